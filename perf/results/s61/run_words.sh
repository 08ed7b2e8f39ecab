#!/bin/bash
# Paged klt, keys after RoPE at 2.6 bits, with and without whole-word key rows (words=true), one text per call.
# usage: bash perf/results/s61/run_words.sh CORE NAME...   (NAME: tech code legal pyenv)
core=$1; shift
declare -A TEXT=([tech]=/usr/share/doc/dpkg/spec/triggers.txt [code]=/root/.pyenv/versions/3.12.1/lib/python3.12/argparse.py
                 [legal]=/usr/share/common-licenses/GPL-3 [pyenv]=/root/.pyenv/CHANGELOG.md)
declare -A CALIB=([tech]=code [code]=tech [legal]=code [pyenv]=legal)
for name in "$@"; do
  OMP_NUM_THREADS=1 taskset -c $core .venv/bin/kvbackend eval --text ${TEXT[$name]} --prefix 1536 \
    --codec "klt:kbits=2.85,vbits=2,vstep=1.15,axes=channels,paged=true,rope=post,words=true" \
    --codec "klt:kbits=2.8,vbits=2,vstep=1.15,axes=channels,paged=true,rope=post,words=true" \
    --codec "klt:kbits=2.85,vbits=2,vstep=1.15,axes=channels,paged=true,rope=post" \
    --calibration ${TEXT[${CALIB[$name]}]} --json perf/results/s61/words_${name}.json \
    > perf/results/s61/words_${name}.log 2>&1
done
