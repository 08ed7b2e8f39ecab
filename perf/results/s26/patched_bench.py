"""`perf/bench_kernels.py` with the encoders' k-means or the outliers' top-k swapped back (session 26's A/B probe).
Usage: python3 patched_bench.py MODE [bench_kernels args]; MODE holds 'graphed' and/or 'fulltopk', or 'eager'."""
import runpy
import sys

import kvbackend.codecs.quantwm as qw
import kvbackend.kernels.chunk_encoder as ce
import kvbackend.kernels.unit_encoder as ue

sys.path.insert(0, "perf/experiments")
from kmeans_graph_ab import graphed  # noqa: E402  (session 25's per-shape graph, removed from kernels/kmeans.py)

mode = sys.argv.pop(1)
if "graphed" in mode:  # session 25's encoders: fixed steps replayed from a CUDA graph per shape
    ue.kmeans = ce.kmeans = graphed
if "fulltopk" in mode:  # session 25's outliers: the full-width top-k
    qw.top_positions = lambda score, n, segment: score.topk(n, dim=-1).indices
sys.argv[0] = "perf/bench_kernels.py"
runpy.run_path("perf/bench_kernels.py", run_name="__main__")
