"""The step query statistics kernel (`kvbackend.kernels.query_moments`) against the torch path it replaces on CUDA:
`LeverFrame.step_queries_to_stored`, then `query_moments`."""

import pytest
import torch

from kvbackend import codecs
from kvbackend.codecs.base import query_moments
from kvbackend.frames import LeverFrame
from kvbackend.kernels import query_moments as kernel
from kvbackend.rope import Rotary

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # (the interpreter without a GPU)


def _reference(q, kv_heads, tables, scaling):
    """The torch path: de-rotate (rounded to q's dtype), then the moments and sums in float32."""
    stored = q if tables is None else Rotary(torch.ones(q.shape[-1] // 2), scaling).derotate(
        q.transpose(0, 1), None, cos_sin=tables).transpose(0, 1)
    return (*query_moments(stored, kv_heads), stored)


def _bound(stored, kv_heads):
    """An elementwise bound of the kernel's distance from the torch path: a de-rotated value may round the other
    way (fused multiply-adds on the GPU: one unit in the last place of its dtype), and float32 sums in another
    order."""
    b, hq, d = stored.shape
    eps = torch.finfo(stored.dtype).eps if stored.dtype != torch.float32 else 1e-6
    a = stored.float().abs().reshape(b, kv_heads, hq // kv_heads, d)
    return 2.5 * eps * (a.transpose(-1, -2) @ a + 1e-30), 1.5 * eps * a.sum(2) + 1e-30


def _out(b, h, d, fill=float("nan")):
    return (torch.full((b, h, d, d), fill, device=DEVICE), torch.full((b, h, d), fill, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("b,hq,h,d", [(1, 3, 1, 8), (5, 4, 2, 12), (3, 9, 3, 64), (2, 8, 8, 6)])
@pytest.mark.parametrize("rotate,scaling", [(False, 1.0), (True, 1.0), (True, 1.7)])
def test_the_kernel_matches_the_torch_path(dtype, b, hq, h, d, rotate, scaling):
    """Odd shapes (head sizes that are not powers of two, one request, GQA groups of 1 to 4), every float dtype, no
    turn, a turn, and a turn with a RoPE scaling; queries strided as a model's projection leaves them, the outputs
    filled with NaN first (every element must be written)."""
    gen = torch.Generator().manual_seed(b * 100 + d)
    wide = torch.randn(b, hq, d + 3, generator=gen) * 3
    q = wide[..., 1:d + 1].to(DEVICE, dtype)  # (rows strided, last dim contiguous)
    if dtype != torch.float32:
        q = wide.to(DEVICE, dtype)[..., 1:d + 1]
    positions = torch.randint(0, 5000, (b,), generator=gen)
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    tables = Rotary(inv, scaling).cos_sin(positions, torch.device(DEVICE)) if rotate else None
    want_m, want_s, stored = _reference(q, h, tables, scaling)
    got_m, got_s = kernel.step_query_moments(q, h, tables, scaling, _out(b, h, d))
    bound_m, bound_s = _bound(stored, h)
    assert not got_m.isnan().any() and not got_s.isnan().any()
    assert ((got_m - want_m).abs() <= bound_m).all(), (got_m - want_m).abs().max()
    assert ((got_s - want_s).abs() <= bound_s).all(), (got_s - want_s).abs().max()
    if DEVICE == "cpu" and dtype != torch.bfloat16:  # the interpreter has no fused multiply-adds: the same values
        # (its bf16 conversion truncates, where the GPU's rounds to nearest: within the bound only)
        torch.testing.assert_close(got_m, want_m, rtol=1e-5, atol=1e-5 * float(want_m.abs().max()))


def test_a_wrong_turn_is_seen():
    """The bound is tight enough to see the turn of the wrong way, or at the wrong position."""
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(2, 4, 16, generator=gen).to(DEVICE, torch.bfloat16)
    rotary = Rotary.default(16, 10000.0)
    tables = rotary.cos_sin(torch.tensor([11, 900]), torch.device(DEVICE))
    other = rotary.cos_sin(torch.tensor([12, 900]), torch.device(DEVICE))
    got_m, _ = kernel.step_query_moments(q, 2, other, 1.0, _out(2, 2, 16))
    want_m, _, stored = _reference(q, 2, tables, 1.0)
    assert not ((got_m - want_m).abs() <= _bound(stored, 2)[0]).all()


def test_bad_outputs_and_groups_are_refused():
    q = torch.randn(2, 4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="do not split"):
        kernel.step_query_moments(q, 3, None, 1.0, _out(2, 3, 8))
    with pytest.raises(ValueError, match="out must be"):
        kernel.step_query_moments(q, 2, None, 1.0, _out(2, 1, 8))
    with pytest.raises(ValueError, match="RoPE tables"):
        kernel.step_query_moments(q, 2, (torch.ones(3, 8), torch.ones(3, 8)), 1.0, _out(2, 2, 8))
    assert not kernel.supports(torch.zeros(1, 2, 256)) and not kernel.supports(torch.zeros(1, 2, 7))
    assert not kernel.supports(torch.zeros(1, 2, 8, dtype=torch.int32))


@pytest.mark.parametrize("levers", ["", "prerope=true", "pagerope=true"])
def test_the_frame_takes_the_kernel_on_cuda_and_torch_elsewhere(levers, monkeypatch):
    """`LeverFrame.step_query_moments` gives the torch path's statistics (within the kernel's bound on CUDA, the
    same bits elsewhere), for queries in the stored frame, pre-RoPE and page-relative keys."""
    spec = "rtn:bits=2,group=32" + (f",{levers}" if levers else "")
    frame = LeverFrame(codecs.get(spec).levers, Rotary.default(64, 10000.0), 16)
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(4, 6, 64, generator=gen).to(DEVICE, torch.bfloat16)
    positions = torch.tensor([0, 17, 300, 4095], device=DEVICE)
    memo = {}
    got = frame.step_query_moments(q, positions, memo, 2, _out(4, 2, 64))
    stored = frame.step_queries_to_stored(q, positions, memo)
    want = query_moments(stored, 2)
    if DEVICE == "cpu":
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    else:
        bounds = _bound(stored, 2)
        assert all(((a - b).abs() <= bound).all() for a, b, bound in zip(got, want, bounds))
    assert bool(levers) == bool(memo)  # the tables made once, for the step's other layers
    monkeypatch.setenv("KVBACKEND_STEP_KERNEL", "0")  # the torch path on every device: the same bits
    assert all(torch.equal(a, b) for a, b in zip(frame.step_query_moments(q, positions, memo, 2, _out(4, 2, 64)), want))
