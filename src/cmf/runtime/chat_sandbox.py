"""The chat template's jinja2 sandbox, with bounds on what a hostile template can cost.

jinja2's ``ImmutableSandboxedEnvironment`` already refuses attribute escapes (``__class__``,
``__globals__``, mutating methods) and caps ``range()`` at 100,000 items. A template comes from
the model file, so it is untrusted input too; on top of the sandbox this environment bounds:

- **size**: templates over ``MAX_TEMPLATE_CHARS`` are refused before compiling;
- **allocation**: ``*``, ``**``, ``+`` and ``~`` are checked before they run (``'x' * 10**10``,
  ``10 ** 10 ** 10``, a string doubled in a loop), and so is every integer argument of a call or
  filter (``'x'.ljust(10**9)``, ``|center(10**9)``);
- **output**: rendering streams and stops past ``max_chars``;
- **time**: a line tracer on the template's own frames stops rendering after ``seconds``
  (nested loops that print nothing never reach the output check).

Every breach raises :class:`TemplateLimit` (a ``jinja2.SecurityError``), which the renderer
reports as a ``ChatTemplateError``.
"""

from __future__ import annotations

import operator
import sys
import time
from typing import Any, Callable

from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

MAX_TEMPLATE_CHARS = 1 << 20  # real templates are 1-30 KB
MAX_VALUE_CHARS = 16 << 20  # one string or list built by an expression
MAX_INT_ARG = 1 << 20  # an integer argument of a call or filter (widths, counts, repeats)
MAX_POW_BITS = 4096  # the result of ``**``
RENDER_SECONDS = 5.0
_TEMPLATE_FILE = "<template>"  # the file name jinja gives code compiled from a string


class TemplateLimit(SecurityError):
    """A chat template went past a size, allocation, output or time bound."""


def _size(v: Any) -> int:
    return len(v) if isinstance(v, (str, bytes, list, tuple)) else 0


def _check_args(args: tuple, kwargs: dict) -> None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_INT_ARG:
            raise TemplateLimit(f"chat template: argument {a} is over the sandbox's {MAX_INT_ARG} limit")


def _bounded_filter(fn: Callable) -> Callable:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        _check_args(args, kwargs)
        return fn(*args, **kwargs)

    for attr in ("jinja_pass_arg",):  # pass_context / pass_environment markers must survive
        if hasattr(fn, attr):
            setattr(wrapped, attr, getattr(fn, attr))
    return wrapped


def concat(parts: tuple) -> str:
    """``a ~ b ~ ...`` with the result's size checked first."""
    strs = [p if isinstance(p, str) else str(p) for p in parts]
    if sum(map(len, strs)) > MAX_VALUE_CHARS:
        raise TemplateLimit(f"chat template: a string over {MAX_VALUE_CHARS} characters")
    return "".join(strs)


class _Generator(CodeGenerator):
    """Compiles ``~`` to the environment's checked concat (jinja's own is a plain str.join)."""

    def visit_Concat(self, node: Any, frame: Any) -> None:
        self.write("environment.cmf_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox plus the allocation bounds above."""

    intercepted_binops = frozenset({"*", "**", "+"})
    code_generator_class = _Generator
    cmf_concat = staticmethod(concat)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.filters = {k: _bounded_filter(v) for k, v in self.filters.items()}

    def call_binop(self, context: Any, operator_name: str, left: Any, right: Any) -> Any:
        if operator_name == "*":
            n = right if _size(left) else left
            if isinstance(n, int) and (_size(left) or _size(right)) * max(n, 0) > MAX_VALUE_CHARS:
                raise TemplateLimit(f"chat template: a value over {MAX_VALUE_CHARS} items")
            return operator.mul(left, right)
        if operator_name == "+":
            if _size(left) + _size(right) > MAX_VALUE_CHARS:
                raise TemplateLimit(f"chat template: a value over {MAX_VALUE_CHARS} items")
            return operator.add(left, right)
        if operator_name == "**":
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and \
                    right * max(abs(left).bit_length(), 1) > MAX_POW_BITS:
                raise TemplateLimit(f"chat template: {left} ** {right} is over {MAX_POW_BITS} bits")
            return operator.pow(left, right)
        return super().call_binop(context, operator_name, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - jinja's spelling
        _check_args(args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)


class _Deadline:
    """A line tracer on template frames only: raises TemplateLimit once ``seconds`` have passed."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds
        self.seconds = seconds
        self.lines = 0

    def global_trace(self, frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename == _TEMPLATE_FILE:
            return self.local_trace
        return None

    def local_trace(self, frame: Any, event: str, arg: Any) -> Any:
        self.lines += 1
        if not self.lines & 255 and time.monotonic() > self.end:
            raise TemplateLimit(f"chat template: rendering took over {self.seconds:g} s")
        return self.local_trace


def render_bounded(template: Any, ctx: dict[str, Any], *, max_chars: int, seconds: float | None = None) -> str:
    """Render a compiled template, streaming, within ``max_chars`` of output and ``seconds``
    (default RENDER_SECONDS)."""
    deadline = _Deadline(RENDER_SECONDS if seconds is None else seconds)
    previous = sys.gettrace()
    sys.settrace(deadline.global_trace)
    try:
        parts: list[str] = []
        total = 0
        for chunk in template.generate(**ctx):
            total += len(chunk)
            if total > max_chars:
                raise TemplateLimit(f"chat template: output over {max_chars} characters")
            parts.append(chunk)
        return "".join(parts)
    finally:
        sys.settrace(previous)
