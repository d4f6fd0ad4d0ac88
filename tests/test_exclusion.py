"""The exclusion arm (App. llama, "Exclusion experiment"; config section `exclusion`, workflow/rules/exclusion.smk,
mfpipe.corpus.exclusion and mfpipe.experiments.rollout.exclusion): the class predicates against plain references, the
arm's tracked set on a byte-level BPE tokenizer of the mini suite's kind against the main selection filtered and
topped up by hand, its side-by-side quantities on tiny models against direct recomputations, its place in the DAG
(its own tracked-set, statistics and rollout jobs; nothing else changes) and in the project (one config section, one
rule file, this test file; editing the rollout's code reruns no statistics of the arm)."""

from __future__ import annotations

import re
import string
from pathlib import Path

import numpy as np
import pytest

from mfpipe.corpus.tracked import select_tracked
from mfpipe.experiments.rollout import exclusion as EX

REPO = Path(__file__).resolve().parents[1]
CI = REPO / "config" / "ci.yaml"

TEXT = ("Who's there?\nNay, answer me: stand, and unfold yourself.\n\n  Long live the king!\t(Exeunt.)\n"
        "BERNARDO. -- 'Tis now struck twelve; get thee to bed, Francisco.\n...\n"
        "« Quoi ? » — “Yes,” he said.\r\n"
        "£5 + $3 = ~8 | 100% [sic] {a} <b> ^_^ `x` @home #1 * & \\ /\n")


# ------------------------------------------------------------------------------------------- the classes
def ascii_reference(s: str) -> tuple[bool, bool]:
    """(whitespace-only, pure punctuation) of an ASCII string by the plain ASCII definitions."""
    ws = bool(s) and all(ch in string.whitespace for ch in s)
    core = s.strip(string.whitespace)
    return ws, bool(core) and all(ch in string.punctuation for ch in core)


def test_classes_on_every_ascii_string_of_up_to_two_characters_and_unicode_cases():
    chars = [chr(i) for i in range(128)]
    for s in chars + [a + b for a in chars for b in chars] + [" .\n", ").\n\n", "\n\n\n", " a.", ". ."]:
        if any(unicode_space(ch) != (ch in string.whitespace) for ch in s):
            continue  # \x1c-\x1f: Unicode whitespace, not ASCII's string.whitespace (checked below)
        assert (EX.is_newline_whitespace(s), EX.is_punctuation(s)) == ascii_reference(s), repr(s)
    for s in ["\u00a0", "\u2028", "\u3000 ", "\r\n", "\x1c"]:
        assert EX.is_newline_whitespace(s) and not EX.is_punctuation(s), repr(s)
    for s in ["«", " »", "—", "“", "…\n", "¿", "€", "¡¡", "、", "«»"]:
        assert EX.is_punctuation(s) and not EX.is_newline_whitespace(s), repr(s)
    for s in ["", "é", "é.", "٣", "\ufffd", "😀", " ©", "a b", ". .", "Ā"]:
        assert not EX.is_punctuation(s) and not EX.is_newline_whitespace(s), repr(s)
    assert EX.exclusion_reason(" and", strings=[" and"]) == "string" and EX.exclusion_reason(" and") is None
    assert EX.exclusion_reason(",\n", classes=["newline_whitespace"]) is None
    assert EX.exclusion_reason(",\n") == "punctuation" and EX.exclusion_reason("\n") == "newline_whitespace"
    with pytest.raises(ValueError, match="unknown exclusion class"):
        EX.exclusion_reason("x", classes=["digits"])
    assert not EX.arm_active({"classes": [], "strings": []}) and EX.arm_active({"classes": [], "strings": ["x"]})


def unicode_space(ch: str) -> bool:
    return re.fullmatch(r"\s", ch) is not None


# ------------------------------------------------------------------------------------ the arm's tracked set
@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A byte-level BPE of the mini suite's kind (mfpipe.minisuite.tokenizer) on text with newlines, whitespace runs,
    ASCII and Unicode punctuation."""
    from transformers import AutoTokenizer

    from mfpipe.minisuite.tokenizer import train_tokenizer

    out = tmp_path_factory.mktemp("tok")
    train_tokenizer([TEXT] * 30, 400, 2, out)
    return AutoTokenizer.from_pretrained(out)


def arm_by_hand(counts, n, bos, decode, excluded):
    """The main top-n with the excluded types dropped, then the next most frequent types not excluded, up to n."""
    main = select_tracked(counts, n, bos, decode).type_ids.tolist()
    kept = [t for t in main if not excluded(decode(t))]
    ranked = select_tracked(counts, len(counts), bos, decode).type_ids.tolist()  # every occurring type, in order
    for t in ranked[n:]:
        if len(kept) == n:
            break
        if not excluded(decode(t)):
            kept.append(t)
    return main, kept


@pytest.mark.parametrize("classes, strings", [(EX.CLASSES, ()), (("punctuation",), (" the", "Nay")),
                                              ((), ("\n",))])
def test_arm_is_the_main_selection_minus_the_excluded_topped_up_in_frequency_order(tokenizer, classes, strings):
    V, bos = len(tokenizer), 0
    counts = np.random.default_rng(0).zipf(1.3, V).astype(np.int64) % 997
    counts[np.random.default_rng(1).choice(V, 40, replace=False)] = 0  # types that never occur
    counts[5:9] = counts[10]  # ties: broken by the smaller id
    counts[[tokenizer.convert_tokens_to_ids(t) for t in ("Ċ", ",", ".", "Ġthe")]] = [5000, 4000, 3000, 2000]
    decode = lambda i: tokenizer.decode([i])  # noqa: E731
    n = 120

    def excluded(s):
        return s in strings or any(EX.PREDICATES[c](s) for c in classes)

    arm = EX.select_arm(counts, n, bos, decode, classes, strings)
    main, expected = arm_by_hand(counts, n, bos, decode, excluded)
    assert arm.type_ids.tolist() == expected and arm.n == n
    for s in arm.strings:  # no type of the arm is excluded
        assert s not in strings and not any(EX.PREDICATES[c](s) for c in classes), repr(s)
    dropped = [t for t in main if excluded(decode(t))]
    assert dropped, "the test's vocabulary must hold excluded types among the top-n"
    assert arm.meta["n_excluded_of_main"] == len(dropped)
    assert [e["id"] for e in arm.meta["excluded"] if e["rank"] < n] == dropped
    assert arm.meta["exclude"] == {"classes": list(classes), "strings": list(strings)}
    assert all(decode(e["id"]) == e["string"] and excluded(e["string"]) for e in arm.meta["excluded"])
    if classes == EX.CLASSES:  # the tokenizer's newline and punctuation types are among the dropped
        assert {"\n", ",", "."} <= {decode(t) for t in dropped}


def test_arm_is_smaller_only_when_the_vocabulary_runs_out(tokenizer):
    counts = np.zeros(len(tokenizer), dtype=np.int64)
    words = sorted(i for i in range(1, len(tokenizer)) if tokenizer.decode([i]).strip().isalpha())[:3]
    ids = [tokenizer.convert_tokens_to_ids(t) for t in ("Ċ", ",")] + words
    counts[ids] = [50, 40, 30, 20, 10]
    arm = EX.select_arm(counts, 4, 0, lambda i: tokenizer.decode([i]))
    assert arm.type_ids.tolist() == words and arm.meta["n_excluded_of_main"] == 2


# -------------------------------------------------------------------------------- the side-by-side table
@pytest.fixture(scope="module", params=["gpt2", "gpt_neox"])
def setup(request, tmp_path_factory):
    from stats_reference import tracked_for, zipf_windows
    from tiny_models import make_tiny_model

    from mfpipe.experiments.rollout import runs as RO
    from mfpipe.models.adapters import get_adapter
    from mfpipe.stats import accumulate_shard, finalize, open_stats, write_store

    model = make_tiny_model(request.param, seed=7)
    ad = get_adapter(model)
    root = tmp_path_factory.mktemp(f"excl-{request.param}")
    st_tok, ev_tok = zipf_windows(24, seed=1), zipf_windows(24, seed=2)
    tracked = tracked_for(st_tok)
    stores = {}
    for half, tok in (("stats", st_tok), ("eval", ev_tok)):
        sums = accumulate_shard(model, ad, tok, tracked, batch_size=8, device="cpu", progress=False)
        meta = {"model": "tiny", "revision": "r1", "half": half, "corpus": "zipf", "corpus_fingerprint": "fp",
                "model_type": ad.model_type}
        stores[half] = write_store(finalize(sums, tracked, meta), root / f"{half}.zarr")
    setup = RO.prepare(ad, open_stats(stores["stats"]), open_stats(stores["eval"]))
    return model, ad, stores, setup


def test_arm_summary_against_table_1_and_a_direct_magnitude_ratio(setup):
    from mfpipe.experiments.rollout import accounting as AC
    from mfpipe.experiments.rollout import runs as RO

    model, ad, stores, s = setup
    seen = {}
    row = EX.arm_summary(ad, s, divergence=lambda setup, kernel: seen.update(k=kernel) or {
        "peak_amplification": 3.0, "peak_layer": 1, "top_tokens": ["\n", "."]})
    t1 = RO.run_rollouts(model, ad, stores["stats"], stores["eval"], kernels=["mean_field"])
    assert row["rollout_cosine"] == pytest.approx(t1.loc[t1["metric"] == "cosine", "value"].mean(), abs=1e-12)
    tf = AC.teacher_forced_table(ad, s)
    assert row["teacher_forced_cosine"] == pytest.approx(tf.loc[tf["metric"] == "cosine", "value"].mean(), abs=1e-12)
    # the centred magnitude ratio by hand: every type's vector minus the cloud's mean, one depth at a time
    from mfpipe.experiments.rollout import algorithm as R

    pred = R.rollout(ad, s.P, s.bos, init=s.init)
    ratios = []
    for d in range(1, ad.n_layers + 1):
        p, t = pred[d][s.types].astype(np.float64), s.truth[d][s.types]
        rms = [np.sqrt(np.mean([np.sum((v - x.mean(0)) ** 2) for v in x])) for x in (p, t)]
        ratios.append(rms[0] / rms[1])
    assert row["peak_magnitude_ratio"] == pytest.approx(max(ratios), rel=1e-9)
    assert row["peak_magnitude_depth"] == int(np.argmax(ratios)) + 1
    assert np.array_equal(seen["k"], s.P) and row["div_top_tokens"] == "'\\n', '.'" and row["div_peak_layer"] == 1
    # the job's diagnostics: the divergence module's headline of the same rollout, its four readings and top tokens
    from mfpipe.experiments.rollout import divergence as DV

    cfg = {"kernel": "mean_field", "pin": False, "alphas": [0.5, 1.0], "top_k": 2, "n_random": 2, "n_top": 5, "seed": 0}
    real = EX.arm_summary(ad, s, EX.divergence_headline(ad, model, cfg))
    head = DV.headline(DV.run(ad, s, s.P, alphas=(0.5, 1.0), top_k=2, n_random=2, seed=0, n_top=5))
    assert [real[f"div_{k}"] for k in EX.DIVERGENCE_KEYS] == [head[k] for k in EX.DIVERGENCE_KEYS]
    assert real["div_top_tokens"] == ", ".join(map(repr, head["top_tokens"])) and head["top_tokens"]
    assert real["peak_magnitude_ratio"] == pytest.approx(head["peak_magnitude_ratio"], rel=1e-5)
    meta = {"exclude": {"classes": list(EX.CLASSES), "strings": []}, "n_excluded_of_main": 2,
            "excluded": [{"string": "\n"}, {"string": "|"}]}
    df = EX.side_by_side(row, row, meta)
    assert df["arm"].tolist() == ["main", "exclusion"] and df["n_excluded"].tolist() == [0, 2]
    assert df.loc[1, "excluded_examples"] == "'\\n', '|'" and df.loc[1, "rule"] == "newline_whitespace+punctuation"
    md = EX.side_by_side_markdown(df, "t")
    assert "| quantity | main | exclusion |" in md and "'\\|'" in md and "| rollout_cosine |" in md


# --------------------------------------------------------------------------------------------------- the DAG
@pytest.mark.slow
def test_the_arm_plans_its_own_jobs_and_changes_no_other(tmp_path):
    """A dry run of the whole ci DAG (shard counts standing in for the corpus checkpoint, as `mfpipe estimate` plans)
    with the arm (the default) and without it (section `exclusion` empty): the arm adds exactly its tracked set per
    model, its statistics jobs on excl/stats and excl/eval and its rollout per (model, rollout revision); every other
    job is the same. No other rule's params can see the section: only the arm's rule file reads it."""
    import yaml

    from mfpipe.estimate import jobs as J

    off = tmp_path / "off.yaml"
    off.write_text(yaml.safe_dump({"exclusion": {"classes": []}}))
    cfg = J.load_config([CI], base=REPO / "config" / "config.yaml")
    corpus = J.predict_corpus(cfg, {}, results="/nonexistent")

    def planned(*files):
        return sorted((j["rule"], tuple(sorted(j["wildcards"].items()))) for j in J.planned_jobs(
            corpus, [CI, *files], snakefile=REPO / "Snakefile", workdir=tmp_path / f"wd{len(files)}"))

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:  # two dry runs side by side (~12 s each: Snakemake reads the whole workflow)
        with_arm, without = pool.map(lambda files: planned(*files), [(), (off,)])
    added = [j for j in with_arm if j not in without]
    assert [j for j in without if j not in with_arm] == []
    from mfpipe.workflow.plan import Plan

    rollout = {(m, rev) for m, revs in Plan(cfg, REPO / "src").rollout_revisions.items() for rev in revs}
    assert sorted(w for r, w in added if r == "exclusion_rollout") == sorted(
        (("model", m), ("revision", rev)) for m, rev in rollout)
    assert sorted(dict(w)["model"] for r, w in added if r == "tracked_types_excl") == sorted(m for m, _ in rollout)
    merges = sorted((dict(w)["model"], dict(w)["dataset"]) for r, w in added if r == "stats_merge")
    assert merges == sorted((m, f"excl/{h}") for m, _ in rollout for h in ("stats", "eval"))
    shards = [dict(w) for r, w in added if r == "stats_shard"]
    assert shards and all(w["dataset"].startswith("excl/") for w in shards)
    assert {r for r, _ in added} == {"tracked_types_excl", "stats_shard", "stats_merge", "exclusion_rollout"}
    # params: the section is read by the arm's rule file alone, and there by the arm's tracked set only
    for smk in (REPO / "workflow" / "rules").glob("*.smk"):
        text = smk.read_text()
        if smk.name != "exclusion.smk":
            assert 'config["exclusion"]' not in text and "EXCLUDE" not in text, smk
    text = (REPO / "workflow" / "rules" / "exclusion.smk").read_text()
    assert text.count("EXCLUDE[") == 2 and text.index("EXCLUDE[") < text.index("rule exclusion_rollout")
    assert 'config["tracked"]' not in re.sub(r'config\["tracked"\]\["n_tracked"\]', "", text)


def test_the_arms_tracked_set_reads_no_rollout_code():
    """The arm's tracked set is the corpus stage's (mfpipe.corpus.exclusion, its job in mfpipe.corpus.jobs): editing
    the rollout's code (the divergence diagnostics, the side-by-side table) reruns no statistics of the arm."""
    from mfpipe.workflow.codedeps import code_inputs

    deps = code_inputs(REPO / "src", REPO / "workflow" / "scripts")
    files = deps["mfpipe.corpus.jobs:tracked_types_excl"]
    assert any(f.endswith("corpus/exclusion.py") for f in files), files
    assert not [f for f in files if "/experiments/" in f], files
    assert any(f.endswith("rollout/divergence.py") for f in deps["mfpipe.experiments.rollout.jobs:exclusion_rollout"])


def test_the_arm_is_one_config_section_one_rule_file_and_one_test_file():
    """Issue 60 item 1: the arm's options are the top-level section `exclusion` (a config of the earlier layout,
    `tracked.exclude`, is told where they went), its rules are workflow/rules/exclusion.smk, its library the two modules
    named for it (the corpus stage's selection and the rollout's table) and its tests this file."""
    import yaml

    from mfpipe.workflow.config import ConfigError, validate_schema

    schema = yaml.safe_load((REPO / "src" / "mfpipe" / "schemas" / "config.schema.yaml").read_text())["properties"]
    assert set(schema["exclusion"]["properties"]) == {"classes", "strings"}
    assert "exclude" not in schema["tracked"]["properties"]
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    validate_schema(cfg)
    assert cfg["exclusion"] == {"classes": list(EX.CLASSES), "strings": []}  # the default: the arm runs
    with pytest.raises(ConfigError, match=r"tracked\.exclude was renamed exclusion"):
        validate_schema({**cfg, "tracked": {"n_tracked": 1000, "exclude": {"classes": []}}})
    modules = sorted(str(p.relative_to(REPO / "src")) for p in (REPO / "src").rglob("*.py") if "exclu" in p.stem)
    assert modules == ["mfpipe/corpus/exclusion.py", "mfpipe/experiments/rollout/exclusion.py"], modules
    rules = {p.name: re.findall(r"^(?:use )?rule (\w*excl\w*)", p.read_text(), re.M)
             for p in (REPO / "workflow" / "rules").glob("*.smk")}
    assert {k: v for k, v in rules.items() if v} == {"exclusion.smk": ["tracked_types_excl", "exclusion_rollout"]}
    tests = sorted(p.name for p in (REPO / "tests").glob("test_*.py") if "rollout.exclusion" in p.read_text()
                   or "corpus.exclusion" in p.read_text())
    assert tests == ["test_exclusion.py"], tests
