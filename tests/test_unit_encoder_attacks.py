"""Adversarial cases for the kernels' one-pass encode (`kvbackend.kernels.unit_encoder`): inputs where it must still
write the reference's bytes (Triton's interpreter) and leave the states as the reference leaves them."""

import pytest
import torch

from kvbackend import codecs
from kvbackend.geometry import Geometry
from kernel_cases import DEVICE
from test_unit_encoder import _assert_same_bytes, _error

pytest.importorskip("triton")


@pytest.mark.skipif(DEVICE != "cpu", reason="IEEE distances in the interpreter (CUDA's are TF32: test_unit_encoder.py)")
def test_keys_far_from_the_origin_cluster_as_well_as_the_reference_clusters_them():
    """float32 keys around 1000 (a large shared offset, as in outlier channels): their squared norms dwarf the
    distances between centroids, so ||c||^2 - 2 x.c cancels, and which near-tied centroid each k-means (reference
    and kernel) takes depends on the order its matrix product sums in (it differs from one CPU to another, so the
    bytes may differ). What must not differ is the quality: each side's reconstruction error within 1% of the
    other's, with the same byte count."""
    from kvbackend.kernels.unit_encoder import encode_units

    codec = codecs.get("qvg:centroids=4,group=16")
    layout = codec.layout(Geometry(1, 2, 32, torch.float32), 16)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(2, 16, 2, 32, generator=gen) + 1000
    v = torch.randn(2, 16, 2, 32, generator=gen)
    ref = codec.encode_units(k, v, layout)
    new = codec.encode_units(k, v, layout, encoder=encode_units)
    assert ref[0].shape == new[0].shape and ref[1].shape == new[1].shape
    ref_k, ref_v = _error(codec, layout, *ref, k, v)
    new_k, new_v = _error(codec, layout, *new, k, v)
    assert 0 < new_k <= 1.01 * ref_k and 0 < ref_k <= 1.01 * new_k, (ref_k, new_k)
    assert new_v <= 1.01 * ref_v and ref_v <= 1.01 * new_v, (ref_v, new_v)


def test_random_seeding_of_a_cold_tensor_beside_a_warm_one_is_left_to_the_reference():
    """init=random draws a permutation per row, which the kernels' path does not make: a state warm for the keys
    but cold for the values (its value centroids dropped) still seeds the values at random, so the kernels must
    refuse it (nothing written, no state touched) and the bytes are the reference's."""
    from kvbackend.codecs.base import CodecState
    from kvbackend.kernels.unit_encoder import encode_units

    codec = codecs.get("qvg:centroids=4,group=16,init=random,seed=3")
    layout = codec.layout(Geometry(1, 2, 32, torch.bfloat16), 16)
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(1, 16, 2, 32, generator=gen).bfloat16() for _ in range(2))
    warm = CodecState()
    codec.encode(k[0], v[0], layout, warm)
    warm.centroids.pop("v")
    ref_state, new_state = warm.clone(), warm.clone()
    pages = torch.full((1, layout.page_bytes), 7, dtype=torch.uint8)
    books = torch.full((1, layout.codebook_bytes), 7, dtype=torch.uint8)
    flat = (16, 2, 32)
    assert not encode_units(codec, k.float().reshape(flat), v.float().reshape(flat), layout, pages, books, [new_state])
    assert bool((pages == 7).all()) and bool((books == 7).all()) and new_state.iterations == warm.iterations
    ref = codec.encode_units(k, v, layout, [ref_state])
    new = codec.encode_units(k, v, layout, [new_state], encoder=encode_units)
    assert torch.equal(ref[0], new[0]) and torch.equal(ref[1], new[1])


@pytest.mark.skipif(DEVICE != "cpu", reason="bytes compared in the interpreter")
def test_float32_steps_past_the_largest_float_saturate_as_the_reference_does():
    """Finite values whose range overflows float32 (about +-2e38): the reference saturates an fp32 scale at the
    largest finite float (`quant.round_to`); an infinite scale would decode every code of the group to NaN."""
    from kvbackend.kernels.unit_encoder import encode_units

    codec = codecs.get("qvg:centroids=4,group=16,scale=fp32,vcluster=false")
    layout = codec.layout(Geometry(1, 2, 32, torch.float32), 16)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(2, 16, 2, 32, generator=gen)
    v = (torch.rand(2, 16, 2, 32, generator=gen) * 2 - 1) * 2e38
    ref = codec.encode_units(k, v, layout)
    new = codec.encode_units(k, v, layout, encoder=encode_units)
    assert bool(torch.isfinite(layout.page.view(new[0].flatten(0, 1), "v_scales")).all())
    _assert_same_bytes(layout, ref, new)
