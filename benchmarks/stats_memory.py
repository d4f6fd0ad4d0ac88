#!/usr/bin/env python
"""The statistics job's peak memory at a preset's real shape (issue 49, item 5): what the ``stats_shard`` job does
(pass 1 over a few batches, the partial written with its derived sums made a layer at a time), on a depth-truncated
random model built from the preset model's ``config.json`` (its published width, heads, vocabulary; the preset's N,
T and batch), in a process of its own at each of ``--depths`` layers. The job's rise over the loaded model is a
line in the depth (least squares): its slope is what each layer adds (the reducer's sums of that layer, counted
beside it from the accumulators' shapes), its intercept what does not grow with depth (one layer's activations, the
batch's plan and work buffers, one block of derived sums being written). The peak at full depth: the process before
the model, the weights at the model's width and that line at the model's depth.

    python benchmarks/preset_shapes.py /tmp/preset-shapes
    HF_HUB_CACHE=/tmp/preset-shapes HF_HUB_OFFLINE=1 python benchmarks/stats_memory.py gemma-2-2b llama-3.2-3b \\
        olmo-2-7b qwen3-14b [--n-tracked N] [--depths 1 2 3] [--device cuda] [--out results.json]

Random 16-bit weights the structural probe cannot place are run in float32 (as `mfpipe estimate` does); their
weights then count at the model's own width, and their activations at float32's (an overestimate). On a GPU
(``--device cuda``) the device's peak is measured too, the same way.
"""

from __future__ import annotations

import argparse
import json
from functools import partial
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30


def _child(args) -> None:
    """One measurement: build, pass 1 over the windows, write the partial; print the stages' rises (bytes)."""
    import numpy as np
    import torch
    import transformers

    from mfpipe.estimate import calibrate as cal
    from mfpipe.models.loader import resolve_location
    from mfpipe.stats import pass1 as P1
    from mfpipe.stats.partials import partial_meta, save_partial
    from mfpipe.stats.shards import accumulate_shard, pass1_reducer
    from mfpipe.workflow.heap import keep_freed_memory
    from mfpipe.workflow.numerics import pin_torch

    keep_freed_memory()
    pin_torch(2)
    spec, config = json.loads(args.spec), json.loads(args.config)
    path, rev = resolve_location(spec, "main", "results")
    cfg = transformers.AutoConfig.from_pretrained(path, revision=rev)
    layers = int(cfg.num_hidden_layers)
    cfg.num_hidden_layers = args.depth
    for key in ("layer_types", "block_types"):
        if isinstance(getattr(cfg, key, None), list):
            setattr(cfg, key, getattr(cfg, key)[: args.depth])
    base = cal._rss_mb() * 2**20
    torch.manual_seed(0)
    dtype = getattr(torch, spec["dtype"])
    model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype).eval().requires_grad_(False)
    model.config._attn_implementation = "eager"
    model, adapter, source = cal._adapter(model, "random weights")
    width = 0.5 if "float32" in source else 1.0  # weights timed in float32 count at the model's 16-bit width
    size = lambda ps: sum(p.numel() * p.element_size() for p in ps)  # noqa: E731
    layer_bytes = sum(size(adapter.block_module(l).parameters()) for l in range(adapter.n_layers)) / args.depth
    weights = size(model.parameters())
    T, B, N = int(config["T"]), int(config["batch_size"]), int(config["n_tracked"])
    V = int(cfg.vocab_size)
    bos = cfg.bos_token_id if cfg.bos_token_id is not None else V - 1
    windows, perm = cal._zipf(V, B * args.batches, T, int(bos))
    tracked = cal._tracked(windows, perm, N, int(bos), V)
    device = args.device
    model = model.to(device)
    held = cal._rss_mb() * 2**20
    peaks = cal._Peaks()
    kernel_tmp = tempfile.TemporaryDirectory() if args.kernel_sums == "disk" else None  # stats.kernel_sums: disk
    reducer = partial(pass1_reducer, lazy_derived=True,  # as the stats_shard job (mfpipe.stats.shards.shard_partials)
                      kernel_dir=kernel_tmp.name if kernel_tmp else None)
    # the batch's kernel sums of all layers are kept for one add per batch up to DEFERRED_SUMS_MAX bytes: scaled by
    # depth / layers, the cut model keeps them exactly where the whole model would, at depth / layers of their size
    P1.DEFERRED_SUMS_MAX = int(P1.DEFERRED_SUMS_MAX * args.depth / layers)

    def job():
        sums = accumulate_shard(model, adapter, windows, tracked, batch_size=B, progress=False, reducer=reducer)
        meta = partial_meta(tracked, windows, {"model": spec["name"], "revision": "main"})
        with tempfile.TemporaryDirectory() as tmp:
            save_partial(Path(tmp) / "p.zarr", sums, meta, mantissa_bits=config["mantissa_bits"])
        # the accumulators: the sums the reducer holds whole (the derived ones are made a layer at a time)
        return sum(v.nbytes for v in sums.values() if isinstance(v, np.ndarray))

    anon = _AnonPeak()
    held_sums = peaks("job", lambda: anon(job))
    device_peak = torch.cuda.max_memory_allocated() if device.startswith("cuda") else None
    print("MFPIPE-STATS-MEMORY " + json.dumps({
        "source": source, "layers": layers, "depth": args.depth, "heads": adapter.n_heads, "d_model": adapter.d_model,
        "d_head": adapter.d_head, "N": N, "T": T, "batch_size": B, "base": base, "held": held,
        "weights": weights, "weights_at_width": weights * width, "layer_weights_at_width": layer_bytes * width,
        "rise": peaks.rise["job"] * 2**20, "device_peak": device_peak, "sums_bytes": int(held_sums),
        "kernel_sums": args.kernel_sums, "anon_before": anon.before, "anon_peak": anon.peak,
    }))


class _AnonPeak:
    """The peak of the process's anonymous resident memory (RssAnon, Linux) while a call runs, sampled every 5 ms: the
    memory a job must have, whatever of a mapped file the page cache holds beside it (counted in RSS, but the
    system's to write back and drop)."""

    def __init__(self):
        self.before = self.peak = self._now()

    @staticmethod
    def _now() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
        return 0

    def __call__(self, fn):
        import threading
        import time

        done = threading.Event()

        def sample():
            while not done.is_set():
                self.peak = max(self.peak, self._now())
                time.sleep(0.005)

        t = threading.Thread(target=sample, daemon=True)
        self.before = self.peak = self._now()
        t.start()
        try:
            return fn()
        finally:
            done.set()
            t.join()


def _measure(spec: dict, config: dict, depth: int, args) -> dict:
    cmd = [sys.executable, __file__, "--child", "--depth", str(depth), "--spec", json.dumps(spec),
           "--config", json.dumps(config), "--device", args.device, "--batches", str(args.batches),
           "--kernel-sums", args.kernel_sums]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("MFPIPE-STATS-MEMORY ")), None)
    if line is None:
        raise SystemExit(f"{spec['name']} at {depth} layer(s) failed:\n{out.stderr[-3000:]}")
    return json.loads(line.split(" ", 1)[1])


def _preset(name: str, n_tracked: int | None) -> tuple[dict, dict]:
    import yaml

    cfg = yaml.safe_load((ROOT / "config" / "presets" / f"{name}.yaml").read_text())
    spec = dict(cfg["models"][0])
    spec["dtype"] = spec.get("dtype") or cfg["runtime"]["dtype"]
    bits = (cfg.get("stats") or {}).get("partial_mantissa_bits")
    return spec, {"T": cfg["corpus"]["context_length"], "batch_size": cfg["runtime"]["batch_size"],
                  "n_tracked": n_tracked or cfg["tracked"]["n_tracked"], "mantissa_bits": bits}


def line(xs, ys) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through the points."""
    import numpy as np

    slope, intercept = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return float(intercept), float(slope)


def scaled(runs: list[dict]) -> dict:
    """The stats job's peak at full depth (bytes) from its runs at several depths: the process before the model, the
    weights at the model's width (the layers' scaled) and the job's rise as intercept + slope x layers; the reducer's
    sums per layer counted from the accumulators beside the slope."""
    one = runs[0]
    L = one["layers"]
    weights = one["weights_at_width"] + one["layer_weights_at_width"] * (L - one["depth"])
    a, b = line([r["depth"] for r in runs], [r["rise"] for r in runs])
    N = one["N"]
    _, sums_per_layer = line([r["depth"] for r in runs], [r["sums_bytes"] for r in runs])
    device = None
    if one["device_peak"] is not None:
        da, db = line([r["depth"] for r in runs], [r["device_peak"] - r["weights"] for r in runs])
        device = weights + da + db * L
    kernel = L * one["heads"] * N * (N + 2) * 4  # the kernel sums, what stats.kernel_sums: disk maps from a file
    # the line's slope moves with the C heap's layout (glibc keeps freed blocks for the next batch: benchmarks/HISTORY,
    # "Pass 1") by ~100 MiB a layer from run to run, which 30 layers make GiBs; the deepest run with the accumulators'
    # own growth per layer (counted exactly) moves only with that run's peak: it is the peak, the line a check
    deep = max(runs, key=lambda r: r["depth"])
    # a 16-bit model run in float32 derives its mlp_out sums from the residual's; the 16-bit model sums them, one more
    # float64 [K, d] a layer (Adapter.mlp_out_from_resid)
    extra = (N + 2) * one["d_model"] * 8 if "float32" in one["source"] else 0
    sums_per_layer += extra
    counted = one["base"] + weights + deep["rise"] + sums_per_layer * (L - deep["depth"]) + extra * deep["depth"]
    line_peak = one["base"] + weights + a + (b + extra) * L
    peak = counted
    return {"layers": L, "weights": weights, "intercept": a, "per_layer": b + extra, "sums_per_layer": sums_per_layer,
            "rise": a + b * L, "peak_line": line_peak, "peak_counted": counted, "peak": peak, "kernel_sums": kernel,
            "peak_kernel_on_disk": peak - kernel,
            # a GPU holds the weights, every sum (the torch engine's) and one layer's activations: counted from the
            # CPU run's sums and intercept where no GPU measured it
            "device_counted": weights + sums_per_layer * L + a, "device_peak": device, "source": one["source"]}


def table(rows: dict) -> list[str]:
    """The markdown table of :func:`main` (GiB; the rise per layer in MiB)."""
    out = ["| preset | layers x heads, d | N, T, batch | weights | rise / layer MiB (sums counted) | rise not per "
           "layer | peak by the line (a check) | stats job peak | fits 24 GiB | kernel sums | with stats.kernel_sums: disk | "
           "GPU (counted) | GPU (measured) | run as |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        one = r["runs"][0]
        g = lambda x: "-" if x is None else f"{x / GiB:.1f}"  # noqa: E731
        out.append(f"| {name} | {r['layers']} x {one['heads']}, {one['d_model']} | {one['N']}, {one['T']}, "
                   f"{one['batch_size']} | {g(r['weights'])} | {r['per_layer'] / 2**20:.0f} "
                   f"({r['sums_per_layer'] / 2**20:.0f}) | {r['intercept'] / GiB:.2f} | {g(r['peak_line'])} | "
                   f"{g(r['peak'])} | "
                   f"{'yes' if r['peak'] <= 24 * GiB else 'no'} | {g(r['kernel_sums'])} | "
                   f"{g(r['peak_kernel_on_disk'])} | {g(r['device_counted'])} | {g(r['device_peak'])} | "
                   f"{one['source']} |")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("presets", nargs="*", default=["gemma-2-2b", "llama-3.2-3b", "olmo-2-7b", "qwen3-14b"])
    ap.add_argument("--n-tracked", type=int, default=None, help="N (default: the preset's)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--depths", type=int, nargs="+", default=[6, 8],
                    help="at least as many layers as a block of the partial's write holds (64 MB of one sum)")
    ap.add_argument("--batches", type=int, default=2)
    ap.add_argument("--kernel-sums", choices=("memory", "disk"), default="memory",
                    help="stats.kernel_sums of the job measured (disk: the kernel sums mapped from a file)")
    ap.add_argument("--out", default=None, help="the measurements and their scaling as JSON")
    ap.add_argument("--from-json", nargs="+", default=None, help="print the table of earlier --out files")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--depth", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(args)
        return 0
    if args.from_json:
        rows = {}
        for path in args.from_json:  # scaled again from the runs (what the scaling is today)
            rows.update({k: scaled(v["runs"]) | {"runs": v["runs"]} for k, v in json.loads(Path(path).read_text()).items()})
        print("\n".join(table(rows)))
        return 0
    rows = {}
    for name in args.presets:
        spec, config = _preset(name, args.n_tracked)
        runs = [_measure(spec, config, d, args) for d in args.depths]
        rows[name] = scaled(runs) | {"runs": runs}
        print(table({name: rows[name]})[-1], flush=True)
    print("\n".join(table(rows)))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
