"""Run vLLM once on a folder and print JSON (greedy tokens, timings): a subprocess for the plugin tests.

``python tests/_vllm_run.py '{"model": DIR, "ids": [..], "n": 8, "load_format": "cmf", ...}'``.
A process of its own per engine: vLLM's engine and workers are spawned processes, which need
this ``__main__`` guard, and a fresh process gives each run clean memory figures.
"""

from __future__ import annotations

import json
import resource
import sys
import time


def _vm_rss_mb() -> float | None:
    """This process's resident set now (Linux), MiB."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            return next(int(x.split()[1]) / 1024 for x in fh if x.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None


def main(spec: dict) -> dict:
    """Start ``vllm.LLM`` as ``spec`` says, decode greedily, return tokens and figures."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(model=spec["model"], dtype=spec.get("dtype", "float32"), load_format=spec.get("load_format", "auto"),
              tensor_parallel_size=spec.get("tp", 1), max_model_len=spec.get("max_model_len", 512),
              enforce_eager=True, seed=0)
    if spec.get("extra") is not None:
        kw["model_loader_extra_config"] = spec["extra"]
    t0 = time.perf_counter()
    llm = LLM(**kw)
    load_s = time.perf_counter() - t0
    rss_loaded_mb = _vm_rss_mb()  # held after the load (weights, KV cache, runtime), not the peak
    sp = SamplingParams(temperature=0.0, max_tokens=spec["n"], ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in spec["ids"]]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2))  # warm-up
    t1 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    gen_s = time.perf_counter() - t1
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    if spec.get("probe"):
        from _vllm_probe import schemes  # tests/ is sys.path[0] here and in the engine's processes

        probe = llm.apply_model(schemes)[0]
    else:
        probe = None
    return {"tokens": tokens, "rss_loaded_mb": rss_loaded_mb, "probe": probe, "load_s": load_s, "gen_s": gen_s,
            "tok_s": sum(len(t) for t in tokens) / gen_s if gen_s else 0.0,
            "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "children_maxrss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}


if __name__ == "__main__":
    result = main(json.loads(sys.argv[1]))
    print("RESULT " + json.dumps(result), flush=True)
