"""The installed wheel works on its own: run by .ci/run from a folder outside the checkout, in a fresh virtual
environment holding torch and the mfpipe wheel (non-editable) with its declared dependencies only.

    python wheel-check.py CONFIG.yaml

Checks that mfpipe is the site-packages copy (not the checkout's src/), that every module of it imports, that the
config schema is the packaged file and is the one read, and that CONFIG (the checkout's config/config.yaml)
passes mfpipe.workflow.config.validate_schema and check_config. Exits non-zero on the first failure.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import sysconfig
import time
from pathlib import Path


def main(config_path: str) -> None:
    t0 = time.perf_counter()
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    print(f"python {sys.executable} (sys.prefix {sys.prefix}); site-packages {site}")

    import mfpipe

    where = Path(mfpipe.__file__).resolve().parent
    assert where == site / "mfpipe", f"mfpipe imported from {where}, not the installed copy in {site}"
    checkout_src = Path(config_path).resolve().parents[1] / "src"
    assert not any(Path(p or ".").resolve() == checkout_src for p in sys.path), f"{checkout_src} is on sys.path"

    modules = [mfpipe.__name__]
    # a package that fails to import is yielded before its submodules are looked for: the loop below reports it
    modules += [info.name for info in pkgutil.walk_packages(mfpipe.__path__, prefix="mfpipe.", onerror=lambda name: None)]
    failed = []
    for name in modules:
        try:
            module = importlib.import_module(name)
        except Exception as e:  # every failure, not only the first, so one CI run shows them all
            failed.append(f"{name}: {type(e).__name__}: {e}")
            continue
        file = getattr(module, "__file__", None)
        if file and not Path(file).resolve().is_relative_to(site):
            failed.append(f"{name}: imported from {file}, outside {site}")
    assert not failed, "modules of the installed mfpipe that do not import:\n  " + "\n  ".join(failed)
    print(f"imported {len(modules)} modules of mfpipe from {where}")

    assert (where / "py.typed").is_file(), "py.typed is not in the wheel"

    import yaml

    from mfpipe.workflow import config as cfgmod

    schema = Path(str(cfgmod.SCHEMA_PATH)).resolve()
    assert schema == where / "schemas" / "config.schema.yaml", f"SCHEMA_PATH is {schema}, not the packaged schema"
    assert schema.is_file(), f"the packaged schema {schema} is missing from the wheel"
    read = []
    original = cfgmod.load_schema

    def spy(path=cfgmod.SCHEMA_PATH):
        read.append(Path(str(path)).resolve())
        return original(path)

    cfgmod.load_schema = spy
    try:
        config = yaml.safe_load(Path(config_path).read_text())
        cfgmod.validate_schema(config)
        cfgmod.check_config(config)
    finally:
        cfgmod.load_schema = original
    assert read and set(read) == {schema}, f"the schema files read were {sorted(set(read))}, not only {schema}"
    assert config.get("rollout"), "validate_schema did not fill the rollout defaults from the packaged schema"
    print(f"{config_path}: valid against {schema} and cross-checked")
    print(f"wheel check passed ({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
