"""The J-lens decode through Jacobian-vector products (issue 58; mfpipe.jlens.jvp, mfpipe.models.adapters.jvp):
equal to ``W_U J v`` from the stored J (its own full-J estimate on the same sampled positions) on the mini models'
shapes and the six tiny architectures, Gemma-2 with a sliding window shorter than the windows; the final point the
raw lens bit for bit; a model without a usable cache runs whole windows; the consumers' choice of path; and the
lenses table through either path."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml
from tiny_models import TINY_MODEL_TYPES, VOCAB, make_tiny_model

from mfpipe.jlens import lens as JL
from mfpipe.jlens.jvp import JLensSample, jvp_products, lens_logits
from mfpipe.models.adapters import get_adapter
from mfpipe.models.adapters.jacobian import position_jacobians
from mfpipe.models.adapters.jvp import position_jvps

T = 12


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


def _windows(n=6, seed=0, vocab=VOCAB, length=T):
    return np.random.default_rng(seed).integers(0, vocab, size=(n, length), dtype=np.int64)


def _mini_model(repo, name):
    """A mini-suite model of the default config's shape (random weights: the trained checkpoints are the workflow's)."""
    from mfpipe.minisuite.model import build_model, resolve_config
    from mfpipe.workflow.config import minimodel

    config = yaml.safe_load((repo / "config" / "config.yaml").read_text())
    torch.manual_seed(0)
    return build_model(resolve_config(minimodel(config, name)), int(config["minisuite"]["tokenizer"]["vocab_size"]))


def _assert_decodes_equal(ad, windows, n_positions=16, seed=3, atol=1e-5):
    """Every (point, layer): the products' decode against the stored J's, logits within ``atol`` of their largest
    magnitude, J v within 1e-5 of J @ v; at (block, L) the raw lens bit for bit."""
    ds = JL.estimate_jlens(ad, windows, n_positions=n_positions, seed=seed, batch_size=4, progress=False)
    sample = JLensSample(windows, n_positions=n_positions, seed=seed, batch_size=4, chunk=5)
    L, d = ad.n_layers, ad.d_model
    u = torch.randn(7, d, generator=torch.Generator().manual_seed(1))
    worst = 0.0
    for point, layers in (("block", range(L + 1)), ("attn", range(L))):
        for layer in layers:
            J = torch.as_tensor(JL.jlens_matrix(ds, layer, point))
            want = u.double() @ J.T
            got = jvp_products(ad, sample, u, layer, point)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))
            a, b = lens_logits(ad, sample, layer, point, u), JL.jlens_decode(ad, ds, layer, point, u)
            err = float((a - b).abs().max() / b.abs().max())
            assert err < atol, (point, layer, err)
            worst = max(worst, err)
    torch.testing.assert_close(lens_logits(ad, sample, L, "block", u), JL.raw_decode(ad, u), rtol=0, atol=0)
    return worst


@pytest.mark.parametrize("name", ["mini-gpt2", "mini-neox"])
def test_the_jvp_decode_equals_the_stored_j_on_the_mini_models(repo, name):
    """Acceptance (issue 58): on the default config's mini models (their shapes, random weights, T = 64), W_U J v
    through Jacobian-vector products equals W_U J v through the full J the jlens job stores, at every point and
    layer, to 1e-5 of the logits' largest magnitude."""
    ad = get_adapter(_mini_model(repo, name))
    windows = _windows(8, seed=2, vocab=ad.model.config.vocab_size, length=64)
    assert _assert_decodes_equal(ad, windows, n_positions=24) < 1e-5


@pytest.mark.parametrize("mt", [*TINY_MODEL_TYPES, "mixtral"])
def test_the_jvp_decode_equals_the_stored_j_on_every_architecture(mt):
    """The six, and a mixture of experts (issue 59 item 6): its products run the experts' eager loop (transformers'
    fused grouped_mm has no forward-mode derivative), its stored J the fused kernel's backward; the setting is
    restored."""
    model = make_tiny_model(mt, seed=2)
    impl = model.config._experts_implementation
    ad = get_adapter(model)
    _assert_decodes_equal(ad, _windows(6, seed=1))
    assert model.config._experts_implementation == impl


def test_a_sliding_window_shorter_than_the_windows_keeps_its_cache():
    """Gemma-2 with a 4-token sliding window on 12-token windows (its cache a DynamicSlidingWindowLayer that drops
    what falls out of the window): the products through the kept cache equal the full Jacobians' (1e-5) and the
    whole-window form's."""
    ad = get_adapter(make_tiny_model("gemma2", seed=3, sliding_window=4))
    ids, pos = torch.as_tensor(_windows(5, seed=0)), torch.tensor([7, 3, 7, 1, 11])
    J = position_jacobians(ad, ids, pos, grad_chunk=8, prefix_cache=False)
    L = ad.n_layers
    points, layers = ["block", "attn", "block", "attn", "block"], [0, 0, 1, 1, L]
    V = torch.randn(5, ad.d_model, generator=torch.Generator().manual_seed(0))
    want = torch.stack([J[0 if p == "block" else 1, l] @ v.double() for p, l, v in zip(points, layers, V)])
    for cached in (True, False):
        got = position_jvps(ad, ids, pos, V, layers, points, chunk=2, prefix_cache=cached)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))
    _assert_decodes_equal(ad, _windows(6, seed=4))


def test_a_model_without_a_usable_cache_runs_whole_windows(caplog):
    """A forward that takes no cache, or ignores it, falls back to whole windows with a log line: the same products;
    parameters and mode are left as they were; bad input is refused by name."""
    model = make_tiny_model("llama", seed=1)
    ad = get_adapter(model)
    ids, pos = torch.as_tensor(_windows(3, seed=4)), torch.tensor([5, 2, 8])
    V = torch.randn(4, ad.d_model, generator=torch.Generator().manual_seed(2))
    whole = position_jvps(ad, ids, pos, V, 0, "attn", prefix_cache=False)
    forward = ad.base.forward

    def refuses(*a, past_key_values=None, use_cache=None, **k):
        if past_key_values is not None or use_cache:
            raise TypeError("forward() got an unexpected keyword argument 'past_key_values'")
        return forward(*a, use_cache=False, **k)

    def ignores(*a, past_key_values=None, use_cache=None, **k):
        return forward(*a, use_cache=past_key_values is None and bool(use_cache), **k)

    for shim, said in ((refuses, "unexpected keyword"), (ignores, "another final residual")):
        ad.base.forward = shim
        caplog.clear()
        try:
            with caplog.at_level(logging.WARNING, logger="mfpipe.models.adapters.jvp"):
                got = position_jvps(ad, ids, pos, V, 0, "attn")
        finally:
            del ad.base.forward
        assert any(said in r.getMessage() and "whole" in r.getMessage() for r in caplog.records), caplog.text
        torch.testing.assert_close(got, whole, rtol=0, atol=0)
    assert all(p.requires_grad for p in model.parameters()) and not model.training
    with pytest.raises(ValueError, match=r"\('attn', layer 2\) outside"):
        position_jvps(ad, ids, pos, V, 2, "attn")
    with pytest.raises(ValueError, match="vectors must be"):
        position_jvps(ad, ids, pos, V[:, :5], 0, "attn")


def test_a_16_bit_model_keeps_its_cached_prefix(caplog):
    """The cached prefix's check tolerates a 16-bit model's rounding (issue 58: Gemma-2, Llama-3.2, Phi-3 and Gemma-7B
    in bfloat16 fell back to whole windows, 26-48x the cost, on differences of 3.9e-3-5.7e-3 against a fixed 1e-3).
    A cached forward whose final residual is 1 % off the whole window's (a constant offset: the Jacobian is unchanged)
    keeps its cache in bfloat16 and falls back in float32, for the Jacobians and the products alike; the bfloat16
    model's Jacobians and products equal the whole-window forms to its rounding."""
    from mfpipe.models.adapters import jacobian

    assert jacobian.cache_tolerance(torch.float32) == 1e-3 and jacobian.cache_tolerance(torch.bfloat16) == 0.0625
    ids, pos = torch.as_tensor(_windows(3, seed=4)), torch.tensor([9, 5, 11])
    for dtype, falls_back in ((torch.bfloat16, False), (torch.float32, True)):
        ad = get_adapter(make_tiny_model("llama", seed=1).to(dtype))
        V = torch.randn(3, ad.d_model, generator=torch.Generator().manual_seed(2))
        offset = 0.01 * float(jacobian.final_residual(ad, ids)[:, -1].float().norm(dim=-1).mean()) / ad.d_model ** 0.5
        forward, cached = ad.base.forward, []

        def shifted(*a, forward=forward, cached=cached, **k):
            cached.append(k.get("cache", k.get("past_key_values")) is not None)
            return forward(*a, **k)

        def shift(module, args, kwargs, cached=cached):
            if cached and cached[-1]:
                x = (args[0] if args else kwargs["hidden_states"]) + offset
                return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})
            return None

        handle = ad.final_norm_module().register_forward_pre_hook(shift, with_kwargs=True)
        ad.base.forward = shifted
        caplog.clear()
        try:
            with caplog.at_level(logging.WARNING):
                got_J = jacobian.position_jacobians(ad, ids, pos)
                got_v = position_jvps(ad, ids, pos, V, 0, "block")
        finally:
            del ad.base.forward
            handle.remove()
        said = [r.getMessage() for r in caplog.records if "whole" in r.getMessage()]
        assert len(said) == (2 if falls_back else 0), (dtype, said)
        whole = jacobian.position_jacobians(ad, ids, pos, prefix_cache=False)
        tol = 1e-5 if dtype == torch.float32 else 0.05
        assert float((got_J[0] - whole[0]).abs().max()) <= tol * float(whole[0].abs().max())
        want = V.double() @ whole[0, 0].T
        assert float((got_v - want).abs().max()) <= tol * float(want.abs().max())


def _plan(repo, tmp_path, *overrides, preset=None):
    from mfpipe.estimate.jobs import load_config
    from mfpipe.workflow.plan import Plan

    files = [repo / "config" / "presets" / f"{preset}.yaml"] if preset else []
    config = load_config(files, ["results=results-58", *overrides], base=repo / "config" / "config.yaml")
    return Plan(config, repo / "src", None)


def test_each_consumer_decodes_the_cheaper_way(repo, tmp_path):
    """jlens.decode auto: the lenses' vectors times the cost of a product against d, per model (the mini suite's
    shape from its config, a local model's from its config.json, a hub model not in the cache: the store); the
    function vectors' every head of every clean prompt: the store; jvp / matrix as named. The DAG follows: the store
    is an input only of a job that reads it, and the products' settings are the params of one that does not."""
    import json

    from mfpipe.experiments.fv import rules as fv_rules
    from mfpipe.experiments.prompts import rules as prompts_rules
    from mfpipe.jlens import rules as R

    plan = _plan(repo, tmp_path)
    # the default config's lenses read every head of the mini models (16, for the explorer), 8 contexts each
    assert prompts_rules.lens_vectors(plan) == 16 * 8 and R.model_shape(plan, "mini-gpt2") == (2, 8, 128)
    assert R.JVP_ROW_COST == 3.0 and R.decode_path(plan, "mini-gpt2", 43) == "matrix"  # 43 x 3 > d = 128
    assert R.decode_path(plan, "mini-gpt2", 42) == "jvp"
    wc = SimpleNamespace(model="mini-gpt2", revision="final")
    assert R.decode_inputs(plan, wc, 64) == {"jlens": "results-58/jlens/mini-gpt2/final/jlens.zarr"}
    assert R.decode_inputs(plan, wc, 8) == {} and R.decode_params(plan, "mini-gpt2", 64) == {"decode": "matrix"}
    assert R.decode_params(plan, "mini-gpt2", 8) == {"decode": "jvp", "n_positions": 256, "seed": 0,
                                                     "batch_size": 32, "chunk": 64}
    f = plan.config["fv"]  # per seed and task: 4 summed vectors, 2 x 8 heads' own and per clean prompt
    runs = int(f["n_seeds"]) * (len(f["tasks"]) - 1 + int(plan.config["minisuite"]["tasks"]["n_tasks"]))
    assert fv_rules.decoded_vectors(plan, "mini-gpt2")(2, 8) == runs * (4 + 16 * (1 + int(f["n_clean"]))) > 128
    assert R.decode_path(plan, "mini-gpt2", fv_rules.decoded_vectors(plan, "mini-gpt2")) == "matrix"
    for named in ("jvp", "matrix"):
        assert R.decode_path(_plan(repo, tmp_path, f"jlens={{decode: {named}}}"), "mini-gpt2", 64) == named
    # a local model's shape from its config.json; a hub model not in the cache: unknown, the store
    folder = tmp_path / "gpt2-local"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 12, "n_head": 12, "n_embd": 768}))
    models = (f'models=[{{name: loc, source: local, path: "{folder}"}}, '
              '{name: hub, source: hub, hub_id: org/not-cached}]')
    plan = _plan(repo, tmp_path, models, "fv={tasks: [antonym]}")
    assert R.model_shape(plan, "loc") == (12, 12, 768) and R.model_shape(plan, "hub") is None
    assert R.decode_path(plan, "loc", 64) == "jvp" and R.decode_path(plan, "hub", 64) == "matrix"
    assert R.decode_path(plan, "loc", fv_rules.decoded_vectors(plan, "loc")) == "matrix"


def test_the_estimate_prices_the_products_where_a_consumer_takes_them():
    """`mfpipe estimate`'s lenses and function vectors add the products' seconds (per position: its own work and
    each vector's) exactly where jlens.decode takes that path for them, and nothing where they read the store."""
    from mfpipe.estimate.prompts import jvp_decode

    c = {"layers": 12, "heads": 12, "d_model": 768, "jvp_position_s": 0.5, "jvp_s_per_vector": 0.01}
    ctx = SimpleNamespace(config={"jlens": {"decode": "auto", "n_positions": 256}})
    assert jvp_decode(ctx, c, 64) == pytest.approx(256 * (0.5 + 64 * 0.01))
    assert jvp_decode(ctx, c, 256) == 0.0  # 256 x 3 = d: the store
    ctx.config["jlens"]["decode"] = "jvp"
    assert jvp_decode(ctx, c, 256) == pytest.approx(256 * (0.5 + 256 * 0.01))
    ctx.config["jlens"]["decode"] = "matrix"
    assert jvp_decode(ctx, c, 1) == 0.0
