"""Host side of the paged KV cache: who owns which page.

Page 0 is the scratch page (see kv_cache.py) and is never handed out. Pages carry reference
counts so that later a page can be shared (prefix caching) and is free only when nobody holds it.
"""

from __future__ import annotations

from collections import deque

from jaxinfer.kv_cache import SCRATCH_PAGE


class OutOfPages(RuntimeError):
    pass


class PageAllocator:
    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page {SCRATCH_PAGE} is scratch), got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(p for p in range(num_pages) if p != SCRATCH_PAGE)
        self._refs = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def retain(self, pages: list[int]) -> None:
        for p in pages:
            assert self._refs[p] > 0, f"page {p} is not allocated"
            self._refs[p] += 1

    def release(self, pages: list[int]) -> None:
        for p in pages:
            assert self._refs[p] > 0, f"page {p} released more often than held"
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)

    def refcount(self, page: int) -> int:
        return self._refs[page]
