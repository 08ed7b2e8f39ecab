"""The rotated-mean experiment of `perf/experiments/chw_rotated_mean.py`: keys with large pre-RoPE channel means
(what makes keys after RoPE hard to code around a chunk mean) come back as well around the rotated pre-RoPE mean as
before RoPE, and far better than around the post-RoPE mean; sinks exact, values through the same codec in every
frame, the same bytes (and the rotated frame's means)."""

import pytest
import torch

from kvbackend.rope import Rotary

pytest.importorskip("transformers")  # the experiment imports the evaluator

EXPERIMENT = "chw_rotated_mean"  # the `experiment` fixture (conftest.py) loads it



def test_the_rotated_mean_codes_keys_as_well_as_before_rope(experiment, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    layers, tokens, heads, dim = 2, 200, 2, 32  # a partial second chunk when CHUNK is 128
    rotary = Rotary.default(dim, 10000.0)
    pos = torch.arange(tokens)
    mean = 4.0 * torch.randn(layers, 1, heads, dim, generator=gen)
    pre = mean + 0.3 * torch.randn(layers, tokens, heads, dim, generator=gen)
    k = torch.stack([rotary.rotate(x.transpose(0, 1), pos).transpose(0, 1) for x in pre])
    v = torch.randn(layers, tokens, heads, dim, generator=gen)
    kw = ["3" * (heads * dim)] * layers
    monkeypatch.setattr(experiment, "CHUNK", 128)
    errors, stored = {}, {}
    for frame in experiment.FRAMES:
        dk, dv, stored[frame] = experiment.code_frame(frame, kw, k, v, rotary, 0)
        assert dk.shape == k.shape and dv.shape == v.shape
        assert torch.equal(dk[:, :4], k[:, :4].half().float()) and torch.equal(dv[:, :4], v[:, :4].half().float())
        errors[frame] = float((dk[:, 4:] - k[:, 4:]).norm() / k[:, 4:].norm())
        assert float((dv[:, 4:] - v[:, 4:]).norm() / v[:, 4:].norm()) < 0.45  # 2-bit values of Gaussian data
    assert stored["pre"] == stored["post"] == stored["rmean"] - 2 * 2 * heads * dim * layers  # + its means (2 chunks)
    assert errors["rmean"] < 1.2 * errors["pre"] and errors["post"] > 2 * errors["rmean"], errors
