"""Rollout divergence diagnostics (App. llama, mfpipe.experiments.rollout.divergence) and the MLP unit decomposition
(mfpipe.models.adapters.mlp_units), against recomputations by hand with the tiny models' own HF submodules
(tests/rollout_reference.py's Ref: value heads, output projection and blocks with Python loops over types, heads and
key columns) and the exact identities: the block's stages equal Alg. 1's block update bit for bit; the units' parts
sum to the MLP's nonlinear excess; the top-k share with k = every unit is 1."""

import numpy as np
import pandas as pd
import pytest
import torch
from rollout_reference import Ref
from tiny_models import make_tiny_model

from mfpipe.experiments.rollout import algorithm as R
from mfpipe.experiments.rollout import divergence as DV
from mfpipe.models.adapters import get_adapter
from mfpipe.models.adapters.mlp_units import mlp_units

N = 7


def _problem(mt, seed=0):
    """A tiny model, a random row-stochastic kernel, b^l and two nearby trajectories (rolled = true + error)."""
    model = make_tiny_model(mt, seed=5)
    a = get_adapter(model)
    L, H, d = a.n_layers, a.n_heads, a.d_model
    rng = np.random.default_rng(seed)
    K = rng.random((L, H, N, N + 2))
    K /= K.sum(-1, keepdims=True)
    bos = rng.normal(size=(L + 1, d)).astype(np.float32)
    true = rng.normal(size=(L + 1, N, d)).astype(np.float32)
    rolled = (true + 0.3 * rng.normal(size=true.shape)).astype(np.float32)
    return model, a, K, bos, rolled, true


def _hand_block(ref, l, K, bos, x):
    """(mid, out) of the mean-field block at the rows of x, with loops (Ref's value heads, projection, block)."""
    x = [torch.as_tensor(v) for v in x]
    keys = x + [torch.as_tensor(bos[l]), sum(x) / len(x)]
    mids, outs = [], []
    for s in range(len(x)):
        reads = []
        for h in range(ref.H):
            z = torch.zeros(ref.dh)
            for t in range(len(keys)):
                z = z + float(K[l, h, s, t]) * ref.value_head(l, keys[t], h)
            reads.append(z)
        r = torch.cat(reads)
        mids.append(x[s] + ref.o_proj_module(l)(r))
        outs.append(ref.finish(l, x[s], r))
    return torch.stack(mids).numpy(), torch.stack(outs).numpy()


@pytest.mark.parametrize("mt", ["gpt2", "llama"])
@torch.no_grad()
def test_amplification_split_equals_a_recomputation_by_hand(mt):
    model, a, K, bos, rolled, true = _problem(mt)
    ref = Ref(model)
    types = np.array([0, 2, 3, 5, 6])  # 1 and 4 unscored: they still feed the <other> column
    steps = DV.step_table(a, K, bos, rolled, true, types).set_index("layer")
    for l in range(a.n_layers):
        mh, oh = _hand_block(ref, l, K, bos, rolled[l])
        m, o = _hand_block(ref, l, K, bos, true[l])
        n = lambda v: np.linalg.norm(np.asarray(v, dtype=np.float64)[types])  # noqa: E731
        e_in, e_mid, e_out = n(rolled[l] - true[l]), n(mh - m), n(oh - o)
        row = steps.loc[l]
        assert row["amp_attention"] == pytest.approx(e_mid / e_in, rel=1e-5)
        assert row["amp_mlp"] == pytest.approx(e_out / e_mid, rel=1e-5)
        assert row["amp_block"] == pytest.approx(e_out / e_in, rel=1e-5)
        assert row["persist"] == pytest.approx(n(rolled[l + 1] - true[l + 1]) / e_in, rel=1e-5)


@pytest.mark.parametrize("mt", ["gpt2", "gpt_neox", "llama", "gemma2"])
def test_block_stages_are_alg1s_block_update_bit_for_bit(mt):
    _, a, K, bos, _, true = _problem(mt)
    x = torch.as_tensor(true[0])
    reads = R.head_reads(a, 0, K[0], x, torch.as_tensor(bos[0]))
    assert torch.equal(DV.block_stages(a, 0, K[0], torch.as_tensor(bos[0]), x)[2], R.block_update(a, 0, x, reads))


def _hand_mlp(model, mt, l):
    """The MLP of block l as a function of its residual input, by its HF submodules: (hidden, output)."""
    b = Ref(model).blocks[l]
    if mt == "gpt2":
        def f(m):
            h = b.mlp.act(b.mlp.c_fc(b.ln_2(m)))
            return h, b.mlp.c_proj(h)
    else:
        def f(m):
            u = b.post_attention_layernorm(m)
            h = b.mlp.act_fn(b.mlp.gate_proj(u)) * b.mlp.up_proj(u)
            return h, b.mlp.down_proj(h)
    return f


@pytest.mark.parametrize("mt", ["gpt2", "llama"])
def test_units_sum_exactly_to_the_mlps_nonlinear_excess(mt):
    """On float64 copies: sum_k eps_k W_k equals MLP(m̂) - MLP(m) - J(m)(m̂ - m), with the MLP and its Jacobian-vector
    product taken by hand through the HF submodules and autograd (1e-6 relative)."""
    model, _, _, _, rolled, true = _problem(mt)
    model = model.double()
    a = get_adapter(model)
    f = _hand_mlp(model, mt, 1)
    m, mh = torch.as_tensor(true[1], dtype=torch.float64), torch.as_tensor(rolled[1], dtype=torch.float64)
    out_m, jvp = torch.autograd.functional.jvp(lambda v: f(v)[1], (m,), (mh - m,))
    excess = (f(mh)[1] - out_m - jvp).detach()
    u, uh = mlp_units(a, 1, m, tangent=mh - m), mlp_units(a, 1, mh)
    parts = torch.einsum("nk,kd->nkd", uh.hidden - u.hidden - u.hidden_tangent, u.weight)
    assert torch.linalg.vector_norm(parts.sum(1) - excess) <= 1e-6 * torch.linalg.vector_norm(excess)
    assert torch.allclose(u.out, out_m.detach(), rtol=1e-10, atol=1e-10)
    share, energy, (e, delta, resid) = DV.unit_shares(uh, u, torch.arange(N))
    assert share.sum() == pytest.approx(1.0, abs=1e-9) and resid < 1e-9
    assert e == pytest.approx(float(torch.linalg.vector_norm(excess)), rel=1e-9)
    assert np.allclose(energy, parts.norm(dim=(0, 2)).numpy(), rtol=1e-9)


def test_unit_table_top_k_of_every_unit_recovers_everything():
    _, a, K, bos, rolled, true = _problem("llama")
    types = np.arange(N)
    full = DV.unit_table(a, K, bos, rolled, true, types, top_k=10**6, n_random=2)
    assert np.allclose(full["share_top_k"], 1.0, atol=1e-5) and np.allclose(full["share_random_k"], 1.0, atol=1e-5)
    few = DV.unit_table(a, K, bos, rolled, true, types, top_k=3, n_random=4)
    assert (few["top_k"] == 3).all() and (few["share_top_k"] < 1.0).all()


def test_curvature_at_alpha_one_is_the_steps_amplification():
    _, a, K, bos, rolled, true = _problem("gpt2")
    types = np.arange(N)
    steps = DV.step_table(a, K, bos, rolled, true, types).set_index("layer")["amp_block"]
    cur = DV.curvature_table(a, K, bos, rolled, true, types, alphas=(0.5, 1.0))
    one = cur[cur["alpha"] == 1.0].set_index("layer")["amp_real"]
    assert np.allclose(one.to_numpy(), steps.to_numpy(), rtol=1e-5)
    assert cur["amp_random"].notna().all()


def test_token_tables_and_pairs():
    _, a, K, bos, rolled, true = _problem("gpt2")
    types = np.arange(N)
    strings = [" The", " the", "And", "and", " x", "I", " i"]
    dist, top, amps, tfs = DV.token_tables(a, K, bos, rolled, true, types, strings, n_top=3)
    e_in = np.linalg.norm(rolled[0] - true[0], axis=1)
    assert amps.shape == (a.n_layers, N) and (top.groupby("layer").size() == 3).all()
    assert dist.loc[0, "max"] == pytest.approx(amps[0].max()) and dist.loc[0, "median"] == pytest.approx(
        np.median(amps[0]))
    order = np.argsort(-amps[0])
    e_out = amps[0] * e_in
    assert dist.loc[0, "top10_energy_share"] == pytest.approx(1.0)  # 7 types: the top ten are all of them
    assert top[top["layer"] == 0]["type"].tolist() == order[:3].tolist()
    assert e_out[order[0]] == pytest.approx(top.iloc[0]["err_out"], rel=1e-5)
    assert DV.capitalisation_pairs(strings, types) == [(0, 1), (2, 3)]  # "I"/" i" differ in leading space
    pairs = pd.DataFrame({"amp_ratio": [2.0, 2.0, 2.0, 0.5], "tf_ratio": [1.0, 1.0, 1.0, 1.0]})
    s = DV.pairs_summary(pairs).set_index("ratio")
    assert s.loc["amp_ratio", "median"] == 2.0 and s.loc["amp_ratio", "n_pairs"] == 4
    assert np.isnan(s.loc["tf_ratio", "wilcoxon_p"])  # all log ratios 0: no test


def test_magnitude_table_ratio():
    rng = np.random.default_rng(0)
    true = rng.normal(size=(3, 6, 4))
    rolled = 2.0 * true + 5.0  # twice the spread, shifted: centred ratio 2, centred cosine 1
    mag = DV.magnitude_table(rolled, true, np.arange(6))
    assert np.allclose(mag["ratio"], 2.0) and np.allclose(mag["cosine"], 1.0)


def test_no_incoming_error_is_no_amplification():
    """A rotary model's rollout starts at the input embeddings, which are the layer-0 centroids: the error entering
    block 0 is rounding, and its ratio is reported as NaN (not a spurious peak); the headline takes block 1."""
    _, a, K, bos, rolled, true = _problem("llama")
    rolled = rolled.copy()
    rolled[0] = true[0] * (1 + 1e-7)
    types = np.arange(N)
    steps = DV.step_table(a, K, bos, rolled, true, types)
    assert np.isnan(steps.loc[0, ["amp_attention", "amp_mlp", "amp_block"]].astype(float)).all()
    assert np.isfinite(steps.loc[1, "amp_block"])
    dist, top, amps, tfs = DV.token_tables(a, K, bos, rolled, true, types, [str(i) for i in range(N)])
    assert np.isnan(amps[0]).all() and np.isfinite(amps[1]).all()
    assert np.isnan(dist.loc[0, ["median", "p99", "max", "top10_energy_share"]].astype(float)).all()
    mag = DV.magnitude_table(rolled, true, types)
    tables = {"steps": steps, "tokens": dist, "top_tokens": top, "magnitude": mag}
    h = DV.headline(tables)
    assert h["peak_layer"] == 1 and h["peak_amplification"] == pytest.approx(steps.loc[1, "amp_block"])
    assert h["top_tokens"] == top[top["layer"] == 1]["token"].head(10).tolist()


def test_a_mixture_of_experts_keeps_its_unit_rows_with_the_reason():
    """Issue 59 item 6: a mixture of experts has no fixed hidden units. On a tiny Mixtral whose block 1 is given a
    dense gated MLP (a MoE model with dense layers), the unit table keeps block 0's row without readings, saying why,
    and computes block 1 as a dense model's (every unit recovers the whole excess, the identity exact); a dense
    model's table has no such column."""
    import transformers

    from mfpipe.models.adapters.mlp_units import MOE_REASON, NoUnitDecomposition

    model, _, K, bos, rolled, true = _problem("mixtral")
    with pytest.raises(NoUnitDecomposition, match="mixture of experts"):
        mlp_units(get_adapter(model), 0, torch.as_tensor(true[0]))
    dense = transformers.models.llama.modeling_llama.LlamaMLP(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, hidden_act="silu"))
    with torch.no_grad():
        for p in dense.parameters():
            p.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(p.numel()))
    model.model.layers[1].mlp = dense.eval()
    a = get_adapter(model)
    types = np.arange(N)
    units = DV.unit_table(a, K, bos, rolled, true, types, top_k=10**6, n_random=2)
    assert units["layer"].tolist() == [0, 1]
    assert units["not_applicable"].tolist() == [f"not applicable: {MOE_REASON}", ""]
    moe, dense_row = units.iloc[0], units.iloc[1]
    assert dense_row["n_units"] == 96 and dense_row["top_k"] == 96 and dense_row["excess"] > 0
    assert dense_row["share_top_k"] == pytest.approx(1.0, abs=1e-5) and dense_row["decomposition_residual"] < 1e-4
    assert pd.isna(moe["n_units"]) and np.isnan(moe[["excess", "share_top_k", "share_all"]].astype(float)).all()
    dist, top, _, _ = DV.token_tables(a, K, bos, rolled, true, types, [str(i) for i in range(N)])
    md = DV.markdown({"steps": DV.step_table(a, K, bos, rolled, true, types), "units": units, "tokens": dist,
                      "top_tokens": top, "magnitude": DV.magnitude_table(rolled, true, types),
                      "curvature": pd.DataFrame(), "pairs_summary": pd.DataFrame(), "pairs": pd.DataFrame()}, "moe")
    assert f"not applicable: {MOE_REASON}" in md
    _, d, K2, bos2, rolled2, true2 = _problem("llama")
    assert "not_applicable" not in DV.unit_table(d, K2, bos2, rolled2, true2, types, top_k=3, n_random=2)
