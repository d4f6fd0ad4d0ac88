"""A fake adapter with hand-built attention patterns, for the tests of the scores that read attention only through
``Adapter.run`` (tests/test_induction.py, tests/test_ranking_head_scores.py)."""

from types import SimpleNamespace

import torch

from mfpipe.models.adapters import Adapter, LayerCapture, RunResult


class PatternModel(Adapter):
    """Fake adapter whose attention probabilities are fixed patterns, per layer:
    head 0 = perfect induction, head 1 = uniform causal, head 2 = previous token, head 3 = BOS.
    (Stands in for a model's adapter: induction scores read attention only through ``Adapter.run``.)"""

    has_lm_head = False

    def __init__(self, n_layer=2):
        self.model = torch.nn.Linear(1, 1)  # only its train/eval mode is used
        self.model.config = SimpleNamespace(bos_token_id=0)
        self.n_layers, self.n_heads = n_layer, 4
        self.seen_lengths = []

    def run(self, input_ids, *, select="all", on_layer=None, logits=False, **kwargs):
        assert tuple(select) == ("attn_probs",) and not logits and not kwargs
        assert not self.model.training
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
        for layer in range(self.n_layers):
            on_layer(LayerCapture(layer=layer, attn_probs=pat.clone()))
        return RunResult()
