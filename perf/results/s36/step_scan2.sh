#!/usr/bin/env bash
# usage: step_scan2.sh CORE KF VF NAME JOB... : as step_scan.sh, with the clipped steps of keys (channel groups)
# multiplied by KF and of values (token groups) by VF; JSON into perf/results/s36/NAME_k<KF>v<VF>_<text>_<N>.json.
core=$1; kf=$2; vf=$3; name=$4; shift 4
declare -A T=([code]=/root/.pyenv/versions/3.12.1/lib/python3.12/argparse.py [tech]=/usr/share/doc/dpkg/spec/triggers.txt
              [pyenv]=/root/.pyenv/CHANGELOG.md [legal]=/usr/share/common-licenses/GPL-3)
for job in "$@"; do
  text=${job%%:*}; n=${job##*:}; prefix=${n%%s*}; skip=0; [ "$n" != "$prefix" ] && skip=${n##*s}
  out=perf/results/s36/${name}_k${kf}v${vf}_${text}_${n}.json
  [ -e "$out" ] && continue
  OMP_NUM_THREADS=1 taskset -c "$core" .venv/bin/python -P -c "
import sys
import kvbackend.quant as q
import kvbackend.codecs.groups as g
BASE = dict(q.GAUSSIAN_STEP)
def scaled(fn, f):
    def run(*a, **k):
        for levels in BASE:
            q.GAUSSIAN_STEP[levels] = BASE[levels] * f
        try:
            return fn(*a, **k)
        finally:
            q.GAUSSIAN_STEP.update(BASE)
    return run
g.encode_channel_groups = scaled(g.encode_channel_groups, $kf)
g.encode_token_groups = scaled(g.encode_token_groups, $vf)
import kvbackend.codecs.qvg as qvg
qvg.encode_channel_groups = g.encode_channel_groups
qvg.encode_token_groups = g.encode_token_groups
from kvbackend.tools.cli import main
sys.argv = ['kvbackend'] + sys.argv[1:]
main()" eval --text "${T[$text]}" --prefix "$prefix" --skip "$skip" --seeds 3 \
    --codec "$(cat ${SPECDIR:-perf/results/s34}/$name.spec)" --json "$out" > /tmp/scan2_${kf}_${vf}.err 2>&1 || echo "FAILED $out"
  echo "$(date -u +%T) $out"
done
