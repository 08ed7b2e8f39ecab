#!/usr/bin/env bash
# One device call (session 12): the decode-kernel tests on CUDA after a tensor-core kernel change, the occupancy probe
# (default grid against fixed program counts) and Nsight Compute on the recommended spec's layout.
# Run from the repository root with .whl carried:  bash perf/gpu_kernel_check.sh   (writes under $OUT)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
REC=$(python3 -c "from kvbackend.spec import RECOMMENDED_PAGE_SPEC as s; print(s)")
timeout 230 python3 -m pytest -q -ra -p no:cacheprovider -n 8 --dist loadfile tests/test_mma_recipe.py tests/test_mma_decode.py \
    tests/test_kernel_levers.py tests/test_paged_decode.py tests/test_kernel_known_limits.py tests/test_transformers_random.py \
    tests/test_llama_runner.py 2>&1 | tee $OUT/tests.log | tail -15
timeout 120 python3 perf/experiments/mma_occupancy.py --out $OUT/mma_occupancy.json --min-blocks 0,2 --programs 0,264,528 \
    2>&1 | tee $OUT/occupancy.log
(cd perf && timeout 60 ncu --clock-control none --kernel-name regex:mma_decode --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
    --section SourceCounters --section MemoryWorkloadAnalysis python3 ncu_kernels.py decode "$REC" --mma --levers \
    > $OUT/ncu_recipe.txt 2>&1; echo "== ncu recipe: rc $?"; grep -E "Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Warp Cycles Per Issued|excessive|Spilling Requests" $OUT/ncu_recipe.txt)
