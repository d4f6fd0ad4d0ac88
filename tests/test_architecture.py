"""The house rules of src/mfpipe (docs/architecture.md), checked on every module: imports go down (an experiment
imports the core, never another experiment; the core never imports an experiment; the module graph has no cycle
and every import goes to the same or a lower layer, never to an enclosing package), no private name is imported
across modules, no module is over 400 lines and no function over 80, at most six modules sit loose beside the
packages, and every package's docstring names each of its modules as a module. The job scripts of workflow/scripts are
held to the same import rule. Past the import statements: no module below the public APIs reaches a higher layer by
name at run time (sys.modules, importlib), and workflow/rules/common.smk holds no experiment's code. Each check is
shown to see a violation fed to it."""

import ast
import pathlib
import re
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


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """The edges of ``graph`` that go to a higher layer (a core module importing the notebook API, say)."""
    return [f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})" for a, bs in graph.items() for b in bs
            if layer(b) > layer(a)]


def test_the_import_graph_is_acyclic_and_goes_down():
    graph = import_graph()
    assert not cycles(graph), cycles(graph)
    up = upward_imports(graph)
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


def names_module(doc: str, package: str, member: str) -> bool:
    """Whether docstring ``doc`` of ``package`` names its module (or subpackage) ``member`` AS a module, not merely
    uses the word: by its dotted name (``mfpipe.deviation.contexts``, e.g. in :mod:`~mfpipe.deviation.contexts`) or
    by its bare name in backticks, alone or as its file or folder (`` `contexts` ``, ````contexts````, ``contexts.py``,
    ``adapters/``). The word in prose ("its top contexts") does not count."""
    if re.search(rf"(?<![\w.]){re.escape(f'{package}.{member}')}(?!\w)", doc):
        return True
    return re.search(rf"`{re.escape(member)}(?:\.py|/)?`", doc) is not None


def missing_from_docstring(init: Path) -> list[str]:
    """The modules and subpackages of the package of ``init`` its docstring does not name (:func:`names_module`)."""
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    members = [p.stem for p in init.parent.glob("*.py") if p.name != "__init__.py" and not p.stem.startswith("_")]
    members += [p.name for p in init.parent.iterdir() if (p / "__init__.py").is_file()]
    package = ".".join(init.parent.relative_to(init.parents[len(dotted_parts(init))]).parts)
    return sorted(m for m in members if not names_module(doc, package, m)) if doc else ["(no docstring)"]


def dotted_parts(init: Path) -> list[str]:
    """The package of ``init`` as its path parts below the folder holding ``mfpipe``."""
    parts = list(init.parent.parts)
    return parts[len(parts) - 1 - parts[::-1].index("mfpipe"):]


@pytest.mark.parametrize("init", sorted(PKG.rglob("__init__.py")), ids=lambda p: dotted(p))
def test_every_package_docstring_names_its_modules(init):
    if init.parent == PKG:
        return  # the top-level package: docs/architecture.md is its map
    missing = missing_from_docstring(init)
    assert not missing, f"{dotted(init)}'s docstring does not name {missing} as modules (names_module)"


def test_the_docstring_check_sees_a_module_only_mentioned_in_prose(tmp_path):
    """Issue 60 item 1: a module whose name is only a word of the prose ("its top contexts") is missing; named by its
    dotted name, in backticks or as its file, it is not."""
    pkg = tmp_path / "mfpipe" / "toy"
    pkg.mkdir(parents=True)
    for m in ("contexts", "store", "base", "rules"):
        (pkg / f"{m}.py").write_text("")
    (pkg / "adapters").mkdir()
    (pkg / "adapters" / "__init__.py").write_text("")
    (pkg / "_private.py").write_text("")
    doc = ("Every head's deviation with its top contexts, and its store rules.\n\n"
           "- :mod:`~mfpipe.toy.store` — the store.\n- ``base.py`` — the base.\n- `adapters/` — the adapters.\n")
    (pkg / "__init__.py").write_text(f'"""{doc}"""\n')
    assert missing_from_docstring(pkg / "__init__.py") == ["contexts", "rules"]
    (pkg / "__init__.py").write_text(f'"""{doc}- ``contexts`` and :mod:`mfpipe.toy.rules`.\n"""\n')
    assert missing_from_docstring(pkg / "__init__.py") == []
    (pkg / "__init__.py").write_text("X = 1\n")
    assert missing_from_docstring(pkg / "__init__.py") == ["(no docstring)"]
    # the dotted name of another package's module, or a longer name, is not this one
    assert not names_module("see mfpipe.toy.contexts2 and mfpipe.other.contexts", "mfpipe.toy", "contexts")


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


# ------------------------------------------------------------------ issue 60 item 1: the slices kept whole
RULES_DIR = SRC.parent / "workflow" / "rules"


def without_comments(text: str) -> str:
    """``text`` (Python or a Snakemake rule file) with its comments blanked out (the tokenizer finds them)."""
    import io
    import tokenize

    lines = text.splitlines(keepends=True)
    for tok in reversed([t for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type == tokenize.COMMENT]):
        (row, a), (_, b) = tok.start, tok.end
        lines[row - 1] = lines[row - 1][:a] + " " * (b - a) + lines[row - 1][b:]
    return "".join(lines)


def common_smk_problems(common: str, rule_files: dict[str, str], core: set[str], experiments: set[str]) -> list[str]:
    """What in common.smk (``common``, its text) is an experiment's, given the other rule files' texts by stem, the
    core stages' rule files (``core``) and every slice that is not core (``experiments``: the experiment packages and
    every other rule file). common.smk holds the helpers every rule file uses, so

    - every name it defines at the top level (a ``def`` or an assignment; an alias of the run's plan, ``X = PLAN.x``,
      is the plan's, not a helper) is used by the Snakefile, a core stage's rule file or common.smk itself: a helper
      that only experiments' rule files use is theirs (their ``rules`` module, or their own rule file);
    - its code (comments aside) names no experiment: no ``<name>_rules``, no ``config["<name>"]`` (an experiment's
      section is read in its own rule file), no ``mfpipe.experiments.<name>``."""
    code = without_comments(common)
    defined = set(re.findall(r"^def (\w+)", code, re.M))
    for lhs in re.findall(r"^(\w+(?:\s*,\s*\w+)*)\s*=(?!=)(.*)$", code, re.M):
        if not re.fullmatch(r"\s*PLAN\.\w+\s*", lhs[1]):
            defined |= {n.strip() for n in lhs[0].split(",")}
    users = {stem: without_comments(text) for stem, text in rule_files.items()}
    wrong = []
    for name in sorted(defined):
        word = re.compile(rf"(?<![\w.]){re.escape(name)}\b")
        shared = len(word.findall(code)) > 1 or any(word.search(users[s]) for s in users if s in core)
        if not shared:
            only = sorted(s for s in users if word.search(users[s]))
            wrong.append(f"common.smk defines {name}, which only {only or 'no rule file'} use: move it to that slice "
                         "(its rules module or its own rule file)")
    for exp in sorted(experiments):
        for rx in (rf"\b{exp}_rules\b", rf"config\[\s*[\"']{exp}[\"']\s*\]", rf"experiments\.{exp}\b"):
            for m in re.finditer(rx, code):
                wrong.append(f"common.smk names the slice {exp} ({m.group(0)}): its code belongs to its own files")
    return wrong


def workflow_slices(rules_dir: Path, src: Path) -> tuple[str, dict[str, str], set[str], set[str]]:
    """(common.smk's text, {stem: text} of the other rule files and the Snakefile, the core stages' rule files as
    common.smk lists them, the other slices: every experiment package and every other rule file)."""
    common = (rules_dir / "common.smk").read_text()
    listed = {k: ast.literal_eval(v) for k, v in re.findall(r"^(CORE_RULE_FILES|LAST_RULE_FILES) = (\[.*\])", common, re.M)}
    core = set(listed["CORE_RULE_FILES"]) | set(listed["LAST_RULE_FILES"]) | {"Snakefile"}
    files = {p.stem: p.read_text() for p in rules_dir.glob("*.smk") if p.stem != "common"}
    files["Snakefile"] = (rules_dir.parents[1] / "Snakefile").read_text()
    experiments = {p.parent.name for p in (src / "mfpipe" / "experiments").glob("*/__init__.py")}
    return common, files, core, experiments | (set(files) - core)


def test_common_smk_holds_no_experiments_code():
    common, files, core, experiments = workflow_slices(RULES_DIR, SRC)
    assert {"rollout", "substitution", "exclusion"} <= experiments and "deviation" in core
    wrong = common_smk_problems(common, files, core, experiments)
    assert not wrong, "\n".join(wrong)


def test_the_common_smk_check_sees_an_experiments_helper(tmp_path):
    """Issue 60 item 1: an input function of one experiment added to common.smk (used by its rule file only), an alias of
    an experiment's config section, or an experiment's rules module named there, is found; a shared helper is not."""
    import shutil

    rules = tmp_path / "workflow" / "rules"
    shutil.copytree(RULES_DIR, rules)
    shutil.copy2(SRC.parent / "Snakefile", tmp_path / "Snakefile")
    (tmp_path / "src" / "mfpipe" / "experiments").mkdir(parents=True)
    shutil.copytree(PKG / "experiments" / "substitution", tmp_path / "src" / "mfpipe" / "experiments" / "substitution")
    common = rules / "common.smk"
    text = common.read_text()
    assert not common_smk_problems(*workflow_slices(rules, tmp_path / "src"))
    helper = ('\n\ndef training_summary(wildcards):\n    """A mini model\'s training.json."""\n'
              '    return [f"{R}/minisuite/{wildcards.model}/training.json"]\n')
    common.write_text(text + helper)
    sub = rules / "substitution.smk"
    sub.write_text(sub.read_text().replace("lambda wc: minisuite_rules.training_summary(PLAN, wc)", "training_summary"))
    assert common_smk_problems(*workflow_slices(rules, tmp_path / "src")) == [
        "common.smk defines training_summary, which only ['substitution'] use: move it to that slice (its rules module "
        "or its own rule file)"]
    common.write_text(text + '\nSUBSTITUTION = config["substitution"]  # used below\nK = SUBSTITUTION["kernels"]\n')
    found = common_smk_problems(*workflow_slices(rules, tmp_path / "src"))
    assert any('names the slice substitution (config["substitution"])' in w for w in found), found
    assert any("defines K, which only no rule file" in w for w in found), found
    common.write_text(text + "\nx = substitution_rules.topn(PLAN)\n")
    assert any("substitution_rules" in w for w in common_smk_problems(*workflow_slices(rules, tmp_path / "src")))
    # a helper a core stage's rule file uses is shared; the same text as a comment names nothing
    common.write_text(text + '\n# substitution_rules, config["substitution"]\n\ndef cpu_only():\n    return 1\n')
    (rules / "stats.smk").write_text((rules / "stats.smk").read_text() + "\n# cpu_only\nX_CPU = cpu_only()\n")
    assert not common_smk_problems(*workflow_slices(rules, tmp_path / "src"))


# calls that load a module named by a string at run time, past the import statements the graph checks
LOADERS = {"import_module", "__import__", "find_spec"}
WORKFLOW_OBJECT = "__main__"  # where a Snakemake job keeps its `snakemake` object: the workflow's, layer 2


def run_time_reaches(source: str) -> list[tuple[int, str]]:
    """(line, name) of every module ``source`` reaches by name at run time rather than by an import statement:
    ``sys.modules[...]``, ``sys.modules.get(...)``, ``importlib.import_module(...)``, ``__import__(...)`` and
    ``find_spec(...)``; ``?`` for a name computed at run time."""
    def is_sys_modules(node) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "modules" and isinstance(node.value, ast.Name)
                and node.value.id == "sys") or (isinstance(node, ast.Name) and node.id == "modules")

    out = []
    for node in ast.walk(ast.parse(source)):
        arg = None
        if isinstance(node, ast.Subscript) and is_sys_modules(node.value):
            arg = node.slice
        elif isinstance(node, ast.Call) and node.args:
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name in LOADERS or (name == "get" and isinstance(f, ast.Attribute) and is_sys_modules(f.value)):
                arg = node.args[0]
        if arg is not None:
            literal = isinstance(arg, ast.Constant) and isinstance(arg.value, str)
            out.append((node.lineno, arg.value if literal else "?"))
    return sorted(out)


def reaches_up(path: Path, module: str) -> list[str]:
    """The run-time reaches of ``path`` (module ``module``) to a module above its layer: an mfpipe module of a higher
    layer (the package itself, whose lazy exports load the notebook and reading APIs, is the top), or from the core
    and the leaf plumbing the workflow's job object or a name computed at run time (which no check can follow)."""
    me, wrong = layer(module), []
    for line, name in run_time_reaches(path.read_text()):
        if name == "?" and me < 2:  # the workflow's runner loads each rule's job module by name: that is its job
            wrong.append(f"{module}:{line} reaches a module by a computed name from layer {me}")
        elif name == WORKFLOW_OBJECT and me < 2:
            wrong.append(f"{module}:{line} reaches the workflow's job object ({name}) from layer {me}")
        elif name.split(".")[0] == "mfpipe" and layer(name) > me:
            wrong.append(f"{module}:{line} reaches {name} (layer {layer(name)}) from layer {me} at run time")
    return wrong


def test_no_module_reaches_up_at_run_time():
    """Issue 60 item 1: below the public APIs, no module reaches a higher layer by name at run time (the notebook API,
    the package's lazy exports, the workflow's job object from the core): the import graph's rule holds past the
    import statements."""
    wrong = [w for p in MODULES for w in reaches_up(p, dotted(p))]
    assert not wrong, "\n".join(wrong)


def test_the_run_time_check_sees_a_core_module_reaching_the_notebook(tmp_path):
    """Issue 60 item 1: a core module importing the notebook package statically (the graph's upward import) or
    reaching it by name at run time (``sys.modules["mfpipe"]``'s lazy exports, ``importlib.import_module``,
    ``__import__``), or reaching the workflow's job object, is found; a third-party name is not."""
    global SRC
    bad = tmp_path / "mfpipe" / "deviation" / "bad.py"
    bad.parent.mkdir(parents=True)
    bad.write_text("from mfpipe.notebook import analysis\n")
    (tmp_path / "mfpipe" / "notebook").mkdir()
    (tmp_path / "mfpipe" / "notebook" / "analysis.py").write_text("")
    old, SRC = SRC, tmp_path
    try:
        graph = import_graph([bad, tmp_path / "mfpipe" / "notebook" / "analysis.py"])
    finally:
        SRC = old
    assert upward_imports(graph) == ["mfpipe.deviation.bad (layer 1) imports mfpipe.notebook.analysis (layer 4)"]
    source = ("import importlib, sys\n"
              "def f(x):\n"
              "    getattr(sys.modules['mfpipe'], '_notebook_deviation')(x)\n"
              "    importlib.import_module('mfpipe.notebook.analysis')\n"
              "    __import__('mfpipe.notebook')\n"
              "    sys.modules.get('__main__')\n"
              "    importlib.import_module(x)\n"
              "    importlib.util.find_spec('numba')\n"
              "    sys.modules['mfpipe.stats.api']\n")
    bad.write_text(source)
    assert run_time_reaches(source) == [(3, "mfpipe"), (4, "mfpipe.notebook.analysis"), (5, "mfpipe.notebook"),
                                        (6, "__main__"), (7, "?"), (8, "numba"), (9, "mfpipe.stats.api")]
    assert [w.split(" ", 1)[1] for w in reaches_up(bad, "mfpipe.deviation.bad")] == [
        "reaches mfpipe (layer 4) from layer 1 at run time",
        "reaches mfpipe.notebook.analysis (layer 4) from layer 1 at run time",
        "reaches mfpipe.notebook (layer 4) from layer 1 at run time",
        "reaches the workflow's job object (__main__) from layer 1",
        "reaches a module by a computed name from layer 1"]
    assert reaches_up(bad, "mfpipe.notebook.inputs") == []  # the notebook's own layer may
