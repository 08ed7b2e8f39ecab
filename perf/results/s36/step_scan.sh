#!/usr/bin/env bash
# usage: step_scan.sh CORE FACTOR NAME JOB... : `kvbackend eval` of perf/results/s34/NAME.spec with every clipped step
# (quant.GAUSSIAN_STEP) multiplied by FACTOR, jobs TEXT:N or TEXT:NsM as in perf/results/s30/run_specs.sh, seeds 0-2;
# JSON into perf/results/s36/NAME_f<FACTOR>_<text>_<N>.json. An experiment: the factor is patched in, not a spec option.
core=$1; f=$2; name=$3; shift 3
declare -A T=([code]=/root/.pyenv/versions/3.12.1/lib/python3.12/argparse.py [tech]=/usr/share/doc/dpkg/spec/triggers.txt
              [pyenv]=/root/.pyenv/CHANGELOG.md [legal]=/usr/share/common-licenses/GPL-3)
for job in "$@"; do
  text=${job%%:*}; n=${job##*:}; prefix=${n%%s*}; skip=0; [ "$n" != "$prefix" ] && skip=${n##*s}
  out=perf/results/s36/${name}_f${f}_${text}_${n}.json
  [ -e "$out" ] && continue
  OMP_NUM_THREADS=1 taskset -c "$core" .venv/bin/python -P -c "
import sys
import kvbackend.quant as q
for levels in q.GAUSSIAN_STEP:
    q.GAUSSIAN_STEP[levels] *= $f
from kvbackend.tools.cli import main
sys.argv = ['kvbackend'] + sys.argv[1:]
main()" eval --text "${T[$text]}" --prefix "$prefix" --skip "$skip" --seeds 3 \
    --codec "$(cat perf/results/s34/$name.spec)" --json "$out" > /dev/null 2>&1 || echo "FAILED $out"
  echo "$(date -u +%T) $out"
done
