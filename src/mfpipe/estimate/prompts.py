"""The prices of the jobs that run a model on prompts or sampled positions rather than on a corpus half
(:mod:`mfpipe.estimate.costs` adds them to its table): the head scores, the J-lens and its decodes through
Jacobian-vector products, the lenses, the prompt classes and the instance meter, the function vectors. Each gives
``(work seconds, disk bytes)`` from the calibration's rates (``c``) and the config's sizes."""

from __future__ import annotations

import math

__all__ = ["PROMPT_RULES", "PROMPT_PEAK", "jvp_decode", "icl_prompt_lengths", "exemplar_tokens",
           "DEFAULT_EXEMPLAR_TOKENS"]

# a few-shot exemplar's tokens ("x:y" and the joiner) where the model's tokenizer is not on this machine to count them
# (mfpipe estimate counts them per task with the tokenizer: :func:`exemplar_tokens`); the paper-shape run's
# Shakespeare-trained tokenizer took 7.1 (antonym) to 16.2 (country-currency) on the six tasks
DEFAULT_EXEMPLAR_TOKENS = 8.0
SAMPLE_PAIRS = 200  # the pairs of each task counted


def exemplar_tokens(config: dict, tokenizer) -> dict:
    """``{"fv_exemplar_tokens", "icl_exemplar_tokens"}``: the mean tokens of one exemplar of the function-vector
    prompts (``x: y`` and the joiner, fv.experiment's layout) over ``fv.tasks`` and of the ICL classes' few-shot prompts
    (``x:y``, mfpipe.tasks.fewshot_text) over ``prompts.icl.tasks``, counted with the model's ``tokenizer`` on the
    first :data:`SAMPLE_PAIRS` pairs of each vendored task; a task it cannot read here (the mini suite's, a user's
    file), and every task without a tokenizer, counts :data:`DEFAULT_EXEMPLAR_TOKENS`."""
    from mfpipe.tasks import load_task

    def mean(tasks, form):
        counts = []
        for name in tasks or []:
            try:
                pairs = load_task(name).pairs[:SAMPLE_PAIRS]
                counts.append(sum(len(tokenizer(form.format(x, y), add_special_tokens=False)["input_ids"])
                                  for x, y in pairs) / max(len(pairs), 1))
            except Exception:  # noqa: BLE001 -- not a vendored task, or no tokenizer: the default
                counts.append(DEFAULT_EXEMPLAR_TOKENS)
        return sum(counts) / len(counts) if counts else DEFAULT_EXEMPLAR_TOKENS

    return {"fv_exemplar_tokens": mean(config["fv"]["tasks"], "{}: {}\n"),
            "icl_exemplar_tokens": mean(config["prompts"]["icl"]["tasks"], "{}:{}\n")}


def head_scores(ctx, c, wc):
    # one forward of the repeated random sequences, their attention read (1.1 bare forwards measured at GPT-2
    # small's shape, its paper-shape run)
    T = ctx.T(ctx.config["corpus"]["name"])
    return int(ctx.config["ranking"]["head_scores"]["n_sequences"]) * T * c["forward_s_per_token"], 0.0


def jlens(ctx, c, wc):
    from mfpipe.estimate.weights import streamed

    j = ctx.config["jlens"]
    # a streamed model's blocks read again per position: its prefix's and token's forwards, each backward call
    reads = c.get("jlens_reads_per_position", 0) * c["blocks_read_s"] if streamed(c, "jlens") else 0.0
    # then its checks' decode agreement (mfpipe.jlens.agreement): a traced forward of each decoded position's window
    # (the reads selected: a pass-2 forward, priced so), and each of its vectors through the LM head twice (raw and
    # J-lens): the residual at every layer and the final one, each head's write at every layer (GPT-2 small's
    # paper-shape job: 168 s of its 348, unpriced before)
    n = int(j["n_decode"])
    vectors = n * (c["layers"] + 1 + c["heads"] * c["layers"])
    decode = n * ctx.T(ctx.config["corpus"]["name"]) * c["pass2_s_per_token"] + 2 * vectors * c["lm_head_s_per_token"]
    store = 2 * (c["layers"] + 1) * c["d_model"] ** 2 * 4  # what it keeps: J [2, L+1, d, d] float32
    return int(j["n_positions"]) * (c["jlens_s_per_position"] + reads) + decode, store


def jvp_decode(ctx, c, n: int) -> float:
    """Seconds of a consumer's J-lens decodes of ``n`` vectors through Jacobian-vector products, where jlens.decode
    takes that path for it (mfpipe.jlens.rules.shape_path; 0 where it reads the store)."""
    from mfpipe.jlens.rules import shape_path

    if shape_path(ctx.config, (c["layers"], c["heads"], c["d_model"]), n) != "jvp":
        return 0.0
    return int(ctx.config["jlens"]["n_positions"]) * (c.get("jvp_position_s", 0.0) + n * c.get("jvp_s_per_vector", 0.0))


def lenses(ctx, c, wc):
    # one forward of each distinct window of the mined contexts (its attention, values and reads: a pass-2
    # forward; mfpipe.experiments.prompts.rerun.ContextRerun.run), then the J-lens decodes of their vectors
    p = ctx.config["prompts"]["lenses"]
    T, n = ctx.T(ctx.config["corpus"]["name"]), (int(p["n_lens_heads"]) + len(p["heads"])) * int(p["per_head"])
    return n * T * c["pass2_s_per_token"] + jvp_decode(ctx, c, n), 0.0


def icl_prompt_lengths(config: dict, T: int, exemplar: float = DEFAULT_EXEMPLAR_TOKENS
                       ) -> dict[str, tuple[int, float, int]]:
    """Per prompt class of the ICL classes job: ``(prompts, mean length in tokens, batches)`` as
    mfpipe.experiments.prompts.sets builds them: induction ``[BOS, r, r_1..r_m]`` and its random control
    ``[BOS, r_1..r_m]`` (``k = n_random`` random tokens, ``m`` uniform in [min_repeat, k)), natural prompts of
    ``natural_length`` (T - 1) tokens, few-shot prompts of ``N_EXEMPLARS`` pairs of ``exemplar`` tokens and the
    query (half a pair). Prompts run in
    batches of one length (``measure_prompts``): a class of ``d`` distinct lengths takes at least ``min(n, d)``."""
    from mfpipe.tasks import N_EXEMPLARS

    p = config["prompts"]["icl"]
    B = int(config["prompts"].get("batch_size") or config["runtime"]["batch_size"])
    n, k = int(p["n_prompts"]), max(2, min(int(p["n_random"]), T // 2))
    lo = min(2, k - 1)
    m = (lo + k - 1) / 2  # the repeat's mean length
    few = min(1 + (N_EXEMPLARS + 0.5) * exemplar, T)
    nat = T - 1 if p.get("natural_length") is None else int(p["natural_length"])

    def batches(count, distinct):
        return max(math.ceil(count / B), min(count, distinct)) if count else 0

    nf = int(p["n_fewshot"])
    return {"induction": (n, 1 + k + m, batches(n, k - lo)), "random": (n, 1 + m, batches(n, k - lo)),
            "natural": (n, nat, batches(n, 1)), "few-shot": (nf, few, batches(nf, N_EXEMPLARS * exemplar))}


def icl_classes(ctx, c, wc):
    # three forwards a batch (measure_prompts): the clean one with pass 2's reads, the substituted one, the permuted
    # prompt's, and the mean field of the prompt and of its permutation: a pass 2 and two substitutions less two bare
    # forwards per token (14.7 ms a token at GPT-2 small's shape, 14.6 measured on its natural prompts), and three
    # short forwards' overhead a batch
    T = ctx.T(ctx.config["corpus"]["name"])
    per_token = max(c["pass2_s_per_token"] + 2 * (c["substitution_s_per_token"] - c["forward_s_per_token"]),
                    c["pass2_s_per_token"] + 2 * c["forward_s_per_token"])
    work = 0.0
    lengths = icl_prompt_lengths(ctx.config, T, c.get("icl_exemplar_tokens") or DEFAULT_EXEMPLAR_TOKENS)
    for n, length, batches in lengths.values():
        work += n * length * per_token + batches * 3 * c["short_forward_s"]
    return work, 0.0


def icl_meter(ctx, c, wc):
    p = ctx.config["prompts"]["icl_meter"]
    T = ctx.T(ctx.config["corpus"]["name"])
    k = min(int(p["chunk_length"]), (T - 1) // 2)
    w = min(int(p["n_sequences"]), ctx.windows(wc["model"], ctx.config["corpus"]["name"], "eval") // 4)
    return w * (2 * k + 1) * c["pass2_s_per_token"] * 2, 0.0


def function_vectors(ctx, c, wc):
    """Per task, seed and split (mfpipe.experiments.fv.experiment): few-shot prompts of ``n_shots`` exemplars through
    a forward each (the clean prompts' and the few-shot ceiling's reads, AIE's corrupted prompts once unpatched and
    once a head), at the calibration's rate of such a batch (``fv_s_per_token``); zero-shot prompts, one a row, in
    batches of rows: the tuning sweep's grid of the four pipelines on the extraction pairs, the raw-magnitude control
    over the grid, the evaluation of every selection and construction, the clean-prompt sweep, each on the held-out
    pairs; the decodes through the J-lens. GPT-2 small's paper-shape run: AIE 56 % of the job, the two sweeps 33 %."""
    f = ctx.config["fv"]
    mini = ctx.models[wc["model"]]["source"] == "minisuite"  # the tasks the mini suite trained on: its models' only
    tasks = [t for t in f["tasks"] or [] if t != "minisuite" or mini]  # (as mfpipe.experiments.fv.rules.fv_tasks)
    n_tasks = sum(int(ctx.config["minisuite"]["tasks"]["n_tasks"]) if t == "minisuite" else 1 for t in tasks)
    B = int(f.get("batch_size") or ctx.config["runtime"]["batch_size"])
    ex = c.get("fv_exemplar_tokens") or DEFAULT_EXEMPLAR_TOKENS
    prompt = 1 + ex * (int(f["n_shots"]) + 0.5)
    held, extract = int(f["n_pairs"]) - int(f["n_extract"]), int(f["n_extract"])
    few_shot = int(f["n_clean"]) + held + int(f["n_corrupted"]) * (c["layers"] * c["heads"] + 1)
    grid = len(f["layers"] if f.get("layers") is not None else range(c["layers"])) * len(f["sum_scales"])
    grid += len(f["head_scales"])
    lists = sum(1 for h in f.get("head_lists") or [] if h.get("model") == wc.get("model"))
    selections = 4 + lists  # AIE, MFA, raw-magnitude, random and the model's head lists
    cleans = sum(1 for n in f["clean_sweep"] if 1 <= int(n) <= int(f["n_clean"]))
    rows = extract * grid * 4 + held * (grid * 2 + 1 + 2 * selections * 2 + 2 * cleans)
    per_token = c.get("fv_s_per_token") or 2 * c["forward_s_per_token"]  # (a calibration from before it was timed)
    runs = int(f["n_seeds"]) * n_tasks * int(f["n_splits"])
    # as mfpipe.experiments.fv.rules.decoded_vectors: per selection (AIE, MFA, each head list) and construction
    decodes = int(f["n_seeds"]) * n_tasks * (2 * (2 + lists) + c["layers"] * c["heads"] * (1 + int(f["n_clean"])))
    return (runs * (few_shot * prompt * per_token + rows / B * c["short_forward_s"])
            + jvp_decode(ctx, c, decodes)), 0.0


def fv_peak(ctx, c, wc) -> float:
    """MiB the function-vector job holds beyond a forward's peak: the corpus null at the cue, the mean field of the
    statistics half (``stats.zhat()``: the kernel and the mean values of every layer, as the substitution holds them;
    GPT-2 small: 1,957 MiB measured, a forward's 1,294 and this 614). Its own forwards are of short prompts."""
    n, dh = int(ctx.config["tracked"]["n_tracked"]), c["d_model"] // max(c["heads"], 1)
    return c["layers"] * c["heads"] * (n + 2) * (n + dh) * 4 / 2**20


PROMPT_PEAK = {"function_vectors": fv_peak}
PROMPT_RULES = {"head_scores": head_scores, "jlens": jlens, "lenses": lenses, "icl_classes": icl_classes,
                "icl_meter": icl_meter, "function_vectors": function_vectors}
