#!/usr/bin/env python
"""Benchmark: the J-lens's backward passes through a 16-bit model on a CPU, with the linear layers' input gradients
in float32 (`mfpipe.models.adapters.backward16.fast_input_grads`, what `position_jacobians` runs since issue 58)
against the model's own bfloat16 backward, on the same positions; and the matrix products behind the difference.

    PYTHONPATH=src python benchmarks/backward16.py --config /tmp/preset-shapes/models--google--gemma-2-2b/snapshots/*/config.json \
        --layers 2 --rows 128 --threads 2

A model of ``--config``'s shape (a ``config.json``: benchmarks/preset_shapes.py writes the presets'), cut to
``--layers`` layers, random weights in ``--dtype``, eager attention, one window of ``--context-length`` Zipf tokens
and one position at its middle: ``position_jacobians(..., rows=K)`` (K backward passes, ``--grad-chunk`` batched)
timed ``--repeats`` times each form, alternately; the script prints each time, the medians, their ratio and the
seconds a backward pass costs beyond the position's forwards (the difference of K and K/4 rows). The products:
GFLOP/s of ``x @ W.T`` (a forward), ``g @ W`` (a backward to the input, the model's bfloat16 kernel) and ``g @ W``
in float32 (both widened), at a weight of the model's MLP's shape, for 16 and 64 rows.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stats_pass import zipf_windows  # noqa: E402


def build(config: Path, layers: int, dtype: torch.dtype):
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(str(config.parent if config.is_file() else config))
    text = getattr(cfg, "text_config", None) or cfg
    text.num_hidden_layers = layers
    if getattr(text, "layer_types", None):
        text.layer_types = text.layer_types[:layers]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval().requires_grad_(False)
    model.config._attn_implementation = "eager"
    return model


def rate(fn, flops: float, seconds: float = 1.0) -> float:
    fn()
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    return flops / ((time.perf_counter() - t0) / n) / 1e9


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, required=True, help="a model's config.json (or its folder)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    ap.add_argument("--context-length", type=int, default=512)
    ap.add_argument("--rows", type=int, default=128, help="backward passes timed (of d)")
    ap.add_argument("--grad-chunk", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)

    from mfpipe.models.adapters import get_adapter
    from mfpipe.models.adapters import jacobian as JJ
    from mfpipe.workflow.numerics import pin_torch

    pin_torch(args.threads)
    dtype = getattr(torch, args.dtype)
    model = build(args.config, args.layers, dtype)
    adapter = get_adapter(model)
    V = model.config.get_text_config().vocab_size
    windows, _ = zipf_windows(V, 1, args.context_length, 0, seed=0)
    ids, pos = torch.from_numpy(windows[:1]), [args.context_length // 2]
    print(f"{args.config}: {adapter.model_type}, {args.layers} layers, d={adapter.d_model}, {args.dtype}; T="
          f"{args.context_length}, position {pos[0]}; torch threads {torch.get_num_threads()}")
    fast = JJ.fast_input_grads
    own = lambda model: contextlib.nullcontext()  # noqa: E731

    def timed(form, rows):
        JJ.fast_input_grads = fast if form == "float32" else own
        try:
            t0 = time.perf_counter()
            JJ.position_jacobians(adapter, ids, pos, grad_chunk=args.grad_chunk, rows=rows)
            return time.perf_counter() - t0
        finally:
            JJ.fast_input_grads = fast

    times = {"float32": [], "own": []}
    few = {"float32": [], "own": []}
    for _ in range(args.repeats):
        for form in times:
            times[form].append(timed(form, args.rows))
            few[form].append(timed(form, max(1, args.rows // 4)))
            print(f"  {form:8s} {args.rows} rows {times[form][-1]:.2f} s, {max(1, args.rows // 4)} rows "
                  f"{few[form][-1]:.2f} s", flush=True)
    med = {f: statistics.median(t) for f, t in times.items()}
    per = {f: (med[f] - statistics.median(few[f])) / (args.rows - max(1, args.rows // 4)) for f in times}
    print(f"median of {args.repeats}: float32 input gradients {med['float32']:.2f} s, the model's own backward "
          f"{med['own']:.2f} s ({med['own'] / med['float32']:.1f}x); a backward pass beyond the forwards "
          f"{per['float32'] * 1e3:.1f} ms vs {per['own'] * 1e3:.1f} ms ({per['own'] / per['float32']:.1f}x)")

    mlp = next(m for m in model.modules() if type(m) is torch.nn.Linear and m.weight.shape[0] > adapter.d_model)
    W = mlp.weight.detach()
    for M in (16, 64):
        x, g = torch.randn(M, W.shape[1], dtype=dtype), torch.randn(M, W.shape[0], dtype=dtype)
        fl = 2.0 * M * W.numel()
        print(f"products at W {tuple(W.shape)}, {M} rows (GFLOP/s): x @ W.T {rate(lambda: x @ W.T, fl):.1f}, "
              f"g @ W {rate(lambda: g @ W, fl):.1f}, g @ W in float32 "
              f"{rate(lambda: g.float() @ W.float(), fl):.1f}")


if __name__ == "__main__":
    main()
