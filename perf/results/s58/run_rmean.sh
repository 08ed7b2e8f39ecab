#!/bin/bash
# The rotated-mean experiment (perf/experiments/chw_rotated_mean.py) on three texts, 1536 and the long-context pair.
# usage: bash perf/results/s58/run_rmean.sh CORE
core=$1
declare -A TEXT=([tech]=/usr/share/doc/dpkg/spec/triggers.txt [code]=/root/.pyenv/versions/3.12.1/lib/python3.12/argparse.py
                 [legal]=/usr/share/common-licenses/GPL-3)
declare -A CALIB=([tech]=code [code]=tech [legal]=code)
run() {  # name prefix skip
  OMP_NUM_THREADS=1 taskset -c $core .venv/bin/python -P perf/experiments/chw_rotated_mean.py ${TEXT[$1]} \
    ${TEXT[${CALIB[$1]}]} $2 $3 > perf/results/s58/rmean_$1_$2s$3.json 2> perf/results/s58/rmean_$1_$2s$3.log
}
for name in tech legal code; do run $name 1536 0; done
for name in tech legal code; do run $name 1536 4608; run $name 6144 0; done
