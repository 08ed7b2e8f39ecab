# Session 61, call 1: the chw bench with the tile-table variants (perf/bench_chw_mma.py: default, tab, tab + vsubn,
# session 60's default), then Nsight Compute on the chw tensor-core decode and KIVI-2 (perf/ncu_chw.sh).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export CHW_VARIANTS=${CHW_VARIANTS:-mma_tab,mma_tab_vsubn,mma_subn_fold_vsubn}
PYTHONPATH=/tmp/site:. python perf/bench_chw_mma.py --precompile > $OUT/precompile.log 2>&1
tail -2 $OUT/precompile.log
PYTHONPATH=/tmp/site:. timeout ${BENCH_LIMIT:-150} python perf/bench_chw_mma.py $OUT/chw_tab.json 8,32768 2>&1 \
  | grep -v "^\s*$" | cut -c1-300 | grep -v '^{' | tail -20
PYTHONPATH=/tmp/site:$PWD bash perf/ncu_chw.sh $OUT
for k in chw kivi; do PYTHONPATH=/tmp/site:. python3 perf/ncu_lines.py $OUT/${k}_source.csv.gz --top 22 \
    --source kernels/mma_decode.cu 2>&1 | cut -c1-200 | tail -26; done
