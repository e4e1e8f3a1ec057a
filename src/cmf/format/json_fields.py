"""The header's JSON plumbing: strict parsing (no duplicate keys, no NaN/Infinity, no lone
surrogates, bounded depth), canonical serialization, and the typed field checks that
:mod:`.header`'s views are built with (each names the key path of a bad value)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import MISSING, field, fields
from typing import Any, Callable

from .constants import MAX_JSON_DEPTH
from .errors import ParseError

_U32_MAX = 2**32 - 1
_U64_MAX = 2**64 - 1
# A `\uD800`-`\uDFFF` escape: the only way JSON text can smuggle a lone surrogate into a str,
# which would later make serialization (``.encode()``) fail outside the error hierarchy.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")


# ----------------------------------------------------------------------------- JSON plumbing


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")  # NaN/Infinity: serde_json refuses them


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d: dict[str, Any] = {}
    for k, v in pairs:
        if k in d:
            # A duplicate key cannot round-trip through a dict, and readers disagree on which wins.
            raise ValueError(f"duplicate key {k!r}")
        d[k] = v
    return d


def _depth(obj: Any) -> int:
    """Nesting depth of a decoded JSON value, iteratively; stops once past MAX_JSON_DEPTH."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        v, d = stack.pop()
        if d > deepest:
            deepest = d
            if d > MAX_JSON_DEPTH:
                break
        if isinstance(v, dict):
            stack.extend((x, d + 1) for x in v.values() if isinstance(x, (dict, list)))
        elif isinstance(v, list):
            stack.extend((x, d + 1) for x in v if isinstance(x, (dict, list)))
    return deepest


def parse_json(raw: bytes | bytearray | memoryview, what: str) -> Any:
    """Decode strict UTF-8 JSON (no NaN/Infinity, no duplicate keys, no lone surrogates).

    Every failure, including pathological nesting, raises :class:`ParseError` naming ``what``.
    """
    try:
        text = bytes(raw).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ParseError(f"{what}: not valid UTF-8 at byte {e.start}") from None
    try:
        obj = json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_no_duplicates)
    except RecursionError:
        raise ParseError(f"{what}: JSON nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, our hooks, int-digit limits
        raise ParseError(f"{what}: not valid JSON ({e})") from None
    if (text.count("[") + text.count("{")) > MAX_JSON_DEPTH and _depth(obj) > MAX_JSON_DEPTH:
        raise ParseError(f"{what}: JSON nested deeper than {MAX_JSON_DEPTH} levels")
    if _SURROGATE_ESCAPE.search(text):
        try:
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ParseError(f"{what}: JSON string contains a lone UTF-16 surrogate") from None
    return obj


def serialize_header(d: Mapping[str, Any]) -> bytes:
    """Compact, deterministic header bytes (insertion order kept, raw UTF-8, no NaN)."""
    return json.dumps(d, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")


# ----------------------------------------------------------------------------- value checks
# Each check takes (value, path) and returns the typed value or raises ParseError. JSON `true`
# is a Python int, so every numeric check excludes bool explicitly.


def _type_name(v: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(v), "number")


def _bad(path: str, want: str, v: Any) -> ParseError:
    return ParseError(f"header: {path} must be {want}, got {_type_name(v)}")


def _str(v: Any, path: str) -> str:
    if not isinstance(v, str):
        raise _bad(path, "a string", v)
    return v


def _bool(v: Any, path: str) -> bool:
    if not isinstance(v, bool):
        raise _bad(path, "a boolean", v)
    return v


def _uint(limit: int) -> Callable[[Any, str], int]:
    def check(v: Any, path: str) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= limit:
            raise _bad(path, f"an integer in [0, {limit}]", v)
        return v
    return check


_usize = _uint(_U64_MAX)
_u32 = _uint(_U32_MAX)


def _num(v: Any, path: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _bad(path, "a number", v)
    try:
        f = float(v)
    except OverflowError:
        f = math.inf
    if not math.isfinite(f):
        raise ParseError(f"header: {path} is out of the float range")
    return f


def _obj(v: Any, path: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise _bad(path, "an object", v)
    return v


def _any(v: Any, path: str) -> Any:
    return v


def _tuple_of(check: Callable[[Any, str], Any]) -> Callable[[Any, str], tuple[Any, ...]]:
    def run(v: Any, path: str) -> tuple[Any, ...]:
        if not isinstance(v, list):
            raise _bad(path, "an array", v)
        return tuple(check(x, f"{path}[{i}]") for i, x in enumerate(v))
    return run


def _one_of(allowed: tuple[str, ...]) -> Callable[[Any, str], str]:
    def check(v: Any, path: str) -> str:
        if _str(v, path) not in allowed:
            raise ParseError(f"header: {path} = {v!r} is not one of {', '.join(allowed)}")
        return v
    return check


def _f(check: Callable[[Any, str], Any], default: Any = MISSING, key: str | None = None) -> Any:
    """A view field: its check, its default (absent = required) and, if different, its JSON key."""
    return field(default=default, metadata={"check": check, "key": key})


def _raw() -> Any:
    return field(default_factory=dict, repr=False)


def _build(cls: type, d: Any, path: str) -> Any:
    """Validate ``d`` against the view ``cls`` and build it (``raw`` keeps ``d`` itself)."""
    if not isinstance(d, dict):
        raise _bad(path, "an object", d)
    kw: dict[str, Any] = {}
    for f in fields(cls):
        if f.name == "raw":
            continue
        key = f.metadata["key"] or f.name
        required = f.default is MISSING and f.default_factory is MISSING
        if key not in d:
            if required:
                raise ParseError(f"header: {path} is missing required key '{key}'")
            continue
        v = d[key]
        if v is None and not required and f.default is None:
            kw[f.name] = None  # serde `Option`: null is the same as absent
            continue
        kw[f.name] = f.metadata["check"](v, f"{path}.{key}")
    return cls(raw=d, **kw)


def _view(cls: type) -> Callable[[Any, str], Any]:
    return lambda v, path: _build(cls, v, path)
