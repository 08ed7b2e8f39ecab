# Session 61 (device time short after failed starts): the CUDA tests of what this session changed (the tensor-core
# decode's launcher and Params, the chw tile table) on this commit, then the chw bench's tile-table variants.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
export CHW_VARIANTS=${CHW_VARIANTS:-mma_tab,mma_w32,mma_w32_tab}
PYTHONPATH=/tmp/site:. python perf/bench_chw_mma.py --precompile > $OUT/precompile.log 2>&1 &
echo "commit ${COMMIT:?} $(nvidia-smi --query-gpu=name --format=csv,noheader)" > $OUT/gpu-subset.log
PYTHONPATH=/tmp/site timeout ${TEST_LIMIT:-220} python3 -P -m pytest -q -n 12 --dist ${DIST:-loadfile} -p no:cacheprovider \
  ${TESTS:-tests/test_mma_chw.py tests/test_mma_decode.py tests/test_chw_gather.py tests/test_chw.py tests/test_paged_decode.py} \
  >> $OUT/gpu-subset.log 2>&1
echo "tests rc=$?"; tail -4 $OUT/gpu-subset.log
wait; tail -1 $OUT/precompile.log
PYTHONPATH=/tmp/site:. timeout ${BENCH_LIMIT:-150} python perf/bench_chw_mma.py $OUT/chw_tab.json 8,32768 2>&1 \
  | grep -v "^\s*$" | cut -c1-300 | grep -v '^{' | tail -20
