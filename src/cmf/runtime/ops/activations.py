"""FFN activations by the header's ``hidden_act`` name."""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

_SQRT_2_OVER_PI = np.float32(math.sqrt(2.0 / math.pi))


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(_SQRT_2_OVER_PI * (x + np.float32(0.044715) * x * x * x)))


def _erf(z: np.ndarray) -> np.ndarray:
    """erf to ~1e-7 absolute (Abramowitz & Stegun 7.1.26 refined in float64); numpy has none."""
    z = z.astype(np.float64)
    s = np.sign(z)
    a = np.abs(z)
    t = 1.0 / (1.0 + 0.5 * a)
    # Numerical Recipes erfc Chebyshev fit: fractional error < 1.2e-7 everywhere.
    poly = -a * a - 1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (
        -0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277))))))))
    return s * (1.0 - t * np.exp(poly))


def gelu_erf(x: np.ndarray) -> np.ndarray:
    return (0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))).astype(np.float32)


def relu(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0)


ACTIVATIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "silu": silu, "swish": silu,
    "gelu_pytorch_tanh": gelu_tanh, "gelu_tanh": gelu_tanh, "gelu_new": gelu_tanh, "gelu_fast": gelu_tanh,
    "gelu": gelu_erf, "relu": relu,
}


def activation(name: str) -> Callable[[np.ndarray], np.ndarray]:
    """The activation called ``name``; ValueError names the unknown one."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported hidden_act {name!r} (known: {', '.join(sorted(ACTIVATIONS))})") from None
