"""The ``mfpipe`` console command: ``mfpipe conformance MODEL [--revision R]`` (:mod:`mfpipe.conformance`) and
``mfpipe census [FAMILY ...] [--write MD]`` (:mod:`mfpipe.models.census`) and ``mfpipe estimate [--configfile F ...]``
(:mod:`mfpipe.estimate`)."""

from __future__ import annotations

import sys

COMMANDS = {"conformance": "check that mfpipe reads a model's internals right, on a tiny random copy of it",
            "census": "place and check a tiny copy of every causal-LM family transformers ships; one table",
            "estimate": "what a config's run will cost (time, memory, disk), from a short calibration on this device"}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        lines = [f"  {name:<12} {what}" for name, what in COMMANDS.items()]
        print("usage: mfpipe COMMAND ...\ncommands:\n" + "\n".join(lines), file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    if argv[0] == "estimate":
        from mfpipe.estimate.report import main as estimate

        return estimate(argv[1:])
    if argv[0] == "census":
        from mfpipe.models.census import main as census

        return census(argv[1:])
    from mfpipe.conformance import main as conformance

    return conformance(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
