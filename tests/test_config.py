import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mfpipe.config import ConfigError, check_config, resolve_revisions, validate_schema

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


def test_bad_value_is_named():
    cfg = default_config()
    cfg["tracked"]["n_types"] = "many"
    with pytest.raises(ConfigError, match=r"tracked\.n_types"):
        validate_schema(cfg)
    cfg = default_config()
    cfg["corpus"]["source"] = "web"
    with pytest.raises(ConfigError, match=r"corpus\.source"):
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


def test_snakemake_stops_on_a_bad_key_with_its_name(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("corpus:\n  context_lenght: 64\n")
    out = subprocess.run(
        [sys.executable, "-m", "snakemake", "-n", "--configfile", str(bad)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode != 0
    assert "context_lenght" in out.stdout + out.stderr
