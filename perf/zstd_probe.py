"""Does a lossless zstd stage pay on packed pages? Real KV from the shipped model, one CPU core.

    .venv/bin/python perf/zstd_probe.py --text /usr/share/common-licenses/GPL-3

Encodes the text's KV (all layers) with each codec, then compresses the packed bytes with zstd at
levels 1, 3 and 19 (the `zstandard` package, installed only for this probe). Prints the size ratio
and the compression and decompression speeds.
"""

from __future__ import annotations

import argparse
import time

import torch

from kvbackend import codecs
from kvbackend.evaluate import capture_exact
from kvbackend.geometry import Geometry
from kvbackend.models import load_model


def main() -> None:
    import zstandard

    parser = argparse.ArgumentParser()
    parser.add_argument("--text", required=True)
    parser.add_argument("--tokens", type=int, default=2048)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_model()
    ids = tokenizer(open(args.text, encoding="utf-8").read(), return_tensors="pt").input_ids[:, : args.tokens]
    exact = capture_exact(model, ids)
    heads, _, dim = exact.k[0].shape
    geometry = Geometry(len(exact.k), heads, dim, exact.k[0].dtype)
    for spec in ("kivi:bits=2,group=32", "rtn:bits=2,group=64,scale=fp8", "qvg", "fp8"):
        codec = codecs.get(spec)
        layout = codec.layout(geometry, 64)
        raw = b"".join(
            (lambda c: c.pages.numpy().tobytes() + c.codebook.numpy().tobytes())(
                codec.encode(k.transpose(0, 1), v.transpose(0, 1), layout))
            for k, v in zip(exact.k, exact.v))
        for level in (1, 3, 19):
            t0 = time.perf_counter()
            packed = zstandard.ZstdCompressor(level=level).compress(raw)
            t1 = time.perf_counter()
            zstandard.ZstdDecompressor().decompress(packed)
            t2 = time.perf_counter()
            print(f"{spec:34s} zstd-{level:<2d} {len(raw) / len(packed):.3f}x smaller  "
                  f"compress {len(raw) / (t1 - t0) / 1e6:7.0f} MB/s  decompress {len(raw) / (t2 - t1) / 1e6:7.0f} MB/s",
                  flush=True)


if __name__ == "__main__":
    main()
