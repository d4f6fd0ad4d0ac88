import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/tiny_models.py and friends
# The helpers that test files share (tests/<name>.py, no test_ prefix: not collected) whose code lived in test modules
# until issue 47 (no test file imports another): pytest rewrites their asserts as it did there (a failing one shows
# its operands).
pytest.register_assert_rewrite("example_notebook", "meanfield_reference", "pattern_adapter", "rollout_reference",
                               "stats_reference", "workflow_runs")

# Never reach for the hub from a test.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    """In a pytest-xdist worker, torch's intra-op threads times the workers stay within the cores: two workers on two
    cores each with torch's default of two threads spun against each other (OpenMP waits actively), and the files
    that run models in the worker took ~20 % longer. A test that needs threads sets them itself (the helper-thread and
    two-thread tests force their split); `pytest -n 0` keeps torch's default."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))


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
# The third, test_moe_workflow.py (local models through the ci DAG; on demand since stop 79, skipped in the default
# run), goes out next, queued behind the first: left at its place in the alphabet, a run of it beside the suite could
# go out mid-run, after most short files, and end the suite alone.
LONGEST_FIRST = ("test_workflow.py", "test_presets.py", "test_moe_workflow.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).name, len(rank)))  # stable: in-file order kept
