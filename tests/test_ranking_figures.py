"""Exp. 3 (Sec. 6.1, fig:e15-correlation): the cross-head Spearman correlation, its table and figure."""

import math

import numpy as np
import pandas as pd
import pytest
import xarray as xr

from mfpipe.experiments.ranking.exp3 import EXP3_COLUMNS, exp3_table, induction_correlation
from mfpipe.experiments.ranking.figures import exp3_figure


def _da(a, dims=("layer", "head")):
    return xr.DataArray(np.asarray(a, float), dims=dims)


def test_correlation_exact_monotone_cases():
    S = np.array([[0.1, 0.5, 0.2], [0.9, 0.05, 0.3]])
    rho, p, n = induction_correlation(S, S ** 3)  # monotone, not linear: rank correlation exactly 1
    assert rho == pytest.approx(1.0) and n == 6 and p < 0.05
    rho, p, n = induction_correlation(_da(S), _da(-np.log(S)))
    assert rho == pytest.approx(-1.0) and n == 6
    # by hand: ranks (2 5 3 6 1 4) and (3 1 2 6 5 4), sum d^2 = 34, rho = 1 - 6 * 34 / (6 * 35) = 1/35
    ind = np.array([[0.3, 0.1, 0.2], [0.6, 0.5, 0.4]])
    rho, p, _ = induction_correlation(S, ind)
    assert rho == pytest.approx(1 / 35) and 0.5 < p < 1


def test_correlation_pairs_heads_by_name_not_storage_order():
    S = _da([[0.1, 0.5, 0.2], [0.9, 0.05, 0.3]])
    assert induction_correlation(S, S.transpose("head", "layer"))[0] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="different heads"):
        induction_correlation(np.zeros((2, 3)), np.zeros((3, 2)))


def test_correlation_nan_handling():
    S = np.array([[0.1, np.nan, 0.2], [0.9, 0.05, 0.3]])
    ind = np.array([[1.0, 2.0, 2.0], [9.0, np.nan, 3.0]])  # finite in both: (0,0), (0,2), (1,0), (1,2)
    rho, p, n = induction_correlation(S, ind)
    assert n == 4 and rho == pytest.approx(1.0)
    rho, p, n = induction_correlation(np.array([[0.1, 0.2, np.nan]]), np.array([[0.3, 0.4, 0.5]]))
    assert n == 2 and math.isnan(rho) and math.isnan(p)
    rho, p, n = induction_correlation(np.full((2, 3), 0.5), np.arange(6.0).reshape(2, 3))  # constant S_bar
    assert n == 6 and math.isnan(rho) and math.isnan(p)


def test_exp3_table_training_order_and_computed_rows():
    S = np.arange(6.0).reshape(2, 3)
    rows = [
        {"model": "m", "revision": "step512", "step": 512, "S_bar": S, "induction": S ** 2},
        {"model": "m", "revision": "step0", "step": 0, "spearman": 0.1, "p_value": 0.7, "n_heads": 6},
        {"model": "m", "revision": "step64", "step": 64, "S_bar": S, "induction": -S},
    ]
    df = exp3_table(rows)
    assert tuple(df.columns) == EXP3_COLUMNS
    assert list(df["revision"]) == ["step0", "step64", "step512"]
    np.testing.assert_allclose(df["spearman"], [0.1, -1.0, 1.0])
    assert list(df["n_heads"]) == [6, 6, 6]
    # unknown steps: the given order is kept
    df = exp3_table([dict(rows[1], step=None, revision="b"), dict(rows[1], step=None, revision="a")])
    assert list(df["revision"]) == ["b", "a"]


def test_exp3_figure_plots_its_inputs(tmp_path, monkeypatch):
    from mfpipe.experiments.ranking import figures

    captured = {}
    real = figures.save_figure
    monkeypatch.setattr(figures, "save_figure",
                        lambda fig, pdf, png, dpi=150: (captured.setdefault("fig", fig), real(fig, pdf, png, dpi=dpi)))
    df = pd.DataFrame({"model": "m", "revision": ["step0", "step512", "step1000", "step143000"],
                       "step": [0, 512, 1000, 143000], "spearman": [0.02, 0.37, 0.71, np.nan],
                       "p_value": [0.8, 0.01, 1e-9, np.nan], "n_heads": [144, 144, 144, 2]})
    csv = tmp_path / "exp3.csv"
    df.iloc[::-1].to_csv(csv, index=False)  # out of order on disk: the figure sorts by step
    pdf, png = exp3_figure(csv, tmp_path / "e15", window=(1000, 2000), title="Pythia-160m")
    assert pdf == tmp_path / "e15.pdf" and png == tmp_path / "e15.png"
    assert pdf.stat().st_size > 0 and png.stat().st_size > 0
    ax = captured["fig"].axes[0]
    assert ax.get_xscale() == "symlog"
    by_gid = {line.get_gid(): line for line in ax.get_lines() if line.get_gid()}
    np.testing.assert_array_equal(by_gid["significant"].get_xdata(), [512, 1000])
    np.testing.assert_array_equal(by_gid["not-significant"].get_xdata(), [0, 143000])
    np.testing.assert_allclose(by_gid["significant"].get_ydata(), [0.37, 0.71])
    span = [p for p in ax.patches if p.get_label() == "induction window"]
    assert len(span) == 1 and span[0].get_x() == 1000 and span[0].get_x() + span[0].get_width() == 2000
    with pytest.raises(ValueError, match="training step"):
        exp3_figure(df.assign(step=[0, None, 2, 3]), tmp_path / "bad")


def test_figure_outputs_keep_the_dots_of_a_model_name():
    """A stem such as `ccmf_scatter_llama-3.2-3b_main` names its files by appending the suffix (with_suffix would cut
    it at the model name's dot and write `ccmf_scatter_llama-3.pdf`)."""
    from pathlib import Path

    from mfpipe.workflow.plots import figure_paths

    stem = Path("results/figures/ccmf_scatter_llama-3.2-3b_main")
    want = (Path(f"{stem}.pdf"), Path(f"{stem}.png"))
    assert figure_paths(stem) == want and figure_paths(f"{stem}.png") == want and figure_paths(f"{stem}.pdf") == want
