"""Chained page hashes: a page's key covers its tokens and, through its parent, the whole prefix."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
from collections.abc import Sequence

from kvbackend.errors import InvalidKV

_MAX_TOKEN = 2**63  # token ids are hashed as little-endian int64


def token_list(token_ids: Sequence[int]) -> list[int]:
    """``token_ids`` as Python ints, every one checked before any is used (a request's chain of page keys
    must never record part of a bad list).

    Raises:
        InvalidKV: an id that is not an integer in 0..2^63-1.
    """
    if isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__iter__"):
        raise InvalidKV(f"token ids must be a sequence of integers, got {type(token_ids).__name__}")
    out = []
    for t in token_ids:
        if isinstance(t, (bool, float)) or not isinstance(t, (int, np.integer)) or not 0 <= int(t) < _MAX_TOKEN:
            raise InvalidKV(f"token ids must be integers in 0..2^63-1, got {t!r}")
        out.append(int(t))
    return out


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian int64 bytes: what page hashes cover and collision checks compare."""
    return np.asarray(token_ids, dtype="<i8").tobytes()


def hash_page(parent: int | None, token_ids: Sequence[int] | bytes, extra_keys: tuple = ()) -> int:
    """hash(parent, token ids, extra keys) as a 63-bit int, stable across processes and machines.

    ``token_ids`` may be given as `token_bytes` already. Extra keys (adapter ids, cache salts,
    multimodal hashes) separate caches that share tokens.
    """
    h = hashlib.sha256()
    h.update(b"\x00" if parent is None else struct.pack("<Q", parent))
    h.update(token_ids if isinstance(token_ids, bytes) else token_bytes(token_ids))
    if extra_keys:
        h.update(repr(tuple(extra_keys)).encode())
    return int.from_bytes(h.digest()[:8], "little") >> 1
