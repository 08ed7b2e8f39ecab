# Session 31, call 3: Nsight Compute's source page of the tensor-core decode kernel on the recommended page codec
# (B=8, L=32K), then per-line instructions and stalls.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
bash perf/ncu_source.sh $OUT 2>&1 | tail -20
python3 perf/ncu_lines.py $OUT/mma_source.csv.gz --top 70 --source kernels/mma_decode.cu > $OUT/lines.txt 2>&1
head -80 $OUT/lines.txt | cut -c1-220
