"""The census of decoder families (``mfpipe census``): for every causal-LM family the installed ``transformers``
ships (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``; encoder-decoder families and remote code left out), a tiny random copy
of its default config (:func:`mfpipe.models.tiny.shrink_config`; a multimodal composite's sub-configs each shrunk, the
composite then read as its language model: :mod:`mfpipe.models.adapters.composite`; built as that language model
alone where a tower needs a library not installed, Gemma-3n's vision tower ``timm``) is placed by structure
(:func:`mfpipe.models.adapters.describe`) and run through ``mfpipe conformance``'s checks
(:func:`mfpipe.conformance.check_model`). Each family gets one row: placed or not, the checks passed, and for a
refusal the one-line reason (the placement's, the failing checks', or why no tiny copy could be built). A family that
is placed but fails a check is refused at DAG time (the workflow's planning runs the same checks on a model of a type
the test suite does not verify), so "passes" is what a run accepts.

Each refusal has a kind. `modelling`: the family is no decoder with attention heads, by rules read off the family
itself -- its config (or a composite's text config) has no attention heads at all (a state-space or
recurrent model: Mamba, RWKV, xLSTM; a config whose heads sit in sub-models none of which is its language model, BLT's,
is an ``mfpipe`` refusal) or its ``layer_types`` name no attention layer and no key of its config turns
one on (a hybrid whose default config is Mamba throughout, Bamba's and Granite-4's, is placed with its second layer
attention, as its checkpoints have attention layers, and its row says so), or it is an encoder: its tiny copy, built from the default config as transformers builds its causal LM,
reads later tokens (its logits at a token change with a later token, :func:`attends_ahead`: a BERT-style encoder whose
LM head is causal only with ``is_decoder=True``, XLNet's permutation LM), or its heads have no probability row each
(differential attention: DiffLlama's heads read the difference of two softmax maps, said by
:func:`mfpipe.models.adapters.unplaced.explain`, which words every placement refusal as precisely as the forward
shows). `mfpipe`:
anything else (no tiny copy, a placement or a check that fails, a probe that crashes) -- the tool's to mend; the goal
is none.
"""

from __future__ import annotations

import signal
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, replace

__all__ = ["CensusRow", "causal_lm_families", "census_row", "census", "census_markdown", "write_section",
           "attends_ahead", "main", "BEGIN", "END"]

PER_FAMILY_SECONDS = 120  # a tiny copy that takes longer to build and check is reported as such


@dataclass
class CensusRow:
    family: str
    placed: bool
    passed: int  # conformance checks passed (of `checks`); 0 when not placed
    checks: int
    reason: str  # why it is refused ("" when every check passes)
    # the kind of refusal: "modelling" (no attention heads at all, or an encoder: the module docstring) or "mfpipe"
    # (anything else: the tool's to mend); "" when accepted
    kind: str = ""

    def __post_init__(self):
        if self.accepted:
            self.kind = ""
        elif not self.kind:
            self.kind = "mfpipe"

    @property
    def accepted(self) -> bool:
        return self.placed and self.checks > 0 and self.passed == self.checks


def causal_lm_families() -> list[str]:
    """Every ``model_type`` with a causal-LM class in the installed transformers whose default config is not an
    encoder-decoder, sorted."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = []
    for family in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            config = CONFIG_MAPPING[family]()
        except Exception:  # a config that cannot be built with defaults is still a family: its row says why
            out.append(family)
            continue
        if not getattr(config, "is_encoder_decoder", False):
            out.append(family)
    return out


def _one_line(e: BaseException) -> str:
    """The error's type and the first line of its message that says something (an ImportError of transformers'
    ``requires_backends`` opens with an empty line: Gemma-3n's vision tower needs timm)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:200]


class _Timeout(BaseException):  # not an Exception: the stages' own `except Exception` must not take it
    pass


def _alarm(signum, frame):
    raise _Timeout(f"over {PER_FAMILY_SECONDS} s")


def _heads(config):
    """The attention heads of ``config`` (a heterogeneous config's first layer's: its global value is ambiguous)."""
    try:
        return getattr(config, "num_attention_heads", None)
    except Exception:  # AmbiguousGlobalPerLayerAttributeError (dots3_note_text's per-layer heads)
        return getattr(config.per_layer_config[0], "num_attention_heads", None)


def _headed_parts(config) -> list[str]:
    """The keys of ``config``'s sub-configs that have attention heads (BLT's encoder, decoder, global transformer and
    patcher), sorted."""
    from transformers import PretrainedConfig

    return sorted(k for k, v in vars(config).items() if isinstance(v, PretrainedConfig) and _heads(v))


def _attention_layers(config) -> bool:
    """Whether ``config``'s layers include attention: False only where its ``layer_types`` name none but
    state-space, recurrent, convolution or linear-attention mixers (Bamba's and Granite-4's default configs: Mamba
    throughout)."""
    kinds = getattr(config, "layer_types", None)
    if not kinds or not isinstance(kinds, (list, tuple)):
        return True
    other = ("linear", "mamba", "conv", "recurrent", "ssm", "delta", "rwkv")
    return not all(isinstance(k, str) and any(t in k for t in other) for k in kinds)


def _with_attention_layer(config) -> tuple[object, str]:
    """``(config, note)``: a hybrid's default config whose ``layer_types`` name no attention layer (Bamba's, Granite-4's:
    Mamba throughout) with its second layer made attention by the key its checkpoints set (Bamba-9B's
    ``attn_layer_indices``, Granite-4.0-H's ``layer_types``), and the census row's note saying so; ``config`` itself
    and "" where it has neither key."""
    import copy

    from mfpipe.models.adapters.composite import text_config

    text = text_config(config)
    new = copy.deepcopy(config)
    target = text_config(new)
    if "attn_layer_indices" in vars(text):
        target.attn_layer_indices, key = [1], "attn_layer_indices"
    elif "layer_types" in vars(text) and len(text.layer_types) > 1:
        target.layer_types = [t if i != 1 else "full_attention" for i, t in enumerate(text.layer_types)]
        key = "layer_types"
    else:
        return config, ""
    return new, (f"placed with layer 1 attention ({key}), as its checkpoints have attention layers; its default "
                 "config has none")


def _size(tiny) -> int:
    """The parameter count of ``tiny``'s causal LM (on the meta device); a family whose causal LM exists only as its
    decoder form (Reformer's ``ReformerModelWithLMHead`` asserts ``is_decoder``, which its default config, shared with
    its masked LM, leaves off) gets ``is_decoder=True`` on ``tiny``, as a checkpoint of it has."""
    from mfpipe.models.tiny import meta_parameter_count

    try:
        return meta_parameter_count(tiny)
    except AssertionError as e:
        if "is_decoder=True" not in str(e):
            raise
        tiny.is_decoder = True
        return meta_parameter_count(tiny)


def attends_ahead(model) -> bool:
    """Whether ``model`` reads later tokens (an encoder): its logits at the first three of four tokens change when the
    fourth does, by more than a thousandth of their size (a decoder's batched expert kernels move them by rounding
    only, ~1e-6: DBRX, AFMoE). Read off the outputs, not the attention probabilities (BigBird's block-sparse attention
    returns none); False where the forward fails or two forwards of one input differ by as much (Reformer's random
    hashing: nothing to tell)."""
    import torch

    if callable(getattr(model, "set_default_language", None)) and getattr(model.config, "languages", None):
        model.set_default_language(model.config.languages[0])  # X-MOD's forward needs a language
    try:
        with torch.no_grad():
            a, b, c = (model(input_ids=torch.tensor([ids])).logits[0, :3] for ids in ([3, 4, 5, 6], [3, 4, 5, 6],
                                                                                     [3, 4, 5, 7]))
    except Exception:  # a forward that fails says nothing
        return False
    tol = 1e-3 * float(a.abs().max())

    def differ(x, y) -> bool:
        return bool((x - y).abs().max() > tol)

    return not differ(a, b) and differ(a, c)


def _refused(family: str, model, reason: str, error=None) -> CensusRow:
    """The row of a family refused at placement: an encoder's refusal is of the modelling kind (the encoder is the
    reason); the placement's refusal ``error`` of any other is worded by what the model's forward shows
    (:func:`mfpipe.models.adapters.unplaced.explain`), of the kind it says (differential attention: modelling)."""
    from mfpipe.models.adapters.unplaced import explain

    if attends_ahead(model):
        return CensusRow(family, False, 0, 0, f"an encoder: its outputs read later tokens ({reason})", "modelling")
    if error is not None:
        error = explain(error, model)
        return CensusRow(family, False, 0, 0, error.reason, error.kind)
    return CensusRow(family, False, 0, 0, reason)


def _buildable(tiny) -> tuple[object, int, str]:
    """(the config to build of the shrunk config ``tiny``, its parameter count, "" or what is built instead): a
    composite whose tower needs a library not installed here (Gemma-3n's vision tower: ``timm``) is built as its
    language model alone, the decoder mfpipe places of any composite (:mod:`mfpipe.models.adapters.composite`), so the
    row says what the decoder computes, not what the environment lacks."""
    from mfpipe.models.adapters.composite import is_composite, text_config

    try:
        return tiny, _size(tiny), ""
    except ImportError as e:
        if not is_composite(tiny):
            raise
        why = " ".join(str(e).split()).split(". ")[0].rstrip(".")  # "TimmWrapperModel requires the timm library..."
        text = text_config(tiny)
        return text, _size(text), f"its language model built alone, its composite not: {why}"


def census_row(family: str, seed: int = 0) -> CensusRow:
    """The census row of one family (see the module docstring)."""
    import torch

    from mfpipe.conformance import check_model
    from mfpipe.models.adapters import UnsupportedArchitectureError, describe
    from mfpipe.models.adapters.composite import is_composite, language_model, shrink_composite, text_config
    from mfpipe.models.defaults import default_config
    from mfpipe.models.tiny import MAX_TINY_PARAMETERS, random_model, shrink_config

    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(PER_FAMILY_SECONDS)
    try:
        torch.manual_seed(seed)
        try:
            config = default_config(family)  # a default its own validator refuses: mended where it names the value
            if not _heads(text_config(config)) and (parts := _headed_parts(config)):  # BLT's several transformers
                return CensusRow(family, False, 0, 0, f"its attention heads sit in {len(parts)} sub-models of its "
                                                      f"config ({', '.join(parts)}), no one of them its language "
                                                      "model: mfpipe reads one decoder's residual stream")
            if not _heads(text_config(config)):  # a composite's: its language model's
                return CensusRow(family, False, 0, 0, "no attention heads in its config (num_attention_heads; a "
                                                      "composite's in its text_config): a state-space or recurrent "
                                                      "model", "modelling")
            note = ""
            if not _attention_layers(text_config(config)):  # as its checkpoints are: Bamba-9B's, Granite-4.0-H's
                kinds = sorted(set(text_config(config).layer_types))
                config, note = _with_attention_layer(config)
                if not _attention_layers(text_config(config)):
                    return CensusRow(family, False, 0, 0, f"no attention layer in its default config (layer_types: "
                                                          f"{kinds}): a state-space or recurrent model as configured",
                                                          "modelling")
            # a composite is placed through its language model (mfpipe.models.adapters.composite), as the loader does
            tiny = shrink_composite(config, shrink_config) if is_composite(config) else shrink_config(config)
            tiny, size, alone = _buildable(tiny)
            if size > MAX_TINY_PARAMETERS:
                return CensusRow(family, False, 0, 0, f"its shrunk config still has {size / 1e6:.0f} M parameters: "
                                                      "mfpipe.models.tiny.shrink_config does not know its size fields")
            model = random_model(tiny, seed=seed)
        except Exception as e:
            return CensusRow(family, False, 0, 0, f"no tiny copy of its default config: {_one_line(e)}")
        try:
            model = language_model(model)
            structure = describe(model)
        except UnsupportedArchitectureError as e:
            row = _refused(family, model, e.reason, e)
            return replace(row, reason=f"{row.reason} ({alone})") if alone else row
        except Exception as e:
            return _refused(family, model, f"the placement's probe forward fails: {_one_line(e)}")
        try:
            rows = check_model(model, structure, seed=seed)
        except Exception as e:
            return CensusRow(family, True, 0, 1, f"a conformance check raises: {_one_line(e)}; "
                                                 f"{traceback.extract_tb(e.__traceback__)[-1].name}")
        bad = [r.name for r in rows if not r.ok]
        return CensusRow(family, True, len(rows) - len(bad), len(rows), "; ".join(
            [*(["fails: " + "; ".join(bad)] if bad else []), *([note] if note else [])]))
    except _Timeout as e:
        return CensusRow(family, False, 0, 0, f"building and checking a tiny copy took {e}")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def census(families: Iterable[str] | None = None, progress=None) -> list[CensusRow]:
    """:func:`census_row` of every family (default: :func:`causal_lm_families`); ``progress(row)`` after each."""
    rows = []
    for family in (causal_lm_families() if families is None else families):
        rows.append(census_row(family))
        if progress is not None:
            progress(rows[-1])
    return rows


def census_markdown(rows: list[CensusRow], transformers_version: str) -> str:
    """The census as Markdown: the counts, then one row per family."""
    accepted = [r for r in rows if r.accepted]
    placed_failing = [r for r in rows if r.placed and not r.accepted]
    lines = [f"transformers {transformers_version}: {len(rows)} decoder-only causal-LM families; "
             f"**{len(accepted)} placed and passing**, {len(placed_failing)} placed but failing a check (refused at "
             f"DAG time), {len(rows) - len(accepted) - len(placed_failing)} not placed. Of the refusals, "
             f"{sum(r.kind == 'modelling' for r in rows)} of the modelling kind (no attention heads, an encoder) and "
             f"**{sum(r.kind == 'mfpipe' for r in rows)} of the mfpipe kind** (the tool's to mend).", "",
             "| family | placed | checks passed | refusal kind | refused because |", "|---|---|---|---|---|"]
    for r in rows:
        checks = f"{r.passed} / {r.checks}" if r.placed else "-"
        reason = r.reason.replace("|", "\\|")
        lines.append(f"| `{r.family}` | {'yes' if r.placed else 'no'} | {checks} | {r.kind} | {reason} |")
    return "\n".join(lines) + "\n"


BEGIN, END = "<!-- census: begin (mfpipe census --write) -->", "<!-- census: end -->"


def write_section(path, text: str) -> None:
    """Replace the census section of the Markdown file ``path`` (between :data:`BEGIN` and :data:`END`) by ``text``."""
    from pathlib import Path

    doc = Path(path).read_text()
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"mfpipe census: {path} has no census section ({BEGIN} ... {END}) to replace")
    head, rest = doc.split(BEGIN, 1)
    Path(path).write_text(head + BEGIN + "\n" + text + rest[rest.index(END):])


def main(argv=None) -> int:
    import argparse
    import logging
    import sys
    import warnings

    import transformers

    ap = argparse.ArgumentParser(prog="mfpipe census", description=__doc__.split("\n\n")[0])
    ap.add_argument("families", nargs="*", help="model types to check (default: every causal-LM family)")
    ap.add_argument("--write", metavar="MD", help="replace the census section of this Markdown file (e.g. "
                                                  "docs/architectures.md) instead of printing the table")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.families) - set(causal_lm_families()))
    if unknown:  # a typo is no family, and no refusal of the tool's to count
        ap.error(f"not a causal-LM family of transformers {transformers.__version__}: {', '.join(unknown)} "
                 "(the model_type, e.g. gpt2, llama, qwen3)")
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)  # transformers' notes on odd default configs, one per family
    rows = census(args.families or None, progress=lambda r: print(
        f"{r.family:<28} {'placed' if r.placed else 'not placed':<11} {r.passed}/{r.checks} {r.kind:<9} "
        f"{r.reason}"[:170], file=sys.stderr))
    text = census_markdown(rows, transformers.__version__)
    if args.write:
        write_section(args.write, text)
    else:
        print(text)
    return 0
