"""A function the vLLM runner sends into the engine (``LLM.apply_model``).

In a module of its own so it pickles by reference: from the runner's ``__main__`` vLLM 0.32
refused it ("it's not the same object as __main__._schemes").
"""

from __future__ import annotations

from typing import Any


def schemes(model: Any) -> dict[str, str]:
    """The quantization scheme vLLM chose for each kind of linear layer (class names only)."""
    out: dict[str, str] = {}
    for name, mod in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf.endswith("_proj") and leaf not in out:
            out[leaf] = type(getattr(mod, "scheme", getattr(mod, "quant_method", None))).__name__
    return out
