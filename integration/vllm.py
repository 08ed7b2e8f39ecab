"""vLLM secondary offloading tier: compressed chunks in kvbackend's crash-safe file tier.

vLLM (0.33) offloads KV blocks to a CPU primary tier and cascades them to secondary tiers. This one
reads a chunk from the primary tier's buffer, compresses it and stores it as one checksummed blob;
a promotion decompresses it back into the primary slot. Configure it as a tier of vLLM's offloading
connector, for example:

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"cpu_bytes_to_use": 68719476736, "secondary_tiers": [
        {"type": "KVBackendTier", "module_path": "kvbackend.integration.vllm",
         "root_dir": "/var/cache/kvbackend-vllm", "codec": "rtn:bits=4,group=64",
         "head_dim": 128, "dtype": "bfloat16", "budget_gb": 200}]}}'

Two modes:
- rows: codecs that quantize each ``head_dim`` row on its own (``rtn``, ``fp8``, ``fp16``, ``bf16``,
  ``identity``). Every vLLM KV layout keeps a token's head row contiguous, so a chunk needs no more
  description than ``head_dim``.
- blocks: codecs over groups of tokens (``kivi``'s per-channel keys, ``qvg``, ``quantwm`` without PSAC
  rows) and the ``vrot=hadamard`` lever. The tier reads the chunk's token structure from the engine's
  offloading config (`integration/vllm_layout.py`: LBHNC/LBNHC layouts, one KV-cache group, no
  context parallelism, pages that are plain K/V) and needs ``kv_heads`` (per worker) in the tier
  config; each worker's layers are encoded as ``[tokens, kv_heads, head_dim]`` K and V in pages of
  ``page_tokens`` tokens. Layouts it cannot read are refused with the reason, never guessed.
Levers that need token positions (``sink=``, ``prerope=``) or queries (``psac=``, ``quantwm``'s
``rank=``) are refused: an offloading tier sees neither.

Stored chunks live under ``root_dir/<fingerprint>``. The fingerprint covers everything that shapes a
chunk's bytes: the chunk size, the codec's byte layout, ``head_dim`` and ``dtype``, the engine's
description of the primary tier (model, KV dtype, layers per group, tokens per block, blocks per
chunk, bytes per block, parallel layout, KV layout) and this tier's format version. A blob whose
length is not what this configuration writes is a miss. ``root_dir`` must belong to the current user
and not be writable by group or others (it is created 0700 when absent).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections.abc import Collection, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ClassVar

import numpy as np
import torch
from vllm.v1.kv_offload.base import LookupResult, Medium, OffloadKey, ReqContext, RequestOffloadingContext
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvbackend.codecs import get as get_codec
from kvbackend.errors import SpecError
from kvbackend.geometry import Geometry
from kvbackend.levers import rotate_values
from kvbackend.page_check import PageCheck, refuse_crafted
from kvbackend.tiers.file import FileTier
from kvbackend.integration.storage_options import (DeviceCodec, budget_bytes, codec_device, path_option,
                                                   private_directory, warn_codebooks_outweigh)
from kvbackend.integration.vllm_layout import BlockLayout, block_layout

log = logging.getLogger(__name__)

ROW_CODECS = ("rtn", "fp8", "fp16", "bf16", "identity")
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_ROWS_PER_PAGE = 64
BATCH_BYTES = 256 << 20  # raw KV per codec call on a GPU (32 chunks of 8 MiB)
WINDOW_BYTES = 256 << 20  # stored bytes a load reads ahead of its decoding (page-locked on a GPU): two per job
FORMAT_VERSION = 3  # of a stored chunk's bytes; enters the fingerprint (2: the blocks mode; 3: the key trailer)
KEY_BYTES = 8  # each blob ends in its key (little-endian u64): a blob filed under another key is refused, not served


class KVBackendTier(SecondaryTierManager):
    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(self, offloading_spec, primary_kv_view: memoryview, tier_type: str, root_dir: str | None = None,
                 codec: str = "rtn:bits=4,group=64", head_dim: int | None = None, dtype: str | None = None,
                 budget_gb: float = 64.0, n_threads: int = 4, kv_heads: int | None = None, page_tokens: int = 64,
                 device: str = "auto", backpressure_detector=None) -> None:
        super().__init__(offloading_spec=offloading_spec, primary_kv_view=primary_kv_view, tier_type=tier_type,
                         backpressure_detector=backpressure_detector)
        self.root_dir = path_option("root_dir", root_dir)
        budget = budget_bytes(budget_gb)
        if isinstance(n_threads, bool) or not isinstance(n_threads, int) or n_threads < 1:
            raise ValueError(f"n_threads must be a positive int, got {n_threads!r}")
        self.codec = get_codec(codec)
        # where the blocks mode's page-local codecs run a chunk's pages (the GPU when there is one), with the
        # CPU as the fallback for a batch the device fails on
        self.device = DeviceCodec(codec_device(device), log)
        levers = self.codec.levers
        if levers.sink or levers.rope or levers.psac:  # never silently dropped
            raise SpecError(f"{codec!r}: an offloading tier sees no token positions or queries, so the levers sink=, "
                            "prerope=, pagerope= and psac= cannot be applied; drop them from the spec")
        if getattr(self.codec.spec, "rank", 0):
            raise SpecError(f"{codec!r}: PSAC rows are fitted to queries, which an offloading tier never sees; "
                            "use rank=0")
        self.rows_mode = self.codec.spec.name in ROW_CODECS and not levers.active
        if isinstance(page_tokens, bool) or not isinstance(page_tokens, int) or not 1 <= page_tokens <= 256:
            raise ValueError(f"page_tokens must be an int in 1..256, got {page_tokens!r}")
        head_dim = head_dim or _head_dim_from_spec(offloading_spec)
        if not head_dim:
            raise ValueError("set head_dim in the tier config (it could not be read from the offloading spec)")
        engine_dtype = _kv_dtype_from_spec(offloading_spec)
        dtype = dtype or engine_dtype or "bfloat16"
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        if engine_dtype is not None and engine_dtype != dtype:
            raise ValueError(f"dtype {dtype!r} is not the engine's KV cache dtype {engine_dtype!r}; the tier reads "
                             f"rows of {sorted(_DTYPES)} values only")
        self.dtype = _DTYPES[dtype]
        self.chunk_bytes = self.block_size_bytes
        self.block: BlockLayout | None = None
        if self.rows_mode:
            self.geometry = Geometry(1, 1, int(head_dim), self.dtype)
            self.layout = self.codec.layout(self.geometry, _ROWS_PER_PAGE)
        else:  # a codec over groups of tokens (or with vrot=): the chunk's K/V structure, or a clear refusal
            self.block = block_layout(offloading_spec, int(head_dim), kv_heads, self.dtype.itemsize, self.chunk_bytes)
            self.geometry = Geometry(1, self.block.kv_heads, int(head_dim), self.dtype)
            self.layout = self.codec.layout(self.geometry, page_tokens)
        self._primary = torch.from_numpy(np.frombuffer(primary_kv_view, dtype=np.uint8))  # shares the buffer
        self._row_bytes = int(head_dim) * self.geometry.dtype.itemsize
        self.body_bytes = self._blob_bytes()  # what the codec writes for a chunk
        self.blob_bytes = self.body_bytes + KEY_BYTES  # what is stored: the body, then the chunk's key
        self._warn_codebooks_per_chunk()
        self.fingerprint = self._fingerprint(offloading_spec)
        self.directory = os.path.join(self.root_dir, self.fingerprint)
        self._private_directories()
        self.store = FileTier(self.directory, budget, self.fingerprint)
        self.page_check = PageCheck.of([(f"page {i}", at, self.codec, self.layout)
                                        for i, at in enumerate(self._page_offsets())])
        self._pool = ThreadPoolExecutor(max_workers=n_threads, thread_name_prefix="kvbackend-vllm")
        self._lock = threading.Lock()
        self._finished: list[JobResult] = []
        self._inflight: dict[int, Future] = {}
        self._stats = {"chunks_stored": 0, "chunks_loaded": 0, "failed_jobs": 0, "raw_bytes_stored": 0}

    def _warn_codebooks_per_chunk(self) -> None:
        """A vLLM chunk is a block of a few dozen tokens, and each carries its own codebooks."""
        if self.block is not None:
            codes = -(-self.block.tokens // self.layout.page_size) * self.layout.page_bytes
        else:
            codes = -(-(self.chunk_bytes // self._row_bytes // 2) // _ROWS_PER_PAGE) * self.layout.page_bytes
        bpv = 8 * self.blob_bytes / (self.chunk_bytes / self.dtype.itemsize)
        warn_codebooks_outweigh(log, "kvbackend vLLM tier", self.codec.spec_string, bpv, self.layout.codebook_bytes,
                                codes, "rtn:bits=4,group=64 or kivi:bits=4,group=64")

    def _fingerprint(self, spec) -> str:
        """16 hex characters naming everything that shapes a stored chunk's bytes."""
        facts = {"format": FORMAT_VERSION, "chunk_bytes": self.chunk_bytes, "blob_bytes": self.blob_bytes,
                 "codec": self.codec.spec_string, "layout": self.layout.fingerprint,
                 "blocks": self.block.facts() if self.block else None,
                 "head_dim": self.geometry.head_dim, "dtype": str(self.dtype), "primary": _primary_facts(spec)}
        text = json.dumps(facts, sort_keys=True, default=repr)
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()

    def _private_directories(self) -> None:
        """``root_dir`` and this configuration's directory in it: created 0700 if absent, refused if unsafe."""
        private_directory(self.root_dir, "root_dir")
        private_directory(self.directory, "root_dir")

    # -- chunk <-> blob -----------------------------------------------------------------------
    @staticmethod
    def _key(key: OffloadKey) -> int:
        return int.from_bytes(hashlib.blake2b(bytes(key), digest_size=8).digest(), "little") >> 1

    def _chunk(self, chunk_id: int) -> torch.Tensor:
        start = int(chunk_id) * self.chunk_bytes
        return self._primary[start : start + self.chunk_bytes]

    def _blob_bytes(self) -> int:
        """Length of every blob `_encode` writes for a chunk of this configuration."""
        if self.block is not None:
            pages = -(-self.block.tokens // self.layout.page_size)
            per_layer = pages * self.layout.page_bytes + self.layout.codebook_bytes
            return self.block.workers * self.block.layers * per_layer + self.chunk_bytes - self.block.used_bytes
        half = self.chunk_bytes // self._row_bytes // 2
        body = -(-half // _ROWS_PER_PAGE) * self.layout.page_bytes + self.layout.codebook_bytes if half else 0
        return body + self.chunk_bytes - 2 * half * self._row_bytes

    def _page_offsets(self) -> list[int]:
        """Where each packed page starts in a blob `_encode` writes (its index fields are checked on every load)."""
        if self.block is not None:
            pages = -(-self.block.tokens // self.layout.page_size)
            per_layer = pages * self.layout.page_bytes + self.layout.codebook_bytes
            return [u * per_layer + p * self.layout.page_bytes
                    for u in range(self.block.workers * self.block.layers) for p in range(pages)]
        half = self.chunk_bytes // self._row_bytes // 2
        return [p * self.layout.page_bytes for p in range(-(-half // _ROWS_PER_PAGE))] if half else []

    def _encode(self, raw: torch.Tensor) -> torch.Tensor:
        """Rows of head_dim values, split in two halves passed as the codec's K and V, plus a raw tail (rows
        mode); or every worker's and layer's K and V, then the chunk's padding (blocks mode)."""
        if self.block is not None:
            return self._encode_blocks([raw])[0]
        rows = raw.numel() // self._row_bytes
        half = rows // 2
        values = raw[: 2 * half * self._row_bytes].view(self.dtype).view(2, half, 1, -1)
        tail = raw[2 * half * self._row_bytes :]
        parts = []
        if half:
            chunk = self.codec.encode(values[0], values[1], self.layout)
            parts += [chunk.pages.reshape(-1), chunk.codebook.reshape(-1)]
        return torch.cat(parts + [tail.clone()])

    def _batched(self) -> bool:
        """Blocks mode with a page-local codec whose pages tile each layer's tokens exactly."""
        return (self.codec.page_local and self.layout.codebook_bytes == 0
                and self.block.tokens % self.layout.page_size == 0)

    def _encode_blocks(self, raws: list[torch.Tensor]) -> torch.Tensor:
        """``[len(raws), blob_bytes]``: each chunk's every worker's and layer's pages (and codebook slot), then its
        padding. The chunks' units go through the codec in one call where it encodes units side by side: the same
        bytes as one chunk at a time."""
        block = self.block
        kv = torch.stack([block.kv(raw, self.dtype) for raw in raws])  # [n, W, L, 2, blocks, tokens/block, H, D]
        tails = torch.stack([raw[block.used_bytes :] for raw in raws])
        n = len(raws)
        k = kv[:, :, :, 0].reshape(n * block.workers * block.layers, block.tokens, block.kv_heads, block.head_dim)
        v = kv[:, :, :, 1].reshape(k.shape)
        if self.codec.levers.vrot == "hadamard":  # the stored frame of `kvbackend.frames`: values times Hadamard
            v = rotate_values(v)
        if self._batched():  # every page in one codec call
            pages = self.codec.encode(k.flatten(0, 1), v.flatten(0, 1), self.layout).pages
            return torch.cat([pages.reshape(n, -1), tails], 1)
        if self.codec.batch_encodes and len(k) > 1:  # every unit (worker and layer of a chunk) in one pass
            pages, books = self.codec.encode_units(k, v, self.layout)
            units = torch.cat([pages.flatten(1), books], 1)  # each unit's pages, then its codebook slot
        else:
            units = torch.stack([torch.cat([c.pages.reshape(-1), c.codebook.reshape(-1)])
                                 for c in (self.codec.encode(ku, vu, self.layout) for ku, vu in zip(k, v))])
        return torch.cat([units.reshape(n, -1), tails], 1)

    def _decode_blocks(self, blobs: torch.Tensor, outs: list[torch.Tensor]) -> None:
        """Inverse of `_encode_blocks`: ``blobs`` ``[n, blob_bytes]`` into the chunks ``outs``, in one codec call
        where the codec allows."""
        block, layout = self.block, self.layout
        n, pages = len(outs), -(-block.tokens // layout.page_size)
        units = n * block.workers * block.layers
        size, unit = pages * layout.page_bytes, pages * layout.page_bytes + layout.codebook_bytes
        body = blobs[:, : (block.workers * block.layers) * unit].reshape(units, unit)
        if self._batched():
            k, v = self.codec.decode_pages(layout, body.reshape(units * pages, -1), body[:0, :0].reshape(-1))
        elif self.codec.per_page_codebooks and layout.codebook_bytes:  # each page with its unit's codebook slot
            k, v = self.codec.decode_units(layout, body[:, :size].reshape(units * pages, -1),
                                           body[:, size:].repeat_interleave(pages, dim=0))
        else:
            parts = [self.codec.decode_pages(layout, u[:size].view(pages, -1), u[size:]) for u in body]
            k, v = torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
        if self.codec.levers.vrot == "hadamard":
            v = rotate_values(v)
        whole = (n, block.workers, block.layers, pages * layout.page_size, block.kv_heads, block.head_dim)
        shape = (block.blocks, block.tokens_per_block, block.kv_heads, block.head_dim)
        k = k.reshape(whole)[:, :, :, : block.tokens].reshape((n, block.workers, block.layers) + shape)
        v = v.reshape(whole)[:, :, :, : block.tokens].reshape(k.shape)
        for i, out in enumerate(outs):
            kv = block.kv(out, self.dtype)
            kv[:, :, 0].copy_(k[i])
            kv[:, :, 1].copy_(v[i])
            out[block.used_bytes :].copy_(blobs[i, (block.workers * block.layers) * unit :])

    def _decode_into(self, blob: torch.Tensor, out: torch.Tensor) -> None:
        if self.block is not None:
            self._decode_blocks(blob.unsqueeze(0), [out])
            return
        rows = out.numel() // self._row_bytes
        half = rows // 2
        body = 2 * half * self._row_bytes
        if half:
            pages = -(-half // _ROWS_PER_PAGE)
            size = pages * self.layout.page_bytes
            k, v = self.codec.decode_pages(self.layout, blob[:size].view(pages, -1),
                                           blob[size : size + self.layout.codebook_bytes])
            values = out[:body].view(self.dtype).view(2, half, 1, -1)
            values[0].copy_(k[:half])
            values[1].copy_(v[:half])
            blob = blob[size + self.layout.codebook_bytes :]
        out[body:].copy_(blob[: out.numel() - body])

    # -- jobs ---------------------------------------------------------------------------------
    def _batch_chunks(self) -> int:
        """Chunks per codec call: about BATCH_BYTES of raw KV on a GPU (one transfer each way), one on the CPU."""
        if self.device.device.type == "cpu":
            return 1
        return max(1, BATCH_BYTES // self.chunk_bytes)

    def _encode_chunks(self, *raws: torch.Tensor) -> torch.Tensor:
        """``[len(raws), blob_bytes]``: the blobs of raw chunks, on whatever device they are."""
        if self.block is not None:
            return self._encode_blocks(list(raws))
        if len(raws) > 1 and self._rows_tile():  # every chunk's pages in one codec call: the same bytes
            half, body = self._half_rows(), 2 * self._half_rows() * self._row_bytes
            values = torch.stack([raw[:body] for raw in raws]).view(self.dtype).view(len(raws), 2, half, 1, -1)
            k, v = values[:, 0].flatten(0, 1), values[:, 1].flatten(0, 1)
            pages = self.codec.encode(k, v, self.layout).pages
            return torch.cat([pages.reshape(len(raws), -1), torch.stack([raw[body:] for raw in raws])], 1)
        return torch.stack([self._encode(raw) for raw in raws])

    def _half_rows(self) -> int:
        """Rows mode: the rows of a chunk's K half (and of its V half)."""
        return self.chunk_bytes // self._row_bytes // 2

    def _rows_tile(self) -> bool:
        """Rows mode with a page-local codec whose pages tile a chunk's halves exactly: chunks batch."""
        return (self.block is None and self.codec.page_local and self.layout.codebook_bytes == 0
                and self._half_rows() > 0 and self._half_rows() % _ROWS_PER_PAGE == 0
                and self.chunk_bytes % self.dtype.itemsize == 0)  # (rows of a batch viewed in place)

    def _decode_chunks(self, blobs: torch.Tensor) -> torch.Tensor:
        """``[n, chunk_bytes]``: the chunks of ``blobs`` ``[n, blob_bytes]``, on their device."""
        blobs = blobs[:, : self.body_bytes]  # (the key trailer was checked where the blobs were read)
        out = torch.empty((blobs.shape[0], self.chunk_bytes), dtype=torch.uint8, device=blobs.device)
        if self.block is not None:
            self._decode_blocks(blobs, list(out))
            return out
        if len(blobs) > 1 and self._rows_tile():  # every chunk's pages in one codec call
            n, half = len(blobs), self._half_rows()
            pages, body = half // _ROWS_PER_PAGE, 2 * half * self._row_bytes
            size = pages * self.layout.page_bytes
            k, v = self.codec.decode_pages(self.layout, blobs[:, :size].reshape(n * pages, -1), blobs[:0, :0].reshape(-1))
            values = out[:, :body].view(self.dtype).view(n, 2, half, 1, -1)
            values[:, 0].copy_(k.view(n, half, 1, -1))
            values[:, 1].copy_(v.view(n, half, 1, -1))
            out[:, body:].copy_(blobs[:, size : size + self.chunk_bytes - body])
            return out
        for blob, chunk in zip(blobs, out):
            self._decode_into(blob, chunk)
        return out

    def _store_job(self, keys: list[OffloadKey], chunk_ids: list[int]) -> bool:
        """Encodes the chunks in batches (on the tier's device) and hands the blobs to the file tier in groups of
        about BATCH_BYTES of raw KV as they are made, so the writes of one group overlap the encoding of the next.
        Every write started is waited for, and counted, whatever fails after it."""
        self._private_directories()  # recreated if it was removed while running
        ints, step, writes, blobs = [self._key(k) for k in keys], self._batch_chunks(), [], []
        group = max(step, BATCH_BYTES // self.chunk_bytes)
        try:
            for at in range(0, len(chunk_ids), step):
                raws = [self._chunk(cid) for cid in chunk_ids[at : at + step]]
                batch = self.device("encode", self._encode_chunks, *raws)
                if batch.shape != (len(raws), self.body_bytes):  # a blob this tier could never load back
                    raise RuntimeError(f"chunks encoded to blobs of shape {tuple(batch.shape)}, expected "
                                       f"{(len(raws), self.body_bytes)}")
                named = torch.tensor(ints[at : at + len(raws)], dtype=torch.int64).view(torch.uint8).view(len(raws), -1)
                blobs += list(torch.cat([batch, named.to(batch.device)], 1))
                if len(blobs) >= group or at + step >= len(chunk_ids):  # one file per group of chunks
                    first = at + len(raws) - len(blobs)
                    writes.append((len(blobs), self.store.put(ints[first : first + len(blobs)], blobs)))
                    blobs = []
        finally:
            ok = []
            for count, write in writes:
                try:
                    ok += write.result()
                except Exception as exc:  # noqa: BLE001 - a write that raised stored nothing; the rest are waited for
                    log.error("kvbackend vLLM tier: a write failed: %r", exc)
                    ok += [False] * count
            # a later group's write may have evicted an earlier group's chunks: only chunks held now count as stored
            ok = [good and self.store.blob_size(key) is not None for good, key in zip(ok, ints)]
            with self._lock:
                self._stats["chunks_stored"] += sum(ok)
                self._stats["raw_bytes_stored"] += sum(ok) * self.chunk_bytes
        return len(ok) == len(keys) and all(ok)

    def _read_window(self, ints: list[int]):
        """(buffers ``[n, blob_bytes]``, the file tier's handle) of a read of ``ints``, into page-locked memory
        where the codec runs on a GPU; `_load_job` checks the blobs' index fields, a window at a time."""
        buffers = self.device.staging((len(ints), self.blob_bytes), torch.uint8)
        return buffers, self.store.get(ints, list(buffers), expected_len=[self.blob_bytes] * len(ints))

    def _named(self, blob: torch.Tensor, key: int) -> bool:
        """Whether ``blob`` (read for ``key``) ends in that key; a blob filed under another key is refused in the
        tier (a miss, its file removed with its last blob), never decoded into the primary tier."""
        named = int.from_bytes(blob[self.body_bytes :].numpy().tobytes(), "little")
        if named == key:
            return True
        self.store.refuse(key, blob, f"a blob of key {named} filed under key {key}")
        return False

    def _deliver(self, blobs: torch.Tensor, chunk_ids: list[int]) -> int:
        """Decodes ``blobs`` into the primary chunks ``chunk_ids``; how many, in order, before the first failure.
        A batch that fails goes chunk by chunk, so the chunks before a bad one still load."""
        if self.device.device.type == "cpu":  # straight into the primary tier
            for n, (blob, cid) in enumerate(zip(blobs, chunk_ids)):
                try:
                    self._decode_into(blob[: self.body_bytes], self._chunk(cid))
                except Exception as exc:  # noqa: BLE001 - a chunk that cannot be decoded ends the prefix
                    log.error("kvbackend vLLM tier: decoding a chunk failed: %r", exc)
                    return n
            return len(chunk_ids)
        try:  # straight from the device into the primary chunks
            # (the copies into the primary chunks overlap the next batch; `_load_job` waits for them)
            self.device("decode", self._decode_chunks, blobs, into=[self._chunk(cid) for cid in chunk_ids], defer=True)
        except Exception as exc:  # noqa: BLE001 - one chunk at a time below
            if len(chunk_ids) == 1:
                log.error("kvbackend vLLM tier: decoding a chunk failed: %r", exc)
                return 0
            for n, cid in enumerate(chunk_ids):
                if self._deliver(blobs[n : n + 1], [cid]) == 0:
                    return n
            return len(chunk_ids)
        return len(chunk_ids)

    def _load_job(self, keys: list[OffloadKey], chunk_ids: list[int]) -> int:
        """Loads chunks in order; returns how many loaded before the first failure (a missing or corrupt blob, a
        decode error, or an error of the job itself, such as no memory for a window). Blobs are read in windows
        of about WINDOW_BYTES (the next window's reads run while this one decodes) and decoded in batches."""
        ints = [self._key(k) for k in keys]
        n = 0  # missing, or written for another configuration: never decoded into the primary tier
        while n < len(ints) and self.store.blob_size(ints[n]) == self.blob_bytes:
            n += 1
        window = max(1, WINDOW_BYTES // self.blob_bytes)
        step = self._batch_chunks()
        if self.device.device.type != "cpu":  # a window per decode batch: the next one is read while this decodes
            window = min(window, step)
        windows = [(at, min(n, at + window)) for at in range(0, n, window)]
        done, ahead = 0, None
        try:
            ahead = self._read_window(ints[slice(*windows[0])]) if windows else None
            for w, (lo, hi) in enumerate(windows):
                (buffers, handle), ahead = ahead, None
                found = handle.result()
                last = w + 1 == len(windows)
                if not last:
                    try:
                        ahead = self._read_window(ints[slice(*windows[w + 1])])
                    except Exception as exc:  # noqa: BLE001 - this window still loads; the job stops after it
                        log.error("kvbackend vLLM tier: reading ahead failed, the load stops at chunk %d: %r", hi, exc)
                        last = True
                # crafted pages (a valid checksum, an index out of range): refused in the tier, a miss
                checked = set(refuse_crafted(self.page_check, self.store, buffers,
                                             [i for i, hit in enumerate(found) if hit], ints[lo:hi]))
                found = [i in checked and self._named(buffers[i], ints[lo + i]) for i in range(len(found))]
                good = next((i for i, f in enumerate(found) if not f), len(found))  # corrupt, or replaced meanwhile
                for at in range(0, good, step):
                    end = min(good, at + step)
                    loaded = self._deliver(buffers[at:end], chunk_ids[lo + at : lo + end])
                    done += loaded
                    with self._lock:
                        self._stats["chunks_loaded"] += loaded
                    if loaded < end - at:
                        break
                if done < hi or last:  # a failure ends the prefix
                    break
        except Exception as exc:  # noqa: BLE001 - the chunks delivered so far stay loaded and are reported
            log.error("kvbackend vLLM tier: a load stopped after %d of %d chunks: %r", done, len(keys), exc)
        finally:
            try:  # the deferred copies into the primary chunks land before any chunk is reported loaded
                self.device.finish()
            except Exception as exc:  # noqa: BLE001 - which chunks landed is unknown: none is reported
                log.error("kvbackend vLLM tier: copying chunks into the primary tier failed: %r", exc)
                done = 0
            if ahead is not None:  # a read still in flight is waited for (its buffers are not used)
                try:
                    ahead[1].result()
                except Exception as exc:  # noqa: BLE001 - nothing of it is used
                    log.debug("kvbackend vLLM tier: an unused read ahead failed: %r", exc)
        return done

    def _submit(self, job: TransferJob, store: bool) -> None:
        keys, chunk_ids = list(job.keys), [int(c) for c in job.chunk_ids]
        if len(keys) != len(chunk_ids):
            raise ValueError(f"{len(keys)} keys but {len(chunk_ids)} chunk ids")
        slots = self._primary.numel() // self.chunk_bytes
        bad = [c for c in chunk_ids if not 0 <= c < slots]
        if bad:  # never a slice past the buffer (an empty chunk "loaded") or one counted from its end
            raise ValueError(f"chunk ids {bad[:4]} outside the primary tier's {slots} chunks")

        def run() -> None:
            try:
                if store:
                    result = JobResult(job.job_id, self._store_job(keys, chunk_ids),
                                       transfer_bytes=len(keys) * self.chunk_bytes)
                else:
                    done = self._load_job(keys, chunk_ids)
                    result = JobResult(job.job_id, done == len(keys),
                                       successful_keys=tuple(keys[:done]) if 0 < done < len(keys) else None,
                                       transfer_bytes=done * self.chunk_bytes)
            except Exception as exc:  # a failed job is reported, never raised into the scheduler
                log.exception("kvbackend vLLM tier job %s failed", job.job_id)
                result = JobResult(job.job_id, False)
                del exc
            with self._lock:
                if not result.success:
                    self._stats["failed_jobs"] += 1
                self._finished.append(result)
                self._inflight.pop(job.job_id, None)

        with self._lock:
            self._inflight[job.job_id] = self._pool.submit(run)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return LookupResult.HIT if self.store.blob_size(self._key(key)) == self.blob_bytes else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, store=True)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, store=False)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        with self._lock:
            finished, self._finished = self._finished, []
        return finished

    def has_pending_work(self) -> bool:
        with self._lock:
            return bool(self._inflight or self._finished)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        return None  # recency is tracked by the file tier's own reads

    def drain_jobs(self) -> None:
        with self._lock:
            pending = list(self._inflight.values())
        for future in pending:
            future.result()

    def shutdown(self) -> None:
        self.drain_jobs()
        self._pool.shutdown(wait=True)
        self.store.close()

    def get_stats(self) -> Any:
        held = self.store.stats()
        with self._lock:
            stats = dict(self._stats)
        # raw bytes of the chunks held now (a chunk stored again, or evicted, is not counted twice) over their files'
        stats.update(bytes_stored=held.bytes_used, codec=self.codec.spec_string,
                     compression_ratio=held.blobs * self.chunk_bytes / held.bytes_used if held.bytes_used else None)
        return stats


def _head_dim_from_spec(spec) -> int | None:
    config = getattr(getattr(spec, "vllm_config", None), "model_config", None)
    try:
        return int(config.get_head_size()) if config is not None else None
    except Exception:  # a spec without a model config: the caller asks for head_dim explicitly
        return None


def _kv_dtype_from_spec(spec) -> str | None:
    """The engine's KV cache dtype (``"bfloat16"``, ``"fp8_e4m3"``, ...), or None if the spec does not say."""
    model = getattr(getattr(spec, "config", None), "model", None)
    dtype = getattr(model, "dtype", None)
    return str(dtype).removeprefix("torch.") if dtype else None


def _primary_facts(spec) -> dict:
    """What the engine's offloading config says about the bytes of a primary-tier chunk ({} if it has none).

    Run-specific values (engine id, ranks, budgets) stay out, so a restart finds its chunks again."""
    config = getattr(spec, "config", None)
    if config is None:
        return {}
    model, cache, parallel = (getattr(config, name, None) for name in ("model", "cache", "parallel"))
    groups = [{name: getattr(g, name, None) for name in
               ("tokens_per_block", "layer_names", "group_id", "sliding_window_size_in_chunks")}
              for g in getattr(config, "groups", None) or ()]
    return {
        "groups": groups,
        "worker_kv_bytes_per_block": getattr(config, "worker_kv_bytes_per_block", None),
        "model": getattr(model, "name", None), "kv_dtype": getattr(model, "dtype", None),
        "tokens_per_hash": getattr(cache, "tokens_per_hash", None),
        "blocks_per_chunk": getattr(cache, "blocks_per_chunk", None),
        "parallel": {name: getattr(parallel, name, None) for name in
                     ("world_size", "tp_size", "pp_size", "pcp_size", "dcp_size", "is_parallelism_agnostic")},
        "replicated_layout": getattr(spec, "replicated_layout", getattr(config, "replicated_layout", None)),
        "canonical_layout": getattr(config, "canonical_layout", None),
        "kv_cache_layout": getattr(config, "kv_cache_layout", None),
    }
