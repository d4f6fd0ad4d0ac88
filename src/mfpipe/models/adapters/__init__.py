"""Per-architecture adapters: the ONE place in mfpipe that knows module paths.

* ``base.py`` — :class:`Adapter`: shapes, module access and the block pieces (embed, value_map,
  out_proj_slices, post_attn_norm, mlp, final_norm ...) used by the rollout.
* ``site.py`` — the read/patch site mixed into every adapter: :meth:`Adapter.run` (one nnsight-traced
  forward that reads the selected :class:`LayerCapture` fields, replaces per-head reads at the output
  projection's input, and returns logits / loss) and :meth:`Adapter.capture` (all fields, no LM head).
* ``values.py`` — the value maps mixed into every adapter (:class:`~mfpipe.models.adapters.values.ValueMaps`): where
  each head's values sit among the value source's outputs, as the site reads them and as the block pieces
  ``value_map`` / ``value_weights``.
* ``layers.py`` — per-layer attention forms (:class:`~mfpipe.models.adapters.layers.LayerForm`: each layer's head
  width, KV heads, value source and layout, where the attention layers are of several kinds: MiMo-V2-Flash's,
  dots.3-note's latent ones), placed kind by kind by a reduced probe, and the zero padding of every head-space tensor
  to the widest layer's width (an exact embedding).
* ``configs.py`` — what a model's config says of its attention forms: a value of a config whose layers differ
  (Gemma-4's head_dim) and the forms refused by the config keys that turn them on (Gemma-4's KV sharing, MoE).
* ``capture.py`` — what the site hands out and takes: :class:`LayerCapture` (one layer's fields,
  ``CAPTURE_FIELDS``), :class:`RunResult`, :func:`resolve_select`, ``module_at`` (a module by its dotted path),
  ``first_output`` (a module's main output: the first of a tuple or list) and ``hidden_input`` (the hidden states a
  hooked module was called with).
* ``structure.py`` — :class:`Structure`, where a decoder keeps its pieces, and :func:`describe`, which finds it
  by what the modules are and do (not by ``model_type``); a model it cannot place raises
  :class:`UnsupportedArchitectureError` naming what did not match.
* ``probe.py`` — the probe forward of :func:`describe`: one forward of three tokens whose tensors decide what names and
  shapes cannot (the norms' roles, the residual form, the MLP chain and how it is called, the value layout among every
  chunked one, the final norm among several, the embedding's scale and position rows, the logits' scale).
* ``embedding.py`` — where the token embedding, the norms outside the blocks and a position table sit, as paths from
  the base model: beside the blocks, one level down with its norm (ModernBERT-decoder's), or in a module beside the
  one holding the blocks (GIT's ``embeddings`` beside ``encoder``).
* ``residual.py`` — how a block's branches join the residual where not as the modules return them (the residual added
  inside the attention and the MLP: BLOOM, MPT; a branch scale: MiniCPM-3), an absolute position table as a tensor
  (a learned or a sinusoidal one), the embedding's and the logits' scales (an affine map of the embedding by the base
  model's own vectors: Zaya's ``embed_affine``), and how the MLP is called (on
  ``[B, T, d]`` where a mixture of experts needs it), for the probe.
* ``latent.py`` — latent attention (DeepSeek-V2/V3's MLA): the value source that reads a norm of a slice of another
  projection, found in the probe forward (:func:`~mfpipe.models.adapters.latent.latent_sources`) and run as the
  attention runs it by the value map (:func:`~mfpipe.models.adapters.latent.latent_input`).
* ``gate.py`` — an output gate between the heads' reads and the output projection (Qwen3-Next's, Qwen3.5's, LFM-3's,
  Ling's: the reads times a sigmoid of a slice of a projection of the attention's input), found by the probe
  (:func:`~mfpipe.models.adapters.gate.gated_layout`); the reads stay probabilities x values, the gate is on the path
  from a read to the residual (the site writes a replaced read through the model's own gate; the rollout takes the
  gate of each centroid: :meth:`~mfpipe.models.adapters.gate.OutputGate.read_gate`).
* ``normed.py`` — a norm of all heads' reads together before the output projection (BitNet's ``attn_sub_norm``), found
  by the probe (:func:`~mfpipe.models.adapters.normed.normed_layout`); the site reads and replaces the reads at its
  input, and a read's write to the residual is the read times the factor the norm gives its position's reads
  (:func:`~mfpipe.models.adapters.normed.reads_factor`, by ``read_gate`` handed the reads).
* ``convolved.py`` — short convolutions over positions on a head's path (Inkling's): of the values (the site reads them
  at the convolution's output, the value map runs the projection and then it) and of each branch before it joins the
  residual (in the post-norm's role); found by what the modules are and read
  (:func:`~mfpipe.models.adapters.convolved.position_conv`); the rollout's rows each a sequence of one position.
* ``calls.py`` — the arguments a model's forward hands its blocks on one-token inputs, for running a block on residual
  rows (a join of the block's own, a hybrid's other mixer, a gate of a latent); per row's token where the blocks read
  an input of each token (Gemma-4's per-layer inputs: ``token_call``, ``row_tokens``); a state each block hands the
  next beside the residual, carried along the rows a caller runs layer by layer (Zaya's router state:
  ``with_carried``).
* ``returned.py`` — values a module of the attention returns among several outputs (Zaya's CCA projection: half of
  its KV heads the previous position's), offered to the value search as ``NAME#i`` and read there by the site, run
  by the value map (:func:`~mfpipe.models.adapters.returned.run_source`).
* ``joins.py`` — blocks whose branches join the residual in a form of their own (Doge's learned vectors, Beam's
  depth-scaled sums, MiniMax's): the block runs it on residual rows as one-position sequences with its attention's
  output replaced (:func:`~mfpipe.models.adapters.joins.run_block`), placed where its output is each position's own;
  a block handed an input of each token beside the residual (Gemma-4's per-layer inputs) runs each row with its
  token's (``calls.py``: a rollout's rows are its types').
* ``asked.py`` — attentions that return their probabilities only when asked (GPT-1's ``output_attentions``): a
  pre-hook asks each, so that it returns them as the modern eager attentions do, without the model keeping any.
* ``sinks.py`` — an attention sink applied after the softmax as a factor of each head's reads (Granite-SWA's
  ``sigmoid(logsumexp(scores) - sink)``): a tap records the factor where the attention computes it
  (:class:`~mfpipe.models.adapters.sinks.SinkTap`), and the site reads the probabilities behind the reads, the returned
  weights times it (:meth:`~mfpipe.models.adapters.sinks.AttentionSink.effective_probs`).
* ``jacobian.py`` — :func:`~mfpipe.models.adapters.jacobian.position_jacobians`: same-position Jacobians of the final
  residual with respect to each block's input and attention output (plain torch hooks and autograd, on the modules
  the adapter names), for the J-lens (:mod:`mfpipe.jlens`), with per-group sums of kept rows beside the total for its
  checks (``groups``).
* ``backward16.py`` — :func:`~mfpipe.models.adapters.backward16.fast_input_grads`: a 16-bit model's linear layers on
  a CPU keep their forward's value and take their input's gradient in float32, batched (the J-lens's backward passes,
  whose bfloat16 kernel for ``g @ W`` is some 35x slower than the forward's there).
* ``jvp.py`` — :func:`~mfpipe.models.adapters.jvp.position_jvps`: the same-position Jacobian-vector products of the
  final residual along given vectors (``torch.func.jvp``, vectors batched as tangent rows, the prefix a kept key/value
  cache), the J-lens decode without its Jacobian (:mod:`mfpipe.jlens.jvp`).
* ``mlp_units.py`` — :func:`~mfpipe.models.adapters.mlp_units.mlp_units`: an MLP as a sum over its hidden units (its
  post-activation and output projection, found among the modules the adapter names), with forward-mode directional
  derivatives, for the rollout's divergence diagnostics (App. llama).
* ``streaming.py`` — weights streamed block by block (:class:`~mfpipe.models.adapters.streaming.BlockStreamer`): a
  block's parameters read from the checkpoint's safetensors files before its forward and dropped after it, or while
  :func:`~mfpipe.models.adapters.streaming.held` (the block pieces above hold their block), for a model whose weights
  exceed the memory (:mod:`mfpipe.models.streamed` loads it).
* ``hybrid.py`` — a hybrid's blocks of another mixer than attention (Mamba, a gated delta-net, a recurrent block:
  :attr:`Structure.layer_kinds`, which :func:`describe` finds by the blocks' modules, named by their mixer's class
  name) as the model runs them, on rows as sequences of one position
  (:func:`~mfpipe.models.adapters.hybrid.mixer_block`), for the rollout.
* ``forms.py`` — block forms beyond one attention and one MLP: a block without an MLP (Nemotron-H's attention
  blocks), a mixer beside the attention whose branch joins the heads' (Falcon-H1's Mamba:
  :func:`~mfpipe.models.adapters.forms.side_branch`), a block the forward skips on text-only input, carried as the
  identity (Mllama's cross-attention layers: :func:`~mfpipe.models.adapters.forms.skipped_capture`), the attention
  and its norms in one module with its values clamped (DBRX's), and the refusals of forms mfpipe does not read.
* ``composite.py`` — :func:`~mfpipe.models.adapters.composite.language_model`: a multimodal composite (Gemma-3's
  conditional-generation model) as the text-only causal LM of its language model, on the composite's own modules
  (the loader and :func:`get_adapter` place a composite through it, on text-only input).
* ``linears.py`` — an attention's projections by path, a linear wrapped in a module of its own included (Moshi's
  ``o_proj.linear``), for the structure and the probe.
* ``unplaced.py`` — :func:`~mfpipe.models.adapters.unplaced.explain`: a refusal of :func:`describe` worded by what
  the model's forward shows stands between its heads and their reads (differential attention, a norm or a gate on
  the reads, a value scale, a sink's factor, heads routed per token) or its residual stream (several streams, a
  post-norm, a residual scaled by the block), for the census.
* ``architectures.py`` — :func:`get_adapter` (the types the test suite checks against brute-force references on
  every commit are ``mfpipe.models.tiny.VERIFIED_MODEL_TYPES``; others that :func:`describe` places are checked
  with ``mfpipe conformance`` first).
"""

from mfpipe.models.adapters.architectures import get_adapter
from mfpipe.models.adapters.base import Adapter, NormForm
from mfpipe.models.adapters.capture import CAPTURE_FIELDS, LayerCapture, RunResult, resolve_select
from mfpipe.models.adapters.structure import Structure, UnsupportedArchitectureError, describe

__all__ = [
    "CAPTURE_FIELDS",
    "Adapter",
    "LayerCapture",
    "NormForm",
    "RunResult",
    "Structure",
    "UnsupportedArchitectureError",
    "describe",
    "get_adapter",
    "resolve_select",
]
