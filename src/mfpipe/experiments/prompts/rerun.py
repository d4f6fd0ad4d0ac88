"""The context lens's re-run of the recorded windows (:func:`mfpipe.experiments.prompts.lenses.context_details`):
one traced forward per batch of distinct windows (:meth:`Adapter.run`) and, per row, pass 2's per-context math
(:func:`~mfpipe.meanfield.ccmf.pair_kernel`, :func:`~mfpipe.meanfield.deviation.occurrence_terms`,
:func:`~mfpipe.meanfield.deviation.meters`) on the rows' heads only, the head's top attended keys and the deviation
vector in residual-stream units with its raw (and J-lens) decode."""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from mfpipe.meanfield.ccmf import pair_kernel
from mfpipe.meanfield.deviation import key_type_ranks, meters, occurrence_terms
from mfpipe.models.adapters.gate import has_gate

__all__ = ["ContextRerun"]


class ContextRerun:
    """The per-row results of re-running the windows ``win`` [R, T] of ``rows`` (layer, head, position, shard,
    window), filled by :meth:`run`: ``out`` (``D_recomputed``, ``M_cov``, ``M_ctx``, ``other_share``, ``valid``),
    the top ``k_keys`` keys (``kpos``, ``kshare``), the head's whole attention row at the query (``att``) and the
    top ``decode_k`` tokens of the raw and J-lens decodes (``dpos``, ``dprob``, ``jpos``, ``jprob``); -1 / NaN where
    a row has none."""

    def __init__(self, adapter, kernel, rows: pd.DataFrame, win: np.ndarray, k_keys: int, decode_k: int):
        R = len(rows)
        keys = list(zip(rows["shard"].astype(int), rows["window"].astype(int)))
        first = {k: n for n, k in reversed(list(enumerate(keys)))}  # each window once, in order of first use
        self.uniq = list(first)
        self.wtok = win[[first[k] for k in self.uniq]]
        self.row_u = np.array([self.uniq.index(k) for k in keys], dtype=np.int64)
        self.adapter, self.kernel, self.k_keys, self.decode_k = adapter, kernel, k_keys, decode_k
        self.dev = adapter.device
        self.grams = kernel.grams(adapter)
        self.out = {k: np.full(R, np.nan) for k in ("D_recomputed", "M_cov", "M_ctx", "other_share")}
        self.out["valid"] = np.zeros(R, bool)
        self.kpos, self.kshare = np.full((R, k_keys), -1, np.int64), np.full((R, k_keys), np.nan)
        self.att = np.full(win.shape[:2], np.nan, np.float32)  # [R, T] the head's attention row at the query
        self.dpos, self.dprob = np.full((R, decode_k), -1, np.int64), np.full((R, decode_k), np.nan)
        self.jpos, self.jprob = np.full((R, decode_k), -1, np.int64), np.full((R, decode_k), np.nan)
        self.lay, self.hd, self.pos = (rows[c].to_numpy(np.int64) for c in ("layer", "head", "position"))

    def run(self, batch_size: int, jlens=None) -> None:
        """Every batch of ``batch_size`` distinct windows: one forward, then the decodes of its rows' vectors. Through
        a J-lens sample (:class:`~mfpipe.jlens.jvp.JLensSample`), the J-lens decodes of every row run after the
        last batch, in one pass over the sample's positions (:meth:`decode_products`)."""
        from mfpipe.jlens.jvp import JLensSample

        dev = self.dev
        sample = jlens if isinstance(jlens, JLensSample) else None
        if sample is not None:
            jlens, self.deltas = None, torch.zeros(len(self.lay), self.adapter.d_model, dtype=torch.float32, device=dev)
        for b0 in range(0, len(self.uniq), int(batch_size)):
            sel = np.flatnonzero((self.row_u >= b0) & (self.row_u < b0 + int(batch_size)))
            ids = self.wtok[b0 : b0 + int(batch_size)]
            kb, qt = (x.to(dev) for x in self.kernel.buckets(ids))
            ranks = key_type_ranks(kb)
            delta = torch.zeros(len(sel), self.adapter.d_model, dtype=torch.float32, device=dev)

            def on_layer(cap, sel=sel, kb=kb, qt=qt, ranks=ranks, delta=delta, b0=b0):
                self.add_layer(cap, sel, kb, qt, ranks, delta, b0)

            # a gated attention's write needs the query's residual (its gate): read it only there
            want = ("attn_probs", "values", "reads") + (("resid_in",) if has_gate(self.adapter) else ())
            self.adapter.run(torch.from_numpy(ids), select=want, on_layer=on_layer)
            if len(sel):
                self.decode(sel, delta, jlens)
                if sample is not None:
                    self.deltas[torch.as_tensor(sel, device=dev)] = delta
        if sample is not None and len(self.lay):
            self.decode_products(sample)

    def decode_products(self, sample, rows: int = 256) -> None:
        """The J-lens decodes of every row's deviation vector at its layer (``attn`` point) through Jacobian-vector
        products on ``sample``'s positions (:func:`mfpipe.jlens.jvp.jvp_products`, one pass for all rows), read out
        as :func:`mfpipe.jlens.jvp.lens_logits` reads them; ``rows`` at a time through the unembedding."""
        from mfpipe.jlens.jvp import jvp_products

        Jv = jvp_products(self.adapter, sample, self.deltas, self.lay, "attn", desc="lenses jvp")
        for r0 in range(0, len(Jv), rows):
            logits = self.adapter.unembed(Jv[r0 : r0 + rows].to(self.adapter.dtype))
            p, i = torch.softmax(logits, dim=-1).topk(self.decode_k, dim=-1)
            self.jprob[r0 : r0 + rows], self.jpos[r0 : r0 + rows] = p.double().cpu().numpy(), i.cpu().numpy()

    def add_layer(self, cap, sel, kb, qt, ranks, delta, b0: int) -> None:
        """Layer ``cap.layer`` of the batch from window ``b0``: the meters, attended keys and deviation vectors (into
        ``delta``, in residual-stream units) of the batch's rows ``sel`` at that layer."""
        dev, kernel, out, hd = self.dev, self.kernel, self.out, self.hd
        l = cap.layer
        mine = np.flatnonzero(self.lay[sel] == l)
        if not len(mine):
            return
        r = sel[mine]
        hs = sorted(set(hd[r].tolist()))
        hi = torch.as_tensor([hs.index(h) for h in hd[r]], device=dev)
        bi, j = torch.as_tensor(self.row_u[r] - b0, device=dev), torch.as_tensor(self.pos[r], device=dev)
        hsel = torch.as_tensor(hs, device=dev)
        probs = cap.attn_probs.float()[:, hsel]
        a, _, valid = pair_kernel(kernel.W[l][hs].to(dev, torch.float32), kb, qt)  # the rows' heads only
        terms = occurrence_terms(probs, cap.values.float()[:, hsel], a.transpose(0, 1),
                                 kernel.mu[l][hs].to(dev, torch.float32), kb, reads=cap.reads[:, :, hsel],
                                 ranks=ranks)
        # a gated attention: the rows' heads' gates of every position (the meters are the gated reads', as pass 2's)
        gate = self.adapter.read_gate(l, cap.resid_in, cap.reads)[:, :, hsel] if has_gate(self.adapter) else None
        m = meters(terms, self.grams[l][hs].to(dev), gate)
        for k in ("D", "M_cov", "M_ctx"):
            out["D_recomputed" if k == "D" else k][r] = m[k][bi, j, hi].cpu().numpy()
        out["valid"][r] = valid[bi, j].cpu().numpy()
        att = probs[bi, hi, j]  # [r, T]
        out["other_share"][r] = (att * (kb[bi] == kernel.n + 1)).sum(-1).double().cpu().numpy()
        self.att[r] = att.cpu().numpy()
        v, i = att.topk(min(self.k_keys, att.shape[-1]), dim=-1)
        self.kshare[r, : v.shape[1]], self.kpos[r, : v.shape[1]] = v.cpu().numpy(), i.cpu().numpy()
        # [r, dh], head space, as it enters the output projection: z and ẑ at one query go through that query's own
        # gate alike (a gated attention, adapters.gate), so Δ_resid is the change of the head's actual write
        d = (terms.z - terms.zhat)[bi, j, hi].float()
        d = d if gate is None else d * gate[bi, j, hi].to(dev)
        O = self.adapter.out_proj_slices(l).to(dev, torch.float32)[torch.as_tensor(hd[r], device=dev)]
        delta[torch.as_tensor(mine, device=dev)] = torch.einsum("rd,rde->re", d, O)

    def decode(self, sel, delta, jlens) -> None:
        """The top ``decode_k`` tokens of the rows ``sel``'s deviation vectors ``delta``: the raw logit lens, and the
        J-lens at each row's layer (``attn`` point) where a store is given."""
        adapter, decode_k, lay = self.adapter, self.decode_k, self.lay
        p, i = torch.softmax(adapter.unembed(delta), dim=-1).topk(decode_k, dim=-1)
        self.dprob[sel], self.dpos[sel] = p.double().cpu().numpy(), i.cpu().numpy()
        if jlens is not None:
            from mfpipe.jlens.lens import jlens_decode
            for l in sorted(set(lay[sel].tolist())):
                m = np.flatnonzero(lay[sel] == l)
                logits = jlens_decode(adapter, jlens, l, "attn", delta[torch.as_tensor(m, device=self.dev)])
                p, i = torch.softmax(logits, dim=-1).topk(decode_k, dim=-1)
                self.jprob[sel[m]], self.jpos[sel[m]] = p.double().cpu().numpy(), i.cpu().numpy()
