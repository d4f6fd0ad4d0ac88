"""One loader for every model mfpipe analyses: a hub name + `revision`, a local directory, or a
checkpoint of the offline mini suite.

Always eager attention (the probabilities must be observable), never remote code, safetensors
only. A multimodal composite whose language model is a decoder (Gemma-3, Llama-4, Qwen-3.5...) loads as that
language model's text-only causal LM (:mod:`mfpipe.models.adapters.composite`). A model spec is the config's model entry::

    {name: gpt2-small, source: hub, hub_id: openai-community/gpt2, revisions: [main]}
    {name: mine, source: local, path: /data/my-model}
    {name: mini-gpt2, source: minisuite}
"""

from __future__ import annotations

import functools
import gc
import json
import os
import re
from pathlib import Path
from typing import Any

from mfpipe.workflow.revisions import minisuite_checkpoint_dir

SOURCES = ("hub", "local", "minisuite")
# the torch dtypes by name (torch is imported where a model loads: the workflow imports this module when it
# plans the DAG, to resolve hub revisions, and must not pay for torch there)
DTYPES = ("float32", "float16", "bfloat16")


class ModelLoadError(RuntimeError):
    """A model could not be loaded; the message names the model and what to do."""


COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
# what a repository holds its tokenizer in (any one of them means the tokenizer of that revision is there)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _collector_paused(load):
    """``load`` with Python's cyclic garbage collector paused (its previous state restored after). Importing a model
    class (transformers' modeling code, with torch.distributed, torch._dynamo and sympy behind it) and building the
    model allocate hundreds of thousands of objects that live as long as the model; the collector scanned them again
    and again as they came (measured: benchmarks/HISTORY.md, "A model job's start-up"). Nothing
    a load makes is cyclic garbage to be reclaimed during it."""

    @functools.wraps(load)
    def paused(*args, **kwargs):
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return load(*args, **kwargs)
        finally:
            if was_enabled:
                gc.enable()

    return paused


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def download_hint(hub_id: str, revision: str | None) -> str:
    return f"`hf download {hub_id} --revision {revision or 'main'}`"


def cached_commit(hub_id: str, revision: str | None, files: tuple[str, ...] = ("config.json",)) -> str | None:
    """The commit ``revision`` of ``hub_id`` resolved to when it was downloaded into the local Hugging Face cache
    (``refs/<revision>`` -> ``snapshots/<commit>/``), where one of ``files`` is cached there; else None."""
    from huggingface_hub import try_to_load_from_cache

    for name in files:
        found = try_to_load_from_cache(hub_id, name, revision=revision or "main")
        if isinstance(found, str):
            return Path(found).parent.name  # .../snapshots/<commit>/<name>
    return None


def resolve_commit(hub_id: str, revision: str | None, files: tuple[str, ...] = ("config.json",),
                   what: str = "model", prefer_cache: bool = False) -> str:
    """The commit a hub revision (a branch such as ``main`` or ``step1000``, a tag or a commit) stands for now: the
    hub's answer when it is reachable (a branch moves), else the local cache's (``prefer_cache``: the cache's first,
    the hub's only for what it lacks); a run records and loads that commit, so its outputs say exactly which weights
    they come from. Raises :class:`ModelLoadError` naming the download command when neither has it."""
    rev = revision or "main"
    if COMMIT_RE.match(rev):
        return rev
    commit = cached_commit(hub_id, rev, files) if prefer_cache else None
    if commit is None and not hub_offline():
        try:
            from huggingface_hub import HfApi

            commit = HfApi().model_info(hub_id, revision=rev).sha
        except Exception:  # unreachable hub, private repo...: the cache may still have it
            commit = None
    commit = commit or cached_commit(hub_id, rev, files)
    if commit:
        return commit
    where = ("is not in the local Hugging Face cache and HF_HUB_OFFLINE=1 forbids downloading it" if hub_offline()
             else "could not be resolved on the hub nor found in the local Hugging Face cache")
    raise ModelLoadError(
        f"{hub_id} revision {rev!r} ({what}) {where}: pre-download it on a machine with network "
        f"({download_hint(hub_id, rev)}), copy the cache (HF_HOME) here and run with HF_HUB_OFFLINE=1"
    )


def find_spec(models: list[dict], name: str) -> dict:
    for m in models:
        if m.get("name") == name:
            return m
    known = ", ".join(m.get("name", "?") for m in models) or "(none)"
    raise ModelLoadError(f"unknown model {name!r}: the config defines {known}. Add it under `models:` in the config.")


def _describe(spec: dict, revision: str | None) -> str:
    where = spec.get("hub_id") or spec.get("path") or spec.get("name")
    return f"model {spec.get('name')!r} ({where}{'' if not revision else ', revision ' + repr(revision)})"


def resolve_location(spec: dict, revision: str | None = None, results_dir: str | Path = "results") -> tuple[str, str | None]:
    """(path or hub id, hub revision or None) for `spec`; checks local paths exist."""
    source = spec.get("source")
    if source not in SOURCES:
        raise ModelLoadError(f"model {spec.get('name')!r}: source must be one of {SOURCES}, got {source!r}")
    if source == "hub":
        if not spec.get("hub_id"):
            raise ModelLoadError(f"model {spec.get('name')!r}: source 'hub' needs hub_id (e.g. EleutherAI/pythia-160m)")
        return spec["hub_id"], revision or "main"
    if source == "local":
        path = Path(spec.get("path") or "")
        if revision and revision != "main" and (path / revision).is_dir():
            path = path / revision  # a local folder of checkpoints, one subfolder per revision
        if not spec.get("path") or not path.is_dir():
            raise ModelLoadError(
                f"{_describe(spec, revision)}: local path {str(path)!r} does not exist or is not a folder. "
                "Point `path` at a folder with config.json and model.safetensors (save_pretrained output)."
            )
        return str(path), None
    path = minisuite_checkpoint_dir(results_dir, spec["name"], revision)
    if not path.is_dir():
        raise ModelLoadError(
            f"{_describe(spec, revision)}: mini-suite checkpoint {str(path)!r} does not exist. "
            f"Train it first: snakemake --cores 2 {Path(results_dir) / 'minisuite' / spec['name'] / 'induction.csv'}"
        )
    return str(path), None


def _refuse_remote_code(path_or_id: str, spec: dict, revision: str | None) -> None:
    cfg_path = Path(path_or_id) / "config.json"
    if cfg_path.is_file():
        cfg = json.loads(cfg_path.read_text())
        if cfg.get("auto_map"):
            raise ModelLoadError(
                f"{_describe(spec, revision)} needs custom code from its repository (config.json has auto_map); "
                "mfpipe never runs remote code (trust_remote_code is off). Use a model whose architecture "
                "transformers implements."
            )


def _offline_message(spec: dict, revision: str | None, err: Exception) -> ModelLoadError:
    hub_id = spec.get("hub_id")
    rev = revision or "main"
    return ModelLoadError(
        f"could not load {_describe(spec, revision)} from the local Hugging Face cache and the hub is not "
        f"reachable or does not have it ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}). "
        f"Check the name, then pre-download it on a machine with network: "
        f"{download_hint(hub_id, rev)} (or huggingface_hub.snapshot_download("
        f"'{hub_id}', revision='{rev}')), copy the cache (HF_HOME) here, and run with HF_HUB_OFFLINE=1."
    )


def tokenizer_revision(spec: dict) -> str | None:
    """The hub revision a model's tokenizer (and so its corpus shards) comes from: the commit the workflow resolved
    ``tokenizer_revision`` to (``tokenizer_commit``, set by the workflow), else ``tokenizer_revision`` (None: the
    default branch). One tokenizer serves every revision of a sweep; other sources have no revisions."""
    if spec.get("source") != "hub":
        return None
    return spec.get("tokenizer_commit") or spec.get("tokenizer_revision")


@_collector_paused
def load_tokenizer(spec: dict, revision: str | None = None, results_dir: str | Path = "results"):
    """The model's tokenizer; for a hub model from its ``hub_id`` at ``revision`` (default: :func:`tokenizer_revision`)."""
    from transformers import AutoTokenizer

    if revision is None:
        revision = tokenizer_revision(spec)
    if spec.get("source") == "minisuite":
        path, rev = str(Path(results_dir) / "minisuite" / "tokenizer"), None
        if not Path(path).is_dir():
            raise ModelLoadError(f"mini-suite tokenizer {path!r} does not exist; run the minisuite stage first")
    else:
        path, rev = resolve_location(spec, revision, results_dir)
    if spec.get("source") != "minisuite":
        _refuse_remote_code(path, spec, revision)
    try:
        kwargs: dict[str, Any] = {"trust_remote_code": False}
        if rev:
            kwargs["revision"] = rev
        return AutoTokenizer.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as e:
        if spec.get("source") == "hub":
            raise _offline_message(spec, revision, e) from e
        raise ModelLoadError(f"could not load the tokenizer of {_describe(spec, revision)}: {e}") from e


def resolve_device(device: str | None):
    import torch

    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} requested but CUDA is not available; set device: cpu (or auto)")
    return torch.device(device)


def _streamed(spec: dict, revision: str | None, path: str, rev: str | None, config, dtype: str, device, stream):
    """:func:`mfpipe.models.streamed.load_streamed` with its errors as :class:`ModelLoadError` naming the model."""
    from mfpipe.models.adapters.streaming import StreamingError
    from mfpipe.models.streamed import load_streamed

    try:
        return load_streamed(spec.get("source"), path, rev, config, dtype, resolve_device(device), stream,
                             _describe(spec, revision))
    except StreamingError as e:
        raise ModelLoadError(f"{_describe(spec, revision)}: {e}") from e
    except OSError as e:  # the hub's snapshot not in the cache (and the hub not reachable), a file not readable
        if spec.get("source") == "hub":
            raise _offline_message(spec, revision, e) from e
        raise ModelLoadError(f"could not stream the weights of {_describe(spec, revision)}: {e}") from e


@_collector_paused
def load_model(
    spec: dict,
    revision: str | None = None,
    dtype: str = "float32",
    device: str | None = "cpu",
    results_dir: str | Path = "results",
    commit: str | None = None,
    stream: bool | str = False,
):
    """A `transformers` causal LM in eval mode with eager attention. ``commit``: for a hub model, the commit
    ``revision`` was resolved to when the run was planned (:func:`resolve_commit`): that is what is loaded, so a
    branch that moves mid-run cannot mix two models' weights in one result. ``stream`` (``runtime.stream_weights``):
    True streams its blocks' weights from its safetensors files one block at a time (:mod:`mfpipe.models.streamed`),
    "auto" where they would not fit the memory (:func:`mfpipe.models.streamed.streams`), False loads them whole."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    path, rev = resolve_location(spec, revision, results_dir)
    _refuse_remote_code(path, spec, revision)
    kwargs: dict[str, Any] = {"trust_remote_code": False}
    if rev:
        kwargs["revision"] = commit if (commit and spec.get("source") == "hub") else rev
    try:
        config = AutoConfig.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as e:
        msg = str(e)
        if "trust_remote_code" in msg or "custom code" in msg:
            raise ModelLoadError(
                f"{_describe(spec, revision)} needs custom code from its repository; mfpipe never runs remote code."
            ) from e
        if spec.get("source") == "hub":
            raise _offline_message(spec, revision, e) from e
        raise ModelLoadError(f"could not read the config of {_describe(spec, revision)}: {e}") from e
    if stream not in (False, None, "false"):
        model = _streamed(spec, revision, path, kwargs.get("revision"), config, dtype, device, stream)
        if model is not None:
            return model
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path,
            config=config,
            attn_implementation="eager",
            dtype=getattr(torch, dtype),
            use_safetensors=True,
            **kwargs,
        )
    except (OSError, ValueError) as e:
        if spec.get("source") == "hub":
            raise _offline_message(spec, revision, e) from e
        raise ModelLoadError(
            f"could not load the weights of {_describe(spec, revision)} (safetensors only): {e}"
        ) from e
    # a multimodal composite (Gemma-3's conditional-generation model): its language model, read on text-only input
    # as the text-only causal LM (the towers are dropped with the composite)
    from mfpipe.models.adapters.composite import language_model

    model = language_model(model)
    model.eval()
    model.requires_grad_(False)
    return model.to(resolve_device(device))
