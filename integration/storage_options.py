"""Options both engine adapters read from their engine's config: a storage directory only this user
may write, and a storage budget. Checked at construction, with errors that name the option; and the start-up
warning both give for codecs whose codebooks outweigh what they store."""

from __future__ import annotations

import math
import os
import stat


def path_option(option: str, value) -> str:
    """A non-empty path from an engine's config, or a ValueError naming ``option``."""
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise ValueError(f"{option} must be a directory path, got {value!r}")
    return os.fspath(value)


def budget_bytes(budget_gb) -> int:
    """``budget_gb`` (GiB, a positive finite number) in bytes, or a ValueError naming the option."""
    if isinstance(budget_gb, bool):
        raise ValueError(f"budget_gb must be a positive number of GiB, got {budget_gb!r}")
    try:
        gb = float(budget_gb)
    except (TypeError, ValueError):
        raise ValueError(f"budget_gb must be a positive number of GiB, got {budget_gb!r}") from None
    if not math.isfinite(gb) or gb <= 0:
        raise ValueError(f"budget_gb must be a positive number of GiB, got {budget_gb!r}")
    return int(gb * 2**30)


def warn_codebooks_outweigh(log, where: str, spec: str, bpv: float, book: int, codes: int, suggestion: str) -> bool:
    """Log (and return True) where a stored unit's codebooks (centroids, PSAC bases: sized for the cache's long
    chunks) exceed a quarter of the codes they serve: engines store small units (a 64-token page or block), each
    carrying its own codebooks. On SmolLM2's KV the recommended spec's codec stored 4.9 bits per value on 64-token
    pages, with 8-10x the next-token KL of kivi:bits=4,group=64 at 4.5 (perf/NOTES.md, session 19)."""
    if book * 4 <= codes:
        return False
    log.warning("%s: %r stores %.2f bits per value: its codebooks (%d bytes per layer) exceed a quarter of the codes "
                "they serve (%d bytes), since every stored unit carries its own. Page-local codecs do better per byte "
                "here (e.g. %s).", where, spec, bpv, book, codes, suggestion)
    return True


def private_directory(path: str, option: str) -> None:
    """Create ``path`` with mode 0700 if absent; refuse (ValueError naming ``option``) a symbolic link, a
    non-directory, or a directory another user owns or that group or others may write: anyone who can
    write there could plant pages this backend would load."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:  # created meanwhile (another thread, or someone else): checked below
            pass
        info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise ValueError(f"{option} {path!r} is a symbolic link; give the real directory")
    if not stat.S_ISDIR(info.st_mode):
        raise ValueError(f"{option} {path!r} exists and is not a directory")
    if info.st_uid != os.geteuid():
        raise ValueError(f"{option} {path!r} is owned by uid {info.st_uid}, not by this user "
                         f"(uid {os.geteuid()}); use a directory of your own")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ValueError(f"{option} {path!r} is writable by group or others (mode {stat.S_IMODE(info.st_mode):o}); "
                         "use a directory only you can write (chmod 700)")


def codec_device(value) -> "torch.device":
    """Where an adapter runs its codec on whole batches of pages: ``"auto"`` (the current CUDA device where
    there is one, else the CPU), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``; a ValueError naming the option
    otherwise, or for a CUDA device this machine does not have."""
    import torch

    if value in (None, "auto"):
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(value) if isinstance(value, str) else None
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {value!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={value!r}, but this machine has no CUDA device; use 'cpu' or 'auto'")
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ValueError(f"device={value!r}, but this machine has {torch.cuda.device_count()} CUDA device(s)")
        device = torch.device("cuda", index)
    return device


class DeviceCodec:
    """Runs codec work of whole page batches on ``device``: host tensors in, host tensors out, on a stream of
    its own, one batch at a time (the engines call their storage backends from several I/O threads)."""

    def __init__(self, device: "torch.device", log=None) -> None:
        import logging
        import threading

        self.device = device
        self._log = log or logging.getLogger(__name__)
        self._lock = threading.Lock()
        self._stream = None
        self._copies = None  # where deferred copies out run (`run(defer=True)`)
        self._logged: set[str] = set()

    def run(self, fn, *tensors, into=None, sink=None, defer=False):
        """``fn(*tensors moved to the device)`` -> its tensor result back on the host (or a tuple of them). With
        ``into`` (host tensors), row ``i`` of the result is copied into ``into[i]`` instead (straight from the
        device, asynchronously where ``into[i]`` is page-locked) and None is returned. With ``sink``,
        ``sink(result)`` is called on the device's stream (its copies may be asynchronous there) and None is
        returned once the stream has finished. With ``defer`` (and ``into`` or ``sink``) those copies run on a
        stream of their own once ``fn``'s work is done, and `run` returns without waiting for them, so the next
        call's transfers and kernels overlap them: the caller calls `finish` before it reads the destinations."""
        import torch

        if self.device.type == "cpu":
            return self._deliver(fn(*tensors), into, sink)
        with self._lock, torch.cuda.device(self.device):
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
            with torch.cuda.stream(self._stream):
                moved = [t.to(self.device, non_blocking=t.is_pinned()) for t in tensors]
                out = fn(*moved)
                if defer and (into is not None or sink is not None):
                    result = self._deliver_later(out, into, sink)
                elif into is not None or sink is not None:
                    result = self._deliver(out, into, sink)
                else:
                    result = tuple(self._to_host(o) for o in out) if isinstance(out, tuple) else self._to_host(out)
            self._stream.synchronize()  # the copies above (all but deferred ones) are complete before anyone reads
        return result

    def _deliver_later(self, out, into, sink):
        """`_deliver` on the copy stream, after the work queued so far on the device's stream."""
        import torch

        if self._copies is None:
            self._copies = torch.cuda.Stream(self.device)
        self._copies.wait_stream(self._stream)
        with torch.cuda.stream(self._copies):
            result = self._deliver(out, into, sink)
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
                tensor.record_stream(self._copies)  # its memory is not reused before the copies read it
        return result

    def finish(self) -> None:
        """Wait for the copies `run` deferred (none on the CPU); a device error in them is raised here."""
        copies = self._copies
        if copies is not None:
            copies.synchronize()

    @staticmethod
    def _deliver(out, into, sink=None):
        if sink is not None:
            sink(out)
            return None
        if into is None:
            return out
        if len(into) != len(out):
            raise ValueError(f"{len(out)} results for {len(into)} destinations")
        for row, dest in zip(out, into):
            if row.shape != dest.shape:  # never broadcast into a destination of another shape
                raise ValueError(f"a result row of shape {tuple(row.shape)} for a destination of {tuple(dest.shape)}")
        for row, dest in zip(out, into):
            dest.copy_(row, non_blocking=dest.is_pinned() and row.device.type != "cpu")
        return None

    @staticmethod
    def _to_host(tensor):
        """A device tensor copied into page-locked host memory (PyTorch's caching host allocator: reused from
        call to call), asynchronously on the current stream: a copy into pageable memory is staged by the driver
        at a fraction of the link's speed."""
        import torch

        try:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        except RuntimeError:  # no page-locked memory left: a plain (synchronous) copy
            return tensor.to("cpu")
        host.copy_(tensor, non_blocking=True)
        return host

    def staging(self, shape, dtype):
        """An empty host tensor for inputs of `run`: page-locked where the codec runs on a CUDA device (copied
        to it asynchronously), plain memory on the CPU or where no page-locked memory can be had."""
        import torch

        if self.device.type == "cuda":
            try:
                return torch.empty(shape, dtype=dtype, pin_memory=True)
            except RuntimeError:  # no page-locked memory (left): plain memory, copied synchronously
                pass
        return torch.empty(shape, dtype=dtype)

    def __call__(self, what: str, fn, *tensors, into=None, sink=None, defer=False):
        """`run`, except that where the device fails (out of memory, a lost context, ...) this batch runs on
        the CPU (the same bytes) and the failure is logged once. Errors of the pages themselves
        (``ValueError``: non-finite values, damaged bytes) are raised as on the CPU."""
        if self.device.type != "cpu":
            try:
                # (``sink`` and ``defer`` only where given: `run` overrides written before them keep working)
                return self.run(fn, *tensors, into=into, **({"sink": sink} if sink is not None else {}),
                                **({"defer": True} if defer else {}))
            except ValueError:
                raise
            except Exception as exc:  # noqa: BLE001 - the CPU path below gives the same bytes
                if what not in self._logged:
                    self._logged.add(what)
                    self._log.error(f"kvbackend storage: {what} on {self.device} failed, using the CPU for this "
                                    f"batch: {exc!r}")
        return self._deliver(fn(*tensors), into, sink)
