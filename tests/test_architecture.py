"""The house rules of src/mfpipe (docs/architecture.md), checked on every module: imports go down (an experiment
imports the core, never another experiment; the core never imports an experiment), no private name is imported
across modules, no module is over 400 lines, no function over 80, and every package's docstring names each of its
modules."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "mfpipe"
MODULES = sorted(PKG.rglob("*.py"))
# the public reading API opens every experiment's stores; the package's lazy export loads it
MAY_IMPORT_EXPERIMENTS = {"mfpipe", "mfpipe.results"}
MAX_LINES = 400
MAX_FUNCTION_LINES = 80  # from `def` to the function's last line, docstring included (issue 47 item 7)


def dotted(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, imported names) of every mfpipe import in ``path``, relative imports resolved."""
    tree = ast.parse(path.read_text())
    here = dotted(path).split(".")
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
