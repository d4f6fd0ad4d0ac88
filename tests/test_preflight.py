"""Issue 12: bad inputs stop the run when the DAG is built, with one line naming the key/file/model and what to do;
a failing job puts its one-line cause in its rule log (above the traceback) and as the last line on stderr."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mfpipe.workflow.config import ConfigError, apply_defaults, check_config, validate_schema
from mfpipe.workflow.preflight import check_inputs

REPO = Path(__file__).resolve().parents[1]


def ci_config():
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    cfg.update(yaml.safe_load((REPO / "config" / "ci.yaml").read_text()))
    return apply_defaults(cfg)


def one_line(exc_info) -> str:
    text = str(exc_info.value)
    assert "\n" not in text, text
    return text


def preflight(cfg):
    validate_schema(cfg)
    check_config(cfg)
    check_inputs(cfg)


def test_unplaceable_architecture_is_refused_before_any_job(tmp_path, monkeypatch):
    """Issue 30: a model type the suite does not verify is checked on a tiny copy of its config.json at planning: one
    that cannot be placed (BitNet: a norm over all its heads' reads before the output projection), or whose conformance fails (Phi-2 placed
    with a sequential residual it does not have: its blocks do not rebuild), stops the run with one line; one that
    passes (StarCoder2) runs, and the verdict is cached."""
    import dataclasses

    from mfpipe.models import adapters

    placed = adapters.describe

    def misplaced(model):  # Phi-2's MLP reads the block input (a parallel residual): say it does not
        s = placed(model)
        return dataclasses.replace(s, parallel_residual=False) if model.config.model_type == "phi" else s

    monkeypatch.setattr(adapters, "describe", misplaced)
    monkeypatch.chdir(tmp_path)
    cases = {"jetmoe": ["'mine'", "'jetmoe'", "no structure mfpipe knows", "its heads are routed per token",
                        "mfpipe conformance"],
             "phi": ["'phi'", "conformance check(s) failed", "block: pieces rebuild the next residual"],
             "starcoder2": None}
    for model_type, want in cases.items():
        (tmp_path / model_type).mkdir()
        (tmp_path / model_type / "config.json").write_text(json.dumps({"model_type": model_type, "vocab_size": 512}))
        (tmp_path / model_type / "tokenizer.json").write_text("{}")  # a tokenizer file (planning reads none)
        cfg = ci_config()
        cfg["models"].append({"name": "mine", "source": "local", "path": str(tmp_path / model_type)})
        if want is None:
            preflight(cfg)
            continue
        with pytest.raises(ConfigError) as e:
            preflight(cfg)
        msg = one_line(e)
        assert all(w in msg for w in want), msg
    cache = json.loads((tmp_path / ".snakemake" / "mfpipe-conformance.json").read_text())
    assert sorted(v["model_type"] for v in cache.values()) == ["jetmoe", "phi", "starcoder2"]


def test_a_quantized_checkpoint_is_refused_before_any_job(tmp_path):
    """A checkpoint whose config carries a quantization_config (BitNet's released ones: AutoBitLinear, which quantizes
    its input to 8 bits) is refused at planning, of a verified type too: a tiny copy of its config is not quantized and
    would pass for it. Without it, the same config (a BitNet, placed since stop 76) plans."""
    config = {"model_type": "bitnet", "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128}
    for model_type in ("bitnet", "llama"):
        (tmp_path / model_type).mkdir()
        quant = {"quant_method": "bitnet", "linear_class": "autobitlinear", "quantization_mode": "offline"}
        (tmp_path / model_type / "config.json").write_text(json.dumps(
            {**config, "model_type": model_type, "quantization_config": quant}))
        (tmp_path / model_type / "tokenizer.json").write_text("{}")
        cfg = ci_config()
        cfg["models"].append({"name": "mine", "source": "local", "path": str(tmp_path / model_type)})
        with pytest.raises(ConfigError) as e:
            preflight(cfg)
        msg = one_line(e)
        assert "'mine' is a quantized checkpoint" in msg and "'bitnet'" in msg and "full-precision" in msg, msg
    (tmp_path / "bitnet" / "config.json").write_text(json.dumps(config))
    cfg = ci_config()
    cfg["models"].append({"name": "mine", "source": "local", "path": str(tmp_path / "bitnet")})
    preflight(cfg)


def test_missing_corpus_file_names_the_corpus_and_path(tmp_path):
    cfg = ci_config()
    cfg["corpus"].update(source="files", path=str(tmp_path / "nope.txt"))
    with pytest.raises(ConfigError) as e:
        preflight(cfg)
    msg = one_line(e)
    assert "shakespeare-ci" in msg and "nope.txt" in msg and "point `path`" in msg


def test_a_missing_task_file_is_refused_by_its_key(tmp_path):
    """An ICL task file is a job's input: missing, its old tables stood with no word (Snakemake took them for source
    files), or a fresh run ended in a MissingInputException naming no key. Found at stop 81."""
    cfg = ci_config()
    cfg.setdefault("prompts", {}).setdefault("icl", {})["task_files"] = [str(tmp_path / "mytasks.json")]
    with pytest.raises(ConfigError) as e:
        preflight(cfg)
    msg = one_line(e)
    assert msg.startswith("prompts.icl.task_files: ") and "mytasks.json' does not exist" in msg, msg
    (tmp_path / "mytasks.json").write_text('{"name": "mine", "pairs": [["a", "b"]]}')
    preflight(cfg)


@pytest.mark.parametrize("key,edit", [
    ("positional.models", lambda c: c.setdefault("positional", {}).update(models=["mini-gtp2"])),
    ("fv.models", lambda c: c.setdefault("fv", {}).update(models=["mini-neo"])),
    ("fv.head_lists", lambda c: c.setdefault("fv", {}).update(head_lists=[{"name": "x", "model": "mini-gpt",
                                                                             "heads": ["L0H0"]}])),
])
def test_a_near_miss_of_a_model_name_is_refused_naming_the_model_meant(key, edit):
    """A typo in a model name an experiment lists skipped the experiment for that model with no word (found at stop
    81); names far from every model's stand (the presets share one fv block naming the paper's three models)."""
    cfg = ci_config()
    edit(cfg)
    with pytest.raises(ConfigError) as e:
        preflight(cfg)
    msg = one_line(e)
    assert msg.startswith(f"{key}: ") and "is no model of this config; did you mean 'mini-" in msg, msg
    cfg = ci_config()
    cfg.setdefault("fv", {}).update(models=["gpt2-small", "gemma-2-2b", "gpt-j-6b"])
    preflight(cfg)


def test_a_local_folder_without_a_tokenizer_or_with_a_broken_config_is_refused_by_name(tmp_path):
    """transformers hands back a one-entry tokenizer for a folder without tokenizer files (every text then encodes to
    nothing, and the corpus job failed saying the corpus was too small); a config.json that is no JSON raised a
    JSONDecodeError naming neither: both refused at planning, by the model and the file."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 512}))
    cfg = ci_config()
    cfg["models"].append({"name": "mine", "source": "local", "path": str(folder)})
    with pytest.raises(ConfigError) as e:
        preflight(cfg)
    msg = one_line(e)
    assert "'mine'" in msg and "holds no tokenizer" in msg and "tokenizer.save_pretrained" in msg, msg
    (folder / "tokenizer.json").write_text("{}")
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ConfigError) as e:
        preflight(cfg)
    msg = one_line(e)
    assert "'mine'" in msg and "config.json" in msg and "no valid JSON" in msg, msg


def test_a_top_n_arm_or_a_budget_that_cannot_fit_is_refused_by_its_key():
    """App. M's tracked-set sizes meet the vocabulary bound tracked.n_tracked meets; a half's token budget below one
    window meets its key, not a corpus job's 'use a larger corpus'."""
    cfg = ci_config()
    cfg["substitution"] = {"top_n": [600]}
    with pytest.raises(ConfigError) as e:
        preflight(cfg)
    assert "substitution.top_n 600" in one_line(e) and "below 512" in one_line(e)
    cfg = ci_config()
    cfg["corpus"]["tokens_per_half"] = cfg["corpus"]["context_length"] - 1
    with pytest.raises(ConfigError, match="tokens_per_half .* less than one window"):
        preflight(cfg)


def test_n_larger_than_the_vocabulary():
    cfg = ci_config()
    cfg["tracked"]["n_tracked"] = 600
    with pytest.raises(ConfigError) as e:
        preflight(cfg)
    msg = one_line(e)
    assert "tracked.n_tracked 600" in msg and "512" in msg and "set tracked.n_tracked below 512" in msg


def test_unknown_kernel_name():
    cfg = ci_config()
    cfg["rollout"]["kernels"] = ["mean_field", "nosuch"]
    with pytest.raises(ConfigError) as e:
        preflight(cfg)
    msg = one_line(e)
    assert "rollout.kernels.1" in msg and "'nosuch'" in msg and "config.schema.yaml" in msg


@pytest.mark.parametrize("tokens", [0, -5])
def test_zero_or_negative_token_count(tokens):
    cfg = ci_config()
    cfg["corpus"]["tokens_per_half"] = tokens
    with pytest.raises(ConfigError) as e:
        preflight(cfg)
    assert "corpus.tokens_per_half" in one_line(e)


def test_offline_uncached_hub_model(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # an empty cache
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path))
    cfg = ci_config()
    cfg["models"].append({"name": "gpt2-small", "source": "hub", "hub_id": "openai-community/gpt2", "revisions": ["main"]})
    with pytest.raises(ConfigError) as e:
        preflight(cfg)
    msg = one_line(e)
    assert "'gpt2-small'" in msg and "hf download openai-community/gpt2 --revision main" in msg


def test_malformed_revision():
    cfg = ci_config()
    cfg["models"].append({"name": "p", "source": "hub", "hub_id": "EleutherAI/pythia-160m", "revisions": ["step 1"]})
    with pytest.raises(ConfigError) as e:
        check_inputs(cfg)
    assert "'step 1'" in one_line(e) and "fix `revisions`" in one_line(e)


def test_failing_job_puts_its_cause_in_its_log_above_the_traceback_and_last_on_stderr(tmp_path):
    log = tmp_path / "job.log"
    code = (
        "from mfpipe.workflow.logs import setup_logging\nfrom mfpipe.workflow.runner import run_logged\n"
        "from mfpipe.models.loader import ModelLoadError\n"
        f"log = setup_logging({str(log)!r})\n"
        "def main():\n    raise ModelLoadError('model x: not cached; run hf download x')\n"
        "run_logged(main, log)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**__import__("os").environ, "PYTHONPATH": str(REPO / "src")})
    assert out.returncode == 1
    cause = "mfpipe error: ModelLoadError: model x: not cached; run hf download x"
    assert out.stderr.strip().splitlines()[-1] == cause
    assert "Traceback" not in out.stderr
    text = log.read_text()
    assert text.index(cause) < text.index("Traceback") and "in main" in text


# ------------------------------------------------------------------ the same inputs through a real `snakemake -n`
def dry_run_last_line(tmp_path, edit, env=None) -> str:
    """The last line `snakemake -n` prints (stdout and stderr) for the ci config edited by ``edit(cfg, tmp_path)``,
    run from the checkout's Snakefile in an empty working directory: it must fail, with that one line as its end."""
    import os

    cfg = yaml.safe_load((REPO / "config" / "ci.yaml").read_text())
    edit(cfg, tmp_path)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(cfg))
    work = tmp_path / "work"
    work.mkdir()
    out = subprocess.run(
        [sys.executable, "-m", "snakemake", "-n", "--snakefile", str(REPO / "Snakefile"), "--directory", str(work),
         "--configfile", str(REPO / "config" / "ci.yaml"), str(bad)],
        capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})
    assert out.returncode != 0, out.stdout + out.stderr
    # stdout (Snakemake's profile notice) is written before the failure: the end of the output is stderr's end
    lines = [ln for ln in (out.stdout + out.stderr).splitlines() if ln.strip()]
    assert out.stderr.strip() and lines[-1] == out.stderr.strip().splitlines()[-1]
    assert lines[-1].startswith("mfpipe error: "), lines[-8:]
    assert sum(ln.startswith("mfpipe error: ") for ln in lines) == 1, lines[-8:]
    return lines[-1]


def _jetmoe(cfg, tmp):
    (tmp / "m").mkdir()
    (tmp / "m" / "config.json").write_text(json.dumps({"model_type": "jetmoe", "vocab_size": 32000}))
    (tmp / "m" / "tokenizer.json").write_text("{}")
    cfg["models"].append({"name": "mine", "source": "local", "path": str(tmp / "m")})


def _offline(cfg, tmp):
    cfg["models"].append({"name": "gpt2-small", "source": "hub", "hub_id": "openai-community/gpt2",
                          "revisions": ["main"]})


DAG_CASES = {
    "unplaceable architecture": (_jetmoe, None, ["'mine'", "'jetmoe'", "no structure mfpipe knows", "mfpipe conformance"]),
    "missing corpus file": (lambda c, t: c["corpus"].update(source="files", path=str(t / "nope.txt")), None,
                            ["corpus 'shakespeare-ci'", "nope.txt", "point `path`"]),
    "N above the vocabulary": (lambda c, t: c["tracked"].update(n_tracked=600), None,
                               ["tracked.n_tracked 600", "set tracked.n_tracked below 512"]),
    "unknown kernel": (lambda c, t: c.setdefault("rollout", {}).update(kernels=["mean_field", "nosuch"]), None,
                       ["rollout.kernels.1", "'nosuch'"]),
    "zero tokens": (lambda c, t: c["corpus"].update(tokens_per_half=0), None, ["corpus.tokens_per_half"]),
    "negative tokens": (lambda c, t: c["corpus"].update(tokens_per_half=-5), None, ["corpus.tokens_per_half"]),
    "budget under a window": (lambda c, t: c["corpus"].update(tokens_per_half=8), None,
                              ["corpus 'shakespeare-ci'", "tokens_per_half 8", "raise tokens_per_half"]),
    "offline uncached hub model": (_offline, "empty-cache", ["'gpt2-small'",
                                                             "hf download openai-community/gpt2 --revision main"]),
    "malformed revision": (lambda c, t: c["models"].append({"name": "p", "source": "hub",
                                                            "hub_id": "EleutherAI/pythia-160m",
                                                            "revisions": ["step 1"]}), None,
                           ["models.2.revisions.0", "'step 1'", "fix it in your config file"]),
}


@pytest.mark.parametrize("case", list(DAG_CASES))
def test_bad_input_ends_a_dry_run_with_its_one_actionable_line(case, tmp_path):
    """Issue 12: through a real `snakemake -n`, each bad input stops the run before any job and the last line of
    the console output is its one-line cause (not a Snakemake traceback frame below it)."""
    edit, env, want = DAG_CASES[case]
    if env == "empty-cache":  # HF_HUB_OFFLINE with an empty hub cache: the model cannot be had
        (tmp_path / "hub").mkdir()
        env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HOME": str(tmp_path / "hf")}
    line = dry_run_last_line(tmp_path, edit, env)
    assert all(w in line for w in want), line


def test_a_job_script_imports_without_the_collector_and_works_with_it(tmp_path):
    """workflow/scripts/_mfpipe_checkout.py turns the cyclic collector off for a job script's imports; run_logged
    freezes what they made and turns it back on before the job's work, which therefore runs as any Python does."""
    script = tmp_path / "job.py"
    script.write_text(
        f"import sys\nsys.path.insert(0, {str(REPO / 'workflow' / 'scripts')!r})\n"
        "import _mfpipe_checkout  # noqa\nimport gc\n"
        "print('imports', gc.isenabled())\nimport xarray  # noqa\n"
        "from mfpipe.workflow.runner import run_logged\nimport logging\n"
        "def main():\n    print('work', gc.isenabled(), gc.get_freeze_count() > 1000)\n"
        "run_logged(main, logging.getLogger('job'))\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:2] == ["imports False", "work True True"], out.stdout
