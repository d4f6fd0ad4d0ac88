"""Open-loop rollout (Alg. 1) and the Sec. 4.3 teacher-forced estimators.

The reference below is deliberately slow and independent of ``mfpipe.models.adapters``: plain Python loops
over types, heads and key columns, calling each HF model's own submodules by their HF names.

Exact identities used:
* a window ``[BOS, t_1..t_N]`` of distinct tokens, with every token tracked exactly once: each type has one
  occurrence, so its centroid IS its residual, the kernel measured on that window IS its attention, and the
  rollout started from the layer-0 residuals reproduces the real residuals layer by layer, and all three
  teacher-forced estimators reproduce ``c^{l+1}`` exactly;
* the context-free kernel: rolling out ``[BOS, t]`` reproduces the real residual at position 1;
* all mass on the type itself: rolling out reproduces the residual of the one-token input ``[t]``.
"""

import hf_reference
import numpy as np
import pytest
import torch
from tiny_models import TINY_MODEL_TYPES, make_tiny_model

from mfpipe import kernels as K
from mfpipe import metrics as M
from mfpipe import rollout as R
from mfpipe.models.adapters import get_adapter

RTOL, ATOL = 2e-4, 2e-4


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

    def embed0(self, ids, positions):
        """Layer-0 residual of token ids at the given positions (token embedding + learned position)."""
        e = self.m.get_input_embeddings()(torch.as_tensor(ids))
        if self.mt == "gpt2":
            e = e + self.m.transformer.wpe.weight[torch.as_tensor(positions)]
        return e.detach().numpy()


def _bos(mt, model):
    return model.config.bos_token_id if mt != "gpt2" else model.config.vocab_size - 1


def _types(model, n, seed):
    bos = _bos(model.config.model_type, model)
    rng = np.random.default_rng(seed)
    pool = np.array([i for i in range(3, model.config.vocab_size) if i != bos])
    return rng.choice(pool, size=n, replace=False)


@pytest.fixture(scope="module", params=TINY_MODEL_TYPES)
def tiny(request):
    mt = request.param
    model = make_tiny_model(mt, seed=3)
    ref = Ref(model)
    bos_id = _bos(mt, model)
    resid, _, _ = ref.run([[bos_id]])
    return mt, model, get_adapter(model), ref, bos_id, resid[:, 0, 0]  # b^l [L+1, d]


# ------------------------------------------------------------------------------------------- tests
def test_bos_residuals_match_forward(tiny):
    mt, model, ad, ref, bos_id, b = tiny
    np.testing.assert_allclose(R.bos_residuals(ad, bos_id), b, rtol=1e-5, atol=1e-5)


def test_rollout_matches_slow_reference(tiny):
    mt, model, ad, ref, bos_id, b = tiny
    n = 4
    types = _types(model, n, seed=1)
    kernel = np.random.default_rng(2).dirichlet(np.ones(n + 2) * 0.7, size=(ref.L, ref.H, n))
    init = R.initial_centroids(ad, types, context_length=16)
    if mt == "gpt2":
        np.testing.assert_allclose(
            init, ref.embed0(types, [0] * n) - model.transformer.wpe.weight[0].detach().numpy()
            + model.transformer.wpe.weight[:16].detach().mean(0).numpy(), rtol=1e-6, atol=1e-6
        )
    else:
        np.testing.assert_allclose(init, ref.embed0(types, [0] * n), rtol=1e-6, atol=1e-6)
    fast = R.rollout(ad, kernel, b, type_ids=types, context_length=16)
    slow = ref.rollout(kernel, init, b)
    assert fast.shape == (ref.L + 1, n, ref.d)
    np.testing.assert_allclose(fast, slow, rtol=RTOL, atol=ATOL)
    # the BOS and <other> columns matter (guards against a silently dropped column)
    k2 = kernel.copy()
    k2[..., n], k2[..., n + 1] = kernel[..., n + 1], kernel[..., n]
    assert np.abs(R.rollout(ad, k2, b, init=init)[1:] - fast[1:]).max() > 1e-3


def test_rollout_exact_on_one_window(tiny):
    """Every tracked type once in one window: measured kernel -> the rollout IS the forward pass, and the
    teacher-forced estimators (a)(b)(c) and the tf-attention comparison are exact."""
    mt, model, ad, ref, bos_id, b = tiny
    n = 7
    types = _types(model, n, seed=4)
    resid, att, reads = ref.run([[bos_id, *types]])
    resid, att, reads = resid[:, 0], att[:, 0], reads[:, 0]  # [L+1,T,d], [L,H,T,T], [L,T,H,dh]
    P = np.zeros((ref.L, ref.H, n, n + 2))
    P[..., :n] = att[:, :, 1:, 1:]
    P[..., n] = att[:, :, 1:, 0]
    K.check_row_stochastic(P, atol=1e-5)
    true = resid[:, 1:]  # centroids [L+1, N, d]
    np.testing.assert_allclose(true[0], ref.embed0(types, np.arange(1, n + 1)), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(b, resid[:, 0], rtol=1e-5, atol=1e-5)

    roll = R.rollout(ad, P, b, init=true[0])
    np.testing.assert_allclose(roll, true, rtol=RTOL, atol=ATOL)
    sc = M.score_layers(roll[1:], true[1:])
    np.testing.assert_allclose(sc["cosine"], 1.0, atol=1e-5)

    zbar = reads[:, 1:].transpose(0, 2, 1, 3)  # [L, H, N, dh]
    mu = np.zeros((ref.L, ref.H, n + 2, ref.dh))
    with torch.no_grad():
        for l in range(ref.L):
            for h in range(ref.H):
                for t in range(n):
                    mu[l, h, t] = ref.value_head(l, torch.as_tensor(true[l, t]), h).numpy()
                mu[l, h, n] = ref.value_head(l, torch.as_tensor(b[l]), h).numpy()
                mu[l, h, n + 1] = 123.0  # <other>: no mass anywhere, must not matter
    pred, meas = R.teacher_forced_attention(ad, P, true, b, zbar)
    np.testing.assert_allclose(pred, meas, rtol=RTOL, atol=ATOL)
    est = R.error_decomposition(ad, P, true, b, zbar, mu)
    for k in ("a", "b", "c"):
        np.testing.assert_allclose(est[k], true[1:], rtol=RTOL, atol=ATOL, err_msg=k)


def test_context_free_rollout_reproduces_bos_t(tiny):
    mt, model, ad, ref, bos_id, b = tiny
    types = _types(model, 5, seed=7)
    cf = K.context_free(model, types, bos_id)
    resid, _, _ = ref.run([[bos_id, t] for t in types])
    true = resid[:, :, 1]  # [L+1, N, d]
    roll = R.rollout(ad, cf, b, init=ref.embed0(types, [1] * len(types)))
    np.testing.assert_allclose(roll, true, rtol=RTOL, atol=ATOL)


def test_self_kernel_rollout_reproduces_single_token(tiny):
    mt, model, ad, ref, bos_id, b = tiny
    types = _types(model, 3, seed=9)
    resid, _, _ = ref.run([[t] for t in types])
    roll = R.rollout(ad, K.self_kernel(ref.L, ref.H, 3), b, init=ref.embed0(types, [0, 0, 0]))
    np.testing.assert_allclose(roll, resid[:, :, 0], rtol=RTOL, atol=ATOL)


def test_pinning_holds_dims():
    model = make_tiny_model("gemma2", seed=1)
    ad = get_adapter(model)
    n, L = 4, model.config.num_hidden_layers
    types = np.array([5, 6, 7, 8])
    b = R.bos_residuals(ad, 1)
    kernel = np.random.default_rng(0).dirichlet(np.ones(n + 2), size=(L, model.config.num_attention_heads, n))
    base = R.rollout(ad, kernel, b, type_ids=types)
    vals = np.random.default_rng(1).normal(size=(L + 1, n, ad.d_model)).astype(np.float32)
    dims = [3, 17]
    for mode in ("mean", "type"):
        pv = R.pin_values(vals, mode)
        pinned = R.rollout(ad, kernel, b, type_ids=types, pin_dims=dims, pin_values=pv)
        want = np.broadcast_to(pv[:, None, dims] if mode == "mean" else pv[..., dims], pinned[..., dims].shape)
        np.testing.assert_allclose(pinned[..., dims], want, rtol=1e-6, atol=1e-6)
        assert np.abs(pinned[1:] - base[1:]).max() > 1e-4
    assert np.array_equal(R.rollout(ad, kernel, b, type_ids=types, pin_dims=[], pin_values=None), base)


def test_rogue_dimensions():
    rng = np.random.default_rng(0)
    c = rng.normal(size=(3, 50, 40))
    c[1, :, 7] += 100.0  # rogue only at layer 1
    c[2, :, 11] *= 40.0
    np.testing.assert_array_equal(R.rogue_dimensions(c), [7, 11])
    np.testing.assert_array_equal(R.rogue_dimensions(c, layers=[0, 2]), [11])
    assert R.rogue_dimensions(c, factor=1e6).size == 0


def test_kernel_shape_checked(tiny):
    mt, model, ad, ref, bos_id, b = tiny
    with pytest.raises(ValueError):
        R.rollout(ad, np.zeros((ref.L, ref.H + 1, 2, 4)), b, type_ids=[5, 6])
