"""The corpus stage's memory, measured (issue 58): its ``corpus_shards`` job loads the model's tokenizer, reads the
corpus and holds both halves' windows before it writes them, so its peak is not the start-up of a process that
imports the tokenizer classes (the paper-shape run of GPT-2 small: 358 MiB measured, 257 by that start-up alone).

:func:`corpus_memory` runs the job's own code (:func:`mfpipe.corpus.windows.write_corpus`, on the tokenizer the
estimate loaded) in a process of its own, into a temporary folder, at two budgets (the config's tokens per half
where that is small, else :data:`PROBE_TOKENS` and half of it), and reads the process's high-water mark (VmHWM):
the peak at the run's budget is the line through the two, at the tokens the job writes. A hub dataset is not read
here (the estimate stays offline): the embedded Shakespeare stands in for its text, as it does for the tokenizing
rate, and the datasets reader's own memory is not counted (the line says so). Where the probe cannot run (no
tokenizer here, a stand-in tokenizer without a vocabulary) the job keeps the start-up's memory.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile

__all__ = ["PROBE_TOKENS", "corpus_memory", "corpus_peak_mb"]

PROBE_TOKENS = 1 << 18  # tokens per half of the larger probe: about five seconds of GPT-2's tokenizer

_PROBE = """
import json, pathlib, sys, tempfile
arg = json.loads(sys.argv[1])
import mfpipe.workflow.runner
from mfpipe.corpus.windows import resolve_bos_id, write_corpus
from mfpipe.models.loader import load_tokenizer
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(arg["tokenizer"], trust_remote_code=False)
with tempfile.TemporaryDirectory() as d:
    info = write_corpus(arg["corpus"], tok, resolve_bos_id(tok, arg["bos_token"]), d, tokenizer_name="probe")
s = pathlib.Path("/proc/self/status")
hwm = int(next(x.split()[1] for x in s.read_text().splitlines() if x.startswith("VmHWM"))) / 1024
print("MFPIPE-CORPUS", json.dumps({"tokens": sum(h["n_tokens"] for h in info["halves"].values()), "mb": hwm}))
"""


def _probe(corpus: dict, tokenizer_path: str, bos_token, tokens_per_half: int) -> dict | None:
    arg = json.dumps({"corpus": {**corpus, "tokens_per_half": int(tokens_per_half)}, "tokenizer": tokenizer_path,
                      "bos_token": bos_token})
    with tempfile.TemporaryDirectory() as cwd:
        done = subprocess.run([sys.executable, "-c", _PROBE, arg], capture_output=True, text=True, cwd=cwd)
    line = next((x for x in done.stdout.splitlines() if x.startswith("MFPIPE-CORPUS ")), None)
    return None if line is None else json.loads(line.split(" ", 1)[1])


def corpus_memory(config: dict, tokenizers: dict) -> dict:
    """``{"<corpus>/<model>": {"mb": a, "mb_per_token": b, "text": what was read}}``: the ``corpus_shards`` job's
    peak MiB as ``a + b x`` the tokens it writes, measured (module docstring) for every corpus and model whose
    tokenizer is loaded here (``tokenizers[model]``, as :func:`mfpipe.estimate.report._tokenizers` gives them); the
    models that share a tokenizer share one measure. Missing where the probe could not run."""
    from mfpipe.estimate.jobs import STAND_IN_TEXT
    from mfpipe.workflow.config import corpora

    out = {}
    for name, corpus in corpora(config).items():
        measured: dict = {}
        for m in config["models"]:
            tok = tokenizers.get(m["name"])
            if tok is None:
                continue
            if id(tok) not in measured:
                text, what = corpus, "the corpus's own text"
                if corpus.get("source") == "hf":
                    text = {**STAND_IN_TEXT, **{k: corpus[k] for k in ("name", "context_length", "shard_windows",
                                                                      "reserve_train_every") if k in corpus}}
                    what = f"the embedded Shakespeare standing in for {corpus.get('hf_name')} (its reader not counted)"
                budget = int(corpus["tokens_per_half"])
                sizes = [budget] if budget <= PROBE_TOKENS else [PROBE_TOKENS // 2, PROBE_TOKENS]
                with tempfile.TemporaryDirectory() as saved:  # the tokenizer as loaded here, whatever its source
                    try:
                        tok.save_pretrained(saved)
                    except Exception:  # noqa: BLE001 -- a tokenizer that cannot be saved: not measured
                        measured[id(tok)] = None
                        continue
                    got = [_probe(text, saved, m.get("bos_token"), n) for n in sizes]
                measured[id(tok)] = None if None in got else (got, what)
            if measured.get(id(tok)) is None:
                continue
            got, what = measured[id(tok)]
            slope = 0.0
            if len(got) == 2 and got[1]["tokens"] > got[0]["tokens"]:
                slope = max(0.0, (got[1]["mb"] - got[0]["mb"]) / (got[1]["tokens"] - got[0]["tokens"]))
            out[f"{name}/{m['name']}"] = {"mb": got[-1]["mb"] - slope * got[-1]["tokens"], "mb_per_token": slope,
                                          "text": what}
    return out


def corpus_peak_mb(measure: dict | None, tokens: float, fallback: float) -> float:
    """The ``corpus_shards`` job's peak MiB at ``tokens`` (both halves) from its :func:`corpus_memory` entry; the
    ``fallback`` (the tokenizer start-up's memory) where there is none."""
    if not measure:
        return fallback
    return max(fallback, measure["mb"] + measure["mb_per_token"] * tokens)
