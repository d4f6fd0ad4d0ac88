"""Rollout divergence diagnostics (paper App. ``app:llama``): the rolled-out and the true centroid trajectories
tracked together, to say where a rollout's error grows and how.

Notation: ``x^l`` the true centroids entering block ``l`` (the evaluation half's, the truth a rollout is scored
against; a type without an evaluation occurrence keeps the statistics half's centroid so the block's ``<other>``
column stays finite, and is never scored), ``x̂^l`` the rollout's (Alg. 1 with the diagnosed kernel, its own
``x̂^{l+1} = F_l(x̂^l)``), ``F_l`` the mean-field block (:func:`block_stages`: reads from the kernel at the block's own
input, output projection, post-attention norm, residual, MLP -- exactly
:func:`mfpipe.experiments.rollout.algorithm.block_update`). Norms are Frobenius over the scored types.

* per-step amplification: ``e_in = x̂^l - x^l``, ``e_mid`` the difference after the attention update
  (``x + a(x)``), ``e_out = F_l(x̂^l) - F_l(x^l)``; ``amp_attention = |e_mid|/|e_in|``, ``amp_mlp = |e_out|/|e_mid|``,
  ``amp_block`` their product; ``persist = |x̂^{l+1} - x^{l+1}| / |e_in|`` is the step the rollout actually took
  (the block's propagation plus its own new error);
* the curvature test: ``|F(x + αe) - F(x)| / |αe|`` over ``alphas``, for the real error and for a random error with
  each type's norm (seeded);
* the MLP's nonlinear excess ``E = MLP(m̂) - MLP(m) - J(m)(m̂ - m)`` (``m`` the MLP's input) decomposed exactly over
  its hidden units (:func:`mfpipe.models.adapters.mlp_units.mlp_units`): unit ``k`` contributes ``C_k = ε_k W_k``,
  ``sum_k C_k = E``; the share a set recovers is ``<sum_K C_k, E> / |E|^2`` (the shares of all units sum to 1);
  top-k units by ``|C_k|`` against ``k`` random units (mean over draws); a block whose MLP is a mixture of experts
  has no fixed hidden units: its row is kept with the reason (``not_applicable``), every other table is computed;
* per-token amplification ``|e_out_s| / |e_in_s|``: median, 99th percentile, max, the ten most amplified types'
  share of the output-error energy, the top types by string;
* the centred magnitude: the predicted centroid cloud's centred RMS norm over the true one, per depth (with the
  rollout's centred cosine);
* capitalisation pairs: every scored pair of types that differ only by the case of their first letter
  (`` The``/`` the``): the capitalised form's amplification at the peak layer and its teacher-forced error
  (``|F_l(x^l)_s - x^{l+1}_s|`` over the true centred norm, mean over layers) over the lower-case form's; Wilcoxon
  signed-rank p of the log ratios.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from mfpipe.experiments.rollout import algorithm as R
from mfpipe.experiments.rollout import metrics as M
from mfpipe.models.adapters.forms import side_branch
from mfpipe.models.adapters.hybrid import mixer_block
from mfpipe.models.adapters.joins import run_block
from mfpipe.models.adapters.mlp_units import NoUnitDecomposition, mlp_units

__all__ = ["DEFAULT_ALPHAS", "block_stages", "trajectories", "step_table", "curvature_table", "unit_table",
           "unit_shares", "token_tables", "magnitude_table", "capitalisation_pairs", "pairs_summary", "run", "headline", "markdown"]

DEFAULT_ALPHAS = (0.1, 0.25, 0.5, 1.0, 2.0)


def _t(adapter, x) -> torch.Tensor:
    return torch.as_tensor(np.asarray(x), dtype=torch.float32, device=adapter.device)


def _norm(x: torch.Tensor, rows: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(x[rows].double()))


# an incoming error below this share of the centroids' norm is float32 rounding (a rotary model's rollout starts at the
# input embeddings, which ARE the layer-0 centroids): its "amplification" would be noise, reported as NaN
NO_ERROR = 1e-5


def _ratio(a: float, b: float, scale: float) -> float:
    return a / b if b > NO_ERROR * max(scale, 1e-30) else float("nan")


@torch.no_grad()
def block_stages(adapter, layer: int, kernel_l, bos_l, x: torch.Tensor,
                 carry: dict | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The mean-field block at ``x [N, d]``: ``(mid, mlp_in, out)`` with ``mid = x + a(x)`` (the attention update;
    where the block joins its branches in a form of its own, what its MLP's norm reads: adapters.joins),
    ``mlp_in`` what the MLP reads (``mid``; ``x`` for a parallel-residual block) and ``out = F_l(x)``, equal to
    :func:`~mfpipe.experiments.rollout.algorithm.block_update` bit for bit; a hybrid's block of another mixer is the
    model's own on each row (no attention update: ``mid = mlp_in = x``; ``out`` as the rollout takes it). ``carry``:
    a state the blocks hand each other beside the residual (Zaya's), kept along the rows' layers (joins.run_block)."""
    if layer not in adapter.attention_layers:
        return x, x, mixer_block(adapter, layer, x)
    reads = R.head_reads(adapter, layer, kernel_l, x, bos_l)
    if adapter.structure.join == "model":  # a join of the block's own: mid is what the MLP's norm reads
        mid, out = run_block(adapter, layer, x, R.attention_output(adapter, layer, reads, bias=True, at=x), carry=carry)
        return mid, mid, out
    a = R.attention_output(adapter, layer, reads, bias=True, post_norm=True, at=x)  # as block_update: x's gate
    side = side_branch(adapter, layer, x[:, None])  # as block_update: a mixer beside the attention (Falcon-H1)
    mid = x + (a if side is None else a + side[:, 0])
    mlp_in = x if adapter.parallel_residual else mid
    return mid, mlp_in, adapter.block_join(layer, mid, adapter.mlp(layer, mlp_in).float())


@R.on_types
def trajectories(adapter, setup, kernel, pin: tuple | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(rolled, true)``, both ``[L+1, N, d]`` float32: the rollout of ``kernel`` from ``setup``'s start (``pin``:
    ``(dims, values)`` of App. I) and the evaluation half's centroids (rows of types it lacks: the statistics half's)."""
    kw = {} if pin is None else {"pin_dims": pin[0], "pin_values": pin[1]}
    rolled = R.rollout(adapter, kernel, setup.bos, init=setup.init, **kw)
    true = np.array(setup.truth, dtype=np.float64)
    bad = ~np.isfinite(true).all(axis=(0, 2))
    true[:, bad] = np.asarray(setup.stats_centroids, dtype=np.float64)[:, bad]
    return rolled, true.astype(np.float32)


def _steps(adapter, kernel, bos, rolled, true, before: dict | None = None):
    """Per layer: the block's stages at the rolled and at the true centroids, each along its own trajectory (a state
    the blocks hand each other: carried along each); ``before``, where given, holds the true trajectory's state as
    it enters the layer (for a block run at other rows there: copy it)."""
    carry_h, carry = {}, {}
    for layer in range(adapter.n_layers):
        Kl, b = np.asarray(kernel[layer]), _t(adapter, bos[layer])
        xh, x = _t(adapter, rolled[layer]), _t(adapter, true[layer])
        if before is not None:
            before.clear()
            before.update(carry)
        yield (layer, xh, x, block_stages(adapter, layer, Kl, b, xh, carry_h),
               block_stages(adapter, layer, Kl, b, x, carry))


def step_table(adapter, kernel, bos, rolled, true, types) -> pd.DataFrame:
    """Per block: the incoming error (absolute and over the true centroids' norm), its amplification by the attention
    update, the MLP and the block, the step the rollout took, and the teacher-forced centred cosine of ``F_l(x^l)``
    against ``x^{l+1}``."""
    rows, L, S = [], adapter.n_layers, torch.as_tensor(types)
    for layer, xh, x, (mh, _, oh), (m, _, o) in _steps(adapter, kernel, bos, rolled, true):
        e_in, e_mid, e_out = _norm(xh - x, S), _norm(mh - m, S), _norm(oh - o, S)
        scale = _norm(x, S)
        nxt = _norm(_t(adapter, rolled[layer + 1]) - _t(adapter, true[layer + 1]), S)
        rows.append({"layer": layer, "layer_kind": adapter.layer_kinds[layer], "frac_depth": (layer + 1) / L,
                     "err_in": e_in, "err_in_rel": e_in / scale,
                     "err_out": e_out, "amp_attention": _ratio(e_mid, e_in, scale),
                     "amp_mlp": _ratio(e_out, e_mid, scale), "amp_block": _ratio(e_out, e_in, scale),
                     "persist": _ratio(nxt, e_in, scale),
                     "tf_cosine": M.centered_cosine(o[S].cpu().numpy(), true[layer + 1][types])})
    return pd.DataFrame(rows)


def curvature_table(adapter, kernel, bos, rolled, true, types, alphas=DEFAULT_ALPHAS, seed: int = 0) -> pd.DataFrame:
    """Per block and ``alpha``: the block's amplification of the real incoming error rescaled to ``alpha e`` and of
    a random error with each type's norm of ``alpha e`` (one seeded draw per block)."""
    rows, S = [], torch.as_tensor(types)
    gen = torch.Generator().manual_seed(int(seed))
    before: dict = {}
    for layer, xh, x, _, (_, _, o) in _steps(adapter, kernel, bos, rolled, true, before):
        e = xh - x
        r = torch.randn(e.shape, generator=gen, dtype=torch.float32).to(e.device)
        r = r * (e.norm(dim=1, keepdim=True) / r.norm(dim=1, keepdim=True).clamp_min(1e-30))
        Kl, b, scale = np.asarray(kernel[layer]), _t(adapter, bos[layer]), _norm(x, S)
        for alpha in alphas:
            row = {"layer": layer, "alpha": float(alpha), "err_in_rel": float(alpha) * _norm(e, S) / scale}
            for name, d in (("real", e), ("random", r)):
                out = block_stages(adapter, layer, Kl, b, x + float(alpha) * d, dict(before))[2]
                row[f"amp_{name}"] = _ratio(_norm(out - o, S), float(alpha) * _norm(d, S), scale)
            rows.append(row)
    return pd.DataFrame(rows)


def unit_shares(units_hat, units, rows) -> tuple[np.ndarray, float, float, float]:
    """``(share [F], energy [F], (|E|, |ΔMLP|, |sum_k C_k - E| / |E|))`` of the nonlinear excess ``E`` over the rows
    ``rows``: each unit's share ``<C_k, E> / |E|^2`` and norm ``|C_k|``; ``units`` carries the tangent ``m̂ - m``."""
    eps = (units_hat.hidden - units.hidden - units.hidden_tangent)[rows].double()  # [n, F]
    W = units.weight.double()  # [F, d]
    E = (units_hat.out - units.out - units.out_tangent)[rows].double()  # [n, d]
    E2 = float((E * E).sum())
    g = (eps * (E @ W.T)).sum(0)  # <C_k, E> per unit
    recon = float(torch.linalg.vector_norm(eps @ W - E))
    delta = float(torch.linalg.vector_norm((units_hat.out - units.out)[rows].double()))
    energy = eps.norm(dim=0) * W.norm(dim=1)
    share = (g / E2).cpu().numpy() if E2 > 0 else np.full(W.shape[0], np.nan)
    return share, energy.cpu().numpy(), (E2 ** 0.5, delta, recon / E2 ** 0.5 if E2 > 0 else float("nan"))


UNIT_COLUMNS = ("layer", "n_units", "top_k", "excess", "excess_share", "share_top_k", "share_random_k", "share_all",
                "decomposition_residual", "post_norm")


def unit_table(adapter, kernel, bos, rolled, true, types, top_k: int = 25, n_random: int = 8,
               seed: int = 0) -> pd.DataFrame:
    """Per block: the MLP's nonlinear excess at the rolled input (over the response ``|ΔMLP|``), the share of it the
    top-``k`` units (by ``|C_k|``) recover, the mean share of ``k`` random units over ``n_random`` draws, and the
    decomposition's residual ``|sum_k C_k - E| / |E|`` (rounding: it is exact). A block whose MLP has no fixed hidden
    units (a mixture of experts: :class:`~mfpipe.models.adapters.mlp_units.NoUnitDecomposition`) keeps its row, its
    readings NaN and the reason in a ``not_applicable`` column ("not applicable: ..."; empty on the rows computed),
    which the table has only where some block does not apply: a dense model's table is unchanged."""
    rows, S = [], torch.as_tensor(types)
    rng = np.random.default_rng(int(seed))
    for layer, _, _, (_, in_h, _), (_, m_in, _) in _steps(adapter, kernel, bos, rolled, true):
        try:
            uh = mlp_units(adapter, layer, in_h)
            u = mlp_units(adapter, layer, m_in, tangent=in_h - m_in)  # the tangent in the model's dtype: m̂ - m as fed
        except NoUnitDecomposition as e:
            rows.append({**dict.fromkeys(UNIT_COLUMNS, np.nan), "layer": layer,
                         "post_norm": adapter.structure.post_mlp_norm is not None,
                         "not_applicable": f"not applicable: {e.reason}"})
            continue
        share, energy, (e_norm, delta, resid) = unit_shares(uh, u, S)
        F = share.size
        k = min(int(top_k), F)
        top = np.argsort(-energy, kind="stable")[:k]
        rand = [share[rng.choice(F, size=k, replace=False)].sum() for _ in range(int(n_random))]
        if _norm(in_h - m_in, S) <= NO_ERROR * _norm(m_in, S):  # no incoming error: the "excess" is rounding
            share, rand, e_norm, resid = np.full(F, np.nan), [np.nan], np.nan, np.nan
        rows.append({"layer": layer, "n_units": F, "top_k": k, "excess": e_norm,
                     "excess_share": e_norm / delta if delta > 0 else float("nan"),
                     "share_top_k": float(share[top].sum()), "share_random_k": float(np.mean(rand)),
                     "share_all": float(share.sum()), "decomposition_residual": resid, "post_norm": u.post_norm})
    df = pd.DataFrame(rows)
    if "not_applicable" in df:
        df["not_applicable"] = df["not_applicable"].fillna("")
        df = df.astype({"n_units": "Int64", "top_k": "Int64"})  # counts stay integers beside the blocks' NaN
    return df


def _per_token(adapter, kernel, bos, rolled, true, types):
    """Per block: ``(e_in_s, e_out_s, teacher-forced relative error_s, |x_s|)`` over the scored types."""
    S = torch.as_tensor(types)
    for layer, xh, x, (_, _, oh), (_, _, o) in _steps(adapter, kernel, bos, rolled, true):
        nxt = _t(adapter, true[layer + 1])[S]
        centred = (nxt - nxt.mean(0)).norm(dim=1)
        tf = (o[S] - nxt).norm(dim=1) / centred.clamp_min(1e-30)
        yield layer, (xh - x)[S].norm(dim=1).double().cpu().numpy(), (oh - o)[S].norm(dim=1).double().cpu().numpy(), \
            tf.double().cpu().numpy(), x[S].norm(dim=1).double().cpu().numpy()


def token_tables(adapter, kernel, bos, rolled, true, types, strings, n_top: int = 20
                 ) -> tuple[pd.DataFrame, pd.DataFrame, np.ndarray, np.ndarray]:
    """``(distribution, top, amplification [L, n], teacher-forced error [L, n])``: per block the per-token
    amplification's median, 99th percentile, max and the ten most amplified types' share of the output-error
    energy; the ``n_top`` most amplified types of every block by string."""
    dist, top, amps, tfs = [], [], [], []
    for layer, e_in, e_out, tf, scale in _per_token(adapter, kernel, bos, rolled, true, types):
        tiny = e_in <= NO_ERROR * np.maximum(scale, 1e-30)
        a = np.where(tiny, np.nan, e_out / np.where(tiny, 1.0, e_in))
        amps.append(a)
        tfs.append(tf)
        order = np.argsort(-np.nan_to_num(a, nan=-np.inf), kind="stable")
        energy = e_out**2
        dist.append({"layer": layer, "median": float(np.nanmedian(a)) if np.isfinite(a).any() else np.nan,
                     "p99": float(np.nanpercentile(a, 99)) if np.isfinite(a).any() else np.nan,
                     "max": float(np.nanmax(a)) if np.isfinite(a).any() else np.nan,
                     "top10_energy_share": float(energy[order[:10]].sum() / energy.sum())
                     if energy.sum() > 0 and np.isfinite(a).any() else np.nan, "n_types": int(np.isfinite(a).sum())})
        for rank, i in enumerate(order[:n_top]):
            top.append({"layer": layer, "rank": rank + 1, "type": int(types[i]), "token": strings[int(types[i])],
                        "amplification": float(a[i]), "err_in": float(e_in[i]), "err_out": float(e_out[i])})
    return pd.DataFrame(dist), pd.DataFrame(top), np.stack(amps), np.stack(tfs)


def magnitude_table(rolled, true, types) -> pd.DataFrame:
    """Per depth ``1..L``: the predicted and true centred RMS norms of the scored types' centroid cloud, their ratio,
    and the rollout's centred cosine."""
    rows, L = [], rolled.shape[0] - 1
    for depth in range(1, L + 1):
        p, t = M.center(rolled[depth][types]), M.center(true[depth][types])
        pn, tn = float(np.sqrt((p**2).sum(1).mean())), float(np.sqrt((t**2).sum(1).mean()))
        rows.append({"depth": depth, "frac_depth": depth / L, "pred_centred_rms": pn, "true_centred_rms": tn,
                     "ratio": pn / tn if tn > 0 else np.nan,
                     "cosine": M.centered_cosine(rolled[depth][types], true[depth][types])})
    return pd.DataFrame(rows)


def capitalisation_pairs(strings, types) -> list[tuple[int, int]]:
    """Scored ``(capitalised, lower-case)`` type pairs whose strings differ only by the case of the first letter
    after any leading whitespace (`` The``/`` the``, ``And``/``and``), as positions into ``types``."""
    pos = {strings[int(t)]: i for i, t in enumerate(types)}
    out = []
    for s, i in pos.items():
        body = s.lstrip()
        if body[:1].isalpha() and body[:1].isupper():
            low = s[: len(s) - len(body)] + body[0].lower() + body[1:]
            if low != s and low in pos:
                out.append((i, pos[low]))
    return sorted(out)


def pairs_summary(pairs: pd.DataFrame) -> pd.DataFrame:
    """One row per ratio (amplification, teacher-forced error): pairs counted, the paired median ratio and the Wilcoxon
    signed-rank p of the log ratios (NaN with fewer than two finite pairs)."""
    from scipy.stats import wilcoxon

    rows = []
    for name in ("amp_ratio", "tf_ratio"):
        r = pairs[name].to_numpy(dtype=np.float64) if len(pairs) else np.array([])
        r = r[np.isfinite(r) & (r > 0)]
        lr = np.log(r)
        p = float(wilcoxon(lr).pvalue) if r.size >= 2 and np.any(lr != 0) else np.nan
        rows.append({"ratio": name, "n_pairs": int(r.size), "median": float(np.median(r)) if r.size else np.nan,
                     "wilcoxon_p": p})
    return pd.DataFrame(rows)


def _pairs_table(strings, types, amp_peak, tf_mean) -> pd.DataFrame:
    rows = [{"capitalised": strings[int(types[i])], "lower": strings[int(types[j])],
             "amp_ratio": amp_peak[i] / amp_peak[j] if amp_peak[j] > 0 else np.nan,
             "tf_ratio": tf_mean[i] / tf_mean[j] if tf_mean[j] > 0 else np.nan}
            for i, j in capitalisation_pairs(strings, types)]
    return pd.DataFrame(rows, columns=["capitalised", "lower", "amp_ratio", "tf_ratio"])


@torch.no_grad()
@R.on_types
def run(adapter, setup, kernel, *, alphas=DEFAULT_ALPHAS, top_k: int = 25, n_random: int = 8, seed: int = 0,
        pin: tuple | None = None, n_top: int = 20) -> dict[str, pd.DataFrame]:
    """Every diagnostic of the module for the rollout of ``kernel`` on ``setup``
    (:class:`mfpipe.experiments.rollout.runs.RolloutSetup`): tables ``steps``, ``curvature``, ``units``, ``tokens``,
    ``top_tokens``, ``magnitude``, ``pairs`` and ``pairs_summary``. The capitalisation pairs compare each pair's
    amplification at the block with the largest ``amp_block``."""
    rolled, true = trajectories(adapter, setup, kernel, pin)
    types = np.asarray(setup.types)
    strings = [str(s) for s in setup.st.ds["query_str"].values]
    args = (adapter, kernel, setup.bos, rolled, true, types)
    steps = step_table(*args)
    tokens, top, amps, tfs = token_tables(*args, strings=strings, n_top=n_top)
    peak = _peak_layer(steps)
    amp_peak = amps[peak] if peak is not None else np.full(types.size, np.nan)
    pairs = _pairs_table(strings, types, amp_peak, np.nanmean(tfs, axis=0))
    return {"steps": steps, "curvature": curvature_table(*args, alphas=alphas, seed=seed),
            "units": unit_table(*args, top_k=top_k, n_random=n_random, seed=seed), "tokens": tokens,
            "top_tokens": top, "magnitude": magnitude_table(rolled, true, types), "pairs": pairs,
            "pairs_summary": pairs_summary(pairs)}


def _peak_layer(steps: pd.DataFrame) -> int | None:
    a = steps["amp_block"].to_numpy(dtype=np.float64)
    return None if not np.isfinite(a).any() else int(steps["layer"].iloc[int(np.nanargmax(a))])


def headline(tables: dict) -> dict:
    """The readings the paper quotes from :func:`run`'s tables: the largest per-step amplification, its block and
    which stage (attention update or MLP) expands more there, the peak centred-magnitude ratio, the ten most
    amplified types' share of the output-error energy at that block and their strings, the mean rollout centred cosine
    and the mean teacher-forced centred cosine of the whole block (``F_l(x^l)`` against ``x^{l+1}``; fig:tf-attention's
    is the attention output's alone)."""
    steps, mag = tables["steps"], tables["magnitude"]
    peak = _peak_layer(steps)
    out = {"peak_amplification": np.nan, "peak_layer": None, "peak_split": None, "top10_energy_share": np.nan,
           "top_tokens": [], "peak_magnitude_ratio": float(mag["ratio"].max()),
           "rollout_cosine": float(mag["cosine"].mean()), "block_tf_cosine": float(steps["tf_cosine"].mean())}
    if peak is not None:
        row = steps.set_index("layer").loc[peak]
        top = tables["top_tokens"]
        out.update(peak_amplification=float(row["amp_block"]), peak_layer=peak,
                   peak_split="mlp" if row["amp_mlp"] >= row["amp_attention"] else "attention",
                   top10_energy_share=float(tables["tokens"].set_index("layer").loc[peak, "top10_energy_share"]),
                   top_tokens=top[top["layer"] == peak]["token"].head(10).tolist())
    return out


def markdown(tables: dict, title: str) -> str:
    """All of :func:`run`'s tables as one Markdown page."""
    from mfpipe.workflow.tables import to_markdown

    h = headline(tables)
    lines = [f"**{title}**", "",
             f"Largest per-step amplification {h['peak_amplification']:.3g}x at block {h['peak_layer']} "
             f"(larger stage: {h['peak_split']}); peak centred-magnitude ratio {h['peak_magnitude_ratio']:.3g}; "
             f"ten most amplified types carry {h['top10_energy_share']:.1%} of the output-error energy there; "
             f"rollout cosine {h['rollout_cosine']:.3f}, teacher-forced block (F_l at the true centroids against "
             f"the next) {h['block_tf_cosine']:.3f}.", ""]
    captions = {"steps": "Per-step error amplification (attention update, MLP, block)",
                "curvature": "Curvature test: amplification of the rescaled real error and of a random one",
                "units": "The MLP's nonlinear excess over its hidden units", "tokens": "Per-token amplification",
                "top_tokens": "Most amplified types", "magnitude": "Centred magnitude, predicted over true",
                "pairs_summary": "Capitalisation pairs (capitalised over lower-case)", "pairs": "The pairs"}
    for key, cap in captions.items():
        lines += [f"*{cap}*", "", to_markdown(tables[key].round(4)) if len(tables[key]) else "(none)", ""]
    return "\n".join(lines)
