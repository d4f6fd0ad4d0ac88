# Every helper of the workflow's rule modules, kept apart from the rules as snakemake --lint asks. Config
# cross-checks, model specs, paths, code dependencies, what a job asks a cluster for.
import importlib
import sys
import time
from pathlib import Path

SRC = Path(workflow.basedir) / "src"
# The workflow always runs the library of its own checkout. Its jobs do too, without PYTHONPATH (which a conda
# environment blocks): each job script first imports workflow/scripts/_mfpipe_checkout.py, which puts SRC first.
sys.path.insert(0, str(SRC))

from mfpipe.workflow.codedeps import code_inputs  # noqa: E402
from mfpipe.workflow.config import ConfigError, check_config, validate_schema  # noqa: E402
from mfpipe.workflow.plan import Plan  # noqa: E402
# each core stage's planning (its targets, its rules' input functions), on PLAN
from mfpipe.minisuite import rules as minisuite_rules  # noqa: E402
from mfpipe.corpus import rules as corpus_rules  # noqa: E402
from mfpipe.stats import rules as stats_rules  # noqa: E402
from mfpipe.deviation import rules as deviation_rules  # noqa: E402
from mfpipe.jlens import rules as jlens_rules  # noqa: E402
from mfpipe.workflow.runner import CAUSE_PREFIX, failed_job_causes  # noqa: E402
from mfpipe.workflow.preflight import TOKENIZER, check_inputs, hub_commits  # noqa: E402
from mfpipe.workflow.scheduling import one_pending_wakeup  # noqa: E402
from mfpipe.workflow.numerics import pin_env  # noqa: E402

# Pinned numerics (mfpipe/workflow/numerics.py): every job this workflow starts, here or through a cluster's
# scheduler (which passes the environment on), runs the same CPU code paths on every x86-64 machine with AVX2,
# whatever the user's environment asks for; the libraries read these variables once, before any job code runs
pin_env()

# Snakemake's job-rate limiter wakes its scheduler once a second per finished job while jobs wait for cores, ~15 % of
# a core over the default run on two; one pending wake-up at a time does the same scheduling (mfpipe/workflow/scheduling.py)
one_pending_wakeup()

# Everything that can be checked before a job runs is checked here, when the DAG is built: the schema (every
# option's default lives there, once, and is filled in), the cross-checks, then the inputs themselves (model
# architectures, corpus files, N against each vocabulary, revisions). Each failure is one line naming the key,
# and it is the LAST line of the console output: a WorkflowError would be followed by Snakemake's
# `File "common.smk", line N` frame, so the run exits with the message instead (SystemExit prints it to stderr).
try:
    validate_schema(config)
    check_config(config)
    check_inputs(config)
    # every hub revision, of a model and of its tokenizer, as the commit it names now: the jobs load that commit and
    # take it as a param, so a branch that moves (a re-download of `main`) reruns exactly that revision's jobs. A job's
    # own process (a cluster job re-reads the workflow) takes the cache's commit first, the one its run planned with.
    HUB_COMMITS = hub_commits(config, prefer_cache=not workflow.is_main_process)
except ConfigError as e:
    raise SystemExit(CAUSE_PREFIX + str(e)) from None

_RUN_STARTED = time.time()


# A failed job's one-line cause is the last line of its own stderr, but Snakemake prints its summary after it and,
# with show-failed-logs, the whole rule log with the traceback. So when a run fails, the causes found in the rule
# logs written during this run are repeated as the last console lines (after the log-file hint), and the run
# exits non-zero right there.
onerror:
    causes = failed_job_causes("logs", since=_RUN_STARTED)
    if causes:
        logs = log if isinstance(log, (list, tuple)) else [log]
        print("Complete log: " + ", ".join(map(str, logs)), file=sys.stderr)
        print("\n".join(causes), file=sys.stderr, flush=True)
        raise SystemExit(1)


# What a run got from the command line, the workflow profile (profiles/default, which Snakemake applies to every
# run, its keys over a --profile's) and a --profile: the settings as Snakemake holds them when the run starts,
# written to logs/run_settings.json (the latest run's; tests/test_workflow.py checks a profiles/slurm run's).
RUN_SETTINGS = Path("logs") / "run_settings.json"


def run_settings():
    import dataclasses
    from snakemake import __version__

    res, exe, out = workflow.resource_settings, workflow.execution_settings, workflow.output_settings
    remote, plugin = workflow.remote_execution_settings, workflow.executor_plugin
    plugin_settings = workflow.executor_settings  # the executor plugin's own options (slurm: status_command, ...)
    # on a cluster the jobs that run here (localrules) go to Snakemake's local executor, a pool of this many threads
    local_executor = getattr(getattr(workflow, "scheduler", None), "_local_executor", None)
    return {
        "snakemake": __version__,
        "executor": plugin.name if plugin else None,
        "jobs": "unlimited" if res.nodes == sys.maxsize else res.nodes,  # --jobs (null: a local run, --cores)
        "cores": res.cores,  # also caps the threads of every job, a submitted one's too
        "local_cores": res.local_cores,
        "max_threads": res.max_threads,
        "login_node_job_slots": getattr(local_executor, "workers", None),
        "keep_going": exe.keep_going,
        "retries": exe.retries,
        "latency_wait": exe.latency_wait,
        "rerun_incomplete": workflow.dag_settings.force_incomplete,
        "printshellcmds": out.printshellcmds,
        "show_failed_logs": out.show_failed_logs,
        "seconds_between_status_checks": remote.seconds_between_status_checks if remote else None,
        "executor_settings": dataclasses.asdict(plugin_settings) if dataclasses.is_dataclass(plugin_settings) else None,
    }


onstart:
    import json

    RUN_SETTINGS.parent.mkdir(parents=True, exist_ok=True)
    part = RUN_SETTINGS.with_name(f".{RUN_SETTINGS.name}.tmp")
    part.write_text(json.dumps(run_settings(), indent=1, sort_keys=True, default=str) + "\n")
    part.replace(RUN_SETTINGS)


def _canonical(value):
    """The same settings in key-sorted order: Snakemake compares params by their text, so a config file
    that lists the same keys in another order (or a layered `--configfile`) must not look like a change."""
    if isinstance(value, dict):
        return {k: _canonical(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    return value


_sorted_config = _canonical(dict(config))
config.clear()
config.update(_sorted_config)

# the run's plan (mfpipe.workflow.plan), which every slice's targets and input functions take (mfpipe.<slice>.rules)
PLAN = Plan(config, SRC, checkpoints)
R = PLAN.results  # the one key every output path derives from
CORPUS = PLAN.corpus
CORPORA = PLAN.corpora  # primary first, then cross corpora (App. G)
CROSS = PLAN.cross
MODELS = PLAN.models
MINI = PLAN.mini
# `revisions`: the training sweep (statistics, substitution, kernel per revision); the rollout stage analyses
# `rollout_revisions` (default: the last of the sweep, the trained model)
REVISIONS = PLAN.revisions
ROLLOUT_REVISIONS = PLAN.rollout_revisions
STORE = PLAN.store  # a store's path, spelt once (mfpipe.workflow.paths.STORES): STORE("stats", dataset="eval")

# The experiments, found, not listed: each is a package mfpipe.experiments.<name> whose `rules` module plans it
# (`targets(plan)`, its rules' input functions) and a rule file workflow/rules/<name>.smk, which refers to that module
# as `<name>_rules`. The Snakefile includes the core stages' rule files in the order they run, then every other rule
# file (an experiment's), then the run's cost table, which waits for all the others.
EXPERIMENT_RULES = {
    p.parent.name: importlib.import_module(f"mfpipe.experiments.{p.parent.name}.rules")
    for p in sorted((SRC / "mfpipe" / "experiments").glob("*/rules.py"))
}
globals().update({f"{name}_rules": module for name, module in EXPERIMENT_RULES.items()})
_RULES_DIR = Path(workflow.basedir) / "workflow" / "rules"
CORE_RULE_FILES = ["minisuite", "corpus", "stats", "deviation", "jlens"]
LAST_RULE_FILES = ["costs"]
RULE_FILES = [f"{name}.smk" for name in CORE_RULE_FILES] + [
    p.name for p in sorted(_RULES_DIR.glob("*.smk"))
    if p.stem not in {"common", *CORE_RULE_FILES, *LAST_RULE_FILES}] + [f"{name}.smk" for name in LAST_RULE_FILES]


SCRIPTS = Path(workflow.basedir) / "workflow" / "scripts"


# every job's library files, derived from the sources once per change of them (.snakemake/ holds the answer), as
# paths relative to the working directory: Snakemake reruns a job whose recorded input paths changed, so absolute
# ones would make a checkout moved or copied with its results plan every job again
CODE_INPUTS = code_inputs(SRC, SCRIPTS, cache=Path(".snakemake") / "mfpipe-code-inputs.json", relative_to=Path.cwd())
# the one job script: it runs the rule's job function, `mfpipe.<package>.jobs.<rule>` (mfpipe.workflow.runner.run_job)
JOB_SCRIPT = "../scripts/job.py"


def code(script):
    """The library files job script `script` imports, directly or not (mfpipe.workflow.codedeps). Rules list them as
    inputs, so editing a module reruns exactly the jobs that run it, and no hand-written list can drift."""
    return CODE_INPUTS[script]


def job(package, rule):
    """The code inputs of job function `rule` of `mfpipe.<package>.jobs` (the module first: the job script finds the
    function there), from what the function imports (mfpipe.workflow.codedeps.job_dependencies)."""
    return CODE_INPUTS[f"mfpipe.{package}.jobs:{rule}"]


def tokenizer_input(wildcards):
    """Mini-suite models tokenize with the suite's tokenizer, which must exist first."""
    if MODELS[wildcards.model]["source"] == "minisuite":
        return [f"{R}/minisuite/tokenizer"]
    return []


def model_input(wildcards):
    """What a corpus pass over (model, revision) depends on: the checkpoint, for the mini suite."""
    if MODELS[wildcards.model]["source"] == "minisuite":
        return [f"{R}/minisuite/{wildcards.model}/checkpoints"]
    return []


# whether a dataset prefix names a top-N arm (`N2000`) or the exclusion arm (`excl`): its own tracked-<prefix>.json
tracked_arm = stats_rules.tracked_arm


def dataset_parts(dataset):
    """(corpus, half) of a stats dataset (mfpipe.stats.rules.dataset_parts)."""
    return stats_rules.dataset_parts(PLAN, dataset)


def dataset_tracked(wildcards):
    """The tracked set a dataset's statistics use: the configured N, or a top-N arm's or the exclusion arm's own."""
    prefix = wildcards.dataset.rpartition("/")[0]
    suffix = f"-{prefix}" if tracked_arm(prefix) else ""
    return f"{R}/corpus/{CORPUS}/{wildcards.model}/tracked{suffix}.json"


def datasets(corpus=None):
    """The datasets of a corpus's halves (mfpipe.stats.rules.datasets)."""
    return stats_rules.datasets(PLAN, corpus)


# what selects revisions (and App. M's arms) is not part of what a job loads: listing another revision must not change
# the params of the jobs of the revisions already built (nor re-tokenize the corpus)
SWEEP_KEYS = ("revisions", "rollout_revisions", "induction_window", "top_n")
# nor is how a job runs or what a figure's axis reads: a model's threads set its jobs' `threads:` (a forward's bits do
# not depend on them: mfpipe.workflow.numerics), its tokens_per_step the cross-model jobs' own params
RUN_KEYS = ("threads", "tokens_per_step")


def model_spec(wildcards):
    """The model entry as a job sees it (name, source, hub_id/path, dtype, bos_token, tokenizer_revision; for a hub
    model the commit its tokenizer_revision resolved to, `tokenizer_commit`: every job depends on the tokenizer
    through the corpus shards)."""
    spec = {k: v for k, v in MODELS[wildcards.model].items() if k not in SWEEP_KEYS + RUN_KEYS}
    if (wildcards.model, TOKENIZER) in HUB_COMMITS:
        spec["tokenizer_commit"] = HUB_COMMITS[(wildcards.model, TOKENIZER)]
    return spec


def revision_commit(wildcards):
    """The commit a hub model's revision resolved to (None for the mini suite and local folders)."""
    return HUB_COMMITS.get((wildcards.model, wildcards.revision))


def results_dir(wildcards):
    """The results folder, for jobs that resolve mini-suite paths under it (a function, not the literal
    prefix: `--lint` rightly flags hard-coded output prefixes in params)."""
    return R


def model_params():
    """Params of every job that loads (model, revision), read by mfpipe.workflow.runner.load_job_model."""
    return dict(
        model_spec=model_spec,
        revision="{revision}",
        commit=revision_commit,
        dtype=lambda wc: MODELS[wc.model].get("dtype", config["runtime"]["dtype"]),
        device=config["runtime"]["device"],
        results=results_dir,
    )


def every_target():
    """Every stage's and every experiment's targets: what the default target makes (with the explorer over them,
    workflow/rules/explorer.smk), and what the run's cost table waits for."""
    targets = []
    for stage in (minisuite_rules, corpus_rules, stats_rules, deviation_rules, jlens_rules,
                  *EXPERIMENT_RULES.values()):
        targets += stage.targets(PLAN)
    return targets


# ------------------------------------------------------------------ statistics (workflow/rules/stats.smk)
# (the statistics stage's input functions: mfpipe.stats.rules)


def partials_output(folder, keep):
    """The folder of a corpus pass's per-shard partials: Snakemake deletes it (`temp`) once every merge that reads it
    has written and checked its store, unless the config keeps partials (`stats.keep_partials`,
    `deviation.keep_partials`: a cluster run that expects to re-merge). A store that is current needs no partial, so a
    deleted one is never rebuilt for it; a store deleted or stale reruns the pass that writes them."""
    return directory(folder) if keep else temp(directory(folder))


# ------------------------------------------------------------------- pass 2 (workflow/rules/deviation.smk)
DEVIATION = config["deviation"]  # (its targets and input functions: mfpipe.deviation.rules)
# No experiment's helper lives here: an experiment's input functions are in its `rules` module
# (mfpipe.experiments.<name>.rules), its config section is read in its own rule file (tests/test_architecture.py)


# ------------------------------------------------------ cluster resources (config `cluster`, profiles/slurm)
ENV = "../envs/mfpipe.yaml"  # one software environment for every rule (`--sdm conda`), relative to the rule files


def cluster_resources(kind):
    """What a submitted job of kind `forward` (a forward pass or training: GPU, many cores) or `cpu` (the
    corpus stage) asks for. Names are those of snakemake-executor-plugin-slurm (`mem_mb`, `runtime` in
    minutes, `gpu`, `gpu_model`, `slurm_partition`, `slurm_account`); on a workstation only `gpu` counts, and
    only against an explicit `--resources gpu=N`."""
    c = config["cluster"]
    k = c[kind]
    res = dict(mem_mb=k["mem_mb"], runtime=k["runtime"])
    if kind == "forward" and config["runtime"]["device"] != "cpu" and k["gpus"]:
        res["gpu"] = k["gpus"]
        if k["gpu_model"]:
            res["gpu_model"] = k["gpu_model"]
    if c["partition"]:
        res["slurm_partition"] = c["partition"]
    if c["account"]:
        res["slurm_account"] = c["account"]
    return res


def cluster_threads(kind):
    """Threads of a job of that kind: `cluster.<kind>.cpus` (a workstation's --cores caps them)."""
    return config["cluster"][kind]["cpus"]


def model_threads(wildcards):
    """Threads of a forward-pass job of model `wildcards.model`: the model's `threads`, else
    `cluster.forward.cpus` (a workstation's --cores caps them)."""
    return MODELS[wildcards.model].get("threads") or cluster_threads("forward")


wildcard_constraints:
    model="|".join(MODELS) if MODELS else "NONE",
    mini="|".join(MINI) if MINI else "NONE",
    corpus="|".join(CORPORA),
    half="stats|eval",
    dataset=f"(?:(?:{'|'.join(CROSS or ['NONE'])}|N[0-9]+|{stats_rules.EXCLUSION_ARM})/)?(?:stats|eval)",
    n="[0-9]+",
    revision="[A-Za-z0-9._-]+",
    i="[0-9]+",


# ------------------------------------------------------------------ report (snakemake --report report.zip)
TABLE_CAPTION = "../report/table.rst"


def table_report(path, name, caption=None):
    """`path` (a result CSV) as a report item with the shared table caption, or its own (workflow/report/<caption>.rst,
    which says what the table is and which paper item it reproduces)."""
    cap = TABLE_CAPTION if caption is None else f"../report/{caption}.rst"
    return report(path, caption=cap, category="Tables", subcategory=name)
