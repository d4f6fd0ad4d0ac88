"""mfpipe.workflow.scheduling: one pending wake-up of Snakemake's scheduler at a time (the workflow applies it when it loads)."""

from __future__ import annotations

import json
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


# The Snakefile of the end-to-end test: the scheduler's wake-up method is wrapped twice around the workaround, so
# that each wake-up the scheduler asks for is recorded before the workaround sees it ("request", the time taken
# first) and each one the workaround lets through after ("start", the time taken last); written out when the run ends.
RECORDING_SNAKEFILE = """import json, sys, time
sys.path.insert(0, {src!r})
from snakemake.scheduling.job_scheduler import JobScheduler
from mfpipe.workflow.scheduling import one_pending_wakeup
EVENTS = []
timer = JobScheduler._schedule_reevalutation
def start(self, delay):
    EVENTS.append(("start", time.monotonic(), float(delay)))
    return timer(self, delay)
JobScheduler._schedule_reevalutation = start
assert one_pending_wakeup()
workaround = JobScheduler._schedule_reevalutation
def request(self, delay):
    EVENTS.append(("request", time.monotonic(), float(delay)))
    return workaround(self, delay)
JobScheduler._schedule_reevalutation = request
onsuccess:
    open("events.json", "w").write(json.dumps(EVENTS))
rule all:
    input: expand("o{{i}}.txt", i=range(10))
rule a:
    output: "o{{i}}.txt"
    shell: "sleep 0.4; echo {{wildcards.i}} > {{output}}"
"""


def overlapping_wakeups(events) -> list[tuple[int, int]]:
    """The pairs (i, j) of started wake-ups where j started before i was due. i's deadline is taken from the time of
    its request (no later than the workaround's clock reading), j's start from after the workaround let it through
    (no earlier): the workaround keeps every pair apart, whatever the machine's load."""
    starts, last_request = [], None
    for kind, t, delay in events:
        if kind == "request":
            last_request = (t, delay)
        else:
            starts.append((last_request[0] + last_request[1], t))
    return [(i, j) for i in range(len(starts)) for j in range(i + 1, len(starts)) if starts[j][1] < starts[i][0]]


def test_snakemake_keeps_one_wakeup_pending_and_a_round_per_job_or_wakeup(tmp_path):
    """With the installed Snakemake: ten jobs on one core, the other nine waiting, the rate limiter's timespan 1 s.
    Its wake-ups had every finished job start a chain of rounds, one a second (25 rounds for these ten jobs, a job
    finishing every 0.4 s, so a wake-up started while another was pending). The bounds are counts, not times (a
    loaded machine stretches the run, not them): no wake-up starts while another is pending, and every round is the
    first, one per finished job, or one per started wake-up."""
    (tmp_path / "Snakefile").write_text(RECORDING_SNAKEFILE.format(src=str(SRC)))
    out = subprocess.run([sys.executable, "-m", "snakemake", "--cores", "1", "--verbose",
                          "--max-jobs-per-timespan", "100/1s"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rounds = (out.stdout + out.stderr).count("Ready jobs")
    events = json.loads((tmp_path / "events.json").read_text())
    requested = sum(kind == "request" for kind, _, _ in events)
    started = len(events) - requested
    # the scenario exercised the workaround: wake-ups asked for while one was pending, and some let through
    assert started >= 2 and requested > started, (requested, started)
    assert overlapping_wakeups(events) == [], events
    assert 10 <= rounds <= 10 + 1 + started, (rounds, started)
