import json
import os
import subprocess
import sys

import pytest

from mfpipe.models.loader import ModelLoadError, find_spec, load_model, load_tokenizer


def test_unknown_model_name_lists_the_known_ones():
    with pytest.raises(ModelLoadError, match=r"unknown model 'gpt5'.*mini-gpt2, mini-neox"):
        find_spec([{"name": "mini-gpt2"}, {"name": "mini-neox"}], "gpt5")


def test_missing_local_path(tmp_path):
    spec = {"name": "mine", "source": "local", "path": str(tmp_path / "nowhere")}
    with pytest.raises(ModelLoadError, match=r"'mine'.*does not exist"):
        load_model(spec)


def test_missing_minisuite_checkpoint_says_how_to_train(tmp_path):
    with pytest.raises(ModelLoadError, match="snakemake"):
        load_model({"name": "mini-gpt2", "source": "minisuite"}, "step8", results_dir=tmp_path)


def test_remote_code_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "fancy", "architectures": ["FancyForCausalLM"],
        "auto_map": {"AutoModelForCausalLM": "modeling_fancy.FancyForCausalLM"},
    }))
    spec = {"name": "fancy", "source": "local", "path": str(tmp_path)}
    with pytest.raises(ModelLoadError, match="remote code"):
        load_model(spec)
    with pytest.raises(ModelLoadError, match="remote code"):
        load_tokenizer(spec)


def test_local_model_loads_with_eager_attention(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16)).save_pretrained(tmp_path)
    m = load_model({"name": "tiny", "source": "local", "path": str(tmp_path)})
    assert m.config._attn_implementation == "eager" and not m.training
    with pytest.raises(ModelLoadError, match="dtype"):
        load_model({"name": "tiny", "source": "local", "path": str(tmp_path)}, dtype="float8")


def test_offline_hub_model_gives_one_clear_message():
    code = (
        "from mfpipe.models.loader import load_model, ModelLoadError\n"
        "try:\n    load_model({'name': 'p', 'source': 'hub', 'hub_id': 'EleutherAI/pythia-160m'}, 'step1000')\n"
        "except ModelLoadError as e:\n    print('MSG', e)\n"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=os.environ.get("HF_HOME", "/tmp/mfpipe-empty-hf-home"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert "MSG" in out.stdout, out.stderr[-2000:]
    assert "EleutherAI/pythia-160m" in out.stdout and "--revision step1000" in out.stdout
    assert "Traceback" not in out.stdout


def test_a_load_pauses_the_cyclic_collector_and_restores_its_state(tmp_path, monkeypatch):
    """The collector is off while a model or tokenizer loads (a speed matter: benchmarks/HISTORY.md, "A model job's
    start-up") and in the state it was before once the load returns or fails, on or off."""
    import gc

    from transformers import GPT2Config, GPT2LMHeadModel

    import mfpipe.models.loader as loader

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16)).save_pretrained(tmp_path)
    seen = []
    real = loader.resolve_location
    monkeypatch.setattr(loader, "resolve_location", lambda *a, **k: (seen.append(gc.isenabled()), real(*a, **k))[1])
    spec = {"name": "tiny", "source": "local", "path": str(tmp_path)}
    was = gc.isenabled()
    try:
        for state in (True, False):
            (gc.enable if state else gc.disable)()
            load_model(spec)
            assert gc.isenabled() is state
            gone = {"name": "gone", "source": "local", "path": str(tmp_path / "gone")}
            for load in (load_model, load_tokenizer):
                with pytest.raises(ModelLoadError):
                    load(gone)
                assert gc.isenabled() is state
    finally:
        (gc.enable if was else gc.disable)()
    assert seen and not any(seen), seen
