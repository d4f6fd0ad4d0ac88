"""Train tiny GPT-2 / GPT-NeoX models on CPU with log-spaced HF checkpoints.

The model config and its keys: :mod:`mfpipe.minisuite.model`; the training rows: :mod:`mfpipe.minisuite.data`.

Documents are tokenised without special tokens and joined into one stream with
``<|endoftext|>`` between documents; every row starts with BOS (docs/conventions.md).

Recipe notes (2 layers, d=128, 8 heads, T=64, batch 64, 4k BPE, Shakespeare train split, CPU):
masking the random first copy from the loss is what makes induction heads appear early; with it,
lr 3e-3 and beta2 0.95, a layer-1 head passes 0.3 at ~900 steps (gpt2) / ~1600 steps (gpt_neox,
rotary on all head dims) without optimizer restarts. The same setting without the mask showed no
induction by step 1100 (max 0.02); lr 1e-3 with beta2 0.999 needed a restart near 1600 steps.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from mfpipe.workflow.io import atomic_dir
from mfpipe.minisuite.data import RowSampler, token_stream
from mfpipe.minisuite.model import (
    build_model,
    resolve_config,
)
from mfpipe.minisuite.tasks import fewshot_accuracy, task_token_pairs, zeroshot_accuracy
from mfpipe.models.induction import induction_metrics
from mfpipe.workflow.numerics import TRAIN_THREADS, numerics_info
from mfpipe.workflow.numerics import pinned as pinned_numerics
from mfpipe.workflow.revisions import checkpoint_steps, step_name

log = logging.getLogger(__name__)

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


def train_mini_model(
    cfg: dict,
    tokenizer_dir: str | os.PathLike,
    train_texts: Sequence[str],
    out_dir: str | os.PathLike,
    threads: int | None = None,
    progress: bool = True,
    tasks: Sequence[dict] | None = None,
    pinned: bool = True,
) -> dict:
    """Train one mini model on ``train_texts`` and write its outputs into ``out_dir``.

    Writes ``out_dir/checkpoints/step<k>/`` (a standalone HF model dir: config, safetensors
    weights, tokenizer files) for every ``k`` in ``checkpoint_steps(cfg["steps"], cfg["linear_checkpoints"])``,
    ``out_dir/induction.csv`` (model, step, layer, head, score: every head at every checkpoint,
    :func:`mfpipe.models.induction.induction_scores` with ``k = (context_length - 1) // 2``) and
    ``out_dir/training.json`` (``model``, resolved ``cfg``, ``vocab_size``, ``n_params``,
    ``train_tokens``, ``threads``, ``numerics`` (:func:`mfpipe.workflow.numerics.numerics_info`), ``checkpoint_steps``, ``checkpoints``: per checkpoint
    ``step``, ``train_loss`` (mean training loss since the previous checkpoint; None at step 0),
    ``text_loss`` (fixed plain-text rows), ``induction_loss`` (second-copy loss on the induction
    test sequences), ``max_induction`` (+ its layer/head), ``elapsed_s``; ``induction_curve``:
    ``step``, ``max_induction``, ``induction_loss`` at every checkpoint and every
    ``induction_every`` steps; then ``final_max_induction``, ``wall_time_s``, ``cpu_time_s``).

    Everything is written into a temporary sibling directory first and moved into place only on
    success (:func:`mfpipe.workflow.io.atomic_dir`: one rename when ``out_dir`` is absent or empty; if it holds other
    files, only the three outputs are replaced, ``training.json`` last). ``pinned`` (default): the run is on pinned
    numerics with one thread (:func:`mfpipe.workflow.numerics.pinned`; ``threads`` is ignored), the same bits on every
    x86-64 machine with AVX2 and the same torch build, provided the process had not run a torch kernel before it
    (else a warning says what is not pinned: the bits are then the machine's own). Not ``pinned``: ``threads`` sets
    ``torch.set_num_threads`` (default: all cores), and the run is deterministic given ``cfg["seed"]``, the thread
    count and the machine's code paths. Both restore the thread count afterwards. ``tasks``: the few-shot tasks (:func:`mfpipe.minisuite.tasks.make_tasks` dicts) of the
    few-shot rows, needed when ``cfg["fewshot_fraction"] > 0``; then ``training.json`` also holds ``fewshot``:
    per checkpoint ``step``, ``n_shots`` (5, fewer where the context is too short) and per task
    ``fewshot_accuracy`` (128 prompts) / ``zeroshot_accuracy`` (every pair)
    (:func:`mfpipe.minisuite.tasks.fewshot_accuracy`). Returns the ``training.json`` dict.
    """
    c = resolve_config(cfg)
    t_start = time.perf_counter()
    cpu_start = time.process_time()
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_dir(out, entries=("checkpoints", "induction.csv", "training.json")) as tmp:
        if not pinned:
            return _train(c, tokenizer_dir, train_texts, tmp, threads, progress, t_start, cpu_start, tasks)
        with pinned_numerics(TRAIN_THREADS):
            return _train(c, tokenizer_dir, train_texts, tmp, TRAIN_THREADS, progress, t_start, cpu_start, tasks)


def _train(c: dict, tokenizer_dir, train_texts: Sequence[str], tmp: Path, threads, progress: bool, t_start: float,
           cpu_start: float, tasks: Sequence[dict] | None = None) -> dict:
    """The training run of :func:`train_mini_model`, writing into the temporary folder ``tmp``."""
    import torch

    prev_threads = torch.get_num_threads()
    n_threads = int(threads) if threads else (os.cpu_count() or 1)
    torch.set_num_threads(n_threads)
    try:
        run = _TrainingRun(c, tokenizer_dir, train_texts, tmp, t_start, tasks)
        run.checkpoint(0)
        run.optimize(progress)
        return run.write_outputs(n_threads, cpu_start)
    finally:
        torch.set_num_threads(prev_threads)


class _TrainingRun:
    """One run of :func:`_train` in its steps: the setup (tokenizer, model, rows, optimizer), the checkpoints with
    their probes, the optimization loop and the outputs. The setup's order is the run's random-number order: the
    torch seed is set right before the model's initialization."""

    def __init__(self, c: dict, tokenizer_dir, train_texts: Sequence[str], tmp: Path, t_start: float,
                 tasks: Sequence[dict] | None):
        import torch
        from transformers import AutoTokenizer

        from mfpipe.models.adapters import get_adapter

        self.c, self.tmp, self.t_start, self.tasks = c, tmp, t_start, tasks
        self.tok = tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        self.vocab_size = len(tok)
        self.bos_id = tok.bos_token_id if tok.bos_token_id is not None else 0
        eos_id = tok.eos_token_id if tok.eos_token_id is not None else self.bos_id
        self.special_ids = sorted(set(tok.all_special_ids) | {self.bos_id, eos_id})

        self.stream = token_stream(tok, train_texts, eos_id)
        log.info("%s: %d training tokens from %d texts", c["name"], self.stream.size, len(train_texts))

        torch.manual_seed(int(c["seed"]))
        self.model = build_model(c, self.vocab_size, bos_id=self.bos_id, eos_id=eos_id)
        self.model.train()
        # one adapter for every probe: the induction probe reads attention through its traced site
        self.adapter = get_adapter(self.model)
        self.n_params = sum(p.numel() for p in self.model.parameters())
        data_rng = np.random.default_rng(int(c["seed"]))
        self.use_tasks = float(c["fewshot_fraction"]) > 0
        if self.use_tasks and not tasks:
            raise ValueError(f"{c['name']}: fewshot_fraction {c['fewshot_fraction']} needs the few-shot tasks")
        fewshot = task_token_pairs(tok, tasks) if self.use_tasks else None
        # the accuracy prompts BOS x1:y1\n…xq: fit the context: five exemplars, fewer in a short one
        self.n_shots = max(1, min(5, (int(c["context_length"]) - 3) // 4))
        self.sampler = RowSampler(self.stream, c, self.vocab_size, self.special_ids, self.bos_id, data_rng,
                                  fewshot=fewshot)
        self.eval_rows = torch.from_numpy(self.sampler.text_rows(int(c["eval_rows"]), np.random.default_rng(12345)))
        self.eval_mask = torch.ones_like(self.eval_rows, dtype=torch.bool)
        self.opt = _make_optimizer(self.model, c)

        self.ckpt_steps = checkpoint_steps(int(c["steps"]), c["linear_checkpoints"])
        self.ckpt_dir = tmp / "checkpoints"
        self.ckpt_dir.mkdir()
        self.records: list[dict] = []
        self.ind_rows: list[tuple] = []
        self.window_losses: list[float] = []
        self.curve: list[dict] = []
        self.fs_records: list[dict] = []

    def probe(self, step: int) -> tuple[np.ndarray, float]:
        """The induction scores and loss at ``step``, appended to the induction curve."""
        c = self.c
        scores, icl_loss = induction_metrics(
            self.adapter,
            self.vocab_size,
            self.special_ids,
            int(c["context_length"]),
            n_sequences=int(c["induction_sequences"]),
            seed=0,
            bos_id=self.bos_id,
        )
        self.model.train()
        self.curve.append({"step": step, "max_induction": float(scores.max()), "induction_loss": icl_loss})
        return scores, icl_loss

    def checkpoint(self, step: int) -> None:
        """The checkpoint of ``step``: evaluate, probe, save, and record (the few-shot accuracies where trained)."""
        import torch

        c = self.c
        self.model.eval()
        with torch.no_grad():
            text_loss = float(_lm_loss(self.model, self.eval_rows, self.eval_mask))
        scores, icl_loss = self.probe(step)
        _save_quietly(self.model, self.tok, self.ckpt_dir / step_name(step))
        for layer in range(scores.shape[0]):
            for head in range(scores.shape[1]):
                self.ind_rows.append((c["name"], step, layer, head, float(scores[layer, head])))
        li, hi = np.unravel_index(int(np.argmax(scores)), scores.shape)
        rec = {
            "step": step,
            "train_loss": float(np.mean(self.window_losses)) if self.window_losses else None,
            "text_loss": text_loss,
            "induction_loss": icl_loss,
            "max_induction": float(scores.max()),
            "max_induction_layer": int(li),
            "max_induction_head": int(hi),
            "elapsed_s": round(time.perf_counter() - self.t_start, 3),
        }
        self.window_losses.clear()
        self.records.append(rec)
        if self.use_tasks:
            self._fewshot_record(step)
        log.info(
            "%s step %d: train_loss %s text_loss %.3f induction_loss %.3f max induction %.3f (L%dH%d)",
            c["name"], step, "-" if rec["train_loss"] is None else f"{rec['train_loss']:.3f}",
            text_loss, icl_loss, rec["max_induction"], li, hi,
        )

    def _fewshot_record(self, step: int) -> None:
        """Every task's few-shot and zero-shot accuracy at ``step``."""
        model, tok, tasks, n_shots = self.model, self.tok, self.tasks, self.n_shots
        fs = {"step": step, "n_shots": n_shots}
        for t in tasks:
            fs[t["name"]] = {"fewshot_accuracy": fewshot_accuracy(model, tok, t, n_shots=n_shots,
                                                                  n_prompts=128, seed=0),
                             "zeroshot_accuracy": zeroshot_accuracy(model, tok, t)}
        self.fs_records.append(fs)
        model.train()
        log.info("%s step %d: few-shot / zero-shot accuracy %s", self.c["name"], step, ", ".join(
            f"{t['name']} {fs[t['name']]['fewshot_accuracy']:.2f} / {fs[t['name']]['zeroshot_accuracy']:.2f}"
            for t in tasks))

    def optimize(self, progress: bool) -> None:
        """The optimizer steps 1..``steps``, with the restarts, checkpoints and induction probes on their steps."""
        import torch
        from tqdm.auto import tqdm

        c, model = self.c, self.model
        restarts = set(c["optimizer_restarts"])
        bar = tqdm(
            range(1, int(c["steps"]) + 1),
            desc=f"train {c['name']}",
            disable=not progress,
            mininterval=2.0,
            dynamic_ncols=True,
        )
        for step in bar:
            rows, mask = self.sampler.sample(int(c["batch_size"]), step)
            rows_t, mask_t = torch.from_numpy(rows), torch.from_numpy(mask)
            lr = _lr_at(step, c)
            for g in self.opt.param_groups:
                g["lr"] = lr
            loss = _lm_loss(model, rows_t, mask_t)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            if c["grad_clip"]:
                torch.nn.utils.clip_grad_norm_(model.parameters(), float(c["grad_clip"]))
            self.opt.step()
            lv = float(loss.detach())
            if not math.isfinite(lv):
                raise FloatingPointError(f"{c['name']}: loss is {lv} at step {step}")
            self.window_losses.append(lv)
            if step % 50 == 0:
                bar.set_postfix(loss=f"{lv:.3f}", refresh=False)
            if step in restarts:
                self.opt = _make_optimizer(model, c)
            if step in self.ckpt_steps:
                self.checkpoint(step)
            elif c["induction_every"] and step % int(c["induction_every"]) == 0:
                self.probe(step)
        bar.close()

    def write_outputs(self, n_threads: int, cpu_start: float) -> dict:
        """``induction.csv`` and ``training.json`` (the summary, returned)."""
        c, tmp = self.c, self.tmp
        with open(tmp / "induction.csv", "w") as f:
            f.write("model,step,layer,head,score\n")
            for name, step, layer, head, score in self.ind_rows:
                f.write(f"{name},{step},{layer},{head},{score:.6f}\n")
        wall = time.perf_counter() - self.t_start
        summary = {
            "model": c["name"],
            "cfg": c,
            "vocab_size": self.vocab_size,
            "n_params": int(self.n_params),
            "train_tokens": int(self.stream.size),
            "threads": n_threads,
            "numerics": numerics_info(),
            "checkpoint_steps": self.ckpt_steps,
            "checkpoints": self.records,
            "induction_curve": self.curve,
            "final_max_induction": self.records[-1]["max_induction"],
            **({"fewshot": self.fs_records} if self.use_tasks else {}),
            "wall_time_s": round(wall, 3),
            "cpu_time_s": round(time.process_time() - cpu_start, 3),
        }
        with open(tmp / "training.json", "w") as f:
            json.dump(summary, f, indent=2)
        log.info("%s: done in %.1f s, final max induction %.3f", c["name"], wall, summary["final_max_induction"])
        return summary
