"""Drive the real Snakemake workflow on the tiny `ci` config in a scratch working directory."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
CI_CONFIG = REPO / "config" / "ci.yaml"
pytestmark = pytest.mark.slow


def snakemake(workdir: Path, *args: str, configfiles=(CI_CONFIG,), timeout=1800) -> str:
    """Run the workflow of the checkout at ``workdir`` (a clone made by :func:`clone`) in ``workdir``."""
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(workdir / "Snakefile"), "--directory", str(workdir),
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


def clone(dest: Path) -> Path:
    """A copy of the workflow and its library: the rules' code inputs live in the copy, so a test may edit
    them, and edits in the working checkout during a test run do not make the built outputs stale."""
    junk = shutil.ignore_patterns("__pycache__", "*.pyc", ".snakemake", "results", "logs")
    for name in ("Snakefile", "workflow", "src", "config", "profiles", "pyproject.toml"):
        src = REPO / name
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, dest / name, **({"ignore": junk} if src.is_dir() else {}))
    return dest


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    wd = clone(tmp_path_factory.mktemp("wf"))
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


# ------------------------------------------------------------------------------------ code inputs
def rule_scripts(repo: Path) -> dict[str, str]:
    """rule name -> its `script:` file name, read from the rule files (the figure rules are made in a loop)."""
    out = {}
    for f in sorted((repo / "workflow" / "rules").glob("*.smk")):
        for block in re.split(r"(?m)^(?=(?:rule|checkpoint) \w+:|\s+rule:)", f.read_text()):
            script = re.search(r'script:\s*\n\s*"\.\./scripts/([\w.]+)"', block)
            if not script:
                continue
            named = re.match(r"(?:rule|checkpoint) (\w+):", block)
            if named:
                out[named.group(1)] = script.group(1)
            elif 'f"figure_{_fig}"' in block:
                out["figure_*"] = script.group(1)
    return out


def rule_graph(workdir: Path) -> dict[str, set[str]]:
    """rule -> the rules that consume its outputs (from `snakemake --rulegraph`)."""
    text = snakemake(workdir, "--rulegraph")
    names = dict(re.findall(r"^\s*(\d+)\[label = \"(\w+)\"", text, flags=re.M))
    graph = {n: set() for n in names.values()}
    for a, b in re.findall(r"^\s*(\d+) -> (\d+)", text, flags=re.M):
        graph[names[a]].add(names[b])
    return graph


def downstream(graph: dict[str, set[str]], rules: set[str]) -> set[str]:
    out, todo = set(rules), list(rules)
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in out:
                out.add(nxt)
                todo.append(nxt)
    return out


def test_editing_a_module_reruns_exactly_the_rules_whose_scripts_import_it(built):
    """Issue 9: a rule's code inputs are derived from its script's imports (mfpipe.codedeps), so editing a
    library module plans the rules whose script imports it, directly or not, and what consumes their outputs;
    and no other rule is stale by itself (a dry run allowed to run only the other rules plans nothing)."""
    from mfpipe.codedeps import script_dependencies

    src = built / "src"
    scripts = rule_scripts(built)
    graph = rule_graph(built)
    rules = set(graph) - {"all"}
    script_of = {r: scripts["figure_*" if r.startswith("figure_") else r] for r in rules}
    deps = {r: set(script_dependencies(src, built / "workflow" / "scripts" / s)) for r, s in script_of.items()}
    mismatches = []
    for module in sorted((src / "mfpipe").rglob("*.py")):
        importers = {r for r in rules if str(module) in deps[r]}
        original = module.read_bytes()
        stat = module.stat()
        module.write_bytes(original + b"\n# edited by test_workflow\n")
        try:
            planned = {r for r, _ in planned_jobs(snakemake(built, "-n"))} - {"all"}
            others = sorted(rules - importers)
            stale_others = set()
            if others and importers:
                stale_others = {r for r, _ in planned_jobs(snakemake(built, "-n", "--allowed-rules", *others))}
        finally:
            module.write_bytes(original)
            os.utime(module, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        want = downstream(graph, importers) - {"all"}
        if "corpus_shards" in want:
            # the shard jobs of a checkpoint that reruns exist only once it has run: a dry run cannot list them
            want.discard("stats_shard")
        if planned != want or stale_others:
            mismatches.append(f"{module.relative_to(src)}: planned {sorted(planned)}, want {sorted(want)} (imported "
                              f"by {sorted(importers)}); stale although not importing it: {sorted(stale_others)}")
    assert not mismatches, "\n".join(mismatches)
    assert planned_jobs(snakemake(built, "-n")) == []
