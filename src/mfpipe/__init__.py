"""mfpipe: attention mean-field analysis of language models.

Reading a finished run (mfpipe.results, loaded on first use so that ``import mfpipe`` stays light: every job
imports it): ``mfpipe.list_results(results)``, ``mfpipe.open_stats(model, revision, results=...)``,
``mfpipe.open_results(experiment, model, revision, results)``.

Computing on a model in memory (mfpipe.notebook, loaded on first use): ``mfpipe.collect_stats(model, texts)``,
``mfpipe.mean_field(stats)``, ``mfpipe.substitute(model, stats, tokens)``, ``mfpipe.context_deviation(model, stats,
tokens)``, ``mfpipe.decode(model, vector, layer)``. (``mfpipe.deviation`` is the package of pass 2, so the notebook's
per-context deviation has a name of its own: nothing below this package reaches up into the notebook API.)
"""

from mfpipe.version import __version__

# served by __getattr__ from mfpipe.results, which is imported only when one of them is asked for
_READING = ("open_stats", "open_results", "list_results")
# served by __getattr__ from mfpipe.notebook's modules
_COMPUTING = ("collect_stats", "mean_field", "substitute", "context_deviation", "decode")

__all__ = ["__version__", *_READING, *_COMPUTING]


def __getattr__(name: str):
    # static imports, so mfpipe.workflow.codedeps sees what the lazily exported names load
    if name in _READING:
        from mfpipe import results

        return getattr(results, name)
    if name == "collect_stats":
        from mfpipe.notebook.stats import collect_stats

        return collect_stats
    if name == "mean_field":
        from mfpipe.notebook.meanfield import mean_field

        return mean_field
    if name in ("substitute", "context_deviation", "decode"):
        from mfpipe.notebook import analysis

        return getattr(analysis, name)
    if name == "deviation":  # the package of pass 2, not imported yet: an earlier release's notebook call lands here
        raise AttributeError("mfpipe.deviation is the package of pass 2 (import mfpipe.deviation.<module>); the "
                             "per-context deviation of a model in memory is mfpipe.context_deviation(model, stats, tokens)")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
