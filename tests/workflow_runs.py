"""Driving the workflow in a scratch clone, for the tests that run it (tests/test_workflow.py, tests/test_presets.py,
tests/test_cuda.py): a copy of the checkout's workflow and library (:func:`clone`), a Snakemake run of it
(:func:`snakemake`, the ci config by default), the jobs a dry run plans (:func:`planned_jobs`), a run's result
files (:func:`result_files`) with JSON compared without its timings (:func:`without_timings`), and what a profile
states and a run recorded it ran with (:func:`profile_settings`, :func:`run_settings`, :func:`run_got`)."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CI_CONFIG = REPO / "config" / "ci.yaml"
PROFILES = REPO / "profiles"


def snakemake(workdir: Path, *args: str, configfiles=(CI_CONFIG,), timeout=1800, env: dict | None = None) -> str:
    """Run the workflow of the checkout at ``workdir`` (a clone made by :func:`clone`) in ``workdir``."""
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(workdir / "Snakefile"), "--directory", str(workdir),
           "--configfile", *map(str, configfiles), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, **env} if env else None)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-6000:]
    return text


# the run's cost table (workflow/rules/costs.smk) sums the benchmark files of every job, so it follows whatever
# else a run does: the tests of what a change plans leave it out
FOLLOWS_EVERY_RUN = {"run_costs"}


def planned_jobs(text: str) -> list[tuple[str, str]]:
    """(rule, wildcards) of every job a dry run lists, but the run's cost table (:data:`FOLLOWS_EVERY_RUN`)."""
    jobs, current = [], None
    for line in text.splitlines():
        m = re.match(r"^\s*(?:rule|checkpoint|localrule|localcheckpoint) (\w+):\s*$", line)
        if m:
            if current:
                jobs.append(tuple(current))
            current = [m.group(1), ""]
            continue
        m = re.match(r"^\s*wildcards: (.*)$", line)
        if m and current:
            current[1] = m.group(1)
    if current:
        jobs.append(tuple(current))
    return [j for j in jobs if j[0] not in FOLLOWS_EVERY_RUN]


def clone(dest: Path) -> Path:
    """A copy of the workflow and its library: the rules' code inputs live in the copy, so a test may edit
    them, and edits in the working checkout during a test run do not make the built outputs stale."""
    junk = shutil.ignore_patterns("__pycache__", "*.pyc", ".snakemake", "results", "logs")
    for name in ("Snakefile", "workflow", "src", "config", "profiles", "pyproject.toml"):
        src = REPO / name
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, dest / name, **({"ignore": junk} if src.is_dir() else {}))
    return dest


def result_files(root: Path) -> dict[str, Path]:
    """Every result file by path relative to ``root``; a Zarr store counts as one entry."""
    out = {}
    for p in sorted(root.rglob("*")):
        if any(part.endswith(".zarr") for part in p.relative_to(root).parts[:-1]):
            continue
        if p.is_file() or p.suffix == ".zarr":
            out[str(p.relative_to(root))] = p
    return out


TIMINGS = {"elapsed_s", "wall_time_s", "cpu_time_s"}  # training.json records how long training took, not a result


def without_timings(value):
    if isinstance(value, dict):
        return {k: without_timings(v) for k, v in value.items() if k not in TIMINGS}
    if isinstance(value, list):
        return [without_timings(v) for v in value]
    return value


# ------------------------------------------------------------------------------------ profiles (issues 12, 27)
def profile_settings(name: str) -> dict:
    """The keys a profile of profiles/ sets, as its YAML says."""
    import yaml

    path = next(p for p in (PROFILES / name).glob("*.yaml"))  # config.yaml or config.v8+.yaml
    return yaml.safe_load(path.read_text())


def run_settings(workdir: Path) -> dict:
    """What the latest run in ``workdir`` ran with: logs/run_settings.json, written by the workflow's onstart
    handler (workflow/rules/common.smk) from Snakemake's own settings objects."""
    import json

    return json.loads((workdir / "logs" / "run_settings.json").read_text())


def run_got(settings: dict, profile: dict) -> dict:
    """For each key of ``profile``, the value the run recorded in ``settings`` (run_settings): an executor
    plugin's option `slurm-x-y` under executor_settings.x_y, any other key under its own name."""
    got = {}
    for key in profile:
        name = key.replace("-", "_")
        got[key] = (settings["executor_settings"][name.removeprefix("slurm_")] if key.startswith("slurm-")
                    else settings[name])
    return got
