"""Skills: one file holding ../shared/models/base plus its three domain fine-tunes as skills.

    python benchmarks/skills.py [--models ../shared/models] [--layers 1-3] [--tensors ffn]
                                [--max-windows 40] [--rank 2] [--quant f32]

Builds the swarm with ``cmf skill add`` (the first skill into a new file, the others appended in
place), each skill = the donor's ``--tensors`` of ``--layers``, routing fitted on the domain's
calibration text (``texts/*-calib.txt``: 64 sentences of 40-240 characters), quality measured on
the held-out text. Then:

- held-out perplexity per domain (README protocol: 257-token windows, positions 1..256 scored)
  for the backbone, each skill, ``--skill auto`` (each window routed on its first 128 tokens) and
  ``--blend auto``, with the full donors as the reference;
- routing accuracy on ``texts/*-prompts.txt`` (24 held-out prompts per domain), never fitted on;
- file size of the swarm vs three separate full models;
- resident memory of the model file's mapping in a fresh process after one 257-token forward (the
  file pages it touched, from /proc/self/smaps) and the process RSS, with the backbone vs one skill
  active; the time of a skill switch.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, table  # noqa: E402

import cmf  # noqa: E402
from cmf.convert import convert  # noqa: E402
from cmf.tools._skill_graft import add_skill  # noqa: E402
from cmf.tools.perplexity import encode_text, perplexity  # noqa: E402

DOMAINS = ("rust", "man", "py")
WINDOW = 257

_RSS_PROBE = """
import json, sys, numpy as np, cmf
from cmf.tools.perplexity import encode_text
path, skill, text = sys.argv[1], sys.argv[2], sys.argv[3]
m = cmf.load(path, skill=None if skill == "-" else skill)
ids = encode_text(m.tokenizer, open(text, encoding="utf-8").read())[:257]
m.logits(ids)
st = {k: int(v.split()[0]) for k, v in (l.split(":", 1) for l in open("/proc/self/status")) if k == "VmRSS"}
# resident KiB of the model file's own mapping (smaps: the pages of this file the process touched)
mine, st["model"] = False, 0
for line in open("/proc/self/smaps"):
    head = line.split()
    if head and "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
        mine = line.rstrip().endswith(path)
    elif mine and line.startswith("Rss:"):
        st["model"] += int(head[1])
print(json.dumps(st))
"""


def calib_prompts(path: Path, n: int = 64) -> list[str]:
    """Prompt-shaped pieces of a calibration text: sentences of 40-240 characters, mostly letters
    (the held-out prompts are single sentences), shuffled with a fixed seed, the first ``n``."""
    text = " ".join(path.read_text(encoding="utf-8").split())
    sents = [x for x in re.split(r"(?<=[.!?])\s+", text)
             if 40 <= len(x) <= 240 and sum(c.isalpha() for c in x) > 0.6 * len(x)]
    random.Random(0).shuffle(sents)
    return sents[:n]


def rss(path: Path, skill: str | None, text: Path) -> dict[str, int]:
    out = subprocess.run([sys.executable, "-c", _RSS_PROBE, str(path), skill or "-", str(text)],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=str(Path(__file__).resolve().parents[2] / "shared" / "models"))
    ap.add_argument("--layers", default="1-3")
    ap.add_argument("--tensors", default="ffn", choices=("ffn", "attn", "all"))
    ap.add_argument("--max-windows", type=int, default=40, help="windows per held-out text (0 = all)")
    ap.add_argument("--rank", type=int, default=2)
    ap.add_argument("--quant", default="f32", help="dtype of the base and the skills")
    args = ap.parse_args()
    root = Path(args.models)
    if not (root / "base").is_dir():
        sys.exit(f"{root / 'base'} not found: this benchmark needs ../shared/models")
    texts = root / "texts"
    t0 = time.time()
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        base = d / "base.cmf"
        convert(root / "base", base, quant=args.quant)
        donors = {}
        for dom in DOMAINS:
            donors[dom] = d / f"donor-{dom}.cmf"
            convert(root / f"donor-{dom}", donors[dom], quant=args.quant)
        swarm = d / "swarm.cmf"
        build = {}
        for i, dom in enumerate(DOMAINS):
            ts = time.time()
            rep = add_skill(base if i == 0 else swarm, donors[dom], dom, name=f"{dom} domain", layers=args.layers,
                            tensors=args.tensors, prompts=calib_prompts(texts / f"{dom}-calib.txt"), rank=args.rank,
                            quality=texts / f"{dom}-heldout.txt", output=swarm if i == 0 else None, in_place=i > 0)
            build[dom] = (rep, time.time() - ts)
            print(f"skill {dom}: {len(rep['tensors'])} tensors, {rep['bytes'] / 2**20:.2f} MiB, "
                  f"{build[dom][1]:.1f} s", file=sys.stderr, flush=True)

        # -- perplexity table
        configs = [("backbone", {}), *[(f"skill {s}", {"skill": s}) for s in DOMAINS],
                   ("--skill auto", {"skill": "auto"}), ("--blend auto", {"blend": "auto"})]
        ppl: dict[str, dict[str, float]] = {}
        routes: dict[str, dict[str, dict]] = {}
        ids_of: dict[str, list[int]] = {}
        with cmf.load(swarm) as m:
            for dom in DOMAINS:
                ids_of[dom] = encode_text(m.tokenizer, (texts / f"{dom}-heldout.txt").read_text(encoding="utf-8"))
            for label, sel in configs:
                m.select(**sel) if sel else m.select(skill=None)
                ppl[label], routes[label] = {}, {}
                for dom in DOMAINS:
                    n = len(ids_of[dom]) // WINDOW
                    n = n if not args.max_windows else min(n, args.max_windows)
                    r = perplexity(m, ids_of[dom], WINDOW, n)
                    ppl[label][dom] = r["ppl"]
                    routes[label][dom] = r.get("routes")
                print(f"{label}: " + ", ".join(f"{k} {v:.3f}" for k, v in ppl[label].items()), file=sys.stderr,
                      flush=True)
            # -- routing accuracy on the held-out prompts
            confusion = {dom: {s: 0 for s in DOMAINS} for dom in DOMAINS}
            margins = []
            for dom in DOMAINS:
                for line in (texts / f"{dom}-prompts.txt").read_text(encoding="utf-8").splitlines():
                    if line.strip():
                        r = m.route(line.strip())
                        confusion[dom][r.winner] += 1
                        e = sorted(r.scores.values())
                        margins.append(e[1] / e[0] if e[0] > 0 else float("inf"))
            # -- switch time
            m.select(skill=None)
            tsw = time.perf_counter()
            for _ in range(10):
                for s in DOMAINS:
                    m.select(skill=s)
            switch_ms = (time.perf_counter() - tsw) / 30 * 1e3
        for dom in DOMAINS:
            n = len(ids_of[dom]) // WINDOW
            n = n if not args.max_windows else min(n, args.max_windows)
            with cmf.load(donors[dom]) as m:
                ppl.setdefault("full donor (reference)", {})[dom] = perplexity(m, ids_of[dom], WINDOW, n)["ppl"]
        t_load = time.perf_counter()
        cmf.load(swarm).close()
        load_ms = (time.perf_counter() - t_load) * 1e3
        sizes = {"base": base.stat().st_size, "swarm": swarm.stat().st_size,
                 "donors": sum(p.stat().st_size for p in donors.values())}
        mem = {"backbone": rss(swarm, None, texts / "rust-heldout.txt"),
               "skill rust": rss(swarm, "rust", texts / "rust-heldout.txt"),
               "base file alone": rss(base, None, texts / "rust-heldout.txt")}
        with cmf.open(swarm) as f:
            qual = {s.id: s.quality for s in f.skills}

    # -- report
    wins = "all" if not args.max_windows else f"at most {args.max_windows}"
    built = ", ".join(f"{s}: {len(build[s][0]['tensors'])} tensors, {build[s][0]['bytes'] / 2**20:.2f} MiB"
                      for s in DOMAINS)
    print(f"# skills — {datetime.date.today()} — {machine()}\n")
    print(f"Base ../shared/models/base and its three fine-tunes at {args.quant}; each skill = the donor's "
          f"`--tensors {args.tensors}` of `--layers {args.layers}` "
          f"({built}); "
          f"routing fitted on 64 calibration sentences per domain (rank {args.rank}, phi_layer "
          f"{build['rust'][0]['record']['selection']['phi_layer']}). Held-out perplexity, {WINDOW}-token windows, "
          f"{wins} windows per text; change vs the backbone in parentheses.\n")
    rows = []
    for label in [c[0] for c in configs] + ["full donor (reference)"]:
        r = [label]
        for dom in DOMAINS:
            p = ppl[label][dom]
            r.append(f"{p:.3f}" + ("" if label == "backbone" else f" ({100 * (p / ppl['backbone'][dom] - 1):+.1f}%)"))
        rows.append(r)
    print(table(["model"] + [f"{d} ppl" for d in DOMAINS], rows))
    own = {dom: 100 * (ppl[f"skill {dom}"][dom] / ppl["backbone"][dom] - 1) for dom in DOMAINS}
    print("\nOwn-domain gain of each skill vs the backbone: "
          + ", ".join(f"{dom} {v:+.1f}%" for dom, v in own.items())
          + f" (mean {sum(own.values()) / 3:+.1f}%; the spec's reference point: -24.9%).")
    ar = routes["--skill auto"]
    print("\n`--skill auto` windows routed to (per held-out text): "
          + "; ".join(f"{dom}: " + ", ".join(f"{k} {v}" for k, v in sorted(ar[dom].items())) for dom in DOMAINS))
    print("\nStored quality records (`skill add --quality`, 1024 held-out tokens, 512-token windows): "
          + "; ".join(f"{s}: {q['backbone']} -> {q['overlaid']}" for s, q in qual.items()))
    total = sum(sum(c.values()) for c in confusion.values())
    right = sum(confusion[d][d] for d in DOMAINS)
    print(f"\n### routing on held-out prompts\n\nAccuracy {right}/{total} ({100 * right / total:.1f}%) on "
          f"texts/*-prompts.txt (none used for fitting). Rows: the prompt's domain; columns: the winner. "
          f"Median runner-up/winner error ratio {sorted(margins)[len(margins) // 2]:.2f}.\n")
    print(table(["domain", *DOMAINS], [[d] + [confusion[d][s] for s in DOMAINS] for d in DOMAINS]))
    print("\n### size and memory\n")
    print(table(["what", "MiB"], [
        ["backbone file", f"{sizes['base'] / 2**20:.2f}"],
        ["one file: backbone + 3 skills", f"{sizes['swarm'] / 2**20:.2f}"],
        ["three separate full models", f"{sizes['donors'] / 2**20:.2f}"],
        ["backbone + three full models (4 files)", f"{(sizes['donors'] + sizes['base']) / 2**20:.2f}"]]))
    print(f"\nThe swarm is {100 * sizes['swarm'] / sizes['donors']:.0f}% of three full models.\n")
    print(table(["process (one 257-token forward)", "model file resident MiB", "process RSS MiB"],
                [[k, f"{v['model'] / 1024:.2f}", f"{v['VmRSS'] / 1024:.1f}"] for k, v in mem.items()]))
    print(f"\nSwitching skills on a loaded model: {switch_ms:.2f} ms per switch (only the touched layers are "
          f"re-prepared); loading the swarm: {load_ms:.1f} ms.")
    print(f"\n(total {time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
