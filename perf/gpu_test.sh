#!/usr/bin/env bash
# `make gpu-test`: on a CUDA machine, every test (CUDA paths included: kernels, the per-layer restore on a
# side stream, pools on the device) and then quick passes of the kernel, tier and memory benchmarks. The log's
# first line names the commit it ran on; the benchmarks' JSON lands beside it.
#   usage: perf/gpu_test.sh COMMIT LOG
set -uo pipefail
commit=${1:?commit}
if ! [[ "$commit" =~ ^[0-9a-f]{40}$ ]]; then  # the log names what it tested: a full commit id, never a short one
    echo "make gpu-test needs COMMIT=<the full 40-character commit id> (git rev-parse HEAD), got '$commit'" >&2
    exit 2
fi
log=${2:?log file}
python=${PYTHON:-python3}
mkdir -p "$(dirname "$log")"
results=$(dirname "$log")
if ! "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "make gpu-test needs a CUDA device; run it on the GPU machine" >&2
    exit 2
fi
status=0
{
    echo "gpu-test commit $commit $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    "$python" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
    "$python" -m pip install -q --no-deps --no-build-isolation -e . || exit 3
    echo "== pytest (every test; CUDA present, so GPU tests run)"
    # PYTHONSAFEPATH (-P, as `make test`; inherited by the xdist workers): the repository root stays off sys.path,
    # so its kernels/ folder hides no other distribution's `kernels`.
    # pytest-xdist, where installed (carried in .whl/ to the GPU machine), runs the test files on a few
    # workers: the kernels' compilation is CPU-bound and the GPU has room for several.
    workers=()
    if "$python" -c 'import xdist' 2>/dev/null; then workers=(-n "${GPU_TEST_WORKERS:-8}" --dist loadfile); fi
    # every failure is also written to gpu-test-failures.txt as it happens (tests/conftest.py): a cut run names them;
    # --durations: the slowest tests, since the whole run (about 480 s on an H100) nearly fills a device call
    rm -f "$results/gpu-test-failures.txt"
    # every finished test goes to gpu-test-done.txt as it finishes (tests/conftest.py): a run the limit cut is
    # completed by another with GPU_TEST_SKIP_DONE=<that file> (it leaves out what passed or skipped there; the file
    # here then holds both runs)
    done_log="$results/gpu-test-done.txt"
    if [ -n "${GPU_TEST_SKIP_DONE:-}" ]; then
        echo "completing a cut run: leaving out the tests ${GPU_TEST_SKIP_DONE} names as passed or skipped"
        [ "$(realpath "$GPU_TEST_SKIP_DONE")" = "$(realpath -m "$done_log")" ] || cp "$GPU_TEST_SKIP_DONE" "$done_log"
        export KVBACKEND_SKIP_DONE="$GPU_TEST_SKIP_DONE"
    else
        rm -f "$done_log"
    fi
    # GPU_TEST_DESELECT: node ids (space-separated) left out when device time is short, named in the log; only for
    # tests that never touch CUDA (CI runs them)
    deselect=()
    for node in ${GPU_TEST_DESELECT:-}; do deselect+=(--deselect "$node"); done
    [ ${#deselect[@]} -gt 0 ] && echo "left out (GPU_TEST_DESELECT): ${GPU_TEST_DESELECT}"
    KVBACKEND_FAILURE_LOG="$results/gpu-test-failures.txt" KVBACKEND_DONE_LOG="$done_log" PYTHONSAFEPATH=1 "$python" -m pytest -q -ra -p no:cacheprovider --durations=25 "${workers[@]}" "${deselect[@]}" tests || status=1
    # (the kernels' agreement with the torch references is the tests' job; the bench's `checks` section repeats it)
    if [ "${GPU_TEST_BENCHES:-1}" = 1 ]; then  # GPU_TEST_BENCHES=0 leaves the quick benches out (about 70 s)
        echo "== bench_kernels (quick: B=8, L=32K, one configuration per kernel; the recipe with and without levers; gather)"
        KVB_BENCH_QUICK=1 "$python" perf/bench_kernels.py --only ceiling,decode,levers,gather \
            --out "$results/gpu-test-bench_kernels.json" || status=1
        echo "== bench_tiers (quick: 8K-token restores)"
        KVB_BENCH_QUICK=1 "$python" perf/bench_tiers.py --out "$results/gpu-test-bench_tiers.json" || status=1
    else
        echo "== bench_kernels and bench_tiers left out (GPU_TEST_BENCHES=0)"
    fi
    if [ "${GPU_TEST_MEMORY:-1}" = 1 ]; then  # GPU_TEST_MEMORY=0 leaves it out (about 100 s) when device time is short
        echo "== bench_memory (transformers: a 16K-token generation, Llama-8B shape with random weights; a 60 s budget)"
        timeout 120 "$python" perf/bench_memory.py --steps 8 --budget-s 60 \
            --out "$results/gpu-test-bench_memory.json" || status=1
    else
        echo "== bench_memory left out (GPU_TEST_MEMORY=0)"
    fi
    echo "gpu-test exit $status"
    exit $status
} 2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
