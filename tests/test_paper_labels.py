"""docs/paper-labels.md, the map from every figure, table, algorithm and results appendix of the paper to the targets
that build it, stays true: each target pattern it names is planned by the default run and a paper preset (GPT-2, or
Pythia for a training sweep's targets), or by App. M's overlay where the row says so (every stage's ``targets(plan)``,
what ``rule all`` builds), and -- where the paper's source sits beside the project, as on the
developers' machines -- every figure, table and algorithm label of the tex has a row."""

import importlib
import re
from pathlib import Path

import pytest

from mfpipe.estimate import jobs as J
from mfpipe.workflow.plan import Plan

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "paper-labels.md"
TEX = REPO.parent / "shared" / "paper" / "mean-field-attention.tex"
CORE = ("minisuite", "corpus", "stats", "deviation", "jlens")


def rows() -> dict[str, list[str]]:
    """label -> its target patterns (relative to results/), from the page's tables."""
    out = {}
    for line in DOC.read_text().splitlines():
        m = re.match(r"\| ((?:fig|tab|alg|app):[\w-]+) \|[^|]*\| (.*) \|$", line)
        if m:
            out[m.group(1)] = re.findall(r"`([^`]+)`", m.group(2))
    return out


def planned(configfiles) -> set[str]:
    cfg = J.load_config([REPO / c for c in configfiles], base=REPO / "config" / "config.yaml")  # absolute paths stay
    plan = Plan(cfg, REPO / "src")
    targets = []
    for stage in CORE:
        targets += importlib.import_module(f"mfpipe.{stage}.rules").targets(plan)
    for p in sorted((REPO / "src" / "mfpipe" / "experiments").glob("*/rules.py")):
        targets += importlib.import_module(f"mfpipe.experiments.{p.parent.name}.rules").targets(plan)
    R = plan.results.rstrip("/") + "/"
    return {t[len(R):] for t in targets if t.startswith(R)}


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    import yaml

    # the two presets' models in one run, as the models-side-by-side targets need
    both = tmp_path_factory.mktemp("presets") / "both.yaml"
    models = [m for p in ("gpt2-small", "pythia-160m")
              for m in yaml.safe_load((REPO / "config" / "presets" / f"{p}.yaml").read_text())["models"]]
    both.write_text(yaml.safe_dump({**yaml.safe_load((REPO / "config/presets/gpt2-small.yaml").read_text()),
                                    "models": models}))
    return {"default": planned([]), "gpt2-small": planned(["config/presets/gpt2-small.yaml"]),
            "gpt2-small + pythia-160m": planned([both]),
            "App. M": planned(["config/presets/pythia-160m.yaml", "config/experiments/topn-sensitivity.yaml"])}


def pattern(p: str) -> re.Pattern:
    rx = re.escape(p).replace(r"\{model\}", r"[^/]+").replace(r"\{revision\}", r"[^/]+").replace(r"\{corpus\}", r"[^/]+")
    return re.compile(rx + "$")


def test_every_named_target_is_planned(targets):
    table = rows()
    assert len(table) > 60
    missing = []
    for label, pats in table.items():
        for p in pats:
            rx = pattern(p)
            where = [name for name, ts in targets.items() if any(rx.match(t) for t in ts)]
            if not where:
                missing.append(f"{label}: {p}")
                continue
            what = DOC.read_text().split(f"| {label} |")[1].split("\n")[0]
            if "(App. M" not in what:
                assert "default" in where, f"{label}: {p} is planned only by {where}; mark the row (App. M)"
                assert {"gpt2-small", "gpt2-small + pythia-160m"} & set(where), f"{label}: no preset plans {p}"
                continue
            assert "App. M" in where, f"{label}: {p} is marked App. M, which does not plan it ({where})"
            # an App. M row the default run builds too (in small) says so, and the default run plans it
            assert ("default run" in what) == ("default" in where), f"{label}: {p} planned by {where}; row: {what}"
    assert not missing, "targets no run plans:\n" + "\n".join(missing)


def test_the_default_run_plans_app_m_in_small(targets):
    """Issue 60 item 4: fig:vocab-mfgap (and the top-N table and fig:vocab-robustness) is in the default run: the mini
    GPT-2's own top-500 arm at five checkpoints of its sweep, beside the configured N; the other mini model has none."""
    default = targets["default"]
    assert {"figures/vocab_mfgap_mini-gpt2.png", "figures/vocab_mfgap_mini-gpt2.pdf", "figures/topn_mini-gpt2.png",
            "tables/substitution_topn_mini-gpt2.csv"} <= default
    assert not [t for t in default if "mini-neox" in t and ("topn" in t or "vocab" in t)]
    row = DOC.read_text().split("| fig:vocab-mfgap |")[1].split("\n")[0]
    assert "default run" in row and "App. M" in row


def test_rows_without_targets_are_schematics():
    for label, pats in rows().items():
        if not pats:
            assert "schematic" in DOC.read_text().split(f"| {label} |")[1].split("\n")[0], label


@pytest.mark.skipif(not TEX.is_file(), reason="the paper's source is not beside this checkout")
def test_every_figure_table_and_algorithm_of_the_paper_has_a_row():
    labels = set(re.findall(r"\\label\{((?:fig|tab|alg):[^}]+)\}", TEX.read_text()))
    assert labels and not labels - set(rows()), sorted(labels - set(rows()))


def test_a_pattern_matches_only_its_own_files():
    rx = pattern("tables/rollout_{model}_{revision}.csv")
    assert rx.match("tables/rollout_mini-gpt2_step1500.csv")
    assert not rx.match("tables/rollout_mini-gpt2_step1500.md") and not rx.match("x/tables/rollout_a/b_c.csv")
