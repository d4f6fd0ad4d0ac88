"""Issue 27, item 4: the workflow profile (profiles/default) and the cluster profile (profiles/slurm) together, as
Snakemake's own command-line parsing merges them, without a cluster. (The run on a real SLURM is
tests/test_workflow.py's: it compares its results with the ci run there.)"""

import subprocess
import sys

import pytest
from workflow_runs import PROFILES, REPO, clone, profile_settings, run_got, run_settings, snakemake

pytestmark = pytest.mark.slow


def cli_args(*argv: str) -> tuple[dict, str]:
    """The arguments Snakemake's own command-line parsing (snakemake.cli.parse_args: --profile files, then the
    workflow profile profiles/default it finds by itself, then the command line) gives `snakemake ARGV` started
    in the checkout, and what it printed."""
    import json

    code = """if True:
        import json, sys
        from snakemake.cli import parse_args

        def plain(v):  # sets in a fixed order; objects by type, not by their address
            if isinstance(v, (set, frozenset)):
                return sorted(map(str, v))
            return type(v).__name__ if " at 0x" in repr(v) else str(v)

        print(json.dumps(vars(parse_args(sys.argv[1:])[1]), default=plain, sort_keys=True))
    """
    out = subprocess.run([sys.executable, "-c", code, "--snakefile", str(REPO / "Snakefile"), *argv], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    return json.loads(out.stdout.splitlines()[-1]), out.stderr


def test_workflow_profile_leaves_the_slurm_profile_its_settings(tmp_path):
    """Issue 27, item 4, without a cluster: Snakemake applies profiles/default (the workflow profile) to a
    `--profile profiles/slurm` run too, its keys over the cluster profile's. It sets only keys profiles/slurm also
    states, with the same values, and neither sets --cores (it would cap every submitted job's threads), so the
    run's arguments are exactly the cluster profile's, the same as with `--workflow-profile none`. And a real run
    (on this machine: --executor local --cores 1, the one cheap job) records in logs/run_settings.json the
    execution settings the cluster profile states."""
    pytest.importorskip("snakemake_executor_plugin_slurm")
    default, slurm = profile_settings("default"), profile_settings("slurm")
    assert {k: slurm.get(k) for k in default} == default, "the workflow profile would override profiles/slurm"
    assert "cores" not in default and "cores" not in slurm and "local-cores" not in slurm

    args, printed = cli_args("--profile", "profiles/slurm")
    assert "workflow specific profile profiles/default" in printed, printed  # the merge under test did happen
    assert {k: args[k.replace("-", "_")] for k in slurm} == slurm
    assert args["cores"] is None, "--cores would cap the threads of every job submitted to SLURM"
    alone, _ = cli_args("--profile", "profiles/slurm", "--workflow-profile", "none")
    assert {k: v for k, v in alone.items() if k != "workflow_profile"} == {
        k: v for k, v in args.items() if k != "workflow_profile"}, "the workflow profile changes a cluster run"

    wd = clone(tmp_path)
    snakemake(wd, "--profile", str(PROFILES / "slurm"), "--executor", "local", "--cores", "1",
              "results/minisuite/tokenizer")
    got = run_settings(wd)
    assert got["executor"] == "local" and got["cores"] == 1, got  # the command line's
    stated = {k: v for k, v in slurm.items() if k != "executor"}
    assert run_got(got, stated) == stated, got
