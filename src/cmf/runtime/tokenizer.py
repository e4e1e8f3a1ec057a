"""The embedded tokenizer (spec §6) through the `tokenizers` library, with stop ids and streaming decode.

Sources, in order: the file's vocab section, a sidecar ``tokenizer.json`` next to the model, a
byte-level fallback (ids 0..255 are bytes) so a file without a tokenizer still runs on raw ids.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ..format.errors import CmfError

log = logging.getLogger(__name__)


class TokenizerError(CmfError):
    """The tokenizer bundle (the vocab section's or a sidecar tokenizer.json) cannot be loaded."""


def _typed(exc: BaseException, what: str) -> BaseException:
    """The TokenizerError for a failure inside the tokenizers library. Its errors are bare
    ``Exception``s, and a Rust panic (a tokenizer.json the library accepts but cannot run, found
    by fuzzing) arrives as pyo3's ``PanicException``, a BaseException; Ctrl-C and exits pass."""
    if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit, MemoryError)):
        return exc
    return TokenizerError(f"{what}: {type(exc).__name__ if not str(exc) else str(exc)[:200]}")


class Tokenizer:
    """encode/decode plus the ids generation stops on and the chat bundle's special tokens."""

    def __init__(self, backend, *, eos_ids: set[int], bos_id: int | None, source: str) -> None:
        self.backend = backend  # tokenizers.Tokenizer, or None for the byte fallback
        self.eos_ids = set(eos_ids)
        self.bos_id = bos_id
        self.source = source

    # -- ids -------------------------------------------------------------------------------------
    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` applies the tokenizer's post-processor
        (e.g. a llama/gemma BOS), exactly as ``tokenizer(text)`` does in transformers."""
        if self.backend is None:
            return list(text.encode("utf-8"))
        try:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        except BaseException as exc:  # noqa: BLE001 - e.g. a WordLevel model whose unk token is not in its vocab
            raise _typed(exc, f"{self.source} tokenizer cannot encode") from None

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        if self.backend is None:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        try:
            return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        except BaseException as exc:  # noqa: BLE001 - the library's bare Exception (a decoder the file misconfigures)
            raise _typed(exc, f"{self.source} tokenizer cannot decode") from None

    def token_to_id(self, token: str) -> int | None:
        return None if self.backend is None else self.backend.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return None if self.backend is None else self.backend.id_to_token(i)

    @property
    def vocab_size(self) -> int:
        return 256 if self.backend is None else self.backend.get_vocab_size(with_added_tokens=True)

    def stream_decoder(self, *, skip_special_tokens: bool = True) -> "StreamDecoder":
        return StreamDecoder(self, skip_special_tokens)


class StreamDecoder:
    """Incremental detokenization that never emits a broken UTF-8 sequence."""

    def __init__(self, tok: Tokenizer, skip_special_tokens: bool) -> None:
        self.tok = tok
        self.skip = skip_special_tokens
        self._pending = bytearray()
        self._stream = None
        if tok.backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        """Text completed by ``token_id`` ("" while a multi-token character is incomplete)."""
        if self._stream is not None:
            try:
                out = self._stream.step(self.tok.backend, int(token_id))
            except BaseException as exc:  # noqa: BLE001 - as in Tokenizer.decode
                raise _typed(exc, f"{self.tok.source} tokenizer cannot decode") from None
            return out or ""
        if token_id < 256:
            self._pending.append(token_id)
        try:
            text = self._pending.decode("utf-8")
        except UnicodeDecodeError as exc:
            if exc.reason == "unexpected end of data":
                return ""
            text = self._pending.decode("utf-8", errors="replace")
        self._pending.clear()
        return text


def _special_ids(backend, names: tuple[str, ...]) -> set[int]:
    out = set()
    for n in names:
        i = backend.token_to_id(n)
        if i is not None:
            out.add(i)
    return out


def tokenizer_from_json(data: bytes | str, *, bundle=None, source: str = "embedded") -> Tokenizer:
    """Build the runtime tokenizer from tokenizer.json bytes and the header's chat bundle."""
    from tokenizers import Tokenizer as HFTokenizer

    try:
        text = bytes(data).decode("utf-8") if isinstance(data, (bytes, bytearray, memoryview)) else data
    except UnicodeDecodeError as exc:
        raise TokenizerError(f"{source} tokenizer.json is not UTF-8 (byte {exc.start})") from None
    try:
        backend = HFTokenizer.from_str(text)
    except BaseException as exc:  # noqa: BLE001 - the tokenizers library raises a bare Exception on bad input
        raise _typed(exc, f"{source} tokenizer.json is not a valid tokenizer") from None
    try:  # one probe: a tokenizer the library builds but cannot run fails here, at load, not mid-request
        backend.encode("a", add_special_tokens=True)
    except BaseException as exc:  # noqa: BLE001 - see _typed
        raise _typed(exc, f"{source} tokenizer.json builds but cannot encode") from None
    eos = set(bundle.eos_token_ids) if bundle is not None and bundle.eos_token_ids else set()
    eos |= _special_ids(backend, ("<|im_end|>", "<|endoftext|>", "</s>", "<eos>", "<|eot_id|>", "<end_of_turn>"))
    bos = bundle.bos_token_id if bundle is not None else None
    if bos is None:
        try:
            post = json.loads(text).get("post_processor") or {}
            single = post.get("single") or []
            first = single[0].get("SpecialToken", {}).get("id") if single else None
            bos = backend.token_to_id(first) if first else None
        except (ValueError, AttributeError, IndexError, KeyError, TypeError):  # any shape but the expected one
            bos = None
    return Tokenizer(backend, eos_ids=eos, bos_id=bos, source=source)


def load_tokenizer(file) -> Tokenizer:
    """The tokenizer of an open CmfFile: embedded → sidecar tokenizer.json → byte fallback."""
    bundle = file.chat_config
    data = file.tokenizer_json
    if data:
        return tokenizer_from_json(data, bundle=bundle, source="embedded")
    sidecar = Path(file.path).with_name("tokenizer.json")
    if sidecar.is_file():
        log.info("%s has no tokenizer section; using sidecar %s", file.path, sidecar)
        return tokenizer_from_json(sidecar.read_bytes(), bundle=bundle, source=str(sidecar))
    log.warning("%s carries no tokenizer and no sidecar tokenizer.json: using raw bytes as ids", file.path)
    eos = set(bundle.eos_token_ids) if bundle is not None and bundle.eos_token_ids else set()
    return Tokenizer(None, eos_ids=eos, bos_id=None, source="bytes")
