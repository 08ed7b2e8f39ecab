"""The prefix index: which packed pages hold which token prefixes.

A full page of known tokens is published under a chained key, ``hash(parent key, token ids, extra
keys)`` (`kvbackend.hashing`), so a key names the whole prefix up to the end of its page. A lookup
follows the chain page by page and compares the page's token bytes too, so a hash collision is a
miss, never another prompt's pages. Keys live in the packed pool's allocator (a page keeps its key
while it is in use or cached, and loses it when it is evicted); this index adds the token bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvbackend.allocator import PageAllocator
from kvbackend.hashing import hash_page, token_bytes
from kvbackend.page_table import PageTable


class PrefixIndex:
    def __init__(self, allocator: PageAllocator, page_size: int, extra_keys: tuple = ()) -> None:
        self.allocator = allocator  # the packed pool's: it owns keys, reference counts and the LRU
        self.page_size = page_size
        self.extra_keys = extra_keys  # mixed into every key (adapter ids, cache salts, ...)
        # hashed packed page -> its tokens, for the collision check on a hit; entries of evicted pages
        # are harmless (their key is gone) and are overwritten when the page is hashed again
        self._page_tokens: dict[int, bytes] = {}

    def keys(self, token_ids: Sequence[int]) -> list[int]:
        """Chained keys of the full pages of a prompt that `match` could reuse (never its last token)."""
        raw = token_bytes(token_ids)
        p, keys, parent = self.page_size, [], None
        for start in range(0, max(len(raw) // 8 - 1, 0) // p * p, p):
            parent = hash_page(parent, raw[8 * start : 8 * (start + p)], self.extra_keys)
            keys.append(parent)
        return keys

    def page_keys(self, token_ids: Sequence[int], pages: int) -> list[int]:
        """Chained keys of the first ``pages`` pages of ``token_ids`` (every one full, the last token included:
        pages a restore installs rather than pages a prompt could reuse)."""
        raw, p, keys, parent = token_bytes(token_ids), self.page_size, [], None
        if len(raw) // 8 < pages * p:
            raise ValueError(f"{len(raw) // 8} token ids do not fill {pages} pages of {p}")
        for start in range(0, pages * p, p):
            parent = hash_page(parent, raw[8 * start : 8 * (start + p)], self.extra_keys)
            keys.append(parent)
        return keys

    def match(self, token_ids: Sequence[int]) -> tuple[list[int], int | None]:
        """The resident pages holding the longest prefix of ``token_ids`` (at most all but its last
        token), each with one more reference, and the key of the last of them (None: no page)."""
        raw = token_bytes(token_ids)
        p, pages, parent = self.page_size, [], None
        for start in range(0, max(len(raw) // 8 - 1, 0) // p * p, p):
            page_raw = raw[8 * start : 8 * (start + p)]
            key = hash_page(parent, page_raw, self.extra_keys)
            page = self.allocator.lookup(key)
            if page is None or self._page_tokens.get(page) != page_raw:
                break
            self.allocator.incref(page)
            pages.append(page)
            parent = key
        return pages, parent

    def resident(self, keys: Sequence[int]) -> int:
        """How many of ``keys`` (from the start) have a packed page on the device."""
        n = 0
        for key in keys:
            if self.allocator.lookup(key) is None:
                break
            n += 1
        return n

    def publish(self, table: PageTable, pages: list[int], first_token: int) -> None:
        """Key newly packed pages whose tokens are known, continuing the request's chain."""
        p = self.page_size
        chained = table.last_hash is not None or first_token == 0
        for i, page in enumerate(pages):
            start = first_token + i * p
            tokens = table.token_ids[start : start + p]
            if not chained or len(tokens) < p:
                table.last_hash = None
                return
            raw = token_bytes(tokens)
            key = hash_page(table.last_hash, raw, self.extra_keys)
            if self.allocator.set_hash(page, key):
                self._page_tokens[page] = raw
            table.last_hash = key

    def adopt(self, page: int, key: int, tokens: bytes) -> None:
        """Key a restored page: ``tokens`` are the page's token bytes, from the prompt that asked for it."""
        self.allocator.set_hash(page, key)
        self._page_tokens[page] = tokens
