"""Rollout experiments (paper Sec. 4, App. E, G): Alg. 1 with every kernel of Table 1 scored per depth against
the held-out centroids, and the cross-corpus matrix. Held-out protocol: see :mod:`mfpipe.experiments.rollout`."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from mfpipe.experiments.rollout import algorithm as R
from mfpipe.experiments.rollout import kernels as K
from mfpipe.experiments.rollout import metrics as M
from mfpipe.experiments.rollout.layered import LayerKernel
from mfpipe.experiments.rollout.tables import DEFAULT_KERNELS
from mfpipe.stats.api import MeanFieldStats, ProvenanceError
from mfpipe.stats.halves import check_model, eval_types, open_pair
from mfpipe.stats.partials import rounding_bound

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_KERNELS", "ROLLOUT_NAMES", "RolloutSetup", "prepare", "retarget", "build_kernel",
           "context_free_prediction", "score_rows", "pinning", "run_rollouts", "cross_corpus"]

#: every name :func:`run_rollouts` accepts: the Table 1 rows plus the optional ``context_free_kernel`` ablation
#: (the ``[BOS, t]`` attention rolled out from the mean-field start, :mod:`mfpipe.experiments.rollout.kernels`). It is not a default
#: row: on rotary models it reproduces ``context_free`` (the start is the same embedding) and on GPT-2 it differs
#: from it only by the start's position offset, so it would add a near-duplicate row the paper does not have.
ROLLOUT_NAMES: tuple[str, ...] = (*DEFAULT_KERNELS, *(k for k in K.KERNEL_NAMES if k not in DEFAULT_KERNELS))


def _fill_rows(x: np.ndarray, ok: np.ndarray, axis: int) -> np.ndarray:
    """Rows (along ``axis``) not in ``ok`` replaced by the (NaN-skipping) mean of the ``ok`` rows; NaN elsewhere is
    kept."""
    x = np.array(x, dtype=np.float64)
    if ok.all():
        return x
    if not ok.any():
        raise ValueError("no tracked type occurs in the statistics half")
    xm = np.moveaxis(x, axis, 0)
    xm[~ok] = np.nanmean(xm[ok], axis=0)
    return np.moveaxis(xm, 0, axis)


@dataclass
class RolloutSetup:
    """Everything a rollout over one statistics half needs (and the truth of one evaluation half)."""

    st: MeanFieldStats
    ev: MeanFieldStats
    P: LayerKernel  # [L, H, N, N+2] float64 per layer, rows of types absent from the statistics half filled
    bos: np.ndarray  # [L+1, d] weight-derived b^l
    init: np.ndarray  # [N, d] start of Alg. 1
    types: np.ndarray  # scored type indices
    truth: np.ndarray  # [L+1, N, d] evaluation-half centroids
    stats_centroids: np.ndarray  # [L+1, N, d] statistics-half centroids (absent types filled)
    type_ids: np.ndarray
    bos_id: int
    context_length: int
    meta: dict = field(default_factory=dict)


def prepare(adapter, st: MeanFieldStats, ev: MeanFieldStats, *, init: str = "embed", min_count: int = 1,
            bos: np.ndarray | None = None) -> RolloutSetup:
    """Load the kernel, start and truth of a rollout (``init``: ``"embed"`` = input embeddings, Alg. 1,
    plus GPT-2's mean positional offset over the positions the statistics half's tracked queries occupy;
    ``"stats"`` = the statistics half's layer-0 centroids, as App. G initialises the cross-corpus runs)."""
    check_model(adapter, st)
    check_model(adapter, ev)
    if "bos_id" not in st.attrs:
        raise ProvenanceError(f"statistics store {st.path} records no bos_id; rerun the stats stage")
    bos_id = int(st.attrs["bos_id"])
    T = int(st.attrs["context_length"])
    type_ids = np.asarray(st.ds["query_token_id"].values, dtype=np.int64)
    has_q = st.query_count().values > 0
    # the kernel read from the store one layer at a time, as Alg. 1 uses it (a whole float64 P is 12.8 GB at
    # Qwen3-14B's shape: mfpipe.experiments.rollout.layered)
    P = LayerKernel(st.ds["P"].shape, lambda l: _fill_rows(st.P(layer=l).values, has_q, axis=1))
    c_st = _fill_rows(st.centroids().values, has_q, axis=1)
    if bos is None:
        bos = R.bos_residuals(adapter, bos_id)
    if init == "embed":
        x0 = R.initial_centroids(adapter, type_ids, context_length=T,
                                 position_count=st.ds["position_count"].values)
    elif init == "stats":
        x0 = c_st[0].astype(np.float32)
    else:
        raise ValueError(f"init must be 'embed' or 'stats', got {init!r}")
    types = eval_types(st, ev, min_count)
    if types.size < 3:
        raise ValueError(f"only {types.size} tracked types occur >= {min_count} times in both halves; "
                         "RSA and the centred metrics need at least 3")
    meta = {"model": st.attrs.get("model"), "revision": st.attrs.get("revision"),
            "stats_corpus": st.attrs.get("corpus"), "eval_corpus": ev.attrs.get("corpus"),
            "partial_mantissa_bits": st.attrs.get("partial_mantissa_bits"), "dtype": st.attrs.get("dtype"),
            "sink_layers": tuple(adapter.sink_layers())}  # rows of P below 1: a sink's share (adapters.sinks)
    return RolloutSetup(st=st, ev=ev, P=P, bos=np.asarray(bos), init=np.asarray(x0), types=types,
                        truth=ev.centroids().values.astype(np.float64), stats_centroids=c_st, type_ids=type_ids,
                        bos_id=bos_id, context_length=T, meta=meta)


def retarget(setup: RolloutSetup, ev: MeanFieldStats, min_count: int = 1) -> RolloutSetup:
    """The same rollout (statistics half, kernel, start) scored against another evaluation half."""
    import dataclasses

    types = eval_types(setup.st, ev, min_count)
    if types.size < 3:
        raise ValueError(f"only {types.size} tracked types occur >= {min_count} times in {setup.st.path} and "
                         f"{ev.path}; the centred metrics need at least 3")
    return dataclasses.replace(setup, ev=ev, types=types, truth=ev.centroids().values.astype(np.float64),
                               meta={**setup.meta, "eval_corpus": ev.attrs.get("corpus")})


def build_kernel(name: str, setup: RolloutSetup, model=None, seed: int = 0) -> np.ndarray:
    """Kernel ``name`` (:data:`mfpipe.experiments.rollout.kernels.KERNEL_NAMES`) from the statistics half of ``setup``."""
    if name == "context_free":
        raise ValueError("context_free is not a kernel but the [BOS, t] forward itself: use "
                         "context_free_prediction (or the context_free_kernel ablation)")
    if name == "context_free_kernel":
        if model is None:
            raise ValueError("the context_free_kernel ablation needs the model")
        return K.context_free_kernel(model, setup.type_ids, setup.bos_id)
    cooc = setup.st.cooc().values if name == "cooc" else None
    layers = setup.st.attention_layers if name in ("P0only", "Pavg") else None  # the layers with heads
    return K.build_kernel(name, setup.P, cooc_counts=cooc, seed=seed, layers=layers)


def context_free_prediction(adapter, setup: RolloutSetup) -> np.ndarray:
    """The paper's context-free baseline for the tracked types of ``setup``: ``[L+1, N, d]`` residuals at
    position 1 of ``[BOS, t]`` (:func:`mfpipe.experiments.rollout.algorithm.context_free_residuals`), in the centroids' convention.
    Corpus-independent: it depends on the model and the tracked set only."""
    return R.context_free_residuals(adapter, setup.type_ids, setup.bos_id)


def score_rows(pred: np.ndarray, truth: np.ndarray, types: np.ndarray, depths: Sequence[int], n_layers: int,
                per_block: bool = False, **labels) -> list[dict]:
    sc = M.score_layers(pred[:, types], truth[:, types])
    rows = []
    for i, dep in enumerate(depths):
        frac = (dep + 1) / n_layers if per_block else dep / n_layers
        key = "layer" if per_block else "depth"
        for m in M.METRICS:
            rows.append({**labels, key: int(dep), "frac_depth": float(frac), "metric": m,
                         "value": float(sc[m][i]), "n_types": int(types.size)})
    return rows


@R.on_types
def _rollout_one(adapter, setup: RolloutSetup, kernel: np.ndarray, pin: tuple | None = None) -> np.ndarray:
    kw = {}
    if pin is not None:
        kw = {"pin_dims": pin[0], "pin_values": pin[1]}
    return R.rollout(adapter, kernel, setup.bos, init=setup.init, **kw)


def pinning(setup: RolloutSetup, factor: float) -> tuple[np.ndarray, np.ndarray]:
    """App. I's ``(dims, values)`` for ``setup``: the rogue dimensions of the statistics half's centroids (types it
    has) at ``factor`` and their all-type centroid per depth."""
    ok = setup.st.query_count().values > 0
    c = setup.stats_centroids[:, ok]
    return R.rogue_dimensions(c, factor=factor), R.pin_values(c, "mean")


def run_rollouts(model, adapter, stats_store, eval_store, kernels: Sequence[str] = DEFAULT_KERNELS, seed: int = 0,
                 pin: bool = False, rogue_factor: float = 15.0, init: str = "embed", min_count: int = 1,
                 model_name: str | None = None, revision: str | None = None, setup: RolloutSetup | None = None,
                 ) -> pd.DataFrame:
    """Alg. 1 with every kernel in ``kernels``, scored per depth ``1..L`` against the evaluation half.

    ``context_free`` is scored the same way but is no rollout: its prediction is the ``[BOS, t]`` forward
    (:func:`context_free_prediction`). Returns a long table: ``kernel, pinned, n_pinned, depth, frac_depth,
    metric, value, n_types`` (+ ``model``, ``revision``). With ``pin`` every kernel is also run with the rogue
    dimensions (App. I: per-dim RMS over the statistics-half centroids above ``rogue_factor`` x the layer median
    at some depth) held at the statistics half's all-type centroid (``pinned=True`` rows, ``n_pinned`` dims;
    none when no dimension qualifies, which is logged). ``context_free`` gets no pinned row: pinning acts
    inside a rollout, and the baseline is the model's own forward."""
    unknown = [k for k in kernels if k not in ROLLOUT_NAMES]
    if unknown:
        raise ValueError(f"unknown kernel(s) {unknown}; known: {ROLLOUT_NAMES}")
    if setup is None:
        st, ev = open_pair(stats_store, eval_store, model=model_name, revision=revision)
        setup = prepare(adapter, st, ev, init=init, min_count=min_count)
    L = adapter.n_layers
    pins = [None]
    if pin:
        dims, vals = pinning(setup, rogue_factor)
        log.info("rogue dimensions (factor %g): %d of %d: %s", rogue_factor, dims.size, adapter.d_model,
                 dims.tolist())
        if dims.size:
            pins.append((dims, vals))
        else:
            log.warning("no rogue dimension at factor %g: the pinned rollouts would equal the plain ones; skipped",
                        rogue_factor)
    rows: list[dict] = []
    labels = dict(model=setup.meta["model"], revision=setup.meta["revision"])
    for name in kernels:
        if name == "context_free":
            pred = context_free_prediction(adapter, setup)
            rows += score_rows(pred[1:], setup.truth[1:], setup.types, range(1, L + 1), L, **labels, kernel=name,
                                pinned=False, n_pinned=0)
            continue
        Kr = build_kernel(name, setup, model=model, seed=seed)
        # rows of P sum to 1 within the rounding of the model's probabilities (bfloat16: ~4e-4) and of the partials
        # (stats.partial_mantissa_bits)
        K.check_row_stochastic(Kr, atol=1e-4 + rounding_bound(setup.meta.get("partial_mantissa_bits"))
                               + K.probability_rounding(setup.meta.get("dtype")),
                               below=K.below_one(name, setup.meta.get("sink_layers", ()), L,
                                                 adapter.attention_layers[0]),
                               skip=[l for l in range(L) if l not in adapter.attention_layers])
        for p in pins:
            pred = _rollout_one(adapter, setup, Kr, p)
            rows += score_rows(pred[1:], setup.truth[1:], setup.types, range(1, L + 1), L, **labels, kernel=name,
                                pinned=p is not None, n_pinned=0 if p is None else int(p[0].size))
        del Kr
    return pd.DataFrame(rows)


def cross_corpus(model, adapter, corpora: Mapping[str, tuple], primary: str, *, init: str = "embed",
                 min_count: int = 1, context_free: bool = True, model_name: str | None = None,
                 revision: str | None = None) -> pd.DataFrame:
    """App. G matrix: for every statistics corpus X and evaluation corpus Y (``corpora``: name ->
    ``(stats_store, eval_store)``), the mean-field rollout with X's statistics scored per depth against Y's
    evaluation centroids, over the types occurring ``>= min_count`` times in X's statistics half and Y's
    evaluation half. Every store must share the primary corpus's model, revision, tracked set and context
    length. With ``context_free`` the context-free baseline (the ``[BOS, t]`` forward: no corpus statistic, so
    one set of residuals serves every column) is scored against every Y too (``stats_corpus =
    "context-free"``). Long table ``stats_corpus, eval_corpus, depth, frac_depth, metric, value, n_types``; the
    cell (primary, primary) is exactly the plain rollout's ``mean_field`` score and the context-free cell of
    the primary column the plain rollout's ``context_free`` score. ``model`` (the HF model) is not needed any
    more -- the adapter runs every forward -- and is kept for the jobs' call signature."""
    if primary not in corpora:
        raise ValueError(f"primary corpus {primary!r} not among {list(corpora)}")
    L = adapter.n_layers
    ref, _ = open_pair(*corpora[primary], model=model_name, revision=revision)
    opened = {}
    for name, (s, e) in corpora.items():
        opened[name] = open_pair(s, e, reference=ref)
    bos = R.bos_residuals(adapter, int(ref.attrs["bos_id"]))
    rows: list[dict] = []
    setups = {}
    for x, (stx, evx) in opened.items():
        sx = setups[x] = prepare(adapter, stx, evx, init=init, min_count=min_count, bos=bos)
        pred = _rollout_one(adapter, sx, K.mean_field(sx.P))
        for y, (_, evy) in opened.items():
            sy = retarget(sx, evy, min_count)
            rows += score_rows(pred[1:], sy.truth[1:], sy.types, range(1, L + 1), L, model=sy.meta["model"],
                                revision=sy.meta["revision"], stats_corpus=x, eval_corpus=y)
    if context_free:
        base = setups[primary]
        pred = context_free_prediction(adapter, base)
        for y, (_, evy) in opened.items():
            sy = retarget(base, evy, min_count)
            rows += score_rows(pred[1:], sy.truth[1:], sy.types, range(1, L + 1), L, model=sy.meta["model"],
                                revision=sy.meta["revision"], stats_corpus="context-free", eval_corpus=y)
    return pd.DataFrame(rows)
