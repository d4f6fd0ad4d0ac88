"""The house rules of src/mfpipe (docs/architecture.md), checked on every module: imports go down (an experiment
imports the core, never another experiment; the core never imports an experiment; the module graph has no cycle
and every import goes to the same or a lower layer, never to an enclosing package), no private name is imported
across modules, no module is over 400 lines and no function over 80, at most six modules sit loose beside the
packages, and every package's docstring names each of its modules. The job scripts of workflow/scripts are held to
the same import rule."""

import ast
import pathlib
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "mfpipe"
MODULES = sorted(PKG.rglob("*.py"))
SCRIPTS = sorted((SRC.parent / "workflow" / "scripts").glob("*.py"))
# the layers, bottom up: a module imports its own layer (without a cycle) or a lower one
#   0  the workflow's leaf plumbing (files, logs, tables, figures, config, code inputs) and the version
#   1  the core: corpus, tasks, statistics, models, the mean field, pass 2, the mini suite, the J-lens, conformance
#   2  the workflow's wiring (the job runner and context, the plan, the preflight checks) and the core stages' jobs
#      and planning (<package>.jobs, <package>.rules)
#   3  the experiments
#   4  the public APIs (results: reading a run; notebook: computing on a model in memory), the command line, the
#      package itself
WORKFLOW_LEAVES = {"io", "heap", "numerics", "logs", "tables", "plots", "revisions", "codedeps", "scheduling",
                   "config", "costs", "paths"}
CORE = {"corpus", "tasks", "stats", "models", "meanfield", "deviation", "minisuite", "jlens", "conformance"}
MAX_LOOSE = 6
# the public reading API opens every experiment's stores, the notebook API runs the substitution's code; the package's
# lazy exports load both; `mfpipe estimate` times the calibrated kernel's passes
MAY_IMPORT_EXPERIMENTS = {"mfpipe", "mfpipe.results", "mfpipe.notebook.analysis", "mfpipe.estimate.timing"}
MAX_LINES = 400
MAX_FUNCTION_LINES = 80  # from `def` to the function's last line, docstring included (issue 47 item 7)


def dotted(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, imported names) of every mfpipe import in ``path``, relative imports resolved."""
    tree = ast.parse(path.read_text())
    here = dotted(path).split(".") if path.is_relative_to(SRC) else []  # a job script: no relative imports
    pkg = here if path.name == "__init__.py" else here[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name.split(".")[0] == "mfpipe"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] == "mfpipe":
                out.append((base, [a.name for a in node.names]))
    return out


def experiment_of(name: str) -> str | None:
    parts = name.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "experiments" else None


def test_imports_go_down():
    wrong = []
    for path in MODULES:
        me = dotted(path)
        mine = experiment_of(me)
        for module, names in imports(path):
            targets = [module] + [f"{module}.{n}" for n in names]
            for target in targets:
                theirs = experiment_of(target)
                if theirs is None:
                    continue
                if mine is None and me not in MAY_IMPORT_EXPERIMENTS:
                    wrong.append(f"{me} (core) imports the experiment module {target}")
                elif mine is not None and theirs != mine:
                    wrong.append(f"{me} (experiment {mine}) imports {target} of experiment {theirs}")
    assert not wrong, "\n".join(sorted(set(wrong)))


def layer(name: str) -> int:
    parts = name.split(".")
    if name in ("mfpipe.version", "mfpipe.workflow"):
        return 0
    if len(parts) > 2 and parts[1] == "workflow":
        return 0 if parts[2] in WORKFLOW_LEAVES else 2
    if len(parts) > 1 and parts[1] in CORE:
        # a core stage's jobs and planning (its rules' targets and input functions) are the workflow's wiring
        return 2 if parts[-1] in ("jobs", "rules") else 1
    if len(parts) > 1 and parts[1] == "experiments":
        return 3
    return 4


def import_graph(modules=None) -> dict[str, set[str]]:
    """module -> the mfpipe modules it imports. ``from package import submodule`` is an edge to the submodule only
    (the package's ``__init__`` runs first for every import below it anyway)."""
    paths = MODULES if modules is None else modules
    known = {dotted(p) for p in paths}

    def resolve(target: str) -> str:
        while target and target not in known:
            target = target.rpartition(".")[0]
        return target

    graph = {}
    for path in paths:
        me, edges = dotted(path), set()
        for module, names in imports(path):
            subs = [f"{module}.{n}" for n in names if f"{module}.{n}" in known]
            for target in subs or [module] + [f"{module}.{n}" for n in names]:
                r = resolve(target)
                if r and r != me:
                    edges.add(r)
        graph[me] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph`` (one per back edge a depth-first search meets)."""
    state, stack, found = {}, [], []

    def visit(u):
        state[u] = 1
        stack.append(u)
        for v in sorted(graph.get(u, ())):
            if state.get(v) == 1:
                found.append(stack[stack.index(v):] + [v])
            elif v not in state:
                visit(v)
        stack.pop()
        state[u] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return found


def test_the_import_graph_is_acyclic_and_goes_down():
    graph = import_graph()
    assert not cycles(graph), cycles(graph)
    up = [f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})" for a, bs in graph.items() for b in bs
          if layer(b) > layer(a)]
    # an enclosing package's own names (`from mfpipe import __version__` in mfpipe.stats.store) are an upward import
    enclosing = [f"{a} imports names of its enclosing package {b}" for a, bs in graph.items() for b in bs
                 if a.startswith(b + ".") and b != "mfpipe" or (b == "mfpipe" and a != "mfpipe")]
    assert not up and not enclosing, "\n".join(sorted(up + enclosing))


def test_job_scripts_import_at_most_one_experiment_and_only_the_workflow_besides():
    wrong = []
    for path in SCRIPTS:
        found = {experiment_of(t) for m, names in imports(path) for t in [m] + [f"{m}.{n}" for n in names]}
        found.discard(None)
        if len(found) > 1:
            wrong.append(f"{path.name} imports the experiments {sorted(found)}")
    assert not wrong, "\n".join(wrong)


def test_at_most_six_modules_sit_loose_beside_the_packages():
    loose = sorted(p.stem for p in PKG.glob("*.py") if p.name != "__init__.py")
    assert len(loose) <= MAX_LOOSE, loose


TOY = {
    "src/mfpipe/experiments/toy/__init__.py": '''"""A toy experiment (tests/test_architecture.py adds it to a copy of the project).

- :mod:`~mfpipe.experiments.toy.counts` — what it computes.
- :mod:`~mfpipe.experiments.toy.jobs` — its job.
- :mod:`~mfpipe.experiments.toy.rules` — its targets.
"""
''',
    "src/mfpipe/experiments/toy/counts.py": '''"""The toy's computation."""


def tracked_count(tracked, scale: int) -> int:
    return scale * tracked.n
''',
    "src/mfpipe/experiments/toy/jobs.py": '''"""The toy's job."""

from __future__ import annotations


def toy_table(job) -> None:
    from mfpipe.corpus.tracked import TrackedSet
    from mfpipe.experiments.toy.counts import tracked_count
    from mfpipe.workflow.io import atomic_write_text

    n = tracked_count(TrackedSet.load(job.input.tracked), int(job.params.scale))
    atomic_write_text(job.output[0], f"model,count\\n{job.wildcards.model},{n}\\n")
''',
    "src/mfpipe/experiments/toy/rules.py": '''"""The toy's targets."""


def targets(plan) -> list[str]:
    return [f"{plan.results}/tables/toy_{m}.csv" for m in plan.models]
''',
    "workflow/rules/toy.smk": '''# A toy experiment: a count per model.


rule toy_table:
    input:
        tracked=f"{R}/corpus/{CORPUS}/{{model}}/tracked.json",
        code=job("experiments.toy", "toy_table"),
    output:
        f"{R}/tables/toy_{{model}}.csv",
    params:
        scale=config["toy"]["scale"],
    log:
        "logs/tables/toy_{model}.log",
    benchmark:
        "logs/benchmarks/toy_table/tables/toy_{model}.tsv"
    script:
        JOB_SCRIPT
''',
    "tests/test_toy.py": "def test_toy():\n    assert True\n",
}
TOY_SECTION = '''  toy:
    type: object
    default: {}
    additionalProperties: false
    description: "a toy experiment"
    properties:
      scale: {type: integer, minimum: 1, default: 3}
'''


def test_a_new_experiment_is_one_package_one_rule_file_one_config_section_and_one_test_file(tmp_path):
    """Issue 47 item 8: adding an experiment to a copy of the project is its package (computation, job, targets), its
    rule file, its config section and its test file, and nothing else: the workflow finds it, plans its job for every
    model among the default target's, declares the job's code inputs from what it imports, and the slice keeps the
    house rules (the import graph still goes down; an experiment imports only the core)."""
    import shutil
    import subprocess
    import sys

    import yaml

    global SRC
    repo = SRC.parent
    junk = shutil.ignore_patterns("__pycache__", "*.pyc", ".snakemake", "results", "logs")
    for name in ("Snakefile", "workflow", "src", "config", "profiles", "pyproject.toml"):
        (shutil.copytree if (repo / name).is_dir() else shutil.copy2)(repo / name, tmp_path / name,
                                                                      **({"ignore": junk} if (repo / name).is_dir() else {}))
    for rel, text in TOY.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    schema = tmp_path / "src" / "mfpipe" / "schemas" / "config.schema.yaml"
    text = schema.read_text()
    at = text.index("\n  jlens:\n") + 1
    schema.write_text(text[:at] + TOY_SECTION + text[at:])
    assert yaml.safe_load(schema.read_text())["properties"]["toy"]["properties"]["scale"]["default"] == 3

    out = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--snakefile", str(tmp_path / "Snakefile"),
                          "--directory", str(tmp_path), "--configfile", str(tmp_path / "config" / "ci.yaml")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ci = yaml.safe_load((tmp_path / "config" / "ci.yaml").read_text())
    models = [m["name"] for m in ci["models"]]
    planned = out.stdout.count("rule toy_table:")
    assert planned == len(models) >= 1, out.stdout[-2000:]
    for m in models:
        assert f"results/tables/toy_{m}.csv" in out.stdout
    sys.path.insert(0, str(tmp_path / "src"))
    try:
        from mfpipe.workflow import codedeps

        code = codedeps.code_inputs(tmp_path / "src", tmp_path / "workflow" / "scripts")
    finally:
        sys.path.remove(str(tmp_path / "src"))
    got = {str(pathlib.Path(f).relative_to(tmp_path / "src")) for f in code["mfpipe.experiments.toy.jobs:toy_table"]}
    assert {"mfpipe/experiments/toy/jobs.py", "mfpipe/experiments/toy/counts.py", "mfpipe/corpus/tracked.py"} <= got
    assert "mfpipe/experiments/toy/rules.py" not in got  # planning, not what the job runs
    toy = sorted((tmp_path / "src").rglob("*.py"))
    toy = [p for p in toy if p.relative_to(tmp_path / "src").parts[:3] == ("mfpipe", "experiments", "toy")]
    old, SRC = SRC, tmp_path / "src"
    try:
        graph = import_graph(sorted((tmp_path / "src" / "mfpipe").rglob("*.py")))
    finally:
        SRC = old
    assert not cycles(graph)
    assert all(experiment_of(t) in (None, "toy") for m in graph if m.startswith("mfpipe.experiments.toy")
               for t in graph[m]) and len(toy) == 4


def test_the_graph_checks_see_a_cycle_and_an_upward_import():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert not cycles({"a": {"b"}, "b": {"c"}, "c": set()})
    assert layer("mfpipe.workflow.io") < layer("mfpipe.stats.pass1") < layer("mfpipe.workflow.runner")
    assert layer("mfpipe.workflow.runner") < layer("mfpipe.experiments.fv.jobs") < layer("mfpipe.results")


def test_no_private_name_is_imported_across_modules():
    wrong = [f"{dotted(p)} imports {n} from {m}" for p in MODULES for m, names in imports(p) for n in names
             if n.startswith("_") and not n.startswith("__") and not n.startswith("_native_loops")]
    assert not wrong, "\n".join(wrong)


def test_no_module_is_over_400_lines():
    long = {dotted(p): n for p in MODULES if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def long_functions(source: str, module: str) -> list[str]:
    """``module:function (n lines)`` of every function and method of ``source`` (nested ones too, by qualified
    name) over :data:`MAX_FUNCTION_LINES` lines."""
    out = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                n = child.end_lineno - child.lineno + 1
                if not isinstance(child, ast.ClassDef) and n > MAX_FUNCTION_LINES:
                    out.append(f"{module}:{name} ({n} lines)")
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return out


def test_no_function_is_over_80_lines():
    long = [f for p in MODULES for f in long_functions(p.read_text(), dotted(p))]
    assert not long, "\n".join(long)


@pytest.mark.parametrize("init", sorted(PKG.rglob("__init__.py")), ids=lambda p: dotted(p))
def test_every_package_docstring_names_its_modules(init):
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    if init.parent == PKG:
        return  # the top-level package: docs/architecture.md is its map
    members = [p.stem for p in init.parent.glob("*.py") if p.name != "__init__.py" and not p.stem.startswith("_")]
    members += [p.name for p in init.parent.iterdir() if (p / "__init__.py").is_file()]
    missing = [m for m in members if m not in doc]
    assert doc and not missing, f"{dotted(init)}'s docstring does not name {missing}"


def test_the_checks_see_a_violation(tmp_path):
    """The import rule is not vacuous: a core module importing an experiment is found."""
    fake = tmp_path / "mfpipe" / "stats" / "bad.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("from mfpipe.experiments.rollout import tables\nfrom .api import _private\n")
    global SRC
    old, SRC = SRC, tmp_path
    try:
        assert experiment_of(imports(fake)[0][0]) == "rollout" and dotted(fake) == "mfpipe.stats.bad"
        assert imports(fake)[1] == ("mfpipe.stats.api", ["_private"])
    finally:
        SRC = old


def test_the_function_length_check_sees_a_long_function():
    """The length rule is not vacuous: a method of 81 lines (a decorator not counted) is found, one of 80 is not."""
    body = "".join(f"        x{i} = {i}\n" for i in range(79))
    source = (f"class A:\n    @staticmethod\n    def long():\n{body}        return x0\n\n"
              f"    def fits():\n{body}\n\ndef outer():\n    def inner():\n{body}        return 1\n    return inner\n")
    assert long_functions(source, "mfpipe.fake") == ["mfpipe.fake:A.long (81 lines)", "mfpipe.fake:outer (83 lines)",
                                                     "mfpipe.fake:outer.inner (81 lines)"]


def test_no_test_module_imports_another():
    """Issue 47 item 1: no test file imports another (an experiment's tests are tests/test_<name>*.py and stand on
    their own); what test files share lives in helper modules beside them (tests/<name>.py, not collected). Checked
    on every file of tests/ (the helpers and conftest.py too), in every import form (`import test_x`,
    `from test_x import ...`, `tests.test_x`, `from tests import test_x`, relative)."""
    here = Path(__file__).resolve().parent
    test_modules = {p.stem for p in here.glob("test_*.py")}

    def test_imports(source: str) -> list[str]:
        out = []
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                names = [base] + [f"{base}.{a.name}" if base else a.name for a in node.names]
            else:
                continue
            for name in names:
                parts = name.split(".")
                parts = parts[1:] if parts[0] == "tests" else parts
                if parts and parts[0] in test_modules:
                    out.append(f"line {node.lineno}: {'.'.join(parts)}")
                    break
        return out

    # not vacuous: every form is found, a helper or a package import is not
    seen = test_imports("import numpy\nfrom stats_reference import BOS\nfrom test_rollout import Ref\nimport tests.test_config\n"
                        "from tests import hub_cache, test_workflow\nfrom . import test_corpus\nfrom .test_io import x\n")
    assert seen == ["line 3: test_rollout", "line 4: test_config", "line 5: test_workflow", "line 6: test_corpus",
                    "line 7: test_io"], seen
    wrong = [f"tests/{p.name} {hit}" for p in sorted(here.glob("*.py")) for hit in test_imports(p.read_text())]
    assert not wrong, "test files import test modules (move what they share into a helper module):\n" + "\n".join(wrong)
