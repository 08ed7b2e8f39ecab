#!/bin/bash
# klt:...,axes=channels,paged=true through the paged cache (chw: page codecs), 1536 + 512, bases from another text.
# usage: bash perf/results/s56/run_paged.sh CORE PREFIX NAME...   (NAME: tech code legal pyenv)
core=$1; prefix=$2; shift 2
declare -A TEXT=([tech]=/usr/share/doc/dpkg/spec/triggers.txt [code]=/root/.pyenv/versions/3.12.1/lib/python3.12/argparse.py
                 [legal]=/usr/share/common-licenses/GPL-3 [pyenv]=/root/.pyenv/CHANGELOG.md)
declare -A CALIB=([tech]=code [code]=tech [legal]=code [pyenv]=legal)
for name in "$@"; do
  OMP_NUM_THREADS=1 taskset -c $core .venv/bin/kvbackend eval --text ${TEXT[$name]} --prefix $prefix \
    --codec "klt:kbits=2.85,vbits=2,vstep=1.15,axes=channels,paged=true" \
    --codec "klt:kbits=3.5,axes=channels,paged=true" \
    --codec "klt:kbits=3.75,axes=channels,paged=true" \
    --calibration ${TEXT[${CALIB[$name]}]} --json perf/results/s56/paged_${name}_${prefix}.json \
    > perf/results/s56/paged_${name}_${prefix}.log 2>&1
done
