"""Which model and tokenizer a notebook result belongs to. :func:`mfpipe.collect_stats` records a fingerprint of the
model's weights and of the windows' tokenizer in the statistics' provenance (``weights_fingerprint``,
``tokenizer_fingerprint``); :func:`check_identity` refuses statistics of other weights of the same shape (another
checkpoint, revision or fine-tune: the shape check of :func:`mfpipe.stats.halves.check_model` cannot tell them apart)
or of another tokenizer, with one :class:`~mfpipe.notebook.inputs.NotebookError` line.

Statistics of the workflow's stores record no weights fingerprint; for them the commit a hub revision resolved to
(``revision_commit``) is compared with the one ``transformers`` records on the model it loads (``_commit_hash``),
where both are known."""

from __future__ import annotations

import hashlib
import json

from mfpipe.notebook.inputs import NotebookError

__all__ = ["weights_fingerprint", "tokenizer_fingerprint", "check_identity", "identity_attrs", "SAMPLES"]

# elements read per parameter tensor: training or fine-tuning moves (nearly) every weight, so a few thousand spread
# over each tensor tell two checkpoints apart, and the fingerprint of a 7B model costs milliseconds, not a pass over
# 14 GB
SAMPLES = 4096


def weights_fingerprint(model) -> str:
    """A fingerprint of ``model``'s weights: every parameter's name and shape and :data:`SAMPLES` of its elements
    evenly spread, rounded to bfloat16 (a float32 checkpoint and its bfloat16 copy share it; float16 rounds twice and
    may not), hashed."""
    import torch

    h = hashlib.sha256()
    with torch.no_grad():
        for name, p in model.named_parameters():
            x = p.detach().reshape(-1)
            if x.is_meta:
                raise NotebookError(f"the model's weights are not loaded ({name} is a meta tensor): load them, e.g. "
                                    "AutoModelForCausalLM.from_pretrained(...) or nnsight's TransformersModel(..., "
                                    "dispatch=True)")
            n, m = x.numel(), min(x.numel(), SAMPLES)
            idx = torch.arange(m, device=x.device, dtype=torch.int64) * max(n - 1, 0) // max(m - 1, 1)
            h.update(f"{name}{tuple(p.shape)}".encode())
            h.update(x[idx].to(torch.bfloat16).view(torch.int16).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def tokenizer_fingerprint(tokenizer) -> str | None:
    """A fingerprint of ``tokenizer`` (a fast tokenizer's whole definition, its runtime truncation and padding aside;
    else its vocabulary and special tokens), or None without one."""
    if tokenizer is None:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        spec.pop("truncation", None)  # set and reset by calls (truncation=, padding=), not part of the tokenizer
        spec.pop("padding", None)
    else:
        spec = {"vocab": sorted(tokenizer.get_vocab().items()),
                "special": {k: str(v) for k, v in sorted(getattr(tokenizer, "special_tokens_map", {}).items())}}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def identity_attrs(model, tokenizer) -> dict:
    """The provenance of a result computed on ``model`` with ``tokenizer``: both fingerprints (the tokenizer's where
    there is one)."""
    fp = tokenizer_fingerprint(tokenizer)
    return {"weights_fingerprint": weights_fingerprint(model), **({"tokenizer_fingerprint": fp} if fp else {})}


def check_identity(model, tokenizer, attrs, where: str, weights: str | None = None) -> None:
    """Refuse a model or tokenizer that is not the one ``attrs`` (the statistics' or a result's provenance, held at
    ``where``) records: another weights fingerprint, another revision commit, another tokenizer fingerprint.
    ``weights``: the model's fingerprint where the caller has it already."""
    have = attrs.get("weights_fingerprint")
    if have is not None:
        now = weights or weights_fingerprint(model)
        if have != now:
            dtype = str(next(model.parameters()).dtype).replace("torch.", "")
            cast = (f"; they were computed in {attrs['dtype']}, the model is {dtype}" if attrs.get("dtype") not in
                    (None, dtype) else "")
            raise NotebookError(f"{where} was computed on other weights than this model's (weights fingerprint "
                                f"{have}, the model's {now}{cast}): another checkpoint, revision or fine-tune of the "
                                "same shape; pass the statistics of this model (mfpipe.collect_stats(model, ...)) or the model "
                                "they were computed on")
    commit, mine = attrs.get("revision_commit"), getattr(getattr(model, "config", None), "_commit_hash", None)
    if commit and mine and commit != mine:
        raise NotebookError(f"{where} was computed on revision {attrs.get('revision')!r} (commit {commit}), the model "
                            f"was loaded from commit {mine}: load that revision (from_pretrained(..., revision="
                            f"{commit!r})) or pass the statistics of this one")
    tok_have = attrs.get("tokenizer_fingerprint")
    tok_now = tokenizer_fingerprint(tokenizer) if tok_have is not None else None
    if tok_have is not None and tok_now is not None and tok_have != tok_now:
        raise NotebookError(f"{where} was computed with another tokenizer (fingerprint {tok_have}, the one given "
                            f"{tok_now}): its token ids name other tokens; pass tokenizer= the statistics' tokenizer")
