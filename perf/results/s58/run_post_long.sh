#!/bin/bash
# The paged klt spec with keys after RoPE (rope=post) at a 6144-token prefix and at 1536 with the same continuation.
# usage: bash perf/results/s58/run_post_long.sh CORE NAME...
core=$1; shift
declare -A TEXT=([tech]=/usr/share/doc/dpkg/spec/triggers.txt [code]=/root/.pyenv/versions/3.12.1/lib/python3.12/argparse.py
                 [legal]=/usr/share/common-licenses/GPL-3 [pyenv]=/root/.pyenv/CHANGELOG.md)
declare -A CALIB=([tech]=code [code]=tech [legal]=code [pyenv]=legal)
for name in "$@"; do
  for run in "6144 0" "1536 4608"; do
    set -- $run
    OMP_NUM_THREADS=1 taskset -c $core .venv/bin/kvbackend eval --text ${TEXT[$name]} --prefix $1 --skip $2 \
      --codec "klt:kbits=2.85,vbits=2,vstep=1.15,axes=channels,paged=true,rope=post" \
      --calibration ${TEXT[${CALIB[$name]}]} --json perf/results/s58/post_long_${name}_$1s$2.json \
      > perf/results/s58/post_long_${name}_$1s$2.log 2>&1
  done
done
