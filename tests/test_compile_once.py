"""No pycmf kernel compiles twice for one model: a second signature that differs from the first
only by a literal argument or an array layout is a whole second compilation (seconds each) on the
first run after an install (docs/PERFORMANCE.md, "Cold numba cache"). Slow: it compiles every
kernel of a model from an empty numba cache in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from server_fixtures import tiny_qwen3_cmf

pytestmark = pytest.mark.slow

PROBE = r"""
import json, sys
import numpy as np
from numba.core.registry import CPUDispatcher
from cmf.runtime import load
from cmf.server.engine import Engine
from cmf.server.warmup import warm_up

m = load(sys.argv[1], int8_activations=sys.argv[2] == "int8")
m.forward([0], m.new_cache())
m.forward(list(range(1, 40)), m.new_cache())
e = Engine(m, parallel=4)
warm_up(e)
e.close()
seen, twice = set(), {}
for name, mod in list(sys.modules.items()):
    if not name.startswith("cmf"):
        continue
    for attr, obj in list(vars(mod).items()):
        if isinstance(obj, CPUDispatcher) and id(obj) not in seen:
            seen.add(id(obj))
            if len(obj.signatures) > 1:
                twice[f"{name}.{attr}"] = [[str(t) for t in s] for s in obj.signatures]
print(json.dumps(twice))
"""


def _same_but_literal_or_layout(a: list[str], b: list[str]) -> bool:
    def plain(t: str) -> str:
        if t.startswith("Literal[int]"):
            return "int64"
        if t.startswith("Literal[bool]"):
            return "bool"
        return t.replace(", C)", ", A)").replace(", F)", ", A)")

    return len(a) == len(b) and [plain(t) for t in a] == [plain(t) for t in b]


@pytest.mark.parametrize("quant,acts", [("q4tp", "exact"), ("q4tp", "int8"), ("q8", "int8")])
def test_no_kernel_compiles_twice(tmp_path: Path, quant: str, acts: str) -> None:
    path = tiny_qwen3_cmf(tmp_path, quant)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    out = subprocess.run([sys.executable, "-c", PROBE, str(path), acts], env=env, capture_output=True, text=True,
                         timeout=1200, check=True).stdout
    twice = json.loads(out.strip().splitlines()[-1])
    again = {name: sigs for name, sigs in twice.items()
             if any(_same_but_literal_or_layout(a, b) for i, a in enumerate(sigs) for b in sigs[i + 1:])}
    assert not again, json.dumps(again, indent=1)
