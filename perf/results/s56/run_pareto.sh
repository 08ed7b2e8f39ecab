#!/bin/bash
# Paged klt points for the Pareto table (perf/pareto.py reads perf/results/eval*.json): 1536 + 512 on the three
# evaluation texts, bases from another text. usage: bash perf/results/s56/run_pareto.sh CORE NAME...
core=$1; shift
declare -A TEXT=([tech]=/usr/share/doc/dpkg/spec/triggers.txt [code]=/root/.pyenv/versions/3.12.1/lib/python3.12/argparse.py
                 [legal]=/usr/share/common-licenses/GPL-3)
declare -A CALIB=([tech]=code [code]=tech [legal]=code)
for name in "$@"; do
  OMP_NUM_THREADS=1 taskset -c $core .venv/bin/kvbackend eval --text ${TEXT[$name]} --prefix 1536 \
    --codec "klt:kbits=1.5,vbits=2,vstep=1.15,axes=channels,paged=true" \
    --codec "klt:kbits=2,vbits=2,vstep=1.15,axes=channels,paged=true" \
    --codec "klt:kbits=2.85,vbits=2,vstep=1.15,axes=channels,paged=true" \
    --codec "klt:kbits=3.75,vstep=1.15,axes=channels,paged=true" \
    --codec "klt:kbits=4.5,vbits=4,axes=channels,paged=true" \
    --calibration ${TEXT[${CALIB[$name]}]} --json perf/results/eval60_${name}_klt.json \
    > perf/results/s56/eval60_${name}_klt.log 2>&1
done
