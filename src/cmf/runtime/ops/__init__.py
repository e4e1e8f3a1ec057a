"""Operators of the decoder, one small module each; all float32 numpy."""
