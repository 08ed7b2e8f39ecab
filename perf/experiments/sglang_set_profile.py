"""Where the SGLang backend's set and get of the recipe's page-local codec spend their time (#20's rows on the GPU):
the backend's own time split (set: from the pool, encode, waiting for writes; get: reads, decode, into the pool),
the codec's one-pass encode of one batch alone (device tensors in, synchronized), and the top operations of one
warm set and one warm get under torch's profiler.

    python3 perf/experiments/sglang_set_profile.py OUT_DIR [--pages 64] [--page-size 64] [--layers 32]

Writes OUT_DIR/sglang_set_profile.json, OUT_DIR/sglang_set_ops.txt and OUT_DIR/sglang_get_ops.txt.
"""
from __future__ import annotations

import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import torch  # noqa: E402

from sglang_common import parser, setup  # noqa: E402
from test_sglang import host_indices  # noqa: E402


def main() -> None:
    args = parser(__doc__).parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    n, p = args.pages, args.page_size
    s = setup(args)
    cuda, host, backend = s.cuda, s.host, s.backend
    raw = n * s.page_raw
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    assert all(backend.batch_set_v1([f"warm{i}" for i in range(n)], host_indices(range(n), p)))
    result = {"codec": args.codec, "pages": n, "page_size": p, "layers": args.layers,
              "device": torch.cuda.get_device_name() if cuda else "cpu"}

    def rounds(kind: str, call, stats: tuple[str, ...]) -> list[dict]:
        """Three timed calls of ``call(r)`` (each must succeed for every page), with the backend's time split."""
        rows = []
        for r in range(3):
            before = dict(backend.get_stats())
            sync()
            start = time.perf_counter()
            assert all(call(r))
            sync()
            seconds = time.perf_counter() - start
            after = backend.get_stats()
            split = {k: after[k] - before.get(k, 0.0) for k in stats if k in after}
            rows.append({"s": seconds, "GBps": raw / seconds / 1e9, **split})
            print(f"{kind} {r}: {raw / seconds / 1e9:.2f} GB/s ({seconds * 1e3:.1f} ms); "
                  + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in split.items()), flush=True)
        return rows

    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])

    def profiled(call, rows: int) -> str:
        """The top operations of one ``call()`` under torch's profiler: by device (or host) time, then by own host time."""
        with torch.profiler.profile(activities=acts) as prof:
            call()
            sync()
        table = prof.key_averages().table
        return (table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=rows, max_name_column_width=70)
                + "\n\n" + table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70))

    result["sets"] = rounds("set", lambda r: backend.batch_set_v1([f"r{r}-{i}" for i in range(n)],
                                                                  host_indices(range(n), p)),
                            ("from_pool_s", "encode_s", "write_s"))

    # the codec's one-pass encode of one batch, device tensors in (no staging, no trailer, no write)
    import kvbackend.integration.sglang as module
    batch = min(n, module.BATCH_PAGES if cuda else 4)
    g = backend.geometry
    dev = backend.device.device
    k = torch.randn(batch * args.layers, p, g.num_kv_heads, g.head_dim, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    stored = backend.frame.to_stored(k.reshape(-1, g.num_kv_heads, g.head_dim), v.reshape(-1, g.num_kv_heads, g.head_dim),
                                     0, None, False) if backend.frame.levers.active else (k, v)
    units = [x.reshape(batch * args.layers, p, g.num_kv_heads, g.head_dim) for x in stored]
    times = []
    for _ in range(4):
        sync()
        start = time.perf_counter()
        backend.codec.encode_units(*units, backend.layout)
        sync()
        times.append(time.perf_counter() - start)
    enc = sorted(times)[len(times) // 2]
    result["encode_units_batch"] = {"pages": batch, "units": batch * args.layers, "s": enc,
                                    "GBps": batch * raw / n / enc / 1e9}
    print(f"encode_units of {batch} pages ({batch * args.layers} units) on {dev}: {enc * 1e3:.1f} ms, "
          f"{batch * raw / n / enc / 1e9:.2f} GB/s of raw KV", flush=True)

    text = profiled(lambda: backend.batch_set_v1([f"prof{i}" for i in range(n)], host_indices(range(n), p)), 40)
    (out / "sglang_set_ops.txt").write_text(text)
    print(text[:6000])

    # gets of what the last set round wrote, into the second half of the pool
    names = [f"r2-{i}" for i in range(n)]
    get = lambda r=0: backend.batch_get_v1(names, host_indices(range(n, 2 * n), p))  # noqa: E731
    result["gets"] = rounds("get", get, ("read_s", "decode_s", "to_pool_s"))
    text = profiled(get, 30)
    (out / "sglang_get_ops.txt").write_text(text)
    (out / "sglang_set_profile.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
