#!/bin/bash
# klt:kbits=3.75,vstep=1.15,axes=channels,paged=true at 1536 + 512 on the other texts.
declare -A TEXT=([tech]=/usr/share/doc/dpkg/spec/triggers.txt [code]=/root/.pyenv/versions/3.12.1/lib/python3.12/argparse.py
                 [legal]=/usr/share/common-licenses/GPL-3 [pyenv]=/root/.pyenv/CHANGELOG.md)
declare -A CALIB=([tech]=code [code]=tech [legal]=code [pyenv]=legal)
core=$1; shift
for name in "$@"; do
  OMP_NUM_THREADS=1 taskset -c $core .venv/bin/kvbackend eval --text ${TEXT[$name]} --prefix 1536 \
    --codec "klt:kbits=3.75,vstep=1.15,axes=channels,paged=true" \
    --calibration ${TEXT[${CALIB[$name]}]} --json perf/results/s56/k375_${name}.json > perf/results/s56/k375_${name}.log 2>&1
done
