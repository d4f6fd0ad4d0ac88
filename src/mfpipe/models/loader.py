"""One loader for every model mfpipe analyses: a hub name + `revision`, a local directory, or a
checkpoint of the offline mini suite.

Always eager attention (the probabilities must be observable), never remote code, safetensors
only. A model spec is the config's model entry::

    {name: gpt2-small, source: hub, hub_id: openai-community/gpt2, revisions: [main]}
    {name: mine, source: local, path: /data/my-model}
    {name: mini-gpt2, source: minisuite}
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..revisions import minisuite_checkpoint_dir

SOURCES = ("hub", "local", "minisuite")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ModelLoadError(RuntimeError):
    """A model could not be loaded; the message names the model and what to do."""


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
        f"`hf download {hub_id} --revision {rev}` (or huggingface_hub.snapshot_download("
        f"'{hub_id}', revision='{rev}')), copy the cache (HF_HOME) here, and run with HF_HUB_OFFLINE=1."
    )


def load_tokenizer(spec: dict, revision: str | None = None, results_dir: str | Path = "results"):
    from transformers import AutoTokenizer

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


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} requested but CUDA is not available; set device: cpu (or auto)")
    return torch.device(device)


def load_model(
    spec: dict,
    revision: str | None = None,
    dtype: str = "float32",
    device: str | None = "cpu",
    results_dir: str | Path = "results",
):
    """A `transformers` causal LM in eval mode with eager attention."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    path, rev = resolve_location(spec, revision, results_dir)
    _refuse_remote_code(path, spec, revision)
    kwargs: dict[str, Any] = {"trust_remote_code": False}
    if rev:
        kwargs["revision"] = rev
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
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path,
            config=config,
            attn_implementation="eager",
            dtype=DTYPES[dtype],
            use_safetensors=True,
            **kwargs,
        )
    except (OSError, ValueError) as e:
        if spec.get("source") == "hub":
            raise _offline_message(spec, revision, e) from e
        raise ModelLoadError(
            f"could not load the weights of {_describe(spec, revision)} (safetensors only): {e}"
        ) from e
    model.eval()
    model.requires_grad_(False)
    return model.to(resolve_device(device))
