"""Drive the real Snakemake workflow on the tiny `ci` config in a scratch working directory."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
CI_CONFIG = REPO / "config" / "ci.yaml"
pytestmark = pytest.mark.slow


def snakemake(workdir: Path, *args: str, configfiles=(CI_CONFIG,), timeout=1800) -> str:
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"), "--directory", str(workdir),
           "--configfile", *map(str, configfiles), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-6000:]
    return text


def planned_jobs(text: str) -> list[tuple[str, str]]:
    """(rule, wildcards) of every job a dry run lists."""
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
    return jobs


def variant(tmp: Path, name: str, edit) -> Path:
    cfg = yaml.safe_load(CI_CONFIG.read_text())
    edit(cfg)
    p = tmp / f"{name}.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    wd = tmp_path_factory.mktemp("wf")
    snakemake(wd, "--cores", "2")
    return wd


def test_ci_dag_builds_everything(built):
    r = built / "results"
    for m in ("mini-gpt2", "mini-neox"):
        assert (r / "minisuite" / m / "induction.csv").is_file()
        assert (r / "corpus" / "shakespeare-ci" / m / "tracked.json").is_file()
        assert sorted((r / "corpus" / "shakespeare-ci" / m / "shards" / "stats").glob("shard-*.npz"))
    assert (r / "tables" / "coverage_positions.md").is_file()
    assert list((built / "logs").rglob("*.log"))


def test_second_run_does_nothing(built):
    text = snakemake(built, "-n")
    assert planned_jobs(text) == [], text[-3000:]


def test_token_budget_change_rebuilds_only_corpus_onward(built, tmp_path):
    cfg = variant(tmp_path, "budget", lambda c: c["corpus"].update(tokens_per_half=c["corpus"]["tokens_per_half"] // 2))
    rules = {r for r, _ in planned_jobs(snakemake(built, "-n", configfiles=(CI_CONFIG, cfg)))}
    assert "corpus_shards" in rules and "tracked_types" in rules
    assert not rules & {"minisuite_tokenizer", "minisuite_train", "induction_table"}, rules


def test_n_change_rebuilds_only_tracked_onward(built, tmp_path):
    cfg = variant(tmp_path, "n", lambda c: c["tracked"].update(n_types=c["tracked"]["n_types"] // 2))
    rules = {r for r, _ in planned_jobs(snakemake(built, "-n", configfiles=(CI_CONFIG, cfg)))}
    assert "tracked_types" in rules
    assert not rules & {"corpus_shards", "minisuite_tokenizer", "minisuite_train", "induction_table"}, rules


def test_training_option_change_retrains_only_that_model(built, tmp_path):
    def edit(c):
        c["minisuite"]["models"][1]["lr"] = 2e-3  # mini-neox only
    cfg = variant(tmp_path, "train", edit)
    jobs = planned_jobs(snakemake(built, "-n", configfiles=(CI_CONFIG, cfg)))
    trains = [w for r, w in jobs if r == "minisuite_train"]
    assert trains == ["mini=mini-neox"], jobs
    rules = {r for r, _ in jobs}
    assert "minisuite_tokenizer" not in rules and "corpus_shards" not in rules
    assert not [w for r, w in jobs if "mini-gpt2" in w], jobs


def test_deleting_a_figure_reruns_only_its_plotting_job(built):
    figs = sorted((built / "results" / "figures").glob("rollout_mini-gpt2_*.png"))
    assert figs, "the ci DAG builds the rollout figure"
    png = figs[0]
    png.unlink()
    jobs = [(r, w) for r, w in planned_jobs(snakemake(built, "-n")) if r != "all"]
    assert [r for r, _ in jobs] == ["figure_rollout"] and "model=mini-gpt2" in jobs[0][1], jobs
    snakemake(built, "--cores", "1", str(png.relative_to(built)))
    assert png.is_file() and png.stat().st_size > 0
    assert planned_jobs(snakemake(built, "-n")) == []
