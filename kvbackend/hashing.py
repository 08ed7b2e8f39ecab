"""Chained page hashes: a page's key covers its tokens and, through its parent, the whole prefix."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence


def hash_page(parent: int | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> int:
    """hash(parent, token ids, extra keys) as a 63-bit int, stable across processes and machines.

    Extra keys (adapter ids, cache salts, multimodal hashes) separate caches that share tokens.
    """
    h = hashlib.sha256()
    h.update(b"\x00" if parent is None else struct.pack("<Q", parent))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra_keys:
        h.update(repr(tuple(extra_keys)).encode())
    return int.from_bytes(h.digest()[:8], "little") >> 1
