"""Prefix cache: the KV caches of finished requests, kept (bounded, LRU) for the prompts that follow.

An entry is the cache of one finished sequence with the tokens it holds, under the selection it
ran with (task mask, skill or blend: a cache computed under one is wrong under another). A new
prompt takes the entry sharing its longest token prefix: when the prompt extends the entry's
whole sequence — the next turn of a chat — the entry's cache is handed over as it is (no copy;
the finished sequence will put back the longer one); when they share only a part — a common
system prompt — that part is copied. Lookup compares the prompt with each entry of its selection
(numpy, microseconds for the few hundred entries a budget holds). A reused prefix changes where
the prompt's prefill chunks start, so logits may differ from a cold run in the last bits.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable

import numpy as np

from ..runtime.batched import can_cut, cache_nbytes, clone_prefix, shrink
from ..runtime.cache import Cache

log = logging.getLogger(__name__)

MIN_REUSE = 4  # shorter common prefixes are not worth a copy


@dataclass
class _Entry:
    key: Hashable
    tokens: np.ndarray  # int64, the positions the cache holds
    cache: Cache
    nbytes: int


class PrefixCache:
    """Finished sequences' caches by selection and token prefix, at most ``capacity`` bytes."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(0, int(capacity))
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._ids = 0
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def _best(self, key: Hashable, tokens: np.ndarray) -> tuple[int | None, int]:
        best, best_n = None, 0
        for eid, e in self._entries.items():
            if e.key != key:
                continue
            n = min(e.tokens.size, tokens.size)
            same = e.tokens[:n] == tokens[:n]
            common = n if same.all() else int(np.argmin(same))
            if common > best_n:
                best, best_n = eid, common
        return best, best_n

    def take(self, key: Hashable, tokens: list[int], limit: int,
             reserve: int = 0) -> tuple[Cache | None, int, bool]:
        """(cache, n, moved): a cache holding the first ``n`` positions of ``tokens`` (``n`` ≤
        ``limit``, the longest prefix an entry shares) with room for ``reserve`` more, and whether
        it is the entry itself (removed from here) rather than a copy; (None, 0, False) on a miss."""
        if not self._entries or limit < MIN_REUSE:
            self.misses += 1
            return None, 0, False
        arr = np.asarray(tokens, dtype=np.int64)
        eid, common = self._best(key, arr)
        n = min(common, limit)
        if eid is None or n < MIN_REUSE:
            self.misses += 1
            return None, 0, False
        e = self._entries[eid]
        moved = n == e.tokens.size == e.cache.pos  # the prompt extends the whole entry: hand it over
        if moved:
            del self._entries[eid]
            self.nbytes -= e.nbytes
            cache = e.cache
        elif can_cut(e.cache, n):
            cache = clone_prefix(e.cache, n, reserve)
            self._entries.move_to_end(eid)
        else:
            self.misses += 1
            return None, 0, False
        self.hits += 1
        self.hit_tokens += n
        return cache, n, moved

    def put(self, key: Hashable, tokens: list[int], cache: Cache) -> None:
        """Keep ``cache`` (holding ``tokens``, as many as its positions) for later prompts; entries
        it extends are dropped (it holds all they hold)."""
        if not self.enabled or cache.pos < MIN_REUSE:
            return
        arr = np.asarray(tokens[:cache.pos], dtype=np.int64)
        for eid in [i for i, e in self._entries.items()
                    if e.key == key and e.tokens.size <= arr.size and np.array_equal(e.tokens, arr[:e.tokens.size])]:
            self.nbytes -= self._entries.pop(eid).nbytes
        shrink(cache)
        size = cache_nbytes(cache)
        if size > self.capacity:
            return
        self._ids += 1
        self._entries[self._ids] = _Entry(key, arr, cache, size)
        self.nbytes += size
        self.evict(self.nbytes - self.capacity)

    def evict(self, nbytes: int) -> int:
        """Drop least recently used entries until ``nbytes`` are freed (or none is left); the bytes freed."""
        freed = 0
        while freed < nbytes and self._entries:
            _, e = self._entries.popitem(last=False)
            self.nbytes -= e.nbytes
            freed += e.nbytes
        return freed

    def clear(self) -> None:
        self.evict(self.nbytes + 1)

    def stats(self) -> dict[str, float]:
        """Entries, megabytes held, hits/misses and the prompt tokens served from the cache."""
        return {"entries": len(self._entries), "mb": round(self.nbytes / 2**20, 1), "capacity_mb":
                round(self.capacity / 2**20, 1), "hits": self.hits, "misses": self.misses,
                "cached_tokens": self.hit_tokens}
