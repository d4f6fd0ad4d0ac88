"""An offline Hugging Face cache for tests, in the hub's own layout, holding tiny random models under the
presets' real repository ids.

``huggingface_hub`` keeps a downloaded repository as ``<cache>/models--<org>--<name>/`` with

- ``blobs/<hash>``: each file's bytes once (git's blob SHA-1 for small files, SHA-256 for LFS files);
- ``snapshots/<commit>/<file>``: a relative symlink to its blob, one folder per commit;
- ``refs/<revision>``: the commit a branch or tag name resolved to when it was downloaded.

With ``HF_HUB_OFFLINE=1``, ``from_pretrained(repo_id, revision="step1000")`` reads ``refs/step1000`` and loads
``snapshots/<that commit>/`` -- what this module writes. The datasets library's offline form of a hub dataset is its
own cache (``<HF_DATASETS_CACHE>/<org>___<name>/<config>/<version>/<hash>/`` with Arrow files and
``dataset_info.json``), which :func:`write_cached_dataset` writes with the library's own writer.

Each model gets its real ``model_type`` (tiny sizes, random weights: tests/tiny_models.py) and a small byte-level
BPE tokenizer saved under the real model's tokenizer class and special tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

LFS_SUFFIXES = (".safetensors", ".bin", ".arrow", ".parquet")


@dataclass(frozen=True)
class HubModel:
    """How a preset's model looks on the hub: what the tests recreate in tiny."""

    repo_id: str
    model_type: str
    tokenizer_class: str
    bos: str | None  # the tokenizer's BOS token (None: the model has none, e.g. Qwen3)
    eos: str
    extra_special: tuple[str, ...] = ()
    config_overrides: dict = field(default_factory=dict)


# preset file stem -> the model it names (model_type and tokenizer class as in each repository's own config files)
PRESET_MODELS: dict[str, HubModel] = {
    "gpt2-small": HubModel("openai-community/gpt2", "gpt2", "GPT2Tokenizer", "<|endoftext|>", "<|endoftext|>"),
    "pythia-160m": HubModel("EleutherAI/pythia-160m", "gpt_neox", "GPTNeoXTokenizer", "<|endoftext|>", "<|endoftext|>",
                            ("<|padding|>",)),
    "pythia-1.4b": HubModel("EleutherAI/pythia-1.4b", "gpt_neox", "GPTNeoXTokenizer", "<|endoftext|>", "<|endoftext|>",
                            ("<|padding|>",)),
    "gemma-2-2b": HubModel("google/gemma-2-2b", "gemma2", "GemmaTokenizer", "<bos>", "<eos>", ("<pad>", "<unk>")),
    "llama-3.2-3b": HubModel("meta-llama/Llama-3.2-3B", "llama", "PreTrainedTokenizerFast", "<|begin_of_text|>",
                             "<|end_of_text|>"),
    "qwen3-14b": HubModel("Qwen/Qwen3-14B", "qwen3", "Qwen2Tokenizer", None, "<|endoftext|>", ("<|im_start|>",)),
    "olmo-2-7b": HubModel("allenai/OLMo-2-1124-7B", "olmo2", "GPT2Tokenizer", "<|endoftext|>", "<|endoftext|>",
                          ("<|pad|>",)),
}


# the presets of the families placed by structure (issue 30): planned (`snakemake -n`) against tiny copies, not run
NEW_PRESET_MODELS: dict[str, HubModel] = {
    "gpt-j-6b": HubModel("EleutherAI/gpt-j-6b", "gptj", "GPT2Tokenizer", "<|endoftext|>", "<|endoftext|>"),
    "mistral-7b": HubModel("mistralai/Mistral-7B-v0.1", "mistral", "LlamaTokenizer", "<s>", "</s>", ("<unk>",)),
    "qwen2-7b": HubModel("Qwen/Qwen2-7B", "qwen2", "Qwen2Tokenizer", None, "<|endoftext|>"),
    "phi-3-mini": HubModel("microsoft/Phi-3-mini-4k-instruct", "phi3", "LlamaTokenizer", "<s>", "<|endoftext|>",
                           ("<unk>",)),
    "gemma-7b": HubModel("google/gemma-7b", "gemma", "GemmaTokenizer", "<bos>", "<eos>", ("<pad>", "<unk>")),
    "gemma-3-1b": HubModel("google/gemma-3-1b-pt", "gemma3_text", "GemmaTokenizer", "<bos>", "<eos>",
                           ("<pad>", "<unk>")),
}


def _git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _blob_name(name: str, data: bytes) -> str:
    return hashlib.sha256(data).hexdigest() if name.endswith(LFS_SUFFIXES) else _git_blob_sha1(data)


def repo_folder(cache: Path, repo_id: str, kind: str = "model") -> Path:
    return Path(cache) / f"{kind}s--{repo_id.replace('/', '--')}"


def add_snapshot(cache: Path, repo_id: str, files: dict[str, bytes], revision: str, kind: str = "model") -> str:
    """Store ``files`` as one commit of ``repo_id`` and point ``refs/<revision>`` at it; returns the commit hash
    (a SHA-1 of the repository id and the files' names and hashes, as stable as the files)."""
    repo = repo_folder(cache, repo_id, kind)
    listing = json.dumps([repo_id, sorted((n, _blob_name(n, d)) for n, d in files.items())])
    commit = hashlib.sha1(listing.encode()).hexdigest()
    for name, data in files.items():
        blob = repo / "blobs" / _blob_name(name, data)
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            blob.write_bytes(data)
        link = repo / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, link.parent))
    set_ref(cache, repo_id, revision, commit, kind)
    return commit


def set_ref(cache: Path, repo_id: str, revision: str, commit: str, kind: str = "model") -> None:
    """Point branch or tag ``revision`` at ``commit`` (a branch that moved, once re-downloaded)."""
    ref = repo_folder(cache, repo_id, kind) / "refs" / revision
    ref.parent.mkdir(parents=True, exist_ok=True)
    ref.write_text(commit)


def folder_files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def small_tokenizer(spec: HubModel, texts: list[str], vocab_size: int = 320):
    """A byte-level BPE trained on ``texts`` with the real model's special tokens, as a ``transformers`` fast
    tokenizer (saved later under ``spec.tokenizer_class``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = list(dict.fromkeys([t for t in (spec.bos, spec.eos) if t] + list(spec.extra_special)))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    kwargs = {"eos_token": spec.eos}
    if spec.bos:
        kwargs["bos_token"] = spec.bos
    for t in spec.extra_special:
        if t in ("<pad>", "<|padding|>", "<|pad|>"):
            kwargs["pad_token"] = t
        elif t == "<unk>":
            kwargs["unk_token"] = t
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=4096, clean_up_tokenization_spaces=False,
                                   **kwargs)


def tokenizer_files(spec: HubModel, tokenizer) -> tuple[dict[str, bytes], object]:
    """The tokenizer's files under the real repository's tokenizer class, and the tokenizer as that class loads them
    (its length can differ from ``tokenizer``'s: a class may add its own special tokens)."""
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        cfg_path = Path(tmp) / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["tokenizer_class"] = spec.tokenizer_class  # as the real repository names it
        cfg_path.write_text(json.dumps(cfg, indent=1))
        return folder_files(Path(tmp)), AutoTokenizer.from_pretrained(tmp)


def model_files(spec: HubModel, tokenizer, seed: int) -> dict[str, bytes]:
    """config.json and model.safetensors of a tiny random model of ``spec.model_type`` sized to ``tokenizer``."""
    from tiny_models import make_tiny_model

    ids = {"bos_token_id": tokenizer.convert_tokens_to_ids(spec.bos) if spec.bos else None,
           "eos_token_id": tokenizer.convert_tokens_to_ids(spec.eos),
           "pad_token_id": tokenizer.pad_token_id}
    vocab = -(-len(tokenizer) // 8) * 8  # padded past the tokenizer's ids, as real embedding matrices often are
    model = make_tiny_model(spec.model_type, seed=seed, vocab_size=vocab, **ids, **spec.config_overrides)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        return folder_files(Path(tmp))


def write_hub_model(cache: Path, spec: HubModel, texts: list[str], revisions: list[str],
                    tokenizer_revisions: dict[str, int] | None = None) -> dict[str, str]:
    """Every revision of ``spec.repo_id`` in ``cache`` (revision i: weights of seed i, the same tokenizer), plus
    tokenizer-only revisions (name -> vocabulary size: another tokenizer, as a re-trained one would be). Returns
    {revision: commit}."""
    tok_files, tokenizer = tokenizer_files(spec, small_tokenizer(spec, texts))
    commits = {}
    for i, rev in enumerate(revisions):
        commits[rev] = add_snapshot(cache, spec.repo_id, {**model_files(spec, tokenizer, seed=i), **tok_files}, rev)
    for rev, vocab in (tokenizer_revisions or {}).items():
        other_files, other = tokenizer_files(spec, small_tokenizer(spec, texts, vocab_size=vocab))
        commits[rev] = add_snapshot(cache, spec.repo_id, {**model_files(spec, other, seed=99), **other_files}, rev)
    return commits


def write_cached_dataset(cache: Path, repo_id: str, config_name: str | None, split: str, texts: list[str]) -> Path:
    """``repo_id`` as the datasets library caches a prepared hub dataset (``load_dataset(repo_id, config_name)``
    then finds it with ``HF_DATASETS_OFFLINE=1``): one Arrow file of a ``text`` column and its dataset_info.json."""
    import datasets
    from datasets.arrow_writer import ArrowWriter
    from datasets.naming import camelcase_to_snakecase

    org, name = repo_id.split("/")
    config = config_name or "default"
    folder = Path(cache) / f"{org}___{camelcase_to_snakecase(name)}" / config / "0.0.0" / ("0" * 16)
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    features = datasets.Features({"text": datasets.Value("string")})
    with ArrowWriter(features=features, path=str(folder / f"{name}-{split}.arrow")) as writer:
        for t in texts:
            writer.write({"text": t})
        n, nbytes = writer.finalize()
    splits = datasets.SplitDict.from_split_dict(
        [datasets.SplitInfo(name=split, num_bytes=nbytes, num_examples=n, dataset_name=name)], dataset_name=name)
    datasets.DatasetInfo(features=features, dataset_name=name, config_name=config, version="0.0.0",
                         splits=splits).write_to_directory(str(folder))
    return folder
