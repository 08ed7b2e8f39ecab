"""The project as users install it: a wheel built from the source tree holds every module.

As a test: build a wheel of a copy of the source tree and check that every ``.py`` file of
kvbackend/, kernels/, tiers/ and integration/ is in it under its package name.

As a script (``make wheel-check``): build the wheel, install it with ``pip install --no-deps
--target``, and import every module from a folder outside the repository, checking that each comes
from the installed wheel (not from the editable install of the working tree).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# source folder -> the package it installs as (pyproject's [tool.setuptools.package-dir])
FOLDERS = {"kvbackend": "kvbackend", "kernels": "kvbackend.kernels", "tiers": "kvbackend.tiers",
           "integration": "kvbackend.integration"}


def source_modules() -> dict[str, str]:
    """Every module of the source tree: path inside a wheel -> dotted module name."""
    found = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder)
            if "__pycache__" in rel.parts:
                continue
            parts = package.split(".") + list(rel.with_suffix("").parts)
            found["/".join(package.split(".") + list(rel.parts))] = ".".join(
                parts[:-1] if parts[-1] == "__init__" else parts)
    return found


def build_wheel(dest: Path) -> Path:
    """A wheel of a copy of the source tree (the working tree gets no build/ or egg-info), in ``dest``."""
    src = dest / "src"
    src.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for folder in FOLDERS:
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(dest / "dist"), str(src)], check=True, capture_output=True, text=True)
    (wheel,) = (dest / "dist").glob("kvbackend-*.whl")
    return wheel


def test_wheel_holds_every_module(tmp_path):
    wheel = zipfile.ZipFile(build_wheel(tmp_path))
    names = set(wheel.namelist())
    expected = source_modules()
    assert "kvbackend/alignpred/__init__.py" in expected and "kvbackend/kernels/__init__.py" in expected
    missing = sorted(path for path in expected if path not in names)
    assert not missing, f"modules missing from the wheel (pyproject's package list): {missing}"
    sources = sorted(f"kvbackend/kernels/{p.name}" for p in (ROOT / "kernels").glob("*.cu"))
    assert sources and not [s for s in sources if s not in names], "CUDA sources missing (pyproject's package-data)"
    entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "kvbackend = kvbackend.tools.cli:main" in wheel.read(entry).decode()  # the console script


_IMPORT_ALL = """
import importlib, os, sys
target, modules = sys.argv[1], sys.argv[2:]
# the editable install's finder would hand out the working tree's files for anything the wheel lacks
sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")
                    and "__editable__" not in getattr(f, "__name__", "")]
wrong = []
for name in modules:
    module = importlib.import_module(name)
    if not os.path.realpath(module.__file__).startswith(os.path.realpath(target) + os.sep):
        wrong.append(f"{name} from {module.__file__}")
if wrong:
    sys.exit("not imported from the installed wheel: " + "; ".join(wrong))
print(f"wheel-check: {len(modules)} modules imported from the installed wheel")
"""


def check_installed_wheel() -> None:
    """Build, install with ``--target`` and import every module from outside the repository."""
    with tempfile.TemporaryDirectory(prefix="kvbackend-wheel-") as tmp:
        tmp_path = Path(tmp)
        wheel = build_wheel(tmp_path)
        target = tmp_path / "site"
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                        str(wheel)], check=True)
        env = {**os.environ, "PYTHONPATH": str(target)}
        env.pop("PYTHONSAFEPATH", None)
        modules = sorted(set(source_modules().values()))
        subprocess.run([sys.executable, "-c", _IMPORT_ALL, str(target), *modules], check=True, cwd=tmp, env=env)


if __name__ == "__main__":
    try:
        check_installed_wheel()
    except subprocess.CalledProcessError as exc:  # the failing step printed its own error above
        sys.exit(f"wheel-check failed: {exc.cmd[:3]}... exited with {exc.returncode}\n{exc.stderr or ''}")
