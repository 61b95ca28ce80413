import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/variants.py and friends


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models decode ~100x faster on one thread than on two busy shared cores. A test module
    opts in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
