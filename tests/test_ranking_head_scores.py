"""Head scores without the mean field (App. P): targets, exact values on fixed attention patterns, a GPT-2
with hand-set weights whose heads attend one position back / to BOS / uniformly, agreement with the
induction scores, batch-size independence and the CSV round trip."""

import numpy as np
import pytest
import torch
import transformers
from pattern_adapter import PatternModel
from tiny_models import make_tiny_model

from mfpipe.experiments.ranking.head_scores import (
    SCORES,
    head_scores,
    open_head_scores,
    score_targets,
    scores_table,
    write_head_scores,
)
from mfpipe.models.induction import induction_scores


def test_score_targets():
    q, t = score_targets(4)  # [BOS, a b c d, a b c d]: queries 5..8
    np.testing.assert_array_equal(q, [5, 6, 7, 8])
    want = {"induction": [2, 3, 4, 5], "previous_token": [4, 5, 6, 7], "duplicate_token": [1, 2, 3, 4],
            "bos_sink": [0, 0, 0, 0]}
    for i, name in enumerate(SCORES):
        np.testing.assert_array_equal(t[i], want[name], err_msg=name)
    q, t = score_targets(3, offset=0)  # [a b c, a b c]
    np.testing.assert_array_equal(q, [3, 4, 5])
    np.testing.assert_array_equal(t[SCORES.index("duplicate_token")], [0, 1, 2])


def test_exact_on_fixed_patterns():
    """Heads: 0 induction, 1 uniform causal, 2 previous token, 3 BOS (pattern_adapter.PatternModel)."""
    ds = head_scores(PatternModel(n_layer=2), vocab_size=50, special_ids=[0], context_length=21, n_sequences=6,
                     batch_size=4)
    k = 10
    assert ds.attrs["k"] == k and ds.attrs["n_sequences"] == 6 and ds.attrs["bos"] == 1
    uniform = np.mean(1.0 / (np.arange(k + 1, 2 * k + 1) + 1))
    want = {  # rows: heads 0..3
        "induction": [1, uniform, 0, 0],
        "previous_token": [0, uniform, 1, 0],
        "duplicate_token": [0, uniform, 0, 0],
        "bos_sink": [0, uniform, 0, 1],
    }
    for name in SCORES:
        assert ds[name].dims == ("layer", "head") and ds[name].dtype == np.float64
        for layer in range(2):
            np.testing.assert_allclose(ds[name].sel(layer=layer).values, want[name], atol=1e-7, err_msg=name)


# --------------------------------------------------------------------------- a GPT-2 with hand-set attention
D, N_HEAD, T = 128, 4, 31  # head dim 32 >= T: one-hot position codes fit in every head
D_HEAD = D // N_HEAD
VOCAB, BOS = 16, 15


def _hand_built_gpt2():
    """Two layers whose attention depends on position only (token embeddings 0, one-hot position embeddings).

    After ln_1 (weight 1, bias 0) position p is ``a e_p - b 1`` with the same a, b for every p; the ``-b 1``
    part adds a constant per query to every logit, which the softmax ignores. Each head's keys are the
    position code itself, its queries a shifted copy, so q_i . k_j = s a^2 [j == i - shift]:
    layer 0 heads = [previous token (shift 1), BOS, uniform (W_Q = 0), shift k - 1 (induction target)],
    layer 1 heads = [shift k (duplicate target), uniform, previous token, BOS].
    The attention and MLP outputs are zeroed so layer 1 sees the same residual stream as layer 0."""
    cfg = transformers.GPT2Config(n_layer=2, n_embd=D, n_head=N_HEAD, n_positions=T + 1, vocab_size=VOCAB,
                                  bos_token_id=BOS, eos_token_id=BOS, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    assert isinstance(model, transformers.GPT2LMHeadModel)
    k = (T - 1) // 2
    s = 2.0  # query scale: the target's logit is s * a^2 / sqrt(D_HEAD) ~ 45 above the others

    def shift(n):  # the query at position p looks for key code p - n
        wq = torch.zeros(D, D_HEAD)
        for p in range(n, T + 1):
            wq[p, p - n] = s
        return wq

    def bos():  # every query looks for key code 0
        wq = torch.zeros(D, D_HEAD)
        wq[: T + 1, 0] = s
        return wq

    uniform = torch.zeros(D, D_HEAD)  # q = 0: equal logits over the causal prefix
    layers = [[shift(1), bos(), uniform, shift(k - 1)], [shift(k), uniform, shift(1), bos()]]
    with torch.no_grad():
        model.transformer.wte.weight.zero_()
        model.transformer.wpe.weight.zero_()
        model.transformer.wpe.weight[:, : T + 1] = torch.eye(T + 1)
        for block, heads in zip(model.transformer.h, layers):
            block.ln_1.weight.fill_(1.0)
            block.ln_1.bias.zero_()
            w = torch.zeros(D, 3 * D)  # Conv1D layout: x @ w, columns [Q | K | V], head h at h * D_HEAD
            for h, wq in enumerate(heads):
                cols = slice(h * D_HEAD, (h + 1) * D_HEAD)
                w[:, cols] = wq
                w[: T + 1, D:][:, cols] = torch.eye(T + 1, D_HEAD)  # key = position code
            block.attn.c_attn.weight.copy_(w)
            block.attn.c_attn.bias.zero_()
            for lin in (block.attn.c_proj, block.mlp.c_proj):
                lin.weight.zero_()
                lin.bias.zero_()
    return model.eval(), k


def test_hand_built_attention_patterns():
    model, k = _hand_built_gpt2()
    ds = head_scores(model, VOCAB, [BOS], context_length=T, n_sequences=8, batch_size=3)
    assert ds.attrs["k"] == k and ds.sizes == {"layer": 2, "head": N_HEAD}
    sc = {name: ds[name].values for name in SCORES}
    # previous-token heads (0, 0) and (1, 2); BOS heads (0, 1) and (1, 3)
    for layer, head in ((0, 0), (1, 2)):
        assert sc["previous_token"][layer, head] >= 0.99
        assert sc["bos_sink"][layer, head] < 0.01 and sc["induction"][layer, head] < 0.01
        assert sc["duplicate_token"][layer, head] < 0.01
    for layer, head in ((0, 1), (1, 3)):
        assert sc["bos_sink"][layer, head] >= 0.99
        assert sc["previous_token"][layer, head] < 0.01 and sc["induction"][layer, head] < 0.01
    assert sc["induction"][0, 3] >= 0.99 and sc["duplicate_token"][0, 3] < 0.01  # target i - k + 1
    assert sc["duplicate_token"][1, 0] >= 0.99 and sc["induction"][1, 0] < 0.01  # target i - k
    # uniform heads: every share is exactly the mean of 1 / (i + 1) over the queries, below 0.1
    uniform = np.mean(1.0 / (np.arange(k + 1, 2 * k + 1) + 1))
    for layer, head in ((0, 2), (1, 1)):
        for name in SCORES:
            assert sc[name][layer, head] < 0.1
            assert sc[name][layer, head] == pytest.approx(uniform, rel=1e-5)


# --------------------------------------------------------------------------- random tiny models
@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_induction_matches_induction_scores_and_batching(model_type):
    model = make_tiny_model(model_type, seed=3)
    V = model.config.vocab_size
    ds = head_scores(model, V, [0, 1, 2], 25, n_sequences=6, seed=5, batch_size=4)
    ref = induction_scores(model, V, [0, 1, 2], 25, n_sequences=6, seed=5, batch_size=4)
    np.testing.assert_allclose(ds["induction"].values, ref, rtol=1e-12)
    # the four scores differ from each other on a random model (not one target read four times)
    vals = [ds[n].values for n in SCORES]
    assert all(not np.allclose(vals[i], vals[j]) for i in range(4) for j in range(i + 1, 4))
    again = head_scores(model, V, [0, 1, 2], 25, n_sequences=6, seed=5, batch_size=5)
    for name in SCORES:
        np.testing.assert_allclose(again[name].values, ds[name].values, rtol=1e-5, atol=1e-7)
    other = head_scores(model, V, [0, 1, 2], 25, n_sequences=6, seed=6, batch_size=4)
    assert not np.allclose(other["induction"].values, ds["induction"].values)


def test_table_and_csv_round_trip(tmp_path):
    ds = head_scores(PatternModel(n_layer=2), 50, [0], 21, n_sequences=2)
    df = scores_table(ds)
    assert list(df.columns) == ["layer", "head", "head_label", *SCORES]
    assert list(df["head_label"][:5]) == ["L0H0", "L0H1", "L0H2", "L0H3", "L1H0"]
    assert df.loc[df["head_label"] == "L1H2", "previous_token"].item() == pytest.approx(1.0)
    path = tmp_path / "head_scores.csv"
    write_head_scores(ds, path, "m", "step8")
    back = open_head_scores(path)
    assert back.attrs["model"] == "m" and back.attrs["revision"] == "step8"
    for name in SCORES:
        np.testing.assert_allclose(back[name].transpose("layer", "head").values, ds[name].values)
    import pandas as pd

    pd.read_csv(path).iloc[:-1].to_csv(tmp_path / "bad.csv", index=False)
    with pytest.raises(ValueError, match="incomplete"):
        open_head_scores(tmp_path / "bad.csv")
