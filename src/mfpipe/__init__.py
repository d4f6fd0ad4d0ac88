"""mfpipe: attention mean-field analysis of language models.

Reading a finished run (mfpipe.results, loaded on first use so that ``import mfpipe`` stays light: every job
imports it): ``mfpipe.list_results(results)``, ``mfpipe.open_stats(model, revision, results=...)``,
``mfpipe.open_results(experiment, model, revision, results)``.
"""

from mfpipe.version import __version__

# served by __getattr__ from mfpipe.results, which is imported only when one of them is asked for
_READING = ("open_stats", "open_results", "list_results")

__all__ = ["__version__", *_READING]


def __getattr__(name: str):
    # a static import, so mfpipe.workflow.codedeps sees what the lazily exported names load
    if name in _READING:
        from mfpipe import results

        return getattr(results, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
