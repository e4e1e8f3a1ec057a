"""Resident memory: give back pages the process no longer needs, so RSS is the model's working set.

Three kinds, all ``madvise(MADV_DONTNEED)`` on read-only file mappings (the data stays in the page
cache and a later read faults the same bytes back in — correct, only slower; anonymous memory is
never touched, since there it would be zeroed):

- **Repacked 4-bit sources.** The 4-bit kernels copy each 64-row tile into a vectorizable layout
  the first time a product needs it (kernels/q4.py) and from then on read only the copy (rows
  past the last whole tile excepted). The mapped source pages they read while packing would stay
  resident: a 4-bit model would hold its weights twice (measured: 108 MiB file, ~200 MiB
  resident). :class:`PackedSourceReleaser` drops the source rows of packed tiles layer by layer,
  so the peak exceeds the final figure by about one layer.
- **Looked-up embedding rows** (:func:`release_pages`). A lookup faults in one row, but the
  kernel maps the cached pages around a fault too (64 KiB): 512 prompt tokens left ~25 MiB of a
  65 MiB f16 embedding resident.
- **The compiler's code** (:func:`release_compiler_pages`). numba's LLVM (``libllvmlite.so``) is
  executed to initialise and to load each cached kernel, then not again: ~68 MB of its pages
  stayed resident for the life of a process, 40% of the runtime's own footprint. Only mappings
  that are not writable and hold no private (copy-on-write) page qualify — code and read-only
  data — so what faults back in is byte-identical.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import sys
import threading
import weakref

import numpy as np

from .plan import plan_names

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE


_libc = None


def _madvise_dontneed(start: int, length: int) -> bool:
    """``madvise(start, length, MADV_DONTNEED)`` through libc; False where that is unavailable."""
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        return _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), mmap.MADV_DONTNEED) == 0
    except (OSError, AttributeError):  # pragma: no cover - no libc madvise: memory stays resident
        return False


def _whole_pages(addr: int, length: int) -> tuple[int, int]:
    """[start, end) of the whole pages inside [addr, addr + length) (end <= start: none)."""
    return -(-addr // PAGE) * PAGE, (addr + length) // PAGE * PAGE


def _ranges(op) -> list[tuple[np.ndarray, int]]:  # noqa: ANN001 - a kernels.tiled.TiledLinear
    """(source array, bytes per row) of each repacked per-row source of ``op``."""
    out = []
    for a in (op.src, op.scs, op.cs, op.params):
        if a.ndim >= 2 and a.shape[0] == op.out_features and a.size:
            out.append((a, a.nbytes // a.shape[0]))
    return out


class PackedSourceReleaser:
    """Tracks, per 4-bit LinearOp, which packed tiles' source rows were already released (and
    which q8 matrices, repacked whole for int8 activations, ``kernels/q8i.py``)."""

    def __init__(self, file) -> None:  # noqa: ANN001 - a CmfFile
        # the file's mappings: only bytes inside an open one are ever given back
        self._maps = [(p.u8.ctypes.data, p.u8.size, p.mm) for p in file._parts if getattr(p, "mm", None) is not None]
        self._done: "weakref.WeakKeyDictionary[object, np.ndarray]" = weakref.WeakKeyDictionary()
        self.released = 0  # bytes given back so far

    def release(self, ops) -> int:  # noqa: ANN001 - LinearOps
        """Release the source pages of tiles packed since the last call; returns bytes released."""
        from ..kernels.q4 import R
        from ..kernels.q8 import Q8Linear
        from ..kernels.tiled import TiledLinear

        total = 0
        for op in ops:
            if isinstance(op, Q8Linear):  # int8 activations: the whole matrix repacked at once
                if op._blocks is not None and op not in self._done:
                    self._done[op] = np.ones(1, bool)
                    total += self._drop(op.q.ctypes.data, op.q.nbytes)
                continue
            op = getattr(op, "tiled", op)  # q1t: the tiles inside its Q1Linear
            if not isinstance(op, TiledLinear) or not op.ntiles:
                continue
            done = self._done.get(op)
            if done is None:
                done = self._done[op] = np.zeros(op.ntiles, bool)
            new = np.flatnonzero((op.ready != 0) & ~done)
            if new.size == 0:
                continue
            done[new] = True
            # runs of consecutive newly packed tiles
            cuts = np.flatnonzero(np.diff(new) != 1) + 1
            for run in np.split(new, cuts):
                r0, r1 = int(run[0]) * R, (int(run[-1]) + 1) * R
                for arr, per_row in _ranges(op):
                    total += self._drop(arr.ctypes.data + r0 * per_row, (r1 - r0) * per_row)
        self.released += total
        return total

    def _drop(self, addr: int, length: int) -> int:
        if not any(base <= addr < base + size and not mm.closed for base, size, mm in self._maps):
            return 0
        start, end = _whole_pages(addr, length)
        return end - start if end > start and _madvise_dontneed(start, end - start) else 0


def _mapped(a: np.ndarray) -> bool:
    """Whether ``a`` is a view into an ``mmap`` (never madvise anonymous memory: it would be zeroed)."""
    base = a
    while isinstance(base, np.ndarray) or isinstance(base, memoryview):
        base = base.base if isinstance(base, np.ndarray) else base.obj
    return isinstance(base, mmap.mmap)


def release_pages(view: np.ndarray) -> None:
    """Drop this process's mapping of the whole pages inside ``view`` (a read-only file mapping):
    resident memory falls, the data stays in the page cache and faults back in if read again.
    A view that is not into an ``mmap`` is left alone."""
    if not sys.platform.startswith("linux") or view.nbytes < PAGE or not _mapped(view):
        return
    start, end = _whole_pages(view.ctypes.data, view.nbytes)
    if end > start:
        _madvise_dontneed(start, end - start)


COMPILER_LIBRARIES = ("libllvmlite",)  # file names (prefixes) of the compiler's shared objects


def idle_code_ranges(smaps: str, libraries: tuple[str, ...] = COMPILER_LIBRARIES) -> list[tuple[int, int]]:
    """[start, end) of each mapping in ``smaps`` (the text of ``/proc/<pid>/smaps``) of one of
    ``libraries`` that can be dropped and faulted back unchanged: not writable, and without a
    private page (``Anonymous: 0 kB``; relocated read-only data after RELRO has some, and is kept)."""
    out: list[tuple[int, int]] = []
    cur = None  # (start, end) of the library mapping whose fields are being read
    for line in smaps.splitlines():
        head = line.split(None, 5)
        if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):  # a mapping's header
            cur = None
            path = head[5] if len(head) == 6 else ""
            name = path.rsplit("/", 1)[-1]
            if "w" not in head[1] and name.startswith(libraries):
                lo, hi = head[0].split("-")
                cur = (int(lo, 16), int(hi, 16))
        elif cur is not None and line.startswith("Anonymous:"):
            if int(line.split()[1]) == 0:
                out.append(cur)
            cur = None
    return out


_code = {"ranges": None}
_code_lock = threading.Lock()


def release_compiler_pages() -> None:
    """Drop this process's resident pages of the compiler's code and read-only data (numba's
    LLVM): executed while kernels compile or load from the cache, idle afterwards. The ranges are
    found once per process (one read of ``/proc/self/smaps``, ~10 ms); a call then costs ~10 µs.
    A later compilation faults the pages it needs back in from the page cache."""
    ranges = _code["ranges"]
    if ranges is None:
        with _code_lock:
            ranges = _code["ranges"]
            if ranges is None:
                try:
                    with open("/proc/self/smaps", encoding="ascii", errors="replace") as fh:
                        ranges = idle_code_ranges(fh.read())
                except OSError:  # no procfs (not Linux, or a sandbox): nothing to release
                    ranges = []
                log.debug("compiler code pages: %d mappings, %.0f MB of address space", len(ranges),
                          sum(hi - lo for lo, hi in ranges) / 1e6)
                _code["ranges"] = ranges
    for lo, hi in ranges:
        _madvise_dontneed(lo, hi - lo)


# Decode looks up one embedding row a token; its pages (and the kernel's fault-around neighbours)
# are given back every this many forwards, so a long generation does not map the whole table.
EMBED_RELEASE_EVERY = 64


class ModelMemory:
    """The Model's side of the above (a mixin of runtime.model.Model): which pages to give back
    when. Expects ``file``, ``plan``, ``weights``, ``_lm_head`` and ``_forwards`` on the model."""

    def _init_release(self) -> None:
        self._forwards = 0
        self._decodes = self._prefills = self._longest_prefill = 0  # see _count_forward
        self._new_blocks = False  # set by Model._make_block: the next forward is watched
        self._releaser = PackedSourceReleaser(self.file)
        self._names_memo: dict[int, tuple[object, frozenset[str]]] = {}  # see _layer_names

    def _embed_release_view(self) -> "np.ndarray | None":
        """The embedding's mapped bytes, given back after lookups (:func:`release_pages`) unless a
        head reads the whole matrix every token (tied weights)."""
        plan, w = self.plan, self.weights
        heads = {plan.lm_head} | ({plan.mtp.lm_head} if plan.mtp is not None else set())
        return None if plan.embed in heads or plan.embed in w._mixed else w.qtensor(plan.embed).numpy()

    def _count_forward(self, t: int) -> bool:
        """Count a forward of ``t`` tokens and give back looked-up embedding pages; whether this
        forward gives back layer pages too (:meth:`_give_back`): decode forwards 1, 2, 4, 8, ...
        and prefills 1, 2, 4, 8, ... or longer than any before (tiles are packed once, at a
        matrix's first product; kernels load from numba's cache at a layer's first call of a path,
        and a longer block may take one the shorter did not), and the first forward after a layer
        was (re)built (a skill or task switch: new matrices to pack). Every prefill used to be
        watched: ~1.4 ms of a 30-token prefill of SmolLM2-135M, a server's every prompt."""
        self._forwards += 1
        fresh, self._new_blocks = self._new_blocks, False
        if self._embed_pages is not None and (t > 1 or self._forwards % EMBED_RELEASE_EVERY == 0):
            release_pages(self._embed_pages)
        if t == 1:
            self._decodes = n = self._decodes + 1
            return fresh or not n & (n - 1)
        self._prefills = n = self._prefills + 1
        longest = self._longest_prefill
        self._longest_prefill = max(longest, t)
        return fresh or t > longest or not n & (n - 1)

    def _give_back(self, i: int) -> None:
        """After layer ``i``: drop the mapped sources of its newly packed tiles, and LLVM's pages
        (touched if the layer loaded kernels) before the next layer's weights come in."""
        lin = self.weights._linears
        self._releaser.release([lin[n] for n in self._layer_names(i) if n in lin])
        release_compiler_pages()

    def _layer_names(self, i: int) -> frozenset[str]:
        """plan_names of layer ``i``'s plan, kept while that plan object stays (walking the nested
        plan took ~50 µs a layer, 1.6 ms of every prefill forward of SmolLM2)."""
        lp = self.plan.layers[i]
        hit = self._names_memo.get(i)
        if hit is None or hit[0] is not lp:
            hit = self._names_memo[i] = (lp, frozenset(plan_names(lp)))
        return hit[1]

    def _give_back_head(self) -> None:
        """After the layers of a watched forward: the lm_head's packed sources."""
        self._releaser.release([self._lm_head])
