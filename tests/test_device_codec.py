"""`DeviceCodec`, the storage adapters' batch runner: the GPU gives the CPU's bytes (page-local codecs), and the
option that picks the device is checked. The adapters' own tests need their engines installed; these do not."""

import pytest
import torch

from kvbackend import Geometry, codecs
from kvbackend.integration.storage_options import DeviceCodec, codec_device

CODECS = ["kivi:bits=4,group=32", "kivi:bits=2,group=16", "rtn:bits=2,group=64,scale=fp8", "rtn:bits=4,group=64",
          "fp8", "identity"]


def test_the_option_picks_a_device():
    assert codec_device("cpu") == torch.device("cpu")
    assert codec_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert codec_device(None) == codec_device("auto")
    for bad in ("gpu", "cuda:x", 3, "meta", ""):
        with pytest.raises(ValueError, match="device must be"):
            codec_device(bad)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            codec_device("cuda:0")
    else:
        with pytest.raises(ValueError, match="CUDA device"):
            codec_device(f"cuda:{torch.cuda.device_count()}")


def test_on_the_cpu_it_is_a_plain_call():
    runner = DeviceCodec(torch.device("cpu"))
    x = torch.arange(6)
    assert runner("encode", lambda t: t * 2, x).tolist() == [0, 2, 4, 6, 8, 10]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_results_go_straight_into_host_destinations(device):
    """``into=``: row i of the result lands in destination i (page-locked or not, any strides), None returned;
    a count that does not match is an error, never a partial copy passed off as done."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    runner = DeviceCodec(torch.device(device))
    x = torch.arange(12, dtype=torch.int32).view(3, 4)
    dests = [torch.zeros(4, dtype=torch.int32), torch.zeros(8, dtype=torch.int32)[::2],
             runner.staging((4,), torch.int32).zero_()]
    assert runner("decode", lambda t: t * 3 + 1, x, into=dests) is None
    for i, d in enumerate(dests):
        assert d.tolist() == (x[i] * 3 + 1).tolist()
    with pytest.raises(ValueError, match="destinations"):
        runner("decode", lambda t: t, x, into=dests[:2])
    with pytest.raises(ValueError, match="destination of"):  # never broadcast into a destination of another shape
        runner("decode", lambda t: t[:, :1], x, into=dests)
    assert dests[0].tolist() == (x[0] * 3 + 1).tolist()  # nothing was copied


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("spec", CODECS)
def test_the_gpu_encodes_and_decodes_the_bytes_of_the_cpu(spec):
    """64 pages of 32 tokens of an 8-head, 128-dim layer with channel offsets and a few large values."""
    gen = torch.Generator().manual_seed(4)
    codec = codecs.get(spec)
    layout = codec.layout(Geometry(1, 8, 128, torch.bfloat16), 32)
    k = (torch.randn(2048, 8, 128, generator=gen) + 6 * torch.randn(1, 8, 128, generator=gen)).bfloat16()
    v = torch.randn(2048, 8, 128, generator=gen).bfloat16()
    k[5, 2, 7], v[9, 1, 3] = 300.0, -250.0
    runner = DeviceCodec(codec_device("cuda"))
    want = codec.encode(k, v, layout).pages
    got = runner("encode", lambda k, v: codec.encode(k, v, layout).pages, k, v)
    assert got.device.type == "cpu" and torch.equal(got, want)
    empty = torch.empty(0, dtype=torch.uint8)
    wk, wv = codec.decode_pages(layout, want, empty)
    gk, gv = runner("decode", lambda body: codec.decode_pages(layout, body, body[:0]), want)
    assert torch.equal(gk, wk) and torch.equal(gv, wv)


def test_host_buffers_are_page_locked_where_they_can_be():
    """Inputs staged for the device and results copied back are page-locked on a CUDA machine (the link's
    speed, not the driver's staging); without page-locked memory they are plain host tensors, never an error."""
    runner = DeviceCodec(torch.device("cuda", 0))
    staged = runner.staging((3, 5), torch.bfloat16)
    assert staged.shape == (3, 5) and staged.dtype == torch.bfloat16 and staged.device.type == "cpu"
    assert staged.is_pinned() == torch.cuda.is_available()
    assert DeviceCodec(torch.device("cpu")).staging((2,), torch.uint8).is_pinned() is False
    if not torch.cuda.is_available():
        return
    x = torch.randn(4, 7)
    out, twice = runner.run(lambda t: (t + 1, t * 2), x)
    assert out.device.type == "cpu" and out.is_pinned() and twice.is_pinned()
    assert torch.equal(out, x + 1) and torch.equal(twice, x * 2)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_deferred_copies_have_landed_once_finish_returns(device):
    """``defer=True``: the copies into the destinations run after the device's work on a stream of their own (a sink
    sees that stream as current), the call returns without waiting for them, and after `finish` every destination
    holds the last call's rows; on the CPU it is a plain call."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    runner = DeviceCodec(torch.device(device))
    x = torch.randn(6, 1 << 18)
    dests = [runner.staging((1 << 18,), torch.float32).zero_() for _ in range(6)]
    for factor in (2.0, 3.0, 5.0):  # each call overwrites the last one's rows, in order
        assert runner("decode", lambda t: t * factor, x, into=dests, defer=True) is None
    runner.finish()
    for i, d in enumerate(dests):
        assert torch.equal(d, x[i] * 5.0), i
    streams = []

    def sink(out):
        if device == "cuda":
            streams.append(torch.cuda.current_stream())
        dests[0].copy_(out[0], non_blocking=device == "cuda")

    assert runner("decode", lambda t: t + 1, x, sink=sink, defer=True) is None
    runner.finish()
    assert torch.equal(dests[0], x[0] + 1)
    if device == "cuda":
        assert streams[0] != runner._stream and streams[0] == runner._copies
