python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
timeout 120 python3 -m pytest -q -x tests/test_mma_decode.py 2>&1 | tail -3
timeout 330 python3 perf/probe_mma.py --out $OUT/probe_mma_v2.json 2>&1 | tail -24
cd perf && timeout 100 ncu --clock-control none --kernel-name regex:mma_decode --launch-skip 2 --launch-count 1 --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section InstructionStats python3 ncu_kernels.py decode rtn:bits=2,group=64,scale=fp8 --mma --stages 2 > $OUT/ncu_mma_v1.txt 2>&1; echo ncu rc $?
grep -E "Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Warp Cycles Per Issued|Issued Ipc|One or More Eligible|Block Limit|Executed Instructions " $OUT/ncu_mma_v1.txt | head -20
for f in ~/.cache/kvbackend/cubin/*.cubin; do cuobjdump -sass $f > $OUT/sass_$(basename $f .cubin).txt 2>&1; done; ls -la $OUT
