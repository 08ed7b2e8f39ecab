#!/bin/bash
# Paged klt on the held-out texts (never used to choose a spec), bases from another text; writes eval60_*.
# usage: bash perf/results/s56/run_heldout.sh CORE
core=$1
C=/root/.pyenv/versions/3.12.1/lib/python3.12/argparse.py; T=/usr/share/doc/dpkg/spec/triggers.txt
for row in "gfdl /usr/share/common-licenses/GFDL-1.3 $C" "subprocess /root/.pyenv/versions/3.12.1/lib/python3.12/subprocess.py $T" \
           "subtree /usr/share/doc/git/contrib/subtree/git-subtree.txt $C"; do
  set -- $row
  OMP_NUM_THREADS=1 taskset -c $core .venv/bin/kvbackend eval --text $2 --prefix 1536 \
    --codec "klt:kbits=2,vbits=2,vstep=1.15,axes=channels,paged=true" \
    --codec "klt:kbits=2.85,vbits=2,vstep=1.15,axes=channels,paged=true" \
    --codec "klt:kbits=3.75,vstep=1.15,axes=channels,paged=true" \
    --calibration $3 --json perf/results/eval60_heldout_$1_klt.json > perf/results/s56/eval60_heldout_$1_klt.log 2>&1
done
