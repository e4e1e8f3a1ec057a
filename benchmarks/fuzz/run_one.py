"""Run one harness of harnesses.py under atheris (libFuzzer): ``run_one.py NAME [libFuzzer args]``.

The project's modules are imported under ``atheris.instrument_imports`` so that their Python
branches guide the fuzzer. ``--seeds DIR`` writes the harness's seed corpus into DIR and exits.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # harnesses, and benchmarks/ (fuzz_reader's seed writer)


def jitted_modules() -> list[str]:
    """cmf modules that define numba / llvmlite code: numba compiles a function's bytecode, which
    atheris's instrumentation rewrites into something numba cannot type, so they stay as they are
    (the compiled kernels carry no Python coverage anyway)."""
    src = HERE.parents[1] / "src"
    out = []
    for p in (src / "cmf").rglob("*.py"):
        text = p.read_text(encoding="utf-8", errors="replace")
        if "numba" in text or "njit" in text or "llvmlite" in text:
            mod = ".".join(p.relative_to(src).with_suffix("").parts)
            out.append(mod[: -len(".__init__")] if mod.endswith(".__init__") else mod)
    return out


def main() -> None:
    import atheris

    name = sys.argv[1]
    if len(sys.argv) > 3 and sys.argv[2] == "--seeds":
        from harnesses import HARNESSES

        out = Path(sys.argv[3])
        out.mkdir(parents=True, exist_ok=True)
        work = out.parent / f".{name}-seed-work"
        work.mkdir(exist_ok=True)
        for i, data in enumerate(HARNESSES[name][0](work)):
            (out / f"seed-{i:03d}").write_bytes(data)
        return
    logging.disable(logging.WARNING)  # the surfaces' warnings (a forced skill apply) would flood stderr
    # The template harness also instruments jinja2: its lexer, parser and compiler are where a
    # hostile template's bytes go, and our sandbox alone gives the fuzzer too few edges to follow.
    # Likewise the gguf package for the importer: its reader parses what the scan let through.
    include = ["cmf"] + {"template": ["jinja2"], "gguf_import": ["gguf"]}.get(name, [])
    with atheris.instrument_imports(include=include, exclude=jitted_modules()):
        import cmf  # noqa: F401
        import cmf.convert.gguf_scan  # noqa: F401
        if name == "gguf_import":
            import gguf  # noqa: F401
            import cmf.convert.gguf, cmf.convert.hf  # noqa: F401, E401
        import cmf.runtime.chat  # noqa: F401
        if name == "template":
            import jinja2.compiler, jinja2.lexer, jinja2.parser, jinja2.sandbox  # noqa: F401, E401
        import cmf.runtime.chat_sandbox  # noqa: F401
        import cmf.runtime.tokenizer  # noqa: F401
        import cmf.server.schemas  # noqa: F401
        import cmf.server.structured  # noqa: F401
        import cmf.server.tools_calls  # noqa: F401
        import cmf.tools._skill_file  # noqa: F401
        import cmf.tools._skill_graft  # noqa: F401
        import cmf.tools.verify  # noqa: F401
        import cmf.image.components  # noqa: F401
        import cmf.image.loader  # noqa: F401
        import cmf.quant  # noqa: F401
        import cmf.kernels  # noqa: F401
    from harnesses import HARNESSES

    one = HARNESSES[name][1]
    atheris.Setup([sys.argv[0]] + sys.argv[2:], one)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
