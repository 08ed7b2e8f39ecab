"""Rotary position embedding, so keys can be stored before RoPE and rotated again on read."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def pair_mean(w: torch.Tensor) -> torch.Tensor:
    """Per-channel weights ``[..., D]`` with both channels of each RoPE pair (d, d + D/2) set to the pair's mean: a
    query meets a key stored before RoPE turned by their relative angle, which mixes the pair."""
    half = w.shape[-1] // 2
    mean = (w[..., :half] + w[..., half:]) / 2
    return torch.cat([mean, mean], dim=-1)


@dataclass(frozen=True)
class Rotary:
    """RoPE in the half-split convention (channel i pairs with i + D/2), as Llama models use it."""

    inv_freq: torch.Tensor  # [D/2] float32
    scaling: float = 1.0  # attention scaling folded into cos/sin by some RoPE variants

    def __post_init__(self) -> None:
        """Raise ValueError for a RoPE no cache can undo: ``inv_freq`` not a 1-D tensor of finite floats, or a
        ``scaling`` that is not a positive finite number (keys stored before RoPE would be divided by it)."""
        inv = self.inv_freq
        if not isinstance(inv, torch.Tensor) or inv.dim() != 1 or not inv.numel() or not inv.dtype.is_floating_point:
            raise ValueError(f"Rotary.inv_freq must be a non-empty 1-D float tensor [head_dim / 2], got "
                             f"{getattr(inv, 'shape', inv)!r} {getattr(inv, 'dtype', '')}")
        if not bool(torch.isfinite(inv).all()):
            raise ValueError("Rotary.inv_freq holds NaN or Inf")
        if isinstance(self.scaling, bool) or not isinstance(self.scaling, (int, float)) \
                or not 0.0 < float(self.scaling) < float("inf"):
            raise ValueError(f"Rotary.scaling must be a positive finite number, got {self.scaling!r}")

    def inv_freq_on(self, device: torch.device | str) -> torch.Tensor:
        """``inv_freq`` on ``device``, copied there once (a copy per call from host memory would make every
        decode step wait for the device)."""
        device = torch.device(device)
        if self.inv_freq.device == device:
            return self.inv_freq
        copies = self.__dict__.setdefault("_copies", {})  # frozen dataclass: a cache beside the fields
        key = str(device)
        if key not in copies:
            copies[key] = self.inv_freq.to(device)
        return copies[key]

    def frequencies(self) -> tuple[float, ...]:
        """``inv_freq`` as Python floats (float64), read from the tensor once (every decode call of every layer names
        them: a read per call from a device tensor would make each one wait for the device)."""
        cached = self.__dict__.get("_frequencies")
        if cached is None:
            cached = self.__dict__.setdefault("_frequencies", tuple(self.inv_freq.double().tolist()))
        return cached

    def cos_sin(self, positions: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables ``[T, D]`` `rotate` and `derotate` apply at ``positions [T]``: to pass to
        `derotate`, where several tensors turn by the same positions."""
        return self._cos_sin(positions, device)

    def _cos_sin(self, positions: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(device=device, dtype=torch.float32)[:, None] * self.inv_freq_on(device)[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)  # [T, D]
        return emb.cos(), emb.sin()

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Apply RoPE to ``x [..., T, D]`` at ``positions [T]`` (what the model does to keys)."""
        cos, sin = self._cos_sin(positions, x.device)
        xf = x.float()
        return ((xf * cos + _rotate_half(xf) * sin) * self.scaling).to(x.dtype)

    def derotate(self, x: torch.Tensor, positions: torch.Tensor | None,
                 cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Undo `rotate`: the transpose of the rotation, divided by the scaling (at ``positions``, or by their tables
        ``cos_sin`` from `cos_sin`)."""
        cos, sin = cos_sin if cos_sin is not None else self._cos_sin(positions, x.device)
        xf = x.float()
        out = xf * cos - _rotate_half(xf) * sin
        return (out / self.scaling if self.scaling != 1.0 else out).to(x.dtype)  # (x / 1.0 is x: one pass less)

    @staticmethod
    def default(head_dim: int, theta: float) -> "Rotary":
        return Rotary(1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)))


def rope_not_undoable(config) -> str | None:
    """Why one `Rotary` cannot undo the RoPE of a transformers text ``config`` for every layer, or None.

    `Rotary` rotates every channel of a head, one way in every layer: a model that rotates part of each
    head (``partial_rotary_factor`` < 1: Phi, StableLM, GPT-NeoX) or gives layer types their own RoPE
    (``rope_parameters`` per layer type, as Gemma 3's full and sliding layers) is undone wrongly, so the
    keys a ``prerope``/``pagerope`` codec stores would be neither pre- nor post-RoPE.
    """
    params = getattr(config, "rope_parameters", None) or {}
    if params and all(isinstance(value, dict) for value in params.values()):
        kinds = {kind: dict(value) for kind, value in params.items()}
        if len({repr(sorted(value.items())) for value in kinds.values()}) > 1:
            return f"its layer types have their own RoPE ({kinds})"
        params = next(iter(kinds.values()))
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if factor is not None and float(factor) != 1.0:
        return f"it rotates a part of each head (partial_rotary_factor={factor})"
    return None


def rotary_from_config(config) -> Rotary:
    """A transformers model config's RoPE (default, or any type transformers knows) as a `Rotary`."""
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        return Rotary.default(head_dim, theta)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
    return Rotary(inv_freq.float(), float(scaling))
