"""When pages move down: water marks on the device's packed pool."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OffloadPolicy:
    """Offload cached (unreferenced) packed pages once the pool is fuller than ``high_water``, down
    to ``low_water``, least recently used first. Referenced pages never move."""

    high_water: float = 0.9  # fraction of packed pages in use or cached that triggers offload
    low_water: float = 0.7  # fraction to offload down to
    interval_s: float = 0.05  # how often the background worker looks
    write_through_to_file: bool = True  # also write offloaded pages to the file tier

    def __post_init__(self) -> None:
        if not 0 < self.low_water <= self.high_water <= 1:
            raise ValueError(f"need 0 < low_water <= high_water <= 1, got {self.low_water}, {self.high_water}")

    def pages_to_offload(self, used: int, cached: int, total: int) -> int:
        """How many cached pages to move down now."""
        occupied = used + cached
        if occupied <= self.high_water * total:
            return 0
        return min(cached, occupied - int(self.low_water * total))
