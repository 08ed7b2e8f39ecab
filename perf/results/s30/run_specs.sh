#!/usr/bin/env bash
# usage: run_specs.sh CORE NAME... : every spec $DIR/NAME.spec on code (1536, 6144), technical and pyenv's
# CHANGELOG (1536), three seeds each, one core; JSON into $DIR/NAME_<text>_<prefix>.json (DIR: perf/results/s30 unless
# set). A job TEXT:NsM caches N tokens after skipping the text's first M (`--skip M`): TEXT:1536s4608 scores the
# continuation TEXT:6144 scores.
core=$1; shift
dir=${DIR:-perf/results/s30}
declare -A T=([code]=/root/.pyenv/versions/3.12.1/lib/python3.12/argparse.py [tech]=/usr/share/doc/dpkg/spec/triggers.txt
              [pyenv]=/root/.pyenv/CHANGELOG.md [legal]=/usr/share/common-licenses/GPL-3
              [gfdl]=/usr/share/common-licenses/GFDL-1.3 [subprocess]=/root/.pyenv/versions/3.12.1/lib/python3.12/subprocess.py
              [subtree]=/usr/share/doc/git/contrib/subtree/git-subtree.txt [idlenews]=/root/.pyenv/versions/3.12.1/lib/python3.12/idlelib/NEWS.txt)
for name in "$@"; do
  for job in ${JOBS:-code:1536 code:6144 tech:1536 pyenv:1536}; do
    text=${job%%:*}; n=${job##*:}; prefix=${n%%s*}; skip=0; [ "$n" != "$prefix" ] && skip=${n##*s}
    out=$dir/${name}_${text}_${n}.json
    [ -e "$out" ] && continue
    OMP_NUM_THREADS=1 taskset -c "$core" .venv/bin/kvbackend eval --text "${T[$text]}" --prefix "$prefix" --skip "$skip" --seeds 3 \
      --codec "$(cat $dir/$name.spec)" --json "$out" > /dev/null 2>&1 || echo "FAILED $out"
    echo "$(date -u +%T) $out"
  done
done
