"""The per-request page table: which physical pages hold a request's tokens, in order."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbackend.codecs.base import CodecState


@dataclass
class PageTable:
    """Logical token positions -> pages. Packed pages come first, then the dense active chunk.

    Owned by `KVCache`; engines read it, never write it.
    """

    request_id: int
    num_layers: int
    page_size: int
    token_ids: list[int] = field(default_factory=list)  # known token ids, for page hashes
    packed: list[int] = field(default_factory=list)  # packed page ids, oldest first
    dense: list[int] = field(default_factory=list)  # dense page ids of the active chunk
    lengths: list[int] = field(default_factory=list)  # tokens appended so far, per layer
    states: list[CodecState] = field(default_factory=list)  # codec state per layer
    last_hash: int | None = None  # chained hash of the last packed page, if it was hashed
    retry_packing_at: int = 0  # after a chunk's encode failed: no new attempt before this many tokens
    # bumped whenever pages leave the table (a chunk packed: its dense pages freed), so a plan of the pages
    # before is refused (`KVCache.decode`/`gather`): those pages may hold another request's tokens by then
    version: int = 0
    # the packed pages' ids and codebook slots as int64 arrays, for the version and page count they were made at
    # (`kvbackend.batch.plan_batch`: made once per chunk, not once per decode step)
    plan_arrays: tuple | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.lengths:
            self.lengths = [0] * self.num_layers
        if not self.states:
            self.states = [CodecState() for _ in range(self.num_layers)]

    @property
    def num_packed_tokens(self) -> int:
        return len(self.packed) * self.page_size

    @property
    def num_tokens(self) -> int:
        """Tokens present in every layer."""
        return min(self.lengths)

    def dense_tokens(self, layer: int) -> int:
        return self.lengths[layer] - self.num_packed_tokens
