#!/usr/bin/env bash
# The pure-Python files of SGLang's storage interface (environ, hicache_storage, the backend factory, the file
# backend's evictor, and the one helper it takes from sglang.srt.utils.common, cut out of that module), copied from
# an installed SGLang into FOLDER, for a machine without SGLang (the GPU machine): PYTHONPATH=FOLDER makes
# `tests/test_sglang.py` and `perf/bench_sglang_gpu.py` run there against SGLang's own classes.
#   bash perf/sglang_subset.sh .sglang_min [PYTHON]
set -eu
out=${1:?folder}
py=${2:-.venv/bin/python}
src=$("$py" -c "import os, importlib.util as u; print(os.path.dirname(u.find_spec('sglang').origin))")
rm -rf "$out"
mkdir -p "$out/sglang/srt/mem_cache/storage/file" "$out/sglang/srt/utils"
touch "$out/sglang/__init__.py" "$out/sglang/srt/__init__.py" "$out/sglang/srt/mem_cache/__init__.py" \
      "$out/sglang/srt/mem_cache/storage/__init__.py" "$out/sglang/srt/utils/__init__.py"
cp "$src/srt/mem_cache/storage/file/__init__.py" "$src/srt/mem_cache/storage/file/lru_file_evictor.py" \
   "$out/sglang/srt/mem_cache/storage/file/"
"$py" - "$src/srt/utils/common.py" "$out/sglang/srt/utils/common.py" <<'PY'
import ast, sys
text = open(sys.argv[1]).read()
node = next(n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == "human_readable_int")
open(sys.argv[2], "w").write("# cut from sglang/srt/utils/common.py\n" + ast.get_source_segment(text, node) + "\n")
PY
cp "$src/srt/environ.py" "$out/sglang/srt/"
cp "$src/srt/mem_cache/hicache_storage.py" "$out/sglang/srt/mem_cache/"
cp "$src/srt/mem_cache/storage/backend_factory.py" "$out/sglang/srt/mem_cache/storage/"
echo "$out: $("$py" -c "import importlib.metadata as m; print('sglang', m.version('sglang'))")"
