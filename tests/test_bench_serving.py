"""perf/bench_serving.py runs every section end to end on a small model (its figures come from the GPU)."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_serving_benchmark_smoke_run(tmp_path):
    out, png = tmp_path / "serving.json", tmp_path / "serving.png"
    caches = "identity|rtn:bits=2,group=64"
    run = subprocess.run([sys.executable, os.path.join(ROOT, "perf", "bench_serving.py"), "--tiny", "--caches", caches,
                          "--out", str(out), "--plot", str(png)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    budget = result["shape"]["budget_bytes"]
    for cache in result["caches"]:
        held = cache["bytes_per_request"]
        assert held["total"] == held["packed"] + held["codebooks"] + held["dense_chunk"] > 0
        assert cache["capacity"] == budget // held["total"]
        batches = [d["batch"] for d in cache["decode"]]
        assert batches == sorted(batches) and batches[-1] == min(cache["capacity"], result["shape"]["max_batch"])
        assert all(d["tokens_per_s"] > 0 for d in cache["decode"])
    identity, rtn = result["caches"]
    again = result["baseline_again"]  # the baseline's limit measured once more, after the other caches
    assert again["batch"] == identity["decode"][-1]["batch"] and again["tokens_per_s"] > 0
    assert "measured again after the others" in result["headline"]
    assert rtn["bytes_per_request"]["packed"] * 6 < identity["bytes_per_request"]["packed"]  # 2-bit codes
    assert rtn["capacity"] > identity["capacity"]
    for served in result["workload"]:
        assert served["requests"] == result["shape"]["workload"]
        assert served["output_tokens"] == served["requests"] * result["shape"]["new_tokens"]
        assert served["prompt_tokens_reused"] > 0  # the shared prefix was found in the cache
    anchor = result["generate_batch"]  # transformers' continuous batching on the same prompts
    assert anchor["measured"], anchor
    assert anchor["output_tokens"] == result["shape"]["workload"] * result["shape"]["new_tokens"]
    for first in result["first_token"]:  # restored from each tier
        for tier in ("host", "file"):
            assert first[f"{tier}_restored_tokens"] > 0, first
            # lossless pages give the recomputed first token; a lossy codec may not: from scratch the
            # last chunk's tokens were still exact when the prompt ended, after a restore they are packed
            assert first[f"{tier}_same_first_token"] or first["codec"] != "identity", first
    tables = result["headline"].split("\n\n")
    # the throughput table, the baseline's drift (one line), the workload (+ the anchor), the first tokens
    rows = [1 + len(result["caches"]), 0, 2 + len(result["caches"]), 1 + len(result["caches"])]
    if torch.cuda.is_available():  # the rows with CUDA graphs, and bound by their kernels alone (a profiled step)
        rows[1:1] = [1 + len(result["caches"])] * 2
        for cache in result["caches"]:
            for d in cache["decode"]:
                assert 0 < d["kernel_ms"] < 2 * d["step_ms_max"], d
                assert d["kernel_bound_tokens_per_s"] == pytest.approx(d["batch"] / d["kernel_ms"] * 1e3)
                assert d["graph_tokens_per_s"] == pytest.approx(d["batch"] / d["graph_step_ms_median"] * 1e3)
    else:
        assert all("kernel_ms" not in d and "graph_tokens_per_s" not in d
                   for cache in result["caches"] for d in cache["decode"])
    assert [t.count("\n") for t in tables] == rows, tables
    assert png.stat().st_size > 0
