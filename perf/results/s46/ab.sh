# Session 46, device call 5: the A/B of call 4, against the kernel source before. The device machine's tree has no git
# history: write the base source first, where git is, and the call carries it (untracked files travel):
#   git show 86130d7:kernels/mma_decode.cu > perf/results/s46/mma_decode_base.cu
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
timeout 300 python3 perf/results/s46/ab_codebooks.py $OUT/ab_codebooks.json perf/results/s46/mma_decode_base.cu 8 46 2>&1 | grep -v Warning
