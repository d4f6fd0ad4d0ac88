"""Checks of a config that need more than the config itself, run when Snakemake builds the DAG (common.smk),
so a bad input stops the run before any job, with one line naming the key, file or model and what to do:
every model's architecture is verified by the test suite or, placed by structure, passes the conformance checks on
a tiny copy of its config.json (the local folder, or the Hugging Face cache when it holds it), an offline hub model is in the cache, corpus files exist, the tracked-type count N fits
each vocabulary, and revisions are well-formed; and it resolves every hub revision, of the model and of its tokenizer,
to the commit it stands for now (:func:`hub_commits`), which the jobs load and the stores record. Nothing here loads
weights, tokenizes or downloads."""

from __future__ import annotations

import json
import re
from pathlib import Path

from mfpipe.workflow.config import ConfigError, corpora, resolve_revisions, resolve_rollout_revisions

REVISION_RE = re.compile(r"^[A-Za-z0-9._-]+$")  # the workflow's `revision` wildcard: used in paths


def _verified_model_types() -> tuple[str, ...]:
    from mfpipe.models.tiny import VERIFIED_MODEL_TYPES  # no torch: planning a verified model imports none

    return VERIFIED_MODEL_TYPES


def _check_unverified(spec: dict, cfg: dict, where: str) -> None:
    """A model whose type the test suite does not verify runs only if a tiny random copy of its config is placed by
    structure and passes every conformance check (:func:`mfpipe.conformance.conformance_cached`: once per model type,
    config and library versions); else one line naming what failed and the command that shows the whole table."""
    from mfpipe.conformance import conformance_cached

    failure = conformance_cached(cfg)
    if failure:
        what = spec.get("hub_id") or spec.get("path") or spec["name"]
        raise ConfigError(f"models: {spec['name']!r} has model_type {cfg.get('model_type')!r} ({where}), which mfpipe "
                          f"cannot read right: {failure}; run `mfpipe conformance {what}` for every check")


def _check_quantized(spec: dict, cfg: dict, where: str) -> None:
    """A quantized checkpoint (its config's ``quantization_config``) is refused, whatever its type: its projections are
    no linear maps of their weights (BitNet's quantize their input to 8 bits; others pack their weights), which mfpipe's
    value and output maps read them as; and a tiny copy built from the config, unquantized, would pass for it."""
    quant = cfg.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise ConfigError(f"models: {spec['name']!r} is a quantized checkpoint ({where}: quantization_config, "
                          f"quant_method {method!r}): mfpipe reads projections that are linear maps of their weights, "
                          "which a quantized layer is not; use a full-precision (dequantized) checkpoint")


def _offline() -> bool:
    from mfpipe.models.loader import hub_offline

    return hub_offline()


def _hub_config(hub_id: str, revision: str) -> Path | None:
    """config.json of ``hub_id`` at ``revision`` from the local Hugging Face cache, or None if not cached."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(hub_id, "config.json", revision=revision)
    return Path(found) if isinstance(found, str) else None


TOKENIZER = None  # the key of a model's tokenizer in hub_commits (its revisions are strings)


def hub_commits(config: dict, prefer_cache: bool = False) -> dict[tuple[str, str | None], str]:
    """``{(model, revision): commit}`` for every revision of every hub model, and ``{(model, TOKENIZER): commit}``
    for its tokenizer (``tokenizer_revision``, default the ``main`` branch): what each names now (the hub, or the
    local cache offline; mfpipe.models.loader.resolve_commit; ``prefer_cache``: the cache first). A revision that
    cannot be resolved -- offline and not in the cache -- raises :class:`ConfigError` naming the ``hf download``
    command, before any job runs."""
    from mfpipe.models.loader import TOKENIZER_FILES, ModelLoadError, resolve_commit

    out: dict[tuple[str, str | None], str] = {}
    for spec in config["models"]:
        if spec["source"] != "hub":
            continue
        try:
            revisions = resolve_revisions(config, spec) + resolve_rollout_revisions(config, spec)
            for rev in dict.fromkeys(revisions):
                out[(spec["name"], rev)] = resolve_commit(spec["hub_id"], rev, what=f"model {spec['name']!r}",
                                                          prefer_cache=prefer_cache)
            out[(spec["name"], TOKENIZER)] = resolve_commit(spec["hub_id"], spec.get("tokenizer_revision"), TOKENIZER_FILES,
                                                            what=f"the tokenizer of model {spec['name']!r}",
                                                            prefer_cache=prefer_cache)
        except ModelLoadError as e:
            raise ConfigError(f"models: {spec['name']!r}: {e}") from None
    return out


def model_config(spec: dict, revision: str) -> tuple[dict | None, str]:
    """(config.json contents or None when it cannot be read before the run, where it was looked for)."""
    from mfpipe.models.loader import TOKENIZER_FILES

    if spec["source"] == "local":
        folder = Path(spec["path"])
        if revision not in ("main", None) and (folder / revision).is_dir():
            folder = folder / revision
        if not folder.is_dir():
            raise ConfigError(
                f"models: {spec['name']!r} has source 'local' but path {str(folder)!r} is not a folder; point `path` "
                "at a folder with config.json and model.safetensors (save_pretrained output)"
            )
        cfg = folder / "config.json"
        if not cfg.is_file():
            raise ConfigError(f"models: {spec['name']!r}: {str(cfg)!r} does not exist; `path` must hold a "
                              "save_pretrained folder (config.json and model.safetensors)")
        if not any((folder / f).is_file() for f in TOKENIZER_FILES):  # transformers would hand back an empty one
            raise ConfigError(f"models: {spec['name']!r}: {str(folder)!r} holds no tokenizer (none of "
                              f"{', '.join(TOKENIZER_FILES)}); save the model's tokenizer there too "
                              "(tokenizer.save_pretrained(path))")
        return _json(cfg, spec), str(cfg)
    if spec["source"] == "hub":
        cfg = _hub_config(spec["hub_id"], revision)
        if cfg is None:
            if _offline():
                raise ConfigError(
                    f"models: {spec['name']!r} ({spec['hub_id']}, revision {revision!r}) is not in the local Hugging "
                    f"Face cache and HF_HUB_OFFLINE=1 forbids downloading it: pre-download it on a machine with "
                    f"network (`hf download {spec['hub_id']} --revision {revision}`) and copy the cache (HF_HOME) here"
                )
            return None, "the hub (not cached yet: checked when its job downloads it)"
        return _json(cfg, spec), str(cfg)
    return None, "the mini suite"


def _json(path: Path, spec: dict) -> dict:
    """A model's config.json, or a one-line refusal naming the model and the file where it is no JSON."""
    try:
        return json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"models: {spec['name']!r}: {str(path)!r} is no valid JSON ({e}); write the model's config "
                          "with save_pretrained") from e


def check_inputs(config: dict) -> None:
    """Raise :class:`ConfigError` (one line) for the first input that would fail a job later."""
    n_tracked = config["tracked"]["n_tracked"]
    for c in corpora(config).values():
        if c["source"] == "files" and not Path(c["path"]).exists():
            raise ConfigError(
                f"corpus {c['name']!r}: path {c['path']!r} does not exist (relative paths are from the working "
                "directory); point `path` at a .txt/.jsonl/.parquet file or a folder of them"
            )
    for path in ((config.get("prompts") or {}).get("icl") or {}).get("task_files") or []:  # a job's input: missing,
        if not Path(path).is_file():  # the job never runs and its old tables stand (or, fresh, a MissingInputException)
            raise ConfigError(f"prompts.icl.task_files: {path!r} does not exist (relative paths are from the working "
                              "directory); point it at a task file (JSON: docs) or remove it")
    verified = None
    mini = {m["name"]: m for m in (config.get("minisuite") or {}).get("models", [])}
    for spec in config["models"]:
        for rev in spec.get("revisions") or []:
            if not REVISION_RE.match(str(rev)):
                raise ConfigError(
                    f"models: {spec['name']!r} revision {rev!r} is not a well-formed revision name (letters, digits, "
                    "'.', '_', '-'; a branch, tag, commit hash or stepN); fix `revisions` in the config"
                )
        if spec["source"] == "minisuite":
            vocab = config["minisuite"]["tokenizer"]["vocab_size"] if spec["name"] in mini else None
            where = "minisuite.tokenizer.vocab_size"
        else:
            verified = verified or _verified_model_types()
            vocab, where = None, ""
            for rev in spec.get("revisions") or ["main"]:
                cfg, where = model_config(spec, rev if spec["source"] == "hub" else rev)
                if cfg is None:
                    continue
                model_type = cfg.get("model_type")
                _check_quantized(spec, cfg, where)
                if model_type not in verified:
                    _check_unverified(spec, cfg, where)
                # a multimodal composite keeps its language model's vocabulary in its text_config
                vocab = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size") or vocab
        if vocab is not None and n_tracked >= vocab:
            raise ConfigError(
                f"tracked.n_tracked {n_tracked} does not fit the vocabulary of model {spec['name']!r} ({vocab} tokens, "
                f"{where}; BOS is never tracked): set tracked.n_tracked below {vocab}"
            )
        arms = [(f"models: {spec['name']!r} top_n", n) for n in ((spec.get("top_n") or {}).get("n") or [])]
        arms += [("substitution.top_n", n) for n in (config.get("substitution") or {}).get("top_n") or []]
        for key, n in arms:  # App. M's tracked-set sizes: the same bound
            if vocab is not None and int(n) >= vocab:
                raise ConfigError(f"{key} {n} does not fit the vocabulary of model {spec['name']!r} ({vocab} tokens, "
                                  f"{where}; BOS is never tracked): keep every top-N size below {vocab}")
