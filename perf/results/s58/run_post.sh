#!/bin/bash
# Paged klt with keys stored after RoPE (rope=post) at 2.6 bits, beside the pre-RoPE spec, three texts.
# usage: bash perf/results/s58/run_post.sh CORE NAME...
core=$1; shift
declare -A TEXT=([tech]=/usr/share/doc/dpkg/spec/triggers.txt [code]=/root/.pyenv/versions/3.12.1/lib/python3.12/argparse.py
                 [legal]=/usr/share/common-licenses/GPL-3 [pyenv]=/root/.pyenv/CHANGELOG.md)
declare -A CALIB=([tech]=code [code]=tech [legal]=code [pyenv]=legal)
for name in "$@"; do
  OMP_NUM_THREADS=1 taskset -c $core .venv/bin/kvbackend eval --text ${TEXT[$name]} --prefix 1536 \
    --codec "klt:kbits=2.85,vbits=2,vstep=1.15,axes=channels,paged=true,rope=post" \
    --codec "klt:kbits=2.85,vbits=2,vstep=1.15,axes=channels,paged=true" \
    --calibration ${TEXT[${CALIB[$name]}]} --json perf/results/s58/post_${name}.json \
    > perf/results/s58/post_${name}.log 2>&1
done
