# Session 21 device call 1, kept as run: the source-level profile of the tensor-core decode kernel on the recipe and
# on the recipe without PSAC rows (pre-RoPE keys), then the quick levers rows again (graphs) for a clean figure.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
spec=$(python3 -c "from kvbackend.spec import RECOMMENDED_SPEC as s; print(s)")
nopsac=$(python3 -c "import sys; sys.path.insert(0, 'perf'); import bench_kernels as b; print(b._with(b.RECOMMENDED_SPEC, rank=0))")
mkdir -p $OUT/recipe $OUT/nopsac
bash perf/ncu_source.sh $OUT/recipe "$spec" 2>&1 | tail -5
bash perf/ncu_source.sh $OUT/nopsac "$nopsac" 2>&1 | tail -5
timeout 240 python3 perf/experiments/mma_occupancy.py --out $OUT/levers_quick.json --min-blocks 2 --programs 0 --variants "recipe|recipe without PSAC|recipe without PSAC, page-relative keys|recipe, no levers, no PSAC" 2>&1 | grep -v "^ *{" | tail -12
