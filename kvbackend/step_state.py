"""What one decode step shares across its layers, kept between `KVCache.append_step` calls.

A serving engine appends a decode step layer by layer, 32 calls with the same requests at the same positions. Built
once per step instead of once per layer: the batch's dense page ids, offsets and positions on the device (one copy
from the host, not one per layer), and the RoPE tables of those positions that de-rotate the step's queries.
Reused from call to call: float32 buffers for the query statistics, with their rows as views, so the statistics of
a step of B requests need no B-way split per layer.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch


@dataclass
class StepInts:
    """A step's rows in a layer's dense pool seen as ``[pages * 2 * P, H, D]`` (`key_rows`, `value_rows`: int64
    ``[B]``, for `index_copy_`) and its positions ``[B]`` (int32), on the cache's device, for the stream and the host
    lists they were made on and from (`key`); `rope` holds the cos/sin tables of the positions for the frames that
    de-rotate the step's queries (`LeverFrame.step_queries_to_stored`), valid as long as they are."""

    key: tuple
    key_rows: torch.Tensor
    value_rows: torch.Tensor
    positions: torch.Tensor
    rope: dict = field(default_factory=dict)


MAX_STREAMS = 4  # buffer pairs kept, for the (stream, thread) pairs used last


def stream_key(device: torch.device) -> tuple[int, int] | None:
    """The current stream of ``device`` as plain ints (device, handle), None off CUDA: a key a cache can keep and
    still be deep-copied (a `torch.cuda.Stream` cannot be)."""
    if device.type != "cuda":
        return None
    stream = torch.cuda.current_stream(device)
    return stream.device_index, stream.cuda_stream


class MomentBuffers:
    """Float32 buffers ``[B, H, D, D]`` and ``[B, H, D]`` for `query_moments` of a step, and their rows (the views
    `add_step_moments` adds to the states), reused across layers and steps.

    One buffer pair per device stream and host thread: a step's statistics are read by the adds queued right after
    them on the same stream, so the next layer's statistics may overwrite them; another stream would not wait for
    those adds, and another thread's call could write them between this call's product and its adds (two threads
    appending to other layers of one cache). The buffers grow to the largest batch seen; a smaller batch takes their
    first rows."""

    def __init__(self, kv_heads: int, head_dim: int, device: torch.device) -> None:
        self.kv_heads, self.head_dim, self.device = kv_heads, head_dim, device
        self._by_stream: dict = {}  # (stream, thread) -> (moments, sums, moment rows, sum rows)
        self._lock = threading.Lock()  # (the dictionary's pops and evictions, between threads)

    def __getstate__(self) -> dict:
        """No buffers in a copy or a pickle: a pickle stores the rows apart from their buffer (they would no longer
        be views of what `query_moments` writes), and they are scratch. The copy makes its own on its first step."""
        return {"kv_heads": self.kv_heads, "head_dim": self.head_dim, "device": self.device}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["kv_heads"], state["head_dim"], state["device"])

    def get(self, batch: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """(moments ``[batch, H, D, D]``, sums ``[batch, H, D]``, their rows): to be filled before use."""
        stream = (stream_key(self.device), threading.get_ident())
        with self._lock:
            held = self._by_stream.pop(stream, None)  # (re-inserted last: the dict is in order of use)
        if held is None or held[0].shape[0] < batch:
            h, d = self.kv_heads, self.head_dim
            size = max(batch, 2 * held[0].shape[0] if held is not None else 0)
            with torch.inference_mode(False):  # normal tensors: written in and out of inference mode alike
                moments = torch.empty(size, h, d, d, dtype=torch.float32, device=self.device)
                sums = torch.empty(size, h, d, dtype=torch.float32, device=self.device)
                held = (moments, sums, list(moments.unbind(0)), list(sums.unbind(0)))
        with self._lock:
            self._by_stream[stream] = held
            while len(self._by_stream) > MAX_STREAMS:  # an engine that steps on new streams does not grow this
                del self._by_stream[next(iter(self._by_stream))]  # (freed buffers are reused on their stream only)
        moments, sums, moment_rows, sum_rows = held
        return moments[:batch], sums[:batch], moment_rows[:batch], sum_rows[:batch]


class CacheLock:
    """A re-entrant lock for one cache's calls (`KVCache`): page allocation, a chunk's packing and the page tables
    are shared by every layer, so two threads appending to other layers of one cache would race on them. A copy or
    a pickle of a cache gets a fresh lock (a lock cannot be pickled, and a copy shares no calls with its source)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()

    def __enter__(self):
        return self._lock.__enter__()

    def __exit__(self, *exc) -> None:
        self._lock.__exit__(*exc)

    def __reduce__(self):
        return CacheLock, ()
