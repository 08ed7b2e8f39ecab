"""Strided copies: ``height`` rows of ``width`` bytes, each at its own pitch on either side.

Moving one layer of many page groups from host slots to a device buffer is one such copy. On CUDA it
is one ``cudaMemcpy2DAsync`` on the given stream (torch's ``copy_`` would first make a pageable,
contiguous host copy of a strided source); elsewhere it is a strided torch copy.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os

import torch

_cudart = None  # None: not looked up yet; False: not found


def _runtime():
    global _cudart
    if _cudart is None:
        candidates = []
        try:
            import nvidia  # the CUDA runtime wheels torch depends on

            for root in nvidia.__path__:
                candidates += sorted(glob.glob(os.path.join(root, "*", "lib", "libcudart.so*")), reverse=True)
        except ImportError:
            pass
        candidates += glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libcudart*.so*"))
        found = ctypes.util.find_library("cudart")
        candidates += [found] if found else []
        _cudart = False
        for path in candidates:
            try:
                lib = ctypes.CDLL(path)
                fn = lib.cudaMemcpy2DAsync
            except (OSError, AttributeError):
                continue
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                           ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
            _cudart = lib
            break
    return _cudart or None


def native_available() -> bool:
    return _runtime() is not None


def copy_2d(dst: torch.Tensor, dst_offset: int, dpitch: int, src: torch.Tensor, src_offset: int, spitch: int,
            width: int, height: int, stream: "torch.cuda.Stream | None" = None) -> None:
    """Row r (of ``height``) moves ``width`` bytes from byte ``src_offset + r*spitch`` of uint8 ``src`` to
    byte ``dst_offset + r*dpitch`` of uint8 ``dst``. Asynchronous on ``stream`` where a side is CUDA."""
    if height <= 0 or width <= 0:
        return
    for t, off, pitch in ((dst, dst_offset, dpitch), (src, src_offset, spitch)):
        assert t.dtype == torch.uint8 and t.is_contiguous(), "copy_2d works on contiguous uint8 buffers"
        assert off + (height - 1) * pitch + width <= t.numel(), "copy_2d range outside its buffer"
    if (dst.is_cuda or src.is_cuda) and _runtime() is not None:
        stream = stream or torch.cuda.current_stream()
        err = _runtime().cudaMemcpy2DAsync(dst.data_ptr() + dst_offset, dpitch, src.data_ptr() + src_offset, spitch,
                                           width, height, 4, stream.cuda_stream)  # 4: cudaMemcpyDefault
        if err != 0:
            raise RuntimeError(f"cudaMemcpy2DAsync failed with CUDA error {err}")
        return
    out = torch.as_strided(dst, (height, width), (dpitch, 1), dst.storage_offset() + dst_offset)
    out.copy_(torch.as_strided(src, (height, width), (spitch, 1), src.storage_offset() + src_offset), non_blocking=True)
