"""`perf/bench_sglang_gpu.py` with the SGLang backend's page encode on the kernels (as shipped: `unit_encoder_for`
gives the kernels' one-pass encode on CUDA) or on the torch reference (``reference``: the encode of before
session 29), for an A/B of the set path in one device call.

    python3 perf/experiments/adapter_encode_ab.py kernels|reference --out F [bench_sglang_gpu options]
"""
import runpy
import sys
from pathlib import Path

import kvbackend.integration.sglang as sglang

side = sys.argv[1]
if side not in ("kernels", "reference"):
    raise SystemExit("first argument: kernels or reference")
if side == "reference":
    sglang.unit_encoder_for = lambda device: {}
sys.argv = [sys.argv[0]] + sys.argv[2:]
runpy.run_path(str(Path(__file__).resolve().parents[1] / "bench_sglang_gpu.py"), run_name="__main__")
