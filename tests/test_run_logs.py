"""The test run's own logs (tests/conftest.py), which `make gpu-test` relies on when a device call's time limit cuts
pytest: failures written as they happen, every finished test in a done log, and a later run that completes the cut
one by leaving out what that log names as passed or skipped."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

CASES = '''
import pytest

def test_passes():
    assert True

def test_skips():
    pytest.skip("not here")

def test_fails():
    assert 1 == 2

@pytest.fixture
def breaks_after():
    yield
    raise RuntimeError("teardown")

def test_fails_in_teardown(breaks_after):
    assert True

@pytest.mark.parametrize("x", ["a b", "c"])
def test_param(x):
    assert x
'''


def _pytest(folder: Path, **env) -> str:
    # the outer run's own logs stay out of the inner runs: a `make gpu-test` run would count their cases as its own
    outer = {key: value for key, value in os.environ.items() if not key.startswith("KVBACKEND_")}
    done = subprocess.run([sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                           str(folder)], capture_output=True, text=True, cwd=folder,
                          env={**outer, **env}, timeout=300)
    return done.stdout + done.stderr


def test_a_cut_run_is_completed_from_its_done_log(tmp_path):
    folder = tmp_path / "suite"
    folder.mkdir()
    shutil.copy(Path(__file__).with_name("conftest.py"), folder / "conftest.py")
    (folder / "test_cases.py").write_text(CASES)
    done, failures = tmp_path / "done.txt", tmp_path / "failures.txt"
    out = _pytest(folder, KVBACKEND_DONE_LOG=str(done), KVBACKEND_FAILURE_LOG=str(failures))
    assert "1 failed, 4 passed, 1 skipped, 1 error" in out, out
    lines = sorted(line.rsplit(" ", 1)[0] for line in done.read_text().splitlines())
    assert lines == sorted(["passed test_cases.py::test_passes", "skipped test_cases.py::test_skips",
                            "failed test_cases.py::test_fails", "passed test_cases.py::test_param[a b]",
                            "passed test_cases.py::test_param[c]", "passed test_cases.py::test_fails_in_teardown",
                            "failed test_cases.py::test_fails_in_teardown"]), lines
    assert "FAILED test_cases.py::test_fails (call)" in failures.read_text()
    assert "FAILED test_cases.py::test_fails_in_teardown (teardown)" in failures.read_text()
    # completing that run from its own log: only the two tests that failed run again
    out = _pytest(folder, KVBACKEND_SKIP_DONE=str(done))
    assert "1 failed, 1 passed, 4 deselected, 1 error" in out, out
    # a run cut after two tests: the completing run leaves out what passed or was skipped, and runs the failed test
    # again with everything that never ran
    cut = tmp_path / "cut.txt"
    cut.write_text("passed test_cases.py::test_param[a b] 0.01\nskipped test_cases.py::test_skips 0.00\n"
                   "failed test_cases.py::test_fails 0.02\n")
    out = _pytest(folder, KVBACKEND_SKIP_DONE=str(cut))
    assert "1 failed, 3 passed, 2 deselected, 1 error" in out, out
