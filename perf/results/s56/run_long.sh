#!/bin/bash
# The two paged klt specs at a 6144-token prefix and at 1536 with the same continuation (--skip 4608).
# usage: bash perf/results/s56/run_long.sh CORE NAME...
core=$1; shift
declare -A TEXT=([tech]=/usr/share/doc/dpkg/spec/triggers.txt [code]=/root/.pyenv/versions/3.12.1/lib/python3.12/argparse.py
                 [legal]=/usr/share/common-licenses/GPL-3 [pyenv]=/root/.pyenv/CHANGELOG.md)
declare -A CALIB=([tech]=code [code]=tech [legal]=code [pyenv]=legal)
for name in "$@"; do
  for run in "6144 0" "1536 4608"; do
    set -- $run
    OMP_NUM_THREADS=1 taskset -c $core .venv/bin/kvbackend eval --text ${TEXT[$name]} --prefix $1 --skip $2 \
      --codec "klt:kbits=2.85,vbits=2,vstep=1.15,axes=channels,paged=true" \
      --codec "klt:kbits=3.75,vstep=1.15,axes=channels,paged=true" \
      --calibration ${TEXT[${CALIB[$name]}]} --json perf/results/s56/long_${name}_$1s$2.json \
      > perf/results/s56/long_${name}_$1s$2.log 2>&1
  done
done
