"""How a rule's job runs: the workflow's one job script (workflow/scripts/job.py) calls :func:`run_job`, which finds
the rule's job function (``<package>.jobs.<rule>``, named by the rule's first code input), hands it the
:class:`Job` (the rule's input, output, params, threads and the job's logger), and reports a failure where users
look. Also what many jobs need first: the (model, revision) a rule names, loaded with its adapter."""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
import traceback
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable

# Where a job records the mfpipe modules it has loaded, when the variable is set (tests/test_workflow.py checks
# them against the rule's declared code inputs: a lazy import the static analysis missed would show up there).
LOADED_MODULES_ENV = "MFPIPE_LOADED_MODULES"

# The prefix of the one line that states a failed job's cause; the workflow's `onerror` handler finds it in the
# rule logs and repeats it as the last console output (workflow/rules/common.smk).
CAUSE_PREFIX = "mfpipe error: "


def load_job_model(params: Any, threads: int | None = None, stream: bool | str = False):
    """(model, adapter) for a rule whose params carry ``model_spec``, ``revision``, ``commit`` (a hub revision's
    resolved commit, or None), ``dtype``, ``device`` and ``results`` (see ``model_params()`` in
    workflow/rules/common.smk); ``stream``: the config's ``runtime.stream_weights`` (not a param: it changes no
    result), whether the blocks' weights are streamed from their files (:mod:`mfpipe.models.streamed`)."""
    import torch

    from mfpipe.models.adapters import get_adapter
    from mfpipe.models.loader import load_model

    from mfpipe.workflow.numerics import pin_torch

    pin_torch(threads or None)
    model = load_model(dict(params.model_spec), params.revision, dtype=params.dtype, device=params.device,
                       results_dir=params.results, commit=getattr(params, "commit", None), stream=stream)
    return model, get_adapter(model)


def stream_setting(config: dict | None) -> bool | str:
    """``runtime.stream_weights`` of a workflow config (auto where it says nothing)."""
    return ((config or {}).get("runtime") or {}).get("stream_weights", "auto")


def failed_job_causes(log_dir: str | Path, since: float) -> list[str]:
    """The one-line causes (``CAUSE_PREFIX …``) in the rule logs under ``log_dir`` written since ``since`` (epoch
    seconds), oldest first: what the workflow repeats as the last console lines of a failed run."""
    found = []
    for path in Path(log_dir).rglob("*.log"):
        try:
            st = path.stat()
            if st.st_mtime < since:
                continue
            with open(path, errors="replace") as fh:
                for line in fh:
                    if line.startswith(CAUSE_PREFIX):
                        found.append((st.st_mtime, line.rstrip("\n")))
                        break
        except OSError:
            continue
    return [line for _, line in sorted(found)]


def one_line_cause(exc: BaseException) -> str:
    """The exception as one line: its type and message (messages of mfpipe's errors already carry the advice)."""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def loaded_mfpipe_files() -> list[str]:
    """The files of every mfpipe module this process has loaded (resolved paths, sorted)."""
    out = set()
    for name, mod in list(sys.modules.items()):
        if (name == "mfpipe" or name.startswith("mfpipe.")) and getattr(mod, "__file__", None):
            out.add(str(Path(mod.__file__).resolve()))
    return sorted(out)


def record_loaded_modules() -> None:
    """With ``MFPIPE_LOADED_MODULES`` set to a folder, write there which mfpipe files this job loaded (one JSON file
    per job: its rule and the files). Called once the job's work is done, so lazy imports are in."""
    folder = os.environ.get(LOADED_MODULES_ENV)
    if not folder:
        return
    sm = getattr(sys.modules.get("__main__"), "snakemake", None)
    rule = getattr(sm, "rule", None) or Path(sys.argv[0]).stem
    Path(folder).mkdir(parents=True, exist_ok=True)
    record = {"rule": rule, "pid": os.getpid(), "files": loaded_mfpipe_files()}
    (Path(folder) / f"{rule}-{os.getpid()}.json").write_text(json.dumps(record))


def run_logged(main: Callable[[], None], log: logging.Logger) -> None:
    """Run a job's ``main``. On failure the rule's log gets the one-line cause and, below it, the traceback;
    stderr gets only the cause, as its last line (a traceback there buries the advice under screens of frames).
    The job then exits non-zero, so Snakemake marks it failed and removes its outputs.

    The job script's imports ran with the cyclic garbage collector off (workflow/scripts/_mfpipe_checkout.py): what
    they made lives for the whole job, so it is frozen (the collector never scans it again) and the collector
    turned back on for the work."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()
    try:
        main()
        record_loaded_modules()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:
        cause = CAUSE_PREFIX + one_line_cause(e)
        tb = traceback.format_exc()
        files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
        for h in files:
            h.acquire()
            try:
                h.stream.write(f"{cause}\n{tb}")
                h.flush()
            finally:
                h.release()
        if not files:  # no log file to hold it: the traceback must not be lost
            sys.stderr.write(tb)
        sys.stderr.flush()
        sys.stderr.write(cause + "\n")
        sys.stderr.flush()
        raise SystemExit(1) from None


@dataclass
class Job:
    """What a job function gets: the rule's Snakemake object (``input``, ``output``, ``params``, ``wildcards``,
    ``threads``, ``resources``, ``rule``) and the job's logger (writing to the rule's ``log:``)."""

    sm: Any
    log: logging.Logger

    @property
    def input(self):
        return self.sm.input

    @property
    def output(self):
        return self.sm.output

    @property
    def params(self):
        return self.sm.params

    @property
    def wildcards(self):
        return self.sm.wildcards

    @property
    def threads(self) -> int:
        return int(self.sm.threads)

    @property
    def rule(self) -> str:
        return str(self.sm.rule)

    @property
    def config(self) -> dict:
        """The workflow's config, for options that change no result (so they are no params: switching one reruns
        nothing), e.g. stats.kernel_sums."""
        return dict(getattr(self.sm, "config", None) or {})

    def model(self, threads: int | None = None, streams: bool = True):
        """(model, adapter) of the rule's (model, revision) (:func:`load_job_model`) with the job's threads, its
        blocks' weights streamed where ``runtime.stream_weights`` says so and the job ``streams`` (a job that cannot
        stream loads them whole, refused where they do not fit)."""
        stream = stream_setting(self.config)
        stream = stream if streams or stream is False else "never"  # whole, refused where it cannot fit
        return load_job_model(self.params, self.threads if threads is None else threads, stream=stream)


def job_module(code_file: str | Path) -> str:
    """The dotted name of the jobs module whose file is ``code_file`` (a rule's first code input)."""
    src = Path(__file__).resolve().parents[2]
    rel = Path(code_file).resolve().relative_to(src).with_suffix("")
    return ".".join(rel.parts)


def run_job(sm: Any) -> None:
    """Run the job of Snakemake object ``sm``: function ``sm.rule`` (or ``params.job_function``) of the jobs module
    that is the rule's first code input (``code=job(...)`` in workflow/rules/common.smk, from mfpipe.workflow.codedeps.job_dependencies, which
    declares that module and what the function imports), under :func:`run_logged`."""
    from mfpipe.workflow.logs import setup_logging
    from mfpipe.workflow.numerics import pin_env

    pin_env()  # before the job's imports: the workflow started the job with it already; a job run by hand too
    log = setup_logging(sm.log[0])
    module = job_module(sm.input.code[0])
    # the rule's name, or params.job_function for rules made in a loop that share one function
    name = getattr(sm.params, "job_function", None) or sm.rule
    # not importlib.import_module: mfpipe.workflow.codedeps refuses a computed import it cannot follow; this one
    # is followed, per job, by codedeps.job_dependencies (the module is the rule's own first code input)
    function = getattr(__import__(module, fromlist=["__name__"]), name, None)
    if function is None:
        raise SystemExit(f"{CAUSE_PREFIX}rule {sm.rule}: {module} has no job function {name}")
    import_first(function)
    pin_loaded_torch(log)
    run_logged(lambda: function(Job(sm, log)), log)


def pin_loaded_torch(log: logging.Logger) -> None:
    """Where the job's imports loaded torch, turn oneDNN off (:func:`mfpipe.workflow.numerics.pin_torch`; its thread
    count stays the rule's) and log what is not pinned: the job's results would then depend on the machine."""
    if "torch" not in sys.modules:
        return
    from mfpipe.workflow.numerics import pin_torch

    problems = pin_torch()
    if problems:
        log.warning("numerics not pinned (%s): the results may differ between machines", "; ".join(problems))


def import_first(function: Callable) -> None:
    """Run the imports that open ``function``'s body (a job imports what it runs there, so that its code inputs are
    its own) before the job starts: the job script's imports run with Python's cyclic collector off, and
    :func:`run_logged` freezes what they made and turns the collector back on for the work (the ~1,500 modules of
    torch, transformers, xarray and pandas would otherwise be scanned again and again as they came;
    benchmarks/HISTORY.md, "A model job's start-up"). Only the statements before the body's first other statement
    (its docstring aside) run here, each exactly as the function would run it; the function runs them again, cheaply."""
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return  # no source to read: the function imports as it runs
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.FunctionDef) else []
    for stmt in body:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue  # the docstring
        if isinstance(stmt, ast.Import):
            for alias in stmt.names:
                __import__(alias.name)
        elif isinstance(stmt, ast.ImportFrom) and stmt.level == 0 and stmt.module:
            __import__(stmt.module, fromlist=[a.name for a in stmt.names])
        else:
            break
