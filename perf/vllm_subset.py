"""The pure-Python files of vLLM's offloading interface that kvbackend's vLLM tier, its tests and
`perf/bench_vllm_gpu.py` import (the tiering factory and base classes, the logger and what they pull in), copied from an installed vLLM into FOLDER, for a machine without vLLM (the GPU machine):
``PYTHONPATH=FOLDER`` makes `tests/test_vllm.py` and the benchmark run there against vLLM's own classes.

    .venv/bin/python perf/vllm_subset.py .vllm_min

The set of files is found by running: start from vLLM's package marker alone, import the entry points and run the
tests, and copy each module the run reports missing, until both succeed.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys

# (vLLM's own file-system tier is not among them: its imports reach the engine's entry points and their
# third-party packages, which this subset cannot carry)
ENTRY_POINTS = ("vllm.v1.kv_offload.tiering.factory", "vllm.v1.kv_offload.config", "kvbackend.integration.vllm",
                "vllm.v1.kv_offload.tiering.fs.manager")
MISSING = re.compile(r"No module named '(vllm[\w.]*)'")
SUBMODULE = re.compile(r"cannot import name '(\w+)' from '(vllm[\w.]*)'")


def copy_module(source: str, out: str, module: str) -> None:
    """Copy ``module`` (a file or a package's __init__) and create its parent packages (empty __init__ files;
    the real ones may import the whole engine)."""
    parts = module.split(".")
    for i in range(2, len(parts)):
        folder = os.path.join(out, *parts[:i])
        os.makedirs(folder, exist_ok=True)
        init = os.path.join(folder, "__init__.py")
        if not os.path.exists(init):
            open(init, "w").close()
    real = os.path.join(source, *parts[1:])
    if os.path.isdir(real):  # a package: an empty __init__ first (the real one may import the whole engine)
        os.makedirs(os.path.join(out, *parts), exist_ok=True)
        init = os.path.join(out, *parts, "__init__.py")
        if not os.path.exists(init):
            open(init, "w").close()
        else:  # asked for again: a name its own __init__ defines
            shutil.copy(os.path.join(real, "__init__.py"), init)
    else:
        shutil.copy(real + ".py", os.path.join(out, *parts[:-1], parts[-1] + ".py"))


def main(out: str) -> None:
    source = os.path.dirname(importlib.util.find_spec("vllm").origin)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(os.path.join(out, "vllm"))
    open(os.path.join(out, "vllm", "__init__.py"), "w").close()
    env = dict(os.environ, PYTHONPATH=os.path.abspath(out))
    checks = ([sys.executable, "-c", "".join(f"import {m}\n" for m in ENTRY_POINTS)],
              [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "tests/test_vllm.py"])
    for _ in range(500):
        for check in checks:
            run = subprocess.run(check, capture_output=True, text=True, env=env)
            if run.returncode:
                break
        else:
            files = sum(len(f) for _, _, f in os.walk(out))
            print(f"{out}: {files} files; the entry points import and tests/test_vllm.py passes")
            return
        text = run.stdout + run.stderr
        found = MISSING.search(text)
        name = SUBMODULE.search(text)
        if found is None and name is not None:  # a submodule imported by name from its package
            module = f"{name.group(2)}.{name.group(1)}"
            real = os.path.join(source, *module.split(".")[1:])
            if os.path.isdir(real) or os.path.exists(real + ".py"):
                copy_module(source, out, module)
                continue
            package = os.path.join(out, *name.group(2).split("."), "__init__.py")
            if os.path.exists(package) and not os.path.getsize(package):  # a name the package's __init__ defines
                copy_module(source, out, name.group(2))
                continue
        if found is None:
            sys.exit(f"a check failed for another reason than a missing vLLM module:\n{(run.stdout + run.stderr)[-3000:]}")
        copy_module(source, out, found.group(1))
    sys.exit("no fixed point after 500 modules")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".vllm_min")
