"""Experiment: the query-key pass of a tensor-core decode over keys at a width per channel (`chw_mma_scores.cu`).

Question: at Llama-8B geometry (Hq 32, Hkv 8, D 128, 64-token pages, B=8, L=32K), what does reading keys at a width
per channel (0-8 bits, 2.66 on average, as a 2.6-bit klt plan spreads them) cost on tensor cores, against the same
kernel with every width 2 (uniform 2-bit codes) and against BF16 SDPA (the whole attention), in one run? And, for
scale, the package's tensor-core decode of KIVI-2 pages (the whole attention: keys, softmax, values).

Checks first: every score of a small batch (odd group and lengths) against float32 scores over the torch-decoded
keys. Then times the scores-only kernel (each warp's largest score written, nothing else) over a few split counts
and register bounds, and writes one JSON.

    PYTHONPATH=. python perf/experiments/chw_mma_scores.py OUT.json
"""

from __future__ import annotations

import ctypes
import json
import pathlib
import random
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "perf"))

from kvbackend.codecs.chw import lane_order  # noqa: E402
from kvbackend.kernels.mma_decode import _Driver, cached_cubin  # noqa: E402

SOURCE = pathlib.Path(__file__).with_suffix(".cu")
D, P, KT = 128, 64, 8


def mixed_widths(heads: int, seed: int = 0) -> torch.Tensor:
    """Widths 0-8 spread as a 2.6-bit klt plan spreads them (the bench of the chw gather's draw), [H, D]."""
    rng = random.Random(seed)
    choices = [0, 1, 2, 2, 2, 3, 3, 3, 4, 6, 3, 3, 4, 2]
    return torch.tensor([[rng.choice(choices) for _ in range(D)] for _ in range(heads)])


class Layout:
    """Byte offsets of one page and the kernel's per-head tables for widths [H, D]."""

    def __init__(self, widths: torch.Tensor, device) -> None:
        self.widths = widths
        heads = widths.shape[0]
        order = lane_order(D)
        self.offsets = torch.zeros(heads, D, dtype=torch.long)  # bit offset of each channel in its token's row
        self.row_bits, self.first, self.bytes = [], [], []
        at = 0
        for h in range(heads):
            w = widths[h, order]
            self.offsets[h, order] = torch.cumsum(w, 0) - w
            s = int(w.sum())
            nbytes = -(-(4 * (-(-P * s // 32) + 1)) // 16) * 16  # the rows, one word more, in 16-byte chunks
            self.row_bits.append(s)
            self.first.append(at)
            self.bytes.append(nbytes)
            at += nbytes
        self.amax = at
        self.page_bytes = at + heads * D * 2
        consts = torch.zeros(heads, KT, 4, dtype=torch.long)
        for h in range(heads):
            for kt in range(KT):
                for tig in range(4):
                    c0 = 16 * kt + 2 * tig
                    ws = [int(widths[h, c]) for c in (c0, c0 + 1, c0 + 8, c0 + 9)]
                    consts[h, kt, tig] = (int(self.offsets[h, c0]) | ws[0] << 12 | ws[1] << 16 | ws[2] << 20
                                          | ws[3] << 24)
        self.consts = consts.to(torch.int32).to(device)
        self.t_first = torch.tensor(self.first, dtype=torch.int32, device=device)
        self.t_bytes = torch.tensor(self.bytes, dtype=torch.int32, device=device)
        self.t_rows = torch.tensor(self.row_bits, dtype=torch.int32, device=device)
        self.block = max(self.bytes)

    def pack(self, codes: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
        """Pages uint8 [N, page_bytes] of codes [N, P, H, D] (below 2^w) and fp16 absmax [N, H, D]."""
        n, heads = codes.shape[0], self.widths.shape[0]
        pages = torch.zeros(n, self.page_bytes, dtype=torch.uint8, device=codes.device)
        shifts = torch.arange(32, device=codes.device)
        for h in range(heads):
            s, w = self.row_bits[h], self.widths[h].to(codes.device)
            words = self.bytes[h] // 4
            bits = torch.zeros(n, words * 32, dtype=torch.uint8, device=codes.device)
            t = torch.arange(P, device=codes.device)
            for k in range(8):  # bit k of every code that has it
                has = (w > k).nonzero().flatten()
                if has.numel() == 0:
                    continue
                at = t[:, None] * s + self.offsets[h, has.cpu()].to(codes.device)[None, :] + k  # [P, C]
                bit = ((codes[:, :, h, has] >> k) & 1).to(torch.uint8)  # [N, P, C]
                bits[:, at.flatten()] = bit.reshape(n, -1)
            value = (bits.view(n, words, 32).long() << shifts).sum(-1)  # LSB first
            value = torch.where(value >= 2**31, value - 2**32, value).to(torch.int32)
            pages[:, self.first[h]: self.first[h] + self.bytes[h]] = value.view(torch.uint8).view(n, -1)
        pages[:, self.amax:] = amax.contiguous().view(torch.uint8).reshape(n, -1)
        return pages

    def keys(self, codes: torch.Tensor, amax: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
        """float32 keys [N, P, H, D]: mean + (code + 0.5) * step - amax, the mean where the width is 0."""
        w = self.widths.to(codes.device)
        a = amax.float()[:, None]
        step = 2 * a / (2.0 ** w)
        level = (codes.float() + 0.5) * step - a
        return mean.float() + torch.where(w > 0, level, torch.zeros_like(level))


class _Params(ctypes.Structure):  # mirrors `struct Params` in chw_mma_scores.cu
    _fields_ = [("pages", ctypes.c_uint64), ("page_bytes", ctypes.c_longlong), ("page_table", ctypes.c_uint64),
                ("pages_per_req", ctypes.c_int), ("pages_per_split", ctypes.c_int), ("H", ctypes.c_int),
                ("group", ctypes.c_int), ("q", ctypes.c_uint64), ("consts", ctypes.c_uint64),
                ("head_first", ctypes.c_uint64), ("head_bytes", ctypes.c_uint64), ("row_bits", ctypes.c_uint64),
                ("amax_offset", ctypes.c_int), ("mean", ctypes.c_uint64), ("out", ctypes.c_uint64)]


_driver = None
_functions = {}


def launch(layout: Layout, pages, table, q, mean, out, splits: int, warps: int, write: bool, minb: int = 1):
    global _driver
    if _driver is None:
        _driver = _Driver()
    block = max(16, layout.block)
    key = (block, warps, write, minb)
    smem = warps * 2 * (block + 2 * D)
    if key not in _functions:
        major, minor = torch.cuda.get_device_capability()
        cubin = cached_cubin(SOURCE, ["-cubin", f"-arch=sm_{major}{minor}", "-O3", "-std=c++17", "-use_fast_math",
                                      f"-DBLOCK={block}", f"-DNWARPS={warps}", f"-DWRITE_SCORES={int(write)}",
                                      f"-DMINB={minb}"], "chw_mma_scores")
        _driver.ensure_context(torch.cuda.current_device())
        _functions[key] = _driver.load(cubin, smem, b"chw_scores")
    b, per_req = table.shape
    heads = layout.widths.shape[0]
    per_split = -(-per_req // splits)
    params = _Params(pages.data_ptr(), pages.shape[1], table.data_ptr(), per_req, per_split, heads,
                     q.shape[1] // heads, q.data_ptr(), layout.consts.data_ptr(), layout.t_first.data_ptr(),
                     layout.t_bytes.data_ptr(), layout.t_rows.data_ptr(), layout.amax, mean.data_ptr(),
                     out.data_ptr())
    args = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(params), ctypes.c_void_p))
    stream = torch.cuda.current_stream().cuda_stream
    _driver.check(_driver.lib.cuLaunchKernel(_functions[key], b, heads, splits, warps * 32, 1, 1, smem,
                                             ctypes.c_void_p(stream), args, None), "cuLaunchKernel")


def unpack(layout: Layout, pages: torch.Tensor) -> torch.Tensor:
    """Codes [N, P, H, D] read back from pages as the kernel reads them (a thread's 32-bit window at the bit of its
    four channels, each code under its width): the layout and the per-head tables checked without a GPU."""
    n, heads = pages.shape[0], layout.widths.shape[0]
    codes = torch.zeros(n, P, heads, D, dtype=torch.long)
    consts = layout.consts.cpu().long()
    for h in range(heads):
        words = pages[:, layout.first[h]: layout.first[h] + layout.bytes[h]].contiguous().view(torch.int32).long()
        words = words & 0xFFFFFFFF
        for kt in range(KT):
            for tig in range(4):
                c = int(consts[h, kt, tig])
                off, ws = c & 0xFFF, [(c >> s) & 15 for s in (12, 16, 20, 24)]
                c0 = 16 * kt + 2 * tig
                for t in range(P):
                    bit = t * layout.row_bits[h] + off
                    win = ((words[:, (bit >> 5) + 1] << 32 | words[:, bit >> 5]) >> (bit & 31)) & 0xFFFFFFFF
                    at = 0
                    for ch, w in zip((c0, c0 + 1, c0 + 8, c0 + 9), ws):
                        codes[:, t, h, ch] = (win >> at) & ((1 << w) - 1)
                        at += w
    return codes


def make(widths: torch.Tensor, n_pages: int, gen: torch.Generator, device):
    layout = Layout(widths, device)
    heads = widths.shape[0]
    w = widths.to(device)
    codes = (torch.rand(n_pages, P, heads, D, generator=gen, device=device) * (2.0 ** w)).long()
    amax = (0.5 + 2.5 * torch.rand(n_pages, heads, D, generator=gen, device=device)).half()
    mean = (0.5 * torch.randn(heads, D, generator=gen, device=device)).half()
    return layout, codes, amax, mean


def check(device) -> dict:
    """Every score of B=3 requests of 5, 2 and 7 pages (group 5 of 2 KV heads) against float32 over the keys."""
    gen = torch.Generator(device=device).manual_seed(1)
    heads, group = 2, 5
    result = {}
    for name, widths in (("mixed", mixed_widths(heads, 3)), ("every width 2", torch.full((heads, D), 2)),
                         ("widths 0 and 8", torch.tensor([[0, 8] * (D // 2)] * heads))):
        layout, codes, amax, mean = make(widths, 21, gen, device)
        pages = layout.pack(codes, amax)
        keys = layout.keys(codes, amax, mean)  # [N, P, H, D]
        per_req = 7
        table = torch.randperm(21, generator=gen, device=device).view(3, per_req).int().contiguous()
        q = torch.randn(3, heads * group, D, generator=gen, device=device).bfloat16()
        out = torch.full((3, heads * group, per_req * P), float("nan"), device=device)
        launch(layout, pages, table, q, mean, out, splits=3, warps=4, write=True)
        torch.cuda.synchronize()
        k = keys[table.long()].reshape(3, per_req * P, heads, D)  # [B, L, H, D]
        qf = q.float().view(3, heads, group, D)
        want = torch.einsum("bhgd,blhd->bhgl", qf, k).reshape(3, heads * group, per_req * P)
        err = float(((out - want).abs().max() / want.abs().max()))
        result[name] = {"max_abs_err_over_max": err, "bits_per_key": float(widths.float().mean())}
        print(name, result[name], flush=True)
        assert err < 5e-3, (name, err)
    return result


def time_scores(device) -> dict:
    import triton

    from bench_kernels import sdpa_time  # noqa: E402

    batch, length, heads, hq = 8, 32768, 8, 32
    per_req = length // P
    n_pages = batch * per_req
    gen = torch.Generator(device=device).manual_seed(2)
    q = torch.randn(batch, hq, D, device=device).bfloat16()
    table = torch.randperm(n_pages, device=device, generator=gen).int().view(batch, per_req).contiguous()
    result = {"sdpa_bf16_us": 1e3 * sdpa_time(batch, hq, heads, length, D, 1)}
    for name, widths in (("mixed 2.66-bit", mixed_widths(heads)), ("every width 2", torch.full((heads, D), 2))):
        layout = Layout(widths, device)
        pages = torch.empty(n_pages, layout.page_bytes, dtype=torch.uint8, device=device)
        for s in range(0, n_pages, 256):  # packed 256 pages at a time (the bit matrix of all would be large)
            _, codes, amax, mean = make(widths, min(256, n_pages - s), gen, device)
            pages[s: s + codes.shape[0]] = layout.pack(codes, amax)
        rows = []
        for splits in (8, 16, 32):
            for minb in (1, 2, 3):
                out = torch.empty(batch * heads * splits * 4, device=device)
                try:
                    ms = triton.testing.do_bench(lambda: launch(layout, pages, table, q, mean, out, splits, 4, False,
                                                                minb), warmup=50, rep=200, return_mode="median")
                except Exception as exc:
                    rows.append({"splits": splits, "minb": minb, "error": f"{type(exc).__name__}: {exc}"[:300]})
                    continue
                rows.append({"splits": splits, "minb": minb, "us": 1e3 * ms})
        best = min((r for r in rows if "us" in r), key=lambda r: r["us"])
        key_bytes = n_pages * layout.page_bytes
        result[name] = {"page_bytes": layout.page_bytes, "rows": rows, "best_us": best["us"],
                        "key_GBps": key_bytes / best["us"] / 1e3,
                        "bits_per_key_stored": 8 * layout.page_bytes / (P * heads * D)}
        print(name, {k: v for k, v in result[name].items() if k != "rows"}, flush=True)
    return result


def kivi_decode(device) -> dict:
    """The package's tensor-core decode of KIVI-2 pages at the same shape (the whole attention), for scale."""
    from bench_kernels import encoded_pages, rotation_plans

    from kvbackend.kernels.paged_decode import paged_decode
    from kvbackend.scheme import kernel_schemes

    batch, length, heads, hq = 8, 32768, 8, 32
    codec, layout, chunk = encoded_pages("kivi:bits=2,group=64", heads, D, P)
    schemes = kernel_schemes(codec, layout)
    per_req = length // P
    pages = chunk.pages.repeat(-(-batch * per_req // chunk.pages.shape[0]), 1)[: batch * per_req].contiguous()
    books, (plan,) = rotation_plans(batch, per_req, P, 1, chunk.codebook, dense_tokens=0)
    dense = torch.zeros(1, 2, P, heads, D, device=device).bfloat16()
    q = torch.randn(batch, hq, D, device=device).bfloat16()
    import triton

    ms = triton.testing.do_bench(lambda: paged_decode(q, pages, books, dense, schemes, plan, target_programs=528,
                                                      mma=True), warmup=50, rep=200, return_mode="median")
    return {"kivi2_mma_decode_us": 1e3 * ms, "page_bytes": layout.page_bytes}


def main(path: str) -> None:
    device = torch.device("cuda")
    result = {"device": torch.cuda.get_device_name()}
    result["check"] = check(device)
    result["scores"] = time_scores(device)
    try:
        result["kivi"] = kivi_decode(device)
    except Exception as exc:
        result["kivi"] = f"{type(exc).__name__}: {exc}"[:500]
    print(json.dumps(result.get("kivi")), flush=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
