"""The job script of every rule: runs the rule's job function, ``<package>.jobs.<rule>`` (mfpipe.workflow.runner.run_job;
the rule's first code input names the module)."""
import _mfpipe_checkout  # noqa: F401,I001 (first: this checkout's src/ on sys.path)
from mfpipe.workflow.runner import run_job

run_job(snakemake)  # noqa: F821 (injected by Snakemake)
