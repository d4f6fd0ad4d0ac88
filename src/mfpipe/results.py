"""Reading a finished run from Python (a notebook, a script): every store the workflow writes, found by
its kind, model and revision, opened by the library's own reader and checked against what was asked for.

Example (examples/reading_results.ipynb does more)::

    import mfpipe
    mfpipe.list_results("results")                      # one row per store: kind, model, revision, ...
    st = mfpipe.open_stats("mini-gpt2", "step1500")     # MeanFieldStats: st.ds, st.attrs, st.P(), st.W(), ...
    dev = mfpipe.open_results("deviation", "mini-gpt2", "step1500")  # xarray Dataset, provenance in dev.attrs
    dev["S_bar"].sel(layer=1, head=3)

Store kinds (:data:`STORES`; :data:`KINDS`, what :func:`open_results` calls them): ``stats`` (pass 1, a half ``stats`` / ``eval`` of the primary corpus, of a cross
corpus with ``corpus=``, or a top-N arm with ``top_n=``), ``deviation`` (pass 2), ``substitution`` (one revision's
mean-field substitution; ``top_n=`` an App. M arm), ``kernel`` (the revision's rank-r kernel factors and row
spread), ``calibrated`` (the calibrated kernel U of App. B) and ``jlens`` (the J-lens of App. P: the average
same-position Jacobians J_ℓ, :func:`mfpipe.jlens.lens.open_jlens`). Each is read by the reader the workflow's own jobs
use (:func:`mfpipe.stats.api.open_stats`, :func:`~mfpipe.deviation.store.open_deviation`,
:func:`~mfpipe.experiments.substitution.substitute.open_result`,
:func:`~mfpipe.experiments.substitution.kernel_dynamics.open_kernel`,
:func:`~mfpipe.meanfield.calibrated.load_calibrated`); this module adds none.

Before a store is opened, the model and revision it records (and the half, corpus or tracked-set size asked for)
are compared with the request: a store of another model or revision (copied, renamed, another run's) is refused
with :class:`~mfpipe.stats.api.ProvenanceError`; a missing or incomplete one with :class:`ResultsNotFoundError`
(a ``FileNotFoundError``). Both messages name the path and the command that builds it.

:data:`STORES` (:mod:`mfpipe.workflow.paths`, the one place the paths are spelt) gives the path of each store,
relative to the results folder (config key ``results``), with the workflow's wildcard names ``{model}``,
``{revision}``, ``{dataset}``, ``{n}``: the rule that writes it (:data:`RULES`) takes its output from there.

``import mfpipe`` does not import this module: ``mfpipe.open_results`` and friends load it on first use. The
experiments' readers (torch, for the substitution result's) are imported only when their store is opened.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mfpipe.workflow.paths import RULES, STORES  # where each store lives, spelt once
from mfpipe.workflow.revisions import parse_step
from mfpipe.stats.api import ProvenanceError  # what every reader raises, re-exported

__all__ = [
    "RESULTS",
    "STORES",
    "RULES",
    "KINDS",
    "ResultsNotFoundError",
    "ProvenanceError",
    "store_path",
    "list_results",
    "open_results",
    "open_stats",
]

RESULTS = "results"  # the default results folder (config key `results`, src/mfpipe/schemas/config.schema.yaml)

# what open_results() and list_results() call each (an App. M arm is `substitution` with top_n)
KINDS = ("stats", "deviation", "substitution", "kernel", "calibrated", "jlens")
_WHAT = {
    "stats": "statistics store",
    "deviation": "deviation store",
    "substitution": "substitution result",
    "substitution_topn": "substitution result",
    "kernel": "kernel store",
    "calibrated": "calibrated kernel store",
    "jlens": "J-lens store",
}
HALVES = ("stats", "eval")
# the regular expression of each wildcard: those of the workflow's wildcard_constraints (common.smk)
_WILDCARDS = {
    "model": r"(?P<model>[^/]+)",
    "revision": r"(?P<revision>[A-Za-z0-9._-]+)",
    "dataset": r"(?P<dataset>(?:[^/]+/)?(?:stats|eval))",
    "n": r"(?P<n>[0-9]+)",
}


def _regex(pattern: str) -> re.Pattern:
    parts = re.split(r"\{(\w+)\}", pattern)  # literal, name, literal, name, ..., literal
    return re.compile("".join(re.escape(p) if i % 2 == 0 else _WILDCARDS[p] for i, p in enumerate(parts)) + "$")


# the stores the reading API lists and opens: App. B's recomputation stores (``*_recompute``) are that table's inputs
_REGEX = {name: _regex(p) for name, p in STORES.items() if not name.endswith("_recompute")}


class ResultsNotFoundError(FileNotFoundError):
    """A store asked for that the results folder does not hold (not built yet, or its write was interrupted)."""


# ------------------------------------------------------------------ paths
def _store_key(kind: str, half: str, corpus: str | None, top_n: int | None) -> tuple[str, dict]:
    """(the STORES key, its wildcards other than model and revision) of a request; refuses options that do not
    apply to the kind."""
    if kind not in KINDS:
        raise ValueError(f"unknown store kind {kind!r}: one of {', '.join(KINDS)}")
    if kind != "stats" and (half != "stats" or corpus is not None):
        raise ValueError(f"half= and corpus= select a statistics store; {kind!r} has one store per revision")
    if top_n is not None and kind not in ("stats", "substitution"):
        raise ValueError(f"top_n= selects a top-N arm of 'stats' or 'substitution', not of {kind!r}")
    if kind == "stats":
        if half not in HALVES:
            raise ValueError(f"half must be one of {HALVES}, not {half!r}")
        if top_n is not None and (corpus is not None or half != "stats"):
            raise ValueError("a top-N arm has statistics of the primary corpus's `stats` half only (no corpus=, eval)")
        prefix = f"N{int(top_n)}/" if top_n is not None else (f"{corpus}/" if corpus else "")
        return "stats", {"dataset": prefix + half}
    if kind == "substitution" and top_n is not None:
        return "substitution_topn", {"n": int(top_n)}
    return kind, {}


def store_path(kind: str, model: str, revision: str, results: str | os.PathLike = RESULTS, *,
               half: str = "stats", corpus: str | None = None, top_n: int | None = None) -> Path:
    """Where the workflow writes a store (:data:`STORES`), under the results folder ``results``: e.g.
    ``store_path("stats", "mini-gpt2", "step1500", half="eval")`` is ``results/stats/mini-gpt2/step1500/eval.zarr``.
    ``half``, ``corpus`` (a cross corpus; None: the primary) for ``stats``; ``top_n`` for a top-N arm of ``stats`` or
    ``substitution``."""
    key, wild = _store_key(kind, half, corpus, top_n)
    return Path(results) / STORES[key].format(model=model, revision=revision, **wild)


def _stores_under(results: Path):
    """Every complete store (``*.zarr`` with its ``zarr.json``) under the experiments' folders, partials left out."""
    for top in dict.fromkeys(STORES[name].split("/")[0] for name in _REGEX):
        base = results / top
        if not base.is_dir():
            continue
        for dirpath, dirnames, _ in os.walk(base):
            keep = []
            for d in sorted(dirnames):
                if d.endswith(".zarr"):
                    if (Path(dirpath, d) / "zarr.json").is_file():
                        yield Path(dirpath, d)
                elif d != "partials" and not d.startswith("."):
                    keep.append(d)
            dirnames[:] = keep


def _revision_key(revision: str):
    step = parse_step(revision)
    return (0, step, "") if step is not None else (1, 0, revision)


def _entries(results: str | os.PathLike) -> list[dict]:
    root = Path(results)
    rows = []
    for path in _stores_under(root):
        rel = path.relative_to(root).as_posix()
        for key, rx in _REGEX.items():
            m = rx.match(rel)
            if not m:
                continue
            g = m.groupdict()
            row = {"kind": "substitution" if key == "substitution_topn" else key, "model": g["model"],
                   "revision": g["revision"], "step": parse_step(g["revision"]), "half": None, "corpus": None,
                   "top_n": int(g["n"]) if g.get("n") else None, "path": path}
            if key == "stats":
                prefix, _, half = g["dataset"].rpartition("/")
                row["half"] = half
                if re.fullmatch(r"N[0-9]+", prefix):
                    row["top_n"] = int(prefix[1:])
                elif prefix:
                    row["corpus"] = prefix
            rows.append(row)
            break
    order = {e: i for i, e in enumerate(KINDS)}
    rows.sort(key=lambda r: (order[r["kind"]], r["model"], _revision_key(r["revision"]), r["corpus"] or "",
                             r["top_n"] or 0, HALVES.index(r["half"]) if r["half"] else 0))
    return rows


def list_results(results: str | os.PathLike = RESULTS):
    """What a results folder holds: a :class:`pandas.DataFrame` with one row per complete store, columns
    ``kind, model, revision, step, half, corpus, top_n, path`` (``step``: k of a revision ``step<k>``;
    ``half``: of a ``stats`` store; ``corpus``: a cross corpus, None for the primary; ``top_n``: a top-N arm),
    in training order within a model. A row's values are :func:`open_results`' arguments."""
    import pandas as pd

    root = Path(results)
    if not root.is_dir():
        raise ResultsNotFoundError(f"results folder {root} does not exist: run the workflow (snakemake --cores 2) "
                                   "or point to the folder a run wrote (its config's `results`)")
    cols = ["kind", "model", "revision", "step", "half", "corpus", "top_n", "path"]
    rows = _entries(root)
    return pd.DataFrame({c: pd.Series([r[c] for r in rows], dtype=object) for c in cols}, columns=cols)


# ------------------------------------------------------------------ opening
def _held(results: Path, kind: str, model: str) -> str:
    """One line on what the folder holds of ``kind``, for a not-found message."""
    try:
        rows = [r for r in _entries(results) if r["kind"] == kind]
    except OSError:  # pragma: no cover
        return ""
    if not rows:
        return f" The folder holds no {kind} store at all."
    mine = [r for r in rows if r["model"] == model]
    if mine:
        revs = list(dict.fromkeys(r["revision"] for r in mine))
        return f" It holds {kind} stores of {model} for revision(s) {', '.join(revs)}."
    return f" It holds {kind} stores of model(s) {', '.join(dict.fromkeys(r['model'] for r in rows))}."


def _missing(path: Path, key: str, results: Path, kind: str, model: str) -> ResultsNotFoundError:
    return ResultsNotFoundError(
        f"{_WHAT[key]} {path} does not exist or is incomplete (no zarr.json). Build it with the workflow (rule "
        f"{RULES[key]}), from the checkout: `snakemake --cores 2 {path}`, with the config whose `results` is "
        f"{str(results)!r}." + _held(results, kind, model))


def _wanted(key: str, model: str, revision: str, half: str, corpus: str | None, top_n: int | None) -> dict:
    want: dict[str, Any] = {"model": model, "revision": revision}
    if key == "stats":
        want["half"] = half
        if corpus:
            want["corpus"] = corpus
    if top_n is not None:
        want["n_tracked"] = int(top_n)
    return want


def _check_owner(attrs: Mapping[str, Any], want: Mapping[str, Any], path: Path, key: str) -> None:
    """Refuse a store whose own record differs from the request, naming every key that differs."""
    bad = [(k, attrs.get(k), v) for k, v in want.items() if str(attrs.get(k)) != str(v)]
    if bad:
        diff = "; ".join(f"{k} is {have!r}, not {v!r}" if have is not None else f"it records no {k!r} (wanted {v!r})"
                         for k, have, v in bad)
        raise ProvenanceError(
            f"{_WHAT[key]} {path} is not the one asked for: {diff}. It was copied or renamed, or another run (or an "
            f"older mfpipe) wrote it. Open it as what it records, or delete it and rebuild it "
            f"with the workflow (rule {RULES[key]}): `snakemake --cores 2 {path}`.")


def _resolve(kind: str, model: str, revision: str, results, half: str, corpus: str | None,
             top_n: int | None) -> tuple[str, Path, dict]:
    """(STORES key, path of an existing complete store, its attributes), after the model / revision check."""
    from mfpipe.stats.store import read_attrs

    results = Path(results)
    key, _ = _store_key(kind, half, corpus, top_n)
    path = store_path(kind, model, revision, results, half=half, corpus=corpus, top_n=top_n)
    if corpus and not (path / "zarr.json").is_file():  # the primary corpus named by its name
        primary = store_path(kind, model, revision, results, half=half)
        if (primary / "zarr.json").is_file() and read_attrs(primary).get("corpus") == corpus:
            path = primary
    if not (path / "zarr.json").is_file():
        raise _missing(path, key, results, kind, model)
    attrs = read_attrs(path)
    _check_owner(attrs, _wanted(key, model, revision, half, corpus, top_n), path, key)
    return key, path, attrs


def open_results(kind: str, model: str, revision: str, results: str | os.PathLike = RESULTS, *,
                 half: str = "stats", corpus: str | None = None, top_n: int | None = None,
                 expect: Mapping[str, Any] | None = None, layer: int | None = None):
    """A store of a finished run as a labelled :class:`xarray.Dataset`, its provenance (model, revision, corpus
    and tracked-set fingerprints, ``mfpipe_version``, the stage's parameters, as stored) in ``.attrs``.

    ``kind``: ``stats`` (lazy: values are read on access; ``half`` ``stats`` / ``eval``, ``corpus`` a cross
    corpus, ``top_n`` a top-N arm), ``deviation``, ``substitution`` (``top_n``: an App. M arm), ``kernel`` (lazy),
    ``calibrated`` (its variable ``U``) or ``jlens`` (``J``: point, layer, out, in). ``results``: the run's results folder. ``expect``: further attribute values
    to require (e.g. ``corpus_fingerprint``, ``tracked_fingerprint``), checked by the reader. ``layer``: only that
    layer (for ``calibrated`` only that layer is read).

    Raises :class:`ResultsNotFoundError` when the store is not there, :class:`~mfpipe.stats.api.ProvenanceError`
    when it records another model, revision, half, corpus or tracked-set size than asked for."""
    key, path, attrs = _resolve(kind, model, revision, results, half, corpus, top_n)
    if key == "stats":
        from mfpipe.stats.api import open_stats as _open_stats

        ds = _open_stats(path, expect).ds
    elif key == "deviation":
        from mfpipe.deviation.store import open_deviation

        ds = open_deviation(path, expect)
    elif key in ("substitution", "substitution_topn"):
        from mfpipe.experiments.substitution.substitute import open_result

        ds = open_result(path, expect)
    elif key == "kernel":
        from mfpipe.experiments.substitution.kernel_dynamics import open_kernel
        from mfpipe.stats.api import check_provenance

        ds = open_kernel(path)
        check_provenance(ds.attrs, expect, path)
    elif key == "jlens":
        from mfpipe.jlens.lens import open_jlens

        ds = open_jlens(path, expect)
    else:  # calibrated
        import xarray as xr

        from mfpipe.meanfield.calibrated import load_calibrated

        U = load_calibrated(path, expect, layer=layer)
        return xr.Dataset({"U": U}, attrs=attrs)
    if layer is not None and "layer" in ds.dims:
        ds = ds.sel(layer=layer)
    return ds


def open_stats(path_or_model: str | os.PathLike, revision: str | None = None, *, results: str | os.PathLike = RESULTS,
               half: str = "stats", corpus: str | None = None, top_n: int | None = None,
               expect: Mapping[str, Any] | None = None):
    """A statistics store as :class:`~mfpipe.stats.api.MeanFieldStats` (``.ds`` the lazy labelled Dataset, ``.attrs``
    its provenance; ``.P()``, ``.W()``, ``.centroids()``, ``.mu()``, ...), as :func:`mfpipe.stats.api.open_stats`.

    ``open_stats(path, expect=...)`` opens the store at ``path``; ``open_stats(model, revision, results=..., half=...,
    corpus=..., top_n=...)`` the one the workflow wrote for that model and revision under ``results``, refused
    like :func:`open_results`' stores when missing or another model's or revision's."""
    from mfpipe.stats.api import open_stats as _open_stats

    if revision is None:
        path = Path(path_or_model)
        if not (path / "zarr.json").is_file() and len(path.parts) == 1 and path.suffix != ".zarr":
            model = str(path_or_model)
            raise TypeError(f"open_stats({model!r}): a model name needs its revision, open_stats({model!r}, "
                            f"'<revision>', results={str(results)!r}); or give a store's path."
                            + _held(Path(results), "stats", model))
        return _open_stats(path, expect)
    _, path, _ = _resolve("stats", str(path_or_model), revision, results, half, corpus, top_n)
    return _open_stats(path, expect)
