"""Issue 30: models side by side -- the comparison table's rows from the tables a run writes, and the cross-model
waypoint figure on a common training-token axis."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from figure_data import capture, lines, main_axes

from mfpipe.experiments.crossmodel import compare as C
from mfpipe.experiments.crossmodel import figures as F


def sweep(name, steps, dl, d):
    return pd.DataFrame({"model": name, "revision": [f"step{s}" for s in steps], "step": steps,
                         "L_model": [5.0 - 0.1 * i for i in range(len(steps))], "L_MF": 5.0 + np.asarray(dl) - 0.1 * np.arange(len(steps)),
                         "delta_L": dl, "D_MF": d})


ROLLOUT = pd.DataFrame({"kernel": ["mean_field", "context_free", "uniform", "mean_field"], "pinned": [False, False, False, True],
                        "cosine": [0.98, 0.72, 0.40, 0.99], "rel_error": [0.29, 0.71, 0.95, 0.1]})
RANKING = pd.DataFrame({"rank": [2, 1, 3, 4], "head_label": ["L1H7", "L1H0", "L1H1", "L0H2"],
                        "role": ["induction", np.nan, "duplicate-token", ""], "S_bar": [0.22, 0.31, 0.19, 0.1]})


def test_a_row_reads_every_table_and_finds_the_peaks():
    row = C.comparison_row("a", substitution=sweep("a", [0, 16, 256, 1500], [0.0, 0.3, 0.1, 0.2], [0.2, 0.1, 0.4, 0.3]),
                           rollout=ROLLOUT, ranking=RANKING, tokens_per_step=4096)
    assert row["rollout_cosine"] == 0.98 and row["rollout_rel_error"] == 0.29  # the unpinned mean field
    assert row["best_baseline"] == "context_free" and row["best_baseline_cosine"] == 0.72
    assert row["revision"] == "step1500" and row["delta_L"] == 0.2 and row["D_MF"] == 0.3
    assert row["tokens"] == 1500 * 4096
    assert (row["delta_L_peak"], row["delta_L_peak_revision"], row["delta_L_peak_tokens"]) == (0.3, "step16", 16 * 4096)
    assert (row["D_MF_peak"], row["D_MF_peak_revision"]) == (0.4, "step256")
    assert row["top_heads"] == "L1H0, L1H7 (induction), L1H1 (duplicate-token)"
    # a model without tokens per step keeps its row, without tokens; one without tables has only its name
    assert np.isnan(C.comparison_row("b", substitution=sweep("b", [0, 8], [0.0, 0.1], [0.1, 0.2]))["tokens"])
    df = C.comparison_table([row, C.comparison_row("c")])
    assert list(df["model"]) == ["a", "c"] and list(df.columns[:3]) == ["model", "rollout_cosine", "rollout_rel_error"]


def test_the_figure_puts_every_model_on_one_token_axis(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    a, b = sweep("a", [0, 16, 256], [0.0, 0.3, 0.1], [0.2, 0.1, 0.4]), sweep("b", [0, 8, 64], [0.0, 0.1, 0.2], [0.1, 0.2, 0.3])
    figures = capture(monkeypatch)
    pdf, png = F.crossmodel_figure([{"name": "a", "table": a, "tokens_per_step": 4096, "window": (10, 20)},
                                    {"name": "b", "table": b, "tokens_per_step": 2 ** 21, "window": None}],
                                   tmp_path / "x.pdf", tmp_path / "x.png")
    assert pdf.stat().st_size > 1000 and png.stat().st_size > 1000
    # what is drawn: each model's table against its training tokens (steps times its tokens per step)
    top, mid, bottom = main_axes(figures[-1])
    for name, table, per_step in (("a", a, 4096), ("b", b, 2 ** 21)):
        tokens = table["step"].to_numpy() * per_step
        for ax, key, col in ((top, f"{name} $L_\\mathrm{{model}}$", "L_model"), (top, f"{name} $L_\\mathrm{{MF}}$", "L_MF"),
                             (mid, name, "delta_L"), (bottom, name, "D_MF")):
            x, y = lines(ax)[key]
            np.testing.assert_array_equal(x, tokens)
            np.testing.assert_allclose(y, table[col], rtol=1e-12)
    with pytest.raises(ValueError, match="tokens per step"):
        F.crossmodel_figure([{"name": "a", "table": a, "tokens_per_step": None}], tmp_path / "y.pdf")


def test_the_comparison_row_carries_the_function_vector_transfer():
    """Issue 29: a model with function vectors gets its zero-shot floor, the AIE·raw and MFA·r transfer (summed
    injection, mean over tasks) and its best pipeline; a model without has no such cells."""
    import pandas as pd

    from mfpipe.experiments.crossmodel import compare as C

    rows = []
    for task, acc in (("a", (0.1, 0.5, 0.7)), ("b", (0.3, 0.2, 0.4))):
        rows.append(dict(task=task, protocol="zero-shot", selection="none", construction="none", accuracy=acc[0],
                         ci_lo=0.0, ci_hi=0.5))
        rows.append(dict(task=task, protocol="sum", selection="AIE", construction="raw", accuracy=acc[1], ci_lo=0.4,
                         ci_hi=0.6))
        rows.append(dict(task=task, protocol="sum", selection="MFA", construction="r", accuracy=acc[2], ci_lo=0.6,
                         ci_hi=0.8))
        rows.append(dict(task=task, protocol="sum", selection="random", construction="r", accuracy=0.9, ci_lo=0.8,
                         ci_hi=1.0))
    row = C.comparison_row("m", fv=pd.DataFrame(rows))
    assert row["fv_tasks"] == 2 and row["fv_zero_shot"] == pytest.approx(0.2)
    assert row["fv_AIE_raw"] == pytest.approx(0.35) and row["fv_MFA_r"] == pytest.approx(0.55)
    assert row["fv_best"] == "MFA·r 0.70 [0.60, 0.80] on a"  # the controls are not pipelines
    assert "fv_best" not in C.comparison_row("m")
    table = C.comparison_table([row, C.comparison_row("n")])
    assert list(table.columns[-5:]) == ["fv_tasks", "fv_zero_shot", "fv_AIE_raw", "fv_MFA_r", "fv_best"]
