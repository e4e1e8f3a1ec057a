"""Options shared by the verbs that run a model (run, chat, ppl, bench) and model resolution."""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def add_model_options(p: argparse.ArgumentParser, *, sampling: bool = True, int8_default: bool = False,
                      kv_default: str = "f32") -> None:
    """The model arguments every running command takes (``int8_default``: the command runs int8
    activations unless told otherwise, as ``cmf serve`` does; ``kv_default``: its KV cache type
    when neither --kv-cache nor CMF_KV_CACHE says; its --help says both)."""
    p.add_argument("model", metavar="MODEL", help="a .cmf file, any shard of a set, or a HF folder / hub id")
    p.add_argument("-c", "--ctx-size", type=int, default=None, help="context limit (default: the model's)")
    p.add_argument("-t", "--threads", type=int, default=None, help="worker threads for the kernels")
    p.add_argument("-b", "--batch-size", type=int, default=None,
                   help="prefill chunk size in tokens (default: runtime.model.DEFAULT_BATCH, 256)")
    p.add_argument("--skill", default=None, metavar="ID|none|auto",
                   help="run with a skill's replacement tensors; auto: route the prompt (recon-argmin)")
    p.add_argument("--blend", default=None, metavar="auto|ID:W,...",
                   help="soft blend of skills (weights normalized; none = the backbone); auto: the two "
                        "best-routed skills, w ~ exp(-E/0.4)")
    p.add_argument("--task", default=None, metavar="NAME|none",
                   help="task mask to activate; none: run unmasked (default: the skill's input_mask_task, "
                        "else the file's default_task, else its Fallback-priority mask, else its first)")
    p.add_argument("--verify", action="store_true",
                   help="check every hash of the file before running it (spec §1.2); a mismatch refuses to run")
    p.add_argument("--int8-act", action="store_true", default=None,
                   help="4-bit, q1t and q8 files: int8 activations in decode and prefill (4-bit: one "
                        "int8 piece per value instead of exact mode's three, with VNNI decode ~1.1×, "
                        "prefill ~1.6×, on AVX2 without VNNI decode ~1.2-1.35× ('cmf --version' shows "
                        "which this CPU runs); q8: integer products, batched decode and prefill ~2×; ~1e-2 "
                        "relative error per product, as llama.cpp's Q4_0 / Q8_0; "
                        + ("default on here (--exact-act turns it off)" if int8_default
                           else "default off, or CMF_INT8_ACT=1") + ")")
    p.add_argument("--kv-cache", choices=("f32", "f16"), default=None,
                   help="how the KV cache stores keys and values: f16 halves its memory and the bytes "
                        "each decode step reads (~1e-3 relative rounding, as llama.cpp's and vLLM's "
                        f"caches); default {kv_default} here, or CMF_KV_CACHE")
    if sampling:
        p.add_argument("-n", "--max-tokens", type=int, default=256, help="tokens to generate (-1 = until EOS)")
        p.add_argument("--temp", "--temperature", dest="temp", type=float, default=0.0,
                       help="sampling temperature (0 = greedy, the default)")
        p.add_argument("--top-k", type=int, default=0)
        p.add_argument("--top-p", type=float, default=1.0)
        p.add_argument("--min-p", type=float, default=0.0)
        p.add_argument("--repeat-penalty", type=float, default=1.0)
        p.add_argument("--presence-penalty", type=float, default=0.0)
        p.add_argument("--frequency-penalty", type=float, default=0.0)
        p.add_argument("-s", "--seed", type=int, default=None)
        p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
        p.add_argument("--no-think", action="store_true", help="disable thinking in templates that support it")
        p.add_argument("--system", default=None, help="system prompt")
        p.add_argument("--spec", choices=("auto", "on", "off"), default=None,
                       help="MTP speculative decoding (greedy only; output identical to plain decoding). "
                            "auto (default): when the model has an MTP head, pausing on prompts that do not gain")
        p.add_argument("--speculative", dest="spec", action="store_const", const="on", help="same as --spec on")
        p.add_argument("--draft", type=int, default=3, metavar="N", help="MTP drafts per verify round (default 3)")


def sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    spec = args.spec
    if spec is None:
        # Off while CMF_MOE_STATS counts routing: verify rounds would also count rejected drafts.
        spec = "off" if (args.temp > 0 or os.environ.get("CMF_MOE_STATS")) else "auto"
    return dict(max_tokens=args.max_tokens, temperature=args.temp, top_k=args.top_k, top_p=args.top_p,
                min_p=args.min_p, repetition_penalty=args.repeat_penalty, presence_penalty=args.presence_penalty,
                frequency_penalty=args.frequency_penalty, seed=args.seed, stop=args.stop,
                thinking=False if args.no_think else None, spec=spec, spec_k=args.draft)


def resolve_model(spec: str) -> Path:
    """A .cmf path as given; a HF folder or hub id (``org/name``) is converted once (f16) into a cache.

    The cache is ``$CMF_CACHE`` or ``~/.cache/pycmf``; the file name carries a hash of the source,
    so a second run starts at once.
    """
    p = Path(spec)
    if p.is_file():
        return p
    is_hf_dir = p.is_dir() and (p / "config.json").is_file()
    is_hub_id = not p.exists() and spec.count("/") == 1 and not spec.endswith(".cmf") and not spec.startswith((".", "/"))
    if not (is_hf_dir or is_hub_id):
        raise FileNotFoundError(f"{spec}: not a .cmf file, a Hugging Face model folder or a hub id")
    from ..convert import convert

    cache = Path(os.environ.get("CMF_CACHE") or Path.home() / ".cache" / "pycmf")
    cache.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(str(p.resolve() if is_hf_dir else spec).encode()).hexdigest()[:16]
    out = cache / f"{p.name or 'model'}-{key}-f16.cmf"
    if not out.is_file():
        log.warning("converting %s to %s (f16, once)", spec, out)
        convert(spec, out, quant="f16")
    return out


COMPILE_NOTICE = ("cmf: compiling CPU kernels for this machine and model type: the first use after an install "
                  "or upgrade waits 10-40 s, once (numba caches them for later runs)")
_notice = {"shown": False}


def _print_notice(name: str) -> None:  # noqa: ARG001 - the kernel's name (logged by the library)
    if not _notice["shown"]:
        _notice["shown"] = True
        print(COMPILE_NOTICE, file=sys.stderr, flush=True)


def announce_compiles() -> None:
    """Print :data:`COMPILE_NOTICE` on stderr the first time this process compiles a kernel (a
    numba cache miss): otherwise a first run after installing sits silent for up to a minute."""
    from ..kernels.compiling import on_compile

    on_compile(_print_notice)


def load_model(args: argparse.Namespace):
    """The model of ``args``. ``CMF_MOE_MASK``/``CMF_MOE_MASK_COVER`` restrict its experts (in
    ``load``); with ``CMF_MOE_STATS=path`` its expert selection counts are written to ``path``
    when the process exits (spec §11.1)."""
    from ..runtime.model import load

    announce_compiles()
    blend = getattr(args, "blend", None)
    if blend is not None:
        from ..runtime.routing import parse_blend

        if args.skill not in (None, "none"):
            from ..format.errors import CmfError

            raise CmfError("give --skill or --blend, not both")
        blend = parse_blend(blend)
    source = resolve_model(args.model)
    from ..image.components import refuse_if_pipeline  # light: no torch

    refuse_if_pipeline(source, getattr(args, "command", None) or "run")
    model = load(source, task=args.task, skill=args.skill, threads=args.threads,
                 ctx_size=args.ctx_size, batch_size=args.batch_size, blend=blend,
                 int8_activations=getattr(args, "int8_act", None), verify=getattr(args, "verify", False),
                 kv_cache=getattr(args, "kv_cache", None))
    path = os.environ.get("CMF_MOE_STATS")
    if path and model.moe_layers:
        import atexit

        model.collect_route_stats(True)
        atexit.register(write_route_stats, model, path)
    elif path:
        log.warning("CMF_MOE_STATS is set but the model has no MoE layers; nothing is written")
    return model


def write_route_stats(model, path: str | os.PathLike) -> None:
    """Write the model's expert selection counts as JSON ``{layer: [count per expert]}``."""
    import json

    Path(path).write_text(json.dumps(model.route_stats()) + "\n", encoding="utf-8")
    log.info("expert selection counts written to %s", path)
