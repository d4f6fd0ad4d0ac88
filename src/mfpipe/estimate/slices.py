"""The prices of the jobs :mod:`mfpipe.estimate.costs` did not price before issue 58: the positional slice's two forward
jobs, the corpus stage's token counts, and the jobs whose work is small beside their process's start-up (tables and
figures drawn from small CSV/JSON files, a store's few arrays), named here one by one so that a rule nobody priced is
seen (:func:`mfpipe.estimate.costs.priced`), never counted as start-up in silence.

Each formula takes ``(ctx, c, wildcards)`` (:class:`mfpipe.estimate.costs.Context`, the model's calibration or None)
and gives ``(work seconds, disk bytes)``; :data:`EXTRA_PEAK` gives the MiB a job holds beyond its calibrated stage
(the positional job's occurrences, the ablation's attention patterns)."""

from __future__ import annotations

import math

__all__ = ["SLICE_RULES", "STARTUP_ONLY", "EXTRA_PEAK", "kernel_cells", "occurrences", "count_tokens", "OFFSET_BINS",
           "cluster_bound"]


def kernel_cells(c: dict, config: dict) -> float:
    """Cells of a statistics store's kernel sums, L·H·N·(N+2), at the config's N (what a store job reads)."""
    n = int(config["tracked"]["n_tracked"])
    return c["layers"] * c["heads"] * n * (n + 2)


def _primary(ctx) -> tuple[str, int]:
    corpus = ctx.config["corpus"]["name"]
    return corpus, ctx.T(corpus)


def _eval_windows(ctx, model: str) -> int:
    corpus, _ = _primary(ctx)
    return ctx.windows(model, corpus, "eval")


def occurrences(ctx, c, wc) -> tuple[int, int]:
    """(windows, query occurrences) of the positional job's natural sample
    (:func:`mfpipe.experiments.positional.collect.sample_occurrences`): ``positional.tokens // T`` eval windows, one
    position in ``stride`` from ``min_position``, every one counted (an upper bound: the job drops untracked ones)."""
    p = ctx.config["positional"]
    _, T = _primary(ctx)
    windows = min(_eval_windows(ctx, wc["model"]), int(p["tokens"]) // T)
    per_window = max(math.ceil((T - int(p["min_position"])) / int(p["stride"])), 0)
    return windows, windows * per_window


def positional(ctx, c, wc):
    """Two deviation forwards (pass 2's, :func:`mfpipe.meanfield.forward.deviation_forward`) per sampled window (the
    streamed collection's two passes, :mod:`mfpipe.experiments.positional.stream`: the second reads the cluster's
    heads and the decode's folds, known only after the first), and one per repeated ``[BOS; c; c]`` sequence of
    ``2k + 1`` tokens; the kernel read from the statistics store."""
    p = ctx.config["positional"]
    _, T = _primary(ctx)
    windows, _ = occurrences(ctx, c, wc)
    k = int(p["repeated"]["chunk_length"] or (T - 1) // 2)
    repeated = min(int(p["repeated"]["n_sequences"]), _eval_windows(ctx, wc["model"])) * (2 * k + 1)
    tokens = 2 * windows * T + repeated
    return (tokens * c["pass2_s_per_token"] + c["pass2_first_s"]
            + kernel_cells(c, ctx.config) * c["store_read_s_per_cell"]), 0.0


def positional_ablation(ctx, c, wc):
    """Per window: the unablated forward and one per arm (carriers, non-carriers, ``n_random`` random subspaces),
    each with its loss through the LM head (:func:`mfpipe.experiments.positional.ablation.run_ablation`)."""
    p = ctx.config["positional"]
    _, T = _primary(ctx)
    n = min(int(p["ablation_windows"]), _eval_windows(ctx, wc["model"]))
    runs = 1 + 2 + int(p["n_random"])
    per_token = c["forward_s_per_token"] + c.get("lm_head_s_per_token", 0.0)
    return n * T * runs * per_token + kernel_cells(c, ctx.config) * c["store_read_s_per_cell"], 0.0


def _dtype_bytes(ctx, model: str) -> int:
    spec = ctx.models.get(model, {})
    return 4 if str(spec.get("dtype") or ctx.config["runtime"]["dtype"]) == "float32" else 2


def _out_proj_mb(c) -> float:
    """``O [L, H, dh, d]`` in float32 (both positional jobs hold it, widened a head at a time): L·d·d·4 bytes where
    H·dh = d."""
    d_head = c.get("d_head") or c["d_model"] / c["heads"]
    return c["layers"] * c["heads"] * d_head * c["d_model"] * 4 / 2**20


# the offset bins of the cluster's cells: mfpipe.experiments.positional.fits.offset_features's one-hot offsets 0..7
# and bins [8, 16), [16, 32), ..., [256, ∞) (a core module does not import an experiment's; a test ties the two)
OFFSET_BINS = 14


def cluster_bound(n_heads: int, p: dict) -> int:
    """The most heads the positional cluster can hold: :func:`mfpipe.experiments.positional.analysis.n_top`'s
    ``top_fraction`` of ``n_heads`` rounded half up, at least ``min_top``, at most all (a test ties the two)."""
    return int(min(n_heads, max(int(p["min_top"]), math.floor(float(p["top_fraction"]) * n_heads + 0.5))))


def positional_peak(ctx, c, wc) -> float:
    """The streamed occurrences (:mod:`mfpipe.experiments.positional.stream`, :mod:`~mfpipe.experiments.positional.
    cells`): per occurrence its window, position, type and position index twice (int64) and valid flag; per head and
    occurrence D and the untracked share (float32) and, on a learned position table, the decode's fold (int8) and
    shuffled position (int32); a(p) of the cluster's heads (float32); every head's Δ sums and count per sampled
    position and its scatter (float64), with a position table the decode's five folds' moments; per cluster head
    (at most the top ``top_fraction`` of them: the bound) Δ's sums and count per (position, offset bin) cell, a(p)'s
    per position and the offsets' histogram; a batch's Δ in float32 and three float64 copies; O. Δ of each head and
    occurrence (``4·dh`` bytes) is never held: only the per-occurrence scalars grow with ``positional.tokens``. Its
    forwards are pass 2's (its peak stage), its arrays the kernel's, not pass 2's float64 sums (``pass2_sums_mb``, at
    full depth: 7.9 GB at Qwen3-14B's shape), which are taken off."""
    p = ctx.config["positional"]
    _, T = _primary(ctx)
    _, n = occurrences(ctx, c, wc)
    LH, dh = c["layers"] * c["heads"], c.get("d_head") or c["d_model"] / c["heads"]
    K, bins = cluster_bound(LH, p), OFFSET_BINS
    wpos = bool(c.get("wpos", True))  # (a calibration without the flag: priced as decoding)
    positions = max(math.ceil((T - int(p["min_position"])) / int(p["stride"])), 1)
    held = n * (5 * 8 + 1 + LH * (8 + 5 * wpos) + 4 * K)
    moments = LH * 8 * (positions * (dh + 1) + dh * dh + wpos * 5 * (dh * dh + 3 * dh + 5))
    cluster = K * 8 * (positions * bins * (dh + 1) + positions + T + dh + 3)
    batch = int(p["batch_size"] or ctx.config["runtime"]["batch_size"]) * positions * LH * (dh * (4 + 3 * 8) + 20)
    return (held + moments + cluster + batch) / 2**20 + _out_proj_mb(c) - c.get("pass2_sums_mb", 0.0)


def ablation_peak(ctx, c, wc) -> float:
    """Every layer's attention pattern ``[B, H, T, T]`` of a batch, unablated and under the carriers' arm, kept on
    the host at the model's width for the consumers' change (one layer's pair of them in float64 as it is taken); O
    twice in float32 (the job's and the ablation's own)."""
    p = ctx.config["positional"]
    _, T = _primary(ctx)
    B = int(p["batch_size"] or ctx.config["runtime"]["batch_size"])
    pattern = B * c["heads"] * T * T
    patterns = 2 * pattern * (c["layers"] * _dtype_bytes(ctx, wc["model"]) + 8) / 2**20
    return patterns + 2 * _out_proj_mb(c)


def count_tokens(ctx, c, wc):
    """The stats half's shards read and their types counted (:func:`mfpipe.corpus.tracked.count_types`), at the
    rate timed beside the start-ups (``count_s_per_token``)."""
    corpus = wc.get("corpus") or ctx.config["corpus"]["name"]
    model = wc.get("model")
    tokens = ctx.windows(model, corpus, "stats") * ctx.T(corpus) if model else 0
    return tokens * ctx.startup.get("count_s_per_token", 0.0), 0.0


def startup_only(ctx, c, wc):
    """Work small beside the job's start-up (measured by its kind: a table's, a figure's, a store's imports)."""
    return 0.0, 0.0


def kernel_column(ctx, c, wc):
    """The statistics store's P read for its <bos> column: the chunks hold every key, so all of it."""
    return kernel_cells(c, ctx.config) * c["store_read_s_per_cell"], 0.0


CARD_BYTES = 16e3  # one head card of the explorer: its scores, rows, kernel heatmap and contexts (~13 kB measured)


def explorer(ctx, c, wc):
    """One model's explorer (mfpipe.explorer): every revision's statistics store read for the kernel heatmaps (P and
    W = P / n̄: the kernel cells twice) and a card written per head and revision."""
    if c is None:
        return 0.0, 0.0
    revs = len(ctx.revisions(wc["model"]))
    seconds = 2 * revs * kernel_cells(c, ctx.config) * c["store_read_s_per_cell"]
    return seconds, revs * c["layers"] * c["heads"] * CARD_BYTES


# jobs whose work is their start-up: tables and figures from small CSV / JSON files, model-free jobs on a store's small
# arrays (S̄ per head, the substitution results) -- each named, so that a new rule is seen unpriced until it is
STARTUP_ONLY = {
    # tables
    "coverage_table", "zipf", "run_costs", "crossmodel_table", "induction_table", "exp3_single", "rollout_table",
    "substitution_table", "substitution_topn_table", "calibrated_recompute",
    # figures (the figure start-up draws and saves one)
    "figure_waypoint", "figure_rollout", "figure_teacher_forced", "figure_error_decomposition", "figure_clustering",
    "figure_cross_corpus", "figure_curves", "figure_icl_classes", "figure_icl_meter", "figure_fv", "figure_fv_clean",
    "figure_crossmodel", "figure_topn", "figure_divergence", "figure_positional", "figure_vocab_mfgap",
    # figures and tables from the deviation stores' and the kernels' small arrays
    "exp3_correlation", "ranking", "kernel_dynamics",
    # a tokenizer's few-shot tasks
    "minisuite_tasks",
    # the explorer's shared assets (a copy of plotly.js) and its index over the models
    "explorer_assets", "explorer_index",
}
SLICE_RULES = {"positional": positional, "positional_ablation": positional_ablation, "tracked_types": count_tokens,
               "tracked_types_topn": count_tokens, "tracked_types_excl": count_tokens, "rank_frequency": count_tokens,
               "ranking_roles": kernel_column, "explorer": explorer, **dict.fromkeys(STARTUP_ONLY, startup_only)}
EXTRA_PEAK = {"positional": positional_peak, "positional_ablation": ablation_peak}
