"""Quality gauge for a format question the tensor-core decode raises (levers report, `perf/results/s50/`): per-channel
key scales and zeros shared by RoPE pairs (c, c + D/2), so that the scale commutes with R(t) (it could fold into the
query) and the zero becomes one product against the constant R(t) table. This script runs `kvbackend eval` with the
channel-group key quantizer of qvg/quantwm replaced by a paired one (each pair's 2 x group values one clipped group;
the layout unchanged, so the pair's scale and zero are stored twice and the bpv is today's: a real paired format
would store half of them, 2 bytes fewer per pair, page and head at fp8 fields).

    .venv/bin/python perf/experiments/kpair_scales.py [--paired] -- <kvbackend eval arguments>
"""

from __future__ import annotations

import sys

import torch

from kvbackend import bitpack
from kvbackend.codecs import groups, qvg
from kvbackend.quant import quantize
from kvbackend.tools import cli

_original = groups.encode_channel_groups


def paired_channel_groups(x, layout, pages, prefix, bits, group, clip=False):
    if prefix != "k":
        return _original(x, layout, pages, prefix, bits, group, clip)
    t, h, d = x.shape
    store = layout.page.fields[f"{prefix}_scales"].dtype
    p = layout.page_size
    grouped = x.float().reshape(t // group, group, h, d).permute(0, 2, 3, 1)  # [tg, H, D, G]
    pair = torch.cat([grouped[..., : d // 2, :], grouped[..., d // 2 :, :]], dim=-1).contiguous()  # [tg, H, D/2, 2G]
    q = quantize(pair, bits, symmetric=False, store=store, clip=clip)
    scale = torch.cat([q.scale, q.scale], dim=-1)  # [tg, H, D]
    zero = torch.cat([q.zero, q.zero], dim=-1)
    codes = torch.cat([q.codes[..., :group], q.codes[..., group:]], dim=2)  # [tg, H, D, G]
    codes = codes.permute(0, 3, 1, 2).reshape(t, h, d)
    page = layout.page
    page.view(pages, f"{prefix}_codes").copy_(groups.to_pages(bitpack.pack(codes, bits), p))
    page.view(pages, f"{prefix}_scales").copy_(scale.reshape(-1, p // group, h, d))
    page.view(pages, f"{prefix}_zeros").copy_(zero.reshape(-1, p // group, h, d))


def main() -> int:
    args = sys.argv[1:]
    if args and args[0] == "--paired":
        qvg.encode_channel_groups = paired_channel_groups
        args = args[1:]
        print("paired key scales (RoPE pairs c, c + D/2)", flush=True)
    if args and args[0] == "--":
        args = args[1:]
    return cli.main(["eval", *args])


if __name__ == "__main__":
    sys.exit(main())
