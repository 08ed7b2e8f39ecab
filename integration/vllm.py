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

A primary-tier chunk is opaque bytes whose layout depends on the attention backend, but every vLLM
KV layout keeps ``head_dim`` values of one token and head contiguous. The tier therefore accepts only
codecs that quantize each such row on its own (``rtn``, ``fp8``, ``fp16``, ``bf16``, ``identity``);
per-channel or clustering codecs need the token structure and are refused.
"""

from __future__ import annotations

import hashlib
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

from ..codecs import get as get_codec
from ..errors import SpecError
from ..geometry import Geometry
from ..tiers.file import FileTier

log = logging.getLogger(__name__)

ROW_CODECS = ("rtn", "fp8", "fp16", "bf16", "identity")
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_ROWS_PER_PAGE = 64


class KVBackendTier(SecondaryTierManager):
    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(self, offloading_spec, primary_kv_view: memoryview, tier_type: str, root_dir: str,
                 codec: str = "rtn:bits=4,group=64", head_dim: int | None = None, dtype: str = "bfloat16",
                 budget_gb: float = 64.0, n_threads: int = 4, backpressure_detector=None) -> None:
        super().__init__(offloading_spec=offloading_spec, primary_kv_view=primary_kv_view, tier_type=tier_type,
                         backpressure_detector=backpressure_detector)
        self.codec = get_codec(codec)
        if self.codec.spec.name not in ROW_CODECS:
            raise SpecError(f"the vLLM tier needs a per-row codec ({', '.join(ROW_CODECS)}); {codec!r} needs the "
                            "token structure of a chunk, which vLLM's primary tier does not expose")
        head_dim = head_dim or _head_dim_from_spec(offloading_spec)
        if not head_dim:
            raise ValueError("set head_dim in the tier config (it could not be read from the offloading spec)")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        self.dtype = _DTYPES[dtype]
        self.geometry = Geometry(1, 1, int(head_dim), self.dtype)
        self.layout = self.codec.layout(self.geometry, _ROWS_PER_PAGE)
        self.chunk_bytes = self.block_size_bytes
        self._primary = torch.from_numpy(np.frombuffer(primary_kv_view, dtype=np.uint8))  # shares the buffer
        self._row_bytes = int(head_dim) * self.geometry.dtype.itemsize
        self.store = FileTier(os.path.join(root_dir, self.layout.fingerprint), int(budget_gb * 2**30),
                              self.layout.fingerprint)
        self._pool = ThreadPoolExecutor(max_workers=n_threads, thread_name_prefix="kvbackend-vllm")
        self._lock = threading.Lock()
        self._finished: list[JobResult] = []
        self._inflight: dict[int, Future] = {}
        self._stats = {"chunks_stored": 0, "chunks_loaded": 0, "failed_jobs": 0, "raw_bytes_stored": 0}

    # -- chunk <-> blob -----------------------------------------------------------------------
    @staticmethod
    def _key(key: OffloadKey) -> int:
        return int.from_bytes(hashlib.blake2b(bytes(key), digest_size=8).digest(), "little") >> 1

    def _chunk(self, chunk_id: int) -> torch.Tensor:
        start = int(chunk_id) * self.chunk_bytes
        return self._primary[start : start + self.chunk_bytes]

    def _encode(self, raw: torch.Tensor) -> torch.Tensor:
        """Rows of head_dim values, split in two halves passed as the codec's K and V, plus a raw tail."""
        rows = raw.numel() // self._row_bytes
        half = rows // 2
        values = raw[: 2 * half * self._row_bytes].view(self.dtype).view(2, half, 1, -1)
        tail = raw[2 * half * self._row_bytes :]
        parts = []
        if half:
            chunk = self.codec.encode(values[0], values[1], self.layout)
            parts += [chunk.pages.reshape(-1), chunk.codebook.reshape(-1)]
        return torch.cat(parts + [tail.clone()])

    def _decode_into(self, blob: torch.Tensor, out: torch.Tensor) -> None:
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
    def _store_job(self, keys: list[OffloadKey], chunk_ids: list[int]) -> bool:
        blobs = [self._encode(self._chunk(cid)) for cid in chunk_ids]
        ok = self.store.put([self._key(k) for k in keys], blobs).result()
        with self._lock:
            self._stats["chunks_stored"] += sum(ok)
            self._stats["raw_bytes_stored"] += sum(ok) * self.chunk_bytes
        return all(ok)

    def _load_job(self, keys: list[OffloadKey], chunk_ids: list[int]) -> int:
        """Loads chunks in order; returns how many loaded before the first failure."""
        for n, (key, cid) in enumerate(zip(keys, chunk_ids)):
            ikey = self._key(key)
            size = self.store.blob_size(ikey)
            buffer = torch.empty(size or 0, dtype=torch.uint8)
            if not size or not self.store.get([ikey], [buffer]).result()[0]:
                return n  # missing or corrupt: never decoded into the primary tier
            self._decode_into(buffer, self._chunk(cid))
            with self._lock:
                self._stats["chunks_loaded"] += 1
        return len(keys)

    def _submit(self, job: TransferJob, store: bool) -> None:
        keys, chunk_ids = list(job.keys), [int(c) for c in job.chunk_ids]
        if len(keys) != len(chunk_ids):
            raise ValueError(f"{len(keys)} keys but {len(chunk_ids)} chunk ids")

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
        return LookupResult.HIT if self.store.contains([self._key(key)]) else LookupResult.MISS

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
        stored = self.store.stats().bytes_used
        with self._lock:
            stats = dict(self._stats)
        stats.update(bytes_stored=stored, codec=self.codec.spec_string,
                     compression_ratio=stats["raw_bytes_stored"] / stored if stored else None)
        return stats


def _head_dim_from_spec(spec) -> int | None:
    config = getattr(getattr(spec, "vllm_config", None), "model_config", None)
    try:
        return int(config.get_head_size()) if config is not None else None
    except Exception:  # a spec without a model config: the caller asks for head_dim explicitly
        return None
