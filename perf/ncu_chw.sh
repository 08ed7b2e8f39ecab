#!/usr/bin/env bash
# Nsight Compute on the tensor-core decode: the chw lane layout (the bench's mixed widths) and KIVI-2 through the
# same kernel family, B=8, L=32K; per kernel the source page (stall samples per line) and the details page.
#   bash perf/ncu_chw.sh $OUT     then: python3 perf/ncu_lines.py $OUT/chw_source.csv.gz --source kernels/mma_decode.cu
set -u
out=${1:?output folder}
cd "$(dirname "$0")"
for kind in chw kivi; do
  timeout 100 ncu --clock-control none --kernel-name regex:mma_decode --launch-skip 3 --launch-count 1 \
      --section SourceCounters --section WarpStateStats --section SpeedOfLight --section Occupancy \
      --section SchedulerStats --section InstructionStats --section MemoryWorkloadAnalysis_Tables \
      --import-source yes -o "$out/${kind}_source" -f python3 ncu_chw.py $kind > "$out/ncu_${kind}_run.txt" 2>&1
  echo "== $kind profile: rc $?"
  ncu --import "$out/${kind}_source.ncu-rep" --page source --csv --print-source sass,cuda > "$out/${kind}_source.csv" 2>&1 \
      || ncu --import "$out/${kind}_source.ncu-rep" --page source --csv > "$out/${kind}_source.csv" 2>&1
  ncu --import "$out/${kind}_source.ncu-rep" --page details --print-details all > "$out/${kind}_details.txt" 2>&1
  grep -iE "Duration|Executed Ipc|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Registers Per|Achieved Occ" \
      "$out/${kind}_details.txt" | head -14
  gzip -f "$out/${kind}_source.csv"
done
