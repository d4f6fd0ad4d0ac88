"""Imported first by every job script: puts this checkout's src/ first on sys.path, so a job runs the library
its rule's code inputs track, not an installed mfpipe. Snakemake puts the script folder on the path of a
local script; PYTHONPATH is not used because a conda environment (`--sdm conda`) blocks it."""
import sys
from pathlib import Path

_SRC = str(Path(__file__).resolve().parents[2] / "src")
if sys.path[:1] != [_SRC]:
    sys.path.insert(0, _SRC)
