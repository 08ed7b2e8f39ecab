"""kvbackend as an SGLang HiCache storage backend, created through SGLang's own factory."""

import logging
import threading

import pytest
import torch

hicache = pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
factory = pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory")

from kvbackend.errors import SpecError  # noqa: E402
from kvbackend.integration.sglang import KVBackendStorage  # noqa: E402
from kvbackend.integration.storage_options import DeviceCodec  # noqa: E402


class HostPool:
    """The host-pool surface SGLang hands to storage backends, as `MHATokenToKVPoolHost` implements it
    (kv_buffer shapes and the three data-page methods, same code). SGLang's own class cannot be built
    here: its constructor needs a device KV pool with CUDA pointer tables."""

    def __init__(self, layout, pages=12, page_size=16, layers=3, heads=2, head_dim=64, dtype=torch.bfloat16):
        self.layout, self.page_size, self.layer_num, self.head_num, self.head_dim = layout, page_size, layers, heads, head_dim
        self.dtype, self.device, self.pin_memory = dtype, "cpu", False
        self.size = pages * page_size
        dims = (2, layers, self.size, heads, head_dim) if layout == "layer_first" else (2, self.size, layers, heads, head_dim)
        self.kv_buffer = torch.zeros(dims, dtype=dtype)

    def get_data_page(self, index, flat=True):
        if self.layout == "layer_first":
            page = self.kv_buffer[:, :, index : index + self.page_size]
        else:
            page = self.kv_buffer[:, index : index + self.page_size]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self):
        return torch.zeros((2, self.layer_num, self.page_size, self.head_num, self.head_dim), dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index, data_page):
        if self.layout == "layer_first":
            self.kv_buffer[:, :, index : index + self.page_size] = data_page.reshape(
                2, self.layer_num, self.page_size, self.head_num, self.head_dim)
        else:
            self.kv_buffer[:, index : index + self.page_size] = data_page.reshape(
                2, self.page_size, self.layer_num, self.head_num, self.head_dim)

    def page(self, index):  # [2, L, P, H, D] regardless of layout
        if self.layout == "layer_first":
            return self.kv_buffer[:, :, index : index + self.page_size].clone()
        return self.kv_buffer[:, index : index + self.page_size].transpose(1, 2).clone()


def make_backend(tmp_path, host, codec="kivi:bits=4,group=16", **extra):
    config = hicache.HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=host.layout == "page_first", model_name="test/model",
        extra_config={"backend_name": "kvbackend", "module_path": "kvbackend.integration.sglang",
                      "class_name": "KVBackendStorage", "interface_v1": 1, "codec": codec,
                      "directory": str(tmp_path), **extra})
    backend = factory.StorageBackendFactory.create_backend("dynamic", config, host)
    backend.register_mem_pool_host(host)
    return backend


def host_indices(pages, page_size=16):
    return torch.cat([torch.arange(p * page_size, (p + 1) * page_size) for p in pages])


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("codec,dtype", [("identity", torch.bfloat16), ("fp16", torch.float16),
                                         ("kivi:bits=4,group=16", torch.bfloat16),
                                         ("rtn:bits=2,group=64,scale=fp8", torch.bfloat16),
                                         ("alignpred:error=1x", torch.bfloat16),
                                         ("alignpred:error=4x", torch.float16)])
def test_v1_round_trip(tmp_path, layout, codec, dtype):
    host = HostPool(layout, dtype=dtype)
    host.kv_buffer.normal_()
    backend = make_backend(tmp_path, host, codec)
    assert isinstance(backend, KVBackendStorage)
    keys = [f"page-{i}" for i in range(6)]
    originals = [host.page(i * 16) for i in range(6)]
    assert backend.batch_set_v1(keys, host_indices(range(6))) == [True] * 6
    assert backend.batch_exists(keys) == 6
    host.kv_buffer.zero_()
    assert backend.batch_get_v1(keys, host_indices(range(6, 12))) == [True] * 6
    for i, original in enumerate(originals):
        got = host.page((6 + i) * 16)
        if codec in ("identity", "fp16"):  # the pool's own dtype stored unchanged: bit-exact
            assert torch.equal(got, original)
        elif codec.startswith("alignpred"):  # the NRMSE budget per page, plus the pool dtype's rounding
            from kvbackend.alignpred import fp8_nrmse

            multiple = float(codec.split("=")[1][:-1])
            for x, y in zip(original.float(), got.float()):  # K, then V
                budget = multiple * fp8_nrmse(x.numpy())
                assert float((y - x).norm() / x.norm()) <= budget * 1.01
        else:
            err = float((got.float() - original.float()).norm() / original.float().norm())
            assert err < (0.12 if "bits=4" in codec else 0.6)
    stats = backend.get_stats()
    assert stats["hits"] == 6 and stats["pages_set"] == 6 and stats["bytes_stored"] > 0


def test_generic_interface_and_prefix_after_eviction(tmp_path):
    host = HostPool("layer_first")
    backend = make_backend(tmp_path, host, "identity")
    pages = [torch.randn(2 * 3 * 16 * 2 * 64).bfloat16() for _ in range(4)]
    for i, page in enumerate(pages):
        assert backend.set(f"k{i}", page)
    assert backend.exists("k2") and not backend.exists("missing")
    got = backend.batch_get(["k0", "k3", "missing"])
    assert torch.equal(got[0], pages[0]) and torch.equal(got[1], pages[3]) and got[2] is None
    target = torch.empty_like(pages[1])
    assert backend.get("k1", target) is target and torch.equal(target, pages[1])
    assert backend.batch_exists(["k0", "k1", "k2", "k3"]) == 4
    backend.tier.evict(1)  # the least recently used page group: k2 (k0, k1, k3 were read since)
    assert backend.batch_exists(["k0", "k1", "k2", "k3"]) == 2
    assert backend.batch_exists(["k3", "k0"]) == 2


def test_corrupted_page_is_a_miss_never_data(tmp_path):
    import os

    host = HostPool("layer_first")
    host.kv_buffer.normal_()
    backend = make_backend(tmp_path, host)
    backend.batch_set_v1(["a", "b"], host_indices([0, 1]))
    files = sorted(os.path.join(backend.directory, f) for f in os.listdir(backend.directory))
    data = bytearray(open(files[0], "rb").read())
    data[-5] ^= 0xFF
    open(files[0], "wb").write(bytes(data))
    host.kv_buffer[:, :, 32:64] = 7.0
    results = backend.batch_get_v1(["a", "b"], host_indices([2, 3]))
    assert results.count(False) == 1
    bad = 2 + results.index(False)
    assert torch.all(host.kv_buffer[:, :, bad * 16 : (bad + 1) * 16] == 7.0)  # untouched
    assert backend.get_stats()["misses"] == 1


def test_concurrent_callers(tmp_path):
    host = HostPool("page_first", pages=64)
    host.kv_buffer.normal_()
    backend = make_backend(tmp_path, host, "identity")
    reference = {i: host.page(i * 16) for i in range(32)}
    errors = []

    def worker(seed):
        rng = torch.Generator().manual_seed(seed)
        for _ in range(20):
            i = int(torch.randint(0, 32, (1,), generator=rng))
            if not backend.batch_set_v1([f"p{i}"], host_indices([i])) == [True]:
                errors.append("set failed")
            dest = 32 + seed  # each thread reads into its own page
            if backend.batch_get_v1([f"p{i}"], host_indices([dest]))[0]:
                if not torch.equal(host.page(dest * 16), reference[i]):
                    errors.append(f"wrong data for p{i}")

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]


def test_refuses_unsupported_layout_and_bad_spec(tmp_path):
    host = HostPool("layer_first")
    host.layout = "page_head"
    with pytest.raises(ValueError, match="layer_first"):
        make_backend(tmp_path, host)
    from kvbackend import SpecError

    with pytest.raises((SpecError, ValueError), match="unknown codec"):
        make_backend(tmp_path, HostPool("layer_first"), codec="zip")
    with pytest.raises((SpecError, ValueError)):
        make_backend(tmp_path, HostPool("layer_first"), codec="kivi:bits=2,group=32")  # group > page of 16


def test_v1_never_returns_none(tmp_path):
    backend = KVBackendStorage(hicache.HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=False, model_name=None, extra_config={"directory": str(tmp_path)}))
    assert backend.batch_get_v1(["x"], torch.arange(16)) == [False]  # no host pool registered yet
    assert backend.batch_set_v1(["x"], torch.arange(16)) == [False]


# -- unsafe directories, bad config, namespaces, layouts that changed --------------------------------


def storage_config(model_name="test/model", **extra):
    return hicache.HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=False, model_name=model_name, extra_config=extra)


def test_refuses_a_directory_others_can_write_or_do_not_own(tmp_path, monkeypatch):
    """A page planted in a directory another user controls must never reach the host pool."""
    import os

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ValueError, match="directory.*writable"):
        KVBackendStorage(storage_config(directory=str(shared)))
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(mine)
    with pytest.raises(ValueError, match="directory.*symbolic link"):
        KVBackendStorage(storage_config(directory=str(link)))
    uid = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: uid + 1)
    with pytest.raises(ValueError, match="directory.*owned"):
        KVBackendStorage(storage_config(directory=str(mine)))
    monkeypatch.undo()
    fresh = tmp_path / "fresh"
    backend = KVBackendStorage(storage_config(directory=str(fresh)))
    assert (fresh.stat().st_mode & 0o777) == 0o700 and (os.stat(backend.directory).st_mode & 0o777) == 0o700


@pytest.mark.parametrize("option,value", [("budget_gb", float("nan")), ("budget_gb", float("inf")),
                                          ("budget_gb", "ten"), ("budget_gb", 0), ("budget_gb", -2),
                                          ("directory", None), ("directory", "")])
def test_refuses_bad_config(tmp_path, option, value):
    extra = {"directory": str(tmp_path), option: value}
    with pytest.raises(ValueError, match=option):
        KVBackendStorage(storage_config(**extra))


def test_model_names_never_share_a_namespace(tmp_path):
    host = HostPool("layer_first")
    host.kv_buffer.normal_()
    backends = {}
    for name in ("org/m", "org-m"):
        config = storage_config(name, backend_name="kvbackend", module_path="kvbackend.integration.sglang",
                                class_name="KVBackendStorage", directory=str(tmp_path), codec="identity")
        backends[name] = factory.StorageBackendFactory.create_backend("dynamic", config, host)
        backends[name].register_mem_pool_host(host)
    assert backends["org/m"].namespace != backends["org-m"].namespace
    assert backends["org/m"].batch_set_v1(["p"], host_indices([0])) == [True]
    assert backends["org-m"].batch_exists(["p"]) == 0
    assert backends["org-m"].batch_get_v1(["p"], host_indices([1])) == [False]


def test_directory_removed_while_running_is_recreated(tmp_path):
    import os
    import shutil

    host = HostPool("layer_first")
    host.kv_buffer.normal_()
    root = tmp_path / "root"
    backend = make_backend(root, host, "identity")
    assert backend.batch_set_v1(["a"], host_indices([0])) == [True]
    shutil.rmtree(root)
    assert backend.batch_set_v1(["b"], host_indices([1])) == [True]
    assert (root.stat().st_mode & 0o777) == 0o700 and os.path.isdir(backend.directory)
    assert backend.batch_get_v1(["b"], host_indices([2])) == [True]
    assert torch.equal(host.page(2 * 16), host.page(1 * 16))
    root.chmod(0o777)  # made writable by others meanwhile: nothing more is written there
    assert backend.batch_set_v1(["c"], host_indices([3])) == [False]
    assert backend.set("c", host.get_data_page(3 * 16)) is False


@pytest.mark.parametrize("codec", ["kivi:bits=4,group=16", "alignpred:error=2x"])
def test_fingerprint_covers_layers_and_dtype(tmp_path, codec):
    """Pages stored for one geometry are never offered to another: not even as an existence hit."""
    host = HostPool("layer_first", layers=3)
    host.kv_buffer.normal_()
    assert make_backend(tmp_path, host, codec).batch_set_v1(["p"], host_indices([0])) == [True]
    for other in (HostPool("layer_first", layers=2), HostPool("layer_first", dtype=torch.float16)):
        other.kv_buffer.fill_(7.0)
        backend = make_backend(tmp_path, other, codec)
        assert backend.batch_exists(["p"]) == 0
        assert backend.batch_get_v1(["p"], host_indices([1])) == [False]
        assert torch.all(other.kv_buffer == 7.0)


def test_blob_of_the_wrong_length_is_a_miss(tmp_path):
    host = HostPool("layer_first")
    backend = make_backend(tmp_path, host, "kivi:bits=4,group=16")
    for i in range(2):
        good = backend._encode(host.page(0), backend._key(f"bad{i}"))
        blob = torch.cat([good, good[:32]]) if i == 0 else good[:-32]
        assert backend.tier.put([backend._key(f"bad{i}")], [blob]).result() == [True]
    host.kv_buffer.fill_(7.0)
    assert backend.batch_get_v1(["bad0", "bad1"], host_indices([1, 2])) == [False, False]
    assert torch.all(host.kv_buffer == 7.0)
    assert backend.batch_get(["bad0", "bad1"]) == [None, None]


@pytest.mark.parametrize("codec", ["kivi:bits=4,group=16", "alignpred:error=1x"])
def test_page_filed_under_another_key_is_a_miss(tmp_path, codec):
    """Every blob names its key (a page group's trailer; an AlignPred stream's key header): a page stored
    under another key (a misrouted write, a swapped file entry) is never loaded as that key's page."""
    host = HostPool("layer_first")
    host.kv_buffer.normal_()
    backend = make_backend(tmp_path, host, codec)
    assert backend.batch_set_v1(["a"], host_indices([0])) == [True]
    page = backend._encode(host.page(0), backend._key("a"))
    assert backend.tier.put([backend._key("b")], [page]).result() == [True]
    host.kv_buffer[:, :, 16:].fill_(7.0)  # host pages 1.. hold sevens
    assert backend.batch_get_v1(["b", "a"], host_indices([1, 2])) == [False, True]
    assert torch.all(host.page(16) == 7.0)  # nothing loaded for "b"
    assert torch.equal(host.page(32), backend._decode(page, backend._key("a")).to(host.dtype))  # "a" came back


def test_context_parallel_ranks_never_share_a_namespace(tmp_path):
    """Each attention-CP rank holds its own slice of every page under the same key: separate namespaces."""
    from dataclasses import replace

    base = storage_config(directory=str(tmp_path))
    names = {KVBackendStorage(replace(base, attn_cp_rank=r, attn_cp_size=2)).namespace for r in (0, 1)}
    names |= {KVBackendStorage(replace(base, dp_rank=1)).namespace, KVBackendStorage(base).namespace}
    assert len(names) == 4


def test_levers_are_applied_or_refused_never_dropped(tmp_path):
    """Pages reach storage without positions: vrot=hadamard is applied (values rotated before encoding,
    back after decoding); sink= and prerope= cannot be, and are refused by name rather than ignored."""
    for spec in ("kivi:bits=2,group=16,sink=4", "kivi:bits=2,group=16,prerope=true", "kivi:bits=2,group=16,psac=4"):
        with pytest.raises(SpecError, match="without their positions"):
            make_backend(tmp_path, HostPool("layer_first"), spec)
    from kvbackend import codecs
    from kvbackend.levers import rotate_values

    host = HostPool("layer_first")
    host.kv_buffer.normal_()
    original = host.page(0)
    got, fingerprints = {}, {}
    for spec in ("kivi:bits=2,group=16", "kivi:bits=2,group=16,vrot=hadamard"):
        backend = make_backend(tmp_path / spec.replace(":", "_"), host, spec)
        assert backend.batch_set_v1(["p"], host_indices([0])) == [True]
        (page,) = backend.batch_get(["p"])
        got[spec] = backend._page_from_flat(page)  # [2, L, P, H, D]
        fingerprints[spec] = backend.tier.fingerprint
    plain = codecs.get("kivi:bits=2,group=16")
    layout = plain.layout(make_backend(tmp_path / "x", host).geometry, 16)
    for layer in range(3):  # what rotating, encoding, decoding and rotating back gives
        k, v = plain.decode(plain.encode(original[0, layer].float(), rotate_values(original[1, layer]), layout))
        want_v = rotate_values(v).bfloat16()
        assert torch.equal(got["kivi:bits=2,group=16,vrot=hadamard"][1, layer], want_v)
        assert torch.equal(got["kivi:bits=2,group=16,vrot=hadamard"][0, layer], k)  # keys untouched
    assert not torch.equal(got["kivi:bits=2,group=16"][1], got["kivi:bits=2,group=16,vrot=hadamard"][1])
    assert len(set(fingerprints.values())) == 2


@pytest.mark.parametrize("codec", ["kivi:bits=2,group=16", "rtn:bits=2,group=64,scale=fp8,vrot=hadamard"])
def test_batched_pages_store_the_bytes_of_page_by_page(tmp_path, codec, monkeypatch):
    """A page-local codec encodes every layer of every page in one call (BATCH_PAGES at a time): the blobs
    on disk and the pages read back are those of the page-by-page path; a non-finite page fails alone."""
    import kvbackend.integration.sglang as module

    monkeypatch.setattr(module, "BATCH_PAGES", 3)
    monkeypatch.setattr(module, "CPU_BATCH_PAGES", {"encode": 64, "decode": 64})  # the same batches on the CPU
    host = HostPool("page_first", pages=16)
    host.kv_buffer.normal_()
    host.kv_buffer[:, 6 * 16 + 3] = float("nan")  # page 6 cannot be stored
    batched = make_backend(tmp_path / "a", host, codec)
    single = make_backend(tmp_path / "b", host, codec)
    assert batched._batched()
    monkeypatch.setattr(single, "_batched", lambda: False)
    keys = [f"p{i}" for i in range(8)]
    assert batched.batch_set_v1(keys, host_indices(range(8))) == [True] * 6 + [False, True]
    assert single.batch_set_v1(keys, host_indices(range(8))) == [True] * 6 + [False, True]
    for i in (0, 4, 7):
        a = batched.tier.blob_size(batched._key(keys[i]))
        buffers = [torch.empty(a, dtype=torch.uint8) for _ in range(2)]
        assert batched.tier.get([batched._key(keys[i])], buffers[:1]).result() == [True]
        assert single.tier.get([single._key(keys[i])], buffers[1:]).result() == [True]
        assert torch.equal(buffers[0], buffers[1])
    got = batched._load(keys)
    want = single._load(keys)
    assert got[6] is None and want[6] is None
    for a, b in zip(got, want):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
    assert float((got[0] - host.page(0)).norm() / host.page(0).float().norm()) < 0.7


def test_codecs_with_codebooks_store_batches_as_page_by_page(tmp_path, monkeypatch):
    """A codec with a codebook per page (QuantWM, the recommended spec's family) encodes every layer of a batch of
    pages in one pass (`Codec.encode_units`): the blobs are those of page-by-page encoding, a non-finite page
    fails alone, and the pages load back."""
    import kvbackend.integration.sglang as module

    monkeypatch.setattr(module, "BATCH_PAGES", 3)
    monkeypatch.setattr(module, "CPU_BATCH_PAGES", {"encode": 64, "decode": 64})  # the same batches on the CPU
    codec = "quantwm:kchannel=16,rank=4,keep=0.0625,centroids=32,clip=true,vcluster=false,vrot=hadamard,cdtype=fp8,outliers=16"
    host = HostPool("layer_first", pages=16)
    host.kv_buffer.normal_()
    host.kv_buffer[:, :, 4 * 16 + 9] = float("inf")  # page 4 cannot be stored
    # both on the CPU: a GPU's k-means may round differently from the CPU's (valid bytes, not the same bytes); the
    # device's own batches are checked at the end
    batched = make_backend(tmp_path / "a", host, codec, device="cpu")
    single = make_backend(tmp_path / "b", host, codec, device="cpu")
    assert batched.group.has_codebooks and not batched._batched() and batched._batched_encode()
    monkeypatch.setattr(single, "_batched_encode", lambda: False)
    calls = []
    encode_units = batched.codec.encode_units
    monkeypatch.setattr(batched.codec, "encode_units", lambda *a: calls.append(1) or encode_units(*a))
    keys = [f"p{i}" for i in range(7)]
    assert batched.batch_set_v1(keys, host_indices(range(7))) == [True] * 4 + [False, True, True]
    assert single.batch_set_v1(keys, host_indices(range(7))) == [True] * 4 + [False, True, True]
    assert len(calls) == 3  # batches of 3, 3 and 1 pages; the failed batch went page by page
    for i in (0, 3, 5, 6):
        size = batched.tier.blob_size(batched._key(keys[i]))
        assert size == single.tier.blob_size(single._key(keys[i]))
        buffers = [torch.empty(size, dtype=torch.uint8) for _ in range(2)]
        assert batched.tier.get([batched._key(keys[i])], buffers[:1]).result() == [True]
        assert single.tier.get([single._key(keys[i])], buffers[1:]).result() == [True]
        assert torch.equal(buffers[0], buffers[1]), i
    got = batched._load(keys)
    assert got[4] is None and all(got[i] is not None for i in (0, 1, 2, 3, 5, 6))
    error = (got[0].float() - host.page(0).float()).norm() / host.page(0).float().norm()
    assert float(error) < 0.35, error
    device = make_backend(tmp_path / "c", host, codec)  # "auto": the GPU where there is one
    assert device.batch_set_v1(keys, host_indices(range(7))) == [True] * 4 + [False, True, True]
    loaded = device._load(keys)
    assert loaded[4] is None
    for i in (0, 3, 5, 6):
        want = host.page(16 * i).float()  # (the pool's page at token 16 i)
        error = (loaded[i].float() - want).norm() / want.norm()
        assert float(error) < 0.35, (i, error)


@pytest.mark.parametrize("page_size", [16, 64])
def test_fused_cpu_decode_loads_the_torch_pages(tmp_path, monkeypatch, page_size):
    """The recommended spec's codec decodes on the CPU through the fused loop (`kvbackend.codecs.qvg_fused`), batch
    by batch and page by page: the pool gets the bits of the torch decode and rotation."""
    import kvbackend.integration.sglang as module

    codec = (f"quantwm:kchannel={page_size},centroids=32,clip=true,vcluster=false,vrot=hadamard,cdtype=fp8,"
             "outliers=16")
    host = HostPool("layer_first", pages=9, page_size=page_size, heads=2, head_dim=128)
    host.kv_buffer.normal_()
    backend = make_backend(tmp_path / "kv", host, codec, device="cpu")
    keys = [f"p{i}" for i in range(3)]
    assert backend.batch_set_v1(keys, host_indices(range(3), page_size)) == [True] * 3
    calls = []
    fused = module.decode_units_bf16
    monkeypatch.setattr(module, "decode_units_bf16", lambda *a: calls.append(1) or fused(*a))
    assert backend.batch_get_v1(keys, host_indices(range(3, 6), page_size)) == [True] * 3
    assert calls, "the fused decode did not serve"
    with monkeypatch.context() as patch:  # page by page (`KVBackendStorage._decode`)
        patch.setattr(backend, "_batched_decode", lambda: False)
        one_by_one = backend._load(keys)
    assert len(calls) > 1
    monkeypatch.setenv("KVBACKEND_FASTQUANT", "0")  # the torch decode
    assert backend.batch_get_v1(keys, host_indices(range(6, 9), page_size)) == [True] * 3
    for i in range(3):
        want = host.page((6 + i) * page_size).view(torch.int16)
        assert torch.equal(host.page((3 + i) * page_size).view(torch.int16), want), i
        assert torch.equal(one_by_one[i].view(torch.int16), want), i


@pytest.mark.parametrize("codec", ["kivi:bits=2,group=16", "quantwm:kchannel=16,centroids=32,cdtype=fp8,outliers=16"])
def test_get_delivers_batches_while_the_next_decodes(tmp_path, monkeypatch, codec):
    """batch_get_v1 over several decode batches (the next one decoding beside the delivery of the last) fills
    the host pool with exactly the pages of one-batch loading; a missing and a corrupt page are misses alone and
    their slots stay untouched."""
    import kvbackend.integration.sglang as module

    host = HostPool("layer_first", pages=24)
    host.kv_buffer.normal_()
    backend = make_backend(tmp_path, host, codec, device="cpu")
    keys = [f"p{i}" for i in range(7)]
    assert backend.batch_set_v1(keys[:3], host_indices(range(3))) == [True] * 3
    assert backend.batch_set_v1(keys[3:4], host_indices(range(3, 4))) == [True]  # a file of its own
    assert backend.batch_set_v1(keys[4:], host_indices(range(4, 7))) == [True] * 3
    where = backend.tier._index[backend._key("p3")]  # one bit of p3's blob
    data = bytearray(open(where.path, "rb").read())
    data[where.offset + where.length // 2] ^= 0x10
    open(where.path, "wb").write(bytes(data))
    asked = keys[:5] + ["never"] + keys[5:]
    expected = [True] * 3 + [False, True, False, True, True]
    monkeypatch.setattr(module, "CPU_BATCH_PAGES", {"encode": 64, "decode": 64})
    monkeypatch.setattr(module, "BATCH_PAGES", 64)  # one batch
    assert backend.batch_get_v1(asked, host_indices(range(8, 16))) == expected
    want = host.kv_buffer[:, :, 8 * 16 : 16 * 16].clone()
    monkeypatch.setattr(module, "BATCH_PAGES", 2)
    host.kv_buffer[:, :, 16 * 16 :] = 7.0
    assert backend.batch_get_v1(asked, host_indices(range(16, 24))) == expected
    got = host.kv_buffer[:, :, 16 * 16 :]
    for slot in range(8):
        rows = slice(slot * 16, (slot + 1) * 16)
        if not expected[slot]:
            assert torch.all(got[:, :, rows] == 7.0), slot
        else:
            assert torch.equal(got[:, :, rows], want[:, :, rows]), slot


def test_the_cpu_decodes_a_page_per_call_and_a_gpu_a_batch(tmp_path, monkeypatch):
    """Batch sizes follow the device: on the CPU one page per decode call (its intermediates stay in cache),
    four per encode call; on a GPU BATCH_PAGES per call."""
    import kvbackend.integration.sglang as module

    monkeypatch.setattr(module, "BATCH_PAGES", 32)
    host = HostPool("layer_first", pages=12)
    host.kv_buffer.normal_()
    backend = make_backend(tmp_path, host, "kivi:bits=2,group=16", device="cpu")
    assert (backend._batch_pages("decode"), backend._batch_pages("encode")) == (1, 4)
    calls = []
    for name in ("decode_pages", "encode"):
        original = getattr(backend.codec, name)
        monkeypatch.setattr(backend.codec, name, lambda *a, f=original, n=name: calls.append(
            (n, a[0 if n == "encode" else 1].shape[0])) or f(*a))  # tokens encoded, pages decoded
    keys = [f"p{i}" for i in range(6)]
    assert backend.batch_set_v1(keys, host_indices(range(6))) == [True] * 6
    assert backend.batch_get_v1(keys, host_indices(range(6, 12))) == [True] * 6
    layers = host.layer_num
    assert [c for c in calls if c[0] == "decode_pages"] == [("decode_pages", layers)] * 6
    assert [c for c in calls if c[0] == "encode"] == [("encode", 4 * layers * 16), ("encode", 2 * layers * 16)]
    for i in range(6):
        want, got = host.page(16 * i).float(), host.page(16 * (6 + i)).float()
        assert float((got - want).norm() / want.norm()) < 0.7, i
    if torch.cuda.is_available():
        gpu = make_backend(tmp_path / "gpu", host, "kivi:bits=2,group=16", device="cuda")
        assert (gpu._batch_pages("decode"), gpu._batch_pages("encode")) == (32, 32)


def test_codecs_with_codebooks_load_batches_as_page_by_page(tmp_path, monkeypatch):
    """Pages of a codec with codebooks are decoded BATCH_PAGES at a time (every layer of every page a unit of
    one `Codec.decode_units` call): the values of page-by-page decoding; a batch that fails goes page by page,
    so a page that cannot be decoded is a miss alone."""
    import kvbackend.integration.sglang as module

    monkeypatch.setattr(module, "BATCH_PAGES", 3)
    monkeypatch.setattr(module, "CPU_BATCH_PAGES", {"encode": 64, "decode": 64})  # the same batches on the CPU
    codec = "quantwm:kchannel=16,rank=4,keep=0.0625,centroids=32,clip=true,vcluster=false,vrot=hadamard,cdtype=fp8,outliers=16"
    host = HostPool("page_first", pages=16)
    host.kv_buffer.normal_()
    backend = make_backend(tmp_path, host, codec, device="cpu")
    assert backend._batched_decode() and not backend._batched()
    keys = [f"p{i}" for i in range(7)]
    assert backend.batch_set_v1(keys, host_indices(range(7))) == [True] * 7
    blobs = []
    for key in keys:
        blob = torch.empty(backend.tier.blob_size(backend._key(key)), dtype=torch.uint8)
        assert backend.tier.get([backend._key(key)], [blob]).result() == [True]
        blobs.append(blob)
    calls = []
    decode_units = backend.codec.decode_units
    monkeypatch.setattr(backend.codec, "decode_units", lambda *a: calls.append(a[1].shape[0]) or decode_units(*a))
    got = backend._load(keys)
    assert calls == [3 * 3, 3 * 3, 3]  # units: pages x 3 layers, batches of 3, 3 and 1 pages
    for i, key in enumerate(keys):
        assert torch.equal(got[i], backend._decode(blobs[i], backend._key(key))), i

    def flaky(layout, pages, books):  # the units of page 4 (its first layer's page bytes) cannot be decoded
        if any(torch.equal(pages[j], blobs[4][: pages.shape[1]]) for j in range(pages.shape[0])):
            raise RuntimeError("cannot decode")
        return decode_units(layout, pages, books)

    monkeypatch.setattr(backend.codec, "decode_units", flaky)
    again = backend._load(keys)
    assert again[4] is None
    assert all(torch.equal(again[i], got[i]) for i in (0, 1, 2, 3, 5, 6))


@pytest.mark.parametrize("device,message", [("gpu", "device must be"), ("cuda:x", "device must be"), (3, "device must be"),
                                            ("meta", "device must be")])
def test_a_bad_device_is_refused_at_start(tmp_path, device, message):
    with pytest.raises(ValueError, match=message):
        make_backend(tmp_path, HostPool("layer_first"), device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_is_refused_where_there_is_none(tmp_path):
    with pytest.raises(ValueError, match="no CUDA device"):
        make_backend(tmp_path, HostPool("layer_first"), device="cuda")


def _batch_pages(host, count=5):
    return [host.page(i * 16) for i in range(count)], list(range(100, 100 + count))


def test_a_device_that_fails_falls_back_to_the_cpu(tmp_path, monkeypatch, caplog):
    """A batch the device cannot run (out of memory, a lost context) is encoded and decoded on the CPU with the
    same bytes, logged once; errors of the pages themselves are raised as on the CPU."""
    host = HostPool("layer_first")
    host.kv_buffer.normal_()
    cpu = make_backend(tmp_path / "cpu", host, "rtn:bits=2,group=64,scale=fp8", device="cpu")
    assert cpu.get_stats()["device"] == "cpu"
    failing = make_backend(tmp_path / "dev", host, "rtn:bits=2,group=64,scale=fp8", device="cpu")
    calls = []

    class Broken(DeviceCodec):
        def run(self, fn, *tensors, into=None, sink=None, defer=False):
            calls.append(fn)
            raise RuntimeError("CUDA error: out of memory")

    failing.device = Broken(torch.device("cuda", 0))
    pages, keys = _batch_pages(host)
    want = cpu._encode_batch(pages, keys)
    with caplog.at_level("ERROR"):
        got = failing._encode_batch(pages, keys)
        again = failing._encode_batch(pages, keys)
    assert len(calls) == 2 and all(torch.equal(a, b) for a, b in zip(want, got)) and len(got) == len(want)
    assert all(torch.equal(a, b) for a, b in zip(want, again))
    assert sum("using the CPU" in r.message for r in caplog.records) == 1  # logged once
    assert torch.equal(failing._decode_batch(want), cpu._decode_batch(want))

    class Refusing(Broken):
        def run(self, fn, *tensors, into=None, sink=None, defer=False):
            raise ValueError("non-finite values")

    failing.device = Refusing(torch.device("cuda", 0))
    with pytest.raises(ValueError, match="non-finite"):
        failing._encode_batch(pages, keys)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("codec", ["kivi:bits=4,group=16", "rtn:bits=2,group=64,scale=fp8"])
def test_the_gpu_stores_and_loads_the_bytes_of_the_cpu(tmp_path, codec):
    host = HostPool("page_first", pages=70)
    host.kv_buffer.normal_()
    cpu = make_backend(tmp_path / "cpu", host, codec, device="cpu")
    gpu = make_backend(tmp_path / "gpu", host, codec, device="cuda")
    assert gpu.get_stats()["device"].startswith("cuda")
    pages, keys = _batch_pages(host, 33)
    blobs = cpu._encode_batch(pages, keys)
    assert all(torch.equal(a, b) for a, b in zip(blobs, gpu._encode_batch(pages, keys)))
    assert torch.equal(cpu._decode_batch(blobs), gpu._decode_batch(blobs))
    names = [f"p{i}" for i in range(33)]
    assert gpu.batch_set_v1(names, host_indices(range(33))) == [True] * 33  # through the file tier and back
    assert gpu.batch_get_v1(names, host_indices(range(33, 66))) == [True] * 33
    want = cpu._decode_batch(blobs)
    assert all(torch.equal(host.page((33 + i) * 16), want[i]) for i in range(33))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_rotated_values_on_the_gpu_decode_as_on_the_cpu(tmp_path):
    """`vrot=hadamard` on the GPU: the decoded pages stay within a fraction of the codec's own error of the CPU's
    (the rotation itself gives the same bits on both: tests/test_levers.py)."""
    host = HostPool("layer_first", pages=40)
    host.kv_buffer.normal_()
    codec = "kivi:bits=2,group=16,vrot=hadamard"
    cpu = make_backend(tmp_path / "cpu", host, codec, device="cpu")
    gpu = make_backend(tmp_path / "gpu", host, codec, device="cuda")
    pages, keys = _batch_pages(host, 33)
    blobs_cpu, blobs_gpu = cpu._encode_batch(pages, keys), gpu._encode_batch(pages, keys)
    a, b = cpu._decode_batch(blobs_cpu).float(), gpu._decode_batch(blobs_gpu).float()
    original = torch.stack(pages).float()
    assert float((b - a).norm() / original.norm()) < 0.02  # 2-bit error is about 0.3 of the norm
    assert float((b - original).norm() / original.norm()) < 1.05 * float((a - original).norm() / original.norm())


def test_a_page_the_host_pool_refuses_misses_alone(tmp_path):
    """Host indices one page short: the pages before it load (pipelined decode batches on the CPU), the last one
    is a miss alone, and the hit and miss counts say exactly that."""
    host = HostPool("layer_first", pages=8)
    host.kv_buffer.normal_()
    backend = make_backend(tmp_path, host, "kivi:bits=4,group=16", device="cpu")
    keys = ["a", "b", "c"]
    assert backend.batch_set_v1(keys, host_indices(range(3))) == [True] * 3
    host.kv_buffer[:, :, 48:].fill_(7.0)
    assert backend.batch_get_v1(keys, host_indices([3, 4])) == [True, True, False]  # one page short
    assert not torch.all(host.page(16 * 3) == 7.0) and not torch.all(host.page(16 * 4) == 7.0)  # both written
    again = backend.batch_get_v1(keys[:2], host_indices([5, 6]))  # the same pages again: the same values
    assert again == [True, True] and all(torch.equal(host.page(16 * a), host.page(16 * b)) for a, b in ((3, 5), (4, 6)))
    stats = backend.get_stats()
    assert stats["hits"] == 4 and stats["misses"] == 1


def test_a_page_the_host_pool_refuses_misses_alone_without_batches(tmp_path):
    """The same on the page-by-page path (error-bounded pages): the pool refuses the second page only."""
    host = HostPool("layer_first", pages=8)
    host.kv_buffer.normal_()
    backend = make_backend(tmp_path, host, "alignpred:error=4x", device="cpu")
    assert backend.batch_set_v1(["a", "b"], host_indices(range(2))) == [True, True]
    original, calls = host.set_from_flat_data_page, []

    def refuse_second(index, data):
        calls.append(index)
        if len(calls) == 2:
            raise RuntimeError("the pool refuses this slot")
        original(index, data)

    host.set_from_flat_data_page = refuse_second
    assert backend.batch_get_v1(["a", "b"], host_indices([2, 3])) == [True, False]
    stats = backend.get_stats()
    assert stats["hits"] == 1 and stats["misses"] == 1


def test_a_page_the_host_pool_cannot_give_fails_alone(tmp_path):
    """A set whose host indices are one page short: the pages it can read are stored, the last is False."""
    host = HostPool("layer_first", pages=8)
    host.kv_buffer.normal_()
    backend = make_backend(tmp_path, host, "kivi:bits=4,group=16", device="cpu")
    assert backend.batch_set_v1(["a", "b", "c"], host_indices([0, 1])) == [True, True, False]
    assert backend.batch_exists(["a", "b", "c"]) == 2
    stats = backend.get_stats()
    assert stats["pages_set"] == 2 and stats["failures"] == 1


def test_the_compression_ratio_is_that_of_the_pages_held(tmp_path):
    """Raw pages stored as they are (identity) hold about 1x, whether a page is set again or pages are evicted to
    fit the budget: the ratio is of what the tier holds, not of every set ever made."""
    host = HostPool("layer_first", pages=8)
    host.kv_buffer.normal_()
    page_bytes = host.page(0).nbytes
    backend = make_backend(tmp_path / "again", host, "identity", device="cpu")
    for _ in range(4):
        assert backend.batch_set_v1(["a"], host_indices([0])) == [True]
    assert 0.95 < backend.get_stats()["compression_ratio"] <= 1.0
    small = make_backend(tmp_path / "evicting", host, "identity", device="cpu",
                         budget_gb=(2 * page_bytes + 400) / 2**30)
    for i in range(6):
        assert small.batch_set_v1([f"p{i}"], host_indices([i])) == [True]
    stats = small.get_stats()
    assert small.tier.stats().evictions >= 4 and 0.95 < stats["compression_ratio"] <= 1.0
    packed = make_backend(tmp_path / "kivi", host, "kivi:bits=2,group=16", device="cpu")
    assert packed.batch_set_v1(["a", "b"], host_indices([0, 1])) == [True, True]
    ratio = packed.get_stats()["compression_ratio"]
    assert abs(ratio - 2 * page_bytes / packed.tier.stats().bytes_used) < 1e-9 and ratio > 3


def test_error_bounded_pages_at_the_edge_of_fp16_stay_finite(tmp_path):
    """Values at fp16's largest finite value decode within their error bound to just past it; the page the pool
    gets saturates there, never inf (a page of inf K/V would be served as a hit)."""
    host = HostPool("layer_first", pages=4, dtype=torch.float16)
    flat = host.kv_buffer.view(-1)
    flat.copy_(torch.where(torch.rand(flat.shape, generator=torch.Generator().manual_seed(0)) < 0.5, 65504.0, -65504.0))
    backend = make_backend(tmp_path, host, "alignpred:error=1x", device="cpu")
    assert backend.batch_set_v1(["edge"], host_indices([0])) == [True]
    assert backend.batch_get_v1(["edge"], host_indices([1])) == [True]
    page = host.page(16)
    assert torch.isfinite(page).all() and page.abs().max() == 65504.0


# -- decoded pages straight into the host pool (`kvbackend.integration.pool_writer`) ------------------------
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_the_pool_writer_writes_what_the_pool_itself_would(layout):
    """`PoolWriter.write` of pages at any slots leaves the pool as `set_from_flat_data_page` of the same pages
    does, and touches nothing else."""
    from kvbackend.integration.pool_writer import PoolWriter

    pool, reference = HostPool(layout, pages=6, layers=3), HostPool(layout, pages=6, layers=3)
    pool.kv_buffer.normal_()
    reference.kv_buffer.copy_(pool.kv_buffer)
    writer = PoolWriter.of(pool, 3, 2, 64, torch.bfloat16)
    assert writer is not None and writer.layout == layout
    pages = torch.randn(3, 2, 3, 16, 2, 64).to(torch.bfloat16)
    starts = [writer.slot(s) for s in (80, 3, 40)]  # any token slot, not only page-aligned ones
    writer.write(pages, starts)
    for page, start in zip(pages, starts):
        ordered = page.transpose(1, 2) if layout == "page_first" else page
        reference.set_from_flat_data_page(start, ordered.contiguous().flatten())
    assert torch.equal(pool.kv_buffer, reference.kv_buffer)
    for bad in (-1, 96 - 15, 10**6):
        with pytest.raises(ValueError, match="outside the host pool"):
            writer.slot(bad)
    with pytest.raises(ValueError, match="for 2 slots"):
        writer.write(pages, starts[:2])


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_the_pool_writer_reads_pages_in_place(layout):
    """`PoolWriter.page` is the pool's page at any token slot, as a view of the pool's own memory (no copy)."""
    from kvbackend.integration.pool_writer import PoolWriter

    pool = HostPool(layout, pages=6, layers=3)
    pool.kv_buffer.normal_()
    writer = PoolWriter.of(pool, 3, 2, 64, torch.bfloat16)
    for start in (0, 3, 40, 80):
        page = writer.page(writer.slot(start))
        assert tuple(page.shape) == (2, 3, 16, 2, 64) and torch.equal(page, pool.page(start))
        assert page.untyped_storage().data_ptr() == pool.kv_buffer.untyped_storage().data_ptr()
    page = writer.page(16)
    pool.set_from_flat_data_page(16, torch.full((2 * 3 * 16 * 2 * 64,), 5.0, dtype=torch.bfloat16))
    assert bool((page == 5.0).all())


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_the_pool_writer_reads_pages_for_a_device(layout):
    """`PoolWriter.read` of pages at any slots (repeated, out of order, not page-aligned) is ``[2, N, L, P, H,
    D]``, K then V, equal to the pages stacked; on the host its strided copies are torch's."""
    from kvbackend.integration.pool_writer import PoolWriter

    pool = HostPool(layout, pages=6, layers=3)
    pool.kv_buffer.normal_()
    writer = PoolWriter.of(pool, 3, 2, 64, torch.bfloat16)
    starts = [writer.slot(s) for s in (80, 3, 40, 3, 0)]
    got = writer.read(starts, torch.device("cpu"))
    want = torch.stack([writer.page(s) for s in starts], 1)  # [2, N, L, P, H, D]
    assert tuple(got.shape) == (2, 5, 3, 16, 2, 64) and got.is_contiguous() and torch.equal(got, want)
    if torch.cuda.is_available():
        pinned = HostPool(layout, pages=6, layers=3)
        pinned.kv_buffer = pool.kv_buffer.pin_memory()
        on_device = PoolWriter.of(pinned, 3, 2, 64, torch.bfloat16).read(starts, torch.device("cuda"))
        torch.cuda.synchronize()
        assert on_device.is_cuda and torch.equal(on_device.cpu(), want)


class _OnHost(DeviceCodec):
    """A "device" that runs its work on the host: the direct path's logic on a machine without a GPU."""

    def run(self, fn, *tensors, into=None, sink=None, defer=False):
        return self._deliver(fn(*tensors), into, sink)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("codec", ["rtn:bits=2,group=64,scale=fp8",
                                   "quantwm:kchannel=16,centroids=32,cdtype=fp8,outliers=16,vcluster=false"])
def test_sets_from_a_page_locked_pool_are_read_by_the_device_with_the_bytes_of_staging(tmp_path, monkeypatch, caplog,
                                                                                      layout, codec):
    """Where the pool is page-locked and the codec runs on a device, a set's batch is copied from the pool by
    the device itself (`PoolWriter.read`, no host staging copy): the blobs are those of the staged path, for
    pages at any slots; a read that fails stages the pages instead (the same bytes, logged once)."""
    import kvbackend.integration.sglang as module
    from kvbackend.integration.pool_writer import PoolWriter

    monkeypatch.setattr(module, "BATCH_PAGES", 4)
    host = HostPool(layout, pages=12)
    host.kv_buffer.normal_()
    staged = make_backend(tmp_path / "staged", host, codec, device="cpu")
    direct = make_backend(tmp_path / "direct", host, codec, device="cpu")
    direct.device = _OnHost(torch.device("cuda", 0))
    monkeypatch.setattr(PoolWriter, "direct", property(lambda self: True))
    reads, read = [], PoolWriter.read
    monkeypatch.setattr(PoolWriter, "read", lambda self, starts, device, stream=None: reads.append(list(starts))
                        or read(self, starts, torch.device("cpu")))
    slots = [5, 0, 9, 2, 7, 3]
    names = [f"p{i}" for i in range(len(slots))]
    assert direct.batch_set_v1(names, host_indices(slots)) == [True] * len(slots)
    assert reads == [[16 * s for s in slots[:4]], [16 * s for s in slots[4:]]]
    assert staged.batch_set_v1(names, host_indices(slots)) == [True] * len(slots)
    for name in names:
        a, b = (torch.empty(x.tier.blob_size(x._key(name)), dtype=torch.uint8) for x in (staged, direct))
        assert staged.tier.get([staged._key(name)], [a]).result() == [True]
        assert direct.tier.get([direct._key(name)], [b]).result() == [True]
        assert torch.equal(a, b), name

    def broken(self, starts, device, stream=None):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(PoolWriter, "read", broken)
    pages = [host.page(16 * s) for s in slots[:4]]
    with caplog.at_level("ERROR"):
        got = direct._encode_batch(pages, list(range(4)), [16 * s for s in slots[:4]])
        again = direct._encode_batch(pages, list(range(4)), [16 * s for s in slots[:4]])
    want = staged._encode_batch(pages, list(range(4)))
    assert all(torch.equal(a, b) for a, b in zip(want, got)) and all(torch.equal(a, b) for a, b in zip(want, again))
    assert sum("staging the pages instead" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_a_page_locked_pool_is_read_by_the_gpu_with_the_bytes_of_staging(tmp_path, monkeypatch, layout):
    """On CUDA: a set from a page-locked pool takes the device's own copies (`PoolWriter.read`), and stores the
    bytes the staged path stores, for a codec with codebooks (the recipe's page-local one) and one without."""
    import kvbackend.integration.sglang as module
    from kvbackend.integration.pool_writer import PoolWriter

    monkeypatch.setattr(module, "BATCH_PAGES", 5)
    host = HostPool(layout, pages=14)
    host.kv_buffer = host.kv_buffer.pin_memory()
    host.kv_buffer.normal_()
    reads, read = [], PoolWriter.read
    monkeypatch.setattr(PoolWriter, "read", lambda self, *a, **k: reads.append(a[0]) or read(self, *a, **k))
    slots = [11, 0, 4, 7, 2, 9, 1]
    for codec in ("rtn:bits=2,group=64,scale=fp8", "quantwm:kchannel=16,centroids=32,cdtype=fp8,outliers=16,vcluster=false"):
        gpu = make_backend(tmp_path / f"gpu{len(reads)}", host, codec, device="cuda")
        assert gpu.writer is not None and gpu.writer.direct
        pages = [host.page(16 * s) for s in slots]
        starts = [16 * s for s in slots]
        before = len(reads)
        got = gpu._encode_batch(pages, list(range(len(slots))), starts)
        assert len(reads) == before + 1
        want = gpu._encode_batch(pages, list(range(len(slots))))
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(want, got))
        names = [f"{codec}{i}" for i in range(len(slots))]
        assert gpu.batch_set_v1(names, host_indices(slots)) == [True] * len(slots)
        assert gpu.batch_get_v1(names, host_indices(range(len(slots)))) == [True] * len(slots)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("codec", ["kivi:bits=2,group=16", "quantwm:kchannel=16,centroids=32,cdtype=fp8,outliers=16"])
def test_sets_read_the_pool_in_place_and_store_the_bytes_of_its_copies(tmp_path, monkeypatch, layout, codec):
    """batch_set_v1 reads pages where they lie in the pool (never through `get_data_page`) and stores the blobs
    that copies of them give; a host index outside the pool fails alone."""
    import kvbackend.integration.sglang as module

    monkeypatch.setattr(module, "BATCH_PAGES", 3)
    monkeypatch.setattr(module, "CPU_BATCH_PAGES", {"encode": 3, "decode": 3})
    host = HostPool(layout, pages=8)
    host.kv_buffer.normal_()
    in_place = make_backend(tmp_path / "a", host, codec, device="cpu")
    copied = make_backend(tmp_path / "b", host, codec, device="cpu")
    copied.writer = None
    assert in_place.writer is not None
    reads = []
    original = host.get_data_page
    host.get_data_page = lambda index, flat=True: reads.append(index) or original(index, flat)
    keys = [f"p{i}" for i in range(6)]
    indices = torch.cat([host_indices([0, 1, 2, 7, 5]), torch.arange(8 * 16, 9 * 16)])  # the last is outside
    assert in_place.batch_set_v1(keys, indices) == [True] * 5 + [False]
    assert reads == []
    assert copied.batch_set_v1(keys, indices)[:5] == [True] * 5
    assert reads  # the pool's own copies
    for key in keys[:5]:
        size = in_place.tier.blob_size(in_place._key(key))
        buffers = [torch.empty(size, dtype=torch.uint8) for _ in range(2)]
        assert in_place.tier.get([in_place._key(key)], buffers[:1]).result() == [True]
        assert copied.tier.get([copied._key(key)], buffers[1:]).result() == [True]
        assert torch.equal(buffers[0], buffers[1]), key
    assert in_place.get_stats()["pages_set"] == 5


def test_a_set_hands_each_batch_to_the_writer_before_encoding_the_next(tmp_path, monkeypatch):
    """Batches are written on the file tier's threads while the next batch encodes: every put comes before the
    next batch's encode and no result is waited for until all are handed over; a batch whose write fails is
    False alone."""
    import kvbackend.integration.sglang as module
    from kvbackend.tiers.base import Handle

    monkeypatch.setattr(module, "BATCH_PAGES", 2)
    monkeypatch.setattr(module, "CPU_BATCH_PAGES", {"encode": 2, "decode": 2})
    host = HostPool("layer_first", pages=8)
    host.kv_buffer.normal_()
    backend = make_backend(tmp_path, host, "kivi:bits=2,group=16", device="cpu")
    events = []
    encode, put = backend._encode_batch, backend.tier.put

    def encode_batch(pages, ints, starts=None):
        events.append(("encode", len(pages)))
        return encode(pages, ints, starts)

    class Later(Handle):  # a handle whose result is only asked for at the end
        def __init__(self, inner, fail):
            super().__init__(results=None)
            self.inner, self.fail = inner, fail

        def result(self):
            events.append(("wait",))
            out = self.inner.result()
            return [False] * len(out) if self.fail else out

    def put_batch(keys, blobs):
        events.append(("put", len(keys)))
        return Later(put(keys, blobs), fail=len([e for e in events if e[0] == "put"]) == 2)

    monkeypatch.setattr(backend, "_encode_batch", encode_batch)
    monkeypatch.setattr(backend.tier, "put", put_batch)
    keys = [f"p{i}" for i in range(5)]
    assert backend.batch_set_v1(keys, host_indices(range(5))) == [True, True, False, False, True]
    assert events == [("encode", 2), ("put", 2), ("encode", 2), ("put", 2), ("encode", 1), ("put", 1),
                      ("wait",), ("wait",), ("wait",)]
    stats = backend.get_stats()
    assert stats["pages_set"] == 3 and stats["failures"] == 2


@pytest.mark.parametrize("failure", ["submit", "result"])
def test_a_write_that_fails_midway_counts_the_pages_written_before_it(tmp_path, monkeypatch, failure):
    """The second batch's write raises (when handed over, or when its result is asked for): the first batch is on
    disk and reported True, every other page False, each failure counted once, and nothing raises into SGLang."""
    import kvbackend.integration.sglang as module

    monkeypatch.setattr(module, "BATCH_PAGES", 2)
    monkeypatch.setattr(module, "CPU_BATCH_PAGES", {"encode": 2, "decode": 2})
    host = HostPool("layer_first", pages=8)
    host.kv_buffer.normal_()
    backend = make_backend(tmp_path, host, "kivi:bits=2,group=16", device="cpu")
    put, calls = backend.tier.put, []

    class Raising:
        def result(self):
            raise RuntimeError("the disk went away")

    def put_batch(keys, blobs):
        calls.append(len(keys))
        if len(calls) == 2:
            if failure == "submit":
                raise RuntimeError("cannot schedule new futures after shutdown")
            return Raising()
        return put(keys, blobs)

    monkeypatch.setattr(backend.tier, "put", put_batch)
    keys = [f"p{i}" for i in range(5)]
    want = [True, True, False, False, False] if failure == "submit" else [True, True, False, False, True]
    assert backend.batch_set_v1(keys, host_indices(range(5))) == want
    assert calls == ([2, 2] if failure == "submit" else [2, 2, 1])
    assert [backend.exists(k) for k in keys] == want
    stats = backend.get_stats()
    assert stats["pages_set"] == sum(want) and stats["failures"] == 5 - sum(want)


def test_a_set_never_reports_pages_that_its_own_later_batches_evicted(tmp_path, monkeypatch):
    """A call whose pages exceed the budget: its later batches' files evict its earlier ones before it returns.
    Every page reported stored is held when the call returns, and the prefix SGLang looks up is as long as the
    call said."""
    import kvbackend.integration.sglang as module

    monkeypatch.setattr(module, "BATCH_PAGES", 2)
    monkeypatch.setattr(module, "CPU_BATCH_PAGES", {"encode": 2, "decode": 2})
    host = HostPool("layer_first", pages=16)
    host.kv_buffer.normal_()
    probe = make_backend(tmp_path / "probe", host, "kivi:bits=2,group=16", device="cpu")
    assert probe.batch_set_v1(["a", "b"], host_indices([0, 1])) == [True, True]
    group = probe.tier.stats().bytes_used  # one file of two pages
    backend = make_backend(tmp_path / "small", host, "kivi:bits=2,group=16", device="cpu",
                           budget_gb=2.5 * group / 2**30)  # room for two such files, not four
    keys = [f"p{i}" for i in range(8)]
    results = backend.batch_set_v1(keys, host_indices(range(8)))
    held = [backend.exists(k) for k in keys]
    assert results == held and sum(held) == 4, (results, held)
    assert backend.batch_exists(keys) == next((i for i, r in enumerate(results) if not r), len(keys))
    assert backend.get_stats()["pages_set"] == 4


def test_a_set_never_reports_a_held_page_that_its_own_write_evicted(tmp_path, monkeypatch):
    """"old" is held, so only "new" is written, and that write evicts "old"'s file: "old" is not reported stored."""
    import kvbackend.integration.sglang as module

    monkeypatch.setattr(module, "CPU_BATCH_PAGES", {"encode": 4, "decode": 4})
    host = HostPool("layer_first", pages=4)
    host.kv_buffer.normal_()
    probe = make_backend(tmp_path / "probe", host, "kivi:bits=2,group=16", device="cpu")
    assert probe.batch_set_v1(["old"], host_indices([0])) == [True]
    one_file = probe.tier.stats().bytes_used
    backend = make_backend(tmp_path / "small", host, "kivi:bits=2,group=16", device="cpu",
                           budget_gb=1.5 * one_file / 2**30)
    assert backend.batch_set_v1(["old"], host_indices([0])) == [True]
    assert backend.batch_set_v1(["new", "old"], host_indices([1, 0])) == [True, False]
    assert [backend.exists(k) for k in ("new", "old")] == [True, False]


def test_a_set_after_the_directory_was_removed_writes_its_pages_again(tmp_path):
    """The storage directory cleaned while serving: pages stored before are written again (not skipped as held
    by an index that still lists their files), and every page reported stored loads."""
    import shutil

    host = HostPool("layer_first", pages=8)
    host.kv_buffer.normal_()
    backend = make_backend(tmp_path, host, "kivi:bits=2,group=16", device="cpu")
    keys = ["p0", "p1", "p2"]
    assert backend.batch_set_v1(keys[:2], host_indices([0, 1])) == [True, True]
    shutil.rmtree(backend.directory)
    assert backend.batch_set_v1(keys, host_indices([0, 1, 2])) == [True, True, True]
    assert backend.batch_get_v1(keys, host_indices([4, 5, 6])) == [True, True, True]
    for i in range(3):
        assert torch.equal(host.page(16 * (4 + i)), backend._load([keys[i]])[0])


def test_the_pool_writer_declines_pools_it_cannot_address():
    """Another dtype, a buffer that is not one contiguous tensor of the layout's shape, or no buffer at all: no
    writer (the backend then goes through the pool's own methods)."""
    from kvbackend.integration.pool_writer import PoolWriter

    pool = HostPool("layer_first", pages=4, layers=3)
    assert PoolWriter.of(pool, 3, 2, 64, torch.float16) is None
    assert PoolWriter.of(pool, 4, 2, 64, torch.bfloat16) is None
    pool.kv_buffer = pool.kv_buffer.transpose(1, 2)
    assert PoolWriter.of(pool, 3, 2, 64, torch.bfloat16) is None
    pool.kv_buffer = [torch.zeros(2)]
    assert PoolWriter.of(pool, 3, 2, 64, torch.bfloat16) is None
    pool.layout = "page_first_direct"
    assert PoolWriter.of(pool, 3, 2, 64, torch.bfloat16) is None


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("codec", ["kivi:bits=2,group=16", "quantwm:kchannel=16,centroids=32,cdtype=fp8,outliers=16"])
@pytest.mark.parametrize("batch,ahead", [(1, 1), (2, 2), (3, 5), (64, 2), (2, 0)])
def test_gets_into_the_pool_hold_the_pages_of_one_by_one_loading(tmp_path, monkeypatch, layout, codec, batch, ahead):
    """batch_get_v1 through the pool writer (reads `READ_AHEAD` batches ahead of the decode) fills every slot
    with exactly the page `_load` decodes for its key; a missing blob, a corrupt one, one filed under another
    key and a host index outside the pool are misses alone, and their slots are not written."""
    import kvbackend.integration.sglang as module

    monkeypatch.setattr(module, "CPU_BATCH_PAGES", {"encode": 4, "decode": batch})
    monkeypatch.setattr(module, "BATCH_PAGES", batch)
    monkeypatch.setattr(module, "READ_AHEAD", ahead)
    host = HostPool(layout, pages=24)
    host.kv_buffer.normal_()
    backend = make_backend(tmp_path, host, codec, device="cpu")
    assert backend.writer is not None
    keys = [f"p{i}" for i in range(7)]
    assert backend.batch_set_v1(keys[:3], host_indices(range(3))) == [True] * 3
    assert backend.batch_set_v1(keys[3:4], host_indices(range(3, 4))) == [True]  # a file of its own
    assert backend.batch_set_v1(keys[4:], host_indices(range(4, 7))) == [True] * 3
    want = backend._load(keys)
    where = backend.tier._index[backend._key("p3")]  # one bit of p3's blob
    data = bytearray(open(where.path, "rb").read())
    data[where.offset + where.length // 2] ^= 0x10
    open(where.path, "wb").write(bytes(data))
    blob = torch.empty(backend.blob_bytes, dtype=torch.uint8)  # p1's bytes filed under q: the trailer names p1
    assert backend.tier.get([backend._key("p1")], [blob]).result() == [True]
    assert backend.tier.put([backend._key("q")], [blob]).result() == [True]
    asked = ["p0", "p1", "p2", "p3", "never", "p4", "q", "p6", "p0"]
    slots = [8, 9, 10, 11, 12, 13, 14, 15, 99]  # the last: outside the pool of 24 pages
    before = HostPool(layout, pages=24)
    before.kv_buffer = host.kv_buffer.clone()
    counted = backend.get_stats()
    indices = torch.cat([host_indices(slots[:-1]), torch.arange(99 * 16, 100 * 16)])
    expected = [True, True, True, False, False, True, False, True, False]
    assert backend.batch_get_v1(asked, indices) == expected
    for slot, key, hit in zip(slots[:-1], asked, expected):
        got = host.page(16 * slot)
        if hit:
            assert torch.equal(got, want[keys.index(key)]), (slot, key)
        else:
            assert torch.equal(got, before.page(16 * slot)), slot
    untouched = torch.ones(host.kv_buffer.shape[2 if layout == "layer_first" else 1], dtype=torch.bool)
    untouched[8 * 16 : 16 * 16] = False
    index = [slice(None)] * 5
    index[2 if layout == "layer_first" else 1] = untouched
    assert torch.equal(host.kv_buffer[tuple(index)], before.kv_buffer[tuple(index)])  # nothing outside the asked slots
    stats = backend.get_stats()
    assert (stats["hits"] - counted["hits"], stats["misses"] - counted["misses"]) == (5, 4)


def test_a_pool_the_writer_cannot_address_goes_through_the_pool(tmp_path, monkeypatch):
    """Where no writer applies, batch_get_v1 delivers through `set_from_flat_data_page`, with the same values."""
    host = HostPool("layer_first", pages=8)
    host.kv_buffer.normal_()
    backend = make_backend(tmp_path, host, "kivi:bits=4,group=16", device="cpu")
    assert backend.batch_set_v1(["a", "b"], host_indices(range(2))) == [True, True]
    assert backend.batch_get_v1(["a", "b"], host_indices([2, 3])) == [True, True]
    via_writer = host.kv_buffer[:, :, 32:64].clone()
    backend.writer, calls = None, []
    original = host.set_from_flat_data_page
    host.set_from_flat_data_page = lambda index, data: calls.append(index) or original(index, data)
    host.kv_buffer[:, :, 64:96] = 7.0
    assert backend.batch_get_v1(["a", "b"], host_indices([4, 5])) == [True, True]
    assert calls == [64, 80] and torch.equal(host.kv_buffer[:, :, 64:96], via_writer)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("codec", ["kivi:bits=2,group=16", "rtn:bits=2,group=64,scale=fp8"])
def test_the_gpu_decodes_straight_into_a_page_locked_pool(tmp_path, layout, codec):
    """A page-locked pool (as SGLang allocates it) is written from the GPU by asynchronous strided copies: the
    values equal the CPU backend's, in every asked slot, and a bad slot is a miss alone."""
    host = HostPool(layout, pages=80)
    host.kv_buffer = host.kv_buffer.pin_memory()
    host.kv_buffer.normal_()
    cpu = make_backend(tmp_path / "cpu", host, codec, device="cpu")
    gpu = make_backend(tmp_path / "gpu", host, codec, device="cuda")
    assert gpu.writer is not None and gpu.writer.direct
    names = [f"p{i}" for i in range(37)]
    assert gpu.batch_set_v1(names, host_indices(range(37))) == [True] * 37
    want = gpu._load(names)
    indices = torch.cat([host_indices(range(40, 76)), torch.arange(10**6, 10**6 + 16)])
    assert gpu.batch_get_v1(names, indices) == [True] * 36 + [False]
    for i in range(36):
        assert torch.equal(host.page(16 * (40 + i)), want[i]), i
    assert cpu.batch_set_v1(names[:3], host_indices(range(3))) == [True] * 3
    assert cpu.batch_get_v1(names[:3], host_indices(range(76, 79))) == [True] * 3
    for i in range(3):
        assert torch.equal(host.page(16 * (76 + i)), want[i]), i


def test_codebooks_that_outweigh_a_page_are_named_at_start_up(tmp_path, caplog):
    """Each storage page is its own chunk: 32 centroids on a 16-token page cost more than the page's codes. The
    backend says so once, with the bits per value it will store; page-local codecs start without a word."""
    recipe = "quantwm:kchannel=16,centroids=32,cdtype=fp8,outliers=16,vcluster=false"
    with caplog.at_level(logging.WARNING, logger="kvbackend.integration.sglang"):
        make_backend(tmp_path / "a", HostPool("layer_first"), "kivi:bits=4,group=16")
        make_backend(tmp_path / "b", HostPool("layer_first"), "quantwm:kchannel=16,centroids=1,cdtype=fp8,vcluster=false,rank=0")
        assert not caplog.records
        backend = make_backend(tmp_path / "c", HostPool("layer_first"), recipe)
    (record,) = caplog.records
    message = record.getMessage()
    bpv = 8 * backend.blob_bytes / (2 * backend.geometry.num_layers * backend.page_size * backend.geometry.num_kv_heads
                                    * backend.geometry.head_dim)
    assert bpv > 4 and f"{bpv:.2f} bits per value" in message and "16-token pages" in message, message


@pytest.mark.parametrize("codec", ["kivi:bits=2,group=16,kbits=4,vrot=hadamard", "rtn:bits=2,group=16",
                                   "quantwm:kchannel=16,rank=0,centroids=8,clip=true,vcluster=false,vrot=hadamard"])
def test_reused_cpu_buffers_never_leak_into_blobs_or_across_threads(tmp_path, codec, monkeypatch):
    """On the CPU a backend keeps each thread's staging and stored-frame buffers across batches (fresh ones cost their
    page faults): a blob encoded before another batch keeps its bytes, every batch gets the bytes a fresh backend
    gives it (the value rotation's fused loop writing into the buffer included), and threads encoding at once each
    get their own pages' bytes."""
    host = HostPool("layer_first", pages=40, layers=4, heads=4, head_dim=64)  # 4 pages: 65536 values, the fused loop
    host.kv_buffer.normal_()
    host.kv_buffer[0, 1] *= 5  # layer 1's keys larger: batches differ in scale
    backend = make_backend(tmp_path / "reused", host, codec, device="cpu")  # the CPU path, on a GPU machine too
    assert backend.device.device.type == "cpu"
    batches = [[host.page((4 * b + p) * 16) for p in range(4)] for b in range(5)]  # token index of each page
    keys = [[backend._key(f"b{b}p{p}") for p in range(4)] for b in range(5)]
    first = [blob.clone() for blob in backend._encode_batch(batches[0], keys[0])]
    kept = backend._encode_batch(batches[0], keys[0])
    later = [backend._encode_batch(batches[b], keys[b]) for b in range(1, 5)]
    assert all(torch.equal(a, b) for a, b in zip(first, kept))  # later batches did not write into earlier blobs
    fresh = make_backend(tmp_path / "fresh", host, codec, device="cpu")  # every buffer a new one, as before
    monkeypatch.setattr(fresh, "_reused", lambda name, shape, dtype: torch.empty(shape, dtype=dtype))
    for b in range(1, 5):
        want = fresh._encode_batch(batches[b], keys[b])
        assert all(torch.equal(x, y) for x, y in zip(later[b - 1], want)), b
    decoded = backend._decode_batch(later[0])  # and the bytes are the pages': K and V each where they belong
    for p in range(4):
        page = batches[1][p].float()
        assert float((decoded[p].float() - page).norm() / page.norm()) < 0.5
    assert not torch.equal(later[0][0], later[1][0])
    results, errors = {}, []

    def worker(b):
        try:
            for _ in range(3):
                results[b] = [blob.clone() for blob in backend._encode_batch(batches[b], keys[b])]
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(b,)) for b in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for b in range(1, 5):
        assert all(torch.equal(x, y) for x, y in zip(results[b], later[b - 1])), b


from test_unit_gather import within  # noqa: E402 - the one tolerance for the kernel's decode of units

RECIPE_PAGE = "quantwm:kchannel=16,rank=4,keep=0.0625,centroids=32,clip=true,vcluster=false,vrot=hadamard,cdtype=fp8,outliers=16"


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_units_with_codebooks_decode_through_the_gather_kernel_as_the_codec_does(tmp_path, layout):
    """The GPU's decode of units with codebooks (`UnitGather`, one gather launch per batch; here Triton's kernel in
    its interpreter on a machine without CUDA) gives the pages the codec's own decode gives, for every layer of every
    page of a batch."""
    host = HostPool(layout, pages=8)
    host.kv_buffer.normal_()
    backend = make_backend(tmp_path, host, RECIPE_PAGE, device="cpu")
    assert backend.units is not None  # vrot, PSAC rows and outliers: all read by the kernels
    pages, keys = _batch_pages(host, 3)
    blobs = torch.stack(backend._encode_batch(pages, keys))
    group, lay, g = backend.group, backend.layout, backend.geometry
    body = blobs[:, : group.pages_bytes].reshape(3 * g.num_layers, lay.page_bytes)
    books = blobs[:, group.books_offset : group.blob_bytes].reshape(3 * g.num_layers, lay.codebook_bytes)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel where it runs, else its interpreter
    got, want = backend._gathered(body.to(dev), books.to(dev), 3).cpu(), backend._decode_batch(blobs)
    assert got.shape == want.shape == (3, 2, g.num_layers, 16, g.num_kv_heads, g.head_dim)
    assert within(got, want)
    assert within(want, torch.stack(pages).view(want.shape)) is False  # the codec's own error is far larger


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_gpu_gets_units_with_codebooks_through_the_gather_kernel(tmp_path, monkeypatch):
    """On a GPU the recipe's page codec is read back by the gather kernel, straight into a page-locked pool: every
    page as the CPU backend decodes it (within bf16 roundings), a bad slot a miss alone."""
    from kvbackend.unit_gather import UnitGather

    calls, call = [], UnitGather.__call__
    monkeypatch.setattr(UnitGather, "__call__", lambda self, *a, **k: calls.append(a[0].shape[0]) or call(self, *a, **k))
    host = HostPool("layer_first", pages=80)
    host.kv_buffer = host.kv_buffer.pin_memory()
    host.kv_buffer.normal_()
    cpu = make_backend(tmp_path / "cpu", host, RECIPE_PAGE, device="cpu")
    gpu = make_backend(tmp_path / "gpu", host, RECIPE_PAGE, device="cuda")
    assert gpu.units is not None and gpu.writer is not None and gpu.writer.direct
    names = [f"p{i}" for i in range(37)]
    assert cpu.batch_set_v1(names, host_indices(range(37))) == [True] * 37
    want = cpu._load(names)
    for name in names:  # the CPU's blobs, read back by the GPU backend
        blob = torch.empty(cpu.blob_bytes, dtype=torch.uint8)
        assert cpu.tier.get([cpu._key(name)], [blob]).result() == [True]
        assert gpu.tier.put([gpu._key(name)], [blob]).result() == [True]
    indices = torch.cat([host_indices(range(40, 76)), torch.arange(10**6, 10**6 + 16)])
    assert gpu.batch_get_v1(names, indices) == [True] * 36 + [False]
    assert sum(calls) == 36 * host.layer_num  # every layer of every delivered page through the kernel
    for i in range(36):
        assert within(host.page(16 * (40 + i)), want[i]), i


@pytest.mark.parametrize("codec", ["kivi:bits=4,group=16", "alignpred:error=1x", "identity"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_a_negative_host_index_is_a_miss_of_that_page_alone(tmp_path, codec, layout):
    """A negative index sliced from the pool's end: codecs decoded page by page (alignpred) wrote the page into the
    pool's last slots and reported a hit. Every path checks the index against the pool now, gets and sets."""
    host = HostPool(layout, pages=8)
    host.kv_buffer.normal_()
    backend = make_backend(tmp_path, host, codec)
    assert backend.batch_set_v1(["a", "b"], host_indices([0, 1])) == [True, True]
    before = host.kv_buffer.clone()
    indices = torch.cat([torch.arange(-32, -16), host_indices([6])])
    assert backend.batch_get_v1(["a", "b"], indices) == [False, True]
    changed = (host.kv_buffer != before).movedim(1 if layout == "page_first" else 2, 0).flatten(1).any(1)
    assert changed.nonzero().flatten().tolist() == list(range(96, 112))  # page b's slots alone
    stats = backend.get_stats()
    assert (stats["hits"], stats["misses"]) == (1, 1)
    assert backend.batch_set_v1(["c", "d"], torch.cat([torch.arange(-16, 0), host_indices([2])])) == [False, True]
    assert backend.batch_exists(["d"]) == 1 and backend.batch_exists(["c"]) == 0


def test_a_generic_get_into_a_target_of_another_size_misses_that_page_alone(tmp_path):
    host = HostPool("layer_first", pages=4)
    host.kv_buffer.normal_()
    backend = make_backend(tmp_path, host)
    assert backend.batch_set_v1(["x", "y"], host_indices([0, 1])) == [True, True]
    n = host.get_data_page(0).numel()
    small, fits = torch.full((n - 2,), 3.0, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    out = backend.batch_get(["x", "y"], [small, fits])
    assert out[0] is None and (small == 3).all()  # refused before any copy
    assert out[1] is fits and torch.equal(fits, backend.batch_get(["y"])[0])
    stats = backend.get_stats()
    assert (stats["hits"], stats["misses"]) == (2, 1)  # x missed once; y was served twice


def test_a_misspelled_option_is_named_in_a_warning(tmp_path, caplog):
    """`budget_GB=1` and `codecs=...` fell back to the defaults silently (64 GiB, the default codec)."""
    host = HostPool("layer_first")
    with caplog.at_level(logging.WARNING, logger="kvbackend.integration.sglang"):
        backend = make_backend(tmp_path / "a", host, "identity", budget_GB=1, codecs="identity")
    text = caplog.text
    assert "'budget_GB' is not one of" in text and "did you mean 'budget_gb'" in text
    assert "'codecs' is not one of" in text and "did you mean 'codec'" in text
    assert backend.codec_spec == "identity"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvbackend.integration.sglang"):
        make_backend(tmp_path / "b", host, "identity", budget_gb=1, device="cpu")
    assert "is not one of" not in caplog.text  # the options and the loader's own keys pass quietly
