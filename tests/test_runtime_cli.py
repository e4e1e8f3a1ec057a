"""Smoke tests of the runtime verbs: run, chat, ppl, bench (in-process through cmf.cli.main)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import hf_fixtures as H  # noqa: E402

from cmf.cli import main  # noqa: E402
from cmf.convert import convert  # noqa: E402


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    out = tmp_path_factory.mktemp("rt") / "qwen3.cmf"
    convert(H.fixture("qwen3"), out, quant="q8")
    return str(out)


def test_run_streams_text_and_stats(model_path, capsys):
    assert main(["run", model_path, "-p", "hello model", "-n", "6"]) == 0
    out, err = capsys.readouterr()
    assert out.endswith("\n")
    assert "prompt tokens" in err and "finish: length" in err


def test_run_json_raw_seeded(model_path, capsys):
    args = ["run", model_path, "-p", "tensor weight", "-n", "5", "--raw", "--json", "--temp", "0.8", "-s", "7"]
    assert main(args) == 0
    a = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    b = json.loads(capsys.readouterr().out)
    assert a["text"] == b["text"] and a["generated_tokens"] == 5 and a["finish_reason"] == "length"


def test_run_context_overflow_is_usage_error(model_path, capsys):
    assert main(["run", model_path, "-p", "word " * 50, "-c", "16", "-n", "2"]) == 2
    assert "context limit" in capsys.readouterr().err


def test_chat_multi_turn(model_path, capsys, monkeypatch):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n/system be brief\nagain\n/reset\n/exit\n"))
    assert main(["chat", model_path, "-n", "3"]) == 0
    out, err = capsys.readouterr()
    assert "history cleared" in err
    assert out.count("\n") == 2  # two replies


def test_ppl_prints_final_estimate(model_path, capsys, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("\n\n".join("model tensor weight layer expert token " * 8 for _ in range(12)))
    assert main(["ppl", model_path, "-f", str(text), "--window", "32"]) == 0
    out = capsys.readouterr().out
    assert "Final estimate: PPL = " in out and "+/-" in out
    assert main(["ppl", model_path, "-f", str(text), "--window", "32", "--chunks", "2", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["windows"] == 2 and res["tokens"] == 62 and res["ppl"] > 1


def test_bench_table_and_json(model_path, capsys):
    assert main(["bench", model_path, "-p", "16", "-n", "4", "-r", "2"]) == 0
    out = capsys.readouterr().out
    assert "pp16" in out and "tg4" in out and "±" in out
    from cmf.kernels import int_dot, sysinfo

    assert out.rstrip().splitlines()[-1] == f"kernels: {sysinfo.summary()}"  # after the table, as llama-bench
    assert main(["bench", model_path, "-p", "8", "-n", "2", "-r", "1", "-o", "json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert [r["test"] for r in res["results"]] == ["pp8", "tg2"]
    assert res["kernels"]["dot"] == int_dot.DOT_PATH and res["kernels"]["target"] == sysinfo.info()["target"]


def test_run_accepts_hf_folder_via_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CMF_CACHE", str(tmp_path / "cache"))
    folder = H.fixture("llama")
    assert main(["run", str(folder), "-p", "hi", "-n", "2", "--raw"]) == 0
    cached = list((tmp_path / "cache").glob("*.cmf"))
    assert len(cached) == 1
    capsys.readouterr()
    assert main(["run", str(tmp_path / "missing.cmf"), "-p", "hi"]) == 2
    assert "missing.cmf" in capsys.readouterr().err


def test_bench_compare_runs_peers_in_fresh_processes(model_path, capsys):
    """hf runs on the exported weights; llama.cpp runs when importable, else the table says why."""
    assert main(["bench", model_path, "--compare", "hf,llama.cpp", "-p", "8", "-n", "4", "-r", "1",
                 "-o", "json"]) == 0
    res = json.loads(capsys.readouterr().out)
    engines = [r["engine"] for r in res["rows"]]
    assert engines[:2] == ["pycmf", "hf"]
    assert res["rows"][0]["decode_ratio_to_pycmf"] == 1.0
    assert all(r["decode_tps"] > 0 and r["prefill_tps"] > 0 and r["peak_rss_mb"] > 10 for r in res["rows"])
    from cmf.tools.bench_compare import llama_cpp_missing

    if llama_cpp_missing() is None:
        assert "llama.cpp" in engines
    else:  # not installed, or installed without its library: skipped with the reason
        assert "llama_cpp" in res["skipped"]["llama.cpp"]


def test_bench_compare_int8_engine_only_for_4bit_and_q8(model_path, tmp_path):
    from cmf.tools.bench_compare import prepare_peers

    peers = prepare_peers(Path(model_path), ["pycmf-int8"], tmp_path)
    assert peers["pycmf-int8"] == (model_path, "q8_row, int8 activations")
    f16 = tmp_path / "f16.cmf"
    convert(H.fixture("qwen3"), f16, quant="f16")
    peers = prepare_peers(f16, ["pycmf-int8"], tmp_path)
    assert "4-bit and q8 files only" in peers["pycmf-int8"]  # an f16 file: skipped, with the reason
    q4 = tmp_path / "q4tp.cmf"
    convert(H.fixture("qwen3"), q4, quant="q4tp")
    peers = prepare_peers(q4, ["pycmf-int8"], tmp_path)
    # a q4tp conversion keeps its token table / output head q8_row (the policy's token-table rule)
    assert peers["pycmf-int8"] == (str(q4), "q4tp/q8_row, int8 activations")


def test_bench_compare_pairs_rounds_and_alternates_the_order(model_path, monkeypatch):
    """Ratios are medians of per-round paired ratios; odd rounds run the engines in reverse order."""
    import subprocess

    from cmf.tools import bench_compare

    order, speed = [], {"pycmf": [100.0, 50.0, 100.0], "hf": [110.0, 55.0, 90.0]}  # the host halves in round 2

    def fake_run(cmd, **kw):
        engine = cmd[3]
        order.append(engine)
        tps = speed[engine][sum(e == engine for e in order) - 1]
        out = json.dumps({"decode_tps": tps, "prefill_tps": 2 * tps, "peak_rss_mb": 100.0})
        return subprocess.CompletedProcess(cmd, 0, stdout=out + "\n", stderr="")

    monkeypatch.setattr(bench_compare.subprocess, "run", fake_run)
    monkeypatch.setattr(bench_compare, "prepare_peers",
                        lambda model, engines, d: {e: (str(model), e) for e in engines})
    res = bench_compare.compare(model_path, ["hf"], n_prompt=8, n_gen=4, reps=3)
    assert order == ["pycmf", "hf", "hf", "pycmf", "pycmf", "hf"]
    hf = res["rows"][1]
    assert hf["decode_tps"] == 90.0  # the median of the engine's own runs
    assert hf["decode_ratio_to_pycmf"] == pytest.approx(1.1)  # rounds: 1.1, 1.1, 0.9
    assert hf["decode_ratio_range"] == pytest.approx((0.9, 1.1))
    assert res["rows"][0]["decode_ratio_to_pycmf"] == 1.0
    assert "paired" in bench_compare.render(res)
