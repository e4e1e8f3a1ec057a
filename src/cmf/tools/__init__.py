"""Maintenance tools: one module per ``cmf`` verb.

Each module has a pure function that returns plain data (dicts and lists, JSON-ready), a
``render`` that turns it into text, and the argparse wiring ``add_parser(subparsers)`` /
``run(args) -> int`` that ``cmf.cli`` loads lazily. This package module stays stdlib-only so
that importing it (for :func:`sanitize`) costs nothing.
"""

from __future__ import annotations

import json
import sys
import unicodedata
from typing import Any, Iterable

__all__ = ["UsageError", "sanitize", "fmt_bytes", "fmt_count", "fmt_ranges", "print_json", "table"]


class UsageError(ValueError):
    """A command's arguments or input do not make sense together; the CLI prints the message
    alone (no "internal error", no traceback) and exits with the usage status."""

# Characters that can move the cursor, recolour the terminal or reorder text when printed:
# every Unicode control (C0, DEL, C1), line/paragraph separators and the bidi overrides.
_EXTRA_UNSAFE = (0x2028, 0x2029, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A))
_ESCAPES: dict[int, str] = {}


def _escape_table() -> dict[int, str]:
    if not _ESCAPES:
        for cp in [*range(0x00, 0x20), *range(0x7F, 0xA0), *_EXTRA_UNSAFE]:
            _ESCAPES[cp] = f"\\x{cp:02x}" if cp < 0x100 else f"\\u{cp:04x}"
    return _ESCAPES


def sanitize(text: Any) -> str:
    """``str(text)`` with terminal control characters escaped (``\\x1b``, ``\\u202e``, ...).

    Names and strings read from a file go through this before they reach a terminal, so a
    crafted tensor name cannot clear the screen, fake output lines or reorder text.
    """
    s = str(text)
    if s.isprintable():  # fast path: printable text has no Cc/Cf/Zl/Zp characters
        return s
    out = s.translate(_escape_table())
    # Remaining invisible format characters outside the table (rare): escape them too.
    if not out.isprintable():
        out = "".join(c if c.isprintable() or c == " " or unicodedata.category(c) not in ("Cc", "Cf")
                      else f"\\u{ord(c):04x}" for c in out)
    return out


def fmt_bytes(n: int | float) -> str:
    """Human-readable binary size: ``512 B``, ``40.0 KiB``, ``1.25 GiB``."""
    n = float(n)
    if abs(n) < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024.0
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if abs(n) < 100 else f"{n:.0f} {unit}"
    raise AssertionError("unreachable")  # pragma: no cover


def fmt_count(n: int) -> str:
    """Compact count: ``950``, ``12.3K``, ``1.54M``, ``7.62B``."""
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.3g}{unit}"
    return str(int(n))


def fmt_ranges(values: Iterable[int]) -> str:
    """Sorted integers as compact ranges: ``[0, 1, 2, 5, 7, 8]`` -> ``0-2,5,7-8``; empty -> ``-``."""
    vals = sorted(set(int(v) for v in values))
    if not vals:
        return "-"
    parts = []
    start = prev = vals[0]
    for v in vals[1:] + [None]:  # type: ignore[list-item]
        if v is not None and v == prev + 1:
            prev = v
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return ",".join(parts)


def table(rows: list[list[Any]], header: list[str], right: Iterable[int] = ()) -> str:
    """A plain aligned text table (cells sanitized); ``right`` lists right-aligned columns."""
    cells = [[sanitize(c) for c in header]] + [[sanitize(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    right = set(right)
    lines = []
    for r in cells:
        line = "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
        lines.append(line.rstrip())
    return "\n".join(lines)


def print_json(data: Any) -> None:
    """Write ``data`` as indented JSON to stdout (non-ASCII and controls are \\u-escaped)."""
    sys.stdout.write(json.dumps(data, indent=2, ensure_ascii=True) + "\n")
