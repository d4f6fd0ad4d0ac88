"""``mfpipe estimate``: the console command. Plans the config's jobs (:mod:`mfpipe.estimate.jobs`), calibrates each
model on this device (:mod:`mfpipe.estimate.calibrate`, one process per model, on the jobs' pinned numerics and
threads), prices every job (:mod:`mfpipe.estimate.costs`) and prints the predicted job-seconds by stage and in
total, the largest single job, the peak memory, the disk the run keeps, and one line per job that will not fit
(naming the knob). ``--compare logs/benchmarks`` sets a finished run's measured job-seconds beside the prediction,
stage by stage."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["main", "estimate", "stage_of_rules"]


def stage_of_rules(rules_dir: str | Path = "workflow/rules") -> dict[str, str]:
    """rule -> its stage, the rule file that defines it (as the run's cost table groups them)."""
    out, prefixes = {}, {}
    for path in sorted(Path(rules_dir).glob("*.smk")):
        text = path.read_text()
        for m in re.finditer(r"^(?:checkpoint|rule) (\w+):|^use rule \w+ as (\w+)", text, re.M):
            out[m.group(1) or m.group(2)] = path.stem
        for m in re.finditer(r"name:\s*f\"(\w+)\{", text):  # rules made in a loop (`name: f"figure_{...}"`)
            prefixes[m.group(1)] = path.stem
    return _Stages(out, prefixes)


class _Stages(dict):
    """rule -> stage, a rule made in a loop found by its name's prefix."""

    def __init__(self, named: dict, prefixes: dict):
        super().__init__(named)
        self.prefixes = prefixes

    def get(self, rule, default=None):
        if rule in self:
            return self[rule]
        return next((s for p, s in self.prefixes.items() if rule.startswith(p)), default)


def _at_once(commands: list[list[str]], env: dict | None = None) -> list[tuple[float, subprocess.CompletedProcess]]:
    """Run ``commands`` all at once (as the run's jobs share the machine); each one's wall seconds and result."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        procs, files = [], []
        for i, c in enumerate(commands):
            out, err = open(f"{tmp}/{i}.out", "w+"), open(f"{tmp}/{i}.err", "w+")
            files += [out, err]
            procs.append((time.perf_counter(), subprocess.Popen(c, stdout=out, stderr=err, text=True, env=env), out, err))
        ended: dict[int, float] = {}
        while len(ended) < len(procs):
            for i, (_, p, _, _) in enumerate(procs):
                if i not in ended and p.poll() is not None:
                    ended[i] = time.perf_counter()
            time.sleep(0.01)
        results = []
        for i, (t0, p, out, err) in enumerate(procs):
            out.seek(0)
            err.seek(0)
            results.append((ended[i] - t0, subprocess.CompletedProcess(p.args, p.returncode, out.read(), err.read())))
        for f in files:
            f.close()
    return results


# a probe's last line: the high-water mark of its own memory (VmHWM, MiB). ru_maxrss also counts the forking parent's
# resident memory at the fork (Linux keeps it across exec): it read 301 MiB for every kind of job, the estimate's own
# process, where a table job peaks at about 120
PRINT_OWN_PEAK = ("import resource, pathlib; s = pathlib.Path('/proc/self/status'); print(int(next(x.split()[1] "
                  "for x in s.read_text().splitlines() if x.startswith('VmHWM'))) / 1024 if s.exists() else "
                  "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)")


def _startups(jobs_at_once: int = 1) -> dict:
    """Seconds to start a job process without a model, by kind (its imports), and its resident memory, as slow as
    it starts beside the run's other jobs (:func:`_contention`)."""
    figure = ("import matplotlib, tempfile; matplotlib.use('Agg'); import matplotlib.pyplot as plt; "
              "f = plt.figure(); plt.plot([0, 1]); d = tempfile.mkdtemp(); f.savefig(d + '/f.pdf'); "
              "f.savefig(d + '/f.png', dpi=150)")
    store = "import mfpipe.workflow.runner, mfpipe.workflow.tables, pandas, xarray, zarr, numpy, torch"
    probes = {"table": "import mfpipe.workflow.runner, mfpipe.workflow.tables, pandas",
              "store": store,  # a store job's code imports torch with the statistics' modules
              "figure": "import mfpipe.workflow.runner, mfpipe.workflow.tables, pandas; " + figure,
              "store_figure": store + "; " + figure,
              # a tokenizer's load imports torch and transformers' tokenizer classes
              "tokenizer": "import mfpipe.workflow.runner, mfpipe.corpus.windows, numpy, transformers, torch; "
                           "from transformers import AutoTokenizer, PreTrainedTokenizerFast"}
    out = {}
    for kind, code in probes.items():
        code += "; " + PRINT_OWN_PEAK
        (t, done), = _at_once([[sys.executable, "-c", code]])
        out[kind], out[f"{kind}_rss_mb"] = t, float(done.stdout.split()[-1])
    out.update(_contention(probes["tokenizer"], out["tokenizer"], jobs_at_once))
    for kind in probes:
        out[kind] *= out["contention"]
    from mfpipe.estimate.timing import count_s_per_token

    out["count_s_per_token"] = count_s_per_token()  # the corpus stage's type counts (tracked_types, rank_frequency)
    return out


# a one-thread compute load: what each of the run's other jobs puts on the machine while one starts or works
LOAD = "import torch; torch.set_num_threads(1); a = torch.randn(1024, 1024)\nwhile True: a @ a"
WORK = ("import time, torch; torch.set_num_threads(1); a = torch.randn(512, 512); a @ a; t = time.perf_counter(); "
        "[a @ a for _ in range(300)]; print(time.perf_counter() - t)")


def _contention(start_probe: str, alone: float, jobs_at_once: int) -> dict:
    """How much slower a job starts (``contention``: its imports) and works (``contention_work``: one thread's
    matrix products) while ``jobs_at_once - 1`` other jobs compute beside it, measured with that many one-thread
    loads running (1.0 and 1.0 for one job at a time)."""
    if jobs_at_once <= 1:
        return {"contention": 1.0, "contention_work": 1.0}
    (_, w0), = _at_once([[sys.executable, "-c", WORK]])
    loads = [subprocess.Popen([sys.executable, "-c", LOAD]) for _ in range(jobs_at_once - 1)]
    try:
        time.sleep(1.0)  # the loads' imports done: they compute
        (t, _), = _at_once([[sys.executable, "-c", start_probe]])
        (_, w1), = _at_once([[sys.executable, "-c", WORK]])
    finally:
        for p in loads:
            p.kill()
            p.wait()
    return {"contention": max(1.0, t / alone), "contention_work": max(1.0, float(w1.stdout) / float(w0.stdout))}


def _calibrations(config: dict, device: str) -> dict:
    """The calibration of every model (:mod:`mfpipe.estimate.calibrate`), one at a time, each in a process of its
    own on the jobs' pinned numerics and threads."""
    from mfpipe.estimate.jobs import EstimateError
    from mfpipe.workflow.numerics import pinned_env

    out = {}
    for spec in config["models"]:
        threads = min(int(spec.get("threads") or config["cluster"]["forward"]["cpus"]), os.cpu_count() or 1)
        arg = json.dumps({"spec": spec, "config": config, "device": device, "threads": threads})
        (_, done), = _at_once([[sys.executable, "-m", "mfpipe.estimate.calibrate", arg]],
                              env=dict(os.environ, **pinned_env()))
        line = next((x for x in done.stdout.splitlines() if x.startswith("MFPIPE-CALIBRATION ")), None)
        if line is None:
            tail = "\n".join(done.stderr.strip().splitlines()[-8:])
            raise EstimateError(f"the calibration of model {spec['name']} failed (exit {done.returncode}):\n{tail}")
        out[spec["name"]] = json.loads(line.split(" ", 1)[1])
    return out


def _tokenizers(config: dict, workdir: Path, startup: dict) -> dict:
    """A tokenizer per model where one can be had here: the mini suite's (its run's, else trained here as its job
    trains it, the time recorded as that job's work), a hub model's from the local cache; else None (the default
    characters per token)."""
    from mfpipe.models.loader import load_tokenizer

    out, mini = {}, None
    for m in config["models"]:
        try:
            if m["source"] == "minisuite" and not (Path(config["results"]) / "minisuite" / "tokenizer").is_dir():
                mini = mini or _train_mini_tokenizer(config, workdir / "tokenizer", startup)
                out[m["name"]] = mini
            else:
                out[m["name"]] = load_tokenizer(m, results_dir=config["results"])
        except Exception:  # noqa: BLE001 -- no tokenizer on this machine: the default characters per token
            out[m["name"]] = None
    return out


def _train_mini_tokenizer(config: dict, path: Path, startup: dict):
    from transformers import AutoTokenizer

    from mfpipe.corpus.documents import load_documents, split_documents
    from mfpipe.minisuite.tokenizer import train_tokenizer

    mc, tk = config["minisuite"]["corpus"], config["minisuite"]["tokenizer"]
    t0 = time.perf_counter()
    texts = [d.text for d in split_documents(load_documents(mc), int(mc["reserve_train_every"] or 0))["train"]]
    train_tokenizer(texts, int(tk["vocab_size"]), int(tk["min_frequency"]), path)
    startup["minisuite_tokenizer_s"] = time.perf_counter() - t0
    return AutoTokenizer.from_pretrained(str(path))


def estimate(configfiles=(), overrides=(), *, device: str = "cpu", snakefile: str | Path = "Snakefile",
             jobs_at_once: int = 1, progress=print):
    """``(jobs DataFrame, context)``: every job of the config with its rule, stage, model, predicted seconds, start-up,
    peak memory (MiB) and the disk its output keeps (bytes). ``device``: where the calibration runs (a GPU's rates
    are measured only on a GPU: :func:`mfpipe.estimate.notes.calibration_device`)."""
    import tempfile

    import pandas as pd

    from mfpipe.estimate import costs
    from mfpipe.estimate.corpus_memory import corpus_memory
    from mfpipe.estimate.costs import Context, job_cost
    from mfpipe.estimate.jobs import load_config, planned_jobs, predict_corpus
    from mfpipe.estimate.prompts import exemplar_tokens

    config = load_config(configfiles, overrides, base=Path(snakefile).resolve().parent / "config" / "config.yaml")
    startup = _startups(jobs_at_once)
    with tempfile.TemporaryDirectory(prefix="mfpipe-estimate-") as tmp:
        progress("predicting the corpus halves ...")
        tokenizers = _tokenizers(config, Path(tmp), startup)
        corpus = predict_corpus(config, tokenizers)
        startup["corpus_memory"] = corpus_memory(config, tokenizers)  # the corpus job's peak, its own code run
        exemplars = {m: exemplar_tokens(config, t) for m, t in tokenizers.items()}  # the few-shot prompts' lengths
    progress("planning the jobs (snakemake's dry run) ...")
    jobs = planned_jobs(corpus, configfiles, overrides, snakefile)
    progress(f"calibrating {', '.join(m['name'] for m in config['models'])} on {device} ...")
    cal = _calibrations(config, device)
    for name, c in cal.items():  # a model job's start-up, as slow as the others' with the run's jobs side by side
        c["startup_s"] *= startup["contention"]
        c.update(exemplars.get(name) or {})
    ctx = Context(config, corpus, cal, startup)
    stages = stage_of_rules(Path(snakefile).resolve().parent / "workflow" / "rules")
    rows = []
    for j in jobs:
        cost = job_cost(ctx, j["rule"], j["wildcards"])
        kept = cost["disk_bytes"] if costs.kept(config, j["rule"]) else 0.0  # partials: where the config keeps them
        rows.append({"rule": j["rule"], "stage": stages.get(j["rule"], j["rule"]), "model": j["wildcards"].get("model") or j["wildcards"].get("mini"),
                     "job": j["benchmark"] or j["rule"], **cost, "disk_kept_bytes": kept})
    return pd.DataFrame(rows), ctx


def fit_problems(jobs, ctx, device: str, results: str | Path, jobs_at_once: int = 1,
                 run_device: str | None = None) -> list[str]:
    """One line per model whose jobs will not fit this machine's memory (its largest job, how many more, the knobs
    those jobs' code reads), one per model that will not fit the GPU (``device``: where the calibration measured
    it), and one for a run whose disk will not fit the results folder's free space. ``run_device``: where the jobs
    will run (default ``device``)."""
    from mfpipe.estimate.notes import memory_lines

    lines = memory_lines(jobs, ctx, run_device or device)
    if device.startswith("cuda"):
        import torch

        total = torch.cuda.get_device_properties(0).total_memory / 2**20
        for name, c in ctx.cal.items():
            if c.get("device_peak_mb", 0) > total:
                lines.append(f"model {name}: needs ~{c['device_peak_mb'] / 1024:.1f} GiB of device memory, the GPU has "
                             f"{total / 1024:.1f}: lower runtime.batch_size or use runtime.dtype bfloat16")
    folder = Path(results)
    while not folder.exists():
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    kept = jobs["disk_kept_bytes"].sum()
    # partials live until their store is merged: at most `jobs_at_once` datasets' partials at a time
    temp = jobs["disk_bytes"] - jobs["disk_kept_bytes"]
    peak = kept + jobs_at_once * float(temp.groupby(jobs["job"].map(_dataset_of)).sum().max() if temp.any() else 0.0)
    # the knobs of the disk: the partials kept (statistics, pass 2) first, where kept
    knobs = [f"set {k}: false" for k in ("stats.keep_partials", "deviation.keep_partials")
             if ctx.config[k.split(".")[0]].get("keep_partials")]
    knobs = ", ".join(knobs + ["lower tracked.n_tracked", "set stats.partial_mantissa_bits"])
    if kept > free:
        lines.append(f"the run keeps ~{kept / 2**30:.1f} GiB, {folder} has {free / 2**30:.1f} GiB free: {knobs}, or "
                     "point `results` at a larger disk")
    elif peak > free:
        lines.append(f"the run needs ~{peak / 2**30:.1f} GiB at its peak (what it keeps and the partials before their "
                     f"merge), {folder} has {free / 2**30:.1f} GiB free: {knobs}, or point `results` at a larger disk")
    return lines


def _dataset_of(job: str) -> str:
    """A statistics job's benchmark file without its run of shards: the partials one merge reads."""
    return job.rsplit("/group-", 1)[0]


def summary(jobs, compare: str | Path | None = None) -> str:
    """The predicted job-seconds by stage (and, with ``compare``, a finished run's measured ones beside them)."""
    import pandas as pd

    from mfpipe.workflow.tables import to_markdown

    g = jobs.groupby("stage", sort=False).agg(jobs=("seconds", "size"), predicted_s=("seconds", "sum"),
                                             largest_s=("seconds", "max"), peak_mb=("peak_mb", "max"),
                                             disk_kept_gb=("disk_kept_bytes", "sum"))
    g["disk_kept_gb"] /= 1e9
    if compare:
        from mfpipe.workflow.costs import read_benchmarks

        real = read_benchmarks(compare)
        stages = dict(zip(jobs["rule"], jobs["stage"]))
        real = real.assign(stage=[stages.get(r, r) for r in real["rule"]]).groupby("stage").agg(
            size=("wall_s", "size"), sum=("wall_s", "sum"), rss=("max_rss_mb", "max"))
        g["measured_jobs"] = real["size"].reindex(g.index)
        g["measured_s"] = real["sum"].reindex(g.index)
        g["predicted / measured"] = g["predicted_s"] / g["measured_s"]
        g["measured_peak_mb"] = real["rss"].reindex(g.index)
    g = g.sort_values("predicted_s", ascending=False)
    total = pd.DataFrame([g.sum(numeric_only=True)], index=["total"])
    total["largest_s"], total["peak_mb"] = g["largest_s"].max(), g["peak_mb"].max()
    if compare:
        total["predicted / measured"] = total["predicted_s"] / total["measured_s"]
        total["measured_peak_mb"] = g["measured_peak_mb"].max()
    t = pd.concat([g, total]).reset_index(names="stage").round(2)
    return to_markdown(t)


def main(argv=None) -> int:
    import argparse

    from mfpipe.estimate.jobs import EstimateError
    from mfpipe.workflow.config import ConfigError

    ap = argparse.ArgumentParser(prog="mfpipe estimate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configfile", nargs="+", default=[], help="the run's --configfile(s), in order")
    ap.add_argument("--config", nargs="+", default=[], metavar="KEY=VALUE", help="the run's --config overrides")
    ap.add_argument("--device", default=None,
                    help="the jobs' device, calibrated on where torch sees it (default: the config's runtime.device; "
                         "a GPU asked for where torch sees none is calibrated on the CPU, and the output says so)")
    ap.add_argument("--snakefile", default="Snakefile")
    ap.add_argument("--jobs-at-once", type=int, default=1, metavar="K",
                    help="jobs the run will run side by side (`snakemake --cores N` with one-thread jobs: N): every "
                         "job's start-up is measured with K starting together, as the run's jobs share the machine")
    ap.add_argument("--compare", default=None, metavar="LOGS_BENCHMARKS",
                    help="a finished run's logs/benchmarks folder: its measured job-seconds beside the prediction")
    ap.add_argument("--jobs", default=None, metavar="CSV", help="also write every job's prediction here")
    ap.add_argument("--calibration", default=None, metavar="JSON", help="also write each model's calibration here")
    args = ap.parse_args(argv)
    try:
        from mfpipe.estimate.jobs import load_config
        from mfpipe.estimate.notes import calibration_device

        cfg = load_config(args.configfile, args.config, base=Path(args.snakefile).resolve().parent / "config" / "config.yaml")
        devices = calibration_device(str(args.device or cfg["runtime"]["device"]))
        t0 = time.perf_counter()
        jobs, ctx = estimate(args.configfile, args.config, device=devices[1], snakefile=args.snakefile,
                             jobs_at_once=args.jobs_at_once, progress=lambda s: print(s, file=sys.stderr))
    except (EstimateError, ConfigError) as e:  # a bad --config value: one line naming the key, as for the workflow
        print(f"mfpipe estimate: {e}", file=sys.stderr)
        return 2
    return 1 if _print(jobs, ctx, devices, args, time.perf_counter() - t0) else 0


def _print(jobs, ctx, devices: tuple, args, took: float) -> list[str]:
    """Print the estimate; its WILL NOT FIT lines back. ``devices``: the jobs' device, the calibration's, its note
    (:func:`mfpipe.estimate.notes.calibration_device`)."""
    from mfpipe.estimate.calibrate import MAX_BATCH_SECONDS
    from mfpipe.estimate.notes import corpus_lines, unpriced_line
    from mfpipe.estimate.weights import stream_line

    run_device, device, note = devices
    big = jobs.loc[jobs["seconds"].idxmax()]
    on = run_device if run_device == device else f"{run_device} (calibrated on {device})"
    print(f"# mfpipe estimate: {len(jobs)} jobs on {on}, {args.jobs_at_once} at once (start-ups "
          f"{ctx.startup['contention']:.2f}x slower side by side; calibrated in {took:.0f} s)\n")
    if note:
        print(f"- {note}")
    for name, c in ctx.cal.items():
        print(f"- {name}: {c['source']}; L={c['layers']}, H={c['heads']}, d={c['d_model']}, T={c['T']}, batch "
              f"{c['batch_size']}: forward {1 / c['forward_s_per_token']:.0f} tok/s, pass 1 "
              f"{1 / c['pass1_s_per_token']:.0f}, pass 2 {1 / c['pass2_s_per_token']:.0f}, substitution "
              f"{1 / c['substitution_s_per_token']:.0f} tok/s; job start-up {c['startup_s']:.1f} s")
        if c["batch_size"] < c.get("runtime_batch_size", c["batch_size"]):  # a batch too slow to time whole
            print(f"- {name}: timed in batches of {c['batch_size']}, not the jobs' {c['runtime_batch_size']} (a batch's "
                  f"forward would take over {MAX_BATCH_SECONDS:.0f} s): its batched jobs' peaks are the smaller "
                  f"batch's plus {c.get('window_mb', 0.0):.0f} MiB for each window more (a bare forward's rise with "
                  "one window more)")
        if stream_line(name, c):  # its weights streamed one block at a time (mfpipe.estimate.weights)
            print(f"- {stream_line(name, c)}")
    half = [m["name"] for m in ctx.config["models"]
            if str(m.get("dtype") or ctx.config["runtime"]["dtype"]) in ("bfloat16", "float16")]
    if half and device == "cpu":
        print(f"- {', '.join(half)}: 16-bit weights on a CPU run far slower than float32 where the CPU has no native "
              "16-bit matrix units; on a CPU set the model's `dtype: float32` (twice the memory)")
    halves = ", ".join(f"{k} {v['windows']} windows{'' if v['measured'] else ' (predicted)'}"
                       for k, v in ctx.corpus.items())
    print(f"- corpus halves: {halves}")
    for line in corpus_lines(ctx):
        print(f"- {line}")
    print()
    print(summary(jobs, args.compare))
    print(f"\nLargest job: {big['job']} ({big['seconds']:.0f} s). Total {jobs['seconds'].sum() / 3600:.2f} job-hours; "
          f"peak memory of a job {jobs['peak_mb'].max() / 1024:.1f} GiB; the run keeps "
          f"{jobs['disk_kept_bytes'].sum() / 1e9:.2f} GB ({jobs['disk_bytes'].sum() / 1e9:.2f} GB written).")
    unpriced = unpriced_line(jobs)
    if unpriced:
        print(unpriced)
    lines = fit_problems(jobs, ctx, device, ctx.config["results"], args.jobs_at_once, run_device=run_device)
    for line in lines:
        print(f"WILL NOT FIT: {line}")
    if args.jobs:
        jobs.to_csv(args.jobs, index=False)
    if args.calibration:
        Path(args.calibration).write_text(json.dumps({"models": ctx.cal, "startup": ctx.startup,
                                                      "corpus": ctx.corpus}, indent=1))
    return lines
