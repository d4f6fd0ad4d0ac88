"""A model whose weights exceed the memory, run one block at a time: its decoder blocks' parameters stay on the meta
device (shapes, no data) and each block's are read from the checkpoint's safetensors files just before the block
runs and dropped right after (a forward pre-hook and a forward hook on the block), while the embedding, the final
norm, the LM head and every buffer stay resident.

Every forward, traced or plain (the statistics pass's capture, pass 2, the substitution's patched reads, the
structural probe), runs the model's own code on the very weights a whole load gives: the streamed model's results
equal the whole model's bit for bit (tests/test_streaming.py). The price is a read of the blocks' weights per forward
(``mfpipe estimate`` prices it; a larger batch amortizes it).

Code that reads a block's weights outside its forward (the adapter's block pieces: ``value_weights``,
``out_proj_slices``, the norm's form ...) holds the block with :func:`held` while it does: a no-op for a block that is
not streamed. Tensors taken from a held block's parameters stay valid after it is released (they keep their storage;
only the module lets go of it).

* :class:`Checkpoint` reads tensors from safetensors files by name, with plain file reads: no memory map, so a block
  read and dropped leaves nothing in the process's resident memory (a mapped file's touched pages would count there).
* :func:`parameters_on_meta` builds a model with its parameters on the meta device and its buffers real (computed by
  the modules' own constructors, as a whole load has them).
* :class:`BlockStreamer` materializes and releases the blocks (the blocks are handed to it: this module knows no
  module path); it counts the bytes of block parameters resident at once (``peak_bytes``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor, nn

__all__ = ["BlockStreamer", "Checkpoint", "StreamingError", "checkpoint_names", "held", "holds_block", "materialize",
           "parameters_on_meta", "reread", "saved_from_checkpoint", "source_of", "stream_blocks", "streamer_of"]

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}

# block module -> (its streamer, its index): what held() looks a block up in (weak: a model dropped is forgotten)
_STREAMED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# the storage of each resident streamed block parameter -> ((checkpoint, name, dtype, device), a weak reference to the
# parameter): where a graph that saves it for its backward (a linear layer's weight, for its input's gradient) reads it
# again (saved_from_checkpoint). The reference tells a live entry from one whose parameter went away without a release
# (a dropped model's resident parts): its freed address, reused by another tensor, must not be taken for it.
_RESIDENT: dict[int, tuple] = {}


class StreamingError(RuntimeError):
    """A checkpoint cannot be streamed (the message names the file or tensor and what to do)."""


class Checkpoint:
    """The tensors of safetensors ``files`` by name: the headers are read once, each tensor on request."""

    def __init__(self, files: Sequence[str | Path]):
        self.entries: dict[str, tuple[Path, torch.dtype, tuple[int, ...], int, int]] = {}
        for f in map(Path, files):
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                try:
                    header = json.loads(fh.read(n))
                except (ValueError, UnicodeDecodeError) as e:
                    raise StreamingError(f"{f} is not a safetensors file (its header does not parse: {e})") from e
            for name, e in header.items():
                if name == "__metadata__":
                    continue
                if e["dtype"] not in _DTYPES:
                    raise StreamingError(f"{f}: tensor {name} has dtype {e['dtype']}, which weight streaming does not "
                                         f"read (it reads {', '.join(_DTYPES)})")
                b, end = e["data_offsets"]
                self.entries[name] = (f, _DTYPES[e["dtype"]], tuple(e["shape"]), 8 + n + b, 8 + n + end)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][2]

    def read(self, name: str) -> Tensor:
        """Tensor ``name`` in its stored dtype, on the CPU (read straight into its own memory)."""
        path, dtype, shape, begin, end = self.entries[name]
        buf = torch.empty(end - begin, dtype=torch.uint8)
        with open(path, "rb", buffering=0) as fh:
            fh.seek(begin)
            view, got = memoryview(buf.numpy()), 0
            while got < len(view):  # a raw read may return fewer bytes than asked
                k = fh.readinto(view[got:])
                if not k:
                    raise StreamingError(f"{path} ends inside tensor {name}: the file is truncated")
                got += k
        return buf.view(dtype).reshape(shape)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside have their parameters on the meta device (no data) and their buffers real."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def checkpoint_names(model: nn.Module, checkpoint: Checkpoint) -> dict[str, str]:
    """The model's state-dict names -> the checkpoint's names of their tensors, as a whole load renames a checkpoint's
    keys (transformers' conversion mapping's renamings, the base model's prefix added or stripped: a GPT-NeoX
    checkpoint's ``embed_out``, openai-community/gpt2's bare ``h.0...``). A key transformers converts (fuses, splits:
    the per-expert weights of a mixture of experts) names nothing: the parameter it makes is left unnamed."""
    meta = model.state_dict()
    prefix = getattr(model, "base_model_prefix", None) or None
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        mapping = get_model_conversion_mapping(model)
    except ImportError:  # a transformers without them: the names as they are, the prefix added or stripped
        renamings, converters, rename_source_key = [], [], None
    else:
        renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
        converters = [m for m in mapping if isinstance(m, WeightConverter)]
    out = {}
    for key in checkpoint.entries:
        if rename_source_key is None:
            name = next((k for k in (key, key.removeprefix(f"{prefix}."), f"{prefix}.{key}") if k in meta), key)
            converted = None
        else:
            name, converted = rename_source_key(key, renamings, converters, prefix, meta)
            if name not in meta and key in meta:  # as a whole load does: the key itself, its prefix settled
                name, converted = rename_source_key(key, [], [], prefix, meta)
        if converted is None and name in meta and tuple(meta[name].shape) == checkpoint.shape(key):
            out.setdefault(name, key)
    return out


def materialize(model: nn.Module, names: dict[str, str], checkpoint: Checkpoint, device) -> int:
    """Read the model's meta parameters outside the blocks (``names``: name -> checkpoint name, for every parameter
    and persistent buffer not in a block) onto ``device``, each in its meta placeholder's (buffer's) dtype, tied ones
    once; move every buffer to ``device``. Returns the bytes read into the model."""
    total = _load(_slots(model, names), checkpoint, device)
    for mod_name, m in model.named_modules():
        for name, b in m._buffers.items():
            key = names.get(f"{mod_name}.{name}" if mod_name else name)
            if key is not None:  # a persistent buffer the checkpoint holds: its value, as a whole load reads it
                b = checkpoint.read(key).to(dtype=b.dtype)
            if b is not None:
                m._buffers[name] = b.to(device)
    return total


def stream_blocks(model: nn.Module, blocks: Sequence[nn.Module], checkpoint: Checkpoint, device) -> BlockStreamer:
    """Stream the parameters of ``blocks`` (``model``'s decoder blocks, found by the adapter's structure) from
    ``checkpoint`` onto ``device``, and read every other parameter of ``model`` (built by :func:`parameters_on_meta`)
    there now. Every parameter needs a tensor of its shape in the checkpoint (:func:`checkpoint_names`; tied ones
    under one of their names), or this raises naming it."""
    names = checkpoint_names(model, checkpoint)
    params = list(model.named_parameters(remove_duplicate=False))
    key_of = {id(p): names[n] for n, p in params if n in names}
    missing = [n for n, p in params if id(p) not in key_of]
    if missing:
        raise StreamingError(
            f"its checkpoint has no tensor of the name and shape of parameter(s) {', '.join(missing[:3])}"
            f"{' ...' if len(missing) > 3 else ''} (transformers converts them from the checkpoint's as it loads "
            "them, which weight streaming does not): set runtime.stream_weights: false and load it whole")
    names.update({n: key_of[id(p)] for n, p in params})
    where = {id(m): n for n, m in model.named_modules()}
    inside = tuple(where[id(b)] + "." for b in blocks)
    in_block = {n for n, _ in params if n.startswith(inside)}  # the streamed; the rest (buffers too) read now
    materialize(model, {n: k for n, k in names.items() if n not in in_block}, checkpoint, device)
    return BlockStreamer(model, blocks, checkpoint, {n: k for n, k in names.items() if n in in_block}, device)


def _slots(root: nn.Module, names: dict[str, str]) -> list[tuple[nn.Module, str, str, Tensor]]:
    """(owning module, attribute, checkpoint name, meta placeholder) of each parameter of ``root`` named in
    ``names`` (tied parameters: one slot per owner, the same placeholder)."""
    out = []
    for name, p in root.named_parameters(remove_duplicate=False):
        if name in names:
            owner, _, attr = name.rpartition(".")
            out.append((root.get_submodule(owner) if owner else root, attr, names[name], p))
    return out


def _load(slots, checkpoint: Checkpoint, device) -> int:
    """Each slot's tensor read from ``checkpoint`` onto ``device`` in its placeholder's dtype (as a whole load casts
    it), set as a frozen parameter of its owner (tied slots share one); returns the bytes read."""
    loaded, total = {}, 0
    for owner, attr, key, placeholder in slots:
        if id(placeholder) not in loaded:
            t = checkpoint.read(key).to(dtype=placeholder.dtype).to(device)
            param = loaded[id(placeholder)] = nn.Parameter(t, requires_grad=False)
            total += t.numel() * t.element_size()
            _RESIDENT[t.untyped_storage().data_ptr()] = ((checkpoint, key, t.dtype, t.device), weakref.ref(param))
        owner._parameters[attr] = loaded[id(placeholder)]
    return total


class BlockStreamer:
    """Streams the parameters of ``blocks`` (modules of ``model``, in forward order) from ``checkpoint`` onto
    ``device``: each block's are read before its forward and dropped after it, or held by :func:`held`.
    ``names``: every block parameter's name in ``model`` -> its checkpoint name."""

    def __init__(self, model: nn.Module, blocks: Sequence[nn.Module], checkpoint: Checkpoint,
                 names: dict[str, str], device):
        self.checkpoint, self.device = checkpoint, torch.device(device)
        where = {id(m): n for n, m in model.named_modules()}
        self.slots = []
        for block in blocks:
            prefix = where[id(block)] + "."
            own = {n.removeprefix(prefix): k for n, k in names.items() if n.startswith(prefix)}
            self.slots.append(_slots(block, own))
        self.block_bytes = [sum(p.numel() * p.element_size() for p in {id(s[3]): s[3] for s in slot}.values())
                            for slot in self.slots]
        self.count = [0] * len(blocks)
        self.resident_bytes = self.peak_bytes = 0
        self.reads = 0  # blocks read so far
        self._in_forward: int | None = None
        self.handles = []
        for i, block in enumerate(blocks):
            _STREAMED[block] = (self, i)
            self.handles.append(block.register_forward_pre_hook(self._pre_hook(i)))
            # always_call: a forward stopped inside the block (the traced site's early stop, an error) lets go too
            self.handles.append(block.register_forward_hook(self._post_hook(i), always_call=True))

    # ------------------------------------------------------------------ holding
    def acquire(self, i: int) -> None:
        if self.count[i] == 0:
            _load(self.slots[i], self.checkpoint, self.device)
            self.resident_bytes += self.block_bytes[i]
            self.peak_bytes = max(self.peak_bytes, self.resident_bytes)
            self.reads += 1
        self.count[i] += 1

    def release(self, i: int) -> None:
        if self.count[i] <= 0:
            return
        self.count[i] -= 1
        if self.count[i] == 0:
            for owner, attr, _, placeholder in self.slots[i]:
                _RESIDENT.pop(owner._parameters[attr].untyped_storage().data_ptr(), None)
                owner._parameters[attr] = placeholder
            self.resident_bytes -= self.block_bytes[i]

    @contextlib.contextmanager
    def hold(self, i: int) -> Iterator[None]:
        self.acquire(i)
        try:
            yield
        finally:
            self.release(i)

    def reset_peak(self) -> None:
        self.peak_bytes = self.resident_bytes

    # ------------------------------------------------------------------ the forward's hooks
    def _pre_hook(self, i: int):
        def pre(module, args):
            # a forward that left a block without its forward hook (always_call runs it after an exception too: a
            # safety net) has its hold let go here, so the forward holds at most one block at a time
            if self._in_forward is not None and self._in_forward != i:
                self.release(self._in_forward)
                self._in_forward = None
            if self._in_forward is None:
                self.acquire(i)
                self._in_forward = i
        return pre

    def _post_hook(self, i: int):
        def post(module, args, output):
            if self._in_forward == i:
                self._in_forward = None
                self.release(i)
        return post


def streamer_of(block: nn.Module) -> tuple[BlockStreamer, int] | None:
    """(the streamer, the block's index) where ``block`` is streamed, else None."""
    return _STREAMED.get(block)


def holds_block(fn):
    """A method ``(self, layer, ...)`` of an adapter that reads block ``layer``'s weights outside its forward: the
    block (``self.block_module(layer)``) is held for the call (a no-op for a model loaded whole)."""
    @functools.wraps(fn)
    def wrapper(self, layer, *args, **kwargs):
        with held(self.block_module(layer)):
            return fn(self, layer, *args, **kwargs)

    return wrapper


@contextlib.contextmanager
def held(block: nn.Module) -> Iterator[None]:
    """``block``'s parameters resident while the ``with`` body runs (a no-op where the block is not streamed)."""
    found = _STREAMED.get(block)
    if found is None:
        yield
        return
    streamer, i = found
    with streamer.hold(i):
        yield


# ------------------------------------------------------------------------------------------ a backward, streamed
def source_of(t: Tensor) -> tuple | None:
    """Where the resident streamed block parameter whose storage ``t`` shares is read from (None: not one)."""
    if t.device.type == "meta" or t.untyped_storage().nbytes() == 0:
        return None
    ptr = t.untyped_storage().data_ptr()
    found = _RESIDENT.get(ptr)
    if found is None:
        return None
    source, ref = found
    param = ref()
    if param is None or param.untyped_storage().data_ptr() != ptr:  # stale: the parameter is gone, its memory reused
        _RESIDENT.pop(ptr, None)
        return None
    return source if source[2] == t.dtype else None


def reread(source: tuple) -> Tensor:
    """The tensor of ``source`` (:func:`source_of`) read again from its checkpoint, as its block's load read it."""
    checkpoint, key, dtype, device = source
    return checkpoint.read(key).to(dtype=dtype).to(device)


class _Saved(NamedTuple):
    source: tuple
    size: tuple
    stride: tuple
    offset: int


def _pack(t: Tensor):
    source = source_of(t)
    return t if source is None else _Saved(source, tuple(t.size()), t.stride(), t.storage_offset())


def _unpack(saved):
    return reread(saved.source).as_strided(saved.size, saved.stride, saved.offset) if isinstance(saved, _Saved) \
        else saved


@contextlib.contextmanager
def saved_from_checkpoint() -> Iterator[None]:
    """A graph recorded in the ``with`` body saves, in place of a streamed block's parameter (or a view of it), where
    to read it again, and its backward reads it when it needs it: a backward through a streamed model holds one
    block's weights at a time, as its forward does, at the price of a read of every block per backward call (the
    J-lens's, :mod:`mfpipe.jlens.lens`). Without it the graph would keep every block it passed through resident.
    No hooks where no model is streamed: a hook that saves a tensor as itself turns an output its own node saves into
    a reference cycle the collector cannot see, freed only by the graph's last backward."""
    if not len(_STREAMED):
        yield
        return
    with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
        yield
