"""One scheduler wake-up pending at a time: a workaround for Snakemake's job-rate limiter (8.x and 9.x).

Snakemake limits how many jobs it starts per timespan (``--max-jobs-per-timespan``, default ``100/1s``). Every
scheduling round that ends with a ready job still waiting (all cores busy) starts a ``threading.Timer`` that wakes
the scheduler once the timespan is over (``JobScheduler._schedule_reevalutation``), and every finished job starts a
round. A round woken by such a timer starts another one, so each finished job leaves behind a chain of wake-ups,
one a second, for as long as jobs wait: with two cores and a wide DAG the chains add up to thousands of rounds,
each checking the sizes of every ready job's inputs (a job's code inputs included) and starting a thread: CPU
taken from the jobs (measured: benchmarks/HISTORY.md, "The scheduler's wake-ups"); upstream: snakemake/snakemake#3744.

:func:`one_pending_wakeup` wraps that method so that a request is dropped when a wake-up no later than the one it
asks for is already pending: the scheduler is still woken when the earliest request falls due, and from then on
each round asks again as before, so what runs and when the limiter lets it start do not change; only the redundant
rounds are gone. The workflow applies it when it loads (workflow/rules/common.smk); where the method is missing
(another Snakemake), nothing is changed.
"""

from __future__ import annotations

import functools
import threading
import time

_MARK = "__mfpipe_one_pending_wakeup__"


def one_pending_wakeup(scheduler_class=None) -> bool:
    """Wrap ``scheduler_class._schedule_reevalutation`` (default: Snakemake's ``JobScheduler``) so that at most one
    wake-up is pending at a time for each deadline not yet covered. Idempotent; False where the class has no such
    method (nothing changed)."""
    if scheduler_class is None:
        try:
            from snakemake.scheduling.job_scheduler import JobScheduler as scheduler_class
        except ImportError:
            return False
    original = getattr(scheduler_class, "_schedule_reevalutation", None)
    if original is None or not callable(original):
        return False
    if getattr(original, _MARK, False):
        return True
    lock = threading.Lock()

    @functools.wraps(original)
    def schedule_reevaluation(self, delay, *args, **kwargs):
        now = time.monotonic()
        with lock:
            # the deadlines of the wake-ups this scheduler has pending (those past are done or about to fire)
            pending = [d for d in self.__dict__.get(_MARK, ()) if d > now]
            if any(d <= now + delay for d in pending):
                self.__dict__[_MARK] = pending
                return None
            self.__dict__[_MARK] = pending + [now + delay]
        return original(self, delay, *args, **kwargs)

    setattr(schedule_reevaluation, _MARK, True)
    scheduler_class._schedule_reevalutation = schedule_reevaluation
    return True
