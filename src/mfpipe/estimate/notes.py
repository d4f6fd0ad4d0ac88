"""The lines of `mfpipe estimate` that say what its numbers are not: the device its rates were measured on (a GPU's
rates are measured only on a GPU, :func:`calibration_device`), the rules it has no price for
(:func:`unpriced_line`), how each corpus's tokenizing is priced or that it is not (:func:`corpus_lines`), and the
knobs of a job that does not fit (:func:`job_knobs`: what that job's own code reads)."""

from __future__ import annotations

__all__ = ["calibration_device", "unpriced_line", "corpus_lines", "job_knobs", "memory_lines", "JOB_KNOBS"]


def calibration_device(requested: str) -> tuple[str, str, str | None]:
    """``(the jobs' device, the calibration's device, a note or None)`` for ``requested`` (``--device``, else the
    config's ``runtime.device``): a GPU asked for (``cuda``, ``cuda:N``) or one the run would take (``auto``) is
    calibrated on where torch sees one; where it sees none the calibration runs on the CPU, and the note says the
    rates are the CPU's, not a GPU's."""
    import torch

    from mfpipe.models.loader import resolve_device

    wants_gpu = requested == "auto" or requested.startswith("cuda")
    if not wants_gpu:
        dev = str(resolve_device(requested))
        return dev, dev, None
    if torch.cuda.is_available():
        dev = "cuda" if requested == "auto" else requested
        return dev, dev, None
    asked = "--device / runtime.device " + requested
    if requested == "auto":  # this host's run would take the CPU; on a GPU host the same config takes the GPU
        return "cpu", "cpu", (f"GPU rates not measured: {asked} takes a GPU where there is one, and torch sees none "
                              "here, so every rate below is this CPU's (a GPU host's jobs run on its GPU: run mfpipe "
                              "estimate there to measure them)")
    return requested, "cpu", (f"GPU rates not measured: {asked} asks for a GPU, and torch sees none here, so the "
                              "jobs are priced at this CPU's rates, as measured, not scaled to any GPU (run mfpipe "
                              "estimate --device cuda on the GPU host to measure them); the GPU memory check is "
                              "skipped")


def unpriced_line(jobs) -> str | None:
    """One line naming every planned rule without a cost formula (costs.RULES), with its jobs' count; None when all
    are priced."""
    missing = jobs.loc[~jobs["modelled"].astype(bool), "rule"]
    if missing.empty:
        return None
    counts = missing.value_counts().sort_index()
    names = ", ".join(f"{r} ({n} job{'s' if n > 1 else ''})" for r, n in counts.items())
    return (f"NOT PRICED: {names}: no cost formula (mfpipe.estimate.costs.RULES); counted as their start-up only, "
            "so their work is missing from the totals")


def corpus_lines(ctx) -> list[str]:
    """One line per corpus: its tokenizing rate and what it was timed on per model, or that it is not priced (no
    tokenizer of the model here), and for a hub dataset that its download is not priced."""
    from mfpipe.workflow.config import corpora

    lines = []
    for name, corpus in corpora(ctx.config).items():
        hub = corpus.get("source") == "hf"
        where = name + (f" (hub dataset {corpus.get('hf_name')}; its download is not priced)" if hub else "")
        groups: dict = {}
        for m in ctx.config["models"]:
            pred = ctx.corpus.get(f"{name}/{m['name']}/stats", {})
            rate = pred.get("tokenize_s_per_token")
            key = (f"~{1 / rate:,.0f} tokens/s, the tokenizer timed on {pred.get('tokenize_text')}" if rate
                   else None)
            mem = ctx.startup.get("corpus_memory", {}).get(f"{name}/{m['name']}")
            if key is not None:
                key += (f"; its memory measured by the job's own code on {mem['text']}" if mem else
                        "; its memory the tokenizer's start-up only (the job's code could not run here)")
            groups.setdefault(key, []).append(m["name"])
        for key, models in groups.items():
            who = ", ".join(models)
            if key is None:
                lines.append(f"corpus stage NOT PRICED: {where} for {who}: no tokenizer of the model on this machine "
                             "to time, so its corpus_shards jobs count their start-up only")
            else:
                lines.append(f"corpus stage: {where} tokenized for {who} at {key}")
    return lines


# the knobs each job's own code reads that set its peak memory, largest effect first (the recompute rules: their
# originals'); tracked.n_tracked where the job holds the kernel (L H N (N+2))
_N = "tracked.n_tracked (the kernel grows with N^2)"
JOB_KNOBS = {
    "stats_shard": [_N, "runtime.batch_size"],
    "deviation_shard": ["deviation.batch_size", _N],
    "substitution": ["substitution.batch_size", _N], "substitution_topn": ["substitution.batch_size", _N],
    "jlens": ["jlens.sum_dtype", "jlens.grad_chunk", "jlens.batch_size"],
    "lenses": ["prompts.batch_size"], "icl_classes": ["prompts.batch_size"], "icl_meter": ["prompts.batch_size"],
    "function_vectors": ["fv.batch_size"],
    "head_scores": ["runtime.batch_size"],
    "positional": ["positional.tokens (per occurrence: D per head, and Δ of the cluster's heads)",
                   "positional.batch_size"],
    "positional_ablation": ["positional.batch_size (every layer's attention pattern of a batch is kept)"],
    "minisuite_train": ["the mini model's batch_size"],
    "calibrate_kernel": ["runtime.batch_size", _N],
    "rollout_scores": [_N], "error_accounting": [_N], "cross_corpus": [_N], "exclusion_rollout": [_N],
    "rollout_divergence": [_N], "rollout_localized": [_N],
}
JOB_KNOBS.update({"deviation_shard_recompute": JOB_KNOBS["deviation_shard"],
                  "substitution_recompute": JOB_KNOBS["substitution"], "icl_meter_recompute": ["prompts.batch_size"],
                  "icl_classes_recompute": ["prompts.batch_size"]})


def job_knobs(rules, dtype: str) -> list[str]:
    """The knobs to lower for jobs of ``rules`` (largest job first) of a model in ``dtype``, each once: each rule's
    own (:data:`JOB_KNOBS`; a store or table job: tracked.n_tracked), then the model's width for a model job."""
    from mfpipe.estimate.costs import MODEL_RULES

    out: list[str] = []
    for rule in rules:
        for knob in JOB_KNOBS.get(rule, [_N]):
            if knob not in out:
                out.append(knob)
    if dtype == "float32" and any(r in MODEL_RULES for r in rules):
        out.append("the model's dtype: bfloat16")
    return out


def memory_lines(jobs, ctx, run_device: str) -> list[str]:
    """The WILL NOT FIT lines for host memory (:func:`mfpipe.estimate.report.fit_problems`): per model, its largest
    job over this machine's memory, how many more, and the knobs of every rule over (:func:`job_knobs`), with
    ``stats.kernel_sums: disk`` first where statistics jobs are over and the jobs run on the CPU."""
    import psutil

    from mfpipe.estimate.costs import kernel_sums_mb

    lines = []
    host = psutil.virtual_memory().total / 2**20
    over = jobs[jobs["peak_mb"] > host].sort_values("peak_mb", ascending=False)
    for model, group in over.groupby("model", sort=False, dropna=False):
        j, spec = group.iloc[0], next((m for m in ctx.config["models"] if m["name"] == model), {})
        dtype = str(spec.get("dtype") or ctx.config["runtime"]["dtype"])
        stats = group[group["rule"] == "stats_shard"]  # statistics jobs over (the largest job or not)
        first = ""
        if len(stats) and ctx.config["stats"].get("kernel_sums") != "disk" and run_device == "cpu":
            kernel = kernel_sums_mb(ctx.cal[model])
            fits = "" if stats["peak_mb"].max() - kernel > host else ", which brings them under"
            first = (f"set stats.kernel_sums: disk (~{kernel / 1024:.1f} GiB of kernel sums off its statistics jobs' "
                     f"memory{fits}), ")
        knobs = job_knobs(list(dict.fromkeys(group["rule"])), dtype)
        more = f" (and {len(group) - 1} more of its jobs, down to ~{group['peak_mb'].min() / 1024:.1f} GiB)" \
            if len(group) > 1 else ""
        where = f"run model {model} on a larger machine (cluster.forward.mem_mb)" if isinstance(model, str) \
            else "run it on a larger machine"
        lines.append(f"{j['job']}: needs ~{j['peak_mb'] / 1024:.1f} GiB{more}, this machine has {host / 1024:.1f} "
                     f"GiB: {first}lower {', '.join(knobs)}, or {where}")
    return lines
