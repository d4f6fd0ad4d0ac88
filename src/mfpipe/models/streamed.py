"""Loading a model to run one block at a time (``runtime.stream_weights``): built on the meta device from its
config, the embedding, final norm, LM head and buffers read whole, each decoder block's weights read from the
checkpoint's safetensors files just before the block runs and dropped after it
(:mod:`mfpipe.models.adapters.streaming`, which the adapter's structure hands the blocks to).

``stream_weights: auto`` streams where the weights would not fit beside the job: where they exceed
:data:`STREAM_SHARE` of the memory available when the job loads them (the host's, within the job's cgroup limit; on a
GPU the device's free memory too). ``true`` always streams, ``false`` never. It changes no result (a streamed model's
forwards equal the whole model's bit for bit), so it is no job's param: switching it reruns nothing.

It imports nothing of :mod:`mfpipe.models.loader` (which calls :func:`load_streamed`): its errors are
:class:`~mfpipe.models.adapters.streaming.StreamingError`, which the loader names the model in.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

__all__ = ["STREAM_SHARE", "STREAM_MODES", "load_streamed", "memory_available", "meta_model", "safetensors_files",
           "stream_mode", "streams", "weight_bytes"]

# auto streams where the weights exceed this share of the memory available: the rest is the job's own (activations,
# sums, the process), which a model filling the memory would leave no room for
STREAM_SHARE = 0.8
STREAM_MODES = ("auto", True, False)

log = logging.getLogger(__name__)


def stream_mode(value) -> bool | str:
    """``runtime.stream_weights`` as True, False or "auto" (YAML's true / false, or their strings); "never" is a job
    that cannot stream: it loads the weights whole, and refuses where they exceed the memory."""
    from mfpipe.models.adapters.streaming import StreamingError

    if value is None or isinstance(value, bool):
        return bool(value)
    mode = {"auto": "auto", "true": True, "false": False, "never": "never"}.get(str(value).strip().lower())
    if mode is None:
        raise StreamingError(f"runtime.stream_weights must be auto, true or false, got {value!r}")
    return mode


def streams(mode, weights: float, available: float) -> bool:
    """Whether a model of ``weights`` bytes is streamed under ``mode`` with ``available`` bytes of memory."""
    mode = stream_mode(mode)
    return weights > STREAM_SHARE * available if mode == "auto" else mode is True


def weight_bytes(model) -> int:
    """Bytes of the model's parameters in memory (tied ones once), meta ones counted at their dtype."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _cgroup_room() -> int | None:
    """Bytes the job's cgroup (a SLURM job's, a container's) and those above it still allow, or None where none sets
    a limit (cgroup v2's memory.max, v1's memory.limit_in_bytes, each less its usage)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: the unified hierarchy
            root, limit, usage = Path("/sys/fs/cgroup"), "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            root, limit, usage = Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        here = root / path.lstrip("/")
        for folder in [here, *here.parents]:
            if not folder.is_relative_to(root):
                break
            try:
                cap, used = (folder / limit).read_text().strip(), int((folder / usage).read_text().strip())
            except (OSError, ValueError):
                continue
            if cap.isdigit() and int(cap) < 1 << 60:  # v1 writes "no limit" as a huge number, v2 as "max"
                found.append(max(int(cap) - used, 0))
    return min(found) if found else None


def memory_available(device=None) -> int:
    """Bytes a model loaded now may take: the host's available memory within the cgroup's limit, and on a GPU no
    more than the device's free memory."""
    import psutil

    room = psutil.virtual_memory().available
    cg = _cgroup_room()
    if cg is not None:
        room = min(room, cg)
    if device is not None and getattr(device, "type", str(device)).startswith("cuda"):
        import torch

        room = min(room, torch.cuda.mem_get_info(device)[0])
    return int(room)


def meta_model(config, dtype: str):
    """The causal LM of ``config`` with its parameters on the meta device (in ``dtype``) and its buffers real, in eval
    mode, with eager attention: no weight read, no memory for them."""
    import torch
    from transformers import AutoModelForCausalLM

    from mfpipe.models.adapters.streaming import parameters_on_meta

    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=getattr(torch, dtype),
                                                 trust_remote_code=False)
    return model.eval().requires_grad_(False)


def safetensors_files(folder: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint folder: those its ``model.safetensors.index.json`` maps the tensors to,
    or its ``model.safetensors``. A folder of ``pytorch_model.bin`` weights (or none) raises, saying what to do."""
    from mfpipe.models.adapters.streaming import StreamingError

    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise StreamingError(f"{index} maps tensors to {', '.join(absent[:3])}, not in {folder}: download the "
                                 "whole checkpoint (`hf download HUB_ID --revision REV`, every safetensors file)")
        return files
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    bins = sorted(p.name for p in folder.glob("pytorch_model*.bin"))
    held = f"its weights are {', '.join(bins[:2])}, not safetensors" if bins else "no safetensors weights are there"
    raise StreamingError(
        f"{held} ({folder}): weight streaming (runtime.stream_weights) reads safetensors files only. Convert the "
        "checkpoint once on a machine with the memory (AutoModelForCausalLM.from_pretrained(folder)"
        ".save_pretrained(new_folder) writes safetensors) and point the model at the new folder, or set "
        "runtime.stream_weights: false")


def checkpoint_folder(source: str, path: str, rev: str | None) -> Path:
    """The local folder of a model's checkpoint: a hub model's snapshot in the Hugging Face cache (its safetensors
    files and index fetched where the hub is reachable), else the model's own folder."""
    if source != "hub":
        return Path(path)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(path, revision=rev or "main",
                                  allow_patterns=["*.safetensors", "*.safetensors.index.json", "config.json"]))


def load_streamed(source: str, path: str, rev: str | None, config, dtype: str, device, stream, what: str):
    """The model of ``config`` (``source``, ``path`` and hub ``rev`` as the loader resolved them) set up to stream its
    blocks' weights onto ``device`` (a torch.device), or None where ``stream`` is "auto" and its weights fit (the
    loader then loads it whole). ``what`` names the model in the log."""
    from mfpipe.models.adapters.streaming import Checkpoint, StreamingError, stream_blocks
    from mfpipe.models.adapters.structure import blocks

    mode = stream_mode(stream)
    try:
        model = meta_model(config, dtype)
    except Exception as e:  # noqa: BLE001 -- a model whose constructor needs real parameters: auto loads it whole
        if mode is not True:
            log.warning("%s: not built on the meta device (%s: %s): its weights load whole", what, type(e).__name__, e)
            return None
        raise StreamingError(f"it cannot be built with its parameters on the meta device ({type(e).__name__}: {e}), "
                             "which weight streaming needs: set runtime.stream_weights: false") from e
    need, room = weight_bytes(model), memory_available(device)
    if mode == "never" and need > room:
        raise StreamingError(
            f"its weights ({need / 2**30:.1f} GiB) exceed the memory available ({room / 2**30:.1f} GiB), and this job "
            "cannot stream them one block at a time (runtime.stream_weights). Run it on a host with more memory "
            "(cluster.forward.mem_mb)")
    if not streams(mode, need, room):
        return None
    from mfpipe.models.adapters.composite import is_composite

    if is_composite(model.config):  # its blocks are placed on the text model; its checkpoint names them otherwise
        raise StreamingError("a multimodal composite's language model is not streamed block by block: load it whole "
                             "(runtime.stream_weights: false) on a host where its weights fit")
    checkpoint = Checkpoint(safetensors_files(checkpoint_folder(source, path, rev)))
    streamer = stream_blocks(model, blocks(model), checkpoint, device)
    log.info("%s: weights streamed one block at a time (runtime.stream_weights: %s): %.2f GiB of weights, %.2f GiB "
             "available; %.2f GiB resident (embedding, final norm, LM head), at most %.2f GiB of one block beside them",
             what, str(stream).lower(), need / 2**30, room / 2**30, (need - sum(streamer.block_bytes)) / 2**30,
             max(streamer.block_bytes) / 2**30)
    return model
