"""Which library files a workflow script's result depends on, derived from its imports.

Every rule declares these files as inputs, so editing a module reruns exactly the jobs whose script imports
it, directly or through other modules -- and a rule cannot forget one (hand-written lists drift).

The rule is static and deliberately coarse: every ``import`` / ``from … import`` statement of ``mfpipe``
anywhere in a file counts, including imports inside functions (a lazy import still runs when the function
does), and importing ``mfpipe.<a>.<b>`` also depends on the package files ``mfpipe/__init__.py`` and
``mfpipe/<a>/__init__.py`` that Python executes first. ``from mfpipe.<a> import <b>`` depends on the submodule
``mfpipe/<a>/<b>.py`` when there is one. ``importlib.import_module("mfpipe.<x>")`` with a literal name counts like
``import mfpipe.<x>``; with a computed name it cannot be followed, and is refused (:class:`UnfollowedImport`):
write the import statically. Non-``mfpipe`` imports (torch, numpy, …) are not followed: their versions are the
software environment's business, not a code input.

A package's module-level ``__getattr__`` (a lazy export, as :mod:`mfpipe` and :mod:`mfpipe.stats` have) runs only
when a name the package does not define is asked for: its imports count for ``from package import name`` where
``name`` is neither a submodule nor bound at the package's top level, and not for the package's other users. So
``import mfpipe`` stays a dependency on ``mfpipe/__init__.py`` alone. (Attribute access on an imported package,
``mfpipe.open_results(...)``, is not followed: job scripts import names, and the workflow's touch test checks at run
time that every mfpipe module a job has loaded is one of its code inputs.)

Pure standard library: the Snakefile calls it while it builds the DAG.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
from pathlib import Path

__all__ = ["script_dependencies", "module_dependencies", "scripts_dependencies", "job_dependencies", "find_jobs",
           "code_inputs", "UnfollowedImport"]

PACKAGE = "mfpipe"


def _module_file(src: Path, dotted: str) -> Path | None:
    """The file of module ``dotted`` under ``src`` (``pkg/__init__.py`` for a package), or None."""
    base = src.joinpath(*dotted.split("."))
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


def _dotted_of(src: Path, path: Path) -> tuple[str, bool]:
    """(dotted name, is_package) of a file under ``src``."""
    rel = path.relative_to(src).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


class UnfollowedImport(ValueError):
    """An ``importlib.import_module`` of a computed name: its target is not known until the code runs."""


def _lazy_getattr(tree: ast.Module) -> ast.FunctionDef | None:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            return node
    return None


def _walk_skipping(tree: ast.AST, skip: ast.AST | None):
    """ast.walk without the subtree ``skip``."""
    todo = [tree]
    while todo:
        node = todo.pop()
        if node is skip:
            continue
        yield node
        todo.extend(ast.iter_child_nodes(node))


def _import_module_target(node: ast.Call, where: str) -> str | None:
    """The module an ``importlib.import_module(...)`` call loads, when it names an mfpipe module."""
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    if name != "import_module" or not node.args:
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value if arg.value.split(".")[0] == PACKAGE else None
    raise UnfollowedImport(f"{where}:{node.lineno}: importlib.import_module of a computed name cannot be followed "
                           "by mfpipe.workflow.codedeps; import the module statically (inside the function, to keep it lazy)")


def _imported_names(tree: ast.AST, current: str | None, is_package: bool, skip: ast.AST | None = None,
                    where: str = "") -> set[str]:
    """Dotted names a file imports (absolute; relative imports resolved against ``current``), leaving out the
    subtree ``skip`` (a package's lazy ``__getattr__``)."""
    names: set[str] = set()
    for node in _walk_skipping(tree, skip):
        if isinstance(node, ast.Call):
            target = _import_module_target(node, where)
            if target:
                names.add(target)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if current is None:
                    continue  # a relative import in a script outside the package: not ours
                pkg = current.split(".") if is_package else current.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)] if node.level > 1 else pkg
                base = ".".join(pkg + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names if a.name != "*")
    return {n for n in names if n == PACKAGE or n.startswith(PACKAGE + ".")}


def _files_for(src: Path, dotted: str) -> list[Path]:
    """The files Python executes to import ``dotted``: each enclosing package's ``__init__`` and the module."""
    parts = dotted.split(".")
    out = []
    for i in range(1, len(parts) + 1):
        f = _module_file(src, ".".join(parts[:i]))
        if f is None:
            break  # `from mfpipe.x import name`: `name` is an attribute, not a module
        out.append(f)
    return out


@functools.lru_cache(maxsize=None)
def _parsed(src: Path, path: Path):
    """(tree, dotted name or None, is_package, lazy ``__getattr__`` node of a package or None)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    try:
        current, is_package = _dotted_of(src, path)
    except ValueError:
        current, is_package = None, False
    return tree, current, is_package, (_lazy_getattr(tree) if is_package else None)


def _top_level_names(tree: ast.Module) -> set[str]:
    """Names a module binds at its top level (assignments, defs, classes, imports)."""
    out: set[str] = set()
    body = list(tree.body)
    while body:
        node = body.pop()
        if isinstance(node, (ast.If, ast.Try, ast.With)):  # bound at import time whichever branch runs
            body += node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", [])
            body += [s for h in getattr(node, "handlers", []) for s in h.body]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for tgt in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                out.update(n.id for n in ast.walk(tgt) if isinstance(n, ast.Name))
    return out


def _lazy_files(src: Path, package_init: Path, names: set[str]) -> set[Path]:
    """What a package's lazy ``__getattr__`` loads for ``from package import names`` (none when every name is a
    submodule or bound at the package's top level)."""
    tree, current, is_package, lazy = _parsed(src, package_init)
    if lazy is None:
        return set()
    bound = _top_level_names(tree)
    pkg_dir = package_init.parent
    asked = {n for n in names if n not in bound and _module_file(src, f"{current}.{n}") is None}
    if not asked or not pkg_dir.is_dir():
        return set()
    branches, common = _lazy_branches(lazy)
    if asked - set(branches):  # a name no branch of its own serves: whatever the function imports
        parts = [lazy]
    else:
        parts = common + [stmt for n in sorted(asked) for stmt in branches[n]]
    files: set[Path] = set()
    for part in parts:
        for name in _imported_names(part, current, is_package, where=str(package_init)):
            files.update(_files_for(src, name))
    return files


def _branch_names(test: ast.AST) -> list[str] | None:
    """The names an ``if name == "X"`` / ``if name in ("X", "Y")`` test of a lazy ``__getattr__`` selects, or None."""
    if not (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and len(test.ops) == 1):
        return None
    op, right = test.ops[0], test.comparators[0]
    if isinstance(op, ast.Eq) and isinstance(right, ast.Constant) and isinstance(right.value, str):
        return [right.value]
    if isinstance(op, ast.In) and isinstance(right, (ast.Tuple, ast.List, ast.Set)) and all(
            isinstance(e, ast.Constant) and isinstance(e.value, str) for e in right.elts):
        return [e.value for e in right.elts]
    return None


def _lazy_branches(lazy: ast.FunctionDef) -> tuple[dict[str, list[ast.AST]], list[ast.AST]]:
    """A lazy ``__getattr__`` split by the name asked for: ``{name: the statements of its branch}`` (one
    ``if name == "X":`` or ``if name in (...):`` per group of names) and the statements outside every branch, whose
    imports count for every name. So ``from mfpipe.stats import open_stats`` depends on the read side's modules, not on
    the pass the same package exports lazily too."""
    branches: dict[str, list[ast.AST]] = {}
    common: list[ast.AST] = []
    for stmt in lazy.body:
        names = _branch_names(stmt.test) if isinstance(stmt, ast.If) and not stmt.orelse else None
        if names is None:
            common.append(stmt)
            continue
        for n in names:
            branches.setdefault(n, []).extend(stmt.body)
    return branches, common


@functools.lru_cache(maxsize=None)
def _direct(src: Path, path: Path) -> frozenset[Path]:
    tree, current, is_package, lazy = _parsed(src, path)
    return _direct_of_tree(src, path, tree, current, is_package, lazy)


def _direct_of_tree(src: Path, path: Path, tree: ast.AST, current, is_package: bool, lazy) -> frozenset[Path]:
    """The files the imports in ``tree`` (all of ``path``'s, or a job's part of it) execute first-hand."""
    files: set[Path] = set()
    for name in _imported_names(tree, current, is_package, skip=lazy, where=str(path)):
        files.update(_files_for(src, name))
    # `from package import name` served by the package's lazy __getattr__
    for node in _walk_skipping(tree, lazy):
        if isinstance(node, ast.ImportFrom) and node.names[0].name != "*":
            if node.level:
                if current is None:
                    continue
                pkg = current.split(".") if is_package else current.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)] if node.level > 1 else pkg
                base = ".".join(pkg + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base.split(".")[0] != PACKAGE:
                continue
            init = _module_file(src, base)
            if init is not None and init.name == "__init__.py":
                files.update(_lazy_files(src, init, {a.name for a in node.names}))
    return frozenset(files)


def module_dependencies(src: str | Path, paths) -> list[Path]:
    """Every file under ``src/mfpipe`` that importing or running ``paths`` executes (transitively), sorted.

    ``src`` is the folder holding the ``mfpipe`` package; ``paths`` are Python files (scripts or modules)."""
    src = Path(src).resolve()
    todo = [Path(p).resolve() for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
    seen: set[Path] = set()
    while todo:
        p = todo.pop()
        for dep in _direct(src, p):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    for p in [Path(q).resolve() for q in ([paths] if isinstance(paths, (str, Path)) else paths)]:
        if p.is_relative_to(src):
            seen.add(p)
    return sorted(seen)


def script_dependencies(src: str | Path, script: str | Path) -> list[str]:
    """The library files a workflow script depends on (strings, for a rule's ``input:``)."""
    return [str(p) for p in module_dependencies(src, script)]


def _job_part(tree: ast.Module, function: str, where: str) -> ast.Module:
    """The part of a jobs module that running job ``function`` executes: its top-level statements with the bodies of
    only those top-level functions that ``function`` reaches by name (itself, the helpers it calls, theirs, ...).
    A job's lazy imports sit in its own body, so two jobs of one module depend on their own imports only."""
    defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    if function not in defs:
        raise KeyError(f"{where} defines no job function {function!r}")
    reached, todo = set(), [function]
    while todo:
        name = todo.pop()
        if name in reached:
            continue
        reached.add(name)
        todo += [n.id for n in ast.walk(defs[name]) if isinstance(n, ast.Name) and n.id in defs]
    body = [n for n in tree.body if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) or n.name in reached]
    return ast.Module(body=body, type_ignores=[])


def job_dependencies(src: str | Path, module: str, function: str, runner: str | Path) -> list[str]:
    """The library files job ``module.function`` depends on when the workflow's one job script ``runner`` runs it
    (strings, for a rule's ``input:``; the jobs module's file first, which is how the runner finds it): what the
    runner imports, the module's packages, and what the module's top level and the job's part of it import
    (:func:`_job_part`), transitively."""
    src = Path(src).resolve()
    path = _module_file(src, module)
    if path is None or path.name == "__init__.py":
        raise KeyError(f"no jobs module {module} under {src}")
    tree, current, is_package, lazy = _parsed(src, path)
    part = _job_part(tree, function, str(path))
    direct = set(_direct_of_tree(src, path, part, current, is_package, lazy)) - {path}
    inits = [f for f in _files_for(src, module) if f != path]
    deps = set(module_dependencies(src, [*direct, *inits, Path(runner)])) | {path}
    return [str(path)] + [str(p) for p in sorted(deps - {path})]


def find_jobs(src: str | Path) -> dict[str, list[str]]:
    """Every job function of the library, ``{module: [function, ...]}``: the public top-level functions whose one
    parameter is ``job`` in the modules named ``jobs.py`` (a package's jobs, one function per rule)."""
    src = Path(src).resolve()
    out = {}
    for path in sorted((src / PACKAGE).rglob("jobs.py")):
        tree = _parsed(src, path)[0]
        names = [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")
                 and [a.arg for a in n.args.args] == ["job"]]
        if names:
            out[_dotted_of(src, path)[0]] = names
    return out


def _sources_digest(src: Path, scripts: list[Path], relative_to: Path | None = None) -> str:
    """A digest of what the dependencies are derived from: every library file's and script's path (relative to
    ``relative_to`` where given, as the answer is: a moved checkout keeps its digest) and bytes."""
    h = hashlib.sha256()
    for f in sorted([*(src / PACKAGE).rglob("*.py"), *scripts]):
        name = os.path.relpath(f, relative_to) if relative_to is not None else str(f)
        h.update(name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def code_inputs(src: str | Path, scripts_dir: str | Path, runner: str = "job.py",
                cache: str | Path | None = None, relative_to: str | Path | None = None) -> dict[str, list[str]]:
    """The code inputs of every job: ``{"module:function": files}`` for each job function (:func:`find_jobs`, run
    by the script ``runner`` of ``scripts_dir``) and ``{script name: files}`` for each other script of
    ``scripts_dir`` (:func:`script_dependencies`). With ``cache`` (a JSON file) the answer is kept there under a
    digest of the sources (every library file and script, path and bytes), so a workflow that is planned again
    with the same code reads it instead of parsing the library (a second or two each time the Snakefile is read:
    every run, every dry run and, on a cluster, every job).

    ``relative_to`` (the workflow's working directory): the files as paths relative to it, not absolute. Snakemake
    records each job's input paths and, by default (``--rerun-triggers input``), reruns a job whose set of inputs
    changed: absolute paths would make a checkout moved or copied with its results (renamed, on another mount)
    plan every job again though no file changed."""
    src = Path(src).resolve()
    scripts = sorted(Path(scripts_dir).resolve().glob("*.py"))
    base = Path(relative_to).resolve() if relative_to is not None else None
    digest = _sources_digest(src, scripts, base) if cache is not None else None
    if cache is not None:
        try:
            held = json.loads(Path(cache).read_text())
            if held.get("digest") == digest:
                return held["code"]
        except (OSError, ValueError, KeyError, AttributeError):
            pass  # no cache yet, or one this function cannot read: derive the answer again
    out = {p.name: script_dependencies(src, p) for p in scripts if p.name != runner}
    run = Path(scripts_dir).resolve() / runner
    for module, functions in (find_jobs(src) if runner else {}).items():
        for f in functions:
            out[f"{module}:{f}"] = job_dependencies(src, module, f, run)
    if base is not None:
        out = {k: [os.path.relpath(p, base) for p in files] for k, files in out.items()}
    if cache is not None:
        try:  # written whole then renamed: workflows read while planning (a cluster's jobs) never see half of it
            Path(cache).parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(cache).with_name(f".{Path(cache).name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"digest": digest, "code": out}))
            os.replace(tmp, cache)
        except OSError:
            pass  # a read-only working directory: plan without the cache
    return out


def scripts_dependencies(src: str | Path, scripts_dir: str | Path, cache: str | Path | None = None) -> dict[str, list[str]]:
    """:func:`script_dependencies` of every ``*.py`` of ``scripts_dir``, by file name (:func:`code_inputs` without
    the jobs)."""
    return {k: v for k, v in code_inputs(src, scripts_dir, runner="", cache=cache).items() if ":" not in k}
