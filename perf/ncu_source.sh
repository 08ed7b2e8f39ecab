#!/usr/bin/env bash
# Nsight Compute's source view of the tensor-core decode kernel on a lever layout (B=8, L=32K): which lines of
# mma_decode.cu take the shared-memory bank conflicts, the uncoalesced global sectors and the stalls. The kernel
# is compiled with -lineinfo into a cubin cache of its own (perf/ncu_kernels.py --lineinfo).
#   bash perf/ncu_source.sh $OUT ["SPEC"]      (default: the recommended spec)
# then, on the CSV it leaves: python3 perf/ncu_lines.py $OUT/mma_source.csv.gz (stall samples per line)
set -u
out=${1:?output folder}
cd "$(dirname "$0")"
spec=${2:-$(python3 -c "from kvbackend.spec import RECOMMENDED_PAGE_SPEC as s; print(s)")}
timeout 120 ncu --clock-control none --kernel-name regex:mma_decode --launch-skip 2 --launch-count 1 \
    --section SourceCounters --section WarpStateStats --section MemoryWorkloadAnalysis_Tables \
    --import-source yes -o "$out/mma_source" -f python3 ncu_kernels.py decode "$spec" --mma --levers --lineinfo \
    > "$out/ncu_source_run.txt" 2>&1
echo "== profile: rc $?"
# the source page (per SASS line with its CUDA line: stall samples, shared wavefronts, excessive sectors)
ncu --import "$out/mma_source.ncu-rep" --page source --csv --print-source sass,cuda > "$out/mma_source.csv" 2>&1 \
    || ncu --import "$out/mma_source.ncu-rep" --page source --csv > "$out/mma_source.csv" 2>&1
echo "== source page: rc $?, $(wc -l < "$out/mma_source.csv") lines"
ncu --import "$out/mma_source.ncu-rep" --page details --print-details all > "$out/mma_details.txt" 2>&1
grep -iE "excessive|bank|uncoalesced" "$out/mma_details.txt" | head -20
gzip -f "$out/mma_source.csv"
