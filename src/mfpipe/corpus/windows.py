"""Corpus stage: documents (:mod:`mfpipe.corpus.documents`) → stats / eval halves → BOS-led windows → fixed-size shards.

Packing: each half's documents are tokenized without special tokens and concatenated into one
stream; the stream is cut into pieces of ``T-1`` tokens and each piece is prefixed by BOS, so
every window is ``[BOS, t1 … t(T-1)]``. The last partial piece (< T-1 tokens) is dropped and the
number of dropped tokens is recorded.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import numpy as np

from mfpipe.corpus.documents import HALVES, CorpusError, Document, assign_split, iter_documents
from mfpipe.workflow.io import atomic_savez, atomic_write_text


class Shard(NamedTuple):
    tokens: np.ndarray  # int32 [n_windows, T]
    doc_ids: np.ndarray  # int32 [n_windows, T], -1 at position 0


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


def shard_groups(shard_ids: Sequence[str], per_job: int | None = None) -> dict[str, list[str]]:
    """The shards of one half as the statistics jobs take them: runs of ``per_job`` consecutive shards (None: all of
    them in one run), each named by its first shard's id, ``{first id: [ids]}`` in shard order. A job loads the
    model and imports its libraries once for its run, so on a small model a run of shards costs little more than
    one shard's forward passes (``stats.shards_per_job``)."""
    ids = sorted(shard_ids)
    if per_job is not None and int(per_job) < 1:
        raise ValueError(f"shards per job must be at least 1 (got {per_job})")
    k = max(len(ids), 1) if per_job is None else int(per_job)
    return {ids[i]: ids[i : i + k] for i in range(0, len(ids), k)}


def shard_fingerprint(shard: Shard) -> str:
    """Checksum of one shard's contents, recorded per shard in `fingerprint.json` and checked on every read."""
    return fingerprint_arrays([shard.tokens, shard.doc_ids])


def _corrupt(path: Path, why: str) -> CorpusError:
    shards = path.parent.parent
    return CorpusError(f"corpus shard {path} is corrupt ({why}): delete the folder {shards} and rerun, which rebuilds it")


def read_shard(path: str | Path, verify: bool = True) -> Shard:
    """One shard of windows. With ``verify``, a shard that cannot be read, or whose contents differ from the
    checksum `fingerprint.json` recorded when it was written (truncated, overwritten, corrupted on disk), is refused
    with one line naming it and what to do -- statistics of a damaged shard would be merged as if valid."""
    path = Path(path)
    try:
        with np.load(path) as z:
            shard = Shard(z["tokens"], z["doc_ids"])
    except FileNotFoundError:
        raise FileNotFoundError(f"corpus shard {path} does not exist; rerun the corpus stage") from None
    except (zipfile.BadZipFile, ValueError, OSError, KeyError, EOFError) as e:
        raise _corrupt(path, f"unreadable: {e}") from None
    info_path = path.parent.parent / "fingerprint.json"
    if verify and info_path.is_file():
        want = json.loads(info_path.read_text()).get("shards", {}).get(f"{path.parent.name}/{path.name}")
        if want is not None and shard_fingerprint(shard) != want:
            raise _corrupt(path, f"its checksum differs from the one recorded in {info_path}")
    return shard


def list_shards(half_dir: str | Path) -> list[Path]:
    return sorted(Path(half_dir).glob("shard-*.npz"))


class EvalWindows(NamedTuple):
    """The first windows of a corpus's ``eval`` half: tokens [n, T], their document ids [n, T], the shard files read."""

    tokens: np.ndarray
    doc_ids: np.ndarray
    shards: list[str]


def eval_windows(shards_dir: str | Path, *, n_windows: int | None = None, n_tokens: int | None = None) -> EvalWindows:
    """The first ``n_windows`` windows of the eval half (``<shards_dir>/eval``) in shard order, or the first
    ceil(``n_tokens`` / T) (fewer when the half is smaller): held out from the statistics half that gives W and μ.
    The one reader of held-out windows (the substitution, the prompt classes, the instance meter)."""
    if (n_windows is None) == (n_tokens is None):
        raise ValueError("eval_windows takes one of n_windows and n_tokens")
    toks, docs, used, have = [], [], [], 0
    for path in list_shards(Path(shards_dir) / "eval"):
        shard = read_shard(path)
        want = int(n_windows) if n_windows is not None else -(-int(n_tokens) // shard.tokens.shape[1])
        toks.append(shard.tokens[: want - have])
        docs.append(shard.doc_ids[: want - have])
        used.append(path.name)
        have += len(toks[-1])
        if have >= want:
            break
    if not toks:
        raise FileNotFoundError(f"no eval-half shards under {Path(shards_dir) / 'eval'}; run the corpus stage first")
    return EvalWindows(np.concatenate(toks), np.concatenate(docs), used)


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
    tokenizer_revision: str | None = None,
    tokenizer_commit: str | None = None,
) -> dict:
    """Build both halves and write shards plus `fingerprint.json` into `out_dir` (a hub tokenizer: with the revision
    it was asked for and the commit that revision resolved to)."""
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
        **{k: v for k, v in (("tokenizer_revision", tokenizer_revision), ("tokenizer_commit", tokenizer_commit)) if v},
        "bos_id": int(bos_id),
        "vocab_size": int(len(tokenizer)),
        "context_length": int(cfg["context_length"]),
        "tokens_per_half": int(cfg["tokens_per_half"]),
        "shard_windows": int(cfg["shard_windows"]),
        "reserve_train_every": int(cfg.get("reserve_train_every", 0)),
        "halves": {},
        "shards": {},  # "<half>/shard-NNNNN.npz" -> shard_fingerprint: read_shard refuses a damaged shard
    }
    for h in HALVES:
        w = halves[h]["windows"]
        if w.tokens.shape[0] == 0:
            n_docs = len(halves[h]["doc_index"])  # the halves take alternate documents: one .txt file is one
            raise CorpusError(
                f"corpus {cfg.get('name')!r}: the {h} half has no complete window of {cfg['context_length']} tokens "
                f"({n_docs} document(s) in it; the halves take alternate documents, and a .txt file is one document): "
                "use a larger corpus of several documents (files, or .jsonl records), or a smaller context_length"
            )
        paths = write_shards(w, out_dir / h, int(cfg["shard_windows"]))
        for p in paths:
            info["shards"][f"{h}/{p.name}"] = shard_fingerprint(read_shard(p, verify=False))
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
