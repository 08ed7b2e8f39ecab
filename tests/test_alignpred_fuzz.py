"""AlignPred decoder on damaged and crafted streams: a miss (``CorruptStream``) or the exact values.

Mutations either leave the container checksum stale (so it must catch them) or reseal it (so the
parser, the bounds checks and the value checksums must). Nothing else may come out: no other
exception, no other values, no large allocation, no abort.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import textwrap
import time

import crc32c
import numpy as np
import pytest

from kvbackend.alignpred import AlignPredCodec, Calibration, CorruptStream
from kvbackend.alignpred.stream import VERSION, pack, unpack


def _kv(seed: int, L: int, T: int, H: int, D: int) -> tuple[np.ndarray, np.ndarray]:
    """KV-like data: per-channel offsets and scales (outlier channels), slow drift over tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(2):
        scale = np.exp(rng.normal(0, 1.0, (L, 1, H, D)))
        offset = rng.normal(0, 2.0, (L, 1, H, D))
        drift = np.cumsum(rng.normal(0, 0.1, (L, T, H, D)), axis=1)
        out.append((offset + scale * (rng.normal(0, 1, (L, T, H, D)) + drift)).astype(np.float32))
    return out[0], out[1]


FALLBACK = "undecodable"  # the decoder's catch-all; the explicit checks should leave it nothing to do


def _reseal(body: bytes | bytearray) -> bytes:
    """A container whose trailing crc32c matches ``body`` minus its old checksum."""
    body = bytes(body[:-4])
    return body + struct.pack("<I", crc32c.crc32c(body))


def _rewrite(blob: bytes, edit) -> bytes:
    """Unpack, let ``edit`` change the arrays in place, pack again (a valid container checksum)."""
    arrays = {name: np.array(a) for name, a in unpack(blob).items()}
    edit(arrays)
    return pack(arrays)


def _entries(blob: bytes) -> list[tuple[str, int, int, int]]:
    """(name, header start, payload start, payload end) of every entry of a container."""
    (count,) = struct.unpack_from("<H", blob, 5)
    pos, out = 7, []
    sizes = [1, 2, 4, 4, 8, 4, 8, 2]  # item sizes of the container's dtype codes
    for _ in range(count):
        start, n = pos, blob[pos]
        name = blob[pos + 1 : pos + 1 + n].decode()
        pos += 1 + n
        code, ndim = blob[pos], blob[pos + 1]
        shape = struct.unpack_from(f"<{ndim}I", blob, pos + 2)
        pos += 2 + 4 * ndim
        size = int(np.prod(shape, dtype=np.int64)) * sizes[code]
        out.append((name, start, pos, pos + size))
        pos += size
    return out


def _encoded_groups() -> list[tuple[AlignPredCodec, bytes, np.ndarray, np.ndarray]]:
    """(codec, stream, decoded K, decoded V) for a few configurations of real page groups."""
    k, v = _kv(0, 4, 64, 2, 16)
    cal = Calibration.fit(*_kv(1, 3, 128, 2, 8))
    cases = [
        (AlignPredCodec("alignpred:error=1x"), k[:2], v[:2]),
        (AlignPredCodec("alignpred:error=2x,predict=prev,align=heads"), k[2:, :16, :, :8], v[2:, :16, :, :8]),
        (AlignPredCodec("alignpred:error=1x,align=layers"), k[:2, 16:48], v[:2, 16:48]),
        (AlignPredCodec("alignpred:error=1x,align=layers,fit=frozen", cal), *_kv(2, 3, 16, 2, 8)),
        (AlignPredCodec("alignpred:error=0.01"), np.zeros((2, 16, 1, 8), np.float32), k[:2, :16, :1, :8]),
    ]
    out = []
    for codec, kk, vv in cases:
        blob = codec.encode(np.ascontiguousarray(kk), np.ascontiguousarray(vv))
        out.append((codec, blob, *codec.decode(blob)))
    return out


@pytest.fixture(scope="module")
def streams():
    return _encoded_groups()


def _outcome(codec, stream, k0, v0, what: str) -> str:
    """'miss' or 'same'; fails the test on other values or another exception."""
    try:
        k, v = codec.decode(stream)
    except CorruptStream as exc:
        assert FALLBACK not in str(exc), f"{what}: only the catch-all caught it: {exc}"
        return "miss"
    except Exception as exc:  # noqa: BLE001 -- the point: nothing but CorruptStream may escape
        pytest.fail(f"{what}: {type(exc).__name__}: {exc}")
    assert k.dtype == k0.dtype and k.shape == k0.shape and v.shape == v0.shape, what
    assert np.array_equal(k, k0) and np.array_equal(v, v0), f"{what}: decoded other values"
    return "same"


# ---- defect: fields outside the value checksums ---------------------------------------------------


def _times3(name: str, index: int):
    def edit(a):
        a[name][index] *= 3

    return edit


def _swap_shape(a):
    a["shape"][[2, 3]] = a["shape"][[3, 2]]


@pytest.mark.parametrize("edit", [_times3("k.f", 0), _times3("v.f", 0), _times3("k.f", 3), _swap_shape],
                         ids=["k step x3", "v step x3", "k max_error x3", "shape H<->D"])
def test_value_fields_are_checksummed(edit):
    """A field edited in a stream whose container checksum was then recomputed is still caught."""
    codec = AlignPredCodec("alignpred:error=1x")
    k, v = _kv(3, 2, 8, 2, 4)  # heads <-> head_dim keeps every count and the lattice's bytes
    blob = _rewrite(codec.encode(k, v), edit)
    with pytest.raises(CorruptStream):
        codec.decode(blob)


def test_streams_of_another_version_are_misses():
    codec = AlignPredCodec("alignpred:error=1x")
    blob = bytearray(codec.encode(*_kv(4, 1, 16, 1, 8)))
    assert blob[4] >= 2
    for version in (0, 1, blob[4] + 1):
        blob[4] = version
        with pytest.raises(CorruptStream, match="version"):
            codec.decode(_reseal(blob))


# ---- defect: crafted counts, shapes and types -----------------------------------------------------


def _set(name: str, value, index=0, dtype=None):
    def edit(a):
        if dtype is not None:
            a[name] = a[name].astype(dtype)
        a[name][index] = value

    return edit


def _replace(name: str, value):
    def edit(a):
        a[name] = value

    return edit


def _drop(name: str):
    return lambda a: a.pop(name)


CRAFTED = {
    "count 2^16": _set("k.cnt", 2**16, 2),  # (2^32-1 would abort the process: see the child test below)
    "count 0": _set("k.cnt", 0, 2),
    "count of the class map": _set("k.cnt", 7, 0),
    "counts as float": _replace("k.cnt", np.array([1.5, 2.5])),
    "class 255": _set("k.cls", 255, 2),
    "zero table": _set("k.tab", 0, 2),
    "table of 3 entries": lambda a: a.__setitem__("k.tab", a["k.tab"][:, :3].copy()),
    "lo one byte short": lambda a: a.__setitem__("k.lo", a["k.lo"][:-1].copy()),
    "words as int64": lambda a: a.__setitem__("k.w", a["k.w"].astype(np.int64)),
    "escapes as float": lambda a: a.__setitem__("k.esc", a["k.esc"].astype(np.float32)),
    "shape with a zero": _set("shape", 0, 1),
    "shape 2^32-1 tokens": _set("shape", 2**32 - 1, 1),
    "shape of 3 dims": lambda a: a.__setitem__("shape", a["shape"][:3].copy()),
    "shape as int64": _replace("shape", np.array([2, 16, 2, 8], np.int64)),
    "spec predictor 9": _set("spec", 9, 1),
    "blend nan": lambda a: a.__setitem__("spec", np.concatenate([a["spec"][:2], np.frombuffer(
        np.float32(np.nan).tobytes(), np.uint8)])),
    "step nan": _set("k.f", np.nan, 0),
    "step negative": _set("k.f", -1.0, 0),
    "step 1e308": _set("k.f", 1e308, 0),
    "i of 1 entry": lambda a: a.__setitem__("k.i", a["k.i"][:1].copy()),
    "class-map offset 2^40": _set("k.i", 2**40, 0),
    "no words": _drop("k.w"),
    "no rotations": _drop("k.rot"),
    "rotations of another size": lambda a: a.__setitem__("k.rot", a["k.rot"][:, :2, :2].copy()),
    "rotations as float64": lambda a: a.__setitem__("k.rot", a["k.rot"].astype(np.float64)),
    "an unknown entry": _replace("k.x", np.zeros(3, np.uint8)),
    "calibration fingerprint": _replace("cal", np.array([7], np.uint32)),
}


@pytest.mark.parametrize("name", list(CRAFTED))
def test_crafted_streams_raise_corrupt_stream_only(name):
    codec = AlignPredCodec("alignpred:error=1x,align=heads")
    blob = codec.encode(*_kv(5, 2, 16, 2, 8))
    crafted = _rewrite(blob, CRAFTED[name])
    with pytest.raises(CorruptStream) as info:
        codec.decode(crafted)
    assert FALLBACK not in str(info.value)


def test_container_overflowing_shape_is_a_miss():
    """Entries whose shape product overflows int64, with too many axes, or with absurd axes beside a zero."""
    body = b"KVAP" + struct.pack("<BH", VERSION, 1) + b"\x01a" + struct.pack("<BB4I", 0, 4, 2**16, 2**16, 2**16, 2**16)
    blob = body + struct.pack("<I", crc32c.crc32c(body))
    with pytest.raises(CorruptStream):
        unpack(blob)
    body = b"KVAP" + struct.pack("<BH", VERSION, 1) + b"\x01a" + struct.pack("<BB", 0, 200) + b"\x00" * 800
    with pytest.raises(CorruptStream):
        unpack(body + struct.pack("<I", crc32c.crc32c(body)))
    body = b"KVAP" + struct.pack("<BH", VERSION, 1) + b"\x01a" + struct.pack("<BB4I", 0, 4, 0, *[2**32 - 1] * 3)
    with pytest.raises(CorruptStream):  # an empty array with absurd axes beside the zero
        unpack(body + struct.pack("<I", crc32c.crc32c(body)))


_CHILD = textwrap.dedent("""
    import json, resource, sys, time
    import numpy as np
    from kvbackend.alignpred import AlignPredCodec, CorruptStream
    from kvbackend.alignpred.stream import pack, unpack

    rng = np.random.default_rng(6)
    k = rng.standard_normal((2, 16, 2, 8)).astype(np.float32)
    codec = AlignPredCodec("alignpred:error=1x")
    blob = codec.encode(k, k * 2)

    def crafted(edit):
        a = {n: np.array(x) for n, x in unpack(blob).items()}
        edit(a)
        return pack(a)

    def huge(a, n):
        a["k.cnt"][2] = n

    def consistent(a, tokens):  # a shape of many tokens with class counts that add up to it
        a["shape"][1] = tokens
        for t in "kv":
            a[t + ".cnt"][2] = 2 * 16 * tokens - int(a[t + ".cnt"][3:].sum())

    cases = {"2^32-1": lambda a: huge(a, 2**32 - 1), "1e8": lambda a: huge(a, 10**8),
             "huge shape": lambda a: consistent(a, 2**26), "shape at the cap": lambda a: consistent(a, 2**20)}
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = {}
    for name, edit in cases.items():
        t = time.perf_counter()
        try:
            codec.decode(crafted(edit))
            out[name] = "decoded"
        except CorruptStream:
            out[name] = "CorruptStream"
        except Exception as exc:
            out[name] = type(exc).__name__
        out[name + " s"] = time.perf_counter() - t
    out["rss_growth_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    print(json.dumps(out))
""")


def test_huge_counts_are_misses_in_bounded_time_and_memory():
    """Counts/shapes whose checksums pass but whose sizes are absurd: CorruptStream, quickly and
    without allocating them (in a child process, so an abort fails the test instead of pytest)."""
    proc = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"child died (rc {proc.returncode}): {proc.stderr[-2000:]}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ("2^32-1", "1e8", "huge shape", "shape at the cap"):
        assert out[name] == "CorruptStream", out
        assert out[name + " s"] < 1.0, out
    assert out["rss_growth_kib"] < 32 * 1024, out  # no allocation of the claimed sizes


# ---- the persistent format: a stream of another shape never lands in the page --------------------


@pytest.fixture(scope="module")
def page_format():
    torch = pytest.importorskip("torch")
    from kvbackend import CacheConfig, Geometry, KVCache
    from kvbackend.tiers.persist import TRAILER_BYTES, AlignPredFormat

    cache = KVCache(Geometry(2, 2, 64, torch.bfloat16),
                    CacheConfig(codec="bf16", page_size=16, chunk_pages=2, dense_pages=4, packed_pages=4))
    fmt = AlignPredFormat("alignpred:error=1x", cache.layout)
    buffer = torch.zeros(fmt.blob_bytes, dtype=torch.uint8)
    gen = torch.Generator().manual_seed(7)
    k, v = fmt._views(buffer)
    k.copy_(torch.randn(k.shape, generator=gen))
    v.copy_(torch.randn(v.shape, generator=gen))
    buffer[fmt.group.pages_bytes :] = torch.arange(TRAILER_BYTES, dtype=torch.uint8) % 251
    stored = fmt.encode(buffer.numpy().tobytes())
    out = torch.empty(fmt.blob_bytes, dtype=torch.uint8)
    fmt.decode(memoryview(stored), out)
    return fmt, stored, out.clone(), TRAILER_BYTES


def test_persist_refuses_a_stream_of_another_shape(page_format):
    torch = pytest.importorskip("torch")
    fmt, stored, _, trailer = page_format
    k, v = fmt.codec.decode(stored[trailer:])
    out = torch.empty(fmt.blob_bytes, dtype=torch.uint8)
    for part in (slice(0, 1), slice(0, 8)):  # one token would broadcast into the page; eight would not fit
        other = stored[:trailer] + fmt.codec.encode(k[:, part], v[:, part])
        with pytest.raises(CorruptStream):
            fmt.decode(memoryview(other), out)


# ---- the gate: seeded fuzzing ---------------------------------------------------------------------

_SPECIAL = [b"\x00", b"\xff", b"\x01", b"\x80", b"\x00\x00\x00\x00", b"\xff\xff\xff\xff", b"\x00\x00\x00\x80",
            b"\x00\x00\x00\x40", b"\x01\x00\x00\x00", b"\x00\x00\xf8\x7f", b"\x00\x00\x00\x00\x00\x00\xf8\x7f"]


def _mutate(rng: np.random.Generator, blob: bytes, other: bytes) -> tuple[bytes, str]:
    """One seeded mutation of ``blob``; resealed (valid container checksum) about two times in three."""
    data = bytearray(blob)
    entries = _entries(blob)
    op = int(rng.integers(0, 9))
    if op == 0:  # bit flips anywhere
        for _ in range(int(rng.integers(1, 4))):
            pos = int(rng.integers(0, len(data)))
            data[pos] ^= 1 << int(rng.integers(0, 8))
        what = "bit flips"
    elif op in (1, 2, 3):  # overwrite an entry's header (name, dtype, ndim, shape) or a small array's payload
        name, start, payload, end = entries[int(rng.integers(0, len(entries)))]
        small = end - payload <= 64
        lo, hi = (start, payload) if op == 1 or not small else (payload, end)
        if hi <= lo:
            lo, hi = start, payload
        pos = int(rng.integers(lo, hi))
        value = _SPECIAL[int(rng.integers(0, len(_SPECIAL)))] if rng.random() < 0.5 else bytes(
            rng.integers(0, 256, int(rng.integers(1, 9)), dtype=np.uint8))
        data[pos : pos + len(value)] = value
        data = data[: len(blob)] if len(data) > len(blob) else data
        what = f"overwrite {name} at {pos}"
    elif op == 4:  # scale a float64 field (steps, bounds) or an integer count
        name, _, payload, end = entries[int(rng.integers(0, len(entries)))]
        if end - payload >= 8 and name.endswith(".f"):
            pos = payload + 8 * int(rng.integers(0, (end - payload) // 8))
            (x,) = struct.unpack_from("<d", data, pos)
            struct.pack_into("<d", data, pos, x * float(rng.choice([3.0, 0.5, -1.0, 1.0 + 2**-40])))
        elif end - payload >= 4:
            pos = payload + 4 * int(rng.integers(0, (end - payload) // 4))
            struct.pack_into("<I", data, pos, int(rng.choice([0, 1, 2**31, 2**32 - 1, 10**8, 3])))
        what = f"scale {name}"
    elif op == 5:  # truncation
        data = data[: int(rng.integers(0, len(data)))]
        what = "truncate"
    elif op == 6:  # extension, at the end or inside
        extra = bytes(rng.integers(0, 256, int(rng.integers(1, 64)), dtype=np.uint8))
        pos = len(data) if rng.random() < 0.5 else int(rng.integers(7, len(data)))
        data[pos:pos] = extra
        what = "extend"
    elif op == 7:  # splice: the head of one stream, the tail of another
        i, j = int(rng.integers(0, len(blob))), int(rng.integers(0, len(other)))
        data = bytearray(blob[:i] + other[j:])
        what = "splice"
    else:  # delete a run of bytes
        pos = int(rng.integers(0, len(data)))
        del data[pos : pos + int(rng.integers(1, 32))]
        what = "delete"
    if len(data) >= 4 and rng.random() < 0.67:
        return _reseal(data), what + " (resealed)"
    return bytes(data), what


def test_fuzz_decoder_is_a_miss_or_exact(streams):
    rng = np.random.default_rng(20240601)
    start, seen = time.perf_counter(), {"miss": 0, "same": 0}
    for it in range(6000):
        a = int(rng.integers(0, len(streams)))
        codec, blob, k0, v0 = streams[a]
        other = streams[int(rng.integers(0, len(streams)))][1]
        mutated, what = _mutate(rng, blob, other)
        if mutated == other:  # a splice that rebuilt the other stream whole: valid, with its own values
            continue
        seen[_outcome(codec, mutated, k0, v0, f"iteration {it} on stream {a}: {what}")] += 1
    assert seen["miss"] > 5000, seen  # the mutations do reach the decoder's checks
    assert time.perf_counter() - start < 15.0


def test_fuzz_persistent_format_is_a_miss_or_exact(page_format):
    torch = pytest.importorskip("torch")
    fmt, stored, expected, trailer = page_format
    rng = np.random.default_rng(11)
    out = torch.empty(fmt.blob_bytes, dtype=torch.uint8)
    for it in range(600):  # the trailer is outside the stream: the file tier's own checksum covers it
        mutated, what = _mutate(rng, stored[trailer:], stored[trailer:])
        try:
            fmt.decode(memoryview(stored[:trailer] + mutated), out)
        except CorruptStream as exc:
            assert FALLBACK not in str(exc), f"iteration {it}: {what}: only the catch-all caught it: {exc}"
            continue
        except Exception as exc:  # noqa: BLE001
            pytest.fail(f"iteration {it}: {what}: {type(exc).__name__}: {exc}")
        assert torch.equal(out, expected), f"iteration {it}: {what}: other bytes in the page"


# Finite values near float32's limit gave a lattice step past float32's range: the encoder wrote a stream its own
# decoder refuses (a miss on every read, and the file tier deletes it). Now the encode refuses with a ValueError
# (the file tier keeps the caller's blob and writes nothing).
_RNG = np.random.default_rng(0)
_LARGE = {"1e38 constant, 1x, lattice": ("alignpred:error=1x,quant=lattice", np.full((1, 4, 1, 8), 1e38, np.float32)),
          "1e37 gaussian, 100x, lattice": ("alignpred:error=100x,quant=lattice",
                                           (_RNG.standard_normal((2, 8, 2, 8)) * 1e37).astype(np.float32)),
          "1e37 gaussian, 100x, trellis": ("alignpred:error=100x",
                                           (_RNG.standard_normal((2, 8, 2, 8)) * 1e37).astype(np.float32)),
          "float32 max, 1x, trellis": ("alignpred:error=1x", np.full((2, 1, 2, 1), np.finfo(np.float32).max,
                                                                      np.float32))}


@pytest.mark.parametrize("name", list(_LARGE))
def test_the_encoder_never_writes_a_stream_its_decoder_refuses(name):
    from kvbackend.alignpred import AlignPredCodec, CorruptStream

    spec, x = _LARGE[name]
    codec = AlignPredCodec(spec)
    with np.errstate(all="ignore"):
        try:
            blob = codec.encode(x, x)
        except ValueError:
            return  # refused at encode: the file tier keeps the caller's blob, nothing is written
        try:
            kh, _ = codec.decode(blob, shape=x.shape)
        except CorruptStream as exc:
            pytest.fail(f"the encoder wrote a stream its own decoder refuses: {exc}")
    assert np.abs(x.astype(np.float64) - kh).max() <= codec.max_errors(blob)[0]


# A spec built in Python with fit=frozen and another alignment than layers was accepted (parsing refuses it), and its
# spec string, which names the file tier's format, did not parse back.
@pytest.mark.parametrize("align", ["none", "heads"])
def test_a_frozen_spec_built_in_python_is_checked_like_a_parsed_one(align):
    from kvbackend.alignpred import AlignPredSpec, ErrorBudget
    from kvbackend.alignpred.spec import parse_alignpred
    from kvbackend.errors import SpecError

    with pytest.raises(SpecError, match="align=layers"):
        parse_alignpred(f"alignpred:error=1x,align={align},fit=frozen")
    with pytest.raises(SpecError, match="align=layers"):
        AlignPredSpec(ErrorBudget(1.0, True), align=align, fit="frozen")


# A 584-byte stream (container checksum valid, every count consistent) claiming 2^25 values per kind in classes
# without raw low bits and one-symbol tables made `decode(blob)` without a shape decode 2^24 rANS symbols from one
# word: 0.7 s and about 640 MiB before the lattice checksum refused it. Without a shape a group now holds at most
# MAX_UNSHAPED_VALUES per kind.
_BOMB = textwrap.dedent("""
    import json, resource, time
    import numpy as np
    from kvbackend.alignpred import AlignPredCodec, CorruptStream
    from kvbackend.alignpred.stream import pack, unpack

    codec = AlignPredCodec("alignpred:error=1x,quant=lattice")
    z = np.zeros((1, 4, 1, 32), np.float32)  # every class is class 0 (no low bits), one-symbol tables
    a = {n: np.array(x) for n, x in unpack(codec.encode(z, z)).items()}
    T = 1 << 20  # 32 channels x 2^20 tokens = 2^25 values per kind
    a["shape"][1] = T
    for t in "kv":
        a[t + ".cnt"][:] = [32, 32, 32 * T]
    blob = pack(a)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    try:
        codec.decode(blob)
        outcome = "decoded"
    except CorruptStream:
        outcome = "CorruptStream"
    print(json.dumps({"bytes": len(blob), "outcome": outcome, "s": time.perf_counter() - t0,
                      "rss_growth_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before}))
""")


def test_a_tiny_crafted_stream_cannot_make_the_decoder_work_in_proportion_to_its_claims():
    proc = subprocess.run([sys.executable, "-c", _BOMB], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"child died (rc {proc.returncode}): {proc.stderr[-2000:]}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["bytes"] < 1024 and out["outcome"] == "CorruptStream", out
    assert out["s"] < 0.2 and out["rss_growth_kib"] < 32 * 1024, out


# Cross-block predictions were float32 BLAS products rounded to integers: another BLAS kernel (another CPU) or another
# thread count rounded some differently, so valid streams failed their lattice checksum where they were read back
# (and the file tier deleted them as corrupt). They are exact fixed-point products now (`align.exact_product`).
_PORTABLE = textwrap.dedent("""
    import sys, numpy as np
    from kvbackend.alignpred import AlignPredCodec, Calibration, CorruptStream

    def kv(L, T, H, D, seed):
        r = np.random.default_rng(seed)
        base = r.standard_normal((L, T, 1, D)).astype(np.float32) * 3
        return (base + 0.3 * r.standard_normal((L, T, H, D))).astype(np.float32)

    cal = Calibration.load(sys.argv[3])
    codecs = [AlignPredCodec("alignpred:error=0.5x,align=layers,fit=frozen,quant=lattice", cal),
              AlignPredCodec("alignpred:error=0.5x,align=heads,quant=lattice")]
    path = sys.argv[2]
    if sys.argv[1] == "encode":
        blobs = [c.encode(kv(4, 64, 4, 32, s), kv(4, 64, 4, 32, s + 50)) for c in codecs for s in range(4)]
        np.savez(path, *[np.frombuffer(b, np.uint8) for b in blobs])
    else:
        f = np.load(path)
        refused = []
        for i, name in enumerate(f.files):
            try:
                codecs[i // 4].decode(f[name].tobytes(), shape=(4, 64, 4, 32))
            except CorruptStream as exc:
                refused.append(i)
        print("REFUSED", refused)
""")


@pytest.mark.parametrize("writer, reader", [
    ({"OPENBLAS_CORETYPE": "Haswell", "OPENBLAS_NUM_THREADS": "1"},
     {"OPENBLAS_CORETYPE": "Prescott", "OPENBLAS_NUM_THREADS": "1"}),  # another CPU's kernels (no FMA)
    ({"OPENBLAS_CORETYPE": "Haswell", "OPENBLAS_NUM_THREADS": "2"},
     {"OPENBLAS_CORETYPE": "Haswell", "OPENBLAS_NUM_THREADS": "1"}),  # another thread count
], ids=["another-cpu-kernel", "another-thread-count"])
def test_a_stream_decodes_under_another_blas_configuration(tmp_path, writer, reader):
    import os

    from kvbackend.alignpred import Calibration

    def kv(L, T, H, D, seed):
        r = np.random.default_rng(seed)
        base = r.standard_normal((L, T, 1, D)).astype(np.float32) * 3
        return (base + 0.3 * r.standard_normal((L, T, H, D))).astype(np.float32)

    cal, path = str(tmp_path / "cal.npz"), str(tmp_path / "streams.npz")
    Calibration.fit(kv(4, 256, 4, 32, 7), kv(4, 256, 4, 32, 8)).save(cal)

    def run(env, *args):
        proc = subprocess.run([sys.executable, "-c", _PORTABLE, *args], env=dict(os.environ, **env),
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout

    run(writer, "encode", path, cal)
    assert "REFUSED []" in run(writer, "decode", path, cal)
    assert "REFUSED []" in run(reader, "decode", path, cal)


@pytest.mark.parametrize("rows", [1, 3, 192, 1024])
def test_exact_products_equal_integer_arithmetic(rows):
    """The fixed-point product is exact at the bounds it allows (centered indices near 2^25, up to 1024 rows): the
    float64 result equals int64 arithmetic on the same fixed-point weights, whatever order BLAS sums in."""
    import math

    from kvbackend.alignpred.align import exact_product

    rng = np.random.default_rng(rows)
    x = rng.integers(-(2**25) + 1, 2**25, size=(64, rows)).astype(np.float64)
    x[0] = 2**25 - 1  # a row at the bound
    w = rng.standard_normal((rows, 8)) * 3.0
    got = exact_product(x, w)
    shift = (53 - 25 - max(1, math.ceil(math.log2(rows)))) - (math.floor(math.log2(float(np.abs(w).max()))) + 1)
    fixed = np.rint(w * 2.0**shift).astype(np.int64)
    want = (x.astype(np.int64) @ fixed).astype(object)
    assert all(int(g * 2.0**shift) == int(t) for g, t in zip(got.ravel(), want.ravel()))
    assert np.abs(got - x @ w).max() <= np.abs(x).sum(1).max() * 2.0**-shift  # the fixed point's rounding only


def test_values_at_float32s_limit_are_refused_by_the_encoder_not_written_unreadable():
    """float32's largest value at a tight lattice budget: its error bound (half a step plus a float32 spacing)
    is infinite; the encoder used to write it, and its own decoder refused the stream."""
    x = np.full((1, 1, 1, 1), np.finfo(np.float32).max, np.float32)
    codec = AlignPredCodec("alignpred:error=1e-7,quant=lattice")
    with np.errstate(all="ignore"), pytest.raises(ValueError, match="float32's range"):
        codec.encode(x, x)
    mixed = np.linspace(-1, 1, 16, dtype=np.float32).reshape(1, 2, 1, 8)
    mixed[0, 0, 0, 0] = np.nextafter(np.finfo(np.float32).max, np.float32(0))
    try:
        with np.errstate(all="ignore"):
            blob = codec.encode(mixed, mixed)
    except ValueError as exc:
        assert "float32" in str(exc)
    else:  # whatever the encoder writes, its decoder reads
        assert np.abs(codec.decode(blob)[0].astype(np.float64) - mixed).max() <= codec.max_errors(blob)[0]


def test_a_decoded_stream_with_non_finite_values_is_a_miss():
    """A stream whose step was raised to float32's largest (within the header's check) with both checksums
    recomputed, as whoever can write the store can: it decoded to +-inf, which no encode writes."""
    from kvbackend.alignpred.codec import _dequant
    from kvbackend.alignpred.schema import value_checksum

    k = np.random.default_rng(0).standard_normal((1, 4, 1, 8)).astype(np.float32)
    codec = AlignPredCodec("alignpred:error=1x,quant=lattice")
    blob = codec.encode(k, k)
    a = {name: np.array(x) for name, x in unpack(blob).items()}
    n = np.rint(codec.decode(blob)[0].astype(np.float64) / a["k.f"][0]).astype(np.int32)
    a["k.f"][0] = np.finfo(np.float32).max
    with np.errstate(over="ignore"):
        xhat = _dequant(n, a["k.f"][0])
    assert not np.isfinite(xhat).all()  # the crafted stream does decode past float32's range
    a["k.i"][2] = value_checksum("k", k.shape, a["spec"], None, a["k.f"], xhat)
    with pytest.raises(CorruptStream, match="non-finite"):
        codec.decode(pack(a))


def test_a_stream_of_many_blocks_decoded_without_a_shape_is_refused_before_its_pairs():
    """A checksum-valid stream of [1, 1, H, 1] with align=heads: each of its H - 1 head pairs was predicted in
    Python (about 30 us each): a 4 MB stream of 2^20 heads took 48 s. Without a shape, at most 2^14 blocks."""
    from kvbackend.alignpred.entropy import encode_classes
    from kvbackend.alignpred.schema import MAX_UNSHAPED_BLOCKS, value_checksum

    def stream(H: int) -> bytes:
        shape = (1, 1, H, 1)
        spec = np.zeros(6, np.uint8)
        spec[0] = 1  # align=heads, predict=mean, lattice
        spec[2:6] = np.frombuffer(np.float32(0.5).tobytes(), np.uint8)
        a = {"shape": np.array(shape, np.uint32), "spec": spec}
        for tag in "kv":
            codes, words, esc = encode_classes([np.zeros(H, np.int32) for _ in range(3)], [0, 0, 0])
            floats = np.array([1.0, 1e-6, 0.0, 0.5], np.float64)
            zero = np.zeros(shape, np.float32)
            a.update({f"{tag}.f": floats,
                      f"{tag}.i": np.array([0, crc32c.crc32c(np.zeros(shape, np.int32).tobytes()),
                                            value_checksum(tag, shape, spec, None, floats, zero)], np.int64),
                      f"{tag}.cls": np.array([c.cls for c in codes], np.uint8),
                      f"{tag}.cnt": np.array([c.count for c in codes], np.uint32),
                      f"{tag}.tab": np.stack([c.table for c in codes]), f"{tag}.lo": np.concatenate([c.lo for c in codes]),
                      f"{tag}.w": words.astype(np.uint32), f"{tag}.esc": esc,
                      f"{tag}.rot": np.zeros((H - 1, 1, 1), np.float16)})
        return pack(a)

    codec = AlignPredCodec("alignpred:error=1x")
    k, v = codec.decode(stream(64))  # the construction is a valid stream: 64 heads decode to zeros
    assert k.shape == (1, 1, 64, 1) and not k.any() and not v.any()
    with pytest.raises(CorruptStream, match="blocks"):
        codec.decode(stream(MAX_UNSHAPED_BLOCKS + 1))
    assert codec.max_errors(stream(MAX_UNSHAPED_BLOCKS + 1)) == (0.5, 0.5)  # the header alone is read


def test_max_errors_reads_any_group_the_encoder_takes():
    """max_errors reads the header only: it used to refuse every valid stream of more than 2^20 values per kind
    (the decoder's cap without a shape), so the bound of a full Llama-8B page group could not be read."""
    x = np.random.default_rng(1).standard_normal((2, 1025, 4, 128)).astype(np.float32)  # 2^20 + 1024 values
    codec = AlignPredCodec("alignpred:error=1x,quant=lattice")
    blob = codec.encode(x, x)
    bound_k, bound_v = codec.max_errors(blob)
    assert bound_k == codec.last_report[0].max_error and bound_v == codec.last_report[1].max_error
    kh, _ = codec.decode(blob, shape=x.shape)
    assert np.abs(x.astype(np.float64) - kh).max() <= bound_k
    with pytest.raises(CorruptStream, match="more than"):
        codec.decode(blob)  # the decode without a shape keeps its cap


@pytest.mark.parametrize("shape", [(0, 1, 1, 1), (1, 0, 1, 1), (1, 1, 0, 1), (1, 1, 1, 0)])
def test_an_empty_axis_is_a_clear_error(shape):
    x = np.zeros(shape, np.float32)
    for quant in ("trellis", "lattice"):
        with pytest.raises(ValueError, match="at least one layer, token, head and channel"):
            AlignPredCodec(f"alignpred:error=1x,quant={quant}").encode(x, x)


def test_a_spec_built_in_python_checks_its_budget():
    from kvbackend.alignpred.spec import AlignPredSpec, ErrorBudget, parse_alignpred
    from kvbackend.errors import SpecError

    for value, relative in ((-0.5, True), (-0.2, False), (0.0, False), (float("nan"), False), (float("inf"), True),
                            (1.0, False), (101.0, True), ("1", False)):
        with pytest.raises(SpecError, match="the budget must be > 0"):
            ErrorBudget(value, relative)
    with pytest.raises(SpecError, match="ErrorBudget"):
        AlignPredSpec(1.0)
    spec = AlignPredSpec(ErrorBudget(0.5, True))
    assert parse_alignpred(spec.spec_string) == spec  # what it prints parses back
    with pytest.raises(SpecError, match="error='-1x'"):
        parse_alignpred("alignpred:error=-1x")
