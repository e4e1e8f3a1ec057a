"""``cmf <verb>``: the command-line interface.

Each verb lives in ``cmf.tools.<module>`` and is imported only when that verb runs, so
``cmf --help`` does not load numpy-heavy code or numba. Exit codes (the public contract):

- 0 success;
- 1 a check found problems (``verify``) or the inputs differ (``diff``);
- 2 a usage error, or a file that cannot be opened; one line ``cmf: error: <message>`` on stderr
  (a traceback only with ``-v``).

stdout carries the product (text or ``--json``); errors, logs and progress go to stderr.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import traceback
from typing import Sequence

from . import __version__
from .tools import UsageError, sanitize

# verb -> (module in cmf.tools, one-line summary). The summaries are repeated by each module's
# add_parser (tests check that they agree) so that `cmf --help` needs no tool import.
VERBS: dict[str, tuple[str, str]] = {
    "info": ("info", "summarize a model: arch, parameters, dtypes by family, sections, skills, masks"),
    "verify": ("verify", "check the whole hash chain and the detached signature, if any"),
    "sign": ("sign", "write a detached Ed25519 signature <model>.sig"),
    "diff": ("diff", "semantic difference of two models (arch, tensors, skills, masks)"),
    "masks": ("masks", "list the task masks: sparsity, quality, layers touched"),
    "compact": ("compact", "rewrite a model tightly (drops dead bytes, joins shards)"),
    "requant": ("requant", "re-encode a model's matrices to another quant (q4t -> q4tp, q8 -> q4tp, ...), or in place"),
    "quant-report": ("quant_report", "bits per weight and error of each quantization on a model's matrices "
                                     "(.cmf or HF folder)"),
    "run": ("run", "generate text from a prompt (streams to stdout; stats on stderr)"),
    "chat": ("chat", "interactive multi-turn chat with the model"),
    "ppl": ("perplexity", "teacher-forced perplexity of a text file"),
    "bench": ("bench", "measure prefill (ppN) and decode (tgN) speed"),
    "convert": ("convert", "convert a Hugging Face checkpoint (folder or hub id) into a .cmf file"),
    "export": ("export", "write a .cmf as a Hugging Face folder (safetensors + config + tokenizer)"),
    "import-gguf": ("import_gguf", "convert a GGUF file (llama, qwen2, qwen3, qwen3moe) into a .cmf file"),
    "imagine-pack": ("imagine_pack", "pack a diffusers text-to-image pipeline folder (Lumina-Image 2.0) into one "
                                     ".cmf file"),
    "imagine": ("imagine", "generate an image from a prompt with a pipeline container (.cmf from imagine-pack)"),
    "serve": ("serve", "serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, ...)"),
    "route-stats": ("route_stats", "count expert selections per MoE layer over a text (JSON for --route-stats, "
                                   "moe-defrag, CMF_MOE_MASK)"),
    "skill": ("skill", "graft, list, remove, export and apply skills (replacement tensors + routing subspace)"),
    "route": ("route", "routing error E per skill for a prompt, and the skill --skill auto would run"),
    "explain": ("explain", "routing plus the first-token distribution under each skill candidate"),
    "mask": ("mask_create", "create a task mask from calibration text, with its held-out quality measured "
                            "(mask create)"),
    "moe-mask": ("moe_mask", "write an expert-field task mask keeping, per MoE layer, the experts that cover "
                             "the routing mass"),
    "moe-defrag": ("moe_defrag", "drop the experts outside the routing cover per MoE layer into a smaller "
                                 "standalone file"),
    "defrag": ("defrag", "bake one task mask's FFN neurons into a smaller standalone file (masked-out neurons "
                         "removed)"),
}

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE = 0, 1, 2


def _verb_of(argv: Sequence[str]) -> str | None:
    """The verb: the first argument that is not a global option (global options take no value)."""
    for a in argv:
        if a == "--":
            return None
        if not a.startswith("-"):
            return a
    return None


class _Parser(argparse.ArgumentParser):
    """argparse with usage errors as one line: ``cmf: error: <message> (see 'cmf X --help')``."""

    def error(self, message: str) -> None:  # type: ignore[override]
        _error(f"{message} (see '{self.prog} --help')")
        raise SystemExit(EXIT_USAGE)


class _Version(argparse.Action):
    """``--version``: pycmf's version, then the kernels' target (numba and LLVM imported only here)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # noqa: ANN001
        from .kernels.sysinfo import summary

        print(f"pycmf {__version__}\nkernels: {sanitize(summary())}")
        parser.exit()


def build_parser(load: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The argument parser; the verbs named in ``load`` get their full options (an import each)."""
    parser = _Parser(
        prog="cmf", description="Tools for CMF v2 model containers.",
        epilog="Run 'cmf <command> --help' for a command's options. Exit status: 0 ok, "
               "1 problems or differences found, 2 usage error or unreadable file.")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="debug logging on stderr and a traceback on errors")
    parser.add_argument("--version", action=_Version, nargs=0,
                        help="show the version and what the CPU kernels are compiled for, and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for verb, (module, summary) in VERBS.items():
        if verb in load:
            p = importlib.import_module(f"cmf.tools.{module}").add_parser(sub)
            # `cmf info -v X` works too; SUPPRESS keeps a global -v when the verb's is absent.
            p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                           help=argparse.SUPPRESS)
        else:
            sub.add_parser(verb, help=summary, add_help=False)
    return parser


class _StderrHandler(logging.StreamHandler):
    """A stream handler that looks up sys.stderr at emit time (works under redirection)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    def emit(self, record: logging.LogRecord) -> None:
        self.setStream(sys.stderr)
        super().emit(record)


def _error(message: str) -> None:
    sys.stderr.write(f"cmf: error: {sanitize(message)}\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``cmf`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    verb = _verb_of(argv)
    parser = build_parser([verb] if verb in VERBS else [])
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help / --version (0) or a usage error (2, message printed)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    if not hasattr(args, "run"):  # the verb was not where _verb_of looks (e.g. after `--`)
        _error(f"put the command first: cmf [-v] {args.command} ... (see 'cmf --help')")
        return EXIT_USAGE

    verbose = bool(args.verbose)
    logger = logging.getLogger("cmf")
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("cmf: %(levelname)s: %(name)s: %(message)s"))
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if verbose else logging.WARNING)
    try:
        return int(args.run(args))
    except KeyboardInterrupt:
        _error("interrupted")
        return 130
    except BrokenPipeError:  # `cmf info X | head`: the reader left; not an error of ours
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return EXIT_OK
    except Exception as exc:  # noqa: BLE001 - the CLI boundary: one line, traceback under -v
        from .format.errors import CmfError

        if verbose:
            traceback.print_exc(file=sys.stderr)
        if isinstance(exc, UsageError):
            _error(str(exc))
        elif isinstance(exc, (CmfError, OSError)):
            _error(_os_message(exc) if isinstance(exc, OSError) and not isinstance(exc, CmfError) else str(exc))
        else:
            _error(f"internal error: {type(exc).__name__}: {exc}"
                   + ("" if verbose else " (run with -v for the traceback)"))
        return EXIT_USAGE
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def _os_message(exc: OSError) -> str:
    """``path: reason`` for an OSError, without Python's ``[Errno N]`` noise."""
    reason = exc.strerror or str(exc)
    name = exc.filename
    return f"{name}: {reason}" if name is not None else reason


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
