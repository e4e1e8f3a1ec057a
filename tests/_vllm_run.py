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
    sp = SamplingParams(temperature=0.0, max_tokens=spec["n"], ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in spec["ids"]]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2))  # warm-up
    t1 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    gen_s = time.perf_counter() - t1
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    params_mb = None
    if spec.get("params"):
        # Bytes of the model's parameters and buffers as vLLM holds them (int8/int4 when kept). Weights
        # a kernel prepacked and dropped from the module (oneDNN W8A8) are not counted here.
        def _size(m) -> int:  # noqa: ANN001 - a torch module
            return sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers()))

        params_mb = llm.apply_model(_size)[0] / 2**20
    return {"tokens": tokens, "params_mb": params_mb, "load_s": load_s, "gen_s": gen_s,
            "tok_s": sum(len(t) for t in tokens) / gen_s if gen_s else 0.0,
            "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "children_maxrss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}


if __name__ == "__main__":
    result = main(json.loads(sys.argv[1]))
    print("RESULT " + json.dumps(result), flush=True)
