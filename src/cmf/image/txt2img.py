"""Text -> image with a loaded pipeline, and the PNG it is written to.

:func:`generate` runs the diffusers pipeline with a seeded CPU generator and returns the decoded
image as floats in [0, 1] (before any rounding), with per-step times. :func:`to_pixels` rounds
it exactly as diffusers' ``numpy_to_pil`` does, so the PNG's pixels equal diffusers' own
output; :func:`save_png` writes them with the prompt, seed, settings and the model file's
hashes as PNG text chunks, under a temporary name renamed into place.
"""

from __future__ import annotations

import io
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from .. import __version__
from ..format.atomic import apply_output_mode
from .errors import ImageError, MissingDependency

SIZE_MULTIPLE = 16  # Lumina2: VAE scale 8 x patch size 2


@dataclass
class ImageResult:
    """One generated image and how it was made."""

    image: np.ndarray  # H x W x 3 float32 in [0, 1], as the VAE decoded it (after clamping)
    prompt: str
    negative_prompt: str | None
    seed: int
    steps: int
    width: int
    height: int
    cfg: float
    step_seconds: list[float] = field(default_factory=list)  # steps 2..N, one interval each
    first_seconds: float = 0.0  # prompt encoding + step 1
    decode_seconds: float = 0.0  # VAE decode + post-processing
    seconds: float = 0.0

    @property
    def mean_step_seconds(self) -> float:
        """Seconds per denoising step (steps 2..N; step 1 with prompt encoding when N = 1)."""
        per = self.step_seconds
        return sum(per) / len(per) if per else self.first_seconds

    def settings(self) -> dict[str, str]:
        """The generation settings as PNG text-chunk values."""
        out = {"prompt": self.prompt, "seed": str(self.seed), "steps": str(self.steps),
               "size": f"{self.width}x{self.height}", "cfg": f"{self.cfg:g}"}
        if self.negative_prompt:
            out["negative_prompt"] = self.negative_prompt
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"prompt": self.prompt, "seed": self.seed, "steps": self.steps, "width": self.width,
                "height": self.height, "cfg": self.cfg, "seconds": round(self.seconds, 3),
                "first_step_seconds": round(self.first_seconds, 4), "decode_seconds": round(self.decode_seconds, 4),
                "step_seconds": [round(s, 4) for s in self.step_seconds],
                "mean_step_seconds": round(self.mean_step_seconds, 4)}


def parse_size(text: str) -> tuple[int, int]:
    """``"512x768"`` -> (512, 768) = (width, height); :class:`ImageError` otherwise."""
    w, sep, h = text.lower().partition("x")
    try:
        width, height = int(w), int(h)
    except ValueError:
        raise ImageError(f"--size {text!r}: expected WxH, e.g. 512x512") from None
    if not sep or width <= 0 or height <= 0:
        raise ImageError(f"--size {text!r}: expected WxH with positive sides, e.g. 512x512")
    return width, height


def default_size(pipe: Any) -> tuple[int, int]:
    """The pipeline's native size (``sample_size`` latents x the VAE scale)."""
    side = int(pipe.default_sample_size) * int(pipe.vae_scale_factor)
    return side, side


def generate(pipe: Any, prompt: str, *, steps: int = 30, size: tuple[int, int] | None = None, seed: int = 0,
             cfg: float = 4.0, negative_prompt: str | None = None,
             progress: Callable[[int, int], None] | None = None) -> ImageResult:
    """Generate one image; ``progress(step, steps)`` is called after every denoising step."""
    try:
        import torch
    except ImportError:
        raise MissingDependency("generating an image needs torch: pip install 'pycmf[image]'") from None
    if steps < 1:
        raise ImageError(f"--steps {steps}: need at least 1")
    width, height = size or default_size(pipe)
    if width % SIZE_MULTIPLE or height % SIZE_MULTIPLE:
        raise ImageError(f"size {width}x{height}: both sides must be multiples of {SIZE_MULTIPLE}")
    marks: list[float] = []

    def on_step(_pipe: Any, i: int, _t: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        marks.append(time.perf_counter())
        if progress is not None:
            progress(i + 1, steps)
        return kwargs

    t0 = time.perf_counter()
    out = pipe(prompt, negative_prompt=negative_prompt, num_inference_steps=steps, width=width, height=height,
               guidance_scale=cfg, generator=torch.Generator(device="cpu").manual_seed(int(seed)),
               output_type="np", callback_on_step_end=on_step)
    end = time.perf_counter()
    image = np.asarray(out.images[0], dtype=np.float32)
    # Step 1 also holds prompt encoding, so per-step times are the intervals after it.
    per = [b - a for a, b in zip(marks, marks[1:])]
    first = marks[0] - t0 if marks else 0.0
    decode = end - marks[-1] if marks else 0.0
    return ImageResult(image, prompt, negative_prompt, int(seed), steps, width, height, float(cfg),
                       per, first, decode, end - t0)


def to_pixels(image: np.ndarray) -> np.ndarray:
    """uint8 pixels, rounded as diffusers' ``numpy_to_pil`` rounds."""
    return (image * 255).round().astype("uint8")


def png_bytes(result: ImageResult, metadata: Mapping[str, str] | None = None) -> bytes:
    """The PNG file of ``result`` with its settings and ``metadata`` as text chunks."""
    try:
        from PIL import Image, PngImagePlugin
    except ImportError:
        raise MissingDependency("writing a PNG needs pillow: pip install 'pycmf[image]'") from None
    info = PngImagePlugin.PngInfo()
    for k, v in {**result.settings(), **dict(metadata or {}), "software": f"pycmf {__version__}"}.items():
        info.add_itxt(k, str(v))  # iTXt: UTF-8, so any prompt survives
    buf = io.BytesIO()
    Image.fromarray(to_pixels(result.image)).save(buf, format="PNG", pnginfo=info)
    return buf.getvalue()


def save_png(result: ImageResult, path: str | os.PathLike[str], metadata: Mapping[str, str] | None = None) -> Path:
    """Write the PNG to ``path`` (temp file in the same folder, fsync, rename)."""
    target = Path(path)
    if not target.parent.is_dir():
        raise ImageError(f"{target.parent}: output folder does not exist")
    data = png_bytes(result, metadata)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            apply_output_mode(fh.fileno(), target)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target
