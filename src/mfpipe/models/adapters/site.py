"""The read/patch site: ONE nnsight-traced forward that reads, replaces and scores.

:meth:`TracedSite.run` is the only code in mfpipe that reads or replaces activations inside a forward pass, apart
from the J-lens's Jacobians (:mod:`mfpipe.models.adapters.jacobian`): they need the autograd graph of an ordinary
forward, which this site runs under ``no_grad``, so that module hooks the modules the adapter names. Per layer it can

* **read** the :class:`LayerCapture` fields named by ``select`` (like TransformerLens' ``names_filter``): a field
  that is not selected is never read from the forward, converted or copied;
* **replace** every head's read at the output projection's input (``patch_reads``; at the input of a norm of every
  head's reads before it: BitNet's, adapters.normed), written back in the model's dtype *before* the output
  projection runs, so on post-attention-norm blocks (Gemma-2, OLMo-2) the replacement also passes through that norm;
* **replace** the output projection's output (``patch_out``), seeing the per-head reads that went into it: the
  paper's positional-transport ablation (App. positional, "Dereferencing") projects a residual-space subspace S out
  of the summed write of a set of heads C mid-forward, ``out - P_S(sum_{h in C} O_h z_h)`` (``O_h`` from
  ``out_proj_slices``), which a reads-space patch cannot express;

and after the last layer it hands over the final residual (``on_final``) and, when asked, runs the LM head for the
logits and the next-token loss. A block the forward skips (:mod:`~mfpipe.models.adapters.forms`) is read where the
block run before it hands on its output.

nnsight 0.8 notes (checked with nnsight 0.8.1, transformers 5.23; see ``shared/design/nnsight-notes.md``)
-------------------------------------------------------------------------------------------------------
* The trace body runs in a greenlet interleaved with the forward; ``.input`` / ``.output`` give real
  tensors, and helper methods *called from* the body (``_trace_body``, ``_layer_site``) may read and
  write envoys too. Plain names assigned in the body do not reach the caller (only ``.save()`` does),
  so results leave through objects created outside (:class:`RunResult`, the callbacks).
* Reads must follow forward-execution order; touching a module the forward already passed raises
  ``nnsight.intervention.interleaver.OutOfOrderError``. :meth:`TracedSite._layer_site` therefore reads in block
  order: block input, value source, output projection input and output, attention output, post-attention norm, MLP.
* Without logits we trace the decoder stack (``model.base_model``) rather than the causal LM with ``tracer.stop()``
  to skip the LM head: ``stop()`` raises an exception whose traceback keeps the last layer's activations alive in a
  reference cycle until the next garbage collection. Where a run reads nothing after the last layer's ``on_layer``
  (no final residual, logits or loss), :meth:`TracedSite.run` does stop there (the last block's MLP is not run) and
  collects the young generations right after, which frees that cycle (tests/test_adapters.py).
* Assigning ``envoy.input = tensor`` replaces the module's first positional input (``envoy.output = tensor``
  its output); writing back the module's own input (output) leaves the logits bit-identical.
* Wrapping a model with ``NNsight`` leaves its plain forward bit-identical; several wrappers of one
  model coexist (we keep one of the decoder stack and, once logits are asked for, one of the causal LM).
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from mfpipe.models.adapters.capture import (CAPTURE_FIELDS, LayerCapture, PatchOut, PatchReads, PatchResid, RunResult,
                                            Select, first_output, module_at, resolve_select)
from mfpipe.models.adapters.forms import skipped_capture
from mfpipe.models.adapters.gate import OutputGate, gated_input
from mfpipe.models.adapters.layers import pad_heads, unpadded
from mfpipe.models.adapters.sinks import AttentionSink

# LayerCapture, RunResult, resolve_select and module_at live in adapters.capture; re-exported here for their callers
__all__ = ["CAPTURE_FIELDS", "LayerCapture", "RunResult", "TracedSite", "module_at", "resolve_select"]


class TracedSite(OutputGate, AttentionSink):  # an output gate's reads and piece (adapters.gate); a sink's factor
    """Mixin of :class:`~mfpipe.models.adapters.Adapter`: the traced read/patch site.

    Uses the adapter's module paths (``LAYERS``, ``FINAL_NORM``, ``V_SRC``, ``O_PROJ``, ``ATTN``,
    ``POST_ATTN_NORM``, ``MLP``, ``POST_MLP_NORM``), its shapes and ``_values_from_src``.
    """

    _envoy = None  # nnsight wrapper of the decoder stack, built on the first run without logits
    _lm_envoy = None  # nnsight wrapper of the causal LM, built on the first run with logits / loss
    _lm_base = None  # the decoder stack's envoy inside it

    @property
    def has_lm_head(self) -> bool:
        """Whether :meth:`run` can return logits (False when the adapter was built on a bare base model)."""
        return self.model is not self.base

    def _check_capturable(self) -> None:
        impl = getattr(self.config, "_attn_implementation", None)
        if impl != "eager":
            raise ValueError(
                f"Adapter.run/capture needs eager attention (got attn_implementation={impl!r}); load the model "
                "with mfpipe.models.loader.load_model or call model.set_attn_implementation('eager')"
            )
        if self.model.training or self.base.training:
            raise ValueError("Adapter.run/capture needs the model in eval mode (dropout); call model.eval()")

    def _trace_roots(self, with_lm_head: bool):
        """(envoy to trace, envoy of the decoder stack inside it)."""
        from nnsight import NNsight

        if not with_lm_head:
            if self._envoy is None:
                self._envoy = _envoy(NNsight, self.base)
            return self._envoy, self._envoy
        if not self.has_lm_head:
            raise ValueError(
                f"logits/loss need the causal LM, but this adapter wraps the bare {type(self.base).__name__}: "
                "build it with get_adapter(model) on the *ForCausalLM / *LMHeadModel"
            )
        if self._lm_envoy is None:
            self._lm_envoy = _envoy(NNsight, self.model)
            # the decoder stack's path in the causal LM ("transformer", "model", ...; not always base_model_prefix)
            path = next(n for n, m in self.model.named_modules() if m is self.base)
            self._lm_base = module_at(self._lm_envoy, path)
        return self._lm_envoy, self._lm_base

    def run(
        self,
        input_ids,
        *,
        select: Select = "all",
        on_layer: Callable[[LayerCapture], None] | None = None,
        patch_reads: PatchReads | None = None,
        patch_resid: PatchResid | None = None,
        patch_out: PatchOut | None = None,
        on_final: Callable[[Tensor], None] | None = None,
        logits: bool = False,
        loss: bool = False,
    ) -> RunResult:
        """ONE nnsight-traced forward pass over ``input_ids`` [B,T] (no padding, no attention mask; any
        integer tensor or array), under ``torch.no_grad()``.

        * ``select``: which :class:`LayerCapture` fields to materialise (see :func:`resolve_select`);
          unselected fields stay ``None`` and cost nothing.
        * ``on_layer(LayerCapture)``: called once per layer, in layer order, from inside the trace, after
          the layer's last selected tensor exists (real float32 tensors; views of the model's own
          activations when the model is float32: do not modify them in place).
        * ``patch_reads(layer, reads)``: called once per layer, in layer order, at the output projection's
          input, with that layer's per-head reads [B,T,H,dh] (float32; do not modify in place). Return the
          replacement [B,T,H,dh] (any float dtype; cast to the model's dtype and written back before the
          output projection runs), or ``None`` to leave the layer untouched. Called before that layer's
          ``on_layer``; ``LayerCapture.reads`` stays the unpatched read. (``dh`` is ``d_head``: a layer of narrower
          heads hands its reads zero-padded and takes a replacement whose padded coordinates are 0, adapters.layers.)
        * ``patch_resid(layer, resid)``: called once per layer, in layer order, at the block's input with the
          residual stream entering block ``layer`` [B,T,d] (float32; do not modify in place). Return the
          replacement [B,T,d] (cast to the model's dtype and written back before the block runs; e.g. a
          function vector added at one position) or ``None`` to leave it. ``LayerCapture.resid_in`` is the
          replaced residual.
        * ``patch_out(layer, out, reads)``: called once per layer, in layer order, at the output projection's
          output, with that output ``out`` [B,T,d] (float32, bias included, before any post-attention norm; do
          not modify in place) and the per-head reads that went into it [B,T,H,dh] (float32, times an output gate, after
          ``patch_reads`` if any). Return the replacement [B,T,d] (cast to the model's dtype and written back as
          the projection's output, so a post-attention norm (Gemma-2, OLMo-2) and everything after see it) or
          ``None`` to leave it. E.g. the positional-transport ablation: ``out - P_S(sum_{h in C} O_h z_h)`` with
          ``O_h = out_proj_slices(layer)[h]``. Called after ``patch_reads`` and before that layer's ``on_layer``;
          ``LayerCapture.reads`` stays the unpatched read, ``attn_out`` / ``resid_mid`` follow the patch.
        * ``on_final(final residual before the last norm [B,T,d], float32)``.
        * ``logits``: run the full causal LM (LM head included) and return ``RunResult.logits`` [B,T,V]
          float32. ``loss``: return ``RunResult.loss`` / ``token_loss`` (next-token cross entropy of the
          float32 logits; needs T >= 2). Without either, only the decoder stack runs (no LM head); without
          either and without ``on_final``, the forward stops once the last layer's ``on_layer`` returns (what
          comes after it, e.g. the last block's MLP and the final norm, reaches no output: pass 2 reads the
          attention only).

        Exceptions raised by the callbacks propagate unchanged.
        """
        self._check_capturable()
        sel = resolve_select(select)
        ids = torch.as_tensor(input_ids).to(device=self.device, dtype=torch.long)
        if ids.ndim != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(ids.shape)}")
        if loss and ids.shape[1] < 2:
            raise ValueError(f"loss needs at least 2 positions per row, got input_ids of shape {tuple(ids.shape)}")
        root, base_env = self._trace_roots(with_lm_head=logits or loss)
        result = RunResult()
        # nested, not one `with a, b:` — nnsight captures the trace's own `with` block from the source
        with torch.no_grad():  # noqa: SIM117
            stop = on_final is None and not (logits or loss)
            with root.trace(ids, use_cache=False) as tracer:
                self._trace_body(root, base_env, ids, sel, on_layer, patch_reads, on_final, logits, loss, result,
                                 patch_resid, patch_out)
                if stop:
                    tracer.stop()
        if stop:
            # the stop unwinds the forward by an exception that nnsight holds in a local of the frame it raised from:
            # a reference cycle through the traceback, which keeps the last block's frames (their attention
            # probabilities) alive until the cycle collector runs. Collect the young generations now (~0.2 ms)
            gc.collect(1)
        return result

    def capture(
        self,
        input_ids,
        on_layer: Callable[[LayerCapture], None],
        on_final: Callable[[Tensor], None] | None = None,
    ) -> None:
        """Every field of every layer: ``run(input_ids, select="all", on_layer=..., on_final=...)``.

        Only the decoder stack (``model.base_model``) runs: the LM head is never computed.
        """
        self.run(input_ids, select="all", on_layer=on_layer, on_final=on_final)

    # ------------------------------------------------------------------ inside the trace
    def _trace_body(self, root, base_env, ids, sel, on_layer, patch_reads, on_final, logits, loss, result,
                    patch_resid=None, patch_out=None) -> None:
        """Runs in the nnsight worker, interleaved with the forward pass."""
        layers_env = module_at(base_env, self.LAYERS)
        kinds = getattr(self, "layer_kinds", None)
        for layer in range(self.n_layers):
            # a hybrid's block of another mixer (Mamba, a delta-net...) runs as the model runs it: only its input is
            # read (and patch_resid'd; where the forward skips the block, as the one before hands it on: adapters.forms)
            other = kinds is not None and kinds[layer] != "attention"
            cap = skipped_capture(layers_env, kinds, layer, sel, patch_resid, LayerCapture) or self._layer_site(
                layers_env[layer], layer, sel & {"resid_in"} if other else sel, None if other else patch_reads,
                patch_resid, tuple(ids.shape), None if other else patch_out)
            if on_layer is not None:
                on_layer(cap)
        if on_final is not None:
            s = self.structure  # a final norm that is also the embedding's (NanoChat) read it first: the last block's
            # (or none: the last block's output is the final residual)
            out = layers_env[-1].output if s.embed_norm == s.final_norm or s.final_norm is None else module_at(
                base_env, self.FINAL_NORM).input
            on_final(first_output(out).float())
        if logits or loss:
            out = root.output
            lg = (out.logits if hasattr(out, "logits") else out[0]).float()
            if logits:
                result.logits = lg
            if loss:
                # as transformers' own causal-LM loss: the targets shifted, not the logits (lg[:, :-1] would copy
                # all B*T*V of them), the last position's target ignored (its loss is 0 and dropped)
                B, T, V = lg.shape
                targets = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
                tl = torch.nn.functional.cross_entropy(lg.reshape(-1, V), targets.reshape(-1), reduction="none")
                result.token_loss = tl.view(B, T)[:, :-1].contiguous()
                result.loss = result.token_loss.reshape(-1).mean()

    def _layer_site(self, layer_env, layer: int, sel: frozenset[str], patch_reads: PatchReads | None,
                    patch_resid: PatchResid | None = None, bt: tuple[int, int] | None = None,
                    patch_out: PatchOut | None = None) -> LayerCapture:
        """One block: read the selected tensors and patch the residual, reads and projection output, in
        forward-execution order.

        Each ``.input`` / ``.output`` access parks until the forward pass reaches that module and returns
        the real tensor; nothing is read that ``sel`` (and the patch) does not need.
        """
        need_resid_in = "resid_in" in sel or "resid_mid" in sel
        need_attn_out = "attn_out" in sel or "resid_mid" in sel
        cap = LayerCapture(layer=layer)
        resid_in = None
        if patch_resid is not None:
            raw = layer_env.input
            new = patch_resid(layer, raw.float())
            if new is not None:
                layer_env.input = _like(new, raw, f"patch_resid(layer={layer})", "the residual")
                raw = layer_env.input
            resid_in = raw.float() if need_resid_in else None
        elif need_resid_in:
            resid_in = layer_env.input.float()
        gate = self.gate_site(layer_env, sel, patch_reads, True, layer)  # an output gate (adapters.gate): Qwen3-Next's
        if "values" in sel and self.structure.value_norm is not None:  # the values as the heads read them (Gemma-4's)
            cap.values = self.values_from_norm(module_at(layer_env, self.structure.value_norm).output, layer).float()
        elif "values" in sel:
            cap.values = self._values_from_src(module_at(layer_env, self.values_read_at(layer)).output, layer).float()
        gate = self.gate_site(layer_env, sel, patch_reads, False, layer) if gate is None else gate  # forward order
        s = self.structure
        # the attention adds the residual itself (BLOOM), or its projection sits beside it (GIT): its branch is the
        # output projection's output
        proj_out = need_attn_out and s.branch_at_projection
        attn_out = None
        # forward order: an attention proper that returns before its projection runs (GIT's) is read first
        early = module_at(layer_env, self.ATTN).output if "attn_probs" in sel and s.projection_beside else None
        if "reads" in sel or patch_reads is not None or patch_out is not None or proj_out:
            cap.reads, proj = self._out_proj_site(layer_env, layer, sel, patch_reads, patch_out, proj_out, gate)
            attn_out = proj if proj_out else None
        if "attn_probs" in sel or (need_attn_out and self.POST_ATTN_NORM is None and not proj_out):
            attn_res = module_at(layer_env, self.ATTN).output if early is None else early
            if "attn_probs" in sel:
                cap.attn_probs = self.effective_probs(layer, attn_res[1])  # times a sink's factor (adapters.sinks)
            if need_attn_out and self.POST_ATTN_NORM is None and not proj_out:
                # the bias the attention returns for the block to add (GPT-NeoX-Japanese's last)
                extra = None if s.attn_bias is None else self._sub(layer, s.attn_bias)
                attn_out = attn_res[0] if extra is None else attn_res[0] + extra
        if need_attn_out and self.POST_ATTN_NORM is not None:
            attn_out = module_at(layer_env, self.POST_ATTN_NORM).output
        if need_attn_out:
            c = self._attn_scale()  # as the block scales it (both branches', and the attention's own: Falcon-H1's)
            attn_out = attn_out.float() if c == 1.0 else attn_out * c
            if "attn_out" in sel:
                cap.attn_out = attn_out.float()
        if "mlp_out" in sel and self.MLP is None:  # no MLP in the block (Nemotron-H's attention blocks): a zero branch
            cap.mlp_out = torch.zeros(*bt, self.d_model, device=self.device)
        elif "mlp_out" in sel:
            # the residual the MLP adds itself (BLOOM, MPT: its second argument), subtracted from its output
            res = module_at(layer_env, self.MLP).inputs[0][1] if s.mlp_residual else None
            if s.mlp_siblings:  # modules on one input, their outputs added (Granite's), read in the order they run
                outs = [first_output(module_at(layer_env, path).output) for path in s.mlp_siblings]
                out = sum(o.reshape(outs[0].shape) for o in outs)
            else:
                out = module_at(layer_env, self.POST_MLP_NORM or self.MLP).output
                out = out[0] if self.POST_MLP_NORM is None and s.mlp_tuple else out
            out = out if s.branch_scale == 1.0 else out * s.branch_scale
            # a copy where .float() makes none: a block may add to its MLP's output in place (Falcon); [B, T, d] where
            # the MLP ran on [B * T, d] (OPT)
            out = out.float() if out.dtype != torch.float32 else out.clone()
            out = out if res is None else out - res.float()
            cap.mlp_out = out if bt is None or out.ndim == 3 else out.reshape(*bt, out.shape[-1])
        if "resid_in" in sel:
            cap.resid_in = resid_in
        if "resid_mid" in sel:
            cap.resid_mid = resid_in + attn_out.float()
        return cap

    def _out_proj_site(self, layer_env, layer: int, sel: frozenset[str], patch_reads: PatchReads | None,
                       patch_out: PatchOut | None, want_out: bool = False,
                       gate: Tensor | None = None) -> tuple[Tensor | None, Tensor | None]:
        """The output projection: read its input (the per-head reads; times the forward's own ``gate``: adapters.gate;
        a norm of the reads before it: that norm's input) and patch it, then patch its output. Returns (the unpatched reads [B,T,H,dh] float32 where ``sel`` asks for
        them, else None; its output, patched, where ``want_out``, else None)."""
        o_env = module_at(layer_env, self.O_PROJ)
        # a norm of every head's reads before the projection (BitNet's, adapters.normed): the reads are its input, and
        # a replaced read passes through it as the model computes it
        r_env = o_env if self.structure.reads_norm is None else module_at(layer_env, self.structure.reads_norm)
        flat = r_env.input  # [B,T,H*dh]
        heads = (*flat.shape[:2], self.n_heads, self.head_dim(layer))  # zero-padded to d_head below: adapters.layers
        reads = flat.view(heads).float() if gate is None else flat.view(heads).float() / gate
        reads = pad_heads(reads, self.d_head)
        if patch_reads is not None:
            new = patch_reads(layer, reads)
            if new is not None:
                flat = self._patched_input(new, flat, layer, None if gate is None else (reads, gate))  # now read
                r_env.input = flat
        out = None
        if patch_out is not None:
            flat = flat if r_env is o_env else o_env.input  # what each head's slice of the projection reads
            out = raw = o_env.output  # [B,T,d]: after its input (forward order), before the attention module's output
            new = patch_out(layer, raw.float(), pad_heads(flat.view(heads).float(), self.d_head))
            if new is not None:
                out = _like(new, raw, f"patch_out(layer={layer})", "the output projection's output")
                o_env.output = out
        elif want_out:
            out = o_env.output
        return (reads if "reads" in sel else None), out

    def _patched_input(self, new: Tensor, flat: Tensor, layer: int, gated: tuple | None = None) -> Tensor:
        """The replacement reads as the output projection's input (``gated``: through the gate): [B,T,H*dh]."""
        want = (*flat.shape[:2], self.n_heads, self.d_head)
        if not isinstance(new, Tensor) or tuple(new.shape) != want:
            got = tuple(new.shape) if isinstance(new, Tensor) else type(new).__name__
            raise ValueError(
                f"patch_reads(layer={layer}) returned {got}; return the replacement reads as a tensor of shape "
                f"[B,T,H,dh] = {list(want)} (or None to leave the layer unpatched)"
            )
        new = unpadded(new, self.head_dim(layer), f"patch_reads(layer={layer})")  # the layer's own coordinates
        new = new if gated is None else gated_input(flat, new, *gated)
        return new.to(device=flat.device, dtype=flat.dtype).reshape(flat.shape)


def _envoy(NNsight, module):
    """nnsight's envoy of ``module``, without its warning of a submodule named as one of an envoy's own attributes
    (GIT's ``output``): :func:`~mfpipe.models.adapters.capture.module_at` reaches it by its name."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*which nnsight already serves on every module")
        return NNsight(module)


def _like(new, raw: Tensor, who: str, what: str) -> Tensor:
    """A callback's replacement ``new`` for ``raw`` in ``raw``'s dtype/device; ValueError unless same shape."""
    if not isinstance(new, Tensor) or tuple(new.shape) != tuple(raw.shape):
        got = tuple(new.shape) if isinstance(new, Tensor) else type(new).__name__
        raise ValueError(f"{who} returned {got}; return {what} as a tensor of shape [B,T,d] = {list(raw.shape)} "
                         "(or None to leave the layer unpatched)")
    return new.to(device=raw.device, dtype=raw.dtype)
