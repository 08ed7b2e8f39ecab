"""Gather-dequant as a CUDA kernel compiled at first use (`gather_dequant.cu` says how it works).

It reads per-token and per-channel groups of 2, 4 or 8-bit codes with fp8, fp16 or bf16 scales, centroid stages
(bf16, or fp8 with scales), plain fp8/fp16/bf16 pages and dense fp16/bf16 pages into fp16 or bf16 rows, with the
levers of the recommended recipe: sinks, pre-RoPE or page-relative keys, Hadamard-rotated values, sparse PSAC rows,
key outliers and (where `mma_decode.WHOLE` allows) whole key rows (`supports` says which layouts; the Triton kernel
reads the rest).
`gather_dequant` takes it on CUDA where `preferred` says so, and the Triton kernel everywhere else. Compilation and
loading share `mma_decode`'s nvcc lookup, disk cache and driver calls.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from kvbackend.batch import BatchPlan
from kvbackend.scheme import CHANNEL_GROUPS, FLOAT, MAX_KERNEL_WHOLE, NONE, TOKEN_GROUPS, LeverScheme, TensorScheme

from kvbackend.kernels import mma_decode

SOURCE = Path(__file__).with_name("gather_dequant.cu")
PREFERRED = True  # `gather_dequant` takes this kernel where it can (tests may turn it off)
_OUT_KIND = {torch.float16: 1, torch.bfloat16: 2}
THREADS = 512  # per CTA (one work page)
UNROLL = 4  # runs of 8 elements a thread loads before it converts and stores them


def default_shape(k: TensorScheme, v: TensorScheme, levers: LeverScheme | None) -> tuple[int, int]:
    """(threads, unroll) when the caller names none. On the H200 (B=8, L=32K; perf/NOTES.md, session 22): plain
    layouts 512 x 4 (rtn-2 and kivi-2 at 84-88% of the copy ceiling, 256 x 4 a few percent behind); centroid stages
    256 x 4 (qvg 4% faster than 512 x 4); levers 256 x 2 (the recipe's layout 18% faster than 512 x 4: 64 and more
    registers a thread, so more, smaller CTAs per SM)."""
    if levers is not None and levers.active:
        return 256, 2
    if k.stages or v.stages:
        return 256, 4
    return THREADS, UNROLL


@dataclass(frozen=True)
class GatherConfig:
    """Compile-time options of one variant: the page geometry, each tensor's storage and the dtypes."""

    head_dim: int
    page: int
    k: tuple[int, ...]  # (mode, bits, group, symmetric, kind, stages, centroids, fp8 centroids)
    v: tuple[int, ...]
    out_kind: int
    dense_kind: int
    threads: int = THREADS
    unroll: int = UNROLL
    sink: int = 0
    sink_kind: int = 2
    rope: bool = False
    page_rope: bool = False
    vrot: bool = False
    psac_rank: int = 0
    psac_rows: int = 0
    psac_sparse: bool = False
    outliers: int = 0
    heads: int = 0  # KV heads, compiled in (0: read at run time)
    whole: int = 0  # whole key rows per page and head

    def defines(self) -> list[str]:
        out = [f"-DHEAD_DIM={self.head_dim}", f"-DKV_HEADS={self.heads}", f"-DPAGE={self.page}", f"-DOUT_KIND={self.out_kind}",
               f"-DDENSE_KIND={self.dense_kind}", f"-DNTHREADS={self.threads}", f"-DUNROLL={self.unroll}",
               f"-DSINK={self.sink}", f"-DSINK_KIND={self.sink_kind}", f"-DROPE={int(self.rope)}",
               f"-DPAGE_ROPE={int(self.page_rope)}", f"-DVROT={int(self.vrot)}", f"-DPSAC_R={self.psac_rank}",
               f"-DPSAC_ROWS={self.psac_rows}", f"-DPSAC_SPARSE={int(self.psac_sparse)}", f"-DOUT_N={self.outliers}",
               f"-DWHOLE_N={self.whole}"]
        for prefix, (mode, bits, group, sym, kind, stages, cents, cfp8) in (("K", self.k), ("V", self.v)):
            out += [f"-D{prefix}_MODE={mode}", f"-D{prefix}_BITS={bits}", f"-D{prefix}_GROUP={group}",
                    f"-D{prefix}_SYM={sym}", f"-D{prefix}_KIND={kind}", f"-D{prefix}_STAGES={stages}",
                    f"-D{prefix}_C={cents}", f"-D{prefix}_CFP8={cfp8}"]
        return out


MAX_HEADS = 32  # KV heads whose PSAC rows and key outliers a CTA stages (`MAX_HEADS` in the source)
_STAGED_BYTES = 40 * 1024  # shared memory for them, whole rows' tokens and scales, and a mask per (token, head) row


def _tensor_ok(x: TensorScheme, page_size: int, head_dim: int) -> bool:
    if x.kind not in (0, 1, 2):
        return False
    if x.stages and (x.assign < 0 or x.codebook % 16 or (x.centroid_scales != NONE and x.centroid_scales % 2)):
        return False
    if x.mode == FLOAT:
        return x.codes % 16 == 0
    if x.bits not in (2, 3, 4, 8) or x.codes % 8 or x.scales % 16 or (not x.symmetric and x.zeros % 16):
        return False
    if x.mode == TOKEN_GROUPS:  # a run of 8 channels lies in one group
        return x.group % 8 == 0 and head_dim % x.group == 0
    return x.mode == CHANNEL_GROUPS and page_size % x.group == 0


def _levers_ok(lv: LeverScheme, page_size: int, head_dim: int, heads: int, whole: bool | None = None) -> bool:
    if lv.whole and not ((mma_decode.WHOLE if whole is None else whole) and lv.whole <= MAX_KERNEL_WHOLE):
        return False  # the Triton gather reads them
    if lv.sink and (lv.sink_k % 16 or lv.sink_v % 16 or lv.sink_kind not in (1, 2)):
        return False
    if (lv.prerope or lv.pagerope) and head_dim % 16:  # a run of 8 channels on one side of RoPE's halves
        return False
    if lv.psac_rank or lv.outliers or lv.whole:
        staged = (lv.psac_rows * (lv.psac_rank + 1) + 2 * lv.outliers + 2 * lv.whole + page_size) * MAX_HEADS * 4
        if heads > MAX_HEADS or staged > _STAGED_BYTES or lv.psac_rank > 16:
            return False
    return True


@functools.lru_cache(maxsize=256)
def supports(k: TensorScheme, v: TensorScheme, page_size: int, head_dim: int, out_dtype: torch.dtype,
             dense_dtype: torch.dtype, levers: LeverScheme | None = None, heads: int = 1) -> bool:
    """Whether the kernel reads this pair of schemes, with ``levers``, into ``out_dtype`` (``heads`` KV heads)."""
    # head_dim 8..128: a row's runs within one warp and their bits below the mask's PSAC bit (`rowmask`)
    return (head_dim % 8 == 0 and 8 <= head_dim <= 128 and 32 % (head_dim // 8) == 0 and out_dtype in _OUT_KIND
            and dense_dtype in _OUT_KIND
            and _levers_ok(levers or LeverScheme(), page_size, head_dim, heads)
            and _tensor_ok(k, page_size, head_dim) and _tensor_ok(v, page_size, head_dim))


def config_for(k: TensorScheme, v: TensorScheme, page_size: int, head_dim: int, out_dtype: torch.dtype,
               dense_dtype: torch.dtype, threads: int | None = None, unroll: int | None = None,
               levers: LeverScheme | None = None, heads: int = 0) -> GatherConfig:
    """The variant for a layout; ``threads``/``unroll`` None: `default_shape`. ``heads``: the KV heads, compiled
    in (the per-run index arithmetic then divides by constants: session 23 measured the recipe's layout's gather
    with them read at run time as its bottleneck); 0 reads them from the launch."""
    def spec(x: TensorScheme) -> tuple[int, ...]:
        return (x.mode, max(x.bits, 1), max(x.group, 1), int(bool(x.symmetric)), x.kind, x.stages,
                max(x.centroids, 1), int(x.stages > 0 and x.centroid_scales != NONE))
    shape = default_shape(k, v, levers)
    threads = shape[0] if threads is None else threads
    unroll = shape[1] if unroll is None else unroll
    if threads not in (64, 128, 256, 512, 1024) or unroll not in (1, 2, 4, 8):
        raise ValueError(f"threads must be 64..1024 (a power of two) and unroll 1, 2, 4 or 8; got {threads}, {unroll}")
    lv = levers or LeverScheme()
    return GatherConfig(head_dim, page_size, spec(k), spec(v), _OUT_KIND[out_dtype], _OUT_KIND[dense_dtype],
                        threads, unroll, lv.sink, lv.sink_kind if lv.sink else 2, bool(lv.prerope), bool(lv.pagerope),
                        bool(lv.vrot), lv.psac_rank, lv.psac_rows if lv.psac_rank else 0,
                        bool(lv.psac_rank) and lv.psac_token != NONE, lv.outliers, int(heads), lv.whole)


class _Params(ctypes.Structure):  # mirrors `struct Params` in gather_dequant.cu
    _fields_ = [(name, ctypes.c_uint64) for name in (
                    "pages", "dense", "book", "page_ids", "kinds", "valid", "rows", "slots", "positions", "local_cos",
                    "local_sin", "base_cos", "base_sin", "k_out", "v_out")] + [
                ("page_bytes", ctypes.c_longlong), ("book_bytes", ctypes.c_longlong)] + [(name, ctypes.c_int) for name in (
                    "H", "k_codes", "k_scales", "k_zeros", "k_assign", "k_book", "k_cscale", "v_codes", "v_scales",
                    "v_zeros", "v_assign", "v_book", "v_cscale", "sink_k", "sink_v", "psac_codes", "psac_scale",
                    "psac_token", "psac_basis", "out_index", "out_value", "whole_codes", "whole_scale", "whole_token")]


def compile_cubin(config: GatherConfig, arch: str) -> bytes:
    """The cubin of ``config`` for ``arch``, compiled once and cached on disk beside the decode kernel's. No fast
    math: float32 subnormal products must survive as the torch reference computes them."""
    return mma_decode.cached_cubin(SOURCE, ["-cubin", f"-arch={arch}", "-O3", "-std=c++17", *config.defines()],
                                   "gather_dequant")


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
              dense_dtype: torch.dtype, levers: LeverScheme | None, device: torch.device, heads: int = 1) -> bool:
    """Whether `gather_dequant` takes this kernel when not told otherwise: a supported layout on a usable GPU,
    a variant that has not failed to compile or load, and not a first load during CUDA-graph capture."""
    if not (PREFERRED and device.type == "cuda"
            and supports(k, v, page_size, head_dim, out_dtype, dense_dtype, levers, heads)
            and mma_decode.available(device)[0]):
        return False
    key = (_index(device), config_for(k, v, page_size, head_dim, out_dtype, dense_dtype, levers=levers,
                                             heads=heads))
    if key in _failed:
        return False
    return key in _functions or not torch.cuda.is_current_stream_capturing()


def launch(pages: torch.Tensor, codebooks: torch.Tensor, dense: torch.Tensor, schemes: tuple[TensorScheme, TensorScheme],
           plan: BatchPlan, k_out: torch.Tensor, v_out: torch.Tensor, levers: LeverScheme | None = None,
           tables=None, threads: int | None = None, unroll: int | None = None) -> None:
    """Write every planned token of K and V into ``k_out, v_out [tokens, H, D]`` (checked by the caller).

    ``codebooks``: the layer's codebook slots (centroids, sinks, PSAC bases); ``tables``: the lever tables
    (`kvbackend.kernels.levers.lever_tables`) for pre-RoPE and page-relative keys."""
    k, v = schemes
    _, _, p, h, d = dense.shape
    lv = levers if levers is not None and levers.active else LeverScheme()
    if pages.device.type != "cuda":
        raise ValueError(f"the CUDA gather kernel runs on CUDA pages, got {pages.device}")
    if not supports(k, v, p, d, k_out.dtype, dense.dtype, lv, h):
        raise ValueError(f"the CUDA gather kernel does not read this layout ({k}, {v}, {lv}; page {p}, head_dim {d}, "
                         f"{h} heads, {dense.dtype} dense pages into {k_out.dtype})")
    if pages.data_ptr() % 16 or pages.shape[1] % 16 or dense.data_ptr() % 16:
        raise ValueError("the CUDA gather kernel needs 16-byte aligned page and dense pools")
    if k_out.data_ptr() % 16 or v_out.data_ptr() % 16 or v_out.dtype != k_out.dtype:
        raise ValueError("the CUDA gather kernel writes 16-byte aligned K and V buffers of one dtype")
    needs_book = k.stages or v.stages or lv.sink or lv.psac_rank
    if needs_book and (codebooks is None or not codebooks.numel() or codebooks.data_ptr() % 16
                       or codebooks.shape[-1] % 16):
        raise ValueError("centroids, sinks and PSAC bases live in 16-byte aligned codebook slots: pass codebooks=")
    if (lv.prerope or lv.pagerope) and tables is None:
        raise ValueError("keys stored before RoPE need its tables (kvbackend.kernels.levers.lever_tables)")
    work = plan.page_ids.numel()
    if work == 0:
        return
    config = config_for(k, v, p, d, k_out.dtype, dense.dtype, threads, unroll, lv, h)
    book = codebooks if needs_book else pages  # never read without centroids, sinks or PSAC rows
    rope = (tables.local_cos, tables.local_sin, tables.base_cos, tables.base_sin) if tables is not None else (pages,) * 4

    def at(offset: int) -> int:  # an absent field's offset: never read
        return max(int(offset), 0)
    params = _Params(pages.data_ptr(), dense.data_ptr(), book.data_ptr(), plan.page_ids.data_ptr(),
                     plan.kinds.data_ptr(), plan.valid.data_ptr(), plan.rows.data_ptr(), plan.slots.data_ptr(),
                     plan.positions.data_ptr(), *(t.data_ptr() for t in rope), k_out.data_ptr(), v_out.data_ptr(),
                     int(pages.shape[1]), int(book.shape[-1]), int(h),
                     *(at(x) for x in (k.codes, k.scales, k.zeros, k.assign, k.codebook, k.centroid_scales,
                                       v.codes, v.scales, v.zeros, v.assign, v.codebook, v.centroid_scales,
                                       lv.sink_k, lv.sink_v, lv.psac_codes, lv.psac_scale, lv.psac_token,
                                       lv.psac_basis, lv.out_index, lv.out_value, lv.whole_codes, lv.whole_scale,
                                       lv.whole_token)))
    args = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(params), ctypes.c_void_p))
    stream = torch.cuda.current_stream(pages.device).cuda_stream
    with torch.cuda.device(pages.device):  # loaded and launched in the pages' device's context
        function = _function(config, pages.device)
        _driver.ensure_context(_index(pages.device))
        _driver.check(_driver.lib.cuLaunchKernel(function, work, 1, 1, config.threads, 1, 1, 0, ctypes.c_void_p(stream),
                                                 args, None), "cuLaunchKernel")
