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
