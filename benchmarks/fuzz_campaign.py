"""Coverage-guided fuzz campaign over every harness of benchmarks/fuzz/harnesses.py (issue 28).

    python benchmarks/fuzz_campaign.py --seconds 600 [--harness reader,codecs,...] [--out DIR]
                                       [--nice 19] [--json] [--write]

``--seconds`` is the whole campaign's budget, split evenly over the harnesses; each runs in its
own process under atheris/libFuzzer (``pip install 'pycmf[fuzz]'``), one core, niced. Seed
corpora are written by the project's own writers into ``DIR/corpus/NAME`` (kept: a later
campaign with the same ``--out`` continues from the grown corpus). An input that raises
anything but the surface's typed refusal, runs past ``-timeout`` or crashes the process is saved
under ``DIR/crashes``, then minimised (``-minimize_crash``, 30 s). Reported per harness:
executions, exec/s, coverage (libFuzzer's ``cov`` edges and ``ft`` features), corpus size and
findings. ``--write`` appends the figures to benchmarks/RESULTS.md (``## fuzz (coverage-guided)``).
Exit status 1 when any harness had a finding.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import append_entry, machine, table  # noqa: E402

RUN_ONE = HERE / "fuzz" / "run_one.py"
RESULTS = HERE / "RESULTS.md"
HARNESS_NAMES = ("reader", "codecs", "skill", "gguf", "tokenizer", "template", "http", "pipeline", "shards",
                 "gguf_import", "skill_add")
# per-input limits: the template sandbox's own deadline is 5 s, everything else is milliseconds.
# At nice 19 on a loaded 2-core machine an instrumented jinja2 compile of 7 KB (322 ms alone) once
# took over 15 s: the slow harnesses get room for starvation, a real hang still stands out.
TIMEOUTS = {"template": 60, "gguf_import": 30, "skill_add": 30, "shards": 30}
_DONE = re.compile(r"#(\d+)\s+DONE\s+cov: (\d+) ft: (\d+) corp: (\d+)/")
_STATUS = re.compile(r"#(\d+)\s+\w+\s+cov: (\d+) ft: (\d+) corp: (\d+)/")


def _python(nice: int) -> list[str]:
    return (["nice", "-n", str(nice)] if nice else []) + [sys.executable, str(RUN_ONE)]


def run_harness(name: str, seconds: int, out: Path, nice: int) -> dict:
    corpus, crashes = out / "corpus" / name, out / "crashes"
    crashes.mkdir(parents=True, exist_ok=True)
    if not corpus.is_dir() or not any(corpus.iterdir()):
        subprocess.run(_python(0) + [name, "--seeds", str(corpus)], check=True)
    seeds = len(list(corpus.iterdir()))
    before = set(crashes.iterdir())
    cmd = _python(nice) + [name, f"-max_total_time={seconds}", f"-timeout={TIMEOUTS.get(name, 10)}",
                           "-rss_limit_mb=4096", f"-artifact_prefix={crashes}/{name}-", "-print_final_stats=1",
                           str(corpus)]
    proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=seconds + 300)
    log = proc.stderr
    (out / f"{name}.log").write_text(log)
    m = _DONE.findall(log) or _STATUS.findall(log)
    execs, cov, ft, corp = (int(x) for x in m[-1]) if m else (0, 0, 0, 0)
    secs = re.findall(r"Done \d+ runs in (\d+) second", log)
    found = sorted(p for p in set(crashes.iterdir()) - before if not p.name.endswith(".min"))
    findings = []
    for p in found:
        kind = p.name[len(name) + 1:].split("-", 1)[0]  # crash / timeout / oom / leak
        minimised = p.with_name(p.name + ".min")
        subprocess.run(_python(nice) + [name, "-minimize_crash=1", "-max_total_time=30",
                                        f"-exact_artifact_path={minimised}", str(p)],
                       capture_output=True, timeout=120)
        err = [ln for ln in log.splitlines() if "Error" in ln or "Exception" in ln][-1:] or [""]
        findings.append({"kind": kind, "file": str(p), "minimised": str(minimised) if minimised.exists() else None,
                         "bytes": p.stat().st_size, "error": err[0][:200]})
    return {"harness": name, "seconds": int(secs[-1]) if secs else seconds, "executions": execs,
            "exec_per_s": round(execs / max(int(secs[-1]) if secs else seconds, 1)), "cov": cov, "ft": ft,
            "seeds": seeds, "corpus": corp, "findings": findings, "exit": proc.returncode}


def entry(res: list[dict], budget: int, date: str) -> str:
    rows = [[r["harness"], f"{r['seconds']} s", f"{r['executions']:,}", f"{r['exec_per_s']:,}", r["cov"], r["ft"],
             f"{r['seeds']} → {r['corpus']}", len(r["findings"]) or "**0**"] for r in res]
    total = sum(r["executions"] for r in res)
    found = [f for r in res for f in r["findings"]]
    text = (f"### {date} — {machine()}\n\n"
            f"`python benchmarks/fuzz_campaign.py --seconds {budget}` (atheris 3, libFuzzer; one process at a time "
            f"at nice 19 on a 2-core machine shared with other work): **{total:,} executions in all**.\n\n"
            + table(["harness", "time", "executions", "exec/s", "cov (edges)", "ft (features)", "corpus",
                     "findings"], rows) + "\n")
    if found:
        text += "\nFindings:\n\n" + "\n".join(f"- {f['kind']}: {f['error']} ({f['bytes']} bytes)" for f in found) + "\n"
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=int, default=600, help="the whole campaign's budget (default 600)")
    ap.add_argument("--harness", default=",".join(HARNESS_NAMES))
    ap.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "cmf-fuzz")
    ap.add_argument("--nice", type=int, default=19)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args(argv)
    names = [n for n in args.harness.split(",") if n]
    unknown = set(names) - set(HARNESS_NAMES)
    if unknown:
        ap.error(f"unknown harness(es): {', '.join(sorted(unknown))}")
    each = max(5, args.seconds // len(names))
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    res = [run_harness(n, each, args.out, args.nice) for n in names]
    print(json.dumps(res, indent=1) if args.json else entry(res, args.seconds, date))
    if args.write:
        append_entry(RESULTS, "## fuzz (coverage-guided)", entry(res, args.seconds, date),
                     intro="`benchmarks/fuzz_campaign.py`: atheris harnesses of `benchmarks/fuzz/harnesses.py` "
                           "(issue 28); the random-mutation reader fuzzer is under *fuzz_reader* above.")
    return 1 if any(r["findings"] for r in res) else 0


if __name__ == "__main__":
    sys.exit(main())
