"""Induction scores: exact values on hand-built attention patterns, the HF reference and shapes on tiny HF models."""

import numpy as np
import pytest
import torch
from hf_reference import reference_run
from pattern_adapter import PatternModel
from tiny_models import TINY_MODEL_TYPES, make_tiny_model

from mfpipe.models.induction import (
    induction_metrics,
    induction_scores,
    induction_targets,
    repeated_random_tokens,
)


def test_repeated_random_tokens_layout():
    rows = repeated_random_tokens(5, 7, vocab_size=20, special_ids=[0, 3], bos_id=0, seed=1)
    assert rows.shape == (5, 15)
    assert (rows[:, 0] == 0).all()
    np.testing.assert_array_equal(rows[:, 1:8], rows[:, 8:15])
    body = rows[:, 1:]
    assert body.min() >= 1 and body.max() < 20 and not (body == 3).any()
    np.testing.assert_array_equal(rows, repeated_random_tokens(5, 7, 20, [0, 3], 0, seed=1))
    no_bos = repeated_random_tokens(2, 4, 10, [], None, seed=0)
    assert no_bos.shape == (2, 8)
    np.testing.assert_array_equal(no_bos[:, :4], no_bos[:, 4:])


def test_induction_targets():
    q, t = induction_targets(4)  # [BOS, a b c d, a b c d]: positions 5..8 → 2..5
    np.testing.assert_array_equal(q, [5, 6, 7, 8])
    np.testing.assert_array_equal(t, [2, 3, 4, 5])
    q, t = induction_targets(3, offset=0)
    np.testing.assert_array_equal(q, [3, 4, 5])
    np.testing.assert_array_equal(t, [1, 2, 3])


def test_scores_on_hand_built_patterns():
    m = PatternModel()
    T = 21  # k = 10, sequences of 21 tokens
    s = induction_scores(m, vocab_size=50, special_ids=[0], context_length=T, n_sequences=6, batch_size=4)
    assert s.shape == (2, 4)
    assert set(m.seen_lengths) == {T}
    k = 10
    q = np.arange(k + 1, 2 * k + 1)
    expected_uniform = np.mean(1.0 / (q + 1))
    for layer in range(2):
        assert s[layer, 0] == pytest.approx(1.0)
        assert s[layer, 1] == pytest.approx(expected_uniform)
        assert s[layer, 2] == pytest.approx(0.0)
        assert s[layer, 3] == pytest.approx(0.0)
    # an even context length: sequences still fit ((T - 1) // 2 = 10 → length 21 ≤ 22)
    m2 = PatternModel(1)
    induction_scores(m2, 50, [0], 22, n_sequences=2)
    assert max(m2.seen_lengths) <= 22


def test_missing_attentions_is_a_clear_error():
    """Without eager attention the probabilities are never materialised: a clear error, mode restored."""
    model = make_tiny_model("llama")
    model.set_attn_implementation("sdpa")
    model.train()
    with pytest.raises(ValueError, match="eager"):
        induction_scores(model, 50, [0], 21, n_sequences=2)
    assert model.training


def test_scores_and_loss_match_hf_reference():
    """Through the adapter's site == HF output_attentions / logits (the shared reference, no mfpipe code)."""
    model = make_tiny_model("gemma2", seed=4)
    T, k = 21, 10
    scores, loss = induction_metrics(model, 128, [0, 1, 2], T, n_sequences=5, batch_size=2)
    tokens = repeated_random_tokens(5, k, 128, [0, 1, 2], 1, seed=0)
    ref = reference_run(model, torch.as_tensor(tokens))
    q, tgt = induction_targets(k)
    want = np.stack([r["probs"][:, :, q, tgt].double().mean(dim=(0, 2)).numpy() for r in ref["layers"]])
    np.testing.assert_allclose(scores, want, rtol=1e-6, atol=1e-7)
    lp = torch.log_softmax(ref["logits"].double(), -1)
    nll = [-lp[b, i, tokens[b, i + 1]].item() for b in range(5) for i in q[:-1]]
    assert loss == pytest.approx(np.mean(nll), rel=1e-5)


@pytest.mark.parametrize("model_type", TINY_MODEL_TYPES)
def test_scores_on_tiny_hf_models(model_type):
    model = make_tiny_model(model_type)
    cfg = model.config
    n_layer = cfg.num_hidden_layers
    n_head = cfg.num_attention_heads
    s = induction_scores(model, vocab_size=cfg.vocab_size, special_ids=[0, 1, 2], context_length=33, n_sequences=8)
    assert s.shape == (n_layer, n_head)
    assert np.isfinite(s).all() and (s >= 0).all() and (s <= 1 + 1e-6).all()
    # same seed → same sequences → same scores; the model is left in its mode
    s2 = induction_scores(model, cfg.vocab_size, [0, 1, 2], 33, n_sequences=8)
    np.testing.assert_allclose(s, s2)
