import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/variants.py and friends
# tests/ mirrors the source rooms (tests/runs/, tests/training/, ...); a test may import another room's test module
# (`from test_checkpoint import tiny_model`), whichever folder pytest collects first, and when run alone
for _room in sorted(p for p in Path(__file__).parent.iterdir() if p.is_dir() and any(p.glob("test_*.py"))):
    sys.path.insert(1, str(_room))


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models decode ~100x faster on one thread than on two busy shared cores. A test module
    opts in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
