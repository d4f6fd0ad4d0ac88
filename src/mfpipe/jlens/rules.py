"""The J-lens's planning: the targets of workflow/rules/jlens.smk, and which way each consumer decodes through it
(config ``jlens.decode``), on the run's plan (:class:`mfpipe.workflow.plan.Plan`). The stores themselves are asked for
by what decodes through them by the full ``J`` (``matrix``); the default target asks for the checks table, which
the same job writes."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["targets", "DECODES", "JVP_ROW_COST", "model_shape", "decode_path", "shape_path", "decode_params",
           "decode_inputs"]

DECODES = ("auto", "jvp", "matrix")
# what one decoded vector's Jacobian-vector products cost in backward passes of the full J (one row each), per
# position: 1.1 at Gemma-2-2B's shape in bfloat16 (from layer 0, position 256), 3.1 at GPT-2 small's (64 vectors
# over its 12 layers, T = 512, benchmarks/jlens.py --decode 64: attention over the prefix weighs more at d = 768)
JVP_ROW_COST = 3.0


def targets(plan) -> list[str]:
    """Per rollout revision of every model (where the lenses draw the J-lens): the J-lens checks table, CSV and
    Markdown."""
    R, t = plan.results, []
    for m in plan.models:
        for rev in plan.rollout_revisions[m]:
            t += [f"{R}/tables/jlens_checks_{m}_{rev}.{e}" for e in ("csv", "md")]
    return t


def _config_json(plan, model: str) -> dict | None:
    """A hub or local model's ``config.json`` where it is on this machine (the local folder, the Hugging Face cache),
    else None. Reads a file; loads nothing."""
    spec = plan.models[model]
    rev = (plan.revisions.get(model) or [None])[-1]
    path = None
    if spec["source"] == "local" and spec.get("path"):
        base = Path(spec["path"])
        path = base / rev / "config.json" if rev and (base / rev).is_dir() else base / "config.json"
    elif spec["source"] == "hub" and spec.get("hub_id"):
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(spec["hub_id"], "config.json", revision=rev or "main")
        path = Path(found) if isinstance(found, str) else None
    try:
        return json.loads(path.read_text()) if path is not None else None
    except (OSError, ValueError):
        return None


def model_shape(plan, model: str) -> tuple[int, int, int] | None:
    """``(layers, heads, d_model)`` of ``model`` from its config (the mini suite's) or its ``config.json`` where it
    is on this machine; None where it is not (a hub model not yet in the cache)."""
    if plan.is_mini(model):
        m = plan.mini.get(model)
        return None if m is None else (int(m["n_layer"]), int(m["n_head"]), int(m["d_model"]))
    cfg = _config_json(plan, model)
    if cfg is None:
        return None
    cfg = {**cfg, **(cfg.get("text_config") or {})}

    def first(*keys):
        return next((int(cfg[k]) for k in keys if cfg.get(k) is not None), None)

    shape = (first("num_hidden_layers", "n_layer", "num_layers"), first("num_attention_heads", "n_head"),
             first("hidden_size", "n_embd", "d_model"))
    return None if None in shape else shape


def decode_path(plan, model: str, n_vectors) -> str:
    """``"jvp"`` or ``"matrix"``: how a consumer job of ``model`` decodes through the J-lens. Config ``jlens.decode``
    names it, or, ``auto``, the cheaper by count: the vectors the job decodes (``n_vectors``, an int or a function of
    ``(layers, heads)``) times :data:`JVP_ROW_COST` against the full J's ``d`` backward passes, both per sampled
    position; where the model's shape is not known when the run is planned, the full J."""
    want = plan.config["jlens"].get("decode", "auto")
    return want if want != "auto" else shape_path(plan.config, model_shape(plan, model), n_vectors)


def shape_path(config: dict, shape, n_vectors) -> str:
    """:func:`decode_path` for a model of ``shape`` ``(layers, heads, d_model)`` (None: not known), as `mfpipe
    estimate` prices it from its calibration."""
    want = config["jlens"].get("decode", "auto")
    if want != "auto":
        return want
    if shape is None:
        return "matrix"
    L, H, d = (int(x) for x in shape)
    n = n_vectors(L, H) if callable(n_vectors) else int(n_vectors)
    return "jvp" if n * JVP_ROW_COST < d else "matrix"


def decode_params(plan, model: str, n_vectors) -> dict:
    """The ``jlens`` params of a consumer job: its path (:func:`decode_path`) and, for ``jvp``, what sets its sample
    and its products (for ``matrix`` the store's own provenance does)."""
    path = decode_path(plan, model, n_vectors)
    if path == "matrix":
        return {"decode": "matrix"}
    j = plan.config["jlens"]
    return {"decode": "jvp", "n_positions": int(j["n_positions"]), "seed": int(j["seed"]),
            "batch_size": int(j["batch_size"] or plan.config["runtime"]["batch_size"]), "chunk": int(j["jvp_chunk"])}


def decode_inputs(plan, wildcards, n_vectors) -> dict:
    """``{"jlens": the revision's J-lens store}`` for a consumer that decodes through the full J, else nothing (the
    products read the statistics half's shards and the model, which every consumer job declares already)."""
    if decode_path(plan, wildcards.model, n_vectors) == "matrix":
        return {"jlens": plan.store("jlens", model=wildcards.model, revision=wildcards.revision)}
    return {}
