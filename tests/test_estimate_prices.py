"""The prices `mfpipe estimate` gives the jobs its paper-shape run measured out of the issue's bounds (issue 58): the
prompt classes, the lenses, the head scores, the recomputation's arms, the start-ups' memory. Each test fails on the
formula it replaced."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mfpipe.estimate import costs as C
from mfpipe.estimate import jobs as J
from mfpipe.estimate import prompts as Pm
from mfpipe.estimate import report as R

REPO = Path(__file__).resolve().parents[1]
BASE = REPO / "config" / "config.yaml"
GPT2 = [REPO / "config" / "presets" / "gpt2-small.yaml", REPO / "config" / "experiments" / "paper-shape.yaml"]
# the rates of GPT-2 small's calibration beside its paper-shape run (batch 1; seconds per token, a short batch's call)
GPT2_RATES = dict(forward_s_per_token=0.00221, pass2_s_per_token=0.00403, substitution_s_per_token=0.00754,
                  short_forward_s=0.0297)


class Rates(dict):
    """A calibration whose rates the tests do not set are a small positive number."""

    def __missing__(self, key):
        return 1e-6


def context(cfg: dict) -> C.Context:
    cal = Rates(layers=12, heads=12, d_model=768, n_tracked=1000, startup_s=3.0, T=512, batch_size=8, **GPT2_RATES,
                peak_mb={k: 2000.0 for k in ("forward", "pass1", "pass2", "substitution", "jlens", "rollout")})
    kinds = ("table", "store", "figure", "store_figure", "tokenizer")
    startup = {**{k: 1.0 for k in kinds}, **{f"{k}_rss_mb": 100.0 for k in kinds}}
    return C.Context(cfg, J.predict_corpus(cfg, {}, results="/nonexistent"), {"gpt2-small": cal}, startup)


def gpt2(**changes):
    cfg = J.load_config(GPT2, base=BASE)
    for key, value in changes.items():
        section, name = key.split("__")
        cfg["prompts"][section][name] = value
    ctx = context(cfg)
    return ctx, ctx.cal["gpt2-small"], {"model": "gpt2-small", "revision": "main"}


def test_the_prompt_classes_are_priced_by_their_prompts_not_by_windows_per_task():
    """The job measured 64 prompts in 119.3 s (two tasks; 16 natural prompts of T - 1 tokens, the rest a few dozen
    tokens): three forwards and two mean fields a prompt token. The former price, every prompt a window of T tokens
    times the tasks / 3, said 247 s."""
    ctx, c, wc = gpt2()
    work = Pm.icl_classes(ctx, c, wc)[0]
    assert 119.3 / 1.35 < work < 119.3 * 1.35
    assert Pm.icl_classes(*gpt2(icl__tasks=["antonym"]))[0] == pytest.approx(work)  # few-shot prompts in all
    short = Pm.icl_classes(*gpt2(icl__natural_length=128))[0]
    n, length, _ = Pm.icl_prompt_lengths(ctx.config, 512)["natural"]
    assert (n, length) == (16, 511)
    per_token = c["pass2_s_per_token"] + 2 * (c["substitution_s_per_token"] - c["forward_s_per_token"])
    assert work - short == pytest.approx(n * (511 - 128) * per_token)


def test_the_lenses_and_head_scores_are_one_forward_a_window():
    """The lenses rerun each mined window once (a pass-2 forward; rerun.ContextRerun.run) and the head scores read
    the attention of one forward of their sequences: measured 45 s and 20 s of work where two forwards each were
    priced (66 + the decodes, 36)."""
    ctx, c, wc = gpt2()
    ctx.config["jlens"]["decode"] = "matrix"  # (the decodes read the stored J: no products to price)
    n = (ctx.config["prompts"]["lenses"]["n_lens_heads"] + len(ctx.config["prompts"]["lenses"]["heads"])) * 4
    assert Pm.PROMPT_RULES["lenses"](ctx, c, wc)[0] == pytest.approx(n * 512 * c["pass2_s_per_token"])
    assert Pm.PROMPT_RULES["head_scores"](ctx, c, wc)[0] == pytest.approx(16 * 512 * c["forward_s_per_token"])


@pytest.mark.parametrize("kernel", ["W", "calibrated"])
def test_a_job_on_the_calibrated_kernel_holds_a_layer_of_U_beside_its_kernel(kernel):
    """The recomputation's arms on U peaked 0.6-0.8 GiB above the same jobs on W when they read U whole (GPT-2 small:
    550 MiB of float32); it is read a layer at a time now (mfpipe.meanfield.calibrated.load_calibrated)."""
    ctx, c, wc = gpt2()
    ctx.config["substitution"]["kernel"] = kernel
    u = 12 * 1000 * 1002 * 4 / 2**20  # one of the 12 layers
    peak = {r: C.job_cost(ctx, r, wc)["peak_mb"] for r in
            ("deviation_shard", "deviation_shard_recompute", "substitution", "substitution_recompute",
             "icl_classes", "icl_classes_recompute")}
    sign = 1 if kernel == "W" else -1
    assert peak["deviation_shard_recompute"] - peak["deviation_shard"] == pytest.approx(sign * u)
    assert peak["substitution_recompute"] - peak["substitution"] == pytest.approx(sign * u)
    assert peak["icl_classes_recompute"] - peak["icl_classes"] == pytest.approx(u)  # the prompt jobs: W, reruns U


def test_a_start_up_probe_reports_its_own_memory_not_its_parents():
    """The start-up probes printed ru_maxrss, which on Linux keeps the forking parent's resident memory across the
    exec: every kind read 301 MiB (the estimate's own process) where a table job peaks at about 120."""
    held = np.ones(400 << 17)  # 400 MiB resident in this process
    done = subprocess.run([sys.executable, "-c", "pass; " + R.PRINT_OWN_PEAK], capture_output=True, text=True,
                          check=True)
    assert float(done.stdout.split()[-1]) < 200 < held.nbytes / 2**20


def test_the_function_vectors_count_their_prompts_tokens_and_every_sweep():
    """GPT-2 small's paper-shape run (one task, seed and split): 442 s of work, AIE's 1,450 corrupted prompts of ~76
    tokens (the run's tokenizer: 7.1 a pair of antonyms) 56 % of it, the tuning and raw-magnitude sweeps' 8,320
    zero-shot rows 33 %. The former price counted 4 tokens a pair and no raw-magnitude or clean-prompt sweep: 305 s
    at batch-1 rates, 207 at the batch's."""
    ctx, c, wc = gpt2()
    c.update(fv_s_per_token=0.00219, short_forward_s=0.104, fv_exemplar_tokens=7.1)
    ctx.config["jlens"]["decode"] = "matrix"
    work = Pm.PROMPT_RULES["function_vectors"](ctx, c, wc)[0]
    assert 442 / 1.35 < work < 442 * 1.35
    ctx.config["fv"]["n_splits"] = 3  # each split runs its own reads, AIE and sweeps
    assert Pm.PROMPT_RULES["function_vectors"](ctx, c, wc)[0] == pytest.approx(3 * work)


def test_the_exemplars_are_counted_with_the_models_tokenizer():
    """A character tokenizer counts the characters of ``x: y\\n`` (function vectors) and ``x:y\\n`` (the ICL classes'
    few-shot prompts) over each task's first pairs; a task it cannot read counts the default."""
    from mfpipe.tasks import load_task

    def chars(text, add_special_tokens=False):
        return {"input_ids": list(text)}

    cfg = J.load_config(GPT2, base=BASE)
    cfg["fv"]["tasks"], cfg["prompts"]["icl"]["tasks"] = ["antonym"], ["antonym", "no-such-task"]
    pairs = load_task("antonym").pairs[:Pm.SAMPLE_PAIRS]
    got = Pm.exemplar_tokens(cfg, chars)
    assert got["fv_exemplar_tokens"] == pytest.approx(np.mean([len(f"{x}: {y}\n") for x, y in pairs]))
    icl = np.mean([len(f"{x}:{y}\n") for x, y in pairs])
    assert got["icl_exemplar_tokens"] == pytest.approx((icl + Pm.DEFAULT_EXEMPLAR_TOKENS) / 2)
    assert Pm.exemplar_tokens(cfg, None)["fv_exemplar_tokens"] == Pm.DEFAULT_EXEMPLAR_TOKENS


def test_the_function_vector_job_peaks_at_a_forward_and_the_mean_field_it_reads():
    """Its forwards are of short prompts, and it reads the statistics half's mean field for the null (the kernel and
    mean values of every layer): 1,957 MiB measured on GPT-2 small, where the substitution's peak (a batch of T = 512
    windows on top) priced it at 3,603."""
    ctx, c, wc = gpt2()
    c["peak_mb"]["forward"] = 1294.0
    mean_field = 12 * 12 * 1002 * (1000 + 64) * 4 / 2**20
    assert C.job_cost(ctx, "function_vectors", wc)["peak_mb"] == pytest.approx(1294.0 + mean_field)


@pytest.mark.parametrize("applies, d, chunk", [(False, 100, 16), (True, 300, 16), (True, 50, 16)])
def test_the_jlens_position_is_priced_by_its_calls_of_backward_passes(monkeypatch, applies, d, chunk):
    """A J-lens position costs its prefix and token forwards, then ceil(d / rows) calls of backward passes (rows:
    jlens.grad_chunk, at least WIDE_ROWS where a 16-bit model runs on a CPU), each call a cost of its own beside its
    rows': timing_jlens's line through one and two calls gives exactly that on a cost of that form (it timed 16 and
    64 rows inside one call before, and priced a row's share only)."""
    import math
    from types import SimpleNamespace

    from mfpipe.estimate import timing as T
    from mfpipe.models.adapters import backward16, jacobian

    rows = min(d, max(chunk, backward16.WIDE_ROWS) if applies else chunk)
    fixed, per_call, per_row = 2.0, 0.5, 0.01

    def cost(n):  # n rows in calls of `rows`
        return fixed + math.ceil(n / rows) * per_call + n * per_row

    clock = {"t": 0.0}
    monkeypatch.setattr(T.time, "perf_counter", lambda: clock["t"])
    monkeypatch.setattr(jacobian, "position_jacobians",
                        lambda *a, rows=None, **k: clock.__setitem__("t", clock["t"] + cost(rows or d)))
    monkeypatch.setattr(backward16, "applies", lambda model: applies)
    adapter = SimpleNamespace(d_model=d, model=None)
    got = T.time_jlens(adapter, np.zeros((1, 8), dtype=np.int64), 8, {"jlens": {"grad_chunk": chunk}})
    calls = math.ceil(d / rows)  # the last call priced whole
    assert got == pytest.approx(fixed + calls * (per_call + rows * per_row))
    assert got >= cost(d) and got - cost(d) < rows * per_row


def test_each_rollout_job_holds_its_own_arrays_beyond_the_calibrated_rollout():
    """The rollout family was priced at the calibrated rollout alone (Alg. 1 on statistics in memory: 1,848 MiB at
    GPT-2 small's paper shape) where its jobs peaked at 2,015-2,681 MiB (their stores' reads, the error accounting's
    per-head reads and estimators, the exclusion's two arms): each rule is priced with the [L+1, N, d] arrays it holds
    beyond it, and every rule the rollout's peak prices has its count."""
    ctx, c, wc = gpt2()
    family = {r for r, stage in C.PEAK_STAGE.items() if stage == "rollout"}
    assert family == set(C.ROLLOUT_COPIES)
    unit = 13 * 1000 * 768 * 8 / 2**20  # one float64 [L+1, N, d] array at GPT-2 small's shape
    peak = {r: C.job_cost(ctx, r, wc)["peak_mb"] for r in family}
    for rule in family:
        assert peak[rule] == pytest.approx(2000.0 + C.ROLLOUT_COPIES[rule] * unit), rule
    assert max(peak, key=peak.get) == "exclusion_rollout"  # two arms, each a rollout and its divergence
