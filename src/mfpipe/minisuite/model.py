"""The mini-suite model: its config (validated, with defaults) and the HF GPT-2 / GPT-NeoX model it builds.

Model config (a plain dict; :data:`DEFAULT_CONFIG` holds the defaults, unknown keys are an error):

==================  =========================================================================
key                 meaning
==================  =========================================================================
name                model name written into ``induction.csv`` / ``training.json``
architecture        ``"gpt2"`` or ``"gpt_neox"`` (Pythia: parallel residual, rotary, untied)
n_layer             number of transformer blocks
d_model             residual width
n_head              attention heads per layer (``d_model % n_head == 0``)
d_mlp               MLP hidden width
context_length      training context T (also ``max_position_embeddings``); rows are T tokens
rotary_pct          gpt_neox only: fraction of each head's dims that get rotary (1.0 = all)
rotary_base         gpt_neox only: rope theta
tie_embeddings      tie input and output embeddings (None: the architecture's default, i.e.
                    tied for gpt2, untied for gpt_neox as in Pythia)
steps               optimizer steps; checkpoints at :func:`checkpoint_steps` ``(steps, linear_checkpoints)``
linear_checkpoints  ``{start, stop, every}``: also save every ``every`` steps in ``(start, stop)`` (None: only
                    the log-spaced ones), to resolve a transition such as the induction bump
batch_size          rows per step
lr                  peak AdamW learning rate
weight_decay        AdamW weight decay (applied to matrices only, not to biases/LayerNorms)
warmup_steps        linear warm-up steps from 0 to ``lr``
lr_schedule         ``"constant"`` (after warm-up) or ``"cosine"`` (decay to ``min_lr_ratio*lr``)
min_lr_ratio        floor of the cosine schedule, as a fraction of ``lr``
beta1, beta2        AdamW betas
grad_clip           max global gradient norm (0 / None: no clipping)
optimizer_restarts  steps after which the AdamW state is re-initialised (list, default none)
repeat_fraction     fraction of rows that are ``[BOS, r1..rk, r1..rk, text...]``; the rest are
                    ``[BOS, text...]`` windows at random offsets of the training stream
repeat_min/max      k is uniform in ``repeat_min..repeat_max`` (inclusive); r is drawn uniformly
                    from the whole vocabulary minus special tokens
mask_first_copy     if true, the (unpredictable) first copy r1..rk is not a loss target
fewshot_fraction    fraction of rows that are few-shot rows ``[BOS, x, sep, y, nl, …]`` of one task of
                    :mod:`mfpipe.minisuite.tasks` (loss on the answers only), in steps after ``fewshot_start``;
                    ``repeat_fraction`` is the repeat share of the other rows. Drawn after the other rows: with
                    0, and before ``fewshot_start``, the rows are the old ones bit for bit
fewshot_start       few-shot rows only in optimizer steps after this one (0: from the first)
fewshot_mask_first  if true, a few-shot row's first answer is not a loss target
seed                seeds ``torch.manual_seed`` (init) and a numpy Generator (data)
induction_sequences number of test sequences for the per-checkpoint induction score
induction_every     also record max induction score / induction loss every this many steps
                    (``induction_curve`` in training.json, no checkpoint saved; 0: off)
eval_rows           fixed plain-text rows for the per-checkpoint ``text_loss``
==================  =========================================================================
"""

from __future__ import annotations

import copy

from mfpipe.workflow.config import schema_defaults

ARCHITECTURES = ("gpt2", "gpt_neox")

# The options the workflow requires (config/config.yaml sets them), with the library's own defaults for callers
# that build a mini model without the workflow; every other option's default lives in the config schema.
DEFAULT_CONFIG: dict = {
    "name": "mini",
    "architecture": "gpt2",
    "n_layer": 2,
    "d_model": 128,
    "n_head": 8,
    "d_mlp": 64,
    "context_length": 64,
    "steps": 1500,
    "batch_size": 64,
    "lr": 3e-3,
    **schema_defaults("minimodel"),
}


def resolve_config(cfg: dict) -> dict:
    """Defaults merged with ``cfg``, validated. Raises ValueError on bad or unknown keys."""
    unknown = sorted(set(cfg) - set(DEFAULT_CONFIG))
    if unknown:
        raise ValueError(f"unknown mini-model config keys: {unknown}; known: {sorted(DEFAULT_CONFIG)}")
    out = copy.deepcopy(DEFAULT_CONFIG)
    out.update(copy.deepcopy(dict(cfg)))
    arch = out["architecture"]
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r}; expected one of {list(ARCHITECTURES)}")
    if out["d_model"] % out["n_head"]:
        raise ValueError(f"d_model {out['d_model']} not divisible by n_head {out['n_head']}")
    T = int(out["context_length"])
    if not 1 <= out["repeat_min"] <= out["repeat_max"]:
        raise ValueError("need 1 <= repeat_min <= repeat_max")
    if out["repeat_fraction"] > 0 and 1 + 2 * out["repeat_max"] > T:
        raise ValueError(f"1 + 2*repeat_max = {1 + 2 * out['repeat_max']} exceeds context_length {T}")
    if not 0.0 <= out["repeat_fraction"] <= 1.0:
        raise ValueError("repeat_fraction must be in [0, 1]")
    if not 0.0 <= out["fewshot_fraction"] <= 1.0:
        raise ValueError("fewshot_fraction must be in [0, 1]")
    if out["lr_schedule"] not in ("constant", "cosine"):
        raise ValueError(f"lr_schedule must be 'constant' or 'cosine', got {out['lr_schedule']!r}")
    out["optimizer_restarts"] = sorted(int(s) for s in (out["optimizer_restarts"] or []))
    return out


def build_model(cfg: dict, vocab_size: int, bos_id: int = 0, eos_id: int | None = None):
    """Fresh (randomly initialised, in the current torch RNG state) model for ``cfg``.

    ``architecture`` "gpt2" → ``GPT2LMHeadModel`` (tied embeddings), "gpt_neox" →
    ``GPTNeoXForCausalLM`` (parallel residual, rotary on ``rotary_pct`` of head dims, untied, as
    Pythia). All dropout is 0, attention is eager, max positions = ``context_length``.
    """
    from transformers import AutoModelForCausalLM, GPT2Config, GPTNeoXConfig

    arch = cfg.get("architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r}; expected one of {list(ARCHITECTURES)}")
    c = resolve_config(cfg)
    eos_id = bos_id if eos_id is None else eos_id
    if arch == "gpt2":
        conf = GPT2Config(
            vocab_size=int(vocab_size),
            n_positions=int(c["context_length"]),
            n_embd=int(c["d_model"]),
            n_layer=int(c["n_layer"]),
            n_head=int(c["n_head"]),
            n_inner=int(c["d_mlp"]),
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=int(bos_id),
            eos_token_id=int(eos_id),
            tie_word_embeddings=True if c["tie_embeddings"] is None else bool(c["tie_embeddings"]),
        )
    else:
        conf = GPTNeoXConfig(
            vocab_size=int(vocab_size),
            hidden_size=int(c["d_model"]),
            num_hidden_layers=int(c["n_layer"]),
            num_attention_heads=int(c["n_head"]),
            intermediate_size=int(c["d_mlp"]),
            max_position_embeddings=int(c["context_length"]),
            rope_parameters={
                "rope_type": "default",
                "rope_theta": float(c["rotary_base"]),
                "partial_rotary_factor": float(c["rotary_pct"]),
            },
            use_parallel_residual=True,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            classifier_dropout=0.0,
            bos_token_id=int(bos_id),
            eos_token_id=int(eos_id),
            tie_word_embeddings=False if c["tie_embeddings"] is None else bool(c["tie_embeddings"]),
        )
    conf._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(conf, attn_implementation="eager")
    model.config.use_cache = False
    return model
