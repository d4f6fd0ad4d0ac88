# Shared helpers: config cross-checks, model specs, paths, code dependencies.
import os
import sys
from pathlib import Path

SRC = Path(workflow.basedir) / "src"
sys.path.insert(0, str(SRC))  # the workflow always runs the library of its own checkout,
os.environ["PYTHONPATH"] = os.pathsep.join([str(SRC)] + [p for p in [os.environ.get("PYTHONPATH")] if p])  # its jobs too

from mfpipe.config import ConfigError, check_config, corpora, minimodel, resolve_revisions  # noqa: E402

try:
    check_config(config)
except ConfigError as e:
    raise WorkflowError(str(e))


def _canonical(value):
    """The same settings in key-sorted order: Snakemake compares params by their text, so a config file
    that lists the same keys in another order (or a layered `--configfile`) must not look like a change."""
    if isinstance(value, dict):
        return {k: _canonical(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    return value


_sorted_config = _canonical(dict(config))
config.clear()
config.update(_sorted_config)

R = "results"
CORPUS = config["corpus"]["name"]
CORPORA = corpora(config)  # primary first, then cross corpora (App. G)
CROSS = [c for c in CORPORA if c != CORPUS]
MODELS = {m["name"]: m for m in config["models"]}
MINI = {m["name"]: m for m in config.get("minisuite", {}).get("models", [])}
REVISIONS = {name: resolve_revisions(config, m) for name, m in MODELS.items()}
HALVES = ["stats", "eval"]


def code(*modules):
    """Library modules a rule's result depends on: editing one reruns the rule."""
    return [str(SRC / "mfpipe" / m) for m in ("__init__.py",) + modules]


# the adapters package (module paths, the traced read/patch site, the per-architecture classes)
ADAPTERS_CODE = tuple(f"models/adapters/{m}.py" for m in ("__init__", "base", "site", "architectures"))


def tokenizer_input(wildcards):
    """Mini-suite models tokenize with the suite's tokenizer, which must exist first."""
    if MODELS[wildcards.model]["source"] == "minisuite":
        return [f"{R}/minisuite/tokenizer"]
    return []


def model_input(wildcards):
    """What a corpus pass over (model, revision) depends on: the checkpoint, for the mini suite."""
    if MODELS[wildcards.model]["source"] == "minisuite":
        return [f"{R}/minisuite/{wildcards.model}/checkpoints"]
    return []


def dataset_parts(dataset):
    """(corpus, half) of a stats dataset: `stats` / `eval` of the primary corpus or `<corpus>/<half>`."""
    corpus, _, half = dataset.rpartition("/")
    return (corpus or CORPUS), half


def datasets(corpus=None):
    prefix = "" if corpus in (None, CORPUS) else f"{corpus}/"
    return [prefix + h for h in HALVES]


def model_spec(wildcards):
    return MODELS[wildcards.model]


def all_targets():
    targets = []
    mini_used = sorted({m for m, spec in MODELS.items() if spec["source"] == "minisuite"})
    for m in mini_used:
        targets.append(f"{R}/minisuite/{m}/induction.csv")
    if mini_used:
        targets.append(f"{R}/tables/induction.md")
    for m in MODELS:
        targets.append(f"{R}/corpus/{CORPUS}/{m}/tracked.json")
        for rev in REVISIONS[m]:
            targets += [f"{R}/stats/{m}/{rev}/{ds}.zarr" for c in CORPORA for ds in datasets(c)]
    targets += [f"{R}/tables/coverage_positions.csv", f"{R}/tables/coverage_positions.md"]
    targets += rollout_targets()  # workflow/rules/rollout.smk
    return targets


wildcard_constraints:
    model="|".join(MODELS) if MODELS else "NONE",
    mini="|".join(MINI) if MINI else "NONE",
    corpus="|".join(CORPORA),
    half="stats|eval",
    dataset="(?:(?:" + "|".join(CROSS or ["NONE"]) + ")/)?(?:stats|eval)",
    revision="[A-Za-z0-9._-]+",
    i="[0-9]+",
