"""The cost model of `mfpipe estimate`: each job's predicted seconds, peak host memory and the disk its output
keeps, from what it works through (its rule, its model's shape, the config's sizes, the corpus halves' predicted
windows) and the calibration's measured rates on this device (:mod:`mfpipe.estimate.calibrate`).

A job costs its process's start-up (a model job's: imports and the loaded model, measured; a store, figure or table
job's: its imports, measured) plus its work. The work is what dominates the job's code (the rule's job function),
counted and priced by the calibration: tokens through a corpus pass at the pass's measured seconds per token,
kernel cells through a store's write and read, heads through a Gram matrix and its eigendecomposition, pair
weights through the calibrated kernel's passes, J-lens positions, training tokens. :data:`RULES` maps each rule to
its formula (with :mod:`mfpipe.estimate.slices`'s: the positional slice, the token counts, the jobs whose work is their
start-up, each named); a rule not there is unpriced (:func:`priced`): it costs its start-up, and `mfpipe estimate`
prints it on a line of its own."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from mfpipe.estimate.corpus_memory import corpus_peak_mb
from mfpipe.estimate.prompts import PROMPT_PEAK, PROMPT_RULES
from mfpipe.estimate.slices import EXTRA_PEAK, SLICE_RULES
from mfpipe.estimate.weights import STARTUP_READS, streamed, weight_reads

__all__ = ["Context", "job_cost", "RULES", "FIGURE_RULES", "priced", "kept"]

FIGURE_RULES = {"figure_waypoint", "figure_rollout", "figure_teacher_forced", "figure_error_decomposition",
                "figure_clustering", "figure_cross_corpus", "figure_icl_classes", "figure_icl_meter", "figure_fv",
                "figure_crossmodel", "figure_topn", "figure_divergence", "figure_curves", "figure_positional",
                "figure_fv_clean", "figure_vocab_mfgap", "zipf"}
# figures drawn from stores (the deviation stores, the kernels): a store job's start-up and a figure's
STORE_FIGURE_RULES = {"exp3_correlation", "ranking", "kernel_dynamics"}
STORE_RULES = {"stats_merge", "deviation_merge", "kernel_revision", "calibrate_kernel", "attention_coverage",
               "substitution_table", "substitution_topn_table", "ranking_roles",
               "explorer"}  # model-free jobs that open Zarr stores

# float32 copies of a store's kernel cells a store job holds at its peak: a merge or a kernel job a few of the whole
# store's (the default, 3), the explorer a revision's P whole (854 MiB measured at GPT-2 small's shape, 850 so), the
# roles table a layer's chunk and its decompression at a time (its <bos> column read through the chunks: 433 and 393)
STORE_COPIES = {"explorer": lambda c: 1.0, "ranking_roles": lambda c: 2.0 / c["layers"]}


@dataclass
class Context:
    """What a job's cost is computed from: the validated ``config``, the ``corpus`` prediction
    (:func:`mfpipe.estimate.jobs.predict_corpus`), the calibration of each model (``cal[model]``) and the start-up
    seconds of a job without a model (``startup["table" | "store" | "figure"]``)."""

    config: dict
    corpus: dict
    cal: dict
    startup: dict
    models: dict = field(init=False)

    def __post_init__(self):
        self.models = {m["name"]: m for m in self.config["models"]}

    def windows(self, model: str, corpus: str, half: str) -> int:
        return int(self.corpus[f"{corpus}/{model}/{half}"]["windows"])

    def T(self, corpus: str) -> int:
        from mfpipe.workflow.config import corpora

        return int(corpora(self.config)[corpus]["context_length"])

    def revisions(self, model: str) -> list:
        from mfpipe.workflow.config import resolve_revisions

        return resolve_revisions(self.config, self.models[model])


def _dataset(ctx: Context, wc: dict) -> tuple[str, str]:
    corpus, _, half = wc.get("dataset", "stats").rpartition("/")
    if not corpus or corpus == "excl" or (corpus[:1] == "N" and corpus[1:].isdigit()):  # an arm of the primary
        corpus = ctx.config["corpus"]["name"]
    return corpus, half


def _cells(c: dict, ctx: Context) -> float:
    """Cells of a store's kernel sums, L·H·N·(N+2), at the config's N."""
    n = int(ctx.config["tracked"]["n_tracked"])
    return c["layers"] * c["heads"] * n * (n + 2)


def _stats_tokens(ctx, model, corpus, half, group: str | None, per_job) -> float:
    """Tokens of one statistics job: its run of shards (all of the half by default)."""
    w, sw = ctx.windows(model, corpus, half), _shard_windows(ctx, corpus)
    shards = [min(sw, w - i * sw) for i in range(math.ceil(w / sw))]
    if per_job and group is not None:
        first = int(group)
        shards = shards[first: first + int(per_job)]
    return sum(shards) * ctx.T(corpus)


def _shard_windows(ctx: Context, corpus: str) -> int:
    from mfpipe.workflow.config import corpora

    return int(corpora(ctx.config)[corpus]["shard_windows"])


def stats_shard(ctx, c, wc):
    corpus, half = _dataset(ctx, wc)
    tok = _stats_tokens(ctx, wc["model"], corpus, half, wc.get("i"), ctx.config["stats"]["shards_per_job"])
    n_shards = math.ceil(tok / ctx.T(corpus) / _shard_windows(ctx, corpus))
    disk = n_shards * _cells(c, ctx) * c["store_bytes_per_cell"]  # a partial holds what its store holds
    # each shard's partial: the calibration's own write (its derived sums made as they are written, per layer)
    write = c.get("partial_write_s", _cells(c, ctx) * c["store_write_s_per_cell"])
    work = tok * c["pass1_s_per_token"] + c["pass1_first_s"] + n_shards * write
    # a streamed model: its blocks read per batch, and per shard some 4 times more (the norm forms and the derived
    # sums read each block outside the forwards; tests/test_streaming.py counts them)
    B = int(ctx.config["runtime"]["batch_size"])
    work += weight_reads(c, tok / ctx.T(corpus), B, n_shards * (4 + 4 / c["layers"]))
    return work, disk


def stats_merge(ctx, c, wc):
    corpus, half = _dataset(ctx, wc)
    n = math.ceil(ctx.windows(wc["model"], corpus, half) / _shard_windows(ctx, corpus))
    cells = _cells(c, ctx)
    return (n * cells * c["store_read_s_per_cell"] + cells * c["store_write_s_per_cell"] + c["finalize_s"],
            cells * c["store_bytes_per_cell"])


def deviation_shard(ctx, c, wc):
    corpus = ctx.config["corpus"]["name"]
    budget = ctx.config["deviation"]["tokens"]
    T, sw = ctx.T(corpus), _shard_windows(ctx, corpus)
    w = ctx.windows(wc["model"], corpus, "stats")
    if budget:  # the first shards that hold the budget
        w = min(w, math.ceil(int(budget) / (sw * T)) * sw)
    per_job = ctx.config["deviation"]["shards_per_job"]
    if per_job:
        w = min(w - int(wc.get("i", 0)) * sw, int(per_job) * sw)
    # a partial per shard (deleted after the merge unless deviation.keep_partials): the calibration's partial, where
    # an older calibration lacks it the store it merges into
    disk = math.ceil(w / sw) * c.get("deviation_partial_bytes", c["deviation_store_bytes"])
    B = int(ctx.config["deviation"].get("batch_size") or ctx.config["runtime"]["batch_size"])
    reads = weight_reads(c, w, B, 1)  # a streamed model: its blocks per batch, and once for the residual Grams
    return (w * T * c["pass2_s_per_token"] + c["pass2_first_s"] + _cells(c, ctx) * c["store_read_s_per_cell"] + reads,
            disk)


def substitution(ctx, c, wc):
    corpus = ctx.config["corpus"]["name"]
    T = ctx.T(corpus)
    w = min(math.ceil(int(ctx.config["substitution"]["eval_tokens"]) / T), ctx.windows(wc["model"], corpus, "eval"))
    B = int(ctx.config["substitution"].get("batch_size") or ctx.config["runtime"]["batch_size"])
    reads = weight_reads(c, 2 * w, B, 1)  # a streamed model: its blocks per forward (two a batch), once for the Grams
    return w * T * c["substitution_s_per_token"] + _cells(c, ctx) * c["store_read_s_per_cell"] + reads, 0.0


def deviation_merge(ctx, c, wc):
    return 0.0, c["deviation_store_bytes"]


def kernel_revision(ctx, c, wc):
    work = c.get("kernel_revision_s") or c["layers"] * c["heads"] * c["eigh_s_per_head"]
    return work + _cells(c, ctx) * c["store_read_s_per_cell"], 0.0


def calibrate_kernel(ctx, c, wc):
    corpus = ctx.config["corpus"]["name"]
    T = ctx.T(corpus)
    k = ctx.config["substitution"]["kernels"]
    passes = 1 + int(k["calibration_iterations"])
    pairs = c["layers"] * c["heads"] * ctx.windows(wc["model"], corpus, "stats") * T * T
    cells = _cells(c, ctx)
    per_layer = passes * c["calibration_pass_s"] + (passes - 1) * c["calibration_update_s"]
    return (c["layers"] * per_layer + passes * pairs * c["calibration_s_per_pair"]
            + cells * (c["store_read_s_per_cell"] + c["store_write_s_per_cell"]), cells * 4.0)  # U in float32


def _rollout_flops(ctx, c) -> float:
    n = int(ctx.config["tracked"]["n_tracked"])
    return c["layers"] * c["heads"] * n * (n + 2) * (c["d_model"] / c["heads"]) * 2 + c["layers"] * n * n * 4


def _rollout(ctx, c, kernels: float) -> float:
    """Seconds of ``kernels`` rollouts with their scoring: the calibration's ``run_rollouts`` (the config's kernels)
    per kernel, else their flops."""
    n = len(ctx.config["rollout"]["kernels"]) * (2 if ctx.config["rollout"].get("pin_rogue") else 1)
    if c.get("rollout_s") is not None:
        return c["rollout_s"] * kernels / max(n, 1)
    return kernels * _rollout_flops(ctx, c) * c["flop_s"]


def rollout_scores(ctx, c, wc):
    r = ctx.config["rollout"]
    arms = len(r["kernels"]) * (2 if r.get("pin_rogue") else 1)
    return _rollout(ctx, c, arms) + 2 * _cells(c, ctx) * c["store_read_s_per_cell"], 0.0


def error_accounting(ctx, c, wc):
    # the teacher-forced reads and three estimators through every block: about three rollouts
    return _rollout(ctx, c, 3) + 2 * _cells(c, ctx) * c["store_read_s_per_cell"], 0.0


def exclusion_rollout(ctx, c, wc):
    # per arm (main, exclusion), each arm's two stores read: the mean-field rollout and the teacher-forced reads
    # (about two rollouts), and the rollout_divergence job's work (exclusion.divergence_headline runs DV.run whole)
    return 2 * (_rollout(ctx, c, 2) + rollout_divergence(ctx, c, wc)[0]), 0.0


def rollout_divergence(ctx, c, wc):
    # the rollout, then every block at both trajectories: the steps, the curvature grid (two errors per alpha), the
    # MLP units (three MLP evaluations) and the per-token pass -- about 2 (alphas + 3) block sweeps
    return _rollout(ctx, c, 2 * (len(ctx.config["rollout"]["divergence"]["alphas"]) + 3)) \
        + 2 * _cells(c, ctx) * c["store_read_s_per_cell"], 0.0


def rollout_localized(ctx, c, wc):
    # four layer sets (+ the user's) and every kernel unpinned and pinned
    r = ctx.config["rollout"]
    return _rollout(ctx, c, 4 + len(r["localized"]["layers"]) + 2 * len(r["kernels"])) \
        + 2 * _cells(c, ctx) * c["store_read_s_per_cell"], 0.0


def cross_corpus(ctx, c, wc):
    from mfpipe.workflow.config import corpora

    C = len(corpora(ctx.config))  # C mean-field rollouts, C x C scorings
    return _rollout(ctx, c, C + C * C) + 2 * C * _cells(c, ctx) * c["store_read_s_per_cell"], 0.0


def attention_coverage(ctx, c, wc):
    total = 0.0
    for m in ctx.models:
        cm = ctx.cal[m]
        total += _cells(cm, ctx) * cm["store_read_s_per_cell"] * (1 + 2 * (len(ctx.corpus) // 2 // max(len(ctx.models), 1)))
    return total, 0.0


def minisuite_train(ctx, c, wc):
    from mfpipe.minisuite.model import resolve_config
    from mfpipe.workflow.config import minimodel
    from mfpipe.workflow.revisions import checkpoint_steps

    mm = resolve_config(minimodel(ctx.config, wc["mini"]))
    T, steps = int(mm["context_length"]), int(mm["steps"])
    ckpts = len(checkpoint_steps(steps, mm["linear_checkpoints"]))
    probes = ckpts + steps // max(int(mm["induction_every"]), 1)
    tasks = int(ctx.config["minisuite"]["tasks"]["n_tasks"]) if float(mm.get("fewshot_fraction") or 0) > 0 else 0
    probe_tokens = (int(mm["eval_rows"]) + int(mm["induction_sequences"])) * T
    probe_tokens += tasks * (128 + int(ctx.config["minisuite"]["tasks"]["n_pairs"])) * T
    work = steps * int(mm["batch_size"]) * T * c["train_s_per_token"] + probes * probe_tokens * c["forward_s_per_token"]
    return work, ckpts * c["param_bytes"]


def corpus_shards(ctx, c, wc):
    tok = sum(ctx.windows(wc["model"], wc["corpus"], h) for h in ("stats", "eval")) * ctx.T(wc["corpus"])
    rate = ctx.corpus[f"{wc['corpus']}/{wc['model']}/stats"].get("tokenize_s_per_token") or 0.0
    return tok * rate, tok * 8  # a shard holds its windows' tokens and document ids, int32 each (np.savez)


def minisuite_tokenizer(ctx, c, wc):
    return ctx.startup.get("minisuite_tokenizer_s", 0.0), 0.0


RULES = {
    "minisuite_tokenizer": minisuite_tokenizer, "deviation_merge": deviation_merge,
    "stats_shard": stats_shard, "stats_merge": stats_merge, "deviation_shard": deviation_shard,
    "substitution": substitution, "substitution_topn": substitution, "kernel_revision": kernel_revision,
    "calibrate_kernel": calibrate_kernel, "rollout_scores": rollout_scores, "error_accounting": error_accounting,
    "cross_corpus": cross_corpus, "exclusion_rollout": exclusion_rollout,
    "rollout_divergence": rollout_divergence, "rollout_localized": rollout_localized,
    "attention_coverage": attention_coverage,
    "minisuite_train": minisuite_train, "corpus_shards": corpus_shards, **PROMPT_RULES, **SLICE_RULES,
}
# jobs that load a model (their start-up is the calibration's: imports and the model)
MODEL_RULES = {"stats_shard", "deviation_shard", "substitution", "substitution_topn", "rollout_scores",
               "error_accounting", "cross_corpus", "exclusion_rollout", "rollout_divergence", "rollout_localized",
               "head_scores", "jlens", "lenses", "icl_classes",
               "icl_meter", "function_vectors", "minisuite_train", "positional", "positional_ablation"}
# jobs that load a tokenizer and no model
TOKENIZER_RULES = {"corpus_shards", "tracked_types", "tracked_types_topn", "tracked_types_excl", "minisuite_tasks"}


# the calibration stage whose memory a job's peak is (the others: the bare forward's)
PEAK_STAGE = {"stats_shard": "pass1", "deviation_shard": "pass2", "lenses": "pass2", "icl_meter": "pass2",
              "substitution": "substitution", "substitution_topn": "substitution", "icl_classes": "substitution",
              "function_vectors": "forward",  # (short prompts; the mean field it reads: estimate.prompts.fv_peak)
              "jlens": "jlens", "minisuite_train": "train",
              "positional": "pass2",  # (the positional job's batches are deviation forwards, pass 2's)
              **dict.fromkeys(("rollout_scores", "error_accounting", "cross_corpus", "exclusion_rollout",
                               "rollout_divergence", "rollout_localized"), "rollout")}  # a store read whole
# float64 [L+1, N, d] arrays (centroids and their like: per-head mean reads, predictions, per-token amplifications) a
# job of the rollout family holds beyond the calibrated rollout (``peak_mb["rollout"]``: Alg. 1 on statistics in
# memory), with its stores' reads: each job's peak RSS sampled every 0.25 s at GPT-2 small's paper shape (2,015-2,681
# MiB against 1,848 for the calibrated rollout; benchmarks/README.md, "A paper-shape run")
ROLLOUT_COPIES = {"rollout_scores": 6, "error_accounting": 10, "cross_corpus": 2, "exclusion_rollout": 11,
                  "rollout_divergence": 9, "rollout_localized": 6}


def rollout_copies_mb(ctx: Context, c: dict, rule: str) -> float:
    """MiB a rollout-family job holds beyond the calibrated rollout (:data:`ROLLOUT_COPIES`), at the config's N."""
    n = int(ctx.config["tracked"]["n_tracked"])
    return ROLLOUT_COPIES.get(rule, 0) * (c["layers"] + 1) * n * c["d_model"] * 8 / 2**20


# App. B's recomputation (workflow/rules/substitution.smk) reruns these jobs with the other kernel: their costs; its
# table job opens the two arms' stores
RECOMPUTE_RULES = {"deviation_shard_recompute": "deviation_shard", "deviation_merge_recompute": "deviation_merge",
                   "substitution_recompute": "substitution", "icl_meter_recompute": "icl_meter",
                   "icl_classes_recompute": "icl_classes"}
RULES.update({new: RULES[old] for new, old in RECOMPUTE_RULES.items()})
MODEL_RULES |= {new for new, old in RECOMPUTE_RULES.items() if old in MODEL_RULES}
STORE_RULES |= {new for new, old in RECOMPUTE_RULES.items() if old in STORE_RULES} | {"calibrated_recompute"}
PEAK_STAGE.update({new: PEAK_STAGE[old] for new, old in RECOMPUTE_RULES.items() if old in PEAK_STAGE})


def reads_calibrated(config: dict, rule: str) -> bool:
    """Whether the job's kernel is the calibrated U (App. B): it reads U a layer at a time beside the kernel built
    from it (GPT-2 small's recompute arms peaked 0.6-0.8 GiB, U's 550 MiB and more, above the same jobs with W, when
    they read it whole).
    The run's own pass 2 and substitution use ``substitution.kernel``, their reruns the other; the prompt jobs W,
    their reruns U (mfpipe.experiments.substitution.rules.recompute_kernels)."""
    own = config["substitution"]["kernel"] == "calibrated"
    return {"deviation_shard": own, "substitution": own, "deviation_shard_recompute": not own,
            "substitution_recompute": not own, "icl_meter_recompute": True, "icl_classes_recompute": True
            }.get(rule, False)
# jobs that open a statistics (or deviation) store before their work
READS_STORES = (MODEL_RULES | STORE_RULES | STORE_FIGURE_RULES) - {
    "stats_shard", "minisuite_train",
    "figure_rollout", "figure_teacher_forced", "figure_error_decomposition", "figure_clustering",
    "figure_cross_corpus", "figure_icl_classes", "figure_icl_meter", "figure_fv", "figure_crossmodel",
    "figure_waypoint", "figure_topn", "figure_divergence", "substitution_table", "substitution_topn_table"}


def kernel_sums_mb(c: dict) -> float:
    """MiB of a statistics job's kernel sums at full depth (L H N (N+2) float32), what ``stats.kernel_sums: disk``
    takes off its resident memory."""
    N = int(c["n_tracked"])
    return c["layers"] * c["heads"] * N * (N + 2) * 4 / 2**20


def kept(config: dict, rule: str) -> bool:
    """Whether a job's output stays on disk to the run's end: every output but the partials, which stay only where
    the config keeps them (``stats.keep_partials``, ``deviation.keep_partials``; else deleted after their merge)."""
    section = {"stats_shard": "stats", "deviation_shard": "deviation", "deviation_shard_recompute": "deviation"}
    return bool(config[section[rule]]["keep_partials"]) if rule in section else True


def priced(rule: str) -> bool:
    """Whether ``rule`` has a cost formula (:data:`RULES`); a job of a rule without one is counted as its start-up
    only, and `mfpipe estimate` names it."""
    return rule in RULES


def job_cost(ctx: Context, rule: str, wildcards: dict) -> dict:
    """``{"seconds", "startup_s", "peak_mb", "disk_bytes", "modelled"}`` of one job (``modelled``: :func:`priced`)."""
    model = wildcards.get("model") or wildcards.get("mini")
    c = ctx.cal.get(model) if model else None
    if rule in MODEL_RULES:
        start, peak = c["startup_s"], c["peak_mb"].get(PEAK_STAGE.get(rule, "forward"), c["peak_rss_mb"])
        if rule == "stats_shard" and (ctx.config.get("stats") or {}).get("kernel_sums") == "disk":
            peak -= kernel_sums_mb(c)  # mapped from a file: the page cache's, not the job's own memory
        if reads_calibrated(ctx.config, rule):  # a layer of U in float32
            peak += _cells(c, ctx) / c["layers"] * 4 / 2**20
        peak += rollout_copies_mb(ctx, c, rule)
        extra = EXTRA_PEAK.get(rule) or PROMPT_PEAK.get(rule)
        if extra is not None:  # what the job holds beyond its calibrated stage (estimate.slices, estimate.prompts)
            peak += extra(ctx, c, wildcards)
        if streamed(c, rule):  # one block's weights resident, not all; the load's probe reads every block twice
            peak, start = peak - c["stream_saving_mb"], start + STARTUP_READS * c["blocks_read_s"]
    else:
        kind = ("figure" if rule in FIGURE_RULES else "store" if rule in STORE_RULES
                else "store_figure" if rule in STORE_FIGURE_RULES else "tokenizer" if rule in TOKENIZER_RULES
                else "table")
        start = ctx.startup[kind]
        peak = ctx.startup.get(f"{kind}_rss_mb", 0.0)
        if c is not None and rule in STORE_RULES:  # a layer-chunked store's arrays, float32 copies of its cells
            peak += STORE_COPIES.get(rule, lambda c: 3.0)(c) * _cells(c, ctx) * 4 / 2**20
        if rule == "corpus_shards":  # its tokenizer, the corpus and both halves' windows (estimate.corpus_memory)
            tokens = sum(ctx.windows(wildcards["model"], wildcards["corpus"], h) for h in ("stats", "eval"))
            measure = ctx.startup.get("corpus_memory", {}).get(f"{wildcards['corpus']}/{wildcards['model']}")
            peak = corpus_peak_mb(measure, tokens * ctx.T(wildcards["corpus"]), peak)
    if c is not None and rule in READS_STORES:
        start += c["store_open_s"]
    fn = RULES.get(rule)
    # (a model-free job without a model wildcard -- a figure, the mini suite's tokenizer -- is priced too)
    work, disk = fn(ctx, c, wildcards) if fn is not None else (0.0, 0.0)
    work *= ctx.startup.get("contention_work", 1.0)  # beside the run's other jobs (`--jobs-at-once`)
    return {"seconds": start + work, "startup_s": start, "peak_mb": peak, "disk_bytes": disk,
            "modelled": priced(rule)}
