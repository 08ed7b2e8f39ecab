"""Arguments of `KVCache` calls as engines pass them (tensor and numpy ids, numpy layers) and the clear errors for
the rest (an adversarial pass's findings; each test failed before its fix)."""

import numpy as np
import pytest
import torch

from kvbackend import CacheConfig, Geometry, KVCache
from kvbackend.attention import decode_attention
from kvbackend.errors import InvalidKV, UnknownRequest


def cache():
    c = KVCache(Geometry(2, 2, 16, torch.float32),
                CacheConfig(codec="identity", page_size=4, chunk_pages=2, dense_pages=8, packed_pages=8, device="cpu"))
    a, _ = c.add_request([1, 2, 3])
    b, _ = c.add_request([4, 5, 6])
    for rid in (a, b):
        for layer in range(2):
            c.append(rid, layer, torch.randn(3, 2, 16), torch.randn(3, 2, 16))
    return c, a, b


def test_a_plan_of_tensor_ids_serves():
    """`plan` took a tensor of ids and kept its 0-d tensors: every gather and decode then called the plan stale
    ("request 0 was freed")."""
    c, a, b = cache()
    ids = torch.tensor([a, b])
    for layer in range(2):
        c.append_step(ids, layer, torch.randn(2, 2, 16), torch.randn(2, 2, 16))
    plan = c.plan(ids, 0)
    assert plan.request_ids == [a, b]
    k, _ = c.gather(plan, 0)
    assert torch.equal(k, torch.cat([c.read(a, 0)[0], c.read(b, 0)[0]]))
    q = torch.randn(2, 4, 16)
    out, _ = c.decode(plan, 0, q)
    for row, rid in enumerate((a, b)):
        want, _ = decode_attention(q[row : row + 1], *[x[None] for x in c.read(rid, 0)])
        torch.testing.assert_close(out[row : row + 1], want.to(out.dtype), atol=1e-5, rtol=1e-5)


def test_numpy_layers_as_numpy_ids():
    c, a, _ = cache()
    c.append(np.int64(a), np.int64(1), torch.randn(1, 2, 16), torch.randn(1, 2, 16))
    assert c.read(a, np.int64(1))[0].shape[0] == 4


def test_clear_errors():
    c, a, b = cache()
    with pytest.raises(UnknownRequest, match="request ids are ints, got '0'"):  # was "request 0 is unknown"
        c.append("0", 0, torch.randn(1, 2, 16), torch.randn(1, 2, 16))
    for page in (-1, 8, 1.0, True, "0", np.float64(1.0)):  # -1 exported the last page; past the end an IndexError
        with pytest.raises(ValueError, match="out of range"):
            c.export_page(page)
    with pytest.raises(ValueError, match="not live"):
        c.export_page(5)  # in range, never packed
    for first in (1.5, True, -1):
        with pytest.raises(InvalidKV, match="first_page must be an int"):
            c.read_packed(a, 0, first_page=first)
    with pytest.raises(InvalidKV, match="got list"):
        c.append_step([a], 0, [[0.0] * 16] * 2, torch.randn(1, 2, 16))
    with pytest.raises(InvalidKV, match="sequence of integers"):
        c.add_request(None)
    r, _ = c.add_request(list(range(100, 109)))
    for layer in range(2):  # 9 tokens: a chunk of 2 pages is packed, keyed by its tokens
        c.append(r, layer, torch.randn(9, 2, 16), torch.randn(9, 2, 16))
    page = c.page_table(r).packed[0]
    with pytest.raises(ValueError, match="not cached"):  # a request holds it: was an AssertionError
        c.drop_cached(page)
    # numpy and 0-d tensor page ids name the page, as for request ids and layers (they were "out of range")
    assert torch.equal(c.export_page(np.int64(page)), c.export_page(page))
    assert torch.equal(c.export_page(torch.tensor(page)), c.export_page(page))
    for first in (np.int64(0), torch.tensor(0)):  # as request ids: were "first_page must be an int"
        assert all(torch.equal(x, y) for x, y in zip(c.read_packed(r, 1, first_page=first), c.read_packed(r, 1)))
    c.free(r)
    assert page in [p for p, _ in c.evictable_pages()]
    c.drop_cached(np.int32(page))  # cached now
    assert page not in [p for p, _ in c.evictable_pages()]
    c.check()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_request_without_tokens_in_a_decode_batch_is_refused_on_both_backends(backend):
    """The torch backend answered zeros (lse -inf) for a request that holds no tokens, the kernels raised: a made-up
    answer on one backend, an error on the other. Both refuse it now, naming the request."""
    if backend == "triton":
        pytest.importorskip("triton")
    # the Triton backend on the GPU where there is one (else in Triton's interpreter on the CPU)
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    c = KVCache(Geometry(1, 2, 32, torch.float16), CacheConfig(codec="kivi:bits=4,group=16", page_size=16,
                                                               chunk_pages=1, dense_pages=8, packed_pages=8,
                                                               backend=backend, device=device))
    a, _ = c.add_request()
    empty, _ = c.add_request()
    c.append(a, 0, torch.randn(20, 2, 32).half().to(device), torch.randn(20, 2, 32).half().to(device))
    with pytest.raises(InvalidKV, match=f"request {empty} holds none in layer 0"):
        c.decode(c.plan([a, empty], 0), 0, torch.randn(2, 2, 32).half().to(device))
    out, _ = c.decode(c.plan([a], 0), 0, torch.randn(1, 2, 32).half().to(device))  # the rest of the batch serves
    assert out.shape == (1, 2, 32) and torch.isfinite(out).all()
