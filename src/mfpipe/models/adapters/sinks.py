"""An attention sink applied after the softmax as a factor of each head's reads (Granite-SWA's ``sinks``: the
attention returns ``weights = softmax(scores)`` and reads ``(weights @ V) * sigmoid(logsumexp(scores) - sink)``).

Since ``sigmoid(lse - s) = Z / (Z + e^s)`` (``Z = sum_j e^{score_j}``), ``weights * sigmoid(lse - s)`` is
``e^{score_j} / (Z + e^s)``: the rows of a softmax over the keys and one sink column, the column dropped (rows sum
below 1), exactly what gpt_oss's attention returns itself. mfpipe reads these *effective probabilities*
``P_eff = weights * factor``: then ``reads = P_eff @ V`` (to rounding), and every consumer of the site's
``attn_probs`` (the statistics pass, pass 2, the mean field, the rollout, the experiments) is right unchanged.

The returned tensors cannot give the factor (a softmax row forgets its logsumexp), so a **tap** records it where the
attention computes it: a forward pre-hook on the attention module pushes a
:class:`~torch.overrides.TorchFunctionMode` that passes every op through and, at the *first* ``logsumexp`` over the
last dimension of that forward (the scores'), computes ``(lse - sink.view(1, -1, 1)).to(float32).sigmoid()`` with
the module's own sink parameter: the attention's own ops and dtypes, so the factor is the model's to the bit. A
forward hook with ``always_call=True`` pops the mode, so it is popped even where the forward is unwound by an
exception (the site's early stop, ``tracer.stop()``). The mode is thread-local; nnsight's trace body runs in a
greenlet of the same thread, so its ops inside the attention's forward pass through it too (unrecorded: only the
first logsumexp counts, and the attention's comes before its output projection, where the body first reads).

* :class:`SinkTap`: the tap on one attention module (:func:`shared_tap`: one shared tap per module, however many
  adapters are built on the model); :func:`effective`: ``P_eff`` of the returned weights and the recorded factor.
* :class:`AttentionSink`: the adapter's mixin: its taps (``Structure.attn_sink``) and
  :meth:`~AttentionSink.effective_probs`, which the site reads its ``attn_probs`` through.
* :func:`probe_sink`: the probe's one-shot tap on the placed block's attention (:func:`~.forms.block_forms`); the
  probe's value search then checks ``P_eff`` against the reads.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

__all__ = ["AttentionSink", "SinkTap", "effective", "probe_sink", "shared_tap", "sink_parameter"]

_LSE = (torch.logsumexp, Tensor.logsumexp)


class _FirstLogsumexp(TorchFunctionMode):
    """Passes every op through; hands the first logsumexp over the last dimension (input, output) to ``tap``."""

    def __init__(self, tap: SinkTap):
        super().__init__()
        self.tap = tap

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _LSE and self.tap.factor is None and _over_last(args, kwargs):
            self.tap.record(args[0], out)  # ops in a mode's handler do not dispatch to the mode again
        return out


def _over_last(args, kwargs) -> bool:
    x = args[0] if args else kwargs.get("input")
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    dims = (dim,) if isinstance(dim, int) else tuple(dim) if isinstance(dim, (tuple, list)) else ()
    return isinstance(x, Tensor) and len(dims) == 1 and dims[0] in (-1, x.ndim - 1)


class SinkTap:
    """The factor ``sigmoid(lse - sink)`` [B, H, Tq] (float32) of the last forward of one attention ``module``
    (``factor``; None until a forward computed a logsumexp of ``[B, H, Tq, Tk]`` scores), with ``param`` the module's
    own ``(H,)`` sink parameter. ``once``: the hooks remove themselves after one forward, and the scores the logsumexp
    read are kept (``scores``: the probe checks that they are the scores of the returned weights)."""

    def __init__(self, module: nn.Module, param: str, once: bool = False):
        # a weak reference: the shared taps are values of a dict weakly keyed by their module, which must not keep it
        self._module, self.param, self.once = weakref.ref(module), param, once
        self.factor: Tensor | None = None
        self.scores: Tensor | None = None
        self._modes: list[_FirstLogsumexp] = []
        self._handles = [module.register_forward_pre_hook(self._push),
                         module.register_forward_hook(self._pop, always_call=True)]

    @property
    def module(self) -> nn.Module | None:
        return self._module()

    def _push(self, module, args) -> None:
        self.factor = self.scores = None
        mode = _FirstLogsumexp(self)
        mode.__enter__()
        self._modes.append(mode)

    def _pop(self, module, args, out) -> None:
        if self._modes:
            self._modes.pop().__exit__(None, None, None)
        if self.once:
            self.remove()

    def record(self, scores: Tensor, lse: Tensor) -> None:
        sink = getattr(self.module, self.param)  # the module is running: alive
        if lse.ndim != 3 or lse.shape[1] != sink.numel():  # not [B, H, Tq]: no logsumexp of a head's scores
            return
        # the attention's own ops and dtypes (Granite-SWA's eager_attention_forward), so the factor is its own
        self.factor = (lse - sink.view(1, -1, 1)).to(torch.float32).sigmoid()
        self.scores = scores.detach() if self.once else None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


_TAPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> its shared tap


def shared_tap(module: nn.Module, param: str) -> SinkTap:
    """The one persistent :class:`SinkTap` of ``module`` (made on the first call; every adapter of the model shares
    it, so building adapters again adds no modes to a forward)."""
    tap = _TAPS.get(module)
    if tap is None or tap.param != param:
        if tap is not None:
            tap.remove()
        tap = _TAPS[module] = SinkTap(module, param)
    return tap


def effective(weights: Tensor, factor: Tensor) -> Tensor:
    """``P_eff = weights * factor`` (float32 ``[B, H, Tq, Tk]``): the probabilities behind the reads."""
    return weights.float() * factor[..., None]


def sink_parameter(module: nn.Module) -> str | None:
    """The name of the attention module's one own 1-D parameter (a sink per head: the tap records a factor only where
    the logsumexp has one row per entry of it), or None."""
    found = [n for n, p in module.named_parameters(recurse=False) if p.ndim == 1]
    return found[0] if len(found) == 1 else None


def probe_sink(module: nn.Module, path: str):
    """For the probe forward of a block whose attention ``module`` (at ``path`` in the block) has one own 1-D
    parameter: a one-shot tap on it and ``apply(seen, same) -> dict``, which, where that forward computed a logsumexp
    of the scores of the weights the attention returned (``softmax(scores) == weights``, ``same``: up to the model
    dtype's rounding), puts ``P_eff`` in place of those weights in ``seen["<attn>"]`` (the value search then checks it
    against the reads) and returns ``{"attn_sink": "PATH.NAME"}``; else ``{}``. None where the module has no such
    parameter."""
    name = sink_parameter(module)
    if name is None:
        return None
    tap = SinkTap(module, name, once=True)

    def apply(seen: dict, same) -> dict:
        tap.remove()  # where the probe forward never ran the attention
        attn = seen.get("<attn>")
        out = None if attn is None else attn.out
        if tap.factor is None or not isinstance(out, (tuple, list)) or len(out) < 2 or not isinstance(out[1], Tensor):
            return {}
        weights = out[1]
        if tap.scores.shape != weights.shape or not same(torch.softmax(tap.scores.float(), -1), weights.float()):
            return {}
        seen["<attn>"] = attn._replace(out=(out[0], effective(weights, tap.factor), *out[2:]))
        return {"attn_sink": f"{path}.{name}"}

    return apply


class AttentionSink:
    """Mixin of :class:`~mfpipe.models.adapters.Adapter`: the taps of a structure with ``attn_sink`` (the sink
    parameter's path from a block: its attention module's path, then its name) and the probabilities behind the
    reads."""

    _sink_taps: dict | None = None

    def _install_sinks(self) -> None:
        path = self.structure.attn_sink
        if path is None:
            return
        mod, name = path.rsplit(".", 1)
        self._sink_taps = {l: shared_tap(self._sub(l, mod), name) for l in self.attention_layers}

    def sink_layers(self) -> tuple[int, ...]:
        """The attention layers whose probabilities leave out a sink's share, so their rows sum below 1: every one
        where the factor is tapped (``attn_sink``), else those whose attention has its own 1-D sink parameter
        (gpt_oss's, MiMo-V2-Flash's sliding layers: the sink's column dropped from the rows it returns)."""
        if self.structure.attn_sink is not None:
            return tuple(self.attention_layers)
        attn = self.structure.attn
        return tuple(l for l in self.attention_layers if "sink" in (sink_parameter(self._sub(l, attn)) or ""))

    def sink_tap(self, layer: int) -> SinkTap | None:
        """Layer ``layer``'s tap (its ``factor``: of the last forward), or None where its attention has no sink."""
        return None if self._sink_taps is None else self._sink_taps.get(layer)

    def effective_probs(self, layer: int, weights: Tensor) -> Tensor:
        """The probabilities behind layer ``layer``'s reads (float32) of the weights its attention returned in the
        forward now running: the weights themselves, or ``P_eff`` where the attention has a sink."""
        if self._sink_taps is None:
            return weights.float()
        factor = self._sink_taps[layer].factor
        if factor is None or factor.shape != weights.shape[:-1]:
            raise RuntimeError(f"{self.model_type}: layer {layer}'s attention computed no logsumexp of its scores in "
                               "this forward: its sink's factor is unknown (transformers' attention changed? check "
                               "the model with `mfpipe conformance`)")
        return effective(weights, factor)
