"""The slow references of the rollout tests (tests/test_rollout.py, tests/test_rollout_analysis.py), independent of
``mfpipe.models.adapters``: :class:`Ref`, the blocks of a tiny HF model rebuilt from its own submodules (Alg. 1
with Python loops over types, heads and key columns, and a hooked real forward), the plain HF forward's residuals
(:func:`forward_residuals`), and the Sec. 4.3 estimators (a)(b)(c) from their definitions, per occurrence
(:func:`estimators_reference`)."""

import hf_reference
import numpy as np
import torch


# ----------------------------------------------------------------------------- HF-only reference
class Ref:
    """The blocks of a tiny HF model, rebuilt from its own submodules (no mfpipe code)."""

    def __init__(self, model):
        self.m = model
        self.cfg = cfg = model.config
        self.mt = cfg.model_type
        self.blocks, self.final = hf_reference.blocks(model), hf_reference.final_norm(model)
        self.L = cfg.num_hidden_layers
        self.H = cfg.num_attention_heads
        self.d = cfg.hidden_size
        self.dh = getattr(cfg, "head_dim", None) or self.d // self.H
        self.kv = getattr(cfg, "num_key_value_heads", None) or self.H

    def o_proj_module(self, l):
        return hf_reference.o_proj(self.m, l)

    def value_head(self, l, x, h):
        b, d, dh = self.blocks[l], self.d, self.dh
        if self.mt == "gpt2":
            return b.attn.c_attn(b.ln_1(x))[2 * d : 3 * d].view(self.H, dh)[h]
        if self.mt == "gpt_neox":
            return b.attention.query_key_value(b.input_layernorm(x)).view(self.H, 3 * dh)[h, 2 * dh :]
        if self.mt == "opt":
            return b.self_attn.v_proj(b.self_attn_layer_norm(x)).view(self.H, dh)[h]
        hin = x if self.mt == "olmo2" else b.input_layernorm(x)
        return b.self_attn.v_proj(hin).view(self.kv, dh)[h // (self.H // self.kv)]

    def finish(self, l, x, reads):
        """Residual after block ``l`` given the block input ``x [d]`` and the concatenated reads ``[H*dh]``."""
        b = self.blocks[l]
        o = self.o_proj_module(l)(reads)
        if self.mt == "gpt2":
            m = x + o
            return m + b.mlp(b.ln_2(m))
        if self.mt == "gpt_neox":
            assert self.cfg.use_parallel_residual
            return x + o + b.mlp(b.post_attention_layernorm(x))
        if self.mt in ("llama", "qwen3"):
            m = x + o
            return m + b.mlp(b.post_attention_layernorm(m))
        if self.mt == "gemma2":
            m = x + b.post_attention_layernorm(o)
            return m + b.post_feedforward_layernorm(b.mlp(b.pre_feedforward_layernorm(m)))
        if self.mt == "olmo2":
            m = x + b.post_attention_layernorm(o)
            return m + b.post_feedforward_layernorm(b.mlp(m))
        if self.mt == "opt":  # the MLP is three modules of the block
            m = x + o
            return m + b.fc2(b.activation_fn(b.fc1(b.final_layer_norm(m))))
        if self.mt == "mixtral":
            m = x + o
            return m + moe_reference(b.mlp, b.post_attention_layernorm(m))
        raise AssertionError(self.mt)

    @torch.no_grad()
    def rollout(self, kernel, init, bos):
        """Alg. 1 with loops: types, heads, key columns one at a time."""
        c = [torch.as_tensor(v, dtype=torch.float32) for v in init]
        out = [torch.stack(c)]
        n = len(c)
        for l in range(self.L):
            b = torch.as_tensor(bos[l], dtype=torch.float32)
            other = sum(c) / n
            keys = c + [b, other]
            new = []
            for s in range(n):
                reads = []
                for h in range(self.H):
                    z = torch.zeros(self.dh)
                    for t in range(n + 2):
                        z = z + float(kernel[l, h, s, t]) * self.value_head(l, keys[t], h)
                    reads.append(z)
                new.append(self.finish(l, c[s], torch.cat(reads)))
            c = new
            out.append(torch.stack(c))
        return torch.stack(out).numpy()

    @torch.no_grad()
    def run(self, ids):
        """Real forward: residual entering each block and the final residual before the last norm
        ``[L+1, B, T, d]``, the attention probabilities ``[L, B, H, T, T]`` and the per-head reads
        ``[L, B, T, H, dh]`` (inputs of the output projections)."""
        resid, reads, hooks = [], [], []
        for l in range(self.L):
            hooks.append(self.blocks[l].register_forward_pre_hook(lambda mod, args: resid.append(args[0].clone())))
            hooks.append(self.o_proj_module(l).register_forward_pre_hook(lambda mod, args: reads.append(args[0].clone())))
        hooks.append(self.final.register_forward_pre_hook(lambda mod, args: resid.append(args[0].clone())))
        try:
            out = self.m(torch.as_tensor(ids), output_attentions=True, use_cache=False)
        finally:
            for hk in hooks:
                hk.remove()
        B, T = np.asarray(ids).shape
        rd = torch.stack(reads).view(self.L, B, T, self.H, self.dh)
        return torch.stack(resid).numpy(), torch.stack(out.attentions).numpy(), rd.numpy()


@torch.no_grad()
def moe_reference(moe, h):
    """Mixtral's sparse MoE at one row ``h [d]``, by its definition: router logits, softmax, the top-k experts with
    their probabilities renormalised, each expert's SwiGLU ``down (silu(gate h) * up h)`` weighted and summed; loops
    over the chosen experts (from the module's parameters, not its forward)."""
    probs = torch.softmax((moe.gate.weight @ h).double(), -1)
    top = torch.topk(probs, moe.top_k).indices
    weights = probs[top] / probs[top].sum()
    out = torch.zeros_like(h, dtype=torch.float64)
    inner = moe.experts.gate_up_proj.shape[1] // 2
    for w, e in zip(weights, top.tolist()):
        gate_up = moe.experts.gate_up_proj[e] @ h
        act = torch.nn.functional.silu(gate_up[:inner]) * gate_up[inner:]
        out += w * (moe.experts.down_proj[e] @ act).double()
    return out.to(h.dtype)


def forward_residuals(ref, ids):
    """Plain HF forward: ``hidden_states[0..L-1]`` and the final residual before the last norm (a pre-hook
    on the final norm: ``hidden_states[L]`` is after it) -> ``[L+1, B, T, d]``."""
    final = {}
    hook = ref.final.register_forward_pre_hook(lambda mod, args: final.update(x=args[0].detach().clone()))
    try:
        with torch.no_grad():
            out = ref.m(torch.as_tensor(ids), output_hidden_states=True, use_cache=False)
    finally:
        hook.remove()
    hs = [h.detach() for h in out.hidden_states]
    assert len(hs) == ref.L + 1
    with torch.no_grad():  # the hooked tensor is the input of the norm that produced hidden_states[L]
        np.testing.assert_allclose(ref.final(final["x"]).numpy(), hs[ref.L].numpy(), rtol=1e-5, atol=1e-5)
    return np.stack([h.numpy() for h in hs[: ref.L]] + [final["x"].numpy()])


@torch.no_grad()
def estimators_reference(ref, toks, tracked):
    """(a)(b)(c) of Sec. 4.3 from their definitions, with loops over occurrences, heads and key positions.

    Per query occurrence j of type s in window w and head h: reads z = sum_k p_jk v(x_k) (the captured input of
    the output projection), A_st = sum_{k: T(x_k)=t} p_jk. P_st = E_s[A_st], zbar_s = E_s[z], c_t = mean residual
    over type-t positions, mu_t = mean value over type-t positions (unconditional), b = position 0's residual,
    cbar = mean of the N tracked centroids. Then with the block applied at c_s:
      (a) zbar_s;  (b) zbar_s + sum_{t<N} P_st (v(c_t) - mu_t);
      (c) sum_{t<N} P_st v(c_t) + P_s,bos v(b) + P_s,other v(cbar)."""
    resid, att, reads = ref.run(toks)
    N = tracked.n
    rank = {int(t): i for i, t in enumerate(tracked.type_ids)}
    nW, T = toks.shape

    def bucket(w, j):
        return N if j == 0 else rank.get(int(toks[w, j]), N + 1)

    out = {k: np.zeros((ref.L, N, ref.d)) for k in "abc"}
    occ = {t: [(w, j) for w in range(nW) for j in range(T) if bucket(w, j) == t] for t in range(N + 2)}
    for l in range(ref.L):
        x = lambda w, j: torch.as_tensor(resid[l, w, j])  # noqa: E731
        c = [torch.stack([x(w, j) for w, j in occ[t]]).mean(0) for t in range(N)]
        b, cbar = x(0, 0), torch.stack(c).mean(0)
        vc = [[ref.value_head(l, c[t], h) for t in range(N)] for h in range(ref.H)]
        mu = [[torch.stack([ref.value_head(l, x(w, j), h) for w, j in occ[t]]).mean(0) for t in range(N)]
              for h in range(ref.H)]
        for s in range(N):
            P = np.zeros((ref.H, N + 2))
            zbar = torch.zeros(ref.H, ref.dh)
            for w, j in occ[s]:
                for h in range(ref.H):
                    zbar[h] += torch.as_tensor(reads[l, w, j, h])
                    for k in range(j + 1):
                        P[h, bucket(w, k)] += att[l, w, h, j, k]
            P, zbar = P / len(occ[s]), zbar / len(occ[s])
            r = {k: [] for k in "abc"}
            for h in range(ref.H):
                r["a"].append(zbar[h])
                r["b"].append(zbar[h] + sum(float(P[h, t]) * (vc[h][t] - mu[h][t]) for t in range(N)))
                r["c"].append(sum(float(P[h, t]) * vc[h][t] for t in range(N))
                              + float(P[h, N]) * ref.value_head(l, b, h) + float(P[h, N + 1]) * ref.value_head(l, cbar, h))
            for k in "abc":
                out[k][l, s] = ref.finish(l, c[s], torch.cat(r[k]).float()).numpy()
    return out
