"""Page ids with reference counts, an O(1) free list and an LRU of cached pages.

A page is in exactly one of three states:
- in use: ref count > 0;
- cached: ref count 0 but hashed, so a later request can reuse it; evicted in LRU order;
- free: ref count 0, unhashed.
All three structures are owned by this class alone.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Callable

from kvbackend.errors import CacheFull


class PageAllocator:
    def __init__(self, num_pages: int, kind: str, on_release: Callable[[int], None] | None = None) -> None:
        self.kind = kind  # used in error messages: "dense", "packed", "codebook"
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._cached: OrderedDict[int, None] = OrderedDict()  # first = least recently freed = evicted first
        self._refs = [0] * num_pages
        self._hash: list[int | None] = [None] * num_pages
        self._by_hash: dict[int, int] = {}
        self._on_release = on_release  # called when a page becomes free (its content is gone)

    # -- capacity ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages that can be handed out now: free plus evictable cached pages."""
        return len(self._free) + len(self._cached)

    def is_cached(self, page: int) -> bool:
        """Whether ``page`` is cached: unreferenced, its content kept for a later hit."""
        return page in self._cached

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    # -- allocation -------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """n pages with ref count 1; free pages first, then cached ones in LRU order.

        Raises:
            CacheFull: fewer than n pages are free or evictable; nothing is allocated.
        """
        if not self.can_allocate(n):
            raise CacheFull(self.kind, n, self.num_free)
        out = []
        for _ in range(n):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._cached.popitem(last=False)
                self._unhash(page)
                if self._on_release is not None:
                    self._on_release(page)
            assert self._refs[page] == 0
            self._refs[page] = 1
            out.append(page)
        return out

    def eviction_order(self, n: int) -> list[int]:
        """The cached pages `allocate(n)` would evict (it takes free pages first), in that order."""
        return list(itertools.islice(self._cached, max(n - len(self._free), 0)))

    def incref(self, page: int) -> None:
        if self._refs[page] == 0:
            assert page in self._cached, f"{self.kind} page {page} is free, not cached: it cannot be shared"
            del self._cached[page]
        self._refs[page] += 1

    def decref(self, page: int) -> None:
        assert self._refs[page] > 0, f"{self.kind} page {page} freed twice"
        self._refs[page] -= 1
        if self._refs[page] == 0:
            if self._hash[page] is not None:
                self._cached[page] = None
            else:
                self._free.append(page)
                if self._on_release is not None:
                    self._on_release(page)

    def cached_pages(self) -> list[int]:
        """Unreferenced hashed pages, least recently freed first (the eviction order)."""
        return list(self._cached)

    def is_cached(self, page: int) -> bool:
        """Whether ``page`` is cached: hashed and unreferenced."""
        return page in self._cached

    def evict_cached(self, page: int) -> None:
        """Turn a cached page into a free one now (its content moved to a lower tier)."""
        assert page in self._cached, f"{self.kind} page {page} is not cached"
        del self._cached[page]
        self._unhash(page)
        self._free.append(page)
        if self._on_release is not None:
            self._on_release(page)

    def ref_count(self, page: int) -> int:
        return self._refs[page]

    # -- hashing ----------------------------------------------------------------------------
    def set_hash(self, page: int, key: int) -> bool:
        """Publish ``page`` under ``key``; False if another page already holds that key."""
        assert self._hash[page] is None, f"{self.kind} page {page} is already hashed"
        if key in self._by_hash:
            return False
        self._hash[page] = key
        self._by_hash[key] = page
        return True

    def lookup(self, key: int) -> int | None:
        return self._by_hash.get(key)

    def page_hash(self, page: int) -> int | None:
        return self._hash[page]

    def _unhash(self, page: int) -> None:
        key = self._hash[page]
        if key is not None:
            del self._by_hash[key]
            self._hash[page] = None

    def check(self) -> None:
        """Assert every invariant (tests and debug mode)."""
        free, cached = set(self._free), set(self._cached)
        assert len(free) == len(self._free), "duplicate page in the free list"
        assert not free & cached, "page both free and cached"
        for page in range(self.num_pages):
            if self._refs[page] > 0:
                assert page not in free and page not in cached, f"page {page} in use and free"
            else:
                assert (page in free) != (page in cached), f"page {page} neither free nor cached"
            assert (page in cached) <= (self._hash[page] is not None), f"cached page {page} has no hash"
        for key, page in self._by_hash.items():
            assert self._hash[page] == key
