"""Behavioural head scores measured without the mean field (paper App. P, ``tab:bottom``; Sec. 6.1 Exp. 3).

Every score is an attention share on the repeated random sequences of :mod:`mfpipe.models.induction`
(``[BOS, c, c]``, ``c`` of length ``k``): a head's attention weight on one target position, averaged
over the ``k`` query positions ``i`` of the second copy and over sequences.

* ``induction``       -- target ``i - k + 1``, the position right after the query type's earlier
  occurrence (Olsson et al. 2022; identical to :func:`mfpipe.models.induction.induction_scores`)
* ``duplicate_token`` -- target ``i - k``, the query type's earlier occurrence
* ``previous_token``  -- target ``i - 1``, the immediately preceding position
* ``bos_sink``        -- target ``0``, the BOS token (the first token when sequences have no BOS)

All four come from one forward per batch (:func:`mfpipe.models.induction.attention_on_targets`), so they are
measured on the same sequences as the induction score with the same seed.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np

from mfpipe.models.induction import as_adapter, attention_on_targets, induction_targets, probe_sequences

__all__ = ["SCORES", "score_targets", "head_scores", "scores_table", "write_head_scores", "open_head_scores",
           "head_label"]

SCORES: tuple[str, ...] = ("induction", "previous_token", "duplicate_token", "bos_sink")


def score_targets(k: int, offset: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Second-copy query positions ``[k]`` and the target of each score ``[len(SCORES), k]``, rows in
    :data:`SCORES` order. ``offset``: tokens before the first copy (1 with BOS, 0 without)."""
    q, induction = induction_targets(k, offset)  # the induction convention is induction.py's, not repeated here
    by_name = {"induction": induction, "previous_token": q - 1, "duplicate_token": q - k,
               "bos_sink": np.zeros_like(q)}
    return q, np.stack([by_name[n] for n in SCORES])


def head_scores(model_or_adapter, vocab_size: int, special_ids: Iterable[int] | None, context_length: int,
                n_sequences: int = 64, seed: int = 0, *, bos_id: int | None | str = "auto", batch_size: int = 16):
    """The four scores of every head as an ``xarray.Dataset``: variables :data:`SCORES`, float64
    ``(layer, head)``; attrs ``n_sequences``, ``seed``, ``k`` (copy length), ``context_length``, ``bos``
    (whether the sequences start with a BOS).

    Arguments as :func:`mfpipe.models.induction.induction_metrics` (an HF causal LM with eager attention or its
    adapter; ``vocab_size`` ids to draw from, ``special_ids`` excluded; ``bos_id="auto"``: the model
    config's). The same ``seed`` gives the same sequences, so checkpoints are comparable."""
    import xarray as xr

    adapter = as_adapter(model_or_adapter)
    tokens, k, offset = probe_sequences(adapter, vocab_size, special_ids, context_length, n_sequences, seed, bos_id)
    q, targets = score_targets(k, offset)
    shares = attention_on_targets(adapter, tokens, q, targets, batch_size)  # [score, layer, head]
    coords = {"layer": np.arange(adapter.n_layers), "head": np.arange(adapter.n_heads)}
    data = {name: (("layer", "head"), shares[i].astype(np.float64)) for i, name in enumerate(SCORES)}
    attrs = {"n_sequences": int(tokens.shape[0]), "seed": int(seed), "k": int(k),
             "context_length": int(context_length), "bos": int(offset)}
    return xr.Dataset(data, coords=coords, attrs=attrs)


def head_label(layer: int, head: int) -> str:
    """The paper's head name, ``L<layer>H<head>`` (0-based, as in ``tab:bottom``)."""
    return f"L{int(layer)}H{int(head)}"


def scores_table(ds, model: str | None = None, revision: str | None = None):
    """One row per head (layer-major): ``[model, revision,] layer, head, head_label`` and the scores.
    ``model``/``revision`` columns are added only when given."""
    import pandas as pd

    layer, head = np.meshgrid(ds["layer"].values, ds["head"].values, indexing="ij")
    cols: dict = {}
    if model is not None:
        cols["model"] = str(model)
    if revision is not None:
        cols["revision"] = str(revision)
    cols["layer"] = layer.ravel().astype(int)
    cols["head"] = head.ravel().astype(int)
    cols["head_label"] = [head_label(a, b) for a, b in zip(cols["layer"], cols["head"])]
    for name in SCORES:
        cols[name] = ds[name].transpose("layer", "head").values.ravel()
    return pd.DataFrame(cols)


def write_head_scores(ds, path: str | Path, model: str, revision: str) -> None:
    """``head_scores.csv``: :func:`scores_table` with the model and revision, written atomically."""
    from mfpipe.workflow.tables import write_csv

    write_csv(scores_table(ds, model, revision), path)


def open_head_scores(path: str | Path):
    """A ``head_scores.csv`` back as the ``(layer, head)`` Dataset (attrs ``model``, ``revision`` when
    the file holds exactly one of each). Every (layer, head) must appear exactly once."""
    import pandas as pd
    import xarray as xr

    df = pd.read_csv(path)
    missing = [c for c in ("layer", "head", *SCORES) if c not in df.columns]
    if missing:
        raise ValueError(f"{path}: not a head_scores table (missing columns {missing})")
    if df.duplicated(["layer", "head"]).any():
        raise ValueError(f"{path}: a (layer, head) appears more than once")
    ds = xr.Dataset.from_dataframe(df.set_index(["layer", "head"])[list(SCORES)].astype(np.float64))
    if ds.sizes["layer"] * ds.sizes["head"] != len(df):
        raise ValueError(f"{path}: incomplete (layer, head) grid")
    for key in ("model", "revision"):
        if key in df.columns and df[key].nunique() == 1:
            ds.attrs[key] = str(df[key].iloc[0])
    return ds
