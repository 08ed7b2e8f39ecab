"""Paged decode on tensor cores for 2-bit pages: a CUDA kernel compiled at first use.

`mma_decode.cu` says how the kernel works. It reads 2-bit codes with per-token channel groups for values,
and for keys either the same or one scale and zero per channel and page (KIVI-style keys, the recommended
recipe's), with up to 32 key centroids per chunk, key outliers, sinks, Hadamard-rotated values and
page-relative keys, pre-RoPE keys (2-, 3- or 4-bit codes; 4-bit ones where `K4` allows) and PSAC rows with
them (`supports_levers`). This module decides which layouts it reads (`supports`),
compiles one cubin per layout with ``nvcc`` (cached on disk, keyed by the source, the options and the
compiler's version), loads it through the CUDA driver and launches it on the current stream, so CUDA
graphs capture it. It writes the same split partials as the Triton kernels, and `paged_decode` merges
them with the same kernel.

Needs a CUDA GPU of compute capability 8.0 or later and ``nvcc`` (on ``PATH``, or ``$CUDA_HOME/bin``).
Where either is missing `available` says why, and `paged_decode` uses the Triton kernels.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from kvbackend.scheme import CHANNEL_GROUPS, MAX_KERNEL_WHOLE, NONE, TOKEN_GROUPS, LeverScheme, TensorScheme

SOURCE = Path(__file__).with_suffix(".cu")
# CTAs per SM the registers must allow unless a caller names another count: 2 (at most 255 registers for 4 warps)
# keeps ptxas from squeezing a variant to 168 registers with spills for a third block that shared memory rarely
# admits; on the H200 (B=8, L=32K) 7% faster on the lever-free layout and 2-5% on the lever layouts than 0
# (perf/NOTES.md, session 13)
DEFAULT_MIN_BLOCKS = 2


def default_min_blocks(warps: int) -> int:
    """`DEFAULT_MIN_BLOCKS` where it only caps registers at 255 (up to 4 warps: 2 x 128 threads x 255 fit the
    register file), else 0: with 8 warps two blocks would cap a thread at 128 registers and spill."""
    return DEFAULT_MIN_BLOCKS if DEFAULT_MIN_BLOCKS * warps * 32 * 255 <= 65536 else 0
MAX_GROUP = 8  # query heads per KV head: the product's N
_KINDS = (0, 1, 2)  # fp8 e4m3, fp16, bf16 scales and zeros
_DTYPE_KIND = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}


MAX_CENTROIDS = 32  # key centroids per chunk and head the kernel's table holds
MAX_OUTLIERS = 64


@functools.lru_cache(maxsize=256)
def supports(k: TensorScheme, v: TensorScheme, page_size: int, head_dim: int, group: int) -> bool:
    """Whether the kernel reads this pair of schemes at this geometry (GQA ``group`` query heads per KV head)."""
    def ok(x: TensorScheme) -> bool:
        return (x.mode == TOKEN_GROUPS and x.bits == 2 and not x.stages and x.kind in _KINDS
                and x.group in (64, head_dim) and head_dim % x.group == 0)

    def channel_keys(x: TensorScheme) -> bool:  # one scale and zero per channel and page, <= 1 centroid stage
        # (3- and 4-bit codes at head_dim 128 with pre-RoPE keys alone: `supports_levers` holds them to that)
        return (x.mode == CHANNEL_GROUPS and (x.bits == 2 or (x.bits in (3, 4) and head_dim == 128))
                and x.group == page_size and x.kind in _KINDS
                and x.stages <= 1 and (not x.stages or 1 <= x.centroids <= MAX_CENTROIDS))

    return ((ok(k) or channel_keys(k)) and ok(v) and head_dim in (64, 128) and page_size % 16 == 0
            and 16 <= page_size <= 256 and 1 <= group <= MAX_GROUP)


# Pre-RoPE keys (per-channel key scales, head_dim 128) and PSAC rows (with pre-RoPE keys, rank a multiple of 4) have
# their own paths in the kernel (`ROPE_TOKEN`, `PSAC_R`). Their GPU tests (`tests/test_mma_recipe.py`) passed on an
# H200 (perf/NOTES.md, session 11), so they are on by default; ``KVBACKEND_MMA_PREROPE=0`` sends those layouts back
# to the Triton kernels.
PREROPE = os.environ.get("KVBACKEND_MMA_PREROPE", "1") != "0"
PSAC = PREROPE
# Sparse PSAC rows with key centroids: each row (its token's centroid plus the correction) joins the centroid-value
# table, so a key pays nothing for it (0 reads the corrections per key value instead; an A/B switch for probes)
PSAC_FOLD = os.environ.get("KVBACKEND_MMA_PSAC_FOLD", "1") != "0"
# Whole key rows (`quantwm:whole=W`) in the CUDA kernels: this kernel with pre-RoPE keys and key centroids, and the
# CUDA gather (`WHOLE_N` in both sources): on since an H100 ran tests/test_mma_whole.py and tests/test_gather_cuda.py
# (session 39, perf/NOTES.md); KVBACKEND_CUDA_WHOLE=0 turns them off (the plain Triton decode kernel and the Triton
# gather read whole rows then).
WHOLE = os.environ.get("KVBACKEND_CUDA_WHOLE", "1") != "0"
# Key outliers with pre-RoPE keys and key centroids (at most 32 per page and head) folded into rows of the
# centroid-value table (`OUT_FOLD` in the source), as whole rows are, instead of a score term after the key loop: off
# by default, since an H100 timed it 2-4% slower than the score term at B=8, L=32K (perf/NOTES.md, session 53);
# KVBACKEND_MMA_OUT_FOLD=1 turns it on (an A/B switch for probes)
OUT_FOLD = os.environ.get("KVBACKEND_MMA_OUT_FOLD", "0") == "1"
# 4-bit pre-RoPE keys (`KBITS=4`: two codes a byte, read 16 of a lane's channels from 8 bytes): on since an H100 ran
# tests/test_mma_k4.py (session 39: such a layer 254.7 us against 272.1 us for a 3-bit one, B=8, L=32K);
# KVBACKEND_CUDA_K4=0 turns them off (the plain Triton decode kernel reads 4-bit keys then).
K4 = os.environ.get("KVBACKEND_CUDA_K4", "1") != "0"
# Packed pages' 2-bit value codes read as fp16 subnormals (`V_SUBN` in the source: one and a code pair instead of an
# or with 1024's bits and a subtraction): exact on an H100 (its CUDA tests passed, session 60) but only 2% faster on
# KIVI-2 and not at all on chw layers, so off by default. KVBACKEND_MMA_V_SUBN=1 turns it on (`config_for` caches:
# clear it after changing this at run time).
V_SUBN = os.environ.get("KVBACKEND_MMA_V_SUBN", "0") == "1"


@functools.lru_cache(maxsize=256)
def supports_levers(k: TensorScheme, levers: LeverScheme | None, page_size: int, head_dim: int = 128,
                    prerope: bool | None = None, psac: bool | None = None, whole: bool | None = None,
                    k4: bool | None = None) -> bool:
    """Whether the kernel reads a layer's levers (None or inactive: nothing to read). It reads sinks (within
    the first page), key outliers, Hadamard-rotated values and page-relative keys (with per-channel key
    scales), pre-RoPE keys where `PREROPE` (or ``prerope``) allows, and PSAC rows with pre-RoPE keys where
    `PSAC` (or ``psac``) allows, and whole key rows with pre-RoPE keys and key centroids where `WHOLE` (or
    ``whole``) allows; 3-bit keys on the pre-RoPE path, and 4-bit ones there where `K4` (or ``k4``) allows."""
    if levers is None or not levers.active:
        return k.bits == 2  # 3- and 4-bit keys are read on the pre-RoPE path alone, which dequantizes each key value
    rope_ok = not levers.prerope or ((PREROPE if prerope is None else prerope) and k.mode == CHANNEL_GROUPS
                                     and head_dim == 128)
    if k.bits in (3, 4) and not (levers.prerope and rope_ok):
        return False
    if k.bits == 4 and not (K4 if k4 is None else k4):
        return False
    psac_ok = not levers.psac_rank or ((PSAC if psac is None else psac) and levers.prerope and rope_ok
                                       and levers.psac_rank % 4 == 0 and levers.psac_rows <= page_size
                                       and (levers.psac_rows <= 127 if levers.psac_token != NONE
                                            else levers.psac_rows == page_size))  # the row map holds signed bytes
    # whole key rows: rows of the centroid-value table, which pre-RoPE keys with key centroids read (`WHOLE_N`)
    whole_ok = not levers.whole or ((WHOLE if whole is None else whole) and levers.prerope and rope_ok
                                    and bool(k.stages) and levers.whole <= MAX_KERNEL_WHOLE)
    return (rope_ok and psac_ok and whole_ok and levers.sink <= page_size
            and levers.outliers <= MAX_OUTLIERS and (not levers.pagerope or k.mode == CHANNEL_GROUPS)
            and (not levers.sink or levers.sink_k != NONE) and (not levers.outliers or levers.out_index != NONE))


# Whether `paged_decode` picks this kernel by default where it reads the layout (and no lever, fold or planar
# argument asks for a Triton kernel). `mma=False` opts out; `mma=True` insists (and raises where it cannot run).
PREFERRED = True


def preferred(k: TensorScheme, v: TensorScheme, page_size: int, head_dim: int, group: int, device: torch.device,
              q_dtype: torch.dtype, dense_dtype: torch.dtype, levers: LeverScheme | None = None,
              stages: int | None = None, warps: int = 4) -> bool:
    """Whether `paged_decode` takes this kernel when not told: a supported layout, levers and dtypes on a
    usable GPU with room for its shared memory, whose variant (``stages`` or `default_stages`, ``warps``) has not
    failed to compile or load, and that is not being captured into a CUDA graph before its first load."""
    if not (PREFERRED and device.type == "cuda" and supports(k, v, page_size, head_dim, group)
            and supports_levers(k, levers, page_size, head_dim)
            and q_dtype in _DTYPE_KIND and dense_dtype in (torch.float16, torch.bfloat16) and available(device)[0]):
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if stages is None:
        stages = default_stages(k, v, page_size, head_dim, q_dtype, dense_dtype, warps, levers, device)
    try:
        config = config_for(k, v, page_size, head_dim, q_dtype, dense_dtype, stages, warps, levers=levers)
    except ValueError:  # stages or warps out of range: `launch` says so where the kernel is insisted on
        return False
    if (index, config) in _failed or config.smem_bytes > max_shared_memory(index):
        return False
    return (index, config) in _functions or not torch.cuda.is_current_stream_capturing()


@functools.lru_cache(maxsize=None)
def max_shared_memory(device: int) -> int:
    """Bytes of shared memory one block may opt into on ``device``."""
    props = torch.cuda.get_device_properties(device)
    value = getattr(props, "shared_memory_per_block_optin", 0)
    if value:
        return int(value)
    return 48 * 1024  # the limit every CUDA GPU allows without opting in


@functools.lru_cache(maxsize=None)
def nvcc() -> str | None:
    """The nvcc to compile with, or None (looked up once: decode calls ask on every step)."""
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    path = Path(home) / "bin" / "nvcc"
    return str(path) if path.exists() else None


def available(device: torch.device | None = None) -> tuple[bool, str]:
    """(usable, why not) for the tensor-core kernel on ``device`` (answered once per device)."""
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    return _available(index, os.environ.get("TRITON_INTERPRET", "0") == "1")


@functools.lru_cache(maxsize=None)
def _available(device: int, interpreted: bool) -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    if interpreted:
        return False, "Triton's interpreter is on (CPU tests)"
    major, _ = torch.cuda.get_device_capability(device)
    if major < 8:
        return False, "mma.sync m16n8k16 needs compute capability 8.0 or later"
    if nvcc() is None:
        return False, "nvcc not found (PATH or CUDA_HOME)"
    return True, ""


@dataclass(frozen=True)
class Config:
    """Compile-time options of one kernel variant."""

    head_dim: int
    page: int
    kg: int  # key scale groups per head
    vg: int
    k_kind: int
    v_kind: int
    k_sym: bool
    v_sym: bool
    q_kind: int
    dense_kind: int
    stages: int = 2
    warps: int = 4
    min_blocks: int = 0  # CTAs per SM the registers must allow (0: the compiler chooses; see default_min_blocks)
    k_chan: bool = False  # key scales and zeros per channel and page
    centroids: int = 0  # key centroids per chunk (one stage; 0 = none)
    c_kind: int = 0  # centroids: 0 fp8 e4m3 (with a scale per stage and head), 2 bf16
    sink: int = 0
    outliers: int = 0
    vrot: bool = False
    page_rope: bool = False
    rope_token: bool = False  # keys stored before RoPE, turned per token in the kernel
    psac_rank: int = 0  # PSAC rows (with rope_token): rank, rows per page, whether each names its token
    psac_rows: int = 0
    psac_sparse: bool = False
    psac_fold: bool = False  # sparse PSAC rows folded into the centroid-value table (`PSAC_FOLD` in the source)
    k_bits: int = 2  # key code width (3 or 4 with rope_token only)
    whole: int = 0  # whole key rows per page and head (with rope_token and centroids)
    out_fold: bool = False  # outliers folded into the centroid-value table (`OUT_FOLD` in the source)
    k_chw: bool = False  # keys at a width per channel in lane order (`K_CHW`: `chw:...,order=lane`)
    chw_block: int = 0  # with k_chw: the largest head block of key codes, bytes (a multiple of 16)
    chw_unroll: bool = False  # with k_chw: the key loop over channel tiles unrolled (`CHW_UNROLL`)
    chw_fold: bool = False  # with k_chw: the page's steps folded once per channel in shared memory (`CHW_SFOLD`;
    #                         `chw_config` turns it on by default)
    chw_qsmem: bool = False  # with k_chw: the query pairs and folded fragments in shared memory (`CHW_QSMEM`)
    chw_swap: bool = False  # with k_chw: the block's words byte-swapped once per page (`CHW_SWAP`)
    chw_pref: bool = False  # with k_chw: the next tile's constants loaded while this one is read (`CHW_PREF`)
    chw_subn: bool = False  # with k_chw: code pairs read as fp16 subnormals (`CHW_SUBN`; on by `chw_config`'s default)
    v_subn: bool = False  # packed pages' value codes read as fp16 subnormals (`V_SUBN`)
    chw_probe: int = 0  # with k_chw: a timing probe that reads the wrong key rows (`CHW_PROBE`; benches only)
    chw_tab: bool = False  # with k_chw and chw_subn: a tile's shifts and masks from `ChwTables.tab` (`CHW_TAB`)
    chw_w32: bool = False  # with k_chw: every head's token rows whole 32-bit words, each read from its own base
    #                        (`CHW_W32`)

    def defines(self) -> list[str]:
        return [f"-DHEAD_DIM={self.head_dim}", f"-DPAGE={self.page}", f"-DKG={self.kg}", f"-DVG={self.vg}",
                f"-DK_KIND={self.k_kind}", f"-DV_KIND={self.v_kind}", f"-DK_SYM={int(self.k_sym)}",
                f"-DV_SYM={int(self.v_sym)}", f"-DQ_KIND={self.q_kind}", f"-DDENSE_KIND={self.dense_kind}",
                f"-DNSTAGE={self.stages}", f"-DNWARPS={self.warps}", f"-DMINB={self.min_blocks}",
                f"-DK_CHAN={int(self.k_chan)}", f"-DK_CENT={self.centroids}", f"-DC_KIND={self.c_kind}",
                f"-DSINK={self.sink}", f"-DOUT_N={self.outliers}", f"-DVROT={int(self.vrot)}",
                f"-DPAGE_ROPE={int(self.page_rope)}", f"-DROPE_TOKEN={int(self.rope_token)}",
                f"-DPSAC_R={self.psac_rank}", f"-DPSAC_ROWS={self.psac_rows}", f"-DPSAC_SPARSE={int(self.psac_sparse)}",
                f"-DPSAC_FOLD={int(self.psac_fold)}", f"-DKBITS={self.k_bits}", f"-DWHOLE_N={self.whole}",
                f"-DOUT_FOLD={int(self.out_fold)}", f"-DK_CHW={int(self.k_chw)}", f"-DCHW_BLOCK={self.chw_block}",
                f"-DCHW_UNROLL={int(self.chw_unroll)}", f"-DCHW_SFOLD={int(self.chw_fold)}",
                f"-DCHW_QSMEM={int(self.chw_qsmem)}", f"-DCHW_SWAP={int(self.chw_swap)}",
                f"-DCHW_PREF={int(self.chw_pref)}", f"-DCHW_SUBN={int(self.chw_subn)}",
                f"-DV_SUBN={int(self.v_subn)}", f"-DCHW_PROBE={self.chw_probe}", f"-DCHW_TAB={int(self.chw_tab)}",
                f"-DCHW_W32={int(self.chw_w32)}",
                f"-DSMEM_EXPECTED={self.smem_bytes}"]

    @property
    def smem_bytes(self) -> int:  # mirrors the byte counts at the top of mma_decode.cu
        d, p, n = self.head_dim, self.page, 8
        kes = 1 if self.k_kind == 0 else 2
        extra = ((2 * d * kes if self.k_chan else 2 * d + 16 if self.k_chw else 0)
                 + (-(-8 * self.outliers // 16) * 16 if self.outliers else 0)
                 + (4 * d if self.page_rope or self.rope_token else 0)
                 + (-(-(self.psac_rows * self.psac_rank + 8 * self.psac_rows) // 16) * 16 if self.psac_rank else 0)
                 + (-(-(self.whole * d + 8 * self.whole) // 16) * 16 if self.whole else 0))
        keys = self.chw_block + 16 if self.k_chw else p * d * self.k_bits // 8
        stage = keys + p * d // 4 + 4 * p * 4 + extra
        sp = self.vg * p * n * 2
        if self.rope_token:  # centroid values as fp16 pairs
            rows = (32 + (self.psac_rows if self.psac_fold else 0) + self.whole + (self.outliers if self.out_fold else 0)
                    + (self.centroids >= 32))  # a zero row
            table = rows * d * 2 if self.centroids else 0
        else:  # q . centroid [32][N] and the centroids' fragments
            table = 32 * n * 4 + 2 * (d // 64) * 4 * 4 * 32 * 4 if self.centroids else 0
        if self.psac_rank:  # the slot's basis, the page's corrections, the token -> row map
            table += d * self.psac_rank * 2 + (0 if self.psac_fold else self.psac_rows * d * 2) + -(-p // 16) * 16
        table += 2 * d * 4 if self.k_chw and self.chw_fold else 0  # the page's folded steps and zero terms
        table += 2 * (d // 16) * 2 * 32 * 4 if self.k_chw and self.chw_qsmem else 0  # query pairs, page fragments
        ring = self.warps * (self.stages * stage + sp + table)
        rot = 2 * p * d if self.rope_token else 0  # R(t) per CTA
        merge = self.warps * n * d * 4 + 2 * self.warps * n * 4
        in_ring = self.stages * stage >= n * d * 4  # rotated values wait in the warp's stage buffers
        return ring + rot + merge if self.vrot and not in_ring else max(ring + rot, merge)


class _Params(ctypes.Structure):  # mirrors `struct Params` in mma_decode.cu
    _fields_ = [("q", ctypes.c_uint64), ("o_part", ctypes.c_uint64), ("m_part", ctypes.c_uint64),
                ("l_part", ctypes.c_uint64), ("pages", ctypes.c_uint64), ("dense", ctypes.c_uint64),
                ("page_ids", ctypes.c_uint64), ("valid", ctypes.c_uint64), ("req_start", ctypes.c_uint64),
                ("req_pages", ctypes.c_uint64), ("req_packed", ctypes.c_uint64), ("scale_log2", ctypes.c_float),
                ("pages_per_split", ctypes.c_int), ("num_splits", ctypes.c_int), ("H", ctypes.c_int),
                ("group", ctypes.c_int), ("page_bytes", ctypes.c_longlong), ("k_codes", ctypes.c_int),
                ("k_scales", ctypes.c_int), ("k_zeros", ctypes.c_int), ("v_codes", ctypes.c_int),
                ("v_scales", ctypes.c_int), ("v_zeros", ctypes.c_int), ("book", ctypes.c_uint64),
                ("slots", ctypes.c_uint64), ("base_cos", ctypes.c_uint64), ("base_sin", ctypes.c_uint64),
                ("book_bytes", ctypes.c_longlong), ("k_assign", ctypes.c_int), ("k_book", ctypes.c_int),
                ("k_cscale", ctypes.c_int), ("out_index", ctypes.c_int), ("out_value", ctypes.c_int),
                ("local_cos", ctypes.c_uint64), ("local_sin", ctypes.c_uint64), ("psac_codes", ctypes.c_int),
                ("psac_scale", ctypes.c_int), ("psac_token", ctypes.c_int), ("psac_basis", ctypes.c_int),
                ("whole_codes", ctypes.c_int), ("whole_scale", ctypes.c_int), ("whole_token", ctypes.c_int),
                ("chw_heads", ctypes.c_uint64), ("chw_tiles", ctypes.c_uint64), ("k_mean", ctypes.c_int),
                ("chw_tab", ctypes.c_uint64)]


class _Driver:
    """The few CUDA driver calls the launcher needs, through ctypes."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.lib.cuLaunchKernel.argtypes = [ctypes.c_void_p, *([ctypes.c_uint] * 6), ctypes.c_uint, ctypes.c_void_p,
                                            ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]

    def check(self, result: int, what: str) -> None:
        if result != 0:
            text = ctypes.c_char_p()
            self.lib.cuGetErrorString(result, ctypes.byref(text))
            raise RuntimeError(f"{what}: CUDA driver error {result} ({(text.value or b'').decode()})")

    def ensure_context(self, device: int) -> None:
        """Make the device's primary context (the one torch uses) current on this thread."""
        ctx = ctypes.c_void_p()
        self.check(self.lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:
            primary = ctypes.c_void_p()
            self.check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(primary), device), "cuDevicePrimaryCtxRetain")
            self.check(self.lib.cuCtxSetCurrent(primary), "cuCtxSetCurrent")

    def resident_blocks(self, function: ctypes.c_void_p, threads: int, smem: int) -> int:
        """Blocks of ``function`` one SM holds at once (registers, shared memory and warps together)."""
        blocks = ctypes.c_int()
        self.check(self.lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(blocks), function, threads,
                                                                         ctypes.c_size_t(smem)),
                   "cuOccupancyMaxActiveBlocksPerMultiprocessor")
        return blocks.value

    def load(self, cubin: bytes, smem: int, name: bytes = b"mma_decode") -> ctypes.c_void_p:
        module, function = ctypes.c_void_p(), ctypes.c_void_p()
        self.check(self.lib.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(cubin)), "cuModuleLoadData")
        self.check(self.lib.cuModuleGetFunction(ctypes.byref(function), module, name), "cuModuleGetFunction")
        if smem > 48 * 1024:  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            self.check(self.lib.cuFuncSetAttribute(function, 8, smem), "cuFuncSetAttribute")
        return function


_lock = threading.Lock()
_driver: _Driver | None = None
_functions: dict[tuple[int, Config], ctypes.c_void_p] = {}
_failed: set[tuple[int, Config]] = set()  # variants that did not compile or load: `preferred` says no to them


def cache_dir() -> Path:
    root = os.environ.get("KVBACKEND_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvbackend")
    return Path(root) / "cubin"


@functools.lru_cache(maxsize=None)
def _nvcc_version(compiler: str) -> str:
    done = subprocess.run([compiler, "--version"], capture_output=True, text=True)
    return done.stdout.strip()


def compile_cubin(config: Config, arch: str) -> bytes:
    """The cubin of ``config`` for ``arch`` (e.g. ``sm_90``), compiled once and cached on disk."""
    return cached_cubin(SOURCE, ["-cubin", f"-arch={arch}", "-O3", "-std=c++17", "-use_fast_math", *config.defines()],
                        "mma_decode")


def cached_cubin(source: Path, options: list[str], stem: str) -> bytes:
    """The cubin ``nvcc options source`` makes, compiled once and cached on disk as ``<stem>-<key>.cubin`` (the key
    covers the source, the options and the compiler's version; a cached cubin serves without nvcc)."""
    text = source.read_bytes()
    compiler = nvcc()
    version = _nvcc_version(compiler) if compiler else ""
    key = hashlib.sha256(text + " ".join(options).encode() + version.encode()).hexdigest()[:24]
    path = cache_dir() / f"{stem}-{key}.cubin"
    if path.exists():
        return path.read_bytes()
    if compiler is None:
        raise RuntimeError(f"the CUDA kernel {source.name} needs nvcc (PATH or CUDA_HOME)")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "k.cubin"
        done = subprocess.run([compiler, *options, "-o", str(out), str(source)], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"nvcc failed on {source.name} ({' '.join(options)}):\n{done.stderr[-4000:]}")
        data = out.read_bytes()
        fd, staged = tempfile.mkstemp(dir=path.parent)  # atomic: concurrent first uses never see half a file
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(staged, path)
    return data


def _function(config: Config, device: torch.device) -> ctypes.c_void_p:
    global _driver
    index = device.index if device.index is not None else torch.cuda.current_device()
    function = _functions.get((index, config))
    if function is not None:  # loaded: no lock on the decode path
        _driver.ensure_context(index)
        return function
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("the tensor-core decode kernel loads on its first call, which cannot happen during "
                           "CUDA-graph capture: run one decode step before capturing")
    if config.smem_bytes > max_shared_memory(index):
        raise ValueError(f"the tensor-core decode kernel needs {config.smem_bytes} bytes of shared memory per block "
                         f"with these options, more than device {index} has ({max_shared_memory(index)}); use "
                         "fewer stages or warps, or the Triton kernels (mma=False)")
    with _lock:
        if _driver is None:
            _driver = _Driver()
        _driver.ensure_context(index)
        function = _functions.get((index, config))
        if function is None:
            major, minor = torch.cuda.get_device_capability(index)
            try:
                function = _driver.load(compile_cubin(config, f"sm_{major}{minor}"), config.smem_bytes)
            except Exception:
                _failed.add((index, config))  # the default path uses the Triton kernels from now on
                raise
            _functions[(index, config)] = function
    return function


@functools.lru_cache(maxsize=256, typed=True)  # asked on every call of every layer; typed: True is not 1 here
def config_for(k: TensorScheme, v: TensorScheme, page_size: int, head_dim: int, q_dtype: torch.dtype,
               dense_dtype: torch.dtype, stages: int = 2, warps: int = 4, min_blocks: int | None = None,
               levers: LeverScheme | None = None) -> Config:
    """The variant for a layout; ``min_blocks`` None: `default_min_blocks` of ``warps``."""
    if min_blocks is None and isinstance(warps, int):
        min_blocks = default_min_blocks(warps)
    for name, value, low, high in (("stages", stages, 1, 4), ("warps", warps, 1, 16), ("min_blocks", min_blocks, 0, 8)):
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise ValueError(f"the tensor-core decode kernel takes {name} from {low} to {high}, got {value!r}")
    if q_dtype not in _DTYPE_KIND:
        raise ValueError(f"queries of dtype {q_dtype} are not read by the tensor-core kernel")
    if dense_dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dense pages of dtype {dense_dtype} are not read by the tensor-core kernel")
    lv = levers or LeverScheme()
    chan = k.mode == CHANNEL_GROUPS
    return Config(head_dim, page_size, 1 if chan else head_dim // k.group, head_dim // v.group, k.kind, v.kind,
                  bool(k.symmetric), bool(v.symmetric), _DTYPE_KIND[q_dtype], _DTYPE_KIND[dense_dtype], stages, warps,
                  min_blocks, chan, k.centroids if k.stages else 0, 2 if k.stages and k.centroid_scales == NONE else 0, lv.sink,
                  lv.outliers, bool(lv.vrot), bool(lv.pagerope), bool(lv.prerope), lv.psac_rank, lv.psac_rows,
                  lv.psac_token != NONE, PSAC_FOLD and bool(k.stages) and bool(lv.prerope) and lv.psac_rank > 0
                  and lv.psac_token != NONE and lv.psac_rows <= 32, k.bits, lv.whole,
                  OUT_FOLD and bool(k.stages) and bool(lv.prerope) and 0 < lv.outliers <= 32, v_subn=V_SUBN)


@functools.lru_cache(maxsize=256)
def _default_stages(k: TensorScheme, v: TensorScheme, page_size: int, head_dim: int, q_dtype: torch.dtype,
                    dense_dtype: torch.dtype, warps: int, levers: LeverScheme | None, per_sm: int,
                    per_block: int | None = None) -> int:
    def smem(stages: int) -> int:
        return config_for(k, v, page_size, head_dim, q_dtype, dense_dtype, stages, warps, 0, levers).smem_bytes

    def blocks(stages: int) -> int:
        return per_sm // (smem(stages) + 1024)  # the driver keeps 1 KiB per block
    if per_block is not None and smem(2) > per_block >= smem(1):  # one stage fits a block, two do not
        return 1
    return 1 if blocks(2) < 2 <= blocks(1) else 2


def default_stages(k: TensorScheme, v: TensorScheme, page_size: int, head_dim: int, q_dtype: torch.dtype,
                   dense_dtype: torch.dtype, warps: int, levers: LeverScheme | None, device: torch.device) -> int:
    """Pages in flight per warp when the caller names none: two (one read while the next arrives), unless their
    shared memory leaves room for a single block per SM where one stage leaves room for two (3-bit pre-RoPE keys
    with PSAC rows: warps of two blocks hide more latency than a second stage of one). The recipe's 2-bit layers fit
    two blocks at two stages; on the H200 one and two stages time the same there (perf/NOTES.md, session 31)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    per_sm, per_block = _shared_memory(index)
    if not per_sm:
        return 2
    return _default_stages(k, v, page_size, head_dim, q_dtype, dense_dtype, warps, levers, per_sm, per_block)


@functools.lru_cache(maxsize=None)
def _shared_memory(index: int) -> tuple[int, int]:
    """(bytes per SM, bytes one block may opt into) of device ``index``, asked once (decode steps ask per layer)."""
    props = torch.cuda.get_device_properties(index)
    return int(getattr(props, "shared_memory_per_multiprocessor", 0) or 0), max_shared_memory(index)


def wave_programs(k: TensorScheme, v: TensorScheme, page_size: int, head_dim: int, q_dtype: torch.dtype,
                  dense_dtype: torch.dtype, stages: int, warps: int, levers: LeverScheme | None, device: torch.device,
                  min_blocks: int | None = None) -> int:
    """Programs of one full wave of this variant on ``device``: SMs x the blocks an SM holds at once. The split-K
    grid fills whole waves of it when the caller names no program count (`BatchPlan.wave_splits`, session 46: one wave
    divided by the requests left B=46 on 1.39 waves that ran as two): on the H200 (B=8, L=32K) one wave of two blocks per SM
    measured 3-5% faster than two waves and 25-30% faster than 1.5, and the Triton kernels' 1024 programs are about four (perf/NOTES.md,
    session 12). Loads (and on first use compiles) the variant."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    config = config_for(k, v, page_size, head_dim, q_dtype, dense_dtype, stages, warps, min_blocks, levers)
    return _wave_programs(config, index)


@functools.lru_cache(maxsize=256)
def _wave_programs(config: Config, index: int) -> int:
    with torch.cuda.device(index):  # loaded in that device's context
        function = _function(config, torch.device("cuda", index))
    blocks = _driver.resident_blocks(function, config.warps * 32, config.smem_bytes)
    return max(1, blocks) * torch.cuda.get_device_properties(index).multi_processor_count


def launch(q, o_part, m_part, l_part, pages, dense, plan, scale_log2: float, per_split: int, splits: int,
           schemes: tuple[TensorScheme, TensorScheme], stages: int = 2, warps: int = 4,
           min_blocks: int | None = None, codebooks: torch.Tensor | None = None,
           levers: LeverScheme | None = None, tables=None, prerope: bool | None = None,
           psac: bool | None = None, whole: bool | None = None, k4: bool | None = None) -> None:
    """Write the split partials of decode attention (as the Triton kernels do) for a supported layout.

    ``codebooks``: the layer's codebook slots (key centroids, sinks); ``levers``: the layer's lever scheme
    (`supports_levers`); ``tables``: `kvbackend.kernels.levers.lever_tables` for page-relative and pre-RoPE
    keys; ``prerope``, ``psac``, ``whole``, ``k4``: override `PREROPE`, `PSAC`, `WHOLE`, `K4` (tests)."""
    k, v = schemes
    _, _, p, h, d = dense.shape
    b, hq, _ = q.shape
    group = hq // h
    levers = levers if levers is not None and levers.active else None
    if not supports(k, v, p, d, group):
        raise ValueError(f"the tensor-core decode kernel does not read this layout ({k}, {v}; page {p}, "
                         f"head_dim {d}, {group} query heads per KV head)")
    if not supports_levers(k, levers, p, d, prerope, psac, whole, k4):
        raise ValueError(f"the tensor-core decode kernel does not read these levers ({levers}) with {k.bits}-bit "
                         "keys; the plain Triton kernel reads them (mma=False)")
    if (k.stages or (levers is not None and levers.psac_rank)) and (codebooks is None or not codebooks.numel()):
        raise ValueError("key centroids and PSAC bases live in the codebook slots: pass codebooks=")
    if levers is not None and (levers.pagerope or levers.prerope) and tables is None:
        raise ValueError("keys stored before RoPE need its tables (kvbackend.kernels.levers.lever_tables)")
    if b == 0:
        return
    if pages.data_ptr() % 16 or dense.data_ptr() % 16 or pages.shape[1] % 16:
        raise ValueError("the tensor-core decode kernel needs 16-byte aligned page and dense pools")
    if codebooks is not None and codebooks.numel() and (codebooks.data_ptr() % 16 or codebooks.shape[-1] % 16):
        raise ValueError("the tensor-core decode kernel needs 16-byte aligned codebook slots")
    config = config_for(k, v, p, d, q.dtype, dense.dtype, stages, warps, min_blocks, levers)
    zero_k = k.zeros if not k.symmetric else k.scales  # a symmetric layout has no zero field: never read
    zero_v = v.zeros if not v.symmetric else v.scales
    lv = levers or LeverScheme()
    book = codebooks if codebooks is not None and codebooks.numel() else pages  # never read without centroids
    rope = lv.pagerope or lv.prerope
    cos = tables.base_cos if rope else q
    sin = tables.base_sin if rope else q
    local_cos = tables.local_cos if lv.prerope else q
    local_sin = tables.local_sin if lv.prerope else q
    params = _Params(q.data_ptr(), o_part.data_ptr(), m_part.data_ptr(), l_part.data_ptr(), pages.data_ptr(),
                     dense.data_ptr(), plan.page_ids.data_ptr(), plan.valid.data_ptr(), plan.req_start.data_ptr(),
                     plan.req_pages.data_ptr(), plan.req_packed.data_ptr(), float(scale_log2), int(per_split),
                     int(splits), int(h), int(group), int(pages.shape[1]), int(k.codes), int(k.scales), int(zero_k),
                     int(v.codes), int(v.scales), int(zero_v), book.data_ptr(), plan.slots.data_ptr(),
                     cos.data_ptr(), sin.data_ptr(), int(book.shape[-1]), max(k.assign, 0), max(k.codebook, 0),
                     max(k.centroid_scales, 0), max(lv.out_index, 0), max(lv.out_value, 0), local_cos.data_ptr(),
                     local_sin.data_ptr(), max(lv.psac_codes, 0), max(lv.psac_scale, 0), max(lv.psac_token, 0),
                     max(lv.psac_basis, 0), max(lv.whole_codes, 0), max(lv.whole_scale, 0), max(lv.whole_token, 0),
                     0, 0, 0)
    _launch(config, params, q.device, b, h, splits, warps)


def _launch(config: Config, params: _Params, device: torch.device, b: int, h: int, splits: int, warps: int) -> None:
    args = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(params), ctypes.c_void_p))
    stream = torch.cuda.current_stream(device).cuda_stream
    with torch.cuda.device(device):  # the driver loads and launches in the current context: make it the device's
        function = _function(config, device)
        _driver.ensure_context(device.index if device.index is not None else torch.cuda.current_device())
        _driver.check(_driver.lib.cuLaunchKernel(function, b, h, splits, warps * 32, 1, 1, config.smem_bytes,
                                                 ctypes.c_void_p(stream), args, None), "cuLaunchKernel")


# ---------------------------------------------------------------- chw: keys at a width per channel (`K_CHW`)

@dataclass(frozen=True)
class ChwTables:
    """The kernel's constants of one ``chw:...,order=lane`` key layout (`chw_tables`)."""

    heads: torch.Tensor  # int32 [H, 8]: block's first byte in the key field, its bytes, a token's bits, the head's
    #                      first absmax index, its coded channels
    tiles: torch.Tensor  # int32 [H, D / 16, 4, 2]: per tile and thread column, bit offset | widths << 12 (4 bits
    #                      each, the column's channels c, c + 1, c + 8, c + 9), and their absmax indices in the head
    #                      (8 bits each, 255 for a channel of width 0)
    block: int  # the largest head block, bytes
    tab: torch.Tensor  # int32 [H, D / 16, 4, 8]: per tile and thread column, what `CHW_TAB` reads instead of
    #                    decoding `tiles`: bit offset, s01 = 32 - w0 - w1, 32 - s01, 32 - w2 - w3, 16 - w1, 16 - w3, and
    #                    the masks of the pairs as fp16 subnormals ((1 << w1) - 1 | ((1 << w0) - 1) << 16, the same
    #                    of w3 and w2)


@functools.lru_cache(maxsize=64)
def chw_tables(widths: str, heads: int, page_size: int, device: str) -> ChwTables:
    """`ChwTables` of key widths ``widths`` (one digit a channel, heads in order) on pages of ``page_size``."""
    from kvbackend.codecs.chw import bit_layout, lane_order

    w = torch.tensor([int(c) for c in widths], dtype=torch.int64).reshape(heads, -1)
    d = w.shape[1]
    bits = bit_layout(w.reshape(-1).to(torch.uint8), heads, page_size, "lane")
    block = torch.tensor(bits.block, dtype=torch.int64)
    coded = w > 0
    head = torch.zeros(heads, 8, dtype=torch.int64)
    head[:, 0] = block[:-1]
    head[:, 1] = block[1:] - block[:-1]
    head[:, 2] = w.sum(1)
    head[:, 4] = coded.sum(1)
    head[1:, 3] = torch.cumsum(head[:, 4], 0)[:-1]
    local = torch.cumsum(coded.to(torch.int64), 1) - 1  # a coded channel's absmax index within its head
    local[~coded] = 255
    order = lane_order(d)
    offset = torch.cumsum(w[:, order], 1) - w[:, order]  # [H, D]: bit offset of lane position i in a token's row
    tiles = torch.zeros(heads, d // 16, 4, 2, dtype=torch.int64)
    tab = torch.zeros(heads, d // 16, 4, 8, dtype=torch.int64)
    for kt in range(d // 16):
        for tig in range(4):
            at = 16 * kt + 4 * tig  # the column's first lane position
            chans = order[at : at + 4]
            word = offset[:, at].clone()
            index = torch.zeros(heads, dtype=torch.int64)
            for i in range(4):
                word |= w[:, chans[i]] << (12 + 4 * i)
                index |= local[:, chans[i]] << (8 * i)
            tiles[:, kt, tig, 0] = word
            tiles[:, kt, tig, 1] = index
            w0, w1, w2, w3 = (w[:, chans[i]] for i in range(4))
            s01 = 32 - w0 - w1
            tab[:, kt, tig] = torch.stack([offset[:, at], s01, 32 - s01, 32 - w2 - w3, 16 - w1, 16 - w3,
                                           ((1 << w1) - 1) | (((1 << w0) - 1) << 16),
                                           ((1 << w3) - 1) | (((1 << w2) - 1) << 16)], 1)
    def as_i32(x: torch.Tensor) -> torch.Tensor:
        x = x.remainder(1 << 32)
        return torch.where(x >= 1 << 31, x - (1 << 32), x).to(torch.int32).to(device).contiguous()

    return ChwTables(head.to(torch.int32).to(device).contiguous(), as_i32(tiles), int(head[:, 1].max()), as_i32(tab))


def supports_chw(scheme, levers: LeverScheme | None, head_dim: int, group: int) -> bool:
    """Whether the kernel reads a ``chw:`` layer (`kvbackend.kernels.chw_gather.ChwScheme`): lane order, keys after
    RoPE (no pre-RoPE or page-relative keys), 2-bit per-token values it reads, head_dim 64 or 128, pages of 16-256
    tokens, up to `MAX_GROUP` query heads per KV head; sinks and rotated values are read."""
    lv = levers if levers is not None and levers.active else None
    v = scheme.values
    values_ok = (v.mode == TOKEN_GROUPS and v.bits == 2 and not v.stages and v.kind in _KINDS
                 and v.group in (64, head_dim))
    levers_ok = lv is None or (not lv.prerope and not lv.pagerope and not lv.psac_rank and not lv.outliers
                               and not lv.whole and lv.sink <= scheme.page_size
                               and (not lv.sink or lv.sink_k != NONE))
    return (scheme.order == "lane" and scheme.codes >= 0 and values_ok and levers_ok and head_dim in (64, 128)
            and scheme.page_size % 16 == 0 and 16 <= scheme.page_size <= 256 and 1 <= group <= MAX_GROUP)


def chw_config(scheme, head_dim: int, q_dtype: torch.dtype, dense_dtype: torch.dtype,
               levers: LeverScheme | None = None, stages: int = 2, warps: int = 4, min_blocks: int | None = None,
               unroll: bool = False, fold: bool = True, qsmem: bool = False, swap: bool = False,
               pref: bool = False, subn: bool = True, vsubn: bool | None = None, probe: int = 0,
               tab: bool = False, w32: bool = False) -> Config:
    """The variant for a ``chw:`` layer `supports_chw` accepts."""
    if tab and (not subn or pref):
        raise ValueError("chw: the tile table (tab=True) holds the subnormal pairs' shifts: it needs subn=True and "
                         "pref=False")
    if min_blocks is None:
        min_blocks = default_min_blocks(warps)
    lv = levers if levers is not None and levers.active else LeverScheme()
    v = scheme.values
    tables = chw_tables(scheme.widths, scheme.heads, scheme.page_size, "cpu")
    if w32 and probe:
        raise ValueError("chw: w32=True reads the right key rows; it takes no timing probe")
    if w32 and bool((tables.heads[:, 2] % 32).any()):
        raise ValueError("chw: w32=True reads token rows of whole 32-bit words; this layout's rows take "
                         f"{tables.heads[:, 2].tolist()} bits a head")
    return Config(head_dim, scheme.page_size, 1, head_dim // v.group, 1, v.kind, False, bool(v.symmetric),
                  _DTYPE_KIND[q_dtype], _DTYPE_KIND[dense_dtype], stages, warps, min_blocks, sink=lv.sink,
                  vrot=bool(lv.vrot), k_chw=True, chw_block=tables.block, chw_unroll=unroll, chw_fold=fold,
                  chw_qsmem=qsmem, chw_swap=swap, chw_pref=pref, chw_subn=subn,
                  v_subn=V_SUBN if vsubn is None else vsubn, chw_probe=probe, chw_tab=tab, chw_w32=w32)


def launch_chw(q, o_part, m_part, l_part, pages, codebooks, dense, plan, scale_log2: float, per_split: int,
               splits: int, scheme, levers: LeverScheme | None = None, **options) -> None:
    """Write the split partials of decode attention over a ``chw:...,order=lane`` layer (`supports_chw`);
    ``options``: `chw_config`'s keywords (``stages``, ``warps``, ``min_blocks``, ``unroll``, ``fold``, ``qsmem``,
    ``swap``, ``pref``, ``subn``, ``vsubn``, ``probe``, ``tab``, ``w32``). ``probe`` reads the wrong key rows on
    purpose and is taken only where the environment sets ``KVBACKEND_MMA_TIMING_PROBES=1`` (a bench's timing of
    bank conflicts)."""
    if options.get("probe") and os.environ.get("KVBACKEND_MMA_TIMING_PROBES") != "1":
        raise ValueError("chw timing probes read the wrong key rows; set KVBACKEND_MMA_TIMING_PROBES=1 to time them")
    _, _, p, h, d = dense.shape
    b, hq, _ = q.shape
    if not supports_chw(scheme, levers, d, hq // h):
        raise ValueError(f"the tensor-core decode kernel does not read this chw: layer (order {scheme.order!r}, "
                         f"levers {levers}, head_dim {d}, {hq // h} query heads per KV head)")
    if b == 0:
        return
    if pages.data_ptr() % 16 or dense.data_ptr() % 16 or pages.shape[1] % 16 or codebooks.data_ptr() % 16 \
            or codebooks.shape[-1] % 16:
        raise ValueError("the tensor-core decode kernel needs 16-byte aligned page, codebook and dense pools")
    config = chw_config(scheme, d, q.dtype, dense.dtype, levers, **options)
    tables = chw_tables(scheme.widths, h, p, str(q.device))
    v = scheme.values
    zero_v = v.zeros if not v.symmetric else v.scales
    params = _Params(q.data_ptr(), o_part.data_ptr(), m_part.data_ptr(), l_part.data_ptr(), pages.data_ptr(),
                     dense.data_ptr(), plan.page_ids.data_ptr(), plan.valid.data_ptr(), plan.req_start.data_ptr(),
                     plan.req_pages.data_ptr(), plan.req_packed.data_ptr(), float(scale_log2), int(per_split),
                     int(splits), int(h), int(hq // h), int(pages.shape[1]), int(scheme.codes), int(scheme.scales), 0,
                     int(v.codes), int(v.scales), int(zero_v), codebooks.data_ptr(), plan.slots.data_ptr(),
                     q.data_ptr(), q.data_ptr(), int(codebooks.shape[-1]), 0, 0, 0, 0, 0, q.data_ptr(),
                     q.data_ptr(), 0, 0, 0, 0, 0, 0, 0, tables.heads.data_ptr(), tables.tiles.data_ptr(),
                     int(scheme.mean), tables.tab.data_ptr())
    _launch(config, params, q.device, b, h, splits, config.warps)


def chw_wave_programs(scheme, head_dim: int, q_dtype: torch.dtype, dense_dtype: torch.dtype,
                      levers: LeverScheme | None, device: torch.device, **options) -> int:
    """`wave_programs` of a ``chw:`` variant (``options``: `chw_config`'s keywords)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _wave_programs(chw_config(scheme, head_dim, q_dtype, dense_dtype, levers, **options), index)


def chw_preferred(scheme, levers: LeverScheme | None, head_dim: int, group: int, device: torch.device,
                  q_dtype: torch.dtype, dense_dtype: torch.dtype, stages: int = 2, warps: int = 4) -> bool:
    """Whether `kvbackend.kernels.chw_decode.chw_decode` takes this kernel when not told: a layer `supports_chw`
    accepts, on a usable GPU with room for its shared memory, a variant that has not failed to compile or load, and
    not during a CUDA-graph capture before its first load."""
    if not (PREFERRED and device.type == "cuda" and supports_chw(scheme, levers, head_dim, group)
            and q_dtype in _DTYPE_KIND and dense_dtype in (torch.float16, torch.bfloat16) and available(device)[0]):
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    config = chw_config(scheme, head_dim, q_dtype, dense_dtype, levers, stages, warps)
    if (index, config) in _failed or config.smem_bytes > max_shared_memory(index):
        return False
    return (index, config) in _functions or not torch.cuda.is_current_stream_capturing()
