"""Grammar-constrained decoding: ``response_format`` (json_object, json_schema), the ``grammar``
parameter, and the grammars of forced tool calls, applied as the Job's token mask each step.

The grammar library is llguidance (measured against xgrammar and outlines-core in
docs/SERVER.md): no dependencies, millisecond compiles (so a schema per request is cheap), JSON
schema, Lark and regex grammars. Its tokenizer info is built from the file's own tokenizer.json
(byte-level BPE included), sized to the model's vocabulary (the logits' width).
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from .errors import RequestError, bad

log = logging.getLogger(__name__)

# A JSON value, any shape: what json_object asks for (an object at the top, as OpenAI's does).
JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}


class GrammarUnavailable(RequestError):
    """llguidance is not installed (the ``server`` extra brings it): the request is refused."""

    def __init__(self, message: str) -> None:
        super().__init__(400, message, code="unsupported_value")


@dataclass
class Constraint:
    """A compiled-and-checked grammar (llguidance's serialized form) and what asked for it."""

    grammar: str
    source: str  # "json_object", "json_schema", "grammar", "tools": for logs and errors


def _lib() -> Any:
    try:
        import llguidance
    except ImportError:  # pragma: no cover - the server extra installs it
        raise GrammarUnavailable("structured output needs llguidance: pip install 'pycmf[server]'") from None
    return llguidance


SAFE_INT = (-(2**53 - 1), 2**53 - 1)  # what every JSON parser (JavaScript included) reads exactly


def bounded(schema: Any) -> Any:
    """``schema`` with every unbounded integer held to ±(2**53 - 1), the range JSON parsers read
    exactly: it keeps a small model from writing digits until its budget runs out."""
    if isinstance(schema, list):
        return [bounded(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in ("const", "enum", "default", "examples") else bounded(v)) for k, v in schema.items()}
    t = out.get("type")
    if t == "integer" or (isinstance(t, list) and "integer" in t):
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = SAFE_INT[0]
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = SAFE_INT[1]
    return out


def json_schema_grammar(schema: Mapping[str, Any], param: str) -> str:
    """The llguidance grammar of a JSON schema; 400 naming ``param`` when it does not compile."""
    L = _lib()
    schema = bounded(schema)
    try:
        # No free whitespace: a small model could otherwise fill its budget with blanks.
        return L.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides={"whitespace_flexible": False})
    except ValueError as exc:
        raise bad(f"'{param}' is not a JSON schema this server can enforce: {str(exc)[:300]}", param,
                  "invalid_schema") from None


def lark_grammar(text: str, param: str) -> str:
    """The llguidance grammar of a Lark grammar text (``%json {...}`` inside allowed)."""
    L = _lib()
    try:
        return L.LLMatcher.grammar_from_lark(text)
    except ValueError as exc:
        raise bad(f"'{param}' does not compile: {str(exc)[:300]}", param, "invalid_grammar") from None


def response_format(rf: Mapping[str, Any] | None) -> Constraint | None:
    """The constraint of a ``response_format`` object (None for text); 400 when malformed."""
    if rf is None:
        return None
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint(json_schema_grammar(JSON_OBJECT_SCHEMA, "response_format"), "json_object")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise bad("'response_format.json_schema' must be an object with a 'schema'",
                      "response_format.json_schema", "invalid_type")
        name = js.get("name")
        if name is not None and not isinstance(name, str):
            raise bad("'response_format.json_schema.name' must be a string", "response_format.json_schema.name",
                      "invalid_type")
        schema = js.get("schema", {"type": "object"})  # OpenAI's default when none is given
        if not isinstance(schema, dict):
            raise bad("'response_format.json_schema.schema' must be an object", "response_format.json_schema.schema",
                      "invalid_type")
        check_schema(schema, "response_format.json_schema.schema")
        return Constraint(json_schema_grammar(schema, "response_format.json_schema.schema"), "json_schema")
    raise bad(f"'response_format.type' must be text, json_object or json_schema; got {str(kind)[:40]!r}",
              "response_format.type", "invalid_value")


def grammar_param(g: Any) -> Constraint | None:
    """The ``grammar`` extension: a Lark string, or ``{"type": "lark" | "regex", "value": ...}``."""
    if g is None:
        return None
    if isinstance(g, str):
        kind, value = "lark", g
    elif isinstance(g, dict) and isinstance(g.get("value"), str):
        kind, value = g.get("type", "lark"), g["value"]
    else:
        raise bad("'grammar' must be a Lark grammar string or {\"type\": \"lark\" | \"regex\", \"value\": ...}",
                  "grammar", "invalid_type")
    if kind == "lark":
        return Constraint(lark_grammar(value, "grammar"), "grammar")
    if kind == "regex":
        L = _lib()
        try:
            return Constraint(L.LLMatcher.grammar_from_regex(value), "grammar")
        except ValueError as exc:
            raise bad(f"'grammar' regex does not compile: {str(exc)[:300]}", "grammar", "invalid_grammar") from None
    raise bad(f"'grammar.type' must be lark or regex, got {str(kind)[:40]!r}", "grammar.type", "invalid_value")


def check_schema(schema: Mapping[str, Any], param: str) -> None:
    """400 when ``schema`` is not a valid JSON schema (draft 2020-12's meta-schema), if jsonschema
    is installed; llguidance's own compile catches the rest."""
    try:
        import jsonschema
    except ImportError:
        return
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise bad(f"'{param}' is not a valid JSON schema: {exc.message[:300]}", param, "invalid_schema") from None


class Grammars:
    """Per-engine: the llguidance tokenizer (built once, lazily) and token masks for constraints."""

    def __init__(self, tokenizer: Any, vocab: int) -> None:
        self.tokenizer = tokenizer
        self.vocab = int(vocab)
        self._lltok: Any = None
        self._lock = threading.Lock()

    def lltokenizer(self) -> Any:
        """llguidance's tokenizer from the file's tokenizer.json, EOS = the tokenizer's stop ids."""
        with self._lock:
            if self._lltok is None:
                L = _lib()
                backend = self.tokenizer.backend
                if backend is None:
                    raise RequestError(400, "structured output needs a tokenizer.json in the model file; this one "
                                            "has none", code="unsupported_value")
                eos = sorted(self.tokenizer.eos_ids) or None
                self._lltok = L.LLTokenizer(backend.to_str(), n_vocab=self.vocab, eos_token=eos)
            return self._lltok

    def mask(self, c: Constraint) -> "GrammarMask":
        """A fresh token mask (one per job: it holds the parse state)."""
        L = _lib()
        m = L.LLMatcher(self.lltokenizer(), c.grammar)
        err = m.get_error()
        if err:
            raise bad(f"the {c.source} grammar is not usable: {err[:300]}", c.source, "invalid_grammar")
        return GrammarMask(m, self.vocab, sorted(self.tokenizer.eos_ids))


class GrammarMask:
    """The Job token mask of one constrained answer: consumes the tokens generated since the last
    call, then returns the allowed next tokens (EOS only once the grammar is complete)."""

    def __init__(self, matcher: Any, vocab: int, eos: Sequence[int]) -> None:
        import llguidance.numpy as LN

        self.m = matcher
        self.vocab = vocab
        self.eos = list(eos)
        self.fed = 0
        self._bits = LN.allocate_token_bitmask(1, vocab)
        self._fill = LN.fill_next_token_bitmask

    def __call__(self, generated: Sequence[int]) -> np.ndarray:
        for tid in generated[self.fed:]:
            if not self.m.consume_token(int(tid)):
                log.debug("grammar refused token %d: %s", tid, self.m.get_error())
        self.fed = len(generated)
        if self.m.is_error() or self.m.is_stopped():
            return self._only_eos()
        self._fill(self.m, self._bits)
        allowed = np.unpackbits(self._bits[0].view(np.uint8), bitorder="little")[:self.vocab].astype(bool)
        if not allowed.any():  # nothing fits (should not happen): end rather than fail the request
            return self._only_eos()
        return allowed

    def _only_eos(self) -> np.ndarray:
        out = np.zeros(self.vocab, dtype=bool)
        out[[e for e in self.eos if e < self.vocab]] = True
        return out
