"""Train tiny GPT-2 / GPT-NeoX models on CPU with log-spaced HF checkpoints.

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
steps               optimizer steps; checkpoints at :func:`checkpoint_steps` ``(steps)``
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
seed                seeds ``torch.manual_seed`` (init) and a numpy Generator (data)
induction_sequences number of test sequences for the per-checkpoint induction score
induction_every     also record max induction score / induction loss every this many steps
                    (``induction_curve`` in training.json, no checkpoint saved; 0: off)
eval_rows           fixed plain-text rows for the per-checkpoint ``text_loss``
==================  =========================================================================

Documents are tokenised without special tokens and joined into one stream with
``<|endoftext|>`` between documents; every row starts with BOS (docs/conventions.md).

Recipe notes (2 layers, d=128, 8 heads, T=64, batch 64, 4k BPE, Shakespeare train split, CPU):
masking the random first copy from the loss is what makes induction heads appear early; with it,
lr 3e-3 and beta2 0.95, a layer-1 head passes 0.3 at ~900 steps (gpt2) / ~1600 steps (gpt_neox,
rotary on all head dims) without optimizer restarts. The same setting without the mask showed no
induction by step 1100 (max 0.02); lr 1e-3 with beta2 0.999 needed a restart near 1600 steps.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from mfpipe.induction import induction_metrics

log = logging.getLogger(__name__)

ARCHITECTURES = ("gpt2", "gpt_neox")

DEFAULT_CONFIG: dict = {
    "name": "mini",
    "architecture": "gpt2",
    "n_layer": 2,
    "d_model": 128,
    "n_head": 8,
    "d_mlp": 64,
    "context_length": 64,
    "rotary_pct": 1.0,
    "rotary_base": 10000.0,
    "tie_embeddings": None,
    "steps": 1500,
    "batch_size": 64,
    "lr": 3e-3,
    "weight_decay": 0.01,
    "warmup_steps": 100,
    "lr_schedule": "constant",
    "min_lr_ratio": 0.1,
    "beta1": 0.9,
    "beta2": 0.95,
    "grad_clip": 1.0,
    "optimizer_restarts": [],
    "repeat_fraction": 0.75,
    "repeat_min": 8,
    "repeat_max": 31,
    "mask_first_copy": True,
    "seed": 0,
    "induction_sequences": 64,
    "induction_every": 100,
    "eval_rows": 32,
}


def checkpoint_steps(total_steps: int) -> list[int]:
    """Log-spaced checkpoint steps: ``0, 1, 2, 4, 8, ...`` (powers of two below ``total_steps``),
    then ``total_steps``. ``checkpoint_steps(0) == [0]``."""
    total = int(total_steps)
    if total < 0:
        raise ValueError(f"total_steps must be >= 0, got {total_steps}")
    steps = [0]
    p = 1
    while p < total:
        steps.append(p)
        p *= 2
    if total > 0:
        steps.append(total)
    return steps


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


# ----------------------------------------------------------------------------------------- data


class RowSampler:
    """Draws training rows (int64 ``[batch, T]``) and loss masks from a token stream."""

    def __init__(self, stream: np.ndarray, cfg: dict, vocab_size: int, special_ids, bos_id: int, rng):
        self.stream = stream
        self.T = int(cfg["context_length"])
        if stream.size < self.T:
            raise ValueError(f"training stream has {stream.size} tokens, fewer than context_length {self.T}")
        self.cfg = cfg
        special = {int(s) for s in special_ids}
        self.allowed = np.array([t for t in range(vocab_size) if t not in special], dtype=np.int64)
        self.bos = int(bos_id)
        self.rng = rng

    def text_rows(self, n: int, rng=None) -> np.ndarray:
        rng = self.rng if rng is None else rng
        L = self.T - 1
        starts = rng.integers(0, self.stream.size - L + 1, size=n)
        rows = np.empty((n, self.T), dtype=np.int64)
        rows[:, 0] = self.bos
        rows[:, 1:] = self.stream[starts[:, None] + np.arange(L)[None, :]]
        return rows

    def sample(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        cfg, rng, T = self.cfg, self.rng, self.T
        rows = self.text_rows(n)
        mask = np.ones((n, T), dtype=bool)  # mask[:, j]: token j is a loss target
        mask[:, 0] = False
        is_rep = rng.random(n) < float(cfg["repeat_fraction"])
        ks = rng.integers(int(cfg["repeat_min"]), int(cfg["repeat_max"]) + 1, size=n)
        for i in np.flatnonzero(is_rep):
            k = int(ks[i])
            r = self.allowed[rng.integers(0, self.allowed.size, size=k)]
            # keep the text tail: shift the text right by 2k and put [r, r] in front
            rows[i, 1 + 2 * k :] = rows[i, 1 : T - 2 * k]
            rows[i, 1 : 1 + k] = r
            rows[i, 1 + k : 1 + 2 * k] = r
            if cfg["mask_first_copy"]:
                mask[i, 1 : 1 + k] = False
        return rows, mask


def _token_stream(tokenizer, texts: Sequence[str], sep_id: int) -> np.ndarray:
    enc = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    parts = []
    for ids in enc:
        if ids:
            parts.append(np.asarray(ids, dtype=np.int32))
            parts.append(np.array([sep_id], dtype=np.int32))
    if not parts:
        raise ValueError("no training tokens")
    return np.concatenate(parts)


# ------------------------------------------------------------------------------------ training


def _lr_at(step: int, cfg: dict) -> float:
    """Learning rate used for optimizer step ``step`` (1-based)."""
    lr, warm, total = float(cfg["lr"]), int(cfg["warmup_steps"]), int(cfg["steps"])
    if warm > 0 and step <= warm:
        return lr * step / warm
    if cfg["lr_schedule"] == "cosine" and total > warm:
        frac = (step - warm) / max(1, total - warm)
        floor = float(cfg["min_lr_ratio"])
        return lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))
    return lr


def _make_optimizer(model, cfg: dict):
    import torch

    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": float(cfg["weight_decay"])},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups, lr=float(cfg["lr"]), betas=(float(cfg["beta1"]), float(cfg["beta2"])), foreach=False
    )


def _lm_loss(model, rows, mask):
    """Mean next-token cross entropy over target positions ``j >= 1`` with ``mask[:, j]``.

    Runs the base model and applies the LM head only to the positions that are targets, which
    avoids materialising (and back-propagating through) the full ``[B, T, V]`` logits.
    """
    import torch.nn.functional as F

    hidden = model.base_model(input_ids=rows, use_cache=False).last_hidden_state
    sel = mask[:, 1:]
    h = hidden[:, :-1][sel]
    logits = model.get_output_embeddings()(h)
    return F.cross_entropy(logits.float(), rows[:, 1:][sel])


def _save_quietly(model, tok, d: Path) -> None:
    """``save_pretrained`` (safetensors) of model and tokenizer without transformers' per-save
    progress bar, which would drown the training bar."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(str(d))
        tok.save_pretrained(str(d))
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _commit(tmp: Path, out: Path, names: Sequence[str]) -> None:
    """Move the finished outputs from ``tmp`` to ``out`` (an atomic rename when ``out`` is absent
    or empty; otherwise each output is replaced, ``training.json`` last)."""
    if out.exists() and out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    if not out.exists():
        os.replace(tmp, out)
        return
    for name in names:
        src, dst = tmp / name, out / name
        if dst.is_dir() and not dst.is_symlink():
            shutil.rmtree(dst)
        elif dst.exists() or dst.is_symlink():
            dst.unlink()
        os.replace(src, dst)
    shutil.rmtree(tmp, ignore_errors=True)


def train_mini_model(
    cfg: dict,
    tokenizer_dir: str | os.PathLike,
    train_texts: Sequence[str],
    out_dir: str | os.PathLike,
    threads: int | None = None,
    progress: bool = True,
) -> dict:
    """Train one mini model on ``train_texts`` and write its outputs into ``out_dir``.

    Writes ``out_dir/checkpoints/step<k>/`` (a standalone HF model dir: config, safetensors
    weights, tokenizer files) for every ``k`` in ``checkpoint_steps(cfg["steps"])``,
    ``out_dir/induction.csv`` (model, step, layer, head, score: every head at every checkpoint,
    :func:`mfpipe.induction.induction_scores` with ``k = (context_length - 1) // 2``) and
    ``out_dir/training.json`` (``model``, resolved ``cfg``, ``vocab_size``, ``n_params``,
    ``train_tokens``, ``threads``, ``checkpoint_steps``, ``checkpoints``: per checkpoint
    ``step``, ``train_loss`` (mean training loss since the previous checkpoint; None at step 0),
    ``text_loss`` (fixed plain-text rows), ``induction_loss`` (second-copy loss on the induction
    test sequences), ``max_induction`` (+ its layer/head), ``elapsed_s``; ``induction_curve``:
    ``step``, ``max_induction``, ``induction_loss`` at every checkpoint and every
    ``induction_every`` steps; then ``final_max_induction``, ``wall_time_s``, ``cpu_time_s``).

    Everything is written into a temporary sibling directory first and moved into place only on
    success (one rename when ``out_dir`` is absent or empty; if it holds other files, only the
    three outputs are replaced). ``threads`` sets ``torch.set_num_threads`` for the run (default:
    all cores; restored afterwards). Training is deterministic given ``cfg["seed"]`` and the
    thread count. Returns the ``training.json`` dict.
    """
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    from mfpipe.models.adapters import get_adapter

    c = resolve_config(cfg)
    t_start = time.perf_counter()
    cpu_start = time.process_time()
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()

    prev_threads = torch.get_num_threads()
    n_threads = int(threads) if threads else (os.cpu_count() or 1)
    torch.set_num_threads(n_threads)
    try:
        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        vocab_size = len(tok)
        bos_id = tok.bos_token_id if tok.bos_token_id is not None else 0
        eos_id = tok.eos_token_id if tok.eos_token_id is not None else bos_id
        special_ids = sorted(set(tok.all_special_ids) | {bos_id, eos_id})

        stream = _token_stream(tok, train_texts, eos_id)
        log.info("%s: %d training tokens from %d texts", c["name"], stream.size, len(train_texts))

        torch.manual_seed(int(c["seed"]))
        model = build_model(c, vocab_size, bos_id=bos_id, eos_id=eos_id)
        model.train()
        # one adapter for every probe: the induction probe reads attention through its traced site
        adapter = get_adapter(model)
        n_params = sum(p.numel() for p in model.parameters())
        data_rng = np.random.default_rng(int(c["seed"]))
        sampler = RowSampler(stream, c, vocab_size, special_ids, bos_id, data_rng)
        eval_rows = torch.from_numpy(sampler.text_rows(int(c["eval_rows"]), np.random.default_rng(12345)))
        eval_mask = torch.ones_like(eval_rows, dtype=torch.bool)
        opt = _make_optimizer(model, c)

        ckpt_steps = checkpoint_steps(int(c["steps"]))
        ckpt_dir = tmp / "checkpoints"
        ckpt_dir.mkdir()
        records: list[dict] = []
        ind_rows: list[tuple] = []
        window_losses: list[float] = []

        curve: list[dict] = []

        def probe(step: int) -> tuple[np.ndarray, float]:
            scores, icl_loss = induction_metrics(
                adapter,
                vocab_size,
                special_ids,
                int(c["context_length"]),
                n_sequences=int(c["induction_sequences"]),
                seed=0,
                bos_id=bos_id,
            )
            model.train()
            curve.append({"step": step, "max_induction": float(scores.max()), "induction_loss": icl_loss})
            return scores, icl_loss

        def checkpoint(step: int) -> None:
            model.eval()
            with torch.no_grad():
                text_loss = float(_lm_loss(model, eval_rows, eval_mask))
            scores, icl_loss = probe(step)
            d = ckpt_dir / f"step{step}"
            _save_quietly(model, tok, d)
            for layer in range(scores.shape[0]):
                for head in range(scores.shape[1]):
                    ind_rows.append((c["name"], step, layer, head, float(scores[layer, head])))
            li, hi = np.unravel_index(int(np.argmax(scores)), scores.shape)
            rec = {
                "step": step,
                "train_loss": float(np.mean(window_losses)) if window_losses else None,
                "text_loss": text_loss,
                "induction_loss": icl_loss,
                "max_induction": float(scores.max()),
                "max_induction_layer": int(li),
                "max_induction_head": int(hi),
                "elapsed_s": round(time.perf_counter() - t_start, 3),
            }
            window_losses.clear()
            records.append(rec)
            log.info(
                "%s step %d: train_loss %s text_loss %.3f induction_loss %.3f max induction %.3f (L%dH%d)",
                c["name"], step, "-" if rec["train_loss"] is None else f"{rec['train_loss']:.3f}",
                text_loss, icl_loss, rec["max_induction"], li, hi,
            )

        checkpoint(0)
        restarts = set(c["optimizer_restarts"])
        bar = tqdm(
            range(1, int(c["steps"]) + 1),
            desc=f"train {c['name']}",
            disable=not progress,
            mininterval=2.0,
            dynamic_ncols=True,
        )
        for step in bar:
            rows, mask = sampler.sample(int(c["batch_size"]))
            rows_t, mask_t = torch.from_numpy(rows), torch.from_numpy(mask)
            lr = _lr_at(step, c)
            for g in opt.param_groups:
                g["lr"] = lr
            loss = _lm_loss(model, rows_t, mask_t)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if c["grad_clip"]:
                torch.nn.utils.clip_grad_norm_(model.parameters(), float(c["grad_clip"]))
            opt.step()
            lv = float(loss.detach())
            if not math.isfinite(lv):
                raise FloatingPointError(f"{c['name']}: loss is {lv} at step {step}")
            window_losses.append(lv)
            if step % 50 == 0:
                bar.set_postfix(loss=f"{lv:.3f}", refresh=False)
            if step in restarts:
                opt = _make_optimizer(model, c)
            if step in ckpt_steps:
                checkpoint(step)
            elif c["induction_every"] and step % int(c["induction_every"]) == 0:
                probe(step)
        bar.close()

        with open(tmp / "induction.csv", "w") as f:
            f.write("model,step,layer,head,score\n")
            for name, step, layer, head, score in ind_rows:
                f.write(f"{name},{step},{layer},{head},{score:.6f}\n")
        wall = time.perf_counter() - t_start
        summary = {
            "model": c["name"],
            "cfg": c,
            "vocab_size": vocab_size,
            "n_params": int(n_params),
            "train_tokens": int(stream.size),
            "threads": n_threads,
            "checkpoint_steps": ckpt_steps,
            "checkpoints": records,
            "induction_curve": curve,
            "final_max_induction": records[-1]["max_induction"],
            "wall_time_s": round(wall, 3),
            "cpu_time_s": round(time.process_time() - cpu_start, 3),
        }
        with open(tmp / "training.json", "w") as f:
            json.dump(summary, f, indent=2)
        _commit(tmp, out, ["checkpoints", "induction.csv", "training.json"])
        log.info("%s: done in %.1f s, final max induction %.3f", c["name"], wall, summary["final_max_induction"])
        return summary
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        torch.set_num_threads(prev_threads)
