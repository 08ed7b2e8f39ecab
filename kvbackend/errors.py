"""The named errors kvbackend raises. Each message states the numbers involved."""

from __future__ import annotations


class KVBackendError(Exception):
    """Base class of every error raised on purpose by kvbackend."""


class SpecError(KVBackendError, ValueError):
    """A codec spec string names an unknown codec or option, or an option has a bad value."""


class InvalidKV(KVBackendError, ValueError):
    """K/V tensors with the wrong shape, dtype or device, or non-finite values."""


class CacheFull(KVBackendError, RuntimeError):
    """The page pool cannot satisfy an allocation; nothing was allocated."""

    def __init__(self, kind: str, requested: int, free: int, hint: str = "") -> None:
        message = f"{kind} pool is full: requested {requested} pages, {free} free or evictable"
        super().__init__(f"{message}: {hint}" if hint else message)
        self.kind = kind
        self.requested = requested
        self.free = free


class UnknownRequest(KVBackendError, KeyError):
    """A request id that was never admitted or was already freed."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "unknown request"


class UnsupportedLayout(KVBackendError, ValueError):
    """No kernel reads this codec's page layout (the torch reference still serves it)."""


class CorruptStream(KVBackendError, ValueError):
    """Stored bytes (an AlignPred stream, a persisted page group) that are truncated, damaged or of another
    format; nothing is decoded from them, and a tier counts them as a miss."""
