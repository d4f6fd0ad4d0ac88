import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/tiny_models.py and friends

# Never reach for the hub from a test.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: intra-op threads only add sync overhead (and stall badly on a loaded machine)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# The two files that run the workflow end to end (test_workflow.py: the ci DAG, its SLURM run; test_presets.py:
# every preset) take most of the suite's time, one pytest-xdist worker each. Collected first (and sent out in
# collection order, pyproject's --no-loadscope-reorder), they start side by side; the short files fill the gaps.
LONGEST_FIRST = ("test_workflow.py", "test_presets.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).name, len(rank)))  # stable: in-file order kept
