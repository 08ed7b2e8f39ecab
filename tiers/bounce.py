"""Host windows that file reads land in on their way to the device, reused from restore to restore.

Page-locking host memory costs about as much as copying it several times (``cudaHostAlloc`` of 1.5 GB took
0.96 s of a 1.12 s restore on the H200), so a restore must not page-lock a buffer for all of its rows. A
`BounceRing` holds a few windows of ``window_bytes``, page-locked once (on CUDA) when first used. A restore
takes a window, reads a run of rows into it, queues their copies to the device, and gives it back with the
event after those copies and the handle of anything else still reading it (a warm copy to the host tier);
the next taker waits for both before writing into it. Windows are handed out whole, never shared.

No deadlock: `take(block=True)` is called only by a restore holding no window; a restore that holds one
asks for more with ``block=False`` and goes on without when none is free.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field

import torch

DEFAULT_WINDOW_BYTES = 64 << 20
DEFAULT_WINDOWS = 3


@dataclass
class Window:
    data: torch.Tensor  # 1-D uint8
    owned: bool = True  # False: a window of the ring (given back); True: a one-off buffer for an oversized run
    event: "torch.cuda.Event | None" = None  # after the last copies out of it
    handles: list = field(default_factory=list)  # tier operations still reading it

    def settle(self) -> None:
        """Wait until nothing reads this window any more."""
        if self.event is not None:
            self.event.synchronize()
        for handle in self.handles:
            handle.wait()
        self.event, self.handles = None, []


class BounceRing:
    def __init__(self, window_bytes: int = DEFAULT_WINDOW_BYTES, windows: int = DEFAULT_WINDOWS,
                 pinned: bool | None = None) -> None:
        if window_bytes <= 0 or windows <= 0:
            raise ValueError(f"a bounce ring needs positive sizes, got {window_bytes} bytes x {windows}")
        self.window_bytes = int(window_bytes)
        self.pinned = torch.cuda.is_available() if pinned is None else bool(pinned)
        # last in, first out: a window used before is taken again before a new one is page-locked
        self._free: queue.LifoQueue[Window | None] = queue.LifoQueue()
        for _ in range(windows):
            self._free.put(None)  # allocated on first use
        self._lock = threading.Lock()
        self.allocated = 0  # windows page-locked so far (for tests and reports)

    def _new(self, nbytes: int) -> torch.Tensor:
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)
        except RuntimeError:  # no page-locked memory left: plain memory (its copies are synchronous)
            return torch.empty(nbytes, dtype=torch.uint8)

    def take(self, nbytes: int, block: bool = True) -> Window | None:
        """A window of at least ``nbytes`` that nothing reads any more; None if ``block`` is False and none is
        free. A run larger than a window gets a buffer of its own (not kept)."""
        if nbytes > self.window_bytes:
            if not block:
                return None
            return Window(self._new(nbytes), owned=True)
        try:
            window = self._free.get(block=block)
        except queue.Empty:
            return None
        try:
            if window is None:
                window = Window(self._new(self.window_bytes), owned=False)
                with self._lock:
                    self.allocated += 1
            window.settle()
        except BaseException:  # back to the ring (still to settle), never lost to it
            self._free.put(window)
            raise
        return window

    def give(self, window: Window, event: "torch.cuda.Event | None" = None, handles=()) -> None:
        """Back to the ring, once ``event`` has fired and ``handles`` are done (the next taker waits)."""
        if window.owned:  # a one-off buffer: released when its readers are done with it
            window.event, window.handles = event, list(handles)
            return
        window.event, window.handles = event, list(handles)
        self._free.put(window)
