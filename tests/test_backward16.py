"""mfpipe.models.adapters.backward16: a 16-bit model's linear layers on a CPU give their forward's value bit for bit
and their input's gradient in float32, batched; the J-lens of a bfloat16 model computed this way is as close to the
float64 model's as the model's own backward gives it (issue 58)."""

from __future__ import annotations

import contextlib
import copy

import numpy as np
import pytest
import torch
from tiny_models import TINY_MODEL_TYPES, VOCAB, make_tiny_model

from mfpipe.models.adapters import get_adapter
from mfpipe.models.adapters import jacobian as JJ
from mfpipe.models.adapters.backward16 import applies, fast_input_grads


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


def _linear(dtype=torch.bfloat16, n_in=48, n_out=80, seed=0):
    torch.manual_seed(seed)
    lin = torch.nn.Linear(n_in, n_out).to(dtype)
    lin.requires_grad_(False)
    return lin


def test_the_value_is_the_modules_and_the_gradient_float32_rounded_once():
    lin = _linear()
    x = torch.randn(3, 5, 48).to(torch.bfloat16).requires_grad_(True)
    g = torch.randn(3, 5, 80).to(torch.bfloat16)
    own = lin(x)
    (own_grad,) = torch.autograd.grad(own, x, g)
    with fast_input_grads(lin):
        y = lin(x)
        assert "forward" in vars(lin)
        (grad,) = torch.autograd.grad(y, x, g)
        with torch.no_grad():  # without a graph the module runs as it is
            assert y.grad_fn is not None and lin(x).grad_fn is None
    assert "forward" not in vars(lin)
    assert torch.equal(y, own)  # the model's own kernel's value, bit for bit
    exact = (g.double() @ lin.weight.double()).to(torch.bfloat16)
    assert torch.equal(grad, (g.float() @ lin.weight.float()).to(torch.bfloat16))
    # float32 sums rounded once: within one unit of bfloat16 of the exact product, as the model's own kernel is
    ulp = 2.0 ** -7 * exact.double().abs().clamp_min(1e-30)
    assert ((grad.double() - exact.double()).abs() <= ulp).all()
    assert ((own_grad.double() - exact.double()).abs() <= ulp).all()


def test_a_batch_of_backward_passes_is_one_product_and_equals_them_one_by_one():
    lin = _linear(n_in=64, n_out=96, seed=1)
    x = torch.randn(2, 1, 64).to(torch.bfloat16).requires_grad_(True)
    go = torch.randn(7, 2, 1, 96).to(torch.bfloat16)
    with fast_input_grads(lin):
        y = lin(x)
        with torch.profiler.profile(record_shapes=True) as prof:
            (batched,) = torch.autograd.grad(y, x, go, retain_graph=True, is_grads_batched=True)
        single = torch.stack([torch.autograd.grad(y, x, go[i], retain_graph=True)[0] for i in range(7)])
    mms = [e for e in prof.key_averages(group_by_input_shape=True) if e.key == "aten::mm"]
    # one float32 product of the 7 x 2 rows (the profiler also lists the logical [2, 96] call vmap batched), not
    # a loop over the 7 passes
    assert sorted((e.input_shapes[0], e.count) for e in mms) == [([2, 96], 1), ([14, 96], 1)]
    torch.testing.assert_close(batched, single, rtol=2.0 ** -7, atol=0)


def test_it_applies_to_16_bit_weights_on_a_cpu_only_and_restores_after_an_error():
    assert applies(_linear()) and applies(_linear(torch.float16))
    lin32 = _linear(torch.float32)
    assert not applies(lin32)
    with fast_input_grads(lin32):
        assert "forward" not in vars(lin32)  # a float32 model runs its own backward
    lin = _linear()
    with pytest.raises(ValueError), fast_input_grads(lin):
        raise ValueError("inside")
    assert "forward" not in vars(lin)


def _windows(n, T=10, seed=2):
    return torch.as_tensor(np.random.default_rng(seed).integers(0, VOCAB, size=(n, T)))


@pytest.mark.parametrize("mt", TINY_MODEL_TYPES)
def test_the_jlens_of_a_bfloat16_model_is_as_close_to_float64_as_its_own_backward(mt, monkeypatch):
    """Every tiny architecture in bfloat16: the Jacobians with the float32 input gradients are within 1.2x (plus a
    bfloat16 unit) of the float64 model's error of those through the model's own bfloat16 backward; GPT-2 (its Conv1D
    is no nn.Linear) is unchanged bit for bit."""
    from mfpipe.models.adapters import backward16 as B16

    model = make_tiny_model(mt, seed=4)
    ids, pos = _windows(4), torch.tensor([7, 3, 7, 9])
    ref = JJ.position_jacobians(get_adapter(copy.deepcopy(model).double()), ids, pos, grad_chunk=8)
    ad = get_adapter(copy.deepcopy(model).to(torch.bfloat16))
    calls, forward = [], B16._forward
    monkeypatch.setattr(B16, "_forward", lambda m, x: calls.append(x.requires_grad) or forward(m, x))
    fast = JJ.position_jacobians(ad, ids, pos, grad_chunk=8)
    has_linear = any(type(m) is torch.nn.Linear for m in ad.base.modules())
    assert has_linear == any(calls)  # the float32 gradients were taken wherever there is an nn.Linear
    monkeypatch.setattr(JJ, "fast_input_grads", lambda model: contextlib.nullcontext())
    own = JJ.position_jacobians(ad, ids, pos, grad_chunk=8)

    def err(J):
        return float(torch.nan_to_num(J - ref).norm() / torch.nan_to_num(ref).norm())

    assert np.isnan(fast[1, -1].numpy()).all() and torch.isfinite(fast[0]).all()
    assert err(fast) <= 1.2 * err(own) + 2.0 ** -8, (err(fast), err(own))
    if not has_linear:
        assert torch.equal(torch.nan_to_num(fast), torch.nan_to_num(own))


def test_modules_nnsight_has_traced_are_swapped_too_and_given_back(monkeypatch):
    """nnsight leaves a forward of its own on each module it traced (the adapter's read/patch site): the J-lens after
    a traced forward still takes the float32 gradients, and each module's forward is the one it had after."""
    from mfpipe.models.adapters import backward16 as B16

    ad = get_adapter(copy.deepcopy(make_tiny_model("llama", seed=4)).to(torch.bfloat16))
    ids = _windows(2)
    ad.run(ids, select=("reads",), on_layer=lambda cap: None)
    own = {name: vars(m).get("forward") for name, m in ad.model.named_modules() if type(m) is torch.nn.Linear}
    assert any(f is not None for f in own.values())  # what this test is about: nnsight's own forwards
    calls, forward = [], B16._forward
    monkeypatch.setattr(B16, "_forward", lambda m, x: calls.append(m) or forward(m, x))
    JJ.position_jacobians(ad, ids, torch.tensor([5, 9]), grad_chunk=4)
    traced = {id(m) for name, m in ad.model.named_modules() if own.get(name) is not None}
    assert traced <= {id(m) for m in calls}
    assert all(vars(m).get("forward") is own[name] for name, m in ad.model.named_modules() if name in own)
    ad.run(ids, select=("reads",), on_layer=lambda cap: None)  # the site still traces
