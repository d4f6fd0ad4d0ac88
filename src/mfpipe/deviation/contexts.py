"""Pass 2's per-context meters kept per position instead of summed (``mfpipe.context_deviation(model, stats, tokens)``): for
every window, query position, layer and head, D = 1 − cos(z, ẑ), M_cov and M_ctx (eq:deviation, eq:mcov-mctx), and on
request the reads z and the mean field ẑ. The terms are pass 2's own (:func:`mfpipe.deviation.queries.query_terms` on
the batch's :func:`mfpipe.meanfield.plan.query_plan`, :func:`mfpipe.meanfield.deviation.meters_head_major` through each
head's output-projection gram), so the occurrence means of these arrays are the deviation store's ``D``, ``M_cov``,
``M_ctx`` (and its ``zbar``, ``zhat_bar`` per query type) on the same windows. Where the attention gates its reads
(:mod:`mfpipe.models.adapters.gate`), ``gate`` holds the model's own gate of each query beside z and ẑ, which enter
the output projection times it."""

from __future__ import annotations

import numpy as np
import torch

from mfpipe.deviation.queries import query_terms
from mfpipe.meanfield.deviation import gate_head_major, layer_grams, meters_head_major, stack_head_major
from mfpipe.meanfield.plan import query_plan
from mfpipe.models.adapters.gate import has_gate

__all__ = ["context_meters", "METERS"]

METERS = ("D", "M_cov", "M_ctx")


def context_meters(adapter, kernel, tokens: np.ndarray, *, batch_size: int = 8, reads: bool = False,
                   progress: bool = False) -> dict[str, np.ndarray]:
    """Per window, position, layer and head of ``tokens [n, T]`` (BOS-led), with ``kernel``
    (:class:`~mfpipe.meanfield.kernel.MeanFieldKernel` of a statistics half): ``D``, ``M_cov``, ``M_ctx`` ``[n, T, L, H]``
    float64, NaN where the position is no valid query in that layer (an untracked type, or a W row without support);
    ``valid [n, T, L]``; with ``reads`` also ``z`` and ``zhat`` ``[n, T, L, H, dh]`` (float32, head space; NaN where not
    valid), and on a model whose attention gates its reads ``gate`` ``[n, T, L, H, dh]``, the model's own gate of each
    query (its write is ``z * gate`` through O_h). One traced forward per batch of ``batch_size`` windows reading
    attention, values and reads."""
    from tqdm.auto import tqdm

    tokens = np.asarray(tokens)
    n, T = tokens.shape
    L, H, dh = adapter.n_layers, adapter.n_heads, adapter.d_head
    dev = adapter.device
    k = kernel.to(dev)
    grams = layer_grams(adapter).to(dev)
    out = {m: np.full((n, T, L, H), np.nan) for m in METERS}
    out["valid"] = np.zeros((n, T, L), dtype=bool)
    gated = has_gate(adapter)  # the meters of the gated reads (meanfield.deviation.gate_head_major), as pass 2's
    for key in (("z", "zhat") if reads else ()) + (("gate",) if reads and gated else ()):
        out[key] = np.full((n, T, L, H, dh), np.nan, dtype=np.float32)
    for b0 in tqdm(range(0, n, int(batch_size)), desc="deviation", disable=not progress, mininterval=2.0):
        chunk = tokens[b0 : b0 + int(batch_size)]
        kb, qt = k.buckets(chunk)
        plan = query_plan(kb.numpy(), qt.numpy(), k.n + 2, dev)
        rows_w, rows_j = plan.b.cpu().numpy() + b0, plan.j.cpu().numpy()  # the plan's rows: once per batch

        def on_layer(cap, plan=plan, rows_w=rows_w, rows_j=rows_j):
            l = cap.layer
            if cap.attn_probs is None:  # a hybrid's layer of another mixer: no meters (NaN), never valid
                return
            t = query_terms(plan, cap.attn_probs.float(), cap.values.float(), k.W[l].to(dev, torch.float32),
                            k.mu[l], reads=cap.reads)
            g = adapter.read_gate(l, cap.resid_in[plan.b, plan.j], None if cap.reads is None else  # [rows, H, dh]: each
                                  cap.reads[plan.b, plan.j]) if gated else None  # query's
            m = meters_head_major(gate_head_major(stack_head_major(t), g), grams[l])  # [H, rows]
            v = t.valid.cpu().numpy()
            w, j = rows_w[v], rows_j[v]
            out["valid"][w, j, l] = True
            for key in METERS:
                out[key][w, j, l] = m[key].T.cpu().numpy()[v]
            if reads:
                out["z"][w, j, l] = t.z.float().cpu().numpy()[v]
                out["zhat"][w, j, l] = t.zhat.float().cpu().numpy()[v]
            if "gate" in out:  # the query's own gate, from the residual entering the block at each plan row
                out["gate"][w, j, l] = g.float().cpu().numpy()[v]

        want = ("attn_probs", "values", "reads") + (("resid_in",) if gated else ())
        adapter.run(torch.as_tensor(chunk), select=want, on_layer=on_layer)
    return out
