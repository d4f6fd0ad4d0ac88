"""Figure plumbing shared by every experiment's figures: the house style, a figure without pyplot (the Agg canvas
of :class:`matplotlib.figure.Figure`, no global backend state), output paths, the atomic writer (a temporary sibling,
then a rename: an interrupted job leaves no figure Snakemake would take as done), the ticks of a discrete axis
(:func:`integer_ticks`: layers, heads, blocks, depths, positions, ranks, never at 0.25) and the training-step axis of
the figures across checkpoints (:func:`step_axis`: symlog, plain step numbers, and with the induction window a linear
inset of it, :func:`window_inset`, where the symlog axis crams the window's checkpoints into a sliver). matplotlib
is imported when a figure is made, not when this module is."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd

from mfpipe.workflow.io import atomic_file

__all__ = ["read_table", "new_figure", "figure_paths", "save_figure", "fit_texts", "step_axis", "step_label",
           "shade_window", "integer_ticks", "plain_log_axis", "window_inset"]

plt_rc = {"font.size": 10, "axes.titlesize": 11, "axes.labelsize": 10, "legend.fontsize": 8,
          "xtick.labelsize": 9, "ytick.labelsize": 9}


def read_table(t) -> pd.DataFrame:
    return t.copy() if isinstance(t, pd.DataFrame) else pd.read_csv(t)


def new_figure(ncols: int, nrows: int = 1, w: float = 3.6, h: float = 3.0):
    import matplotlib
    from matplotlib.figure import Figure

    matplotlib.rcParams.update(plt_rc)
    fig = Figure(figsize=(w * ncols, h * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, axes


def figure_paths(out, png=None) -> tuple[Path, Path]:
    """(pdf, png) from a stem (``results/figures/x``), a path with either suffix, or both paths."""
    if png is not None:
        return Path(out), Path(png)
    p = Path(out)
    # by name, not with_suffix: a stem may hold dots of its own (`rollout_llama-3.2-3b_main`)
    stem = p.parent / p.stem if p.suffix in (".pdf", ".png") else p
    return stem.parent / f"{stem.name}.pdf", stem.parent / f"{stem.name}.png"


def save_figure(fig, pdf: str | Path, png: str | Path, dpi: int = 150) -> None:
    """Write ``fig`` to ``pdf`` and ``png``, each atomically (temporary sibling, then rename), once its titles and
    labels fit and no tick labels overlap (:func:`fit_texts`)."""
    fit_texts(fig)
    for path, kw in ((Path(pdf), {"metadata": {"CreationDate": None}}), (Path(png), {"dpi": dpi})):
        with atomic_file(path) as tmp:
            fig.savefig(tmp, format=path.suffix[1:], **kw)


def _wrap(text: str, width: int) -> str:
    """``text`` on lines of at most ``width`` characters (a longer word alone), a mathtext ``$…$`` never split."""
    words = re.findall(r"(?:\$[^$]*\$|[^\s$])+", text)
    lines, line = [], ""
    for w in words:
        if line and len(line) + 1 + len(w) > width:
            lines.append(line)
            line = w
        else:
            line = f"{line} {w}" if line else w
    return "\n".join(lines + [line])


def _fit_text(t, limit: float, along_y: bool = False) -> bool:
    """Wrap the text artist ``t`` to ``limit`` display units (its height for a rotated axis label), or to the figure
    where it runs past the figure's edge; True if changed."""
    text = t.get_text()
    bb = t.get_window_extent()
    fig = t.get_figure(root=True).bbox
    size = bb.height if along_y else bb.width
    outside = bb.x0 < fig.x0 - 0.5 or bb.x1 > fig.x1 + 0.5 or bb.y0 < fig.y0 - 0.5 or bb.y1 > fig.y1 + 0.5
    if outside:
        limit = min(limit, 0.95 * (fig.height if along_y else fig.width))
    if not text or (size <= limit and not outside) or len(text) < 12:
        return False
    lines = text.split("\n")  # each line wrapped (a line of its own stays one), to the width that fits the longest
    width = max(8, int(max(len(line) for line in lines) * limit / size) - 1)
    wrapped = "\n".join(_wrap(line, width) for line in lines)
    if wrapped == text:
        return False
    t.set_text(wrapped)
    return True


def _crowded(labels) -> bool:
    """Whether consecutive drawn tick labels (sorted along the axis) overlap."""
    boxes = sorted((b.x0, b.x1) for b in (t.get_window_extent() for t in labels if t.get_visible() and t.get_text()))
    return any(nxt[0] < prev[1] + 1.0 for prev, nxt in zip(boxes, boxes[1:]))


def _thin(axis) -> bool:
    """Fewer labelled ticks on a crowded x axis: the minor labels dropped first, then half of matplotlib's own major
    ticks (a fixed set, e.g. categories or the checkpoints drawn, is left as it is); True if changed."""
    from matplotlib.ticker import MaxNLocator, NullFormatter

    if any(t.get_text() for t in axis.get_ticklabels(minor=True)):
        axis.set_minor_formatter(NullFormatter())
        return True
    locator = axis.get_major_locator()
    n = sum(1 for t in axis.get_ticklabels() if t.get_text())
    if isinstance(locator, MaxNLocator) and n > 2:
        locator.set_params(nbins=max(2, n // 2))
        return True
    return False


def fit_texts(fig, rounds: int = 4) -> None:
    """No clipped or overrunning text: a figure title wider than the figure, a panel title or axis label running far
    past its panel, or any of them past the figure's edge, is wrapped onto lines (mathtext kept whole); crowded x tick
    labels are thinned
    (:func:`_thin`). Drawn once per round (the layout moves as texts change), until nothing changes."""
    for _ in range(rounds):
        fig.draw_without_rendering()
        changed = False
        for t in fig.texts:
            changed |= _fit_text(t, 0.98 * fig.bbox.width)
        for ax in fig.axes:
            if not ax.get_visible() or not ax.axison:
                continue
            # a panel's title or label may overrun its panel a little (a heatmap's square box is narrow), not far;
            # a colour bar's label only the figure
            bar = ax.get_label() == "<colorbar>"
            changed |= _fit_text(ax.title, 1.3 * ax.bbox.width)
            changed |= _fit_text(ax.xaxis.label, 1.3 * ax.bbox.width)
            changed |= _fit_text(ax.yaxis.label, fig.bbox.height if bar else 1.25 * ax.bbox.height, along_y=True)
            for a in (ax, *ax.child_axes):
                if _crowded(a.xaxis.get_ticklabels(minor=True) + a.xaxis.get_ticklabels()):
                    changed |= _thin(a.xaxis)
        if not changed:
            return


def integer_ticks(ax, axis: str = "x", values=None, every_up_to: int = 16) -> None:
    """A discrete axis (layers, heads, blocks, depths, positions, ranks): ticks at whole numbers only, labelled as
    such (``1``, not ``1.0``). With ``values`` (the positions drawn) and at most ``every_up_to`` of them, a tick at
    each; otherwise matplotlib's choice among the integers. A heatmap's cells (``imshow``) sit at 0 … n-1."""
    from matplotlib.ticker import FixedLocator, MaxNLocator, NullLocator

    a = ax.xaxis if axis == "x" else ax.yaxis
    v = None if values is None else np.unique(np.asarray(values, dtype=float))
    v = None if v is None else v[np.isfinite(v)]
    if v is not None and 0 < v.size <= every_up_to and np.array_equal(v, np.round(v)):
        a.set_major_locator(FixedLocator(v))
    else:
        a.set_major_locator(MaxNLocator(integer=True))
    a.set_minor_locator(NullLocator())


def plain_log_axis(ax, axis: str, values) -> None:
    """A log axis read as plain numbers (``1.05``, ``20``, not ``1.05×10^0``): where ``values`` span less than a
    decade the in-between ticks are labelled too (matplotlib labels them there anyway), otherwise the decades only."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v) & (v > 0)]
    a = ax.xaxis if axis == "x" else ax.yaxis
    plain = FuncFormatter(lambda x, _pos: f"{x:g}")
    a.set_major_formatter(plain)
    a.set_minor_formatter(plain if v.size and v.max() < 10 * v.min() else NullFormatter())


def step_label(v, linthresh: float = 1.0) -> str:
    """A tick of a training axis (steps, tokens) as a plain number (``1000``, ``20k``, ``4M``), not ``10^3``; blank
    strictly between 0 and ``linthresh`` (the symlog axis' linear stretch, where a decade tick would crowd 0)."""
    v = float(v)
    if 0 < abs(v) < linthresh:
        return ""
    if abs(v) < 1e4:
        return f"{v:.0f}"
    return f"{v / 1e3:g}k" if abs(v) < 1e6 else f"{v / 1e6:g}M" if abs(v) < 1e9 else f"{v / 1e9:g}G"


def step_axis(ax, steps, window=None, label: str = "training step (symlog)", linthresh: float = 1.0) -> None:
    """Training steps on a symmetric-log x axis (linear on [0, ``linthresh``], logarithmic above), so step 0 sits at
    0 with the log-spaced checkpoints spread out; the plotted x values are the steps themselves (or tokens: any
    training axis). The ends are padded so the first and last checkpoints' markers are whole; ticks read as plain
    numbers (:func:`step_label`). With the induction ``window`` ``(start, stop)``, a linear inset of it
    (:func:`window_inset`). Call it once the panel (and any twin axis, legend) is drawn: the inset copies the lines
    drawn."""
    from matplotlib.ticker import FuncFormatter

    ax.set_xscale("symlog", linthresh=float(linthresh))
    ax.set_xlabel(label)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: step_label(v, float(linthresh))))
    s = np.asarray(steps, dtype=float)
    s = s[np.isfinite(s)]
    if s.size:
        forward = ax.xaxis.get_transform()
        lo, hi = forward.transform([max(0.0, float(s.min())), float(s.max())])
        pad = 0.04 * (hi - lo) if hi > lo else 0.5
        x0, x1 = forward.inverted().transform([lo - pad, hi + pad])
        ax.set_xlim(x0, x1)
        labelled = [v for v in ax.xaxis.get_major_locator().tick_values(x0, x1)
                    if x0 <= v <= x1 and step_label(v, float(linthresh))]
        if len(labelled) < 2:  # the checkpoints within one decade: ticks at the checkpoints themselves
            from matplotlib.ticker import FixedLocator

            u = np.unique(s)
            ax.xaxis.set_major_locator(FixedLocator(u[:: max(1, int(np.ceil(len(u) / 8)))]))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: step_label(v)))
    if window is not None:
        window_inset(ax, window)


WINDOW_COLOR = "#ffb74d"
INSET_MIN_CHECKPOINTS = 3  # checkpoints in the window below which the band alone shows them all
INSET_MAX_SHARE = 0.3  # the window's share of the axis width above which it is no sliver
# where an inset may go, in the panel's axes fraction (x0, y0, width, height), in the order preferred among equally
# empty places: a grid from the upper right corner, kept clear of the panel's edges so that the inset's own tick
# labels stay inside the panel
INSET_PLACES = [(float(x0), float(y0), 0.4, 0.4) for y0 in np.linspace(0.5, 0.13, 6) for x0 in np.linspace(0.57, 0.12, 7)]


def _data_lines(a):
    """The lines of ``a`` drawn in data coordinates (not axhline / axvline, whose x or y is the axes' own)."""
    return [ln for ln in a.get_lines() if ln.get_transform() == a.transData and len(ln.get_xdata())]


def _twins(ax) -> list:
    """Axes drawn on ``ax``'s box sharing its x axis (``twinx``)."""
    return [a for a in ax.figure.axes if a is not ax and ax.get_shared_x_axes().joined(ax, a)
            and a.get_position().bounds == ax.get_position().bounds]


def _occupancy(ax, axes, rect) -> float:
    """How much of what ``axes`` draw falls in ``rect`` (``ax``'s axes fraction): the lines sampled densely along
    their segments, and any legend's box (by the area it shares with ``rect``, far costlier than a line). The inset's
    tick labels (left, below) and title (above) count as part of it."""
    x0, y0, w, h = rect
    x0, y0, w, h = x0 - 0.08, y0 - 0.08, w + 0.08, h + 0.16
    to_frac = ax.transAxes.inverted()
    score = 0.0
    for a in axes:
        for ln in _data_lines(a):
            xy = to_frac.transform(a.transData.transform(np.column_stack([ln.get_xdata(), ln.get_ydata()]).astype(float)))
            xy = xy[np.isfinite(xy).all(1)]
            if len(xy) > 1:
                t = np.linspace(0.0, 1.0, 24)[:, None, None]
                xy = (xy[:-1] * (1 - t) + xy[1:] * t).reshape(-1, 2)
            score += float(((xy[:, 0] >= x0) & (xy[:, 0] <= x0 + w) & (xy[:, 1] >= y0) & (xy[:, 1] <= y0 + h)).sum())
        leg = a.get_legend()
        if leg is not None:
            (lx0, ly0), (lx1, ly1) = to_frac.transform(leg.get_window_extent().get_points())
            overlap = max(0.0, min(lx1, x0 + w) - max(lx0, x0)) * max(0.0, min(ly1, y0 + h) - max(ly0, y0))
            score += 1e5 * overlap
    return score


def _copy_lines(src, dst, lo: float, hi: float) -> tuple[float, float] | None:
    """``src``'s data lines onto ``dst``, each cut to the checkpoints in ``[lo, hi]`` and one either side (the lines
    run to the inset's edges); returns the y range they take within ``[lo, hi]`` (interpolated at its ends)."""
    ys = []
    for ln in _data_lines(src):
        x, y = np.asarray(ln.get_xdata(), dtype=float), np.asarray(ln.get_ydata(), dtype=float)
        order = np.argsort(x, kind="stable")
        x, y = x[order], y[order]
        inside = np.flatnonzero((x >= lo) & (x <= hi))
        if not inside.size:
            continue
        keep = slice(max(0, inside[0] - 1), min(len(x), inside[-1] + 2))
        dst.plot(x[keep], y[keep], color=ln.get_color(), ls=ln.get_linestyle(), lw=ln.get_linewidth(),
                 marker=ln.get_marker(), ms=ln.get_markersize(), mfc=ln.get_markerfacecolor(),
                 mec=ln.get_markeredgecolor(), gid=ln.get_gid(), label=ln.get_label())
        fin = np.isfinite(x) & np.isfinite(y)
        if fin.sum() >= 2:
            ys += [float(np.interp(lo, x[fin], y[fin])), float(np.interp(hi, x[fin], y[fin]))]
        ys += [v for v in y[inside] if np.isfinite(v)]
    return (min(ys), max(ys)) if ys else None


def _drawn_loc(a, legend) -> str:
    """The named location (``"upper right"`` …) of where ``legend`` was drawn on ``a``: its centre's third of the
    axes each way."""
    (x0, y0), (x1, y1) = a.transAxes.inverted().transform(legend.get_window_extent().get_points())
    cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
    h = "left" if cx < 1 / 3 else "right" if cx > 2 / 3 else "center"
    v = "lower" if cy < 1 / 3 else "upper" if cy > 2 / 3 else "center"
    return "center" if h == v == "center" else f"{v} {h}"


def window_inset(ax, window, min_checkpoints: int = INSET_MIN_CHECKPOINTS, max_share: float = INSET_MAX_SHARE):
    """A linear-axis inset of the induction ``window`` ``(start, stop)`` on a training-step panel: the panel's lines
    (and its twin's, on a twin axis of the inset) cut to the window, so the checkpoints a symlog axis crams into a
    sliver are spread out. Only where that happens: at least ``min_checkpoints`` drawn steps in the window, the window
    at most ``max_share`` of the axis. Placed where it covers the least of the lines and no legend (a
    legend is pinned where it was first drawn). Returns the inset (gid ``window-inset``), or
    None."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    lo, hi = float(window[0]), float(window[1])
    axes = [ax, *_twins(ax)]
    steps = {float(v) for a in axes for ln in _data_lines(a) for v in np.asarray(ln.get_xdata(), dtype=float)
             if lo <= v <= hi}
    if not hi > lo or len(steps) < min_checkpoints:
        return None
    forward = ax.xaxis.get_transform()
    (a0, a1), (w0, w1) = forward.transform(list(ax.get_xlim())), forward.transform([lo, hi])
    if (w1 - w0) > max_share * abs(a1 - a0):
        return None
    fig = ax.figure
    fig.draw_without_rendering()  # the layout and the legends' places, as they will be drawn
    for a in axes:  # pinned where drawn: "best" would move a legend onto the inset, which takes the emptiest corner
        leg = a.get_legend()
        if leg is not None and leg.get_bbox_to_anchor().bounds == a.bbox.bounds:
            leg.set_loc(_drawn_loc(a, leg))
    rect = min(INSET_PLACES, key=lambda r: _occupancy(ax, axes, r))
    ins = ax.inset_axes(rect, zorder=5)
    pad = 0.06 * (hi - lo)
    for src, dst in zip(axes, [ins] + [ins.twinx() for _ in axes[1:]]):
        dst.set_gid("window-inset")  # a twin of the inset is a figure axes of its own: marked too
        span = _copy_lines(src, dst, lo, hi)
        if span is not None:
            y0, y1 = span
            m = 0.1 * (y1 - y0) if y1 > y0 else max(abs(y0) * 0.05, 1e-12)
            dst.set_ylim(y0 - m, y1 + m)
        dst.yaxis.set_major_locator(MaxNLocator(3))
        dst.tick_params(labelsize=6, pad=1, length=2)
    bands = [(pa.get_x(), pa.get_x() + pa.get_width(), pa.get_facecolor()) for pa in ax.patches
             if pa.get_data_transform() == ax.get_xaxis_transform() and hasattr(pa, "get_width")]  # axvspan
    for x0, x1, color in bands or [(lo, hi, WINDOW_COLOR)]:
        ins.axvspan(x0, x1, color=color, lw=0, zorder=0, **({} if bands else {"alpha": 0.3}))
    ins.set_xlim(lo - pad, hi + pad)
    ins.xaxis.set_major_locator(MaxNLocator(4, integer=True))
    ins.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: step_label(v)))
    ins.set_title("induction window (linear)", fontsize=6, pad=2)
    return ins


def shade_window(ax, window) -> None:
    """The induction-formation window ``(start, stop)``, when known."""
    if window is not None:
        ax.axvspan(float(window[0]), float(window[1]), color=WINDOW_COLOR, alpha=0.3, lw=0, label="induction window",
                   zorder=0)
