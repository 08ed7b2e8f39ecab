"""Known limits of the kernels: the ones still open are kept as strict expected failures so that they stay visible
and a fix flips them (then drop the mark); the lever cases below are refused at append now (`KVCache.kv_limits`). Each compares the Triton backend with the torch reference
(`KVCache.read` + `decode_attention`), which decodes in float32.

The kernels' tensor-core operands are fp16, so a stored-frame value above 65504 overflows where the
reference does not:
- ``vrot=hadamard`` concentrates a same-sign value vector into one channel (``sum(v) / sqrt(D)``), so
  values above about 65504 / sqrt(D) overflow (decode and gather);
- ``prerope=true`` keeps each RoPE pair's norm, not each channel, so keys above about 65504 / sqrt(2)
  can overflow in decode;
- per-channel keys (KIVI) form ``code * scale`` before adding the zero, so a channel spanning more than
  65504 overflows in decode (also without levers) in Triton's interpreter; the H200 build passes this
  case (the compiler fuses the multiply-add).
"""

import pytest
import torch

from kvbackend import CacheConfig, Geometry, KVCache
from kvbackend.attention import decode_attention
from kvbackend.errors import InvalidKV
from kvbackend.rope import Rotary
from kernel_cases import DEVICE

pytest.importorskip("triton")

ROTARY = Rotary(1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)))
FP16_OPERANDS = "the kernels' fp16 operands overflow where the float32 reference does not (see the module docstring)"


def _decode_error(codec, k, v, scale_q=1.0):
    cache = KVCache(Geometry(1, 2, 64, torch.bfloat16),
                    CacheConfig(codec=codec, page_size=16, chunk_pages=2, dense_pages=16, packed_pages=16,
                                device=DEVICE, backend="triton"), rotary=ROTARY)
    rid, _ = cache.add_request()
    cache.append(rid, 0, k.bfloat16().to(DEVICE), v.bfloat16().to(DEVICE))
    rk, rv = cache.read(rid, 0)
    assert torch.isfinite(rk.float()).all() and torch.isfinite(rv.float()).all()
    q = (torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(1)) * scale_q).bfloat16().to(DEVICE)
    want, _ = decode_attention(q, [rk], [rv])
    out, _ = cache.decode(cache.plan([rid], 0), 0, q)
    return float((out.float() - want).norm() / want.norm())


def _data(n=40, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2, 64, generator=gen), torch.randn(n, 2, 64, generator=gen)


def test_large_values_with_rotated_values():
    """Values the rotation would carry past fp16 in the stored frame are refused at append (they gave NaN)."""
    k, v = _data()
    v = 12000.0 + 100.0 * v  # finite in fp16; (v @ H)[0] is about 96000
    assert _decode_error("rtn:bits=4,group=32", k, v) < 1e-2  # control: without the rotation they decode fine
    with pytest.raises(InvalidKV, match="stored frame"):
        _decode_error("rtn:bits=4,group=32,vrot=hadamard", k, v)


def test_large_rope_pair_with_pre_rope_keys():
    """Keys whose RoPE pair would pass fp16 before RoPE are refused at append on the kernels (they gave NaN)."""
    k, v = _data()
    k = k * 0.01
    k[:, :, 0] = 50000.0  # one RoPE pair (0, 32) of norm 70711
    k[:, :, 32] = 50000.0
    assert _decode_error("rtn:bits=8,group=32", k, v, scale_q=1e-4) < 1e-2
    with pytest.raises(InvalidKV, match="stored frame"):
        _decode_error("rtn:bits=8,group=32,prerope=true", k, v, scale_q=1e-4)


@pytest.mark.xfail(not torch.cuda.is_available(), strict=True,
                   reason=FP16_OPERANDS + " (in the interpreter; the H200 build passes: measured 2026-12-01)")
def test_per_channel_keys_spanning_more_than_fp16():
    k, v = _data()
    k[:, :, 0] = 40000.0 * torch.where(torch.arange(40) % 2 == 0, 1.0, -1.0)[:, None]
    assert _decode_error("kivi:bits=8,group=16", k, v, scale_q=1e-4) < 1e-2
