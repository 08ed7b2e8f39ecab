"""Where one SGLang get of the recipe's page-local codec goes (#20's get row), piece by piece: the file tier's reads
of one decode batch (open, read, crc32c) with the page check blob by blob inside the tier and without it, the page
check blob by blob and over the whole batch, the batch's decode (synchronized) and whole `batch_get_v1` calls, each
with the gather kernel's decode of units with codebooks (`UnitGather`) and with the codec's own, side by side.

    python3 perf/experiments/sglang_get_split.py OUT.json [--pages 64] [--page-size 64] [--layers 32]

Prints milliseconds and GB/s of raw KV for each piece (medians of five) and writes them to OUT.json.
"""
from __future__ import annotations

import json
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import torch  # noqa: E402

from sglang_common import parser, setup  # noqa: E402
from test_sglang import host_indices  # noqa: E402


def main() -> None:
    args = parser(__doc__).parse_args()
    n, p = args.pages, args.page_size
    s = setup(args)
    cuda, backend, page_raw = s.cuda, s.backend, s.page_raw
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    names = [f"p{i}" for i in range(n)]
    assert all(backend.batch_set_v1(names, host_indices(range(n), p)))
    import kvbackend.integration.sglang as module
    batch = min(n, module.BATCH_PAGES if cuda else 4)
    ints = [backend._key(k) for k in names[:batch]]
    size = backend.blob_bytes
    staging = backend.device.staging((batch, size), torch.uint8)
    result = {"codec": args.codec, "pages": n, "batch": batch, "blob_bytes": size, "page_raw_bytes": page_raw,
              "device": torch.cuda.get_device_name() if cuda else "cpu", "workers": backend.tier._workers}

    def timed(name: str, call, pages: int, repeat: int = 5) -> None:
        times = []
        for _ in range(repeat):
            sync()
            start = time.perf_counter()
            out = call()
            sync()
            times.append(time.perf_counter() - start)
            assert out is not False
        s = statistics.median(times)
        result[name] = {"ms": s * 1e3, "GBps_raw": pages * page_raw / s / 1e9}
        print(f"{name}: {s * 1e3:.2f} ms ({pages * page_raw / s / 1e9:.2f} GB/s of raw KV, {pages} pages)", flush=True)

    check = backend._check()
    timed("read_batch_check_per_blob", lambda: all(backend.tier.get(ints, list(staging), expected_len=[size] * batch,
                                                                     check=check).result()), batch)
    timed("read_batch_unchecked", lambda: all(backend.tier.get(ints, list(staging), expected_len=[size] * batch)
                                              .result()), batch)
    if check is not None:
        timed("check_per_blob", lambda: all(check(row) is None for row in staging), batch)
        timed("check_batch", lambda: not any(backend.page_check.bad_rows(staging)), batch)
    timed("is_page_of_batch", lambda: all(backend._is_page_of(staging[j], ints[j]) for j in range(batch)), batch)
    units = backend.units  # the gather kernel's decode of units with codebooks (None: the codec's own)
    result["gather_kernel"] = units is not None
    for name, using in (("kernel", units), ("codec", None)) if units is not None else (("codec", None),):
        backend.units = using
        timed(f"decode_batch_{name}", lambda: backend._decode_batch(staging) is not None, batch)
        timed(f"batch_get_v1_{name}", lambda: all(backend.batch_get_v1(names, host_indices(range(n, 2 * n), p))), n,
              repeat=3)
    backend.units = units
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
