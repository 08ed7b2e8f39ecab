# Session 39's first device call (carry .whl .whl_vllm .sglang_min .vllm_min); $1: commit. `make gpu-test` with 12
# test workers (16 cores on the device; session 38's 8 took 461 s of pytest), bench_memory left out, under LIMIT.
export GPU_TEST_WORKERS=${GPU_TEST_WORKERS:-12}
bash perf/results/s27/gpu_final.sh "$1"
