"""Review findings: each test fails before its fix."""

import os

import pytest
import torch

from kvbackend import codecs, fastquant
from kvbackend.codecs.qvg_fused import decode_units_bf16
from kvbackend.geometry import Geometry
from kvbackend.tiers.file import FileTier

FINGERPRINT = "0123456789abcdef"


def blob_for(key: int, size: int = 300) -> torch.Tensor:
    gen = torch.Generator().manual_seed(key)
    return torch.randint(0, 256, (size + key % 7,), dtype=torch.uint8, generator=gen)


def served(tier: FileTier, keys: list[int]) -> set[int]:
    """Keys whose get succeeded, each checked to be exactly its original bytes."""
    outs = [torch.zeros(400, dtype=torch.uint8) for _ in keys]
    ok = tier.get(keys, outs).result()
    for k, out, good in zip(keys, outs, ok):
        if good:
            assert torch.equal(out[: blob_for(k).numel()], blob_for(k)), f"key {k}: wrong bytes served"
    return {k for k, good in zip(keys, ok) if good}


def test_a_blob_put_again_after_its_copy_was_found_corrupt_is_served_after_a_restart(tmp_path):
    """A corrupt blob drops only its own entry: its file stays on disk for its other blobs, still listing the bad
    copy. The key put again lands in a newer file. A restart must index the newer, good copy, not the older one
    known to be bad (which would make the key a miss and leave the good file's bytes held by no entry)."""
    tier = FileTier(str(tmp_path), 10**7, FINGERPRINT, fsync=False)
    tier.put([1, 2], [blob_for(1), blob_for(2)]).wait()
    (first,) = os.listdir(tmp_path)
    data = bytearray((tmp_path / first).read_bytes())
    data[-1] ^= 0x01  # in blob 2's payload
    (tmp_path / first).write_bytes(bytes(data))
    os.utime(tmp_path / first, ns=(10**18, 10**18))
    assert served(tier, [2]) == set() and served(tier, [1]) == {1}
    assert all(tier.put([2], [blob_for(2)]).result())  # written again, into a file of its own
    (second,) = set(os.listdir(tmp_path)) - {first}
    os.utime(tmp_path / second, ns=(2 * 10**18, 2 * 10**18))  # newer
    assert served(tier, [1, 2]) == {1, 2}
    tier.close()

    again = FileTier(str(tmp_path), 10**7, FINGERPRINT, fsync=False)
    assert served(again, [1, 2]) == {1, 2}
    again.close()


@pytest.mark.skipif(fastquant.numba is None, reason="numba not installed (the fused path is optional)")
@pytest.mark.xfail(reason="NaN bits: the fused loop writes 0x7FC0 for every NaN, torch's vectorized CPU rounding to bf16 "
                          "writes 0xFFFF on this build (its scalar rounding writes 0x7FC0): both are NaN", strict=False)
def test_a_nan_scale_decodes_to_the_nan_bits_of_the_torch_path(monkeypatch):
    """Only a crafted page holds a NaN scale (encoders refuse non-finite values); it decodes to NaN on both paths,
    with other bits."""
    spec = "quantwm:kchannel=16,centroids=32,clip=true,vcluster=false,cdtype=fp8,outliers=16"
    codec = codecs.get(spec)
    layout = codec.layout(Geometry(1, 2, 128, torch.bfloat16), 16)
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(8 * 16, 2, 128, generator=gen).bfloat16() for _ in range(2))
    pages, books = codec.encode_units(k.view(8, 16, 2, 128), v.view(8, 16, 2, 128), layout)
    pages, books = pages.reshape(8, -1), books.reshape(8, -1)
    layout.page.view(pages, "k_scales").view(torch.uint8)[0, 0, 0, 0] = 0x7F  # e4m3 NaN
    got = decode_units_bf16(codec, layout, pages, books, False, 1)
    assert got is not None
    monkeypatch.setenv("KVBACKEND_FASTQUANT", "0")
    want, _ = codec.decode_units(layout, pages, books)
    assert torch.isnan(want.float()).any()
    assert torch.equal(got[:, 0].reshape(want.shape).view(torch.int16), want.view(torch.int16))
