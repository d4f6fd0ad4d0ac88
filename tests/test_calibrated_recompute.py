"""The calibrated-kernel recomputation of App. B (sec:U2M; mfpipe.experiments.substitution.recompute and the
calibrated_recompute job): with U replaced by W itself the U arm reproduces the W numbers exactly (Spearman 1, shift 0,
equal ΔL), with a genuinely calibrated U on a tiny model pass 2's S̄ equals a slow per-context reference using U, the
ranking orders heads as the ranking experiment does, and the job's table is the two arms side by side."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from hf_reference import head_maps
from stats_reference import reference_capture, tiny_stats_half

from mfpipe.deviation import shards as DP
from mfpipe.experiments.substitution import recompute as RC
from mfpipe.experiments.substitution import substitute as SU
from mfpipe.experiments.substitution.calibration import calibrate, window_batches
from mfpipe.meanfield.calibrated import calibrated_dataset
from mfpipe.meanfield.kernel import kernel_from_store

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: intra-op threads only add overhead

N_WIN, MIN_OCC = 12, 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny GPT-2, its statistics half, W as a 'calibrated' kernel and a genuinely calibrated U (Alg. sinkhorn)."""
    model, ad, tokens, tracked, _, _, st = tiny_stats_half("gpt2", tmp_path_factory.mktemp("recompute"), model_seed=7,
                                                           n_windows=N_WIN, token_seed=3, batch_size=6)
    doc_ids = np.repeat(np.arange(N_WIN)[:, None] // 3, tokens.shape[1], axis=1)
    W = st.W(min_count=1)
    batches = window_batches(tokens, tracked, batch_size=6)
    U = np.stack([calibrate(W.isel(layer=l).values, st.P(layer=l).values, batches, iterations=4)[0].numpy()
                  for l in range(st.n_layers)])
    U_da = calibrated_dataset(U, st, {"min_count": 1})["U"]
    U_da.attrs["min_count"] = 1
    W_da = W.copy()
    W_da.attrs["min_count"] = 1
    return model, ad, tokens, doc_ids, tracked, st, W_da, U_da


def pass2(tiny, calibrated=None):
    model, ad, tokens, doc_ids, tracked, st, _, _ = tiny
    sums, meta = DP.deviation_shard(model, ad, tokens, doc_ids, tracked, st, min_count=1, calibrated=calibrated,
                                    batch_size=5, progress=False)
    return sums, DP.deviation_dataset(sums, meta, tracked, min_occurrences=MIN_OCC)


def slow_S_bar(model, tokens, kernel, min_occurrences=MIN_OCC):
    """S̄ per head (eq:ddec) by loops: per context ẑ = Σ_t Â_t(U) μ_t over the prefix's key types with the
    kernel's rows (Â_t = n_t U_st / Σ n_t' U_st'), per query type the mean z and mean ẑ, centred over the types
    with enough contexts, compared by cosine after the head's output map O_h."""
    ref = reference_capture(model, torch.as_tensor(tokens.astype(np.int64)))
    W, mu = kernel.W.double().numpy(), kernel.mu.double().numpy()
    L, H, N, K = W.shape
    dh = mu.shape[-1]
    z_sum, zh_sum, count = np.zeros((L, H, N, dh)), np.zeros((L, H, N, dh)), np.zeros((L, N))
    for b in range(tokens.shape[0]):
        for j in range(1, tokens.shape[1]):
            s = int(kernel.query_lut[tokens[b, j]])
            if s < 0:
                continue
            bk = [N] + [int(kernel.key_lut[tokens[b, i]]) for i in range(1, j + 1)]
            n = {t: bk.count(t) for t in set(bk)}
            for l in range(L):
                nx = [sum(c * W[l, h, s, t] for t, c in n.items()) for h in range(H)]
                if not all(np.isfinite(x) and x > 0 for x in nx):
                    continue
                count[l, s] += 1
                for h in range(H):
                    z_sum[l, h, s] += ref["reads"][l, b, j, h]
                    zh_sum[l, h, s] += sum(c * W[l, h, s, t] / nx[h] * mu[l, h, t] for t, c in n.items())
    S_bar = np.full((L, H), np.nan)
    for l in range(L):
        O = head_maps(model, l)
        keep = count[l] >= min_occurrences
        for h in range(H):
            zb = z_sum[l, h, keep] / count[l, keep, None]
            hb = zh_sum[l, h, keep] / count[l, keep, None]
            x = (zb - zb.mean(0)) @ O[h]
            y = (hb - hb.mean(0)) @ O[h]
            S_bar[l, h] = np.mean(1 - (x * y).sum(1) / np.sqrt((x * x).sum(1) * (y * y).sum(1)))
    return S_bar


def test_with_W_in_place_of_U_the_U_arm_reproduces_W_exactly(tiny):
    """Acceptance: the 'calibrated' path fed W itself gives pass-2 sums and ΔL bit for bit equal to W's, so the
    table's U arm reads Spearman 1, largest shift 0, top-k overlap k and ΔL, D_MF unchanged."""
    model, ad, tokens, doc_ids, tracked, st, W_da, _ = tiny
    sums_w, ds_w = pass2(tiny)
    sums_u, ds_u = pass2(tiny, calibrated=W_da)
    for k in ("count", "D_sum", "M_cov_sum", "M_ctx_sum", "z_sum", "zhat_sum"):
        np.testing.assert_array_equal(sums_u[k], sums_w[k], err_msg=k)
    rows = {r["quantity"].split(" (")[0]: r for r in RC.ranking_rows(ds_w["S_bar"].values, ds_u["S_bar"].values)}
    H = ds_w.sizes["layer"] * ds_w.sizes["head"]
    assert rows["Spearman of S̄"]["U"] == pytest.approx(1.0) and rows["largest rank shift"]["U"] == 0
    assert rows[f"top-{min(20, H)} overlap"]["U"] == min(20, H)
    kw = kernel_from_store(st, tracked, min_count=1)
    ku = kernel_from_store(st, tracked, calibrated=W_da)
    a = SU.substitution_pass(ad, kw, tokens, batch_size=6).summary()
    b = SU.substitution_pass(ad, ku, tokens, batch_size=6).summary()
    sub = RC.recompute_table(RC.substitution_rows(a, b), "tiny", "r1")
    assert (sub["difference"] == 0).all() and (sub["agree_sf"] == RC.MAX_SF).all(), sub


def test_calibrated_S_bar_equals_a_slow_per_context_reference_using_U(tiny):
    """Acceptance: pass 2 with a genuinely calibrated U (not W: the fit moved it) gives the S̄ of a per-context loop
    over the prefixes with U's rows, to 1e-5; and S̄ moved from W's (the check could fail)."""
    model, ad, tokens, doc_ids, tracked, st, W_da, U_da = tiny
    assert np.nanmax(np.abs(U_da.values / np.where(W_da.values > 0, W_da.values, 1) - 1)) > 1e-2
    _, ds_u = pass2(tiny, calibrated=U_da)
    ref = slow_S_bar(model, tokens, kernel_from_store(st, tracked, calibrated=U_da))
    assert np.isfinite(ref).all()
    np.testing.assert_allclose(ds_u["S_bar"].values, ref, rtol=0, atol=1e-5)
    _, ds_w = pass2(tiny)
    assert np.abs(ds_w["S_bar"].values - ref).max() > 1e-4  # U's S̄ is not W's: the reference tells them apart


def test_head_ranks_order_heads_as_the_ranking_does():
    """The recomputation ranks heads as the ranking experiment's table (S̄ descending, ties by layer then head, NaN
    last), and the ranking rows count shifts and overlaps by those ranks."""
    import xarray as xr

    from mfpipe.experiments.ranking.heads import heads_table

    S = np.array([[0.3, np.nan, 0.5, 0.3], [0.1, 0.5, 0.2, np.nan], [0.05, 0.3, 0.0, 0.7]])
    dev = xr.Dataset({k: (("layer", "head"), S) for k in ("S_bar", "M_cov", "M_ctx", "D")}
                     | {"S_bar_half": (("half", "layer", "head"), np.stack([S, S]))})
    table = heads_table(dev)
    want = np.zeros(S.shape, dtype=int)
    want[table["layer"], table["head"]] = table["rank"]
    np.testing.assert_array_equal(RC.head_ranks(S), want)
    S2 = S.copy()
    S2[0, 0], S2[2, 3] = 0.9, 0.01  # L0H0 rises from rank 4 to 1, L2H3 falls from 1 to 9
    rows = {r["quantity"]: r for r in RC.ranking_rows(S, S2, top=3)}
    assert rows["largest rank shift"]["U"] == 8 and rows["largest rank shift"]["U_head"] == "L2H3"
    assert rows["top-3 overlap"]["U"] == 2  # {L2H3, L0H2, L1H1} vs {L0H0, L0H2, L1H1}
    assert rows["top head S̄"]["W_head"] == "L2H3" and rows["top head S̄"]["U_head"] == "L0H0"


def test_agree_sf():
    assert RC.agree_sf(1.2345, 1.2345) == RC.MAX_SF
    assert RC.agree_sf(1.2345, 1.2349) == 4 and RC.agree_sf(1.23, 1.31) == 1 and RC.agree_sf(1.0, 2.0) == 0
    assert RC.agree_sf(0.2511, 0.2495) == 2 and RC.agree_sf(4.803, 4.8031) == 4
    assert RC.agree_sf(-0.0702, -0.0748) == 1 and RC.agree_sf(-0.0702, -0.0808) == 0
    assert RC.agree_sf(float("nan"), 1.0) == 0 and RC.agree_sf(float("nan"), float("nan")) == RC.MAX_SF


def meter_summary(top, rise, c1, c2, rho):
    return pd.DataFrame([{"model": "tiny", "revision": "r1", "n_sequences": 4, "k": 7, "top_layer": top[0],
                          "top_head": top[1], "top_head_rise": rise, "D_MF_copy1": c1, "D_MF_copy2": c2,
                          "spearman_rho": rho}])


def class_table(scale):
    rows = [{"model": "tiny", "revision": "r1", "class": c, "n": 5, "D_MF": 0.2 * i * scale, "M_cov": 0.1 * i,
             "M_ctx": 0.1 * i * scale, "delta_L": 0.3 + i, "delta_L_perm": 0.01 * i, "accuracy": 0.5}
            for i, c in enumerate(["induction", "few-shot", "natural", "random"], start=1)]
    return pd.DataFrame(rows)


def test_recompute_job_writes_the_two_arms_side_by_side(tiny, tmp_path):
    """The calibrated_recompute job on the tiny model's stores (pass 2 and the substitution with W and with U) and two
    meter summaries and class tables: every row is the two arms' values, the ranking rows are recomputed from the
    stores; an arm computed with the wrong kernel is refused."""
    from scipy.stats import spearmanr
    from synthetic_stats import NamedList, run_job

    from mfpipe.stats.store import write_store

    model, ad, tokens, doc_ids, tracked, st, W_da, U_da = tiny
    paths = {}
    for arm, cal in (("w", None), ("u", U_da)):
        _, ds = pass2(tiny, calibrated=cal)
        paths[f"{arm}_deviation"] = str(write_store(ds, tmp_path / f"{arm}_deviation.zarr"))
        kernel = kernel_from_store(st, tracked, min_count=1, calibrated=cal)
        sums = SU.substitution_pass(ad, kernel, tokens, batch_size=6)
        res = SU.substitution_result(sums, kernel.attrs, model="tiny", revision="r1", corpus={"fingerprint": "fp"},
                                     tokens=tokens, shards=["shard-0"])
        res.to_zarr(tmp_path / f"{arm}_substitution.zarr", mode="w", zarr_format=3, consolidated=False)
        paths[f"{arm}_substitution"] = str(tmp_path / f"{arm}_substitution.zarr")
        paths[f"{arm}_summary"] = sums.summary()
        paths[f"{arm}_S"] = ds["S_bar"].values
    for arm, m, c in (("w", meter_summary((1, 2), 0.4, 0.10, 0.30, 0.5), class_table(1.0)),
                      ("u", meter_summary((1, 3), 0.41, 0.11, 0.32, 0.45), class_table(1.01))):
        m.to_csv(tmp_path / f"{arm}_meter.csv", index=False)
        c.to_csv(tmp_path / f"{arm}_classes.csv", index=False)
        paths[f"{arm}_meter"] = str(tmp_path / f"{arm}_meter.csv")
        paths[f"{arm}_classes"] = str(tmp_path / f"{arm}_classes.csv")
    inputs = {k: paths[k] for k in ("w_deviation", "u_deviation", "w_substitution", "u_substitution", "w_meter",
                                    "u_meter", "w_classes", "u_classes")}
    out = NamedList(csv=str(tmp_path / "calibrated.csv"), md=str(tmp_path / "calibrated.md"))
    params = NamedList(model="tiny", revision="r1", top=20)
    run_job("experiments.substitution", "calibrated_recompute", input=NamedList(**inputs), output=out,
            params=params, log=[str(tmp_path / "job.log")])
    df = pd.read_csv(out.csv).set_index("quantity")
    S_w, S_u = paths["w_S"], paths["u_S"]
    rho = df.loc[df.index.str.startswith("Spearman of S̄"), "U"].item()
    assert rho == pytest.approx(spearmanr(S_w.ravel(), S_u.ravel())[0], abs=1e-12) and not np.allclose(S_w, S_u)
    shift = np.abs(RC.head_ranks(S_u) - RC.head_ranks(S_w)).max()
    assert df.loc["largest rank shift", "U"] == shift
    for k in ("delta_L", "D_MF", "L_MF", "L_model"):
        want = (paths["w_summary"][k], paths["u_summary"][k])
        assert (df.loc[k, "W"], df.loc[k, "U"]) == pytest.approx(want, abs=1e-12)
    assert df.loc["L_model", "difference"] == 0  # the model's own loss does not depend on the kernel
    assert df.loc["boundary rise of D_MF (copy 2 - copy 1)", ["W", "U"]].tolist() == pytest.approx([0.2, 0.21])
    assert df.loc["top rising head: rise", ["W_head", "U_head"]].tolist() == ["L1H2", "L1H3"]
    assert df.loc["few-shot: D_MF", ["W", "U"]].tolist() == pytest.approx([0.4, 0.404])
    assert df.loc["few-shot: D_MF", "agree_sf"] == 2
    assert "Calibrated kernel U vs W: tiny @ r1" in Path(out.md).read_text()
    # an arm computed with the wrong kernel is refused
    bad = NamedList(**{**inputs, "u_deviation": paths["w_deviation"]})
    with pytest.raises(SystemExit):
        run_job("experiments.substitution", "calibrated_recompute", input=bad, output=out, params=params,
                log=[str(tmp_path / "bad.log")])
    assert "kernel 'W'" in Path(tmp_path / "bad.log").read_text()


def test_the_arms_are_the_runs_own_outputs_and_the_reruns_with_the_other_kernel():
    """The table's W arm is the run's own output where the run used W, the rerun's where it used U
    (`substitution.kernel: calibrated`); the prompt experiments always run with W, so their U arm is the rerun."""
    from types import SimpleNamespace

    from mfpipe.experiments.substitution import rules as SR
    from mfpipe.workflow.paths import store_pattern

    def plan(kernel):
        return SimpleNamespace(results="R", config={"substitution": {"kernel": kernel}},
                               store=lambda kind, **w: store_pattern(kind, "R", **w))

    wc = SimpleNamespace(model="m", revision="r")
    got = SR.recompute_inputs(plan("W"), wc)
    assert got["w_deviation"] == "R/deviation/m/r/deviation.zarr"
    assert got["u_deviation"] == "R/recompute/m/r/calibrated/deviation.zarr"
    assert got["w_substitution"] == "R/substitution/m/r/substitution.zarr"
    assert got["u_meter"] == "R/recompute/m/r/calibrated/icl_meter.csv" and got["w_meter"] == "R/tables/icl_meter_m_r.csv"
    got = SR.recompute_inputs(plan("calibrated"), wc)
    assert got["u_deviation"] == "R/deviation/m/r/deviation.zarr"
    assert got["w_deviation"] == "R/recompute/m/r/W/deviation.zarr"
    assert got["w_substitution"] == "R/recompute/m/r/W/substitution.zarr"
    assert got["u_classes"] == "R/recompute/m/r/calibrated/icl_classes.csv"
