"""Every import is declared, and the rule environment is pyproject's dependency list (issue 27).

A third-party module imported anywhere (at the top or lazily inside a function) by the library (src/) or the
job scripts (workflow/scripts/) must come from a distribution in pyproject's [project] dependencies; the
benchmarks' and the tests' imports may also come from the `dev` extra (with the extras it includes). A module
no installed distribution provides fails too: it cannot be mapped, so it cannot be declared either.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]

# what may be imported from where: the tree, and the extras (beyond [project] dependencies) it may use
TREES = {
    "src": (),
    "workflow/scripts": (),
    "benchmarks": ("dev",),
    "tests": ("dev",),
}
# trees of scripts run with their own folder on sys.path (a test, a benchmark, a job script), not a package
SCRIPT_TREES = {"workflow/scripts", "benchmarks", "tests"}


def normalize(name: str) -> str:
    """PEP 503's normalised project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(req: str) -> str:
    """The project name of a PEP 508 requirement string (no dependency on `packaging` for this)."""
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    assert m, f"pyproject.toml: cannot read the requirement {req!r}"
    return normalize(m.group(1))


def declared(extras: tuple[str, ...] = ()) -> set[str]:
    """Normalised names of the runtime dependencies plus the given extras, following `mfpipe[...]` self-references."""
    own = normalize(PROJECT["name"])
    out: set[str] = set()
    todo, seen = list(PROJECT["dependencies"]), set()
    todo += [r for e in extras for r in PROJECT["optional-dependencies"][e]]
    while todo:
        req = todo.pop()
        name = requirement_name(req)
        if name != own:
            out.add(name)
            continue
        inner = re.search(r"\[([^\]]*)\]", req)
        for extra in (inner.group(1).split(",") if inner else []):
            extra = extra.strip()
            if extra not in seen:
                seen.add(extra)
                todo += PROJECT["optional-dependencies"][extra]
    return out


def local_modules(path: Path, script: bool) -> set[str]:
    """Names that resolve to the checkout, not to a distribution: mfpipe and, for a script (run with its folder on
    sys.path), the modules beside it and the checkout's top-level folders (e.g. `tests.hub_cache`)."""
    names = {"mfpipe"}
    if script:
        names |= {p.stem for p in path.parent.glob("*.py")} | {p.name for p in path.parent.iterdir() if p.is_dir()}
        names |= {p.name for p in REPO.iterdir() if p.is_dir() and not p.name.startswith(".")}
    return names


def imported_modules(path: Path) -> dict[str, int]:
    """Top-level names of every absolute import in the file, anywhere in it, with the line of the first."""
    out: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            top = name.partition(".")[0]
            out[top] = min(out.get(top, node.lineno), node.lineno)
    return out


def third_party_imports(tree: str) -> dict[str, list[str]]:
    """Third-party top-level module -> where it is imported (`path:line`), for every .py file in the tree."""
    out: dict[str, list[str]] = {}
    files = sorted((REPO / tree).rglob("*.py"))
    assert files, f"no Python files under {tree}/"
    for path in files:
        local = local_modules(path, tree in SCRIPT_TREES)
        for mod, line in imported_modules(path).items():
            if mod in sys.stdlib_module_names or mod in local:
                continue
            out.setdefault(mod, []).append(f"{path.relative_to(REPO)}:{line}")
    return out


def undeclared(imports: dict[str, list[str]], allowed: set[str]) -> list[str]:
    dists = importlib.metadata.packages_distributions()
    problems = []
    for mod, where in sorted(imports.items()):
        provided_by = dists.get(mod)
        if not provided_by:
            problems.append(f"{mod} (imported at {where[0]}) is provided by no installed distribution")
        elif not {normalize(d) for d in provided_by} & allowed:
            problems.append(f"{mod} (imported at {', '.join(where[:3])}) comes from {sorted(set(provided_by))}, "
                            "none of which pyproject.toml declares")
    return problems


@pytest.mark.parametrize("tree", sorted(TREES))
def test_every_import_is_declared(tree):
    problems = undeclared(third_party_imports(tree), declared(TREES[tree]))
    where = "[project] dependencies" + "".join(f" or the {e!r} extra" for e in TREES[tree])
    assert not problems, f"declare in pyproject.toml's {where}: " + "; ".join(problems)


def test_the_check_sees_lazy_imports_and_undeclared_modules(tmp_path):
    """The walk finds an import inside a function, and a module whose distribution is not declared fails."""
    src = tmp_path / "m.py"
    src.write_text("import os\nfrom . import sibling\n\ndef f():\n    from scipy.stats import spearmanr\n"
                   "    import yaml.constructor\n")
    assert imported_modules(src) == {"os": 1, "scipy": 5, "yaml": 6}
    imports = {"scipy": ["m.py:5"], "yaml": ["m.py:6"]}
    assert undeclared(imports, {"scipy", "pyyaml"}) == []  # yaml comes from PyYAML, normalised to pyyaml
    problems = undeclared(imports, {"pyyaml"})
    assert len(problems) == 1 and problems[0].startswith("scipy ")
    assert "provided by no installed distribution" in undeclared({"no_such_module_xyz": ["m.py:1"]}, set())[0]


def test_dev_extra_includes_slurm_and_bench():
    deps = declared(("dev",))
    assert {"pytest", "psutil", "snakemake-executor-plugin-slurm"} <= deps
    # `mfpipe estimate` reads resident memory with psutil: a runtime dependency, which the benchmarks use too
    assert "psutil" in declared()


def _env_pip_list() -> list[str]:
    env = yaml.safe_load((REPO / "workflow" / "envs" / "mfpipe.yaml").read_text())
    pips = [d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d]
    assert len(pips) == 1, "workflow/envs/mfpipe.yaml: expected one `pip:` list"
    return pips[0]


def test_rule_environment_is_pyproject_dependencies():
    """workflow/envs/mfpipe.yaml (every rule's environment under --sdm conda) installs exactly pyproject's
    dependencies, the same specifiers in the same order: one source, copied, cannot drift."""
    squash = lambda reqs: [re.sub(r"\s+", "", r) for r in reqs]  # noqa: E731
    env, project = squash(_env_pip_list()), squash(PROJECT["dependencies"])
    missing = [r for r in project if r not in env]
    extra = [r for r in env if r not in project]
    assert env == project, (f"workflow/envs/mfpipe.yaml's pip list differs from pyproject.toml's dependencies "
                            f"(copy them over): missing {missing}, not in pyproject {extra}"
                            + ("" if missing or extra else ", or in another order"))


def test_rule_environment_python_meets_requires_python():
    env = yaml.safe_load((REPO / "workflow" / "envs" / "mfpipe.yaml").read_text())
    pinned = [d for d in env["dependencies"] if isinstance(d, str) and d.startswith("python")]
    assert len(pinned) == 1
    env_version = tuple(int(x) for x in re.findall(r"\d+", pinned[0])[:2])
    m = re.fullmatch(r">=\s*(\d+)\.(\d+)", PROJECT["requires-python"].strip())
    assert m, PROJECT["requires-python"]
    assert env_version >= (int(m.group(1)), int(m.group(2)))
    assert sys.version_info[:2] >= (int(m.group(1)), int(m.group(2)))
