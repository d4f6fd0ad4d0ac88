#!/usr/bin/env python
"""An offline Hugging Face cache holding only the ``config.json`` (and an empty ``tokenizer_config.json``) of every
preset's model, at its published shape,
for `mfpipe estimate` on a machine without the weights (issue 49, item 2): the estimate then calibrates random
weights of the real shape, cut in depth where memory forbids, and the workflow's dry run finds each model's
revision in the cache.

    python benchmarks/preset_shapes.py /tmp/preset-shapes
    HF_HUB_CACHE=/tmp/preset-shapes HF_HUB_OFFLINE=1 mfpipe estimate --configfile config/presets/gpt2-small.yaml

The shapes are the models' published ``config.json`` values that set the cost (layers, width, heads, key/value
heads, head width, MLP width, vocabulary, positions); everything else is the transformers config class's default.
A cache that already holds a model (its real files) is left as it is for that model."""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

SHAPES = {
    "openai-community/gpt2": ("gpt2", {}),  # GPT2Config's defaults are GPT-2 small
    "EleutherAI/pythia-160m": ("gpt_neox", dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                                intermediate_size=3072, vocab_size=50304, rotary_pct=0.25,
                                                max_position_embeddings=2048)),
    "EleutherAI/pythia-1.4b": ("gpt_neox", dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=16,
                                                intermediate_size=8192, vocab_size=50304, rotary_pct=0.25,
                                                max_position_embeddings=2048)),
    "EleutherAI/gpt-j-6b": ("gptj", dict(n_embd=4096, n_layer=28, n_head=16, rotary_dim=64, vocab_size=50400,
                                         n_positions=2048)),
    "Qwen/Qwen2-7B": ("qwen2", dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                                    num_key_value_heads=4, intermediate_size=18944, vocab_size=152064,
                                    max_position_embeddings=131072)),
    "Qwen/Qwen3-14B": ("qwen3", dict(hidden_size=5120, num_hidden_layers=40, num_attention_heads=40,
                                     num_key_value_heads=8, head_dim=128, intermediate_size=17408, vocab_size=151936,
                                     max_position_embeddings=40960)),
    "allenai/OLMo-2-1124-7B": ("olmo2", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                             num_key_value_heads=32, intermediate_size=11008, vocab_size=100352,
                                             max_position_embeddings=4096)),
    "google/gemma-2-2b": ("gemma2", dict(hidden_size=2304, num_hidden_layers=26, num_attention_heads=8,
                                         num_key_value_heads=4, head_dim=256, intermediate_size=9216,
                                         vocab_size=256000, max_position_embeddings=8192)),
    "google/gemma-3-1b-pt": ("gemma3_text", dict(hidden_size=1152, num_hidden_layers=26, num_attention_heads=4,
                                                 num_key_value_heads=1, head_dim=256, intermediate_size=6912,
                                                 vocab_size=262144, max_position_embeddings=32768)),
    "google/gemma-7b": ("gemma", dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=16,
                                      num_key_value_heads=16, head_dim=256, intermediate_size=24576,
                                      vocab_size=256000, max_position_embeddings=8192)),
    "meta-llama/Llama-3.2-3B": ("llama", dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24,
                                              num_key_value_heads=8, intermediate_size=8192, vocab_size=128256,
                                              max_position_embeddings=131072, tie_word_embeddings=True)),
    "microsoft/Phi-3-mini-4k-instruct": ("phi3", dict(hidden_size=3072, num_hidden_layers=32,
                                                      num_attention_heads=32, num_key_value_heads=32,
                                                      intermediate_size=8192, vocab_size=32064,
                                                      max_position_embeddings=4096)),
    "mistralai/Mistral-7B-v0.1": ("mistral", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                                  num_key_value_heads=8, intermediate_size=14336, vocab_size=32000,
                                                  max_position_embeddings=32768)),
}


def write_config(cache: Path, repo_id: str, model_type: str, shape: dict, revisions=("main",)) -> bool:
    """``config.json`` of ``repo_id`` in the hub cache's layout (blob, snapshot, a ref per revision); False where the
    cache already holds the repository."""
    from transformers import AutoConfig

    repo = cache / ("models--" + repo_id.replace("/", "--"))
    if repo.exists():
        return False
    files = {"config.json": AutoConfig.for_model(model_type, **shape).to_json_string().encode(),
             # the workflow's preflight finds a tokenizer revision by this file; it holds no tokenizer (the estimate
             # then counts 4 characters a token, and the presets' hub corpora fill their budget anyway)
             "tokenizer_config.json": b"{}"}
    commit = hashlib.sha1(repo_id.encode() + files["config.json"]).hexdigest()
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    for name, data in files.items():
        blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        (snap / name).symlink_to(Path("..", "..", "blobs", blob))
    (repo / "refs").mkdir()
    for rev in revisions:
        (repo / "refs" / rev).write_text(commit)
    return True


def preset_revisions(presets: Path) -> dict[str, set[str]]:
    """hub id -> the revisions the presets name (``main`` always)."""
    import yaml

    out: dict[str, set[str]] = {}
    for path in sorted(presets.glob("*.yaml")):
        for m in (yaml.safe_load(path.read_text()) or {}).get("models", []):
            if m.get("hub_id"):
                out.setdefault(m["hub_id"], {"main"}).update(str(r) for r in m.get("revisions") or [])
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cache", type=Path, help="the cache folder (HF_HUB_CACHE)")
    ap.add_argument("--presets", type=Path, default=Path(__file__).resolve().parents[1] / "config" / "presets")
    args = ap.parse_args(argv)
    revs = preset_revisions(args.presets)
    for repo_id, (model_type, shape) in SHAPES.items():
        wrote = write_config(args.cache, repo_id, model_type, shape, sorted(revs.get(repo_id, {"main"})))
        print(f"{repo_id}: {'written' if wrote else 'already in the cache, left as it is'}")
    missing = sorted(set(revs) - set(SHAPES))
    if missing:
        print("presets' models without a shape here:", ", ".join(missing))
    print(json.dumps({"HF_HUB_CACHE": str(args.cache), "HF_HUB_OFFLINE": "1"}))


if __name__ == "__main__":
    main()
