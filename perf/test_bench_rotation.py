"""The value rotation of ``vrot=hadamard`` on one CPU core (pytest-benchmark): `kvbackend.levers.rotate_values` (a
fast Walsh-Hadamard transform, fused loop where numba is installed) against the float32 matrix product it replaced,
in the same run, on one SGLang page of an 8B model's values (32 layers x 16 tokens x 8 heads, head_dim 128).

    .venv/bin/python -m pytest perf/test_bench_rotation.py --benchmark-enable -s
"""

import pytest
import torch

from kvbackend.levers import hadamard, rotate_values

ROWS = 32 * 16 * 8


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("how", ["rotate_values", "matrix product"])
def test_rotation(benchmark, how):
    v = torch.randn(ROWS, 128).bfloat16()
    h = hadamard(128)
    run = (lambda: rotate_values(v)) if how == "rotate_values" else (lambda: v.float() @ h)
    out = benchmark.pedantic(run, rounds=20, iterations=1, warmup_rounds=2)
    assert torch.allclose(out, v.float() @ h, atol=1e-5)
    print(f"\n{how}: {v.numel() * 2 / benchmark.stats.stats.median / 1e9:.2f} GB/s of bf16 values, one core")
