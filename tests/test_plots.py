"""The figure plumbing every experiment shares (mfpipe.workflow.plots): the ticks of a discrete axis, the training-step
axis and its linear inset of the induction window, read back from the drawn artists."""

from __future__ import annotations

import numpy as np
import pytest
from figure_data import inset, lines, tick_values

from mfpipe.workflow import plots as P

STEPS = np.array([0, 16, 256, 1024, 1056, 1088, 1120, 1152, 1184, 1216, 1312])  # the default config's mini sweep
WINDOW = (1056, 1216)


def _drawn(fig):
    fig.draw_without_rendering()
    return fig


@pytest.mark.parametrize("n", [1, 2, 5, 12, 40])
def test_a_discrete_axis_has_whole_numbers_only(n):
    fig, axes = P.new_figure(2)
    ax, heat = axes[0, 0], axes[0, 1]
    ax.plot(np.arange(n), np.random.default_rng(0).random(n), "o-")
    P.integer_ticks(ax, "x", np.arange(n))
    heat.imshow(np.zeros((n, 3)))
    P.integer_ticks(heat, "y", range(n))
    P.integer_ticks(heat, "x")
    _drawn(fig)
    for a, axis in ((ax, "x"), (heat, "y"), (heat, "x")):
        v = tick_values(a, axis)
        assert v.size and np.array_equal(v, np.round(v)), (axis, v)
    if n <= 16:  # few: a tick at each
        assert tick_values(ax, "x").tolist() == list(range(n)) and tick_values(heat, "y").tolist() == list(range(n))
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert all("." not in t for t in labels), labels


def test_the_step_axis_reads_plain_numbers_and_keeps_the_end_markers_whole():
    fig, axes = P.new_figure(1)
    ax = axes[0, 0]
    ax.plot(STEPS, STEPS / 10, "o-")
    P.step_axis(ax, STEPS)
    _drawn(fig)
    lo, hi = ax.get_xlim()
    assert lo < 0 and hi > STEPS.max()  # padded both ends
    assert {t.get_text() for t in ax.get_xticklabels()} >= {"0", "1", "10", "100", "1000"}
    assert [P.step_label(v) for v in (0, 1000, 20000, 2_097_152, 143_000)] == ["0", "1000", "20k", "2.09715M", "143k"]
    assert P.step_label(1000, linthresh=4096) == ""  # inside the linear stretch of a token axis: no tick to crowd 0


def test_the_window_inset_redraws_the_windows_checkpoints_on_a_linear_axis_away_from_lines_and_legend():
    fig, axes = P.new_figure(1, w=5.2, h=2.6)
    ax = axes[0, 0]
    y = np.where(STEPS >= 1056, 1.0 + (STEPS - 1056) / 100, 1.0)  # flat (across the lower corners), then rising
    P.shade_window(ax, WINDOW)
    ax.plot(STEPS, y, "o-", label="a")
    ax.plot(STEPS, 0.5 * y, "s--", label="b")
    ax.axhline(0.0, color="0.6")
    ax.legend(loc="upper left")
    twin = ax.twinx()
    twin.plot(STEPS, 3 * y, "^-", color="C3", label="c")
    P.step_axis(ax, STEPS, WINDOW)
    _drawn(fig)
    ins = inset(ax)
    assert ins is not None and ins.get_xscale() == "linear"
    lo, hi = ins.get_xlim()
    assert lo < WINDOW[0] and hi > WINDOW[1] and hi - lo < 1.2 * (WINDOW[1] - WINDOW[0])
    got = lines(ins)
    # each line cut to the window's checkpoints and one either side (so it runs to the inset's edges)
    keep = slice(np.flatnonzero(STEPS >= WINDOW[0])[0] - 1, np.flatnonzero(STEPS <= WINDOW[1])[-1] + 2)
    for label, (x, yy) in (("a", (STEPS, y)), ("b", (STEPS, 0.5 * y))):
        np.testing.assert_array_equal(got[label][0], x[keep])
        np.testing.assert_array_equal(got[label][1], yy[keep])
    (twin_inset,) = [a for a in fig.axes if a is not ins and a.get_shared_x_axes().joined(a, ins)]
    np.testing.assert_array_equal(lines(twin_inset)["c"][1], (3 * y)[keep])
    # the window's checkpoints span the inset, not a sliver: 6 of them over most of its width
    x_in = got["a"][0][(got["a"][0] >= lo) & (got["a"][0] <= hi)]
    assert len(x_in) == 6 and (x_in.max() - x_in.min()) / (hi - lo) > 0.8
    # placed clear of the legend and of every line of the panel
    inset_box = ins.get_window_extent()
    assert not inset_box.overlaps(ax.get_legend().get_window_extent())
    for a in (ax, twin):
        for ln in a.get_lines():
            if ln.get_transform() != a.transData:
                continue
            xy = a.transData.transform(np.column_stack([ln.get_xdata(), ln.get_ydata()]))
            t = np.linspace(0, 1, 50)[:, None, None]
            pts = (xy[:-1] * (1 - t) + xy[1:] * t).reshape(-1, 2)
            inside = (pts[:, 0] > inset_box.x0) & (pts[:, 0] < inset_box.x1) & (pts[:, 1] > inset_box.y0) \
                & (pts[:, 1] < inset_box.y1)
            assert not inside.any(), ln.get_label()


def test_no_inset_where_the_band_already_shows_its_checkpoints():
    """Two checkpoints in the window (Pythia's 1000 and 2000), or a window that takes much of the axis: no inset."""
    for steps, window in (([0, 1, 2, 512, 1000, 2000, 4000, 143000], (1000, 2000)), (STEPS, (16, 1312))):
        fig, axes = P.new_figure(1)
        ax = axes[0, 0]
        ax.plot(steps, np.arange(len(steps)), "o-")
        P.step_axis(ax, steps, window)
        assert inset(ax) is None


def test_a_title_past_the_figure_is_wrapped_and_crowded_ticks_thinned(tmp_path):
    """What the ci run's figures showed: a figure title wider than its figure (fig:curves at 4.6 in) and an axis of
    small values whose labels ran into each other (fig:ccmf-scatter's M_cov) -- save_figure leaves neither; a panel
    title is wrapped with its mathtext whole."""
    from matplotlib.ticker import MaxNLocator

    fig, axes = P.new_figure(1, w=3.0, h=2.5)
    ax = axes[0, 0]
    ax.plot([0.0, 0.0017], [0.0, 0.0017], "o")
    ax.xaxis.set_major_locator(MaxNLocator(nbins=12))
    fig.suptitle("Per-layer rollout quality across corpora: mini-gpt2 @ step20 (a long title)")
    ax.set_title(r"Spearman $\rho$($\bar S^{\ell h}$, induction score) of every head at every checkpoint")
    P.save_figure(fig, tmp_path / "f.pdf", tmp_path / "f.png")
    fig.draw_without_rendering()
    page = fig.bbox
    for t in (*fig.texts, ax.title):
        box = t.get_window_extent()
        assert "\n" in t.get_text() and page.x0 <= box.x0 and box.x1 <= page.x1, t.get_text()
    assert all(line.count("$") % 2 == 0 for line in ax.title.get_text().splitlines())  # no mathtext split
    labels = sorted((b.x0, b.x1) for b in (t.get_window_extent() for t in ax.get_xticklabels() if t.get_text()))
    assert len(labels) >= 2 and all(b[0] >= a[1] for a, b in zip(labels, labels[1:]))
