"""SGLang HiCache storage backend: compressed pages in kvbackend's crash-safe file tier.

Launch SGLang with:

    --enable-hierarchical-cache --hicache-storage-backend dynamic \\
    --hicache-storage-backend-extra-config '{"backend_name": "kvbackend",
        "module_path": "kvbackend.integration.sglang", "class_name": "KVBackendStorage",
        "interface_v1": 1, "codec": "kivi:bits=4,group=32", "directory": "/var/cache/kvbackend",
        "budget_gb": 100}'

Host pages going to storage are encoded with the codec (per layer, on the CPU) and written as one
checksummed blob per page; on a prefix hit they are decoded straight into SGLang's host pool.
``"codec": "alignpred:error=1x"`` (or 2x, 4x, an absolute NRMSE) stores each page with the
error-bounded persistent codec instead: every layer of the page in one stream, the NRMSE budget
guaranteed per page.
Supported host layouts: ``layer_first`` and ``page_first``; others are refused at registration.

Pages live under ``directory/<namespace>``: the namespace is the model name (readable part plus a
hash of the exact name) and the rank. ``directory`` must belong to the current user and not be
writable by group or others; it is created 0700 when absent, and again if it is removed while
running. The file tier's fingerprint covers the codec, layers, heads, head_dim, dtype, page size
and this backend's format version; a blob of another length than this configuration writes is a miss.
"""

from __future__ import annotations

import collections
import concurrent.futures
import difflib
import hashlib
import itertools
import json
import logging
import math
import os
import re
import struct
import threading
import time
from typing import Any, List, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from kvbackend.alignpred.spec import is_alignpred
from kvbackend.codecs import get as get_codec
from kvbackend.codecs.base import EncodedChunk
from kvbackend.codecs.qvg_fused import decode_units_bf16
from kvbackend.errors import CorruptStream, SpecError
from kvbackend.frames import LeverFrame
from kvbackend.geometry import Geometry
from kvbackend.page_check import PageCheck, refuse_crafted
from kvbackend.page_group import PageGroupFormat
from kvbackend.tiers.file import FileTier
from kvbackend.unit_gather import UnitGather
from kvbackend.integration.pool_writer import PoolWriter
from kvbackend.integration.storage_options import (DeviceCodec, budget_bytes, codec_device, path_option,
                                                   private_directory, warn_codebooks_outweigh)

log = logging.getLogger(__name__)

SUPPORTED_LAYOUTS = ("layer_first", "page_first")
DEFAULTS = {"codec": "kivi:bits=4,group=32", "directory": "/tmp/kvbackend_hicache", "budget_gb": 64.0, "device": "auto"}
BATCH_PAGES = 32  # pages encoded or decoded in one codec call on a GPU (64 MiB of an 8B model's bf16 at 16 tokens)
# On the CPU smaller batches are faster (their intermediates stay in cache; one core, Llama-8B pages of 64 tokens,
# perf/NOTES.md session 13): decode 1 page at a time (kivi-2 1.93 against 1.36 GB/s at 32, the recipe's codec 0.62
# against 0.30), encode 4 (kivi-2 1.42 against 1.14 GB/s)
CPU_BATCH_PAGES = {"encode": 4, "decode": 1}
READ_AHEAD = 2  # decode batches whose file reads run while the current batch decodes (gets into the host pool)
FORMAT_VERSION = 2  # of a stored page's bytes (a page group, kvbackend.page_group); enters the fingerprint


class KVBackendStorage(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None) -> None:
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        _warn_unknown_options(extra)
        self.codec_spec = str(extra.get("codec", DEFAULTS["codec"]))
        if is_alignpred(self.codec_spec):
            from kvbackend.alignpred import AlignPredCodec

            self.persistent = AlignPredCodec(self.codec_spec)  # a bad spec fails here, at start-up
            if self.persistent.spec.fit == "frozen":
                raise ValueError("alignpred fit=frozen needs a calibration; use fit=group with SGLang storage")
            self.codec = None
        else:
            self.persistent = None
            self.codec = get_codec(self.codec_spec)  # a bad spec fails here, at start-up, with the valid options
            levers = self.codec.levers
            if levers.sink or levers.rope or levers.psac:  # never silently dropped
                raise SpecError(f"{self.codec_spec!r}: SGLang hands storage pages without their positions, so "
                                "sink=, prerope=, pagerope= and psac= cannot be applied here; vrot=hadamard can (drop the others "
                                "from the spec)")
            self.frame = LeverFrame(levers)  # values rotated before encoding when vrot=hadamard
        self.namespace = _namespace(storage_config)  # keys of different models/ranks never collide
        self.root = path_option("directory", extra.get("directory", DEFAULTS["directory"]))
        self.directory = os.path.join(self.root, self.namespace)
        self.budget_bytes = budget_bytes(extra.get("budget_gb", DEFAULTS["budget_gb"]))
        # where page-local codecs encode and decode whole batches (the GPU when there is one: host pages go
        # there and back, the codec's work leaves the CPU); a failure there falls back to the CPU for that batch
        self.device = DeviceCodec(codec_device(extra.get("device", DEFAULTS["device"])), log)
        self._private_directories()  # an unsafe directory is refused here, at start-up
        self.blob_bytes: int | None = None  # length of every blob of a registered pool (None: it varies)
        self.mem_pool_host = None
        self.writer: PoolWriter | None = None  # decoded pages straight into the pool's buffer, where it allows
        self.units: UnitGather | None = None  # units with codebooks decoded by the gather kernel on a GPU
        self.tier: FileTier | None = None
        self.page_check: PageCheck | None = None  # the index fields of a page group (`register_mem_pool_host`)
        self._lock = threading.Lock()
        self._cpu_buffers = threading.local()  # each thread's reused CPU encode buffers (`_reused`)
        self._logged: set[str] = set()
        self._stats = {"hits": 0, "misses": 0, "failures": 0, "pages_set": 0, "raw_bytes_set": 0,
                       "encode_s": 0.0, "decode_s": 0.0, "read_s": 0.0, "write_s": 0.0, "to_pool_s": 0.0,
                       "from_pool_s": 0.0}

    # -- set-up -----------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host) -> None:
        layout = getattr(mem_pool_host, "layout", None)
        if layout not in SUPPORTED_LAYOUTS:
            raise ValueError(f"kvbackend storage supports host layouts {SUPPORTED_LAYOUTS}, not {layout!r}; "
                             "start SGLang with --hicache-mem-layout layer_first or page_first")
        self.mem_pool_host = mem_pool_host
        self.page_size = mem_pool_host.page_size
        self.geometry = Geometry(mem_pool_host.layer_num, mem_pool_host.head_num, mem_pool_host.head_dim,
                                 mem_pool_host.dtype)
        if self.persistent is not None:
            self.layout = None
            codec, layout = self.persistent.spec_string, None
        else:
            self.layout = self.codec.layout(self.geometry, self.page_size)  # SpecError if the codec cannot serve it
            codec, layout = self.codec.spec_string, self.layout.fingerprint
        g = self.geometry
        facts = {"format": FORMAT_VERSION, "codec": codec, "layout": layout, "layers": g.num_layers,
                 "heads": g.num_kv_heads, "head_dim": g.head_dim, "dtype": str(g.dtype), "page_size": self.page_size}
        fingerprint = hashlib.blake2b(json.dumps(facts, sort_keys=True).encode(), digest_size=8).hexdigest()
        if self.layout is not None:  # each SGLang page is a one-page chunk: its group always carries its codebooks
            self.group = PageGroupFormat.of([self.layout] * g.num_layers, fingerprint)
            self.blob_bytes = self.group.blob_bytes
            self._warn_codebooks_per_page()
        # a blob whose index fields are out of range (crafted with a valid checksum) is corrupt: the tier refuses it
        self.page_check = None if self.layout is None else PageCheck.of(
            [(f"layer {layer}", self.group.page_offsets[layer], self.codec, self.layout)
             for layer in range(g.num_layers)])
        self.writer = PoolWriter.of(mem_pool_host, g.num_layers, g.num_kv_heads, g.head_dim, g.dtype)
        # units with codebooks decoded by the gather kernel on a GPU (None: the codec's own decode)
        self.units = (UnitGather.of(self.codec, self.layout, g.dtype)
                      if self.layout is not None and self.group.has_codebooks else None)
        self._private_directories()
        # readers side by side for a batch's blobs (the file tier's default: up to 8, one per core)
        self.tier = FileTier(self.directory, self.budget_bytes, fingerprint)

    def _warn_codebooks_per_page(self) -> None:
        """Each SGLang page is its own chunk: a page of 64 tokens carries all 32 centroids of the recommended spec."""
        g = self.geometry
        bpv = 8 * self.blob_bytes / (2 * g.num_layers * self.page_size * g.num_kv_heads * g.head_dim)
        warn_codebooks_outweigh(log, f"kvbackend storage ({self.page_size}-token pages)", self.codec_spec, bpv,
                                self.layout.codebook_bytes, self.layout.page_bytes,
                                "kivi:bits=4,group=64 or kivi:bits=3,group=64,kbits=4,vrot=hadamard")

    def _raw_page_bytes(self) -> int:
        """Bytes of one page of the host pool: K and V of every layer."""
        g = self.geometry
        return 2 * g.num_layers * self.page_size * g.num_kv_heads * g.head_dim * g.dtype.itemsize

    def _private_directories(self) -> None:
        """``directory`` and this namespace's directory in it: created 0700 if absent, refused if unsafe."""
        private_directory(self.root, "directory")
        private_directory(self.directory, "directory")

    def _require_pool(self) -> None:
        if self.tier is None:
            raise RuntimeError("register_mem_pool_host must be called before storage operations")

    def _key(self, key: str) -> int:
        # every str hashes (a lone surrogate too); any other str gives the bytes of a strict encode, as before
        digest = hashlib.blake2b(f"{self.namespace}/{key}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
        return int.from_bytes(digest, "little") >> 1

    # -- page <-> blob ------------------------------------------------------------------------
    def _encode(self, page: torch.Tensor, key: int) -> torch.Tensor:
        """A [2, L, P, H, D] page -> one blob: a page group (`kvbackend.page_group`) of a one-page chunk,
        its trailer naming ``key`` and this configuration, so a blob filed under another key is a miss."""
        start = time.perf_counter()
        if self.persistent is not None:
            stream = struct.pack("<Q", key) + self.persistent.encode(page[0], page[1])  # the key, then the stream
            blob = torch.frombuffer(bytearray(stream), dtype=torch.uint8)
        else:
            chunks: list[EncodedChunk] = [self.codec.encode(*self.frame.to_stored(page[0, layer], page[1, layer], 0),
                                                            self.layout) for layer in range(self.geometry.num_layers)]
            carries = self.group.has_codebooks
            trailer = torch.frombuffer(bytearray(self.group.pack_trailer(key, 0, carries)), dtype=torch.uint8)
            blob = torch.cat([c.pages.reshape(-1) for c in chunks] + [trailer]
                             + ([c.codebook.reshape(-1) for c in chunks] if carries else []))
            if blob.numel() != self.blob_bytes:  # a blob this backend could never load back
                raise RuntimeError(f"a page encoded to {blob.numel()} bytes, not the {self.blob_bytes} expected")
        with self._lock:
            self._stats["encode_s"] += time.perf_counter() - start
        return blob

    def _reused(self, name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised CPU tensor of this thread, kept for its next batch: a fresh buffer of a batch's size
        costs its page faults, more than the copy into it (3.7 against 0.36 ns per value, perf/NOTES.md session 26).
        Per thread, so concurrent stores never share one; nothing returned to a caller is a view of it."""
        buffers = self._cpu_buffers.__dict__.setdefault("by_name", {})
        numel = math.prod(shape)
        held = buffers.get(name)
        if held is None or held.dtype != dtype or held.numel() < numel:
            held = buffers[name] = torch.empty(numel, dtype=dtype)
        return held[:numel].view(shape)

    def _encode_batch(self, pages: List[torch.Tensor], keys: List[int],
                      starts: Optional[List[int]] = None) -> List[torch.Tensor]:
        """`_encode` of many pages in one codec call, the same bytes: a page-local codec encodes every layer of
        every page as pages of one chunk; a codec with codebooks (`Codec.batch_encodes`) encodes each layer of
        each page as its own one-page chunk (`Codec.encode_units`). ``starts``: the pages' token slots in the
        host pool, where they are views of it (a page-locked pool is then read by the device straight, with no
        staging copy on the host). Raises if any page cannot be encoded."""
        start = time.perf_counter()
        g, lay, group = self.geometry, self.layout, self.group
        n = len(pages)
        on_cpu = self.device.device.type == "cpu"  # the CPU's buffers are reused; a GPU's staging is page-locked
        carries = group.has_codebooks

        def encode(k, v):
            out = None
            if self.frame.levers.active and k.device.type == "cpu":  # the stored frame's float32 into reused buffers
                out = tuple(self._reused(f"stored{i}", tuple(x.shape), torch.float32) for i, x in enumerate((k, v)))
            # keys without a RoPE lever stay bf16 for codecs that read it (their fused loops: the same bytes)
            as_given = self.codec.any_float_input and k.device.type == "cpu"
            stored = self.frame.to_stored(k, v, 0, out, as_given) if self.frame.levers.active else (k, v)
            if carries:  # units: one layer of one page each, page-major as `_encode` lays them out
                units = [x.view(n * g.num_layers, self.page_size, g.num_kv_heads, g.head_dim) for x in stored]
                packed, books = self.codec.encode_units(*units, lay)
                return packed.view(n, -1), books.view(n, -1)
            return self.codec.encode(*stored, lay).pages.view(n, -1)

        out = None
        if starts is not None and not on_cpu and self.writer is not None and self.writer.direct:
            def encode_from_pool():  # on the device's stream: the pool's pages copied there, then encoded
                both = self.writer.read(starts, self.device.device)  # [2, N, L, P, H, D], K and V contiguous
                return encode(both[0].view(-1, g.num_kv_heads, g.head_dim), both[1].view(-1, g.num_kv_heads, g.head_dim))

            try:
                out = self.device.run(encode_from_pool)
            except ValueError:  # the pages' own errors (non-finite values), as on the staged path
                raise
            except Exception as exc:  # noqa: BLE001 - the staged path below (and its CPU fallback) gives the same bytes
                self._log_once("encode_direct", f"kvbackend storage: encoding from the page-locked pool on "
                                                f"{self.device.device} failed, staging the pages instead: {exc!r}")
        if out is None:
            def staging(i):
                shape = (n,) + tuple(pages[0][i].shape)
                return self._reused(f"stage{i}", shape, pages[0].dtype) if on_cpu else self.device.staging(shape, pages[0].dtype)

            # K and V stacked apart: each [N, L, P, H, D] contiguous, so the reshape copies nothing
            k, v = (torch.stack([page[i] for page in pages], out=staging(i)).reshape(-1, g.num_kv_heads, g.head_dim)
                    for i in (0, 1))
            out = self.device("encode", encode, k, v)
        packed, books = out if carries else (out, None)  # [N, L * page_bytes], [N, L * codebook_bytes]
        trailers = torch.tensor([list(group.pack_trailer(key, 0, carries)) for key in keys], dtype=torch.uint8)
        blobs = torch.cat([packed, trailers] + ([books] if carries else []), dim=1)
        if blobs.shape[1] != self.blob_bytes:
            raise RuntimeError(f"a page encoded to {blobs.shape[1]} bytes, not the {self.blob_bytes} expected")
        with self._lock:
            self._stats["encode_s"] += time.perf_counter() - start
        return list(blobs)

    def _decode_batch(self, blobs, sink=None, defer=False) -> Optional[torch.Tensor]:
        """Pages [N, 2, L, P, H, D] from blobs `_is_page_of` accepted (a list, or a [N, blob_bytes] tensor), in one
        codec call: every layer of every page as pages of one chunk (page-local codecs), or as one-page units
        with their own codebooks (`Codec.decode_units`; each blob carries its layers' codebooks). With ``sink``,
        ``sink(pages)`` takes them where they were decoded (on the codec's device and stream) and None is
        returned; with ``defer`` too, its copies may still run when this returns (`DeviceCodec.finish` waits)."""
        start = time.perf_counter()
        g, lay, group = self.geometry, self.layout, self.group
        if isinstance(blobs, torch.Tensor):
            stacked = blobs
        else:
            stacked = torch.stack([b[: group.blob_bytes] for b in blobs],
                                  out=self.device.staging((len(blobs), group.blob_bytes), torch.uint8))
        n = stacked.shape[0]
        shape = (n, g.num_layers, self.page_size, g.num_kv_heads, g.head_dim)
        units = (n, g.num_layers, lay.page_size, g.num_kv_heads, g.head_dim)

        def decode(blobs):  # on the codec's device: the page bytes and codebooks are cut from the blobs there
            body = blobs[:, : group.pages_bytes].reshape(n * g.num_layers, lay.page_bytes)
            if group.has_codebooks:  # one layout for every layer: the codebooks are [L, codebook_bytes] per blob
                books = blobs[:, group.books_offset : group.blob_bytes].reshape(n * g.num_layers, lay.codebook_bytes)
                fused = self._fused_decode(body, books, n)
                if fused is None and self.units is not None and blobs.device.type == "cuda":
                    fused = self._gathered(body, books, n)
                if fused is not None:
                    return fused
                k, v = self.frame.from_stored(*self.codec.decode_units(lay, body, books), 0)
                return torch.stack([k.reshape(units)[:, :, : self.page_size],
                                    v.reshape(units)[:, :, : self.page_size]], dim=1).to(g.dtype)
            k, v = self.frame.from_stored(*self.codec.decode_pages(lay, body, body.new_empty(0)), 0)
            return torch.stack([k.reshape(shape), v.reshape(shape)], dim=1)

        out = self.device("decode", decode, stacked, sink=sink, defer=defer)
        with self._lock:
            self._stats["decode_s"] += time.perf_counter() - start
        return out

    def _fused_decode(self, body: torch.Tensor, books: torch.Tensor, n: int) -> Optional[torch.Tensor]:
        """Pages [n, 2, L, P, H, D] of QVG-family codecs decoded on the CPU by the fused loop (`decode_units`, then
        the value rotation, bit for bit, written once into the stacked pages); None where it does not serve."""
        g, lay = self.geometry, self.layout
        if lay.page_size != self.page_size or g.dtype != torch.bfloat16:
            return None
        out = decode_units_bf16(self.codec, lay, body, books, self.frame.levers.vrot == "hadamard", n)
        return None if out is None else out.view(n, 2, g.num_layers, self.page_size, g.num_kv_heads, g.head_dim)

    def _gathered(self, body: torch.Tensor, books: torch.Tensor, n: int) -> torch.Tensor:
        """Pages [n, 2, L, P, H, D] of units with codebooks decoded by the gather kernel (`UnitGather`: one launch
        for every layer of every page, the value rotation undone inside)."""
        g = self.geometry
        k, v = self.units(body, books)
        shape = (n, g.num_layers, self.layout.page_size, g.num_kv_heads, g.head_dim)
        return torch.stack([k.view(shape)[:, :, : self.page_size], v.view(shape)[:, :, : self.page_size]], dim=1)

    def _batched(self) -> bool:
        """Whether pages are decoded in batches (page-local codecs without codebooks)."""
        return self.codec is not None and self.codec.page_local and not self.group.has_codebooks

    def _batch_pages(self, kind: str) -> int:
        """Pages per codec call for ``kind`` ("encode" or "decode"): BATCH_PAGES on a GPU, fewer on the CPU."""
        if self.device.device.type == "cuda":
            return BATCH_PAGES
        return max(1, min(BATCH_PAGES, CPU_BATCH_PAGES[kind]))

    def _batched_decode(self) -> bool:
        """Whether pages are decoded in batches: `_batched`, or a codec with codebooks (each page carries its own;
        every layer of every page of a batch is a unit of one `Codec.decode_units` call)."""
        return self._batched() or (self.codec is not None and self.persistent is None and self.group.has_codebooks)

    def _batched_encode(self) -> bool:
        """Whether pages are encoded in batches: `_batched`, or a codec that encodes one-page chunks together."""
        return self._batched() or (self.codec is not None and self.codec.batch_encodes)

    def _check(self):
        """What the file tier checks in each blob it reads back beyond its checksum (`kvbackend.page_check`)."""
        return self.page_check.reason if self.page_check is not None else None

    def _is_page_of(self, blob: torch.Tensor, key: int) -> bool:
        """Whether ``blob`` is a page group of this configuration whose trailer names ``key``."""
        group = self.group
        if blob.numel() < group.books_offset:
            return False
        trailer = group.unpack_trailer(bytes(blob[group.pages_bytes : group.books_offset].numpy()))
        return trailer is not None and trailer.key == key and group.length(trailer.carries_codebook) == blob.numel()

    def _decode(self, blob: torch.Tensor, key: int) -> torch.Tensor:
        start = time.perf_counter()
        g, lay = self.geometry, self.layout
        if self.persistent is not None:  # raises CorruptStream (a ValueError) on damage: the page is a miss
            shape = (g.num_layers, self.page_size, g.num_kv_heads, g.head_dim)
            if blob.numel() < 8 or struct.unpack("<Q", bytes(blob[:8].numpy()))[0] != key:
                raise CorruptStream("the stored stream is not this key's page")
            k, v = self.persistent.decode(blob[8:].numpy(), shape=shape)  # another shape: refused before decoding
            if tuple(k.shape) != shape or tuple(v.shape) != shape:
                raise ValueError(f"a stored page decoded to {tuple(k.shape)}, not {shape}")
            big = torch.finfo(g.dtype).max  # values within the bound past the pool dtype's range saturate, never inf
            out = torch.stack([torch.from_numpy(k), torch.from_numpy(v)]).clamp_(-big, big).to(g.dtype)
            with self._lock:
                self._stats["decode_s"] += time.perf_counter() - start
            return out
        group = self.group
        if not self._is_page_of(blob, key):
            raise CorruptStream("the stored page group is not this key's page of this configuration")
        spans = [(group.page_span(layer), group.book_span(layer)) for layer in range(g.num_layers)]
        pages = torch.stack([blob[s : s + n] for (s, n), _ in spans])  # every layer's page and slot: one decode
        books = torch.stack([blob[s : s + n] for _, (s, n) in spans])
        fused = self._fused_decode(pages, books, 1)
        if fused is not None:
            out = fused[0]
        else:
            out = torch.empty(2, g.num_layers, self.page_size, g.num_kv_heads, g.head_dim, dtype=g.dtype)
            k, v = self.frame.from_stored(*self.codec.decode_units(lay, pages, books), 0)
            shape = (g.num_layers, lay.page_size, g.num_kv_heads, g.head_dim)
            out[0], out[1] = k.reshape(shape)[:, : self.page_size], v.reshape(shape)[:, : self.page_size]
        with self._lock:
            self._stats["decode_s"] += time.perf_counter() - start
        return out

    def _page_from_flat(self, flat: torch.Tensor) -> torch.Tensor:
        """A flat host data page (in the pool's layout) as [2, L, P, H, D]."""
        g = self.geometry
        if self.mem_pool_host.layout == "layer_first":
            return flat.reshape(2, g.num_layers, self.page_size, g.num_kv_heads, g.head_dim)
        return flat.reshape(2, self.page_size, g.num_layers, g.num_kv_heads, g.head_dim).transpose(1, 2)

    def _flat_from_page(self, page: torch.Tensor) -> torch.Tensor:
        """Inverse of `_page_from_flat`."""
        ordered = page.transpose(1, 2) if self.mem_pool_host.layout == "page_first" else page
        return ordered.contiguous().flatten()

    def _page_from_pool(self, index: int) -> torch.Tensor:
        return self._page_from_flat(self.mem_pool_host.get_data_page(index, flat=True))

    def _slot(self, index) -> int:
        """The first token slot of the page at host index ``index``; ValueError outside the host pool (a negative
        index would slice from the pool's end: another page's slots)."""
        if self.writer is not None:
            return self.writer.slot(index)
        start, tokens = int(index), getattr(self.mem_pool_host, "size", None)  # SGLang's host pools: tokens
        if start < 0 or (isinstance(tokens, int) and start + self.page_size > tokens):
            raise ValueError(f"host index {start} is outside the host pool of {tokens} tokens "
                             f"(pages of {self.page_size})")
        return start

    def _page_to_pool(self, index: int, page: torch.Tensor) -> None:
        self.mem_pool_host.set_from_flat_data_page(index, self._flat_from_page(page))

    def _store(self, keys: List[str], page_of, slot_of=None) -> List[bool]:
        """Encode and write the pages ``page_of(i)`` of ``keys[i]`` (a page that cannot be had, or encoded, fails
        alone; ``slot_of(i)``: its token slot, where ``page_of(i)`` is a view of the pool `writer` reads), a batch
        at a time: a batch's blobs go to the file tier's writer threads while the next batch is read and encoded.
        Every write handed over is waited for and counted, whatever fails after it; never raises."""
        n = len(keys)
        try:
            self._private_directories()  # recreated if it was removed while running
        except (OSError, ValueError) as exc:  # unsafe or impossible to create: nothing is written there
            self._log_once("directory", f"kvbackend storage: {exc}")
            with self._lock:
                self._stats["failures"] += n
            return [False] * n
        step = self._batch_pages("encode") if self._batched_encode() else 1
        writes = []  # (positions, handle) of the batches handed to the tier
        results = [False] * n
        from_pool = 0.0
        try:
            for at in range(0, n, step):
                start = time.perf_counter()
                rows, pages, slots = [], [], []
                for i in range(at, min(at + step, n)):
                    try:
                        page = page_of(i)
                        if slot_of is not None:
                            slots.append(slot_of(i))
                        pages.append(page)
                        rows.append(i)
                    except Exception as exc:  # noqa: BLE001 - a page the pool cannot give (a bad host index) fails alone
                        self._log_once("from_pool", f"kvbackend storage: reading a page from the host pool failed: {exc!r}")
                from_pool += time.perf_counter() - start
                blobs, encoded = self._encode_part([keys[i] for i in rows], pages,
                                                   slots if slot_of is not None else None)
                if blobs:
                    positions = [i for i, good in zip(rows, encoded) if good]
                    writes.append((positions, self.tier.put([self._key(keys[i]) for i in positions], blobs)))
        except Exception as exc:  # noqa: BLE001 - the pages not handed over fail; those that were are counted below
            self._log_once("store", f"kvbackend storage: storing pages failed: {exc!r}")
        start = time.perf_counter()
        for positions, handle in writes:
            try:
                written = handle.result()
            except Exception as exc:  # noqa: BLE001 - a write that raised stored nothing; the rest are waited for
                self._log_once("write", f"kvbackend storage: writing pages failed: {exc!r}")
                continue
            for i, ok in zip(positions, written):
                results[i] = ok
        # a later batch's write may have evicted an earlier batch's pages: only pages held now count as stored
        results = [ok and self.tier.blob_size(self._key(keys[i])) is not None for i, ok in enumerate(results)]
        waited = time.perf_counter() - start
        with self._lock:
            self._stats["from_pool_s"] += from_pool
            self._stats["write_s"] += waited  # waiting for writes the encodes did not hide
            self._stats["pages_set"] += sum(results)
            self._stats["raw_bytes_set"] += sum(results) * self._raw_page_bytes()
            self._stats["failures"] += results.count(False)
        return results

    def _encode_part(self, keys: List[str], pages: List[torch.Tensor],
                     starts: Optional[List[int]] = None) -> tuple[list, list]:
        """(blobs, encoded?) of one batch of ``pages``: in one codec call where the codec allows; a batch that
        fails (a page with non-finite values, ...) goes page by page, so a bad page fails alone."""
        ints = [self._key(k) for k in keys]
        if pages and self._batched_encode() and self._batch_pages("encode") > 1:
            try:
                return self._encode_batch(pages, ints, starts), [True] * len(pages)
            except Exception:  # noqa: BLE001 - page by page below, so it fails alone
                pass
        blobs, encoded = [], []
        for key, page in zip(ints, pages):
            try:
                blobs.append(self._encode(page, key))
                encoded.append(True)
            except Exception as exc:  # a bad page fails alone, never the I/O thread
                self._log_once("encode", f"kvbackend storage: encoding a page failed: {exc!r}")
                encoded.append(False)
        return blobs, encoded

    def _decode_rows(self, rows: List[int], buffers: List[torch.Tensor]) -> List[tuple[int, Optional[torch.Tensor]]]:
        """(row, page or None) of valid blobs ``buffers[row]``, decoded in one batch; a batch that fails goes
        page by page, so a page that cannot be decoded is a miss alone."""
        done = self._batch_or_one_by_one(len(rows), lambda: self._decode_batch([buffers[i] for i in rows]),
                                         lambda j: self._decode_batch([buffers[rows[j]]])[0])
        return [(rows[j], page) for j, page in done]

    def _batch_or_one_by_one(self, count: int, batch, one) -> list:
        """(j, result) for j in 0..count-1: ``batch()`` decodes all of them (its row j, or None where it returns
        None); where it fails, ``one(j)`` decodes each alone and a row that fails again is left out (a miss)."""
        try:
            out = batch()
            return [(j, None if out is None else out[j]) for j in range(count)]
        except Exception as exc:  # noqa: BLE001 - one page at a time below
            self._log_once("decode", f"kvbackend storage: decoding pages failed: {exc!r}")
        done = []
        for j in range(count) if count > 1 else ():
            try:
                done.append((j, one(j)))
            except Exception:  # noqa: BLE001 - logged once above; this row is a miss
                continue
        return done

    def _load(self, keys: List[str], deliver=None) -> list:
        """The pages of ``keys`` (None for a miss). With ``deliver(row, page)``, each page is handed over as soon
        as its batch is decoded, while the next batch decodes beside it (on the device codec's stream), and the
        list holds True in its place."""
        ints = [self._key(k) for k in keys]
        sizes = [self.tier.blob_size(i) or 0 for i in ints]
        batch = None  # [n, blob_bytes]: every blob of one length in one buffer, checked in one pass
        if self.blob_bytes is not None:  # a blob of another length is not a page of this configuration
            sizes = [size if size == self.blob_bytes else 0 for size in sizes]
            batch = torch.empty(len(ints), self.blob_bytes, dtype=torch.uint8)
            buffers = [batch[i] if size else batch[i, :0] for i, size in enumerate(sizes)]
        else:
            buffers = [torch.empty(size, dtype=torch.uint8) for size in sizes]
        start = time.perf_counter()
        found = self.tier.get(ints, buffers, expected_len=[b.numel() for b in buffers],  # exact length
                              check=self._check() if batch is None else None).result()
        if batch is not None and self.page_check is not None:  # index fields of every hit at once, on this thread
            # (a check per blob inside the tier's reader threads took the interpreter lock once per blob)
            passed = set(refuse_crafted(self.page_check, self.tier, batch, [j for j, hit in enumerate(found) if hit],
                                        ints))
            found = [j in passed for j in range(len(found))]
        with self._lock:
            self._stats["read_s"] += time.perf_counter() - start
        pages: list[Optional[torch.Tensor]] = []
        batched = self._batched_decode()
        if batched:
            valid = [i for i, (buffer, good, key) in enumerate(zip(buffers, found, ints))
                     if good and buffer.numel() == self.blob_bytes and self._is_page_of(buffer, key)]
            pages = [None] * len(buffers)
            step = self._batch_pages("decode")
            batches = [valid[at : at + step] for at in range(0, len(valid), step)]
            if deliver is None or len(batches) < 2:
                for rows in batches:
                    for i, page in self._decode_rows(rows, buffers):
                        pages[i] = page if deliver is None else self._hand_over(deliver, i, page)
            else:  # batch j + 1 decodes in a helper thread while batch j is delivered here
                with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvbackend-decode") as helper:
                    ahead = helper.submit(self._decode_rows, batches[0], buffers)
                    for j in range(len(batches)):
                        done = ahead.result()
                        if j + 1 < len(batches):
                            ahead = helper.submit(self._decode_rows, batches[j + 1], buffers)
                        for i, page in done:
                            pages[i] = self._hand_over(deliver, i, page)
        for buffer, good, key in zip(buffers, found, ints) if not batched else ():
            if not good or buffer.numel() == 0:
                pages.append(None)
                continue
            try:
                page = self._decode(buffer, key)
            except Exception as exc:
                self._log_once("decode", f"kvbackend storage: decoding a page failed: {exc!r}")
                pages.append(None)
                continue
            pages.append(page if deliver is None else self._hand_over(deliver, len(pages), page))
        with self._lock:
            hits = sum(p is not None for p in pages)
            self._stats["hits"] += hits
            self._stats["misses"] += len(pages) - hits
        return pages

    def _load_into_pool(self, keys: List[str], host_indices: torch.Tensor) -> List[bool]:
        """batch_get_v1 for batched codecs and a pool `PoolWriter` can write: blobs are read a batch at a time into
        (page-locked) staging rows, READ_AHEAD batches ahead of the decode; each batch is decoded in one codec
        call and its pages are copied from where they were decoded straight into the pool's slots (on a GPU:
        one asynchronous strided copy per page, no host copy). A page with a bad host index, a missing, short,
        corrupt or foreign blob, or a page that cannot be decoded is a miss alone; its slot is not written."""
        n, p = len(keys), self.page_size
        ints = [self._key(k) for k in keys]
        starts: list[Optional[int]] = []
        for i in range(n):
            try:
                starts.append(self.writer.slot(host_indices[i * p]))
            except Exception as exc:  # noqa: BLE001 - a bad or missing host index: that page alone misses
                self._log_once("deliver", f"kvbackend storage: a page cannot go into the host pool: {exc!r}")
                starts.append(None)
        rows = [i for i in range(n) if starts[i] is not None and self.tier.blob_size(ints[i]) == self.blob_bytes]
        step = self._batch_pages("decode")
        batches = iter([rows[at : at + step] for at in range(0, len(rows), step)])

        def read(batch):
            staging = self.device.staging((len(batch), self.blob_bytes), torch.uint8)
            return batch, staging, self.tier.get([ints[i] for i in batch], list(staging),  # checked below, together
                                                 expected_len=[self.blob_bytes] * len(batch))

        pending = collections.deque(read(b) for b in itertools.islice(batches, max(1, READ_AHEAD)))
        results = [False] * n
        read_s = 0.0
        try:
            while pending:
                batch, staging, handle = pending.popleft()
                following = next(batches, None)
                if following is not None:
                    pending.append(read(following))
                start = time.perf_counter()
                found = handle.result()
                read_s += time.perf_counter() - start
                checked = refuse_crafted(self.page_check, self.tier, staging, [j for j, hit in enumerate(found) if hit],
                                         [ints[i] for i in batch])
                good = [j for j in checked if self._is_page_of(staging[j], ints[batch[j]])]
                if len(good) < len(batch):  # the rows that read well, packed together (page-locked again)
                    staging = torch.index_select(staging, 0, torch.tensor(good, dtype=torch.long),
                                                 out=self.device.staging((len(good), self.blob_bytes), torch.uint8))
                for j in self._decode_into_pool(staging, [starts[batch[j]] for j in good]):
                    results[batch[good[j]]] = True
        finally:  # no copy into the pool outlives the call, even one that fails (its slots may be reused at once)
            self.device.finish()
        with self._lock:
            self._stats["read_s"] += read_s
            hits = sum(results)
            self._stats["hits"] += hits
            self._stats["misses"] += n - hits
        return results

    def _decode_into_pool(self, blobs: torch.Tensor, starts: List[int]) -> List[int]:
        """Rows of ``blobs`` decoded into the pool at ``starts``: those that made it. A batch that fails goes
        page by page, so a page that cannot be decoded is a miss alone."""
        if not starts:
            return []
        done = self._batch_or_one_by_one(  # copies into the pool overlap the next batch (`_load_into_pool` waits)
            len(starts), lambda: self._decode_batch(blobs, sink=lambda pages: self.writer.write(pages, starts), defer=True),
            lambda j: self._decode_batch(blobs[j : j + 1], sink=lambda pages: self.writer.write(pages, [starts[j]]),
                                         defer=True))
        return [j for j, _ in done]

    def _hand_over(self, deliver, row: int, page: torch.Tensor) -> Optional[bool]:
        """``deliver(row, page)``: True, or None (a miss of this page alone) where the host pool refuses it."""
        try:
            deliver(row, page)
        except Exception as exc:  # noqa: BLE001 - a bad host index or a pool error: this page alone misses
            self._log_once("deliver", f"kvbackend storage: copying a page into the host pool failed: {exc!r}")
            return None
        return True

    def _log_once(self, kind: str, message: str) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            log.error(message)

    # -- the v1 zero-copy interface (used when "interface_v1": 1) -----------------------------
    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        try:
            self._require_pool()
            # straight into the pool where the copies can be asynchronous (a page-locked pool) or are host copies
            # anyway (the CPU); a GPU into a pageable pool goes through page-locked staging (below), which the
            # driver's own staging of each strided copy would make slower (1.72x HiCacheFile's get against 2.18x)
            if self.writer is not None and self._batched_decode() and (
                    self.writer.direct or self.device.device.type == "cpu"):
                return self._load_into_pool(list(keys), host_indices)
            copying = [0.0]

            def deliver(i: int, page: torch.Tensor) -> None:  # into the host pool as soon as it is decoded
                start = time.perf_counter()
                self._page_to_pool(self._slot(host_indices[i * self.page_size]), page)
                copying[0] += time.perf_counter() - start

            results = [page is not None for page in self._load(list(keys), deliver)]
            with self._lock:
                self._stats["to_pool_s"] += copying[0]
            return results
        except Exception as exc:  # never None, never an exception into SGLang's I/O threads
            self._log_once("get_v1", f"kvbackend storage: batch_get_v1 failed: {exc!r}")
            with self._lock:  # (`_load` counts its own pages and never raises past its reads)
                self._stats["misses"] += len(keys)
            return [False] * len(keys)

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        try:
            self._require_pool()
            p, writer = self.page_size, self.writer

            def page_of(i: int) -> torch.Tensor:  # read in place where the pool allows, else copied out of it
                start = self._slot(host_indices[i * p])
                return writer.page(start) if writer is not None else self._page_from_pool(start)

            slot_of = (lambda i: writer.slot(host_indices[i * p])) if writer is not None else None
            return self._store(list(keys), page_of, slot_of)
        except Exception as exc:
            self._log_once("set_v1", f"kvbackend storage: batch_set_v1 failed: {exc!r}")
            with self._lock:
                self._stats["failures"] += len(keys)
            return [False] * len(keys)

    # -- the generic interface (flat data pages as SGLang's host pool returns them) ------------
    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None):
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None):
        self._require_pool()
        out = []
        for i, page in enumerate(self._load(list(keys))):
            if page is None:
                out.append(None)
                continue
            flat = self._flat_from_page(page)
            if target_locations is not None and target_locations[i] is not None:
                try:
                    target_locations[i].copy_(flat.view_as(target_locations[i]))
                except Exception as exc:  # noqa: BLE001 - a target of another size: this page alone misses
                    self._log_once("target", f"kvbackend storage: a page does not fit its target: {exc!r}")
                    with self._lock:  # (`_load` counted it a hit)
                        self._stats["hits"] -= 1
                        self._stats["misses"] += 1
                    out.append(None)
                    continue
                flat = target_locations[i]
            out.append(flat)
        return out

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        self._require_pool()
        if values is None or len(values) != len(keys):
            raise ValueError(f"batch_set needs one value per key ({len(keys)} keys)")
        return all(self._store(list(keys), lambda i: self._page_from_flat(values[i])))

    def exists(self, key: str) -> bool:
        self._require_pool()
        return self.tier.contains([self._key(key)]) == 1

    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        self._require_pool()
        return self.tier.contains([self._key(k) for k in keys])

    def clear(self) -> None:
        if self.tier is not None:
            self.tier.evict(1 << 62)

    def get_stats(self) -> dict:
        held = self.tier.stats() if self.tier is not None else None
        stored = held.bytes_used if held is not None else 0
        with self._lock:
            stats = dict(self._stats)
        # raw bytes of the pages the tier holds now (pages set again, or evicted, are not counted twice) over the
        # bytes their files take
        raw = held.blobs * self._raw_page_bytes() if held is not None else 0
        stats.update(bytes_stored=stored, codec=self.codec_spec, device=str(self.device.device),
                     compression_ratio=raw / stored if stored else None)
        return stats


# the options this backend reads from SGLang's `extra_config`, and the keys SGLang's loader of dynamic backends reads
OPTIONS = ("codec", "directory", "budget_gb", "device")
LOADER_KEYS = ("backend_name", "module_path", "class_name", "interface_v1")


def _warn_unknown_options(extra: dict) -> None:
    """Log the keys of ``extra`` that neither this backend nor SGLang's loader reads (a misspelled option falls back
    to its default: ``budget_GB`` gave 64 GiB), naming the nearest option. A warning, not an error: keys a later
    SGLang adds for its own use stay harmless."""
    for key in sorted(set(map(str, extra)) - set(OPTIONS) - set(LOADER_KEYS)):
        near = difflib.get_close_matches(key.lower(), OPTIONS, n=1, cutoff=0.6)
        log.warning("kvbackend storage: extra_config option %r is not one of %s and is ignored%s", key,
                    ", ".join(OPTIONS), f" (did you mean {near[0]!r}?)" if near else "")


def _namespace(config: HiCacheStorageConfig) -> str:
    """Directory name for one model and rank: a readable part plus a hash of the exact model name, so
    names that read alike (``org/m``, ``org-m``) never share pages."""
    model = str(getattr(config, "model_name", None) or "model")
    readable = re.sub(r"[^A-Za-z0-9._-]", "-", model)[:48]
    digest = hashlib.blake2b(model.encode(), digest_size=8).hexdigest()
    ranks = [("tp", "tp_rank", "tp_size"), ("pp", "pp_rank", "pp_size"), ("cp", "attn_cp_rank", "attn_cp_size"),
             ("dcp", "dcp_rank", "dcp_size")]
    rank = "_".join(f"{tag}{int(getattr(config, r, 0) or 0)}of{int(getattr(config, n, 1) or 1)}" for tag, r, n in ranks)
    return f"{readable}-{digest}_{rank}_dp{int(getattr(config, 'dp_rank', 0) or 0)}"
