"""Which library files a workflow script's result depends on, derived from its imports.

Every rule declares these files as inputs, so editing a module reruns exactly the jobs whose script imports
it, directly or through other modules -- and a rule cannot forget one (hand-written lists drift).

The rule is static and deliberately coarse: every ``import`` / ``from … import`` statement of ``mfpipe``
anywhere in a file counts, including imports inside functions (a lazy import still runs when the function
does), and importing ``mfpipe.a.b`` also depends on the package files ``mfpipe/__init__.py`` and
``mfpipe/a/__init__.py`` that Python executes first. ``from mfpipe.a import b`` depends on the submodule
``mfpipe/a/b.py`` when there is one. Non-``mfpipe`` imports (torch, numpy, …) are not followed: their
versions are the software environment's business, not a code input.

Pure standard library: the Snakefile calls it while it builds the DAG.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

__all__ = ["script_dependencies", "module_dependencies"]

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


def _imported_names(tree: ast.AST, current: str | None, is_package: bool) -> set[str]:
    """Dotted names a file imports (absolute; relative imports resolved against ``current``)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
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
def _direct(src: Path, path: Path) -> frozenset[Path]:
    tree = ast.parse(path.read_text(), filename=str(path))
    try:
        current, is_package = _dotted_of(src, path)
    except ValueError:
        current, is_package = None, False
    files: set[Path] = set()
    for name in _imported_names(tree, current, is_package):
        files.update(_files_for(src, name))
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
