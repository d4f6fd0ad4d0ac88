"""Where a rollout's kernel matters (App. I, ``tab:qwen-layers``, ``tab:rogue-dims``, ``tab:qwen-pinned``).

* Layer-localized kernel substitution: a substitute kernel (default ``cooc``) on a chosen set of layers and the
  measured kernel ``P`` everywhere else (:func:`mfpipe.experiments.rollout.kernels.substitute_layers`), rolled out by
  Alg. 1 and scored like Table 1; rows none / all / layer 0 only / all but layer 0 and any user sets, with the
  cross-layer mean centred cosine (standard error over layers), the damage (the shortfall against ``none``) and the
  damage's share of the all-layers damage. The paper's Qwen-3-14B: layer 0 alone carries 85 % of it.
* Rogue dimensions: the dimensions App. I pins (per-dimension RMS over the statistics half's type centroids above
  ``factor`` x that depth's median at some depth), each with its RMS ratio to the median at every depth, the model
  width D and how many are pinned -- and, when none qualifies, the widest dimensions anyway, marked unpinned, so a
  reader sees how far below the threshold the model sits; beside it every kernel's rollout unpinned and pinned
  (cross-layer mean centred cosine with its SE, mean centred relative error), as ``tab:qwen-pinned``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from mfpipe.experiments.rollout import algorithm as R
from mfpipe.experiments.rollout import kernels as K
from mfpipe.experiments.rollout import metrics as M
from mfpipe.experiments.rollout.runs import build_kernel, run_rollouts

__all__ = ["layer_sets", "localized_rollouts", "localized_table", "rogue_table", "pinning_table"]


def layer_sets(n_layers: int, user_sets: Sequence[Sequence[int]] = ()) -> list[tuple[str, list[int]]]:
    """The rows of ``tab:qwen-layers``: ``(label, layers)`` for none, all, layer 0 only, all but layer 0, then each user
    set (layer indices, ``-1`` = the last; refused out of range)."""
    L = int(n_layers)
    rows = [("none (measured kernel)", []), (f"all {L} layers", list(range(L))), ("layer 0 only", [0]),
            ("all layers except 0", list(range(1, L)))]
    for s in user_sets:
        idx = sorted({int(i) % L if -L <= int(i) < L else _bad_layer(i, L) for i in s})
        rows.append(("layers " + ",".join(map(str, idx)), idx))
    return rows


def _bad_layer(i, L: int) -> int:
    raise ValueError(f"rollout.localized.layers: layer {i} is not a layer of this model (0..{L - 1})")


@R.on_types
def localized_rollouts(adapter, setup, substitute: np.ndarray, sets, pin: tuple | None = None) -> dict:
    """``label -> [L+1, N, d]``: Alg. 1 with ``substitute`` on each set's layers and ``setup.P`` elsewhere."""
    kw = {} if pin is None else {"pin_dims": pin[0], "pin_values": pin[1]}
    return {label: R.rollout(adapter, K.substitute_layers(setup.P, substitute, layers), setup.bos, init=setup.init,
                             **kw) for label, layers in sets}


def localized_table(adapter, setup, substitute: str = "cooc", user_sets: Sequence[Sequence[int]] = (),
                    pin: tuple | None = None, seed: int = 0, model=None) -> pd.DataFrame:
    """``tab:qwen-layers`` for one rollout: per layer set, the cross-layer mean centred cosine (SE over depths
    ``1..L``), the mean centred relative error, the damage against the measured kernel and its share of the
    all-layers damage."""
    L = adapter.n_layers
    sets = layer_sets(L, user_sets)
    S = build_kernel(substitute, setup, model=model, seed=seed)
    preds = localized_rollouts(adapter, setup, S, sets, pin)
    rows = []
    for label, layers in sets:
        sc = M.score_layers(preds[label][1:][:, setup.types], setup.truth[1:][:, setup.types])
        cos, se = M.cross_layer_summary(sc["cosine"])
        rows.append({"layers": label, "substituted": ",".join(map(str, layers)) or "-", "n_substituted": len(layers),
                     "cosine": cos, "cosine_se": se, "rel_error": float(np.mean(sc["rel_error"]))})
    df = pd.DataFrame(rows)
    df["damage"] = df["cosine"].iloc[0] - df["cosine"]
    total = df["damage"].iloc[1]
    df["damage_share"] = df["damage"] / total if abs(total) > 0 else np.nan
    df.insert(0, "substitute", substitute)
    df["pinned"] = pin is not None
    return df


def rogue_table(centroids, factor: float = 15.0, n_widest: int = 5) -> pd.DataFrame:
    """Per dimension pinned at ``factor`` (or, if none is, the ``n_widest`` dimensions by their largest ratio): its RMS
    over the type centroids over that depth's median, at every depth (``centroids [L+1, N, d]``: the statistics half's,
    of the types it has), with ``pinned`` and the model width ``D``."""
    c = np.asarray(centroids, dtype=np.float64)
    rms = np.sqrt((c**2).mean(axis=1))  # [L+1, d]
    ratio = rms / np.median(rms, axis=1, keepdims=True)
    pinned = R.rogue_dimensions(c, factor=factor)
    dims = pinned if pinned.size else np.argsort(-ratio.max(axis=0), kind="stable")[:n_widest]
    rows = []
    for dim in dims:
        row = {"dim": int(dim), "pinned": bool(pinned.size), "max_ratio": float(ratio[:, dim].max()),
               "depth_of_max": int(ratio[:, dim].argmax())}
        row.update({f"ratio_depth{j}": float(ratio[j, dim]) for j in range(ratio.shape[0])})
        rows.append(row)
    df = pd.DataFrame(rows)
    df.insert(0, "D", c.shape[2])
    df.insert(1, "n_pinned", int(pinned.size))
    df.insert(2, "factor", float(factor))
    return df


def pinning_table(model, adapter, setup, kernels: Sequence[str], factor: float, seed: int = 0) -> pd.DataFrame:
    """``tab:qwen-pinned``: every kernel's rollout unpinned and pinned at ``factor``, cross-layer mean centred
    cosine (SE over layers) and mean centred relative error side by side (pinned columns NaN when no dimension
    qualifies: pinning would change nothing)."""
    df = run_rollouts(model, adapter, None, None, kernels=[k for k in kernels if k != "context_free"], seed=seed,
                      pin=True, rogue_factor=factor, setup=setup)
    rows = []
    for kernel, g in df.groupby("kernel", sort=False):
        row = {"kernel": kernel}
        for pinned, name in ((False, "unpinned"), (True, "pinned")):
            gp = g[g["pinned"] == pinned]
            cos = gp[gp["metric"] == "cosine"]["value"].to_numpy()
            rel = gp[gp["metric"] == "rel_error"]["value"].to_numpy()
            mean, se = M.cross_layer_summary(cos) if cos.size else (np.nan, np.nan)
            row.update({f"cosine_{name}": mean, f"cosine_se_{name}": se,
                        f"rel_error_{name}": float(rel.mean()) if rel.size else np.nan})
        row["n_pinned"] = int(g["n_pinned"].max())
        rows.append(row)
    return pd.DataFrame(rows)
