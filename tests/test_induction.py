"""Induction scores: exact values on hand-built attention patterns, and shapes on tiny HF models."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mfpipe.induction import induction_scores, induction_targets, repeated_random_tokens
from tiny_models import TINY_MODEL_TYPES, make_tiny_model


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


class PatternModel(torch.nn.Module):
    """Fake causal LM whose attentions are fixed patterns, per layer:
    head 0 = perfect induction, head 1 = uniform causal, head 2 = previous token, head 3 = BOS."""

    def __init__(self, n_layer=2):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.n_layer = n_layer
        self.config = SimpleNamespace(bos_token_id=0)
        self.seen_lengths = []

    def forward(self, input_ids, attention_mask=None, output_attentions=False, use_cache=False):
        B, L = input_ids.shape
        self.seen_lengths.append(L)
        k = (L - 1) // 2
        ind = torch.zeros(L, L)
        prev = torch.zeros(L, L)
        bos = torch.zeros(L, L)
        bos[:, 0] = 1
        for i in range(L):
            prev[i, max(i - 1, 0)] = 1
            # in the second copy attend to the token after the earlier occurrence, else BOS
            ind[i, i - k + 1 if i > k else 0] = 1
        uni = torch.tril(torch.ones(L, L))
        uni = uni / uni.sum(-1, keepdim=True)
        pat = torch.stack([ind, uni, prev, bos])[None].expand(B, 4, L, L)
        return SimpleNamespace(attentions=tuple(pat.clone() for _ in range(self.n_layer)))


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
    class NoAtt(PatternModel):
        def forward(self, input_ids, **kw):
            return SimpleNamespace(attentions=None)

    with pytest.raises(RuntimeError, match="eager"):
        induction_scores(NoAtt(), 50, [0], 21, n_sequences=2)


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
