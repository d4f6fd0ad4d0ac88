"""The public reading API (mfpipe.results: list_results, open_stats, open_results) on a synthetic results folder laid
out as the workflow writes it, and examples/reading_results.ipynb as stored (its execution, tests/example_notebook.py,
runs on the ci config's results in tests/test_workflow.py, which builds them once)."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
from example_notebook import API_NOTEBOOK, NOTEBOOK

REPO = Path(__file__).resolve().parents[1]
MODEL = "synth"
REVISIONS = ["step4", "step16"]  # training order; a name sort would put step16 first


def test_notebook_is_valid_and_stored_without_outputs():
    import nbformat

    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    assert nb.nbformat == 4 and nb.metadata["kernelspec"]["name"] == "python3"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)
    source = "\n".join(c.source for c in code)
    assert 'os.environ.get("MFPIPE_RESULTS", "results")' in source and "savefig" in source
    assert ".isel(" not in source  # selection by coordinate labels, not positions


def test_the_notebook_api_example_is_stored_without_outputs():
    """examples/notebook_api.ipynb (issue 46) as stored: valid, no outputs, every function of the API used, the model
    and tokenizer from the environment (CI runs it on the ci run's mini model: tests/test_workflow.py)."""
    import nbformat

    nb = nbformat.read(API_NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)
    source = "\n".join(c.source for c in code)
    for call in ("mfpipe.collect_stats(", "mfpipe.mean_field(", "mfpipe.substitute(", "mfpipe.context_deviation(",
                 "mfpipe.decode(", 'os.environ.get("MFPIPE_MODEL"', "savefig"):
        assert call in source, call


# ------------------------------------------------------------------ import mfpipe stays light
def test_import_mfpipe_does_not_import_the_reading_api():
    """Every job imports mfpipe: that must not load mfpipe.results (nor numpy, xarray); asking for
    mfpipe.open_results does, and gives the module's function."""
    probe = textwrap.dedent("""
        import sys
        import mfpipe
        heavy = [m for m in ("mfpipe.results", "numpy", "xarray", "pandas", "torch") if m in sys.modules]
        assert not heavy, heavy
        assert {"open_stats", "open_results", "list_results", "__version__"} <= set(dir(mfpipe)), dir(mfpipe)
        assert {"open_stats", "open_results", "list_results"} <= set(mfpipe.__all__)
        f = mfpipe.open_results
        import mfpipe.results
        assert f is mfpipe.results.open_results and mfpipe.open_stats is mfpipe.results.open_stats
        assert not hasattr(mfpipe, "no_such_name")
        # the notebook API: loaded on first use; mfpipe.deviation is pass 2's package, so the notebook's per-context
        # deviation is mfpipe.context_deviation (the package is no function: an earlier release's call is told so)
        names = {"collect_stats", "mean_field", "substitute", "context_deviation", "decode"}
        assert names <= set(mfpipe.__all__) and names <= set(dir(mfpipe)) and "deviation" not in mfpipe.__all__
        assert "mfpipe.notebook.stats" not in sys.modules and "torch" not in sys.modules
        assert mfpipe.collect_stats is sys.modules["mfpipe.notebook.stats"].collect_stats
        try:
            mfpipe.deviation
        except AttributeError as e:
            assert "mfpipe.context_deviation(model, stats, tokens)" in str(e), e
        else:
            raise AssertionError("mfpipe.deviation before the package is imported")
        import mfpipe.deviation.store
        assert mfpipe.deviation is sys.modules["mfpipe.deviation"] and not callable(mfpipe.deviation)
        assert mfpipe.context_deviation is sys.modules["mfpipe.notebook.analysis"].context_deviation
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_no_job_depends_on_the_reading_api(tmp_path):
    """The rules' code inputs (mfpipe.workflow.codedeps) of every job script leave mfpipe/results.py out: editing it reruns
    nothing; `from mfpipe import open_results` does depend on it."""
    from mfpipe.workflow.codedeps import module_dependencies, script_dependencies

    src = REPO / "src"
    results_py = (src / "mfpipe" / "results.py").resolve()
    scripts = sorted((REPO / "workflow" / "scripts").glob("*.py"))
    assert scripts
    for script in scripts:
        assert results_py not in {Path(p).resolve() for p in script_dependencies(src, script)}, script.name
    user = tmp_path / "notebook.py"
    user.write_text("from mfpipe import open_results\n")
    assert results_py in {Path(p).resolve() for p in module_dependencies(src, [user])}


# ------------------------------------------------------------------ a results folder as a run lays it out
def relabel(store: Path, **attrs) -> Path:
    """Change attributes in a store's own record (zarr.json), as a store written for something else would have."""
    meta = json.loads((store / "zarr.json").read_text())
    meta["attributes"].update(attrs)
    (store / "zarr.json").write_text(json.dumps(meta))
    return store


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """results/ of a run of model `synth` at two revisions: both statistics halves and a cross corpus, deviation,
    substitution (and a top-N arm), kernel factors, and at the last revision the calibrated kernel; plus a
    partial and an interrupted store, which are not results."""
    from synthetic_stats import make_store, tracked_set, windows

    from mfpipe.experiments.substitution.kernel_dynamics import kernel_dataset
    from mfpipe.meanfield.calibrated import calibrated_dataset, write_calibrated
    from mfpipe.results import store_path
    from mfpipe.stats import open_stats, write_store

    root = tmp_path_factory.mktemp("run") / "results"
    tokens = windows(24, seed=1)
    tracked = tracked_set(tokens)
    rng = np.random.default_rng(0)
    L, H, N = 2, 2, tracked.n
    for i, rev in enumerate(REVISIONS):
        U = rng.lognormal(0.0, 1.0, size=(L, H, N, N + 2))
        stats = make_store(store_path("stats", MODEL, rev, root), tokens, tracked, U, revision=rev, model=MODEL)
        relabel(make_store(store_path("stats", MODEL, rev, root, half="eval"), tokens, tracked, U, revision=rev,
                           model=MODEL), half="eval")
        st = open_stats(stats)
        prov = {k: st.attrs[k] for k in ("model", "revision", "tracked_fingerprint", "n_tracked", "corpus_fingerprint")}
        write_store(kernel_dataset(st, min_count=1, rank=2), store_path("kernel", MODEL, rev, root))
        layer_head = {"coords": {"layer": np.arange(L), "head": np.arange(H)}}
        dev = xr.Dataset({"S_bar": (("layer", "head"), rng.random((L, H))), "D": (("layer", "head"), rng.random((L, H)))},
                         **layer_head, attrs={**prov, "min_occurrences": 1})
        write_store(dev, store_path("deviation", MODEL, rev, root))
        sub = xr.Dataset({"D_MF": ((), 0.1 * (i + 1)), "head_deviation": (("layer", "head"), rng.random((L, H)))},
                         **layer_head, attrs={**prov, "kernel": "W"})
        write_store(sub, store_path("substitution", MODEL, rev, root))
    # at the last revision: a cross corpus's statistics, a top-N substitution arm, the calibrated kernel
    make_store(store_path("stats", MODEL, rev, root, corpus="other-corpus"), tokens, tracked, U, revision=rev,
               model=MODEL, corpus_fingerprint="beef")
    relabel(store_path("stats", MODEL, rev, root, corpus="other-corpus"), corpus="other-corpus")
    write_store(sub.assign_attrs(n_tracked=5), store_path("substitution", MODEL, rev, root, top_n=5))
    write_calibrated(calibrated_dataset(st.W(min_count=1).fillna(0).values, st, {"calibration_iterations": 1}),
                     store_path("calibrated", MODEL, rev, root))
    # not results: a pass-2 partial (a store of its own) and a store whose write never finished (no zarr.json)
    write_store(dev, root / "deviation" / MODEL / rev / "partials" / "group-00000" / "shard-00000.zarr")
    (root / "deviation" / MODEL / "step99" / "deviation.zarr").mkdir(parents=True)
    return root


def test_list_results_lists_every_store_in_training_order(run):
    import mfpipe

    df = mfpipe.list_results(run)
    rows = [tuple(r) for r in df[["kind", "model", "revision", "step", "half", "corpus", "top_n"]].itertuples(index=False)]
    last = REVISIONS[-1]
    assert rows == [
        ("stats", MODEL, "step4", 4, "stats", None, None),
        ("stats", MODEL, "step4", 4, "eval", None, None),
        ("stats", MODEL, last, 16, "stats", None, None),
        ("stats", MODEL, last, 16, "eval", None, None),
        ("stats", MODEL, last, 16, "stats", "other-corpus", None),
        ("deviation", MODEL, "step4", 4, None, None, None),
        ("deviation", MODEL, last, 16, None, None, None),
        ("substitution", MODEL, "step4", 4, None, None, None),
        ("substitution", MODEL, last, 16, None, None, None),
        ("substitution", MODEL, last, 16, None, None, 5),
        ("kernel", MODEL, "step4", 4, None, None, None),
        ("kernel", MODEL, last, 16, None, None, None),
        ("calibrated", MODEL, last, 16, None, None, None),
    ]
    # each row's path is where store_path puts it, and its values open it
    from mfpipe.results import store_path

    for r in df.itertuples(index=False):
        kw = {"half": r.half or "stats", "corpus": r.corpus, "top_n": r.top_n}
        assert r.path == store_path(r.kind, r.model, r.revision, run, **kw)
        assert mfpipe.open_results(r.kind, r.model, r.revision, run, **kw).attrs["revision"] == r.revision


def test_open_results_gives_what_the_library_readers_give(run):
    """Each store kind is read by the reader its jobs use: the same data, coordinates and provenance attributes."""
    import mfpipe
    from mfpipe.deviation.store import open_deviation
    from mfpipe.experiments.substitution.kernel_dynamics import open_kernel
    from mfpipe.experiments.substitution.substitute import open_result
    from mfpipe.meanfield.calibrated import load_calibrated
    from mfpipe.stats import open_stats, read_attrs

    rev = REVISIONS[-1]
    base = run / "stats" / MODEL / rev
    for half in ("stats", "eval"):
        ds = mfpipe.open_results("stats", MODEL, rev, run, half=half)
        xr.testing.assert_identical(ds, open_stats(base / f"{half}.zarr").ds)
        assert ds.attrs["half"] == half and ds.attrs["model"] == MODEL and "tracked_fingerprint" in ds.attrs
    xr.testing.assert_identical(mfpipe.open_results("stats", MODEL, rev, run, corpus="other-corpus"),
                                open_stats(base / "other-corpus" / "stats.zarr").ds)
    st = mfpipe.open_stats(MODEL, rev, results=run)
    assert type(st).__name__ == "MeanFieldStats"
    xr.testing.assert_identical(st.ds, open_stats(base / "stats.zarr").ds)
    xr.testing.assert_identical(mfpipe.open_stats(base / "eval.zarr").ds, open_stats(base / "eval.zarr").ds)
    assert st.P(layer=1).equals(open_stats(base / "stats.zarr").P(layer=1))

    for kind, reader, path in (
        ("deviation", open_deviation, run / "deviation" / MODEL / rev / "deviation.zarr"),
        ("substitution", open_result, run / "substitution" / MODEL / rev / "substitution.zarr"),
        ("kernel", open_kernel, run / "kernels" / MODEL / rev / "kernel.zarr"),
    ):
        ds = mfpipe.open_results(kind, MODEL, rev, run)
        xr.testing.assert_identical(ds, reader(path))
        assert ds.attrs["model"] == MODEL and ds.attrs["revision"] == rev and ds.attrs["tracked_fingerprint"]
        xr.testing.assert_identical(mfpipe.open_results(kind, MODEL, rev, run, layer=1), reader(path).sel(layer=1))
    arm = mfpipe.open_results("substitution", MODEL, rev, run, top_n=5)
    xr.testing.assert_identical(arm, open_result(run / "substitution" / MODEL / rev / "N5" / "substitution.zarr"))

    cal_path = run / "kernels" / MODEL / rev / "calibrated.zarr"
    cal = mfpipe.open_results("calibrated", MODEL, rev, run)
    xr.testing.assert_identical(cal["U"], load_calibrated(cal_path))
    assert cal.attrs == read_attrs(cal_path) and cal.attrs["kind"] == "calibrated"
    xr.testing.assert_identical(mfpipe.open_results("calibrated", MODEL, rev, run, layer=1)["U"],
                                load_calibrated(cal_path, layer=1))


def test_a_missing_store_is_refused_naming_its_path_and_the_command(run):
    import mfpipe
    from mfpipe.results import ResultsNotFoundError

    cases = [
        (("deviation", MODEL, "step99"), {}, run / "deviation" / MODEL / "step99" / "deviation.zarr"),  # write never finished
        (("calibrated", MODEL, "step4"), {}, run / "kernels" / MODEL / "step4" / "calibrated.zarr"),
        (("stats", "gpt2", "main"), {"half": "eval"}, run / "stats" / "gpt2" / "main" / "eval.zarr"),
    ]
    for args, kw, path in cases:
        with pytest.raises(ResultsNotFoundError) as err:
            mfpipe.open_results(*args, run, **kw)
        msg = str(err.value)
        assert isinstance(err.value, FileNotFoundError)
        assert str(path) in msg and f"snakemake --cores 2 {path}" in msg, msg
    with pytest.raises(FileNotFoundError, match=r"of synth for revision\(s\) step4, step16"):
        mfpipe.open_results("deviation", MODEL, "final", run)
    with pytest.raises(FileNotFoundError, match="holds stats stores of model"):
        mfpipe.open_stats("gpt2", "main", results=run)
    with pytest.raises(TypeError, match="needs its revision"):
        mfpipe.open_stats(MODEL, results=run)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        mfpipe.list_results(run / "nowhere")
    with pytest.raises(ValueError, match="unknown store kind 'rollout'"):
        mfpipe.open_results("rollout", MODEL, "step4", run)
    with pytest.raises(ValueError, match="half= and corpus= select a statistics store"):
        mfpipe.open_results("deviation", MODEL, "step4", run, half="eval")


def test_a_store_of_another_model_or_revision_is_refused(run, tmp_path):
    """A store copied or renamed into another model's or revision's place is refused before it is read, naming the
    path, what it records and the command that rebuilds it; `expect` adds the reader's own checks."""
    import mfpipe
    from mfpipe.results import ProvenanceError

    other = tmp_path / "results"
    src = run / "deviation" / MODEL / "step4" / "deviation.zarr"
    moved = {
        ("deviation", "other-model", "step4"): other / "deviation" / "other-model" / "step4" / "deviation.zarr",
        ("deviation", MODEL, "step8"): other / "deviation" / MODEL / "step8" / "deviation.zarr",
    }
    for path in moved.values():
        shutil.copytree(src, path)
    for (kind, model, rev), path in moved.items():
        with pytest.raises(ProvenanceError) as err:
            mfpipe.open_results(kind, model, rev, other)
        msg = str(err.value)
        assert str(path) in msg and f"snakemake --cores 2 {path}" in msg, msg
        assert re.search(r"model is 'synth', not 'other-model'|revision is 'step4', not 'step8'", msg), msg
    # a statistics half in the other half's place, and the stats store opened as the model's
    shutil.copytree(run / "stats" / MODEL / "step4" / "stats.zarr", other / "stats" / MODEL / "step4" / "eval.zarr")
    with pytest.raises(ProvenanceError, match="half is 'stats', not 'eval'"):
        mfpipe.open_results("stats", MODEL, "step4", other, half="eval")
    with pytest.raises(ProvenanceError, match="half is 'stats', not 'eval'"):
        mfpipe.open_stats(MODEL, "step4", results=other, half="eval")
    shutil.copytree(run / "kernels" / MODEL / "step16", other / "kernels" / MODEL / "step4")
    for kind in ("kernel", "calibrated"):
        with pytest.raises(ProvenanceError, match="revision is 'step16', not 'step4'"):
            mfpipe.open_results(kind, MODEL, "step4", other)
    # a store that records no model at all (an older mfpipe's)
    shutil.copytree(run / "substitution" / MODEL / "step4", other / "substitution" / MODEL / "step4")
    meta = other / "substitution" / MODEL / "step4" / "substitution.zarr" / "zarr.json"
    record = json.loads(meta.read_text())
    del record["attributes"]["model"]
    meta.write_text(json.dumps(record))
    with pytest.raises(ProvenanceError, match="records no 'model'"):
        mfpipe.open_results("substitution", MODEL, "step4", other)
    # further expectations go to the reader
    with pytest.raises(ProvenanceError, match="tracked_fingerprint"):
        mfpipe.open_results("deviation", MODEL, "step4", run, expect={"tracked_fingerprint": "0" * 16})


def test_store_paths_are_the_rules_outputs():
    """Issue 47: the store paths are spelt once, in mfpipe.workflow.paths.STORES (mfpipe.results reads them there): the
    rule that writes each store (RULES) takes its output from there (STORE("<kind>") in the rule files), and no rule
    file or slice planning module spells a store's path itself."""
    from mfpipe.results import RULES, STORES
    from mfpipe.workflow import paths

    assert STORES is paths.STORES and RULES is paths.RULES
    files = sorted((REPO / "workflow" / "rules").glob("*.smk")) + sorted((REPO / "src" / "mfpipe").rglob("rules.py"))
    code = {f: "\n".join(line.split("#")[0] for line in f.read_text().splitlines()) for f in files}
    spelt = [f"{f.name}: {line.strip()}" for f, text in code.items() for line in text.splitlines() if ".zarr" in line]
    assert not spelt, spelt
    rules = "\n".join(code.values())
    for name in STORES:
        block = re.search(rf"^(?:rule|use rule \w+ as) {RULES[name]}\b.*?(?=^\S|\Z)", rules, re.M | re.S)
        assert block, RULES[name]
        assert re.search(rf'STORE\("{name}"[,)]', block.group(0)), (name, block.group(0)[:400])
    assert paths.store_pattern("stats", "res", dataset="eval") == "res/stats/{model}/{revision}/eval.zarr"
    assert paths.store_pattern("jlens", "res", model="m", revision="r") == "res/jlens/m/r/jlens.zarr"
    with pytest.raises(KeyError, match="no wildcard"):
        paths.store_pattern("deviation", "res", dataset="eval")