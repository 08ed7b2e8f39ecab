# Session 58, second device call: the gpu-test's failed tests again (fixed tests; GPU paths as at 1a5a2f2), the chw
# tests and bench with the tile variant timed (session 57's gpu4.sh), then the tensor-core chw scores experiment.
GPU_TEST_WORKERS=8 GPU_TEST_BENCHES=0 GPU_TEST_SKIP_DONE=perf/results/s58/done1.txt LIMIT=200 \
  bash perf/results/s45/gpu_final.sh $1 2>&1 | tail -8
bash perf/results/s57/gpu4.sh 2>&1 | tail -14
export PYTHONPATH=/tmp/site:.
timeout 200 python perf/experiments/chw_mma_scores.py $OUT/chw_mma_scores.json 2>&1 | tail -12
