"""mfpipe.workflow.codedeps: the library files a workflow script depends on, from its imports."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mfpipe.workflow.codedeps import module_dependencies, script_dependencies

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for p in (REPO / "workflow" / "scripts").glob("*.py") if not p.name.startswith("_"))  # job scripts, not helpers


def write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))


@pytest.fixture
def pkg(tmp_path):
    """A synthetic `mfpipe` with every import form the library uses, and modules nothing imports."""
    write(tmp_path / "src", {
        "mfpipe/__init__.py": "",
        "mfpipe/a.py": "from . import b as B\nfrom .sub.c import thing\n",
        "mfpipe/b.py": "import numpy as np\n\ndef f():\n    from mfpipe.lazy import g  # runs when f does\n    return g\n",
        "mfpipe/lazy.py": "g = 1\n",
        "mfpipe/sub/__init__.py": "from .d import D\n",
        "mfpipe/sub/c.py": "thing = 1\n",
        "mfpipe/sub/d.py": "from ..e import E\nD = 1\n",
        "mfpipe/e.py": "E = 1\n",
        "mfpipe/unused.py": "import mfpipe.a\n",
        "mfpipe/sub/unused2.py": "",
    })
    write(tmp_path / "scripts", {
        "s1.py": "import json\nfrom mfpipe.a import x\n",
        "s2.py": "from mfpipe.sub import c\n",
        "s3.py": "import mfpipe.e\n",
        "s4.py": "import torch\n",
    })
    return tmp_path


def names(paths, root):
    return sorted(str(Path(p).relative_to(root / "src")) for p in paths)


def test_transitive_relative_lazy_and_package_imports(pkg):
    src = pkg / "src"
    got = names(script_dependencies(src, pkg / "scripts" / "s1.py"), pkg)
    assert got == ["mfpipe/__init__.py", "mfpipe/a.py", "mfpipe/b.py", "mfpipe/e.py", "mfpipe/lazy.py",
                   "mfpipe/sub/__init__.py", "mfpipe/sub/c.py", "mfpipe/sub/d.py"]


def test_from_package_import_submodule(pkg):
    got = names(script_dependencies(pkg / "src", pkg / "scripts" / "s2.py"), pkg)
    assert got == ["mfpipe/__init__.py", "mfpipe/e.py", "mfpipe/sub/__init__.py", "mfpipe/sub/c.py", "mfpipe/sub/d.py"]


def test_plain_import_and_foreign_packages(pkg):
    assert names(script_dependencies(pkg / "src", pkg / "scripts" / "s3.py"), pkg) == ["mfpipe/__init__.py", "mfpipe/e.py"]
    assert script_dependencies(pkg / "src", pkg / "scripts" / "s4.py") == []


def test_a_module_depends_on_itself_and_what_it_imports(pkg):
    src = pkg / "src"
    got = names(module_dependencies(src, src / "mfpipe" / "unused.py"), pkg)
    assert "mfpipe/unused.py" in got and "mfpipe/a.py" in got and "mfpipe/sub/unused2.py" not in got


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_static_dependencies_cover_what_the_script_really_imports(script):
    """Independent check on the real workflow: import every module the script names at top level in a fresh
    interpreter and record which mfpipe files Python actually executed; the static set must contain them all."""
    static = set(script_dependencies(REPO / "src", script))
    import ast

    tree = ast.parse(script.read_text())
    mods = [a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names if a.name.startswith("mfpipe")]
    mods += [n.module for n in tree.body if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("mfpipe")]
    code = ("import importlib, json, sys\n"
            f"for m in {mods!r}: importlib.import_module(m)\n"
            "print(json.dumps(sorted(getattr(m, '__file__', None) or '' for n, m in sys.modules.items() "
            "if n == 'mfpipe' or n.startswith('mfpipe.'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "PYTHONPATH": str(REPO / "src")})
    assert out.returncode == 0, out.stderr[-3000:]
    executed = {str(Path(f).resolve()) for f in json.loads(out.stdout.splitlines()[-1]) if f}
    assert executed, "the script imports no mfpipe module?"
    missing = executed - static
    assert not missing, f"{script.name}: imported at run time but not declared: {sorted(missing)}"


def test_importlib_and_lazy_exports(tmp_path):
    """A literal importlib.import_module counts like an import; a computed one is refused; a package's lazy
    __getattr__ counts only for `from package import <name it serves>`, not for the package's other users."""
    from mfpipe.workflow.codedeps import UnfollowedImport

    write(tmp_path / "src", {
        "mfpipe/__init__.py": ("try:\n    X = 1\nexcept ImportError:\n    X = 0\n\ndef __getattr__(name):\n    if name == 'heavy':\n"
                               "        from mfpipe.heavy import heavy\n        return heavy\n    raise AttributeError(name)\n"),
        "mfpipe/heavy.py": "heavy = 1\n",
        "mfpipe/light.py": "import importlib\n\ndef f():\n    return importlib.import_module('mfpipe.loops')\n",
        "mfpipe/loops.py": "",
        "mfpipe/computed.py": "import importlib\n\ndef f(n):\n    return importlib.import_module(f'mfpipe.{n}')\n",
    })
    write(tmp_path / "scripts", {
        "plain.py": "import mfpipe\nfrom mfpipe import X\nfrom mfpipe import light\n",
        "lazy.py": "from mfpipe import heavy\n",
        "computed.py": "from mfpipe import computed\n",
    })
    src = tmp_path / "src"
    assert names(script_dependencies(src, tmp_path / "scripts" / "plain.py"), tmp_path) == [
        "mfpipe/__init__.py", "mfpipe/light.py", "mfpipe/loops.py"]
    assert names(script_dependencies(src, tmp_path / "scripts" / "lazy.py"), tmp_path) == [
        "mfpipe/__init__.py", "mfpipe/heavy.py"]
    with pytest.raises(UnfollowedImport, match=r"computed\.py:4: importlib\.import_module of a computed name"):
        script_dependencies(src, tmp_path / "scripts" / "computed.py")


def test_the_real_lazy_exports_are_followed():
    """mfpipe.stats exports the pass lazily: a script importing it from the package depends on pass 1's files."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "s.py"
        script.write_text("from mfpipe.stats import accumulate_shard\n")
        got = {Path(p).relative_to(REPO / "src").as_posix() for p in script_dependencies(REPO / "src", script)}
        assert {"mfpipe/stats/shards.py", "mfpipe/stats/pass1.py", "mfpipe/stats/_native_loops.py"} <= got
        script = Path(d) / "s2.py"  # another file: the analysis caches per file
        script.write_text("from mfpipe.stats import open_stats\n")
        got = {Path(p).relative_to(REPO / "src").as_posix() for p in script_dependencies(REPO / "src", script)}
        assert "mfpipe/stats/pass1.py" not in got and "mfpipe/stats/api.py" in got


def test_the_answers_are_kept_under_a_digest_of_the_sources(pkg, monkeypatch):
    """The workflow plans from a cache of every script's dependencies (.snakemake/mfpipe-code-inputs.json): read back
    while no library file or script changed, derived again (in the next process, as every planning is) after an
    edit that changes them."""
    import mfpipe.workflow.codedeps as C

    src, scripts, cache = pkg / "src", pkg / "scripts", pkg / "cache" / "code-inputs.json"
    first = C.scripts_dependencies(src, scripts, cache=cache)
    assert sorted(first) == ["s1.py", "s2.py", "s3.py", "s4.py"] and cache.is_file()
    assert first["s3.py"] == script_dependencies(src, scripts / "s3.py")

    def parse(*_):
        raise AssertionError("the sources did not change: the cache answers")

    monkeypatch.setattr(C, "script_dependencies", parse)
    assert C.scripts_dependencies(src, scripts, cache=cache) == first
    monkeypatch.undo()
    (src / "mfpipe" / "e.py").write_text("from mfpipe import lazy\nE = 1\n")  # s3 now also runs lazy.py
    code = ("import importlib.util, json; "  # this checkout's codedeps, run on the synthetic package
            f"spec = importlib.util.spec_from_file_location('codedeps', {C.__file__!r}); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
            f"print(json.dumps(m.scripts_dependencies({str(src)!r}, {str(scripts)!r}, cache={str(cache)!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    again = json.loads(out.stdout)
    assert names(again["s3.py"], pkg) == ["mfpipe/__init__.py", "mfpipe/e.py", "mfpipe/lazy.py"], again["s3.py"]
    assert json.loads(cache.read_text())["code"] == again


def test_relative_code_inputs_survive_a_move(pkg, tmp_path_factory, monkeypatch):
    """Issue 60, item 5: with ``relative_to`` (the workflow's working directory) every code input is a path relative
    to it, the absolute answer's relpath; the same checkout copied elsewhere (its cache too) gives the same answer, read
    from the copied cache (its digest names the files relative to the working directory), so Snakemake sees every
    job's input set unchanged."""
    import os
    import shutil

    import mfpipe.workflow.codedeps as C

    src, scripts = pkg / "src", pkg / "scripts"
    absolute = C.code_inputs(src, scripts, runner="")
    rel = C.code_inputs(src, scripts, runner="", cache=pkg / "cache.json", relative_to=pkg)
    assert rel == {k: [os.path.relpath(f, pkg) for f in v] for k, v in absolute.items()}
    assert rel["s1.py"] and all(f.startswith("src/mfpipe/") for v in rel.values() for f in v)
    moved = tmp_path_factory.mktemp("elsewhere") / "checkout"
    shutil.copytree(pkg, moved)

    def parse(*_):
        raise AssertionError("nothing changed but the folder: the copied cache answers")

    monkeypatch.setattr(C, "script_dependencies", parse)
    assert C.code_inputs(moved / "src", moved / "scripts", runner="", cache=moved / "cache.json",
                         relative_to=moved) == rel
    monkeypatch.undo()
    # another working directory than the checkout: the paths lead there from it
    other = C.code_inputs(moved / "src", moved / "scripts", runner="", relative_to=moved / "scripts")
    assert other["s3.py"] == [os.path.join("..", f) for f in rel["s3.py"]]


def test_a_job_depends_on_its_own_part_of_its_jobs_module(tmp_path):
    """Two jobs of one jobs module: each depends on the module's top level, its own body's imports and those of the
    helpers it calls, not on the other job's (so editing one job's science reruns that job only); the module comes
    first (the job script finds it there); find_jobs lists the `def rule(job)` functions only."""
    from mfpipe.workflow.codedeps import code_inputs, find_jobs, job_dependencies

    write(tmp_path / "src", {
        "mfpipe/__init__.py": "",
        "mfpipe/runner.py": "",
        "mfpipe/top.py": "",
        "mfpipe/one.py": "",
        "mfpipe/two.py": "",
        "mfpipe/helper.py": "",
        "mfpipe/exp/__init__.py": "",
        "mfpipe/exp/jobs.py": """\
            from mfpipe import top

            def _shared():
                from mfpipe import helper

            def first(job):
                from mfpipe import one
                _shared()

            def second(job):
                from mfpipe import two

            def not_a_job(x):
                from mfpipe import two
        """,
    })
    write(tmp_path / "scripts", {"job.py": "from mfpipe import runner\n", "old.py": "from mfpipe import one\n"})
    src, run = tmp_path / "src", tmp_path / "scripts" / "job.py"
    first = job_dependencies(src, "mfpipe.exp.jobs", "first", run)
    assert names(first[:1], tmp_path) == ["mfpipe/exp/jobs.py"]
    assert names(first, tmp_path) == sorted(["mfpipe/exp/jobs.py", "mfpipe/__init__.py", "mfpipe/exp/__init__.py",
                                             "mfpipe/runner.py", "mfpipe/top.py", "mfpipe/one.py", "mfpipe/helper.py"])
    second = names(job_dependencies(src, "mfpipe.exp.jobs", "second", run), tmp_path)
    assert "mfpipe/two.py" in second and "mfpipe/one.py" not in second and "mfpipe/helper.py" not in second
    assert find_jobs(src) == {"mfpipe.exp.jobs": ["first", "second"]}
    code = code_inputs(src, tmp_path / "scripts")
    assert set(code) == {"old.py", "mfpipe.exp.jobs:first", "mfpipe.exp.jobs:second"}
    assert code["mfpipe.exp.jobs:first"] == first
    with pytest.raises(KeyError, match="no job function 'third'"):
        job_dependencies(src, "mfpipe.exp.jobs", "third", run)


def test_every_rule_of_the_job_script_names_its_own_job_function():
    """A rule run by workflow/scripts/job.py declares `code=job(package, function)` with `function` its own name (or
    its params.job_function), and that function exists: the job script runs function `rule` of the module."""
    import re

    from mfpipe.workflow.codedeps import find_jobs

    jobs = find_jobs(REPO / "src")
    wrong = []
    for f in sorted((REPO / "workflow" / "rules").glob("*.smk")):
        for block in re.split(r"(?m)^(?=(?:rule|checkpoint) \w+:|\s+rule:|use rule )", f.read_text()):
            if "JOB_SCRIPT" not in block or f.name == "common.smk":
                continue
            job = re.search(r'code=job\("([\w.]+)", "(\w+)"\)', block)
            named = re.match(r"(?:rule|checkpoint) (\w+):", block)
            alias = re.search(r'job_function="(\w+)"', block)
            rule = named.group(1) if named else "(loop)"
            if not job:
                wrong.append(f"{f.name} {rule}: runs the job script without code=job(...)")
                continue
            module, function = f"mfpipe.{job.group(1)}.jobs", job.group(2)
            if function not in jobs.get(module, []):
                wrong.append(f"{f.name} {rule}: {module} has no job function {function}")
            if function != (alias.group(1) if alias else rule):
                wrong.append(f"{f.name} {rule}: declares the code of {function}")
    assert not wrong, "\n".join(wrong)


def test_a_lazy_export_depends_on_its_own_branch_only(tmp_path):
    """A package's lazy __getattr__ split by `if name == ...` / `if name in (...)`: `from package import X` depends on
    X's branch and the statements outside every branch, not on the other names' modules; a name no branch serves
    depends on all of it."""
    write(tmp_path / "src", {
        "mfpipe/__init__.py": "",
        "mfpipe/pkg/__init__.py": ("def __getattr__(name):\n"
                                   "    from mfpipe import always\n"
                                   "    if name in ('light', 'other'):\n        from mfpipe.pkg import read\n        return 1\n"
                                   "    if name == 'heavy':\n        from mfpipe.pkg import loops\n        return 2\n"
                                   "    raise AttributeError(name)\n"),
        "mfpipe/pkg/read.py": "", "mfpipe/pkg/loops.py": "", "mfpipe/always.py": "",
    })
    write(tmp_path / "scripts", {"light.py": "from mfpipe.pkg import light\n",
                                 "heavy.py": "from mfpipe.pkg import heavy\n",
                                 "unknown.py": "from mfpipe.pkg import mystery\n"})
    src = tmp_path / "src"
    base = ["mfpipe/__init__.py", "mfpipe/always.py", "mfpipe/pkg/__init__.py"]
    assert names(script_dependencies(src, tmp_path / "scripts" / "light.py"), tmp_path) == sorted(
        base + ["mfpipe/pkg/read.py"])
    assert names(script_dependencies(src, tmp_path / "scripts" / "heavy.py"), tmp_path) == sorted(
        base + ["mfpipe/pkg/loops.py"])
    assert names(script_dependencies(src, tmp_path / "scripts" / "unknown.py"), tmp_path) == sorted(
        base + ["mfpipe/pkg/loops.py", "mfpipe/pkg/read.py"])


def test_a_jobs_leading_imports_run_before_it_with_the_collector_off(tmp_path, monkeypatch):
    """mfpipe.workflow.runner.import_first runs the imports that open a job function's body (after its docstring),
    so that they happen, as a job script's used to, before run_logged freezes what they made; a later import in the
    body is left to the function."""
    import gc
    import importlib

    from mfpipe.workflow.runner import import_first

    write(tmp_path, {"pkgx/__init__.py": "", "pkgx/b.py": "", "pkgx/c.py": "", "pkgx/d.py": "",
                     "pkgx/jobs.py": ('def job_one(job):\n    """doc"""\n    import pkgx.d\n    from pkgx import b\n'
                                      '    x = 1\n    from pkgx import c\n    return x\n')})
    monkeypatch.syspath_prepend(str(tmp_path))
    jobs = importlib.import_module("pkgx.jobs")  # the synthetic package of tmp_path

    was = gc.isenabled()
    gc.disable()
    try:
        import_first(jobs.job_one)
    finally:
        if was:
            gc.enable()
    assert "pkgx.b" in sys.modules and "pkgx.d" in sys.modules and "pkgx.c" not in sys.modules
    for m in ("pkgx", "pkgx.jobs", "pkgx.b", "pkgx.d"):
        sys.modules.pop(m, None)
