"""The J-lens estimate's checks on its own position sample (how reliable ``J`` is), and the checks table the
``jlens`` job writes (with the decode agreement of :mod:`mfpipe.jlens.agreement`).

The ``n`` sampled positions of :func:`mfpipe.jlens.lens.estimate_jlens`, in their sampled order (a random order:
:func:`~mfpipe.jlens.lens.sample_positions`), fall into four nested-prefix blocks, ``[0, n//8)``, ``[n//8, n//4)``,
``[n//4, n//2)`` and ``[n//2, n)`` (:func:`sample_groups`). The estimate sums each block's Jacobians beside its total
(:func:`~mfpipe.models.adapters.jacobian.position_jacobians` with ``groups``; the total, and so ``J``, is computed
exactly as without them), on ``r`` kept output dimensions (:func:`check_row_indices`: every one when ``d <= r``, else
a seeded random subset), and from those four sums (:func:`sample_checks`), per (point, layer):

* **split half**: ``||J_A - J_B||_F / ||J||_F``, ``J_A`` the mean over the first ``n//2`` samples, ``J_B`` over the
  other ``n - n//2`` (two disjoint position samples), ``J`` over all ``n``. A split half's own sampling error is about
  ``sqrt(2)`` times that of a mean over ``n/2``; ``J``'s is about half the split-half difference.
* **convergence**: ``||J_k - J_n||_F / ||J_n||_F`` for ``k`` in ``n//8, n//4, n//2`` (the mean over the first
  ``k`` samples, a nested prefix of the random order) and ``k = n`` (0).

All norms are over the kept rows only (``r x d`` entries of each ``J``). For ``n < 8`` the empty blocks are skipped:
the sizes ``k`` are the distinct positive ones of ``n//8, n//4, n//2, n`` (:func:`check_sizes`), and the split half
needs ``n >= 2`` (NaN below). NaN at (``attn``, ``L``), where there is no ``J``.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

__all__ = ["N_GROUPS", "sample_bounds", "sample_groups", "check_sizes", "check_row_indices", "sample_checks",
           "checks_table", "checks_markdown", "summary_lines"]

N_GROUPS = 4  # the nested-prefix blocks [0, n/8), [n/8, n/4), [n/4, n/2), [n/2, n)


def sample_bounds(n: int) -> list[int]:
    """``[0, n//8, n//4, n//2, n]``: the blocks' boundaries in the sampled order (empty blocks for ``n < 8``)."""
    n = int(n)
    return [0, n // 8, n // 4, n // 2, n]


def sample_groups(n: int) -> np.ndarray:
    """The block (``0..3``) of each of the ``n`` samples, int64 ``[n]``, by its index in the sampled order."""
    b = sample_bounds(n)
    return np.searchsorted(np.asarray(b[1:4]), np.arange(int(n)), side="right").astype(np.int64)


def check_sizes(n: int) -> list[int]:
    """The nested-prefix sizes the convergence check compares with ``n``: the distinct positive ones of ``n//8``,
    ``n//4``, ``n//2``, then ``n`` itself (``[32, 64, 128, 256]`` for 256; ``[1, 3, 6]`` for 6)."""
    return sorted({k for k in sample_bounds(n)[1:4] if k > 0} | {int(n)})


def check_row_indices(d: int, r: int, seed: int) -> np.ndarray:
    """The output dimensions (rows of ``J``) the checks compare, int64 sorted: all ``d`` when ``d <= r``, else ``r`` of
    them drawn without replacement by ``numpy.random.default_rng(seed)`` (the estimate passes its seed + 2; its
    positions take the seed, the decode agreement's seed + 1)."""
    d, r = int(d), int(r)
    if r < 1:
        raise ValueError(f"the J-lens checks need at least one output dimension, got check_rows={r}")
    if d <= r:
        return np.arange(d, dtype=np.int64)
    return np.sort(np.random.default_rng(int(seed)).choice(d, size=r, replace=False)).astype(np.int64)


def sample_checks(by_group, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``(split_half [P, L+1], convergence [P, L+1, K])`` float64 from ``by_group [4, P, L+1, r, d]`` (a torch
    tensor: the sums of each block's Jacobians on the kept rows) of ``n`` samples; ``K = len(check_sizes(n))``."""
    import torch

    by = torch.as_tensor(by_group, dtype=torch.float64)
    if by.shape[0] != N_GROUPS:
        raise ValueError(f"the J-lens checks need the sums of {N_GROUPS} blocks, got {by.shape[0]}")
    n, bounds = int(n), sample_bounds(n)

    def frob(x):
        return torch.linalg.vector_norm(x, dim=(-2, -1))

    full = by.sum(0) / n
    norm = frob(full)
    sizes = check_sizes(n)
    conv = torch.full((*norm.shape, len(sizes)), float("nan"), dtype=torch.float64, device=by.device)
    prefix = torch.zeros_like(full)
    for g in range(N_GROUPS):  # prefix: the sum over the samples [0, bounds[g + 1])
        prefix = prefix + by[g]
        k = bounds[g + 1]
        if k in sizes:  # (the positive boundaries are distinct)
            conv[..., sizes.index(k)] = 0.0 if k == n else frob(prefix / k - full) / norm
        if g == 2:
            first_half = prefix
    conv[torch.isnan(norm)] = float("nan")  # (attn, L)
    half = n // 2
    split = torch.full_like(norm, float("nan"))
    if half >= 1:
        split = frob(first_half / half - by[3] / (n - half)) / norm
    return split.cpu().numpy(), conv.cpu().numpy()


def _estimated(ds) -> list[tuple[str, int]]:
    """The (point, layer) pairs where the store holds a ``J``: every layer of ``block``, ``attn`` below ``L``."""
    L = int(ds.sizes["layer"]) - 1
    return [(str(p), int(l)) for p in ds["point"].values for l in range(L + 1) if not (p == "attn" and l == L)]


def checks_table(ds, agreement: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per (point, layer) where ``J`` is estimated (``block`` 0..L, ``attn`` 0..L-1) of the J-lens store
    ``ds`` (from :func:`~mfpipe.jlens.lens.estimate_jlens` with ``check_rows``): ``point``, ``layer``,
    ``n_positions``, ``check_rows`` (output dimensions compared), ``split_half_rel_diff``, ``rel_diff_n<k>`` for each
    ``k`` of ``n_check``; with ``agreement`` (:func:`mfpipe.jlens.agreement.decode_agreement`), its
    ``top1_agreement``, ``top10_overlap``, ``n_decode`` and ``n_vectors`` joined on (point, layer)."""
    if "check_split_half" not in ds:
        raise ValueError("the J-lens store holds no checks: estimate it with check_rows")
    rows = []
    for point, layer in _estimated(ds):
        at = {"point": point, "layer": layer}
        row = {**at, "n_positions": int(ds["n_positions"]), "check_rows": len(ds.attrs["check_rows"]),
               "split_half_rel_diff": float(ds["check_split_half"].sel(**at))}
        conv = ds["check_convergence"].sel(**at)
        row.update({f"rel_diff_n{int(k)}": float(conv.sel(n_check=k)) for k in ds["n_check"].values})
        rows.append(row)
    df = pd.DataFrame(rows)
    if agreement is not None:
        df = df.merge(agreement, on=["point", "layer"], how="left", validate="one_to_one")
    return df


def checks_markdown(df: pd.DataFrame, title: str) -> str:
    """``df`` (:func:`checks_table`) as Markdown: ``title``, a paragraph on what each column is, the table."""
    from mfpipe.workflow.tables import to_markdown

    sizes = [c.removeprefix("rel_diff_n") for c in df.columns if c.startswith("rel_diff_n")]
    n = int(df["n_positions"].iloc[0]) if len(df) else 0
    text = (
        f"# {title}\n\n"
        "How reliable the J-lens estimate J = E[d h^L_t / d x_t] is, per insertion point (`block`: the residual "
        "entering block `layer`, and at layer L the final residual, where J = I; `attn`: block `layer`'s attention "
        f"output) and layer. `n_positions`: the sampled positions J averages over ({n}). `check_rows`: the output "
        "dimensions (rows of J) the two sample checks compare (all of them, or a seeded random subset). "
        "`split_half_rel_diff`: ||J_A - J_B||_F / ||J||_F, J_A and J_B the estimates over the first and the second "
        "half of the positions (two disjoint samples, in the sampled random order). "
        f"`rel_diff_n<k>` (k = {', '.join(sizes)}): ||J_k - J_n||_F / ||J_n||_F, J_k the estimate over the first k "
        "positions (a nested prefix), 0 at k = n. "
        "`top1_agreement`: the share of vectors whose raw logit-lens and J-lens decodes have the same top token; "
        "`top10_overlap`: the mean share of the two decodes' top 10 tokens they have in common; over `n_vectors` "
        "vectors from `n_decode` positions sampled apart from J's (seed + 1): at `attn`, every head's write O_h z "
        "there (n_decode x heads vectors), at `block` the residual itself (n_decode vectors). At (block, L) J = I "
        "and the two decodes agree exactly.\n\n"
    )
    return text + to_markdown(df, floatfmt="{:.4g}")


def summary_lines(df: pd.DataFrame) -> list[str]:
    """One log line per row of ``df`` (:func:`checks_table`): the split-half difference, the difference of the
    estimate over the first half of the positions from the whole (where there is one) and the decode agreement."""
    half = [c for c in df.columns if c.startswith("rel_diff_n")][-2:-1]
    lines = []
    for r in df.to_dict("records"):
        prefix = f", {half[0]} {r[half[0]]:.3g}" if half else ""
        agree = (f"; decode agreement top-1 {r['top1_agreement']:.3f}, top-10 overlap {r['top10_overlap']:.3f}"
                 if "top1_agreement" in r else "")
        lines.append(f"{r['point']:<5s} layer {r['layer']:2d}: split-half rel. diff {r['split_half_rel_diff']:.3g}"
                     f"{prefix}{agree}")
    return lines
