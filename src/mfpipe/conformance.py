"""``mfpipe conformance MODEL``: check, before spending GPU days, that mfpipe reads a model's internals right.

It builds a tiny random copy of the model's config (same ``model_type`` and switches, shrunk sizes:
:func:`mfpipe.models.tiny.shrink_config`), places it by structure (:func:`mfpipe.models.adapters.describe`), and
checks every piece the analyses use against the model's own ``transformers`` forward, which knows nothing of the
description: its ``output_attentions`` (times an attention sink's factor where the attention has one, as its tap records
it: :mod:`~mfpipe.models.adapters.sinks`), ``output_hidden_states`` and logits (:func:`reference_forward`).

* the read/patch site: captured probabilities and residual stream equal the forward's; the captured reads are the
  probabilities times the captured values (the value layout and the output projection's input are right);
* the block pieces: the value map of the residual gives the values, and the block rebuilt from the forward's
  probabilities with the adapter's value map, output projection, norms and residual form gives the forward's next
  residual (a norm in the wrong place, a wrong residual form or embedding scale fails here); the final norm and LM
  head give the logits;
* the statistics pass: P, n̄, the context and query counts and the residual centroids of pass 1 equal per-position
  loops over the forward's attentions and hidden states (:func:`reference_stats`);
* the substitution write-back: the model's own reads written back leave the logits bit-identical, and mean-field
  reads (a kernel from that statistics pass) written back through the site give the logits of a plain torch
  ``forward_pre_hook`` on the output projection (times the forward's own output gate where the attention has one,
  read by a hook on its source: :mod:`mfpipe.models.adapters.gate`; the rebuilt block takes it of the residual).

:func:`check_model` returns the rows (check, max error, tolerance, pass); :func:`main` prints them as one table and
exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["CACHE", "Check", "check_model", "conformance_cached", "main", "reference_forward", "reference_stats",
           "tiny_copy"]

B, T = 4, 16
# results of conformance_cached, in the working directory's .snakemake folder (a workflow's planning reads it)
CACHE = Path(".snakemake") / "mfpipe-conformance.json"


@dataclass
class Check:
    name: str
    error: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return bool(np.isfinite(self.error)) and self.error <= self.tolerance


def reference_forward(model, ids, taps=None):
    """The model's own forward, nothing of mfpipe: ``(attentions [L] of [B,H,T,T], hidden_states [L+1] of [B,T,d],
    logits [B,T,V])``, float64; ``taps`` (one per attention, or None): a sink's tap (the one piece of mfpipe here:
    :mod:`~mfpipe.models.adapters.sinks`) whose factor of this forward the returned probabilities are multiplied by."""
    import torch

    with torch.no_grad():
        out = model(torch.as_tensor(ids), output_attentions=True, output_hidden_states=True, use_cache=False)
    taps = taps if taps and len(taps) == len(out.attentions) else [None] * len(out.attentions)
    att = [a if t is None else a * t.factor[..., None] for a, t in zip(out.attentions, taps)]
    return [a.double() for a in att], [h.double() for h in out.hidden_states], out.logits.double()


def reference_stats(attentions, hidden, tokens: np.ndarray, tracked, values=None) -> dict[str, np.ndarray]:
    """Per-position loops over windows, queries and keys: P [L,H,N,K], n̄ [N,K], context counts C [N,K], query
    counts [N] and the residual centroids [L,K,d] (mean of the forward's hidden state entering each block by key
    bucket), from :func:`reference_forward`'s outputs of ``tokens``; with ``values`` ([L] of [B,T,H,dh]), also the
    value means mu [L,H,K,dh] by key bucket. A layer whose ``attentions`` (``values``) entry is None (a hybrid's
    layer of another mixer) has NaN rows of P (mu)."""
    N = tracked.n
    K = N + 2
    rank = {int(t): i for i, t in enumerate(tracked.type_ids)}
    bucket = [[N if j == 0 else rank.get(int(tokens[w, j]), N + 1) for j in range(tokens.shape[1])]
              for w in range(tokens.shape[0])]
    L = len(attentions)
    # a hybrid's layer of another mixer (attentions[l] None: no probabilities, no values) has NaN rows of P and mu
    probs = [None if a is None else a.numpy() for a in attentions]
    att_layers = [l for l in range(L) if probs[l] is not None]
    H = next(p.shape[1] for p in probs if p is not None)
    P = np.zeros((L, H, N, K))
    nbar, C, qn = np.zeros((N, K)), np.zeros((N, K)), np.zeros(N)
    d = hidden[0].shape[-1]
    csum, ccount = np.zeros((L, K, d)), np.zeros(K)
    vsum = None if values is None else np.zeros((L, H, K, next(v for v in values if v is not None).shape[-1]))
    for w in range(tokens.shape[0]):
        for j in range(tokens.shape[1]):
            t = bucket[w][j]
            ccount[t] += 1
            for l in range(L):
                csum[l, t] += hidden[l][w, j].numpy()
                if vsum is not None and values[l] is not None:
                    vsum[l, :, t] += values[l][w, j].numpy()
            if j == 0 or t >= N:
                continue
            qn[t] += 1
            counts = np.bincount(bucket[w][: j + 1], minlength=K)
            nbar[t] += counts
            C[t] += counts > 0
            for k in range(j + 1):
                for l in att_layers:
                    P[l, :, t, bucket[w][k]] += probs[l][w, :, j, k]
    P[[l for l in range(L) if probs[l] is None]] = np.nan
    if vsum is not None:
        vsum[[l for l in range(L) if values[l] is None]] = np.nan
    with np.errstate(invalid="ignore", divide="ignore"):
        out = dict(P=P / qn[None, None, :, None], nbar=nbar / qn[:, None], context_count=C, query_count=qn,
                   centroid=csum / ccount[None, :, None])
        return out if vsum is None else dict(out, mu=vsum / ccount[None, None, :, None])


def _shrunk(config):
    """:func:`mfpipe.models.tiny.shrink_config` of ``config``; of a multimodal composite, each of its sub-configs (its
    language model is what is placed: :mod:`mfpipe.models.adapters.composite`)."""
    from mfpipe.models.adapters.composite import is_composite, shrink_composite
    from mfpipe.models.tiny import shrink_config

    return shrink_composite(config, shrink_config) if is_composite(config) else shrink_config(config)


def tiny_copy(source: str, revision: str | None = None, seed: int = 0):
    """A tiny random model of ``source``'s architecture: a verified ``model_type`` name (its test recipe), a local
    folder with config.json, or a Hugging Face id (its config.json only, from the cache or the hub)."""
    from mfpipe.models.tiny import (MAX_TINY_PARAMETERS, VERIFIED_MODEL_TYPES, make_tiny_model, meta_parameter_count,
                                    random_model)

    if source in VERIFIED_MODEL_TYPES:
        return make_tiny_model(source, seed=seed)
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(source, revision=revision)
    except (OSError, ValueError) as e:
        raise SystemExit(f"mfpipe conformance: cannot read the config of {source!r} (revision {revision!r}): {e}") from None
    tiny = _shrunk(config)
    size = meta_parameter_count(tiny)
    if size > MAX_TINY_PARAMETERS:
        raise SystemExit(f"mfpipe conformance: the tiny copy of {source!r} still has {size / 1e6:.0f} M parameters: "
                         "mfpipe.models.tiny.shrink_config does not know its config's size fields")
    return random_model(tiny, seed=seed)


def check_model(model, structure=None, seed: int = 0) -> list[Check]:
    """The conformance rows of a (tiny, float32, eager, eval) causal LM; ``structure`` replaces the placed one
    (tests give a deliberately wrong description and see the failure)."""
    import torch

    from mfpipe.models.adapters import Adapter, describe
    from mfpipe.models.adapters.composite import language_model
    from mfpipe.models.adapters.forms import per_layer_hidden

    lm = language_model(model)  # a composite: its language model (the references run the composite's own forward)
    adapter = Adapter(lm, structure or describe(lm))
    vocab = int(lm.config.vocab_size)
    rng = np.random.default_rng(seed)
    bos = vocab - 1
    tokens = rng.integers(0, min(vocab - 1, 24), size=(B, T))  # a small alphabet: types repeat in a window
    tokens[:, 0] = bos
    ids = torch.as_tensor(tokens, dtype=torch.long)
    att, hid, logits = reference_forward(model, ids, [adapter.sink_tap(l) for l in adapter.attention_layers])
    hid = per_layer_hidden(hid, adapter.layer_kinds)  # blocks the forward skips (Mllama's cross-attention): none kept
    L, A = adapter.n_layers, adapter.attention_layers  # A: every layer but a hybrid's layers of another mixer
    rows: list[Check] = []
    # a hybrid's forward returns the probabilities of its attention layers only: they go to those layers
    rows.append(Check("site: the forward's attention layers are the placed ones", 0.0 if len(att) in (L, len(A))
                      else float("inf"), 0.0))
    # (MiniMax's linear-attention layers return weights of their own: not probabilities, left out too)
    att = [(att[l] if len(att) == L else att[A.index(l)]) if l in A else None for l in range(L)]
    caps, finals = [], []
    adapter.capture(ids, caps.append, finals.append)

    def err(a, b):
        a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
        return float((a - b).abs().max()) if a.shape == b.shape else float("inf")

    ac = [caps[l] for l in A]
    rows.append(Check("site: attention probabilities", max(err(c.attn_probs, att[c.layer]) for c in ac), 1e-5))
    rows.append(Check("site: residual stream entering each block", max(err(c.resid_in, hid[c.layer]) for c in caps),
                      1e-4))
    rows.append(Check("site: reads = probabilities x values", max(
        err(c.reads, torch.einsum("bhqk,bhkd->bqhd", att[c.layer], c.values.double())) for c in ac), 1e-4))
    rows.append(Check("block: value map of the residual", max(
        err(adapter.value_map(c.layer, hid[c.layer].float()).transpose(1, 2), c.values) for c in ac), 1e-4))
    W_v = {l: adapter.value_weights(l) for l in A}
    if W_v[A[0]] is not None:  # latent attention and hybrids have none: the statistics pass sums the values instead
        rows.append(Check("block: value weights of the attention-input norm", max(
            err(torch.einsum("btd,hde->bhte", adapter.attn_input_norm(l, hid[l].float()), W_v[l][0])
                + (0 if W_v[l][1] is None else W_v[l][1][None, :, None, :]), caps[l].values) for l in A), 1e-4))
    rows.append(Check("block: pieces rebuild the next residual (relative)", _rebuilt(adapter, att, hid, err, ids), 1e-4))
    rows.append(Check("unembed: final norm and LM head give the logits",
                      err(adapter.unembed(finals[0]), logits) / max(1.0, float(logits.abs().max())), 1e-5))
    own = adapter.run(ids, patch_reads=lambda layer, r: r, logits=True)
    rows.append(Check("substitution: own reads written back (exact)", err(own.logits, logits.float()), 0.0))
    values = None if W_v[A[0]] is not None else [
        adapter.value_map(l, hid[l].float()).double() if l in A else None for l in range(L)]
    rows += _stats_and_substitution(model, adapter, tokens, att, hid, seed, values)
    return rows


def _rebuilt(adapter, att, hid, err, ids) -> float:
    """The worst relative error of an attention block rebuilt from the forward's probabilities and the adapter's pieces
    against the forward's next residual (a hybrid's other blocks are the model's own; a join of its own: ids' rows)."""
    import torch

    from mfpipe.models.adapters.forms import IDENTITY_KINDS, side_branch
    from mfpipe.models.adapters.joins import run_block

    worst, carry = 0.0, {}  # a state the blocks hand each other beside the residual (Zaya's), along the layers
    for l in adapter.attention_layers:
        x = hid[l].float()
        v = adapter.value_map(l, x)  # [B,T,H,dh]
        reads = torch.einsum("bhqk,bkhd->bqhd", att[l].float(), v)
        g = adapter.read_gate(l, x, reads)  # an output gate: of each position's residual; a reads norm: of the reads
        reads = reads if g is None else reads * g
        o = torch.einsum("bthk,hkd->btd", reads, adapter.out_proj_slices(l))
        if adapter.out_proj_bias(l) is not None:
            o = o + adapter.out_proj_bias(l)
        side = side_branch(adapter, l, x)  # a mixer beside the attention (Falcon-H1): the model's own, on the sequence
        a = adapter.post_attn_norm(l, o) if side is None else adapter.post_attn_norm(l, o) + side
        mid = x + a
        nxt = (adapter.block_join(l, mid, adapter.mlp(l, x if adapter.parallel_residual else mid))  # post-norm, scale
               if adapter.structure.join == "sum" else run_block(adapter, l, x, o, ids, carry)[1])  # a join of its own
        want = hid[l + 1]
        if all(k in IDENTITY_KINDS for k in adapter.layer_kinds[l + 1:]):  # the last block run: transformers' last
            # hidden state is the final norm's output
            nxt = adapter.final_norm(nxt)
        worst = max(worst, err(nxt, want) / max(1.0, float(want.abs().max())))
    return worst


def _stats_and_substitution(model, adapter, tokens, att, hid, seed, values=None) -> list[Check]:
    import torch

    from mfpipe.corpus.tracked import TrackedSet
    from mfpipe.meanfield.kernel import kernel_from_store
    from mfpipe.models.adapters.gate import gate_of
    from mfpipe.models.adapters.site import module_at
    from mfpipe.stats import accumulate_shard, finalize, open_stats, write_store

    vocab = int(adapter.config.vocab_size)
    counts = np.bincount(tokens[:, 1:].ravel(), minlength=vocab)
    counts[vocab - 1] = 0
    order = np.lexsort((np.arange(vocab), -counts))[:8]
    tracked = TrackedSet(type_ids=order, strings=[f"t{i}" for i in order], counts=counts[order], bos_id=vocab - 1,
                         vocab_size=vocab)
    ref = reference_stats(att, hid, tokens, tracked, values)
    sums = accumulate_shard(model, adapter, tokens, tracked, batch_size=B, device="cpu", progress=False)
    meta = {"model": "conformance", "revision": "tiny", "half": "stats", "corpus": "random", "corpus_fingerprint": "-",
            "model_type": adapter.model_type, "layer_kinds": list(adapter.layer_kinds)}
    ds = finalize(sums, tracked, meta, dtype=np.float64)
    rows = []
    for name in ("P", "nbar", "context_count", "query_count"):
        got = np.asarray(ds[name].values, dtype=np.float64)
        rows.append(Check(f"statistics: {name} vs a per-position loop", _nan_err(got, ref[name]), 1e-5))
    got = np.asarray(ds["centroid"].values, dtype=np.float64)[: adapter.n_layers]
    rows.append(Check("statistics: residual centroids vs a per-position loop", _nan_err(got, ref["centroid"]), 1e-4))
    if values is not None:  # no value weights: the pass sums the values it reads (in place of the value-weights row)
        rows.append(Check("statistics: value means (summed as read) vs a per-position loop",
                          _nan_err(np.asarray(ds["mu"].values, dtype=np.float64), ref["mu"]), 1e-4))
    with tempfile.TemporaryDirectory() as tmp:
        kernel = kernel_from_store(open_stats(write_store(finalize(sums, tracked, meta), Path(tmp) / "s.zarr")),
                                   tracked, min_count=1)
        kb, qt = kernel.buckets(tokens)
        zhat, sub = kernel.zhat(kb, qt)
    ids = torch.as_tensor(tokens, dtype=torch.long)

    def replace(layer, reads):
        return torch.where(sub[..., None, None], zhat[layer].to(reads.dtype), reads)

    got = adapter.run(ids, patch_reads=replace, logits=True).logits
    proj = {l: adapter.reads_module(l) for l in adapter.attention_layers}  # a hybrid's other layers: not patched
    H, dh, s, gates = adapter.n_heads, adapter.d_head, adapter.structure, {}

    def hook_for(layer):
        def hook(mod, args):
            x, own = args[0], adapter.head_dim(layer)  # a layer of narrower heads: zhat's first `own` coordinates
            r = x.reshape(*x.shape[:2], H, own)
            # an output gate: the projection reads the mean-field read times the forward's own gate of the position
            new = torch.where(sub[..., None, None], zhat[layer][..., :own].to(x.dtype), r) if layer not in gates else \
                torch.where(sub[..., None, None], zhat[layer].to(x.dtype) * gates[layer], r)
            return (new.reshape(x.shape), *args[1:])
        return hook

    handles = [p.register_forward_pre_hook(hook_for(l)) for l, p in proj.items()]
    if s.output_gate is not None:  # the gate as the forward computes it, off its source (mfpipe.models.adapters.gate)
        handles += [module_at(adapter.block_module(l), s.output_gate).register_forward_hook(
            lambda m, a, out, l=l: gates.__setitem__(l, gate_of(out, s.gate_layout, H, dh, s.gate_act,
                                                            adapter.gate_bias(l)))) for l in proj]
    try:
        with torch.no_grad():
            want = model(ids, use_cache=False).logits
    finally:
        for h in handles:
            h.remove()
    rows.append(Check(f"substitution: mean-field write-back vs a torch hook ({int(sub.sum())} positions)",
                      float((got - want).abs().max()) if int(sub.sum()) else float("inf"), 1e-5))
    return rows


def _nan_err(got: np.ndarray, want: np.ndarray) -> float:
    if got.shape != want.shape or not np.array_equal(np.isnan(got), np.isnan(want)):
        return float("inf")
    scale = max(1.0, float(np.nanmax(np.abs(want)))) if np.isfinite(want).any() else 1.0
    return float(np.nanmax(np.abs(got - want))) / scale if np.isfinite(want).any() else 0.0


def conformance_cached(config: dict, cache: Path | None = None) -> str | None:
    """Run the conformance checks on a tiny copy of ``config`` (a config.json's contents): None when all pass, else
    one line saying what failed (the structure not placed, or the failing checks). Kept in ``cache`` (default
    :data:`CACHE`) per model type, config and the versions of torch, transformers and mfpipe's code: paid once."""
    import hashlib
    import json

    import torch
    import transformers

    from mfpipe.models.adapters import UnsupportedArchitectureError, describe
    from mfpipe.models.adapters.composite import language_model
    from mfpipe.models.adapters.unplaced import explain
    from mfpipe.models.defaults import special_floats as floats
    from mfpipe.models.tiny import MAX_TINY_PARAMETERS, meta_parameter_count, random_model

    code = hashlib.sha256()
    models = Path(__file__).parent / "models"  # the placement's code and the shrinker's: a new tiny copy, a new verdict
    shrinker = [models / "shrink.py", models / "defaults.py"]
    for f in sorted((models / "adapters").glob("*.py")) + shrinker + [Path(__file__)]:
        code.update(f.read_bytes())
    key = hashlib.sha256(json.dumps([config, torch.__version__, transformers.__version__, code.hexdigest()],
                                    sort_keys=True, default=str).encode()).hexdigest()
    path = Path(cache or CACHE)
    known = json.loads(path.read_text()) if path.is_file() else {}
    if key in known:
        return known[key]["failure"]
    cfg = floats(dict(config))
    model_type = cfg.pop("model_type", None)
    # every way this can fail is one line at planning, never a traceback (`mfpipe census` met configs whose
    # validation raises plain Exceptions, and a placed model whose forward the site cannot read)
    try:
        full = transformers.AutoConfig.for_model(model_type, **{k: v for k, v in cfg.items()
                                                                 if k not in ("architectures", "auto_map")})
        tiny = _shrunk(full)
        size = meta_parameter_count(tiny)
        if size > MAX_TINY_PARAMETERS:
            raise ValueError(f"its shrunk config still has {size / 1e6:.0f} M parameters (shrink_config does not know "
                             "its size fields)")
        torch.manual_seed(0)
        model = random_model(tiny)
    except Exception as e:  # a config transformers cannot build
        model, failure = None, f"transformers cannot build a tiny copy of its config ({type(e).__name__}: {e})"
    if model is not None:
        try:
            rows = check_model(model, describe(language_model(model)))  # a composite: its language model
            bad = [f"{r.name} (error {r.error:.2g} > {r.tolerance:g})" for r in rows if not r.ok]
            failure = f"conformance check(s) failed on a tiny copy: {'; '.join(bad)}" if bad else None
        except UnsupportedArchitectureError as e:  # said as precisely as the forward shows (models.adapters.unplaced)
            failure = f"no structure mfpipe knows ({explain(e, language_model(model)).reason})"
        except Exception as e:
            failure = f"a conformance check raises on a tiny copy ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
    known[key] = {"model_type": model_type, "failure": failure}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(known, indent=1))
    tmp.replace(path)
    return failure


def table(rows: list[Check]) -> str:
    w = max(len(r.name) for r in rows)
    out = [f"{'check':<{w}}  {'max error':>10}  {'tolerance':>9}  pass"]
    out += [f"{r.name:<{w}}  {r.error:>10.2e}  {r.tolerance:>9.0e}  {'yes' if r.ok else 'NO'}" for r in rows]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="mfpipe conformance", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a Hugging Face id, a local folder with config.json, or a verified model_type")
    ap.add_argument("--revision", default=None, help="the hub revision whose config.json to copy")
    args = ap.parse_args(argv)
    import torch

    from mfpipe.models.adapters import UnsupportedArchitectureError, describe
    from mfpipe.models.adapters.composite import language_model
    from mfpipe.models.adapters.unplaced import explain

    torch.manual_seed(0)
    model = tiny_copy(args.model, args.revision)
    try:
        structure = describe(language_model(model))  # a composite: its language model
    except UnsupportedArchitectureError as e:
        print(f"mfpipe conformance: {args.model}: {explain(e, language_model(model))}", file=sys.stderr)
        return 2
    print(f"{args.model} ({model.config.model_type}): a tiny random copy, placed as {structure}")
    rows = check_model(model, structure)
    print(table(rows))
    bad = [r.name for r in rows if not r.ok]
    print(f"{len(rows) - len(bad)} of {len(rows)} checks pass" + (f"; FAILED: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0
