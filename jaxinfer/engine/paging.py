"""Host side of the paged KV cache: who owns which page, and which pages hold which prefix.

Page 0 is the scratch page (see kv_cache.py) and is never handed out. Pages carry reference
counts: a page is in use while some sequence holds it. A full page whose tokens are known can be
registered under the hash of its block chain (the hash of the previous block's hash and its own
token ids), so a later sequence with the same prefix takes the page instead of recomputing it
(prefix caching). A registered page that nobody holds stays cached, in least-recently-used order,
until an allocation needs its space.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Sequence

from jaxinfer.model.kv_cache import SCRATCH_PAGE


class OutOfPages(RuntimeError):
    pass


def block_hashes(tokens: Sequence[int], page_size: int, start: int = 0, prev: int | None = None) -> list[int]:
    """Hash chain of the full blocks of `tokens`, from block `start` on (prev: the hash before it)."""
    out = []
    for i in range(start, len(tokens) // page_size):
        prev = hash((prev, tuple(tokens[i * page_size:(i + 1) * page_size])))
        out.append(prev)
    return out


class PageAllocator:
    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page {SCRATCH_PAGE} is scratch), got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(p for p in range(num_pages) if p != SCRATCH_PAGE)
        self._refs = [0] * num_pages
        self._cached: dict[int, int] = {}                      # block hash -> page
        self._hash_of: dict[int, int] = {}                     # page -> block hash
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached pages nobody holds, LRU first
        self.queries = 0                                       # blocks looked up (prefix-cache hit rate)
        self.hits = 0

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        """Pages an allocation can take now: free ones plus cached ones nobody holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_in_use(self) -> int:
        return self.capacity - self.num_free

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfPages(f"asked for {n} pages, {self.num_free} available")
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.popleft()
            else:  # evict the least recently used cached page
                page, _ = self._evictable.popitem(last=False)
                del self._cached[self._hash_of.pop(page)]
            self._refs[page] = 1
            pages.append(page)
        return pages

    def release(self, pages: Sequence[int]) -> None:
        for p in pages:
            assert self._refs[p] > 0, f"page {p} released more often than held"
            self._refs[p] -= 1
            if self._refs[p] == 0:
                if p in self._hash_of:
                    self._evictable[p] = None   # keep its contents for a later prefix hit
                else:
                    self._free.append(p)

    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """Take (and hold) the cached pages of the longest prefix of `hashes` found in the cache."""
        pages = []
        self.queries += len(hashes)
        for h in hashes:
            page = self._cached.get(h)
            if page is None:
                break
            if self._refs[page] == 0:
                del self._evictable[page]
            self._refs[page] += 1
            pages.append(page)
        self.hits += len(pages)
        return pages

    def register(self, page: int, block_hash: int) -> None:
        """Record that a held page now holds the full block with this hash (first writer wins)."""
        assert self._refs[page] > 0, f"page {page} is not held"
        if block_hash in self._cached or page in self._hash_of:
            return
        self._cached[block_hash] = page
        self._hash_of[page] = block_hash

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def check(self) -> None:
        """Invariants (tests): every page is exactly one of scratch, free, evictable or held."""
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free) and not free & evictable and SCRATCH_PAGE not in free | evictable
        for p in range(self.num_pages):
            if p == SCRATCH_PAGE:
                continue
            held = self._refs[p] > 0
            assert held + (p in free) + (p in evictable) == 1, f"page {p}: refs {self._refs[p]}"
            assert (p in evictable) <= (p in self._hash_of)
        assert all(self._cached[h] == p for p, h in self._hash_of.items())
