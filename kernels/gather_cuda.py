"""Gather-dequant for plain layouts: a CUDA kernel compiled at first use (`gather_dequant.cu` says how it works).

It reads what the Triton kernel reads minus centroids and levers: per-token and per-channel groups of 2, 4 or 8-bit
codes with fp8, fp16 or bf16 scales, plain fp8/fp16/bf16 pages, and dense fp16/bf16 pages, into fp16 or bf16 rows.
`gather_dequant` takes it on CUDA where `preferred` says so, and the Triton kernel everywhere else. Compilation and
loading share `mma_decode`'s nvcc lookup, disk cache and driver calls.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from kvbackend.batch import BatchPlan
from kvbackend.scheme import CHANNEL_GROUPS, FLOAT, NONE, TOKEN_GROUPS, LeverScheme, TensorScheme

from kvbackend.kernels import mma_decode

SOURCE = Path(__file__).with_name("gather_dequant.cu")
PREFERRED = True  # `gather_dequant` takes this kernel where it can (tests may turn it off)
_OUT_KIND = {torch.float16: 1, torch.bfloat16: 2}
THREADS = 256  # per CTA (one work page)
UNROLL = 4  # runs of 8 elements a thread loads before it converts and stores them


@dataclass(frozen=True)
class GatherConfig:
    """Compile-time options of one variant: the page geometry, each tensor's storage and the dtypes."""

    head_dim: int
    page: int
    k: tuple[int, int, int, int, int]  # (mode, bits, group, symmetric, kind)
    v: tuple[int, int, int, int, int]
    out_kind: int
    dense_kind: int
    threads: int = THREADS
    unroll: int = UNROLL

    def defines(self) -> list[str]:
        out = [f"-DHEAD_DIM={self.head_dim}", f"-DPAGE={self.page}", f"-DOUT_KIND={self.out_kind}",
               f"-DDENSE_KIND={self.dense_kind}", f"-DNTHREADS={self.threads}", f"-DUNROLL={self.unroll}"]
        for prefix, (mode, bits, group, sym, kind) in (("K", self.k), ("V", self.v)):
            out += [f"-D{prefix}_MODE={mode}", f"-D{prefix}_BITS={bits}", f"-D{prefix}_GROUP={group}",
                    f"-D{prefix}_SYM={sym}", f"-D{prefix}_KIND={kind}"]
        return out


def _tensor_ok(x: TensorScheme, page_size: int, head_dim: int) -> bool:
    if x.stages or x.kind not in (0, 1, 2):
        return False
    esize = 1 if x.kind == 0 else 2
    if x.mode == FLOAT:
        return x.codes % 16 == 0
    if x.bits not in (2, 4, 8) or x.codes % 8 or x.scales % 16 or (not x.symmetric and x.zeros % 16):
        return False
    if x.mode == TOKEN_GROUPS:  # a run of 8 channels lies in one group
        return x.group % 8 == 0 and head_dim % x.group == 0
    return x.mode == CHANNEL_GROUPS and page_size % x.group == 0 and esize in (1, 2)


@functools.lru_cache(maxsize=256)
def supports(k: TensorScheme, v: TensorScheme, page_size: int, head_dim: int, out_dtype: torch.dtype,
             dense_dtype: torch.dtype, levers: LeverScheme | None = None) -> bool:
    """Whether the kernel reads this pair of schemes into ``out_dtype`` (no levers, no centroids)."""
    return (head_dim % 8 == 0 and (levers is None or not levers.active) and out_dtype in _OUT_KIND
            and dense_dtype in _OUT_KIND and _tensor_ok(k, page_size, head_dim) and _tensor_ok(v, page_size, head_dim))


def config_for(k: TensorScheme, v: TensorScheme, page_size: int, head_dim: int, out_dtype: torch.dtype,
               dense_dtype: torch.dtype, threads: int = THREADS, unroll: int = UNROLL) -> GatherConfig:
    def spec(x: TensorScheme) -> tuple[int, int, int, int, int]:
        return (x.mode, max(x.bits, 1), max(x.group, 1), int(bool(x.symmetric)), x.kind)
    if threads not in (64, 128, 256, 512, 1024) or unroll not in (1, 2, 4, 8):
        raise ValueError(f"threads must be 64..1024 (a power of two) and unroll 1, 2, 4 or 8; got {threads}, {unroll}")
    return GatherConfig(head_dim, page_size, spec(k), spec(v), _OUT_KIND[out_dtype], _OUT_KIND[dense_dtype],
                        threads, unroll)


class _Params(ctypes.Structure):  # mirrors `struct Params` in gather_dequant.cu
    _fields_ = [("pages", ctypes.c_uint64), ("dense", ctypes.c_uint64), ("page_ids", ctypes.c_uint64),
                ("kinds", ctypes.c_uint64), ("valid", ctypes.c_uint64), ("rows", ctypes.c_uint64),
                ("k_out", ctypes.c_uint64), ("v_out", ctypes.c_uint64), ("page_bytes", ctypes.c_longlong),
                ("H", ctypes.c_int), ("k_codes", ctypes.c_int), ("k_scales", ctypes.c_int), ("k_zeros", ctypes.c_int),
                ("v_codes", ctypes.c_int), ("v_scales", ctypes.c_int), ("v_zeros", ctypes.c_int)]


def compile_cubin(config: GatherConfig, arch: str) -> bytes:
    """The cubin of ``config`` for ``arch``, compiled once and cached on disk beside the decode kernel's. No fast
    math: float32 subnormal products must survive as the torch reference computes them."""
    source = SOURCE.read_bytes()
    options = ["-cubin", f"-arch={arch}", "-O3", "-std=c++17", *config.defines()]
    compiler = mma_decode.nvcc()
    if compiler is None:
        raise RuntimeError("the CUDA gather kernel needs nvcc (PATH or CUDA_HOME)")
    version = mma_decode._nvcc_version(compiler)
    key = hashlib.sha256(source + " ".join(options).encode() + version.encode()).hexdigest()[:24]
    path = mma_decode.cache_dir() / f"gather_dequant-{key}.cubin"
    if path.exists():
        return path.read_bytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "k.cubin"
        done = subprocess.run([compiler, *options, "-o", str(out), str(SOURCE)], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"nvcc failed on {SOURCE.name} ({' '.join(config.defines())}):\n{done.stderr[-4000:]}")
        data = out.read_bytes()
        fd, staged = tempfile.mkstemp(dir=path.parent)  # atomic: concurrent first uses never see half a file
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(staged, path)
    return data


_lock = threading.Lock()
_driver: mma_decode._Driver | None = None
_functions: dict[tuple[int, GatherConfig], ctypes.c_void_p] = {}
_failed: set[tuple[int, GatherConfig]] = set()


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _function(config: GatherConfig, device: torch.device) -> ctypes.c_void_p:
    global _driver
    index = _index(device)
    function = _functions.get((index, config))
    if function is not None:
        _driver.ensure_context(index)
        return function
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("the CUDA gather kernel loads on its first call, which cannot happen during CUDA-graph "
                           "capture: run one gather before capturing")
    with _lock:
        if _driver is None:
            _driver = mma_decode._Driver()
        _driver.ensure_context(index)
        function = _functions.get((index, config))
        if function is None:
            major, minor = torch.cuda.get_device_capability(index)
            try:
                function = _driver.load(compile_cubin(config, f"sm_{major}{minor}"), 0, b"gather_dequant")
            except Exception:
                _failed.add((index, config))  # `preferred` says no from now on: the Triton kernel serves
                raise
            _functions[(index, config)] = function
    return function


def preferred(k: TensorScheme, v: TensorScheme, page_size: int, head_dim: int, out_dtype: torch.dtype,
              dense_dtype: torch.dtype, levers: LeverScheme | None, device: torch.device) -> bool:
    """Whether `gather_dequant` takes this kernel when not told otherwise: a supported layout on a usable GPU,
    a variant that has not failed to compile or load, and not a first load during CUDA-graph capture."""
    if not (PREFERRED and device.type == "cuda" and supports(k, v, page_size, head_dim, out_dtype, dense_dtype, levers)
            and mma_decode.available(device)[0]):
        return False
    key = (_index(device), config_for(k, v, page_size, head_dim, out_dtype, dense_dtype))
    if key in _failed:
        return False
    return key in _functions or not torch.cuda.is_current_stream_capturing()


def launch(pages: torch.Tensor, dense: torch.Tensor, schemes: tuple[TensorScheme, TensorScheme], plan: BatchPlan,
           k_out: torch.Tensor, v_out: torch.Tensor, threads: int = THREADS, unroll: int = UNROLL) -> None:
    """Write every planned token of K and V into ``k_out, v_out [tokens, H, D]`` (checked by the caller)."""
    k, v = schemes
    _, _, p, h, d = dense.shape
    if pages.device.type != "cuda":
        raise ValueError(f"the CUDA gather kernel runs on CUDA pages, got {pages.device}")
    if not supports(k, v, p, d, k_out.dtype, dense.dtype):
        raise ValueError(f"the CUDA gather kernel does not read this layout ({k}, {v}; page {p}, head_dim {d}, "
                         f"{dense.dtype} dense pages into {k_out.dtype})")
    if pages.data_ptr() % 16 or pages.shape[1] % 16 or dense.data_ptr() % 16:
        raise ValueError("the CUDA gather kernel needs 16-byte aligned page and dense pools")
    if k_out.data_ptr() % 16 or v_out.data_ptr() % 16 or v_out.dtype != k_out.dtype:
        raise ValueError("the CUDA gather kernel writes 16-byte aligned K and V buffers of one dtype")
    work = plan.page_ids.numel()
    if work == 0:
        return
    config = config_for(k, v, p, d, k_out.dtype, dense.dtype, threads, unroll)
    function = _function(config, pages.device)
    zero_k = k.zeros if k.zeros != NONE else 0  # symmetric or float layouts: never read
    zero_v = v.zeros if v.zeros != NONE else 0
    params = _Params(pages.data_ptr(), dense.data_ptr(), plan.page_ids.data_ptr(), plan.kinds.data_ptr(),
                     plan.valid.data_ptr(), plan.rows.data_ptr(), k_out.data_ptr(), v_out.data_ptr(),
                     int(pages.shape[1]), int(h), int(k.codes), max(int(k.scales), 0), int(zero_k), int(v.codes),
                     max(int(v.scales), 0), int(zero_v))
    args = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(params), ctypes.c_void_p))
    stream = torch.cuda.current_stream(pages.device).cuda_stream
    with torch.cuda.device(pages.device):
        _driver.ensure_context(_index(pages.device))
        _driver.check(_driver.lib.cuLaunchKernel(function, work, 1, 1, threads, 1, 1, 0, ctypes.c_void_p(stream),
                                                 args, None), "cuLaunchKernel")
