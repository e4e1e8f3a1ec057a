"""Bridges from CMF files to other serving stacks (each imports its stack lazily)."""
