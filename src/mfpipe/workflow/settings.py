"""Every rule's params by name, as one more param: what Snakemake's rerun check compares.

Snakemake decides that a job's params changed by comparing the *set* of its params' values, without their names
(``snakemake.persistence``: ``set(self._params(job))``). A new value equal to another param's value, or two values
swapped, is no change to it: ``prompts.icl.natural_length: 20`` where ``substitution.min_count`` is 20 already, or
``ranking: {top: 15, bottom: 20}`` (the defaults swapped), left the tables as they were, with no word. :func:`add_named`
gives each rule with params one more, ``settings``: a function of the wildcards returning its other params as one JSON
object of name -> value, so that any change of any of them is a change of that value. Params that are functions of
more than the wildcards (the input files, threads, resources) are derived from what Snakemake tracks already and are
left out, as are values JSON cannot write (a job never reads them as numbers).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from typing import Any

__all__ = ["add_named", "named_settings", "SETTINGS"]

SETTINGS = "settings"  # the param's name (a job's own params never use it)


def _plain(value: Any) -> Any:
    """``value`` as JSON writes it, or :data:`_SKIP` where it holds anything else (an object, a function)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        return _SKIP if any(v is _SKIP for v in items) else items
    if isinstance(value, dict):
        items = {str(k): _plain(v) for k, v in value.items()}
        return _SKIP if any(v is _SKIP for v in items.values()) else items
    if hasattr(value, "item") and callable(value.item) and getattr(value, "shape", None) == ():  # a numpy scalar
        return _plain(value.item())
    return _SKIP


_SKIP = object()


def _of_wildcards(fn: Callable) -> bool:
    """Whether ``fn`` takes the wildcards alone (Snakemake passes ``input``, ``output``, ``threads``, ``resources`` to
    a param function only by those names)."""
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return False
    return len(names) <= 1 and not set(names) & {"input", "output", "threads", "resources"}


def named_settings(params: dict[str, Any]) -> Callable:
    """The ``settings`` param of a rule whose params are ``params`` (name -> value or param function): a function of
    the wildcards returning them as one JSON object, keys sorted (see the module docstring)."""
    def settings(wildcards) -> str:
        out = {}
        for name, value in params.items():
            if callable(value):
                if not _of_wildcards(value):
                    continue  # derived from the inputs or the run: Snakemake tracks those itself
                value = value(wildcards) if inspect.signature(value).parameters else value()
            plain = _plain(value)
            if plain is not _SKIP:
                out[name] = plain
        return json.dumps(out, sort_keys=True)
    return settings


def add_named(rule) -> None:
    """Give the Snakemake rule ``rule`` its ``settings`` param (:func:`named_settings`), where it has named params."""
    named = dict(rule.params.items())
    if named and SETTINGS not in named:
        rule.set_params(**{SETTINGS: named_settings(named)})
