"""The set-up shared by the SGLang experiments (`sglang_get_split.py`, `sglang_get_rounds.py`,
`sglang_set_profile.py`): their common options and a backend over a host pool of Llama-8B-shaped pages (8 KV heads
of 128), page-locked where CUDA is present as SGLang allocates it, filled with random values."""
from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
from dataclasses import dataclass

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests"))

import torch  # noqa: E402

from bench_sglang_gpu import CODECS  # noqa: E402
from test_sglang import HostPool, make_backend  # noqa: E402


def parser(doc: str) -> argparse.ArgumentParser:
    """OUT, --pages, --page-size, --layers and --codec (the recipe's page codec by default)."""
    out = argparse.ArgumentParser(description=doc.splitlines()[0])
    out.add_argument("out")
    out.add_argument("--pages", type=int, default=64)
    out.add_argument("--page-size", type=int, default=64)
    out.add_argument("--layers", type=int, default=32)
    out.add_argument("--codec", default=CODECS[-1])
    return out


@dataclass
class Setup:
    host: HostPool  # 2 x pages pages: the first half is stored, gets land in the second
    backend: object  # the storage backend (`KVBackendStorage`)
    cuda: bool
    page_raw: int  # bytes of one page's raw bf16 K and V


def setup(args: argparse.Namespace) -> Setup:
    n, p = args.pages, args.page_size
    cuda = torch.cuda.is_available()
    host = HostPool("layer_first", pages=2 * n, page_size=p, layers=args.layers, heads=8, head_dim=128)
    if cuda:
        host.kv_buffer = host.kv_buffer.pin_memory()
    host.kv_buffer.normal_()
    backend = make_backend(pathlib.Path(tempfile.mkdtemp()) / "kv", host, args.codec)
    return Setup(host, backend, cuda, 2 * args.layers * p * 8 * 128 * 2)
