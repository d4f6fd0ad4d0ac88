# mfpipe: attention mean-field analysis of language models.
#   snakemake --cores 2                       # the embedded default (mini suite on Shakespeare)
#   snakemake --cores 8 --configfile config/presets/gpt2-small.yaml
#   snakemake --profile profiles/slurm        # on a SLURM cluster (and no --cores: it caps each job's threads)
#   (profiles/default, the workflow profile, applies to every run by itself: options right for all of them)
#   snakemake -n                              # what would run, and why

from snakemake.utils import min_version

min_version("8.0")


configfile: "config/config.yaml"


# the config is validated against src/mfpipe/schemas/config.schema.yaml in workflow/rules/common.smk, with
# one-line messages that name the key


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"


# the core stages' rule files in the order they run, every experiment's (workflow/rules/<name>.smk), the cost table
for _rule_file in RULE_FILES:

    include: f"workflow/rules/{_rule_file}"


rule all:
    default_target: True
    input:
        every_target(),
        EXPLORER_TARGETS,
        rules.run_costs.output,


# every rule's params by name, as one more param (mfpipe.workflow.settings): Snakemake's rerun check compares the
# set of a job's param values without their names, so that a value swapped or made equal to another's is no change
from mfpipe.workflow.settings import add_named

for _rule in workflow.rules:
    add_named(_rule)
