"""mfpipe.workflow.scheduling: one pending wake-up of Snakemake's scheduler at a time (the workflow applies it when it loads)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from mfpipe.workflow.scheduling import one_pending_wakeup

SRC = Path(__file__).resolve().parents[1] / "src"


def scheduler_class():
    class Scheduler:
        def __init__(self):
            self.started = []

        def _schedule_reevalutation(self, delay):
            self.started.append(delay)

    return Scheduler


def test_a_wakeup_is_dropped_only_where_one_no_later_is_pending():
    cls = scheduler_class()
    assert one_pending_wakeup(cls) and one_pending_wakeup(cls)  # idempotent: wrapped once
    s = cls()
    for _ in range(50):
        s._schedule_reevalutation(0.3)
    s._schedule_reevalutation(5)  # later than the pending one, which wakes the scheduler first
    assert s.started == [0.3]
    s._schedule_reevalutation(0.01)  # earlier than the pending one: started
    assert s.started == [0.3, 0.01]
    other = cls()  # each scheduler its own
    other._schedule_reevalutation(0.3)
    assert other.started == [0.3]
    time.sleep(0.35)  # both of s's are due: the next request starts one
    s._schedule_reevalutation(0.3)
    assert s.started == [0.3, 0.01, 0.3]


def test_a_class_without_the_method_is_left_alone():
    class Other:
        pass

    assert not one_pending_wakeup(Other) and not hasattr(Other, "_schedule_reevalutation")


def test_snakemake_runs_one_round_per_finished_job_and_waiting_second(tmp_path):
    """With the installed Snakemake: ten jobs on one core, the other nine waiting. Its rate limiter's wake-ups had
    every finished job start a chain of rounds, one a second (25 rounds for these ten jobs); with one wake-up
    pending, a round per finished job and at most one per second of the run is left."""
    (tmp_path / "Snakefile").write_text(
        f"import sys\nsys.path.insert(0, {str(SRC)!r})\nfrom mfpipe.workflow.scheduling import one_pending_wakeup\n"
        "assert one_pending_wakeup()\n"
        "rule all:\n    input: expand('o{i}.txt', i=range(10))\n"
        "rule a:\n    output: 'o{i}.txt'\n    shell: 'sleep 0.4; echo {wildcards.i} > {output}'\n")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "snakemake", "--cores", "1", "--verbose"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    wall = time.monotonic() - t0
    assert out.returncode == 0, out.stderr[-3000:]
    rounds = (out.stdout + out.stderr).count("Ready jobs")
    assert 10 <= rounds <= 10 + 2 + wall, (rounds, wall)
