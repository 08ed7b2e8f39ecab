"""The tensor-core scores experiment of `perf/experiments/chw_mma_scores.py` (keys at a width per channel, in lane
order): its page packing read back as the kernel reads it (a thread's 32-bit window per tile) on the CPU, and the
kernel's scores against float32 over the decoded keys where a CUDA device and nvcc are present."""

import pytest
import torch

EXPERIMENT = "chw_mma_scores"  # the `experiment` fixture (conftest.py) loads it



@pytest.mark.parametrize("kind", ["mixed", "uniform", "extremes", "random"])
def test_pages_read_back_as_the_kernel_reads_them(experiment, kind):
    gen = torch.Generator().manual_seed(7)
    widths = {"mixed": experiment.mixed_widths(2, 3), "uniform": torch.full((2, 128), 2),
              "extremes": torch.tensor([[0, 8] * 64, [8] * 128]),
              "random": torch.randint(0, 9, (3, 128), generator=gen)}[kind]
    layout, codes, amax, mean = experiment.make(widths, 3, gen, "cpu")
    assert torch.all(codes < 2 ** widths[None, None])
    pages = layout.pack(codes, amax)
    assert pages.shape == (3, layout.page_bytes)
    assert torch.equal(experiment.unpack(layout, pages), codes)
    assert torch.equal(pages[:, layout.amax:].contiguous().view(torch.float16).view(3, -1, 128), amax)
    # each head's rows fit its block with one word to spare (the window's second word)
    for h, (s, nbytes) in enumerate(zip(layout.row_bits, layout.bytes)):
        assert s == int(widths[h].sum()) and nbytes % 16 == 0 and nbytes >= 4 * (-(-64 * s // 32) + 1)
    keys = layout.keys(codes, amax, mean)
    zero = widths == 0
    assert torch.equal(keys[:, :, zero], mean.float()[zero].expand(3, 64, -1))  # width 0 reads as its mean


def test_the_kernel_scores_what_the_reference_scores(experiment):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from kvbackend.kernels import mma_decode

    usable, why = mma_decode.available()
    if not usable:
        pytest.skip(why)
    result = experiment.check(torch.device("cuda"))  # asserts every score within 5e-3 of the largest
    assert set(result) == {"mixed", "every width 2", "widths 0 and 8"}
