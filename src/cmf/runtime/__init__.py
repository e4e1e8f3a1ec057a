"""The CPU runtime: run models straight from the mapped file."""

from .model import ContextOverflow, Model, load

__all__ = ["ContextOverflow", "Model", "load"]
