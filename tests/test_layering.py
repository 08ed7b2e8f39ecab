"""The core imports nothing from kvbackend.tools or kvbackend.integration.

The core is kvbackend/*.py (not tools/), kvbackend/codecs/, kvbackend/alignpred/, kernels/ (installed
as kvbackend.kernels) and tiers/ (kvbackend.tiers). Every module is parsed with ``ast`` (nothing is
imported) and every import in it, at module level or inside a function, is resolved to absolute
names, relative forms included; so are ``importlib.import_module`` / ``__import__`` calls with a
literal name. Tools and integration sit on top and may import anything.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = ("kvbackend.tools", "kvbackend.integration")
# source folder -> the package it installs as (pyproject's [tool.setuptools.package-dir]), and whether
# its subfolders are searched too
CORE = [("kvbackend", "kvbackend", False), ("kvbackend/codecs", "kvbackend.codecs", True),
        ("kvbackend/alignpred", "kvbackend.alignpred", True), ("kernels", "kvbackend.kernels", True),
        ("tiers", "kvbackend.tiers", True)]


def core_modules() -> dict[Path, str]:
    """Every core source file -> the dotted package its module lives in (for relative imports)."""
    found = {}
    for folder, package, recursive in CORE:
        base = ROOT / folder
        for path in sorted(base.rglob("*.py") if recursive else base.glob("*.py")):
            rel = path.relative_to(base)
            found[path] = ".".join([package, *rel.parent.parts]) if rel.parent.parts else package
    return found


def imported_names(source: str, package: str) -> list[tuple[int, str]]:
    """(line, absolute dotted name) of everything ``source`` (a module of ``package``) imports."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                if node.level - 1 >= len(parts):
                    raise ValueError(f"line {node.lineno}: relative import beyond the top package {package!r}")
                base = ".".join(parts[:len(parts) - (node.level - 1)])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            names.append((node.lineno, module))
            # `from kvbackend import tools` imports kvbackend.tools too
            names += [(node.lineno, f"{module}.{alias.name}") for alias in node.names if alias.name != "*"]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__"):
                names.append((node.lineno, node.args[0].value))
    return names


def forbidden_imports(source: str, package: str) -> list[str]:
    """The imports of ``source`` that reach kvbackend.tools or kvbackend.integration."""
    return [f"line {line}: {name}" for line, name in imported_names(source, package)
            if any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN)]


@pytest.mark.parametrize("source", [
    "import kvbackend.tools.cli",
    "from kvbackend.tools.auto import cache_specs",
    "from kvbackend import tools",
    "from kvbackend import integration as i",
    "import kvbackend.integration.transformers as t",
    "from .tools import auto",
    "from . import integration",
    "from .tools.reconstruct import reconstruct_sequence",
    "def f():\n    from .integration.transformers import KVBackendCache\n",
    "class C:\n    def m(self):\n        import kvbackend.tools\n",
    "import importlib\nimportlib.import_module('kvbackend.tools.models')",
])
def test_checker_finds_every_form(source):
    assert forbidden_imports(source, "kvbackend"), source


@pytest.mark.parametrize("source, package", [
    ("from ..tools import auto", "kvbackend.codecs"),
    ("from ..integration import sglang", "kvbackend.tiers"),
    ("def f():\n    from ...tools.cli import main\n", "kvbackend.alignpred.sub"),
])
def test_checker_resolves_relative_imports_of_subpackages(source, package):
    assert forbidden_imports(source, package), source


@pytest.mark.parametrize("source, package", [
    ("from kvbackend.tooling import x\nimport kvbackend.integrations", "kvbackend"),  # other names, same prefix
    ("from .errors import SpecError\nfrom . import codecs", "kvbackend"),
    ("from ..geometry import Geometry\nfrom ..backends import get", "kvbackend.kernels"),
    ("from .tools import x", "kvbackend.codecs"),  # kvbackend.codecs.tools, not kvbackend.tools
])
def test_checker_allows_the_core(source, package):
    assert not forbidden_imports(source, package), source


def test_core_modules_are_found():
    modules = core_modules()
    paths = {path.relative_to(ROOT).as_posix() for path in modules}
    assert {"kvbackend/manager.py", "kvbackend/codecs/__init__.py", "kvbackend/alignpred/__init__.py",
            "kernels/__init__.py", "tiers/__init__.py"} <= paths
    assert not any(p.startswith(("kvbackend/tools/", "integration/")) for p in paths)
    assert modules[ROOT / "kvbackend" / "codecs" / "__init__.py"] == "kvbackend.codecs"
    assert modules[ROOT / "kernels" / "__init__.py"] == "kvbackend.kernels"


def test_core_imports_neither_tools_nor_integration():
    bad = {}
    for path, package in core_modules().items():
        found = forbidden_imports(path.read_text(encoding="utf-8"), package)
        if found:
            bad[path.relative_to(ROOT).as_posix()] = found
    assert not bad, f"the core must not import kvbackend.tools or kvbackend.integration: {bad}"
