"""The standalone decode kernel of `perf/experiments/chw_decode_kernel.py` (keys with a width per channel) against
its torch reference on odd shapes, in Triton's interpreter on the CPU (on a GPU where one is present)."""

import pytest
import torch

pytest.importorskip("triton")

EXPERIMENT = "chw_decode_kernel"  # the `experiment` fixture (conftest.py) loads it



@pytest.mark.parametrize("tile", [False, True])
@pytest.mark.parametrize("batch, hq, heads, dim, pages, splits", [(1, 6, 2, 16, 3, 2), (2, 4, 4, 32, 2, 1)])
def test_the_kernel_reads_what_the_reference_reads(experiment, batch, hq, heads, dim, pages, splits, tile):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(dim)
    width = torch.randint(0, 9, (heads, dim), generator=gen).int()  # every width 0-8
    table = experiment.make(batch * pages, heads, dim, width, seed=dim)
    keys, _ = experiment.dequant_reference(table)
    zero = width.long() == 0
    assert torch.all(keys.permute(1, 3, 0, 2)[zero] == table["kmean"].float()[zero][:, None, None])  # width 0
    q = torch.randn(batch, hq, dim, generator=gen).bfloat16()
    want = experiment.reference(q, table, pages)
    on = {k: v.to(device) if torch.is_tensor(v) else v for k, v in table.items() if k != "codes"}
    got = experiment.decode(q.to(device), on, pages, splits, tile=tile).cpu()
    assert torch.allclose(got, want, atol=2e-2, rtol=2e-2)
    assert not torch.allclose(got, torch.zeros_like(got))


def test_packing_puts_each_channel_at_its_width(experiment):
    width = torch.tensor([[3, 0, 8, 1]], dtype=torch.int32)
    codes = torch.zeros(1, 1, 64, 4, dtype=torch.long)
    codes[0, 0, 0, 0] = 5  # 101 first: byte 0 starts 101
    codes[0, 0, 0, 2] = 0xA7
    codes[0, 0, 0, 3] = 1
    packed, offsets = experiment.pack(codes, width)
    assert offsets[0].tolist() == [0, 24, 24, 88]
    assert packed.shape[-1] == 8 * (3 + 8 + 1) + 1
    assert packed[0, 0, 0] == 0b1010_0000 and packed[0, 0, 24] == 0xA7 and packed[0, 0, 88] == 0b1000_0000
