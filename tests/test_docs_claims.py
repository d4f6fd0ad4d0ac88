"""What the documentation claims, checked (issue 60, item 3): every path and every ``mfpipe.…`` name that README.md,
docs/*.md and the library's module docstrings mention exists, and ``snakemake --lint`` has nothing to say about the
workflow on the default config.

Paths are the repository's: a token starting with one of :data:`ROOTS` (``src/``, ``benchmarks/``, ``docs/``,
``config/``, ``workflow/``, ``tests/``, ``examples/``, ``profiles/``, ``.ci/``, or ``mfpipe/``, read under ``src/``),
backticked or not. A path with placeholders is a pattern: ``<name>`` and ``{model}`` (a wildcard), ``*`` and ``…``
match anything, ``{csv,md}`` is each of its alternatives, and a pattern must match at least one file or folder.
Outputs of a run (``results/…``, ``logs/…``, ``.snakemake/…``) are not files of the repository and are not looked
up: they do not start with a root above (``logs/benchmarks/<rule>`` is not ``benchmarks/``); the report test and
tests/test_paper_labels.py check what a run writes. Nor is a path git ignores (``.ci/venv``, which .ci/run makes). A dotted ``mfpipe.a.b`` must import as a module or resolve as an
attribute of one (the longest importable prefix, then ``getattr``)."""

from __future__ import annotations

import ast
import importlib
import itertools
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("src", "benchmarks", "docs", "config", "workflow", "tests", "examples", "profiles", ".ci", "mfpipe")
# a root right after a word, '/', '.', '-' or '~' is inside another path (logs/benchmarks/…, ~/src, $OUT/src)
PATH_RE = re.compile(r"(?<![\w./~$-])((?:%s)/[^\s`'\"()\[\]|]*)" % "|".join(re.escape(r) for r in ROOTS))
DOTTED_RE = re.compile(r"(?<![\w./])mfpipe(?:\.[A-Za-z_]\w*)+")


def documents() -> list[tuple[str, str]]:
    """(where, text) of README.md, docs/*.md and every module docstring of the library."""
    out = [("README.md", (REPO / "README.md").read_text())]
    out += [(str(p.relative_to(REPO)), p.read_text()) for p in sorted((REPO / "docs").glob("*.md"))]
    for p in sorted((REPO / "src" / "mfpipe").rglob("*.py")):
        doc = ast.get_docstring(ast.parse(p.read_text()))
        if doc:
            out.append((str(p.relative_to(REPO)), doc))
    return out


def _candidates(path: str) -> list[str]:
    """The globs a mentioned path stands for (its brace alternatives expanded, placeholders as ``*``)."""
    path = path.rstrip(".,;:")
    path = re.sub(r"<[^>]*>", "*", path).replace("…", "*")
    parts = re.split(r"(\{[^}]*\})", path)
    options = [p[1:-1].split(",") if p.startswith("{") and "," in p else ["*"] if p.startswith("{") else [p]
               for p in parts]
    out = [re.sub(r"\*+", "*", "".join(c)) for c in itertools.product(*options)]  # test_<name>*.py: one *
    return [("src/" + c if c.startswith("mfpipe/") else c) for c in out]


def _ignored(root: Path, path: str) -> bool:
    """Whether git ignores ``path`` (something a command makes, not a file of the repository)."""
    path = path.replace("*", "x").rstrip("/")
    return any(subprocess.run(["git", "-C", str(root), "check-ignore", "-q", p], capture_output=True).returncode == 0
               for p in (path, path + "/"))  # a folder's pattern (/.ci/venv/) matches only with the slash


def missing_paths(text: str, root: Path = REPO) -> list[str]:
    """The paths ``text`` mentions that name nothing under ``root`` (a pattern: that match nothing)."""
    bad = []
    for m in PATH_RE.finditer(text):
        for c in _candidates(m.group(1)):
            found = any(root.glob(c.rstrip("/"))) if "*" in c else (root / c).exists()
            if not found and not _ignored(root, c):
                bad.append(m.group(1).rstrip(".,;:"))
    return sorted(set(bad))


def unresolved_names(text: str) -> list[str]:
    """The ``mfpipe.…`` names ``text`` mentions that are neither a module nor an attribute of one."""
    bad = []
    for name in sorted(set(DOTTED_RE.findall(text))):
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:i]))
                break
            except ModuleNotFoundError:
                continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            bad.append(name)
    return bad


def test_every_path_the_docs_name_exists():
    bad = [f"{where}: {p}" for where, text in documents() for p in missing_paths(text)]
    assert not bad, "paths named in the docs that do not exist:\n" + "\n".join(bad)


def test_every_mfpipe_name_the_docs_use_resolves():
    bad = [f"{where}: {n}" for where, text in documents() for n in unresolved_names(text)]
    assert not bad, "mfpipe names in the docs that are no module or attribute:\n" + "\n".join(bad)


def test_the_checks_see_what_dangles():
    """Non-triviality: a missing file, a pattern that matches nothing and a name that does not resolve are found;
    a pattern that matches, brace alternatives that exist, a run's output and a path inside another are not."""
    text = ("See `docs/nowhere.md`, src/mfpipe/experiments/<name>/nothing.py and mfpipe.stats.no_such_function; "
            "`src/mfpipe/experiments/<name>/rules.py`, config/{ci,config}.yaml, `results/tables/x_{model}.csv`, "
            "logs/benchmarks/<rule>/x.tsv, mfpipe.stats.api.MeanFieldStats.W and `mfpipe/workflow/codedeps.py`.")
    assert missing_paths(text) == ["docs/nowhere.md", "src/mfpipe/experiments/<name>/nothing.py"]
    assert unresolved_names(text) == ["mfpipe.stats.no_such_function"]
    assert missing_paths("config/{ci,nothing}.yaml") == ["config/{ci,nothing}.yaml"]


@pytest.mark.slow
def test_snakemake_lint_is_silent_on_the_default_config(tmp_path):
    """`snakemake --lint` on the default config prints its verdict and nothing else: no lint, no warning."""
    from workflow_runs import clone

    wd = clone(tmp_path)
    out = subprocess.run([sys.executable, "-m", "snakemake", "--lint", "--snakefile", str(wd / "Snakefile"),
                          "--directory", str(wd)], capture_output=True, text=True, timeout=900, cwd=wd)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    allowed = re.compile(r"Using workflow specific profile \S*profiles/default for setting default command line "
                         r"arguments\.|Congratulations, your workflow is in a good condition!")
    extra = [line for line in text.splitlines() if line.strip() and not allowed.fullmatch(line.strip())]
    assert "Congratulations, your workflow is in a good condition!" in text and not extra, "\n".join(extra)
