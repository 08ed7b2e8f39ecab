"""Model geometry and cache configuration: the frozen facts every other part reads."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_KV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class Geometry:
    """Shape of one model's KV cache."""

    num_layers: int  # L: attention layers that keep a cache
    num_kv_heads: int  # H: key/value heads per layer
    head_dim: int  # D: channels per head
    dtype: torch.dtype = torch.bfloat16  # dtype of K/V at the API boundary

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Geometry.{name} must be a positive int, got {value!r}")
        if self.head_dim % 8:
            raise ValueError(f"Geometry.head_dim must be a multiple of 8 for bit packing, got {self.head_dim}")
        if self.dtype not in _KV_DTYPES:
            raise ValueError(f"Geometry.dtype must be one of {_KV_DTYPES}, got {self.dtype}")

    @property
    def values_per_token(self) -> int:
        """K and V values of one token in one layer."""
        return 2 * self.num_kv_heads * self.head_dim


_DEFAULT_CODEC = "qvg"  # `CacheConfig.codec` where none is given


@dataclass(frozen=True)
class CacheConfig:
    """How a `KVCache` lays out and sizes its pools.

    The defaults keep codec metadata small: with 64-token pages and 32-page chunks a chunk holds
    2048 tokens, so a 16-centroid bf16 codebook costs 16 * 16 / 2048 = 0.125 bits per value.
    """

    codec: str = _DEFAULT_CODEC  # codec spec string, parsed by kvbackend.codecs.get
    # one codec spec per layer (e.g. the plan `kvbackend eval` prints for auto:...); empty: `codec` everywhere (a
    # codec other than the default given beside them is refused: one of the two would be ignored)
    layer_codecs: tuple[str, ...] = ()
    page_size: int = 64  # P: tokens per page
    chunk_pages: int = 32  # pages in one chunk; a chunk is encoded once it is full
    dense_pages: int = 256  # capacity of the dense (uncompressed) pool, in pages
    packed_pages: int = 1024  # capacity of the packed pool, in pages
    codebook_slots: int | None = None  # chunk codebook slots; default: one per possible chunk
    device: str = "cpu"
    backend: str = "auto"  # "auto" (Triton kernels on CUDA when they read the layout), "torch" or "triton"
    # reject NaN/Inf in appended K/V and queries (and K/V past `KVCache.kv_limits`): one device read per append, so
    # a decode step waits for the device once per layer. Off, a chunk's K/V are checked when it is encoded (refused
    # there: it stays dense, logged) and its query statistics when it closes (non-finite ones dropped)
    check_finite: bool = True
    # CUDA with the Triton backend: warm chunk encodes replayed from CUDA graphs (`kvbackend.kernels.encode_graph`).
    # Off by default: on the H200 a 32-layer Llama-8B chunk encodes 1.2x faster (7.7 -> 6.6 ms) for a memory pool of
    # 0.6-0.9 GiB that the cache keeps reserved (perf/NOTES.md, session 29)
    encode_graphs: bool = False
    extra_keys: tuple = field(default_factory=tuple)  # mixed into every page hash (LoRA id, salt, ...)

    def __post_init__(self) -> None:
        if isinstance(self.layer_codecs, str) or not all(isinstance(c, str) for c in self.layer_codecs):
            raise ValueError(f"CacheConfig.layer_codecs must be a sequence of codec spec strings, got "
                             f"{self.layer_codecs!r}")
        object.__setattr__(self, "layer_codecs", tuple(self.layer_codecs))  # a list is accepted, kept hashable
        if not isinstance(self.codec, str):
            raise ValueError(f"CacheConfig.codec must be a codec spec string, got {self.codec!r}")
        if self.layer_codecs and self.codec != _DEFAULT_CODEC:  # one of them would be ignored
            raise ValueError(f"CacheConfig: give codec={self.codec!r} or layer_codecs (one spec per layer), not both")
        for name in ("page_size", "chunk_pages", "dense_pages", "packed_pages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"CacheConfig.{name} must be a positive int, got {value!r}")
        slots = self.codebook_slots
        if slots is not None and (not isinstance(slots, int) or isinstance(slots, bool) or slots <= 0):
            raise ValueError(f"CacheConfig.codebook_slots must be None (one per possible chunk) or a positive int, "
                             f"got {slots!r}")
        for name in ("check_finite", "encode_graphs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"CacheConfig.{name} must be True or False, got {getattr(self, name)!r}")
        try:
            check_device(self.device)
        except ValueError as exc:
            raise ValueError(f"CacheConfig.device: {exc}") from None

    @property
    def chunk_tokens(self) -> int:
        """N: tokens in one full chunk."""
        return self.page_size * self.chunk_pages

    @property
    def num_codebook_slots(self) -> int:
        if self.codebook_slots is not None:
            return self.codebook_slots
        return -(-self.packed_pages // self.chunk_pages) + 1


def check_device(value) -> torch.device:
    """``value`` as a device this machine has: the CPU or a CUDA device present (the pools live on one of them).

    Raises:
        ValueError: not a device, another kind of device, or a CUDA device this machine does not have.
    """
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{value!r} is not a device (cpu, cuda, cuda:N): {exc}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{value!r}: kvbackend runs on cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{value!r}: this machine has no CUDA device; use cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"{value!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device
