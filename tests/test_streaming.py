"""Models larger than memory (issue 58 item 4): a model loaded with ``stream=True`` keeps its blocks' parameters on the
meta device and reads each block's from its sharded safetensors checkpoint just before the block runs. A tiny GPT-2
and a tiny Llama saved sharded (an index json over several files) run the statistics pass, pass 2 and the
substitution streamed and whole: every sum equal bit for bit; at most one block's parameters resident at a time,
counted by hooks of the test's own; a checkpoint of pytorch_model.bin is refused naming the model and what to do."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
import torch
from stats_reference import tracked_for, zipf_windows
from tiny_models import make_tiny_model

from mfpipe.models.adapters import get_adapter
from mfpipe.models.adapters.streaming import Checkpoint, streamer_of
from mfpipe.models.loader import ModelLoadError, load_model
from mfpipe.models.streamed import STREAM_SHARE, safetensors_files, stream_mode, streams

N_WIN, BATCH = 10, 4


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


def _save_sharded(model, folder: Path) -> Path:
    model.save_pretrained(folder, max_shard_size="40KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2  # the multi-file path
    return folder


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def pair(request, tmp_path_factory):
    """(model type, the whole model's adapter, the streamed model's adapter, its streamer, the checkpoint folder)."""
    mt = request.param
    folder = _save_sharded(make_tiny_model(mt, seed=11), tmp_path_factory.mktemp(f"ckpt-{mt}"))
    spec = {"name": f"tiny-{mt}", "source": "local", "path": str(folder)}
    whole, streamed = load_model(spec), load_model(spec, stream=True)
    aw, ast_ = get_adapter(whole), get_adapter(streamed)
    found = streamer_of(ast_.block_module(0))
    assert found is not None and streamer_of(aw.block_module(0)) is None
    return mt, aw, ast_, found[0], folder


class BlockCount:
    """The bytes of block parameters that hold data (not meta), summed over every block at each block's entry and
    exit (hooks of the test's own, registered after the streamer's), and the most seen."""

    def __init__(self, adapter):
        self.blocks = [adapter.block_module(l) for l in range(adapter.n_layers)]
        self.peak = 0
        self.handles = [h for b in self.blocks for h in (b.register_forward_pre_hook(self.count),
                                                          b.register_forward_hook(self.count))]

    def count(self, *args):
        self.peak = max(self.peak, sum(p.numel() * p.element_size() for b in self.blocks for p in b.parameters()
                                       if p.device.type != "meta"))

    def close(self):
        for h in self.handles:
            h.remove()


def _block_bytes(adapter) -> list[int]:
    return [sum(p.numel() * p.element_size() for p in adapter.block_module(l).parameters())
            for l in range(adapter.n_layers)]


def _assert_streamed_within_one_block(adapter, streamer, counter):
    assert counter.peak > 0, "the test's hooks saw no block's weights: nothing ran"
    assert counter.peak <= max(_block_bytes(adapter)), (counter.peak, _block_bytes(adapter))
    assert streamer.peak_bytes <= max(streamer.block_bytes)
    assert streamer.resident_bytes == 0  # no block left resident after the pass
    assert all(p.device.type == "meta" for l in range(adapter.n_layers) for p in adapter.block_module(l).parameters())


def _equal(a, b, where: str):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (np.ndarray, torch.Tensor)) or hasattr(a, "__array__"):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"), f"{where} differs"
    else:
        assert a == b or (a != a and b != b), f"{where}: {a!r} != {b!r}"


# ------------------------------------------------------------------------------------------- the checkpoint
def test_the_checkpoint_reader_equals_safetensors(pair):
    from safetensors.torch import load_file

    *_, folder = pair
    files = safetensors_files(folder)
    ck = Checkpoint(files)
    n = 0
    for f in files:
        for name, t in load_file(f).items():
            got = ck.read(name)
            assert got.dtype == t.dtype and torch.equal(got, t), name
            n += 1
    assert n == len(ck.entries) > 10


def test_resident_parts_and_buffers_equal_the_whole_load(pair):
    mt, aw, ast_, streamer, _ = pair
    blocks = {id(p) for l in range(ast_.n_layers) for p in ast_.block_module(l).parameters()}
    whole = dict(aw.model.named_parameters(remove_duplicate=False))
    outside = [(n, p) for n, p in ast_.model.named_parameters(remove_duplicate=False) if id(p) not in blocks]
    assert outside and {n for n, _ in outside} | {n for n, p in ast_.model.named_parameters(remove_duplicate=False)
                                                   if id(p) in blocks} == set(whole)
    for n, p in outside:
        assert p.device.type == "cpu" and p.dtype == whole[n].dtype and torch.equal(p, whole[n]), n
    bw, bs = dict(aw.model.named_buffers()), dict(ast_.model.named_buffers())
    assert bw.keys() == bs.keys()
    for n in bw:
        assert bw[n].dtype == bs[n].dtype and torch.equal(bw[n], bs[n]), n
    assert aw.structure == ast_.structure  # the probe placed the streamed model as the whole one
    # the blocks' own parameters: read on demand, equal to the whole model's
    for l in range(ast_.n_layers):
        with streamer.hold(l):
            for (n, p), (_, q) in zip(ast_.block_module(l).named_parameters(), aw.block_module(l).named_parameters()):
                assert p.device.type == "cpu" and torch.equal(p, q), (l, n)
    assert streamer.resident_bytes == 0


# --------------------------------------------------------------------------------- the passes, bit for bit
def test_statistics_pass_is_bit_identical_and_holds_one_block(pair, tmp_path):
    from mfpipe.stats import accumulate_shard

    mt, aw, ast_, streamer, _ = pair
    tokens = zipf_windows(N_WIN, seed=4)
    tracked = tracked_for(tokens)
    want = accumulate_shard(aw.model, aw, tokens, tracked, batch_size=BATCH, device="cpu", progress=False)
    streamer.reset_peak()
    reads = streamer.reads
    counter = BlockCount(ast_)
    try:
        got = accumulate_shard(ast_.model, ast_, tokens, tracked, batch_size=BATCH, device="cpu", progress=False)
    finally:
        counter.close()
    _equal(want, got, f"{mt} stats")
    assert len(want) > 5
    # every batch's forward read every block (and the derived sums read each block once more)
    assert streamer.reads - reads >= ast_.n_layers * -(-N_WIN // BATCH)
    _assert_streamed_within_one_block(ast_, streamer, counter)


@pytest.fixture(scope="module")
def store(pair, tmp_path_factory):
    """The statistics half of the whole model (the store pass 2 and the substitution read)."""
    from stats_reference import STORE_META

    from mfpipe.stats import accumulate_shard, finalize, open_stats, write_store

    mt, aw, *_ = pair
    tokens = zipf_windows(24, seed=1)
    tracked = tracked_for(tokens)
    sums = accumulate_shard(aw.model, aw, tokens, tracked, batch_size=8, device="cpu", progress=False)
    path = tmp_path_factory.mktemp(f"store-{mt}") / "stats.zarr"
    return tracked, open_stats(write_store(finalize(sums, tracked, dict(STORE_META, model_type=aw.model_type)), path))


def test_pass2_is_bit_identical_and_holds_one_block(pair, store):
    from mfpipe.deviation import shards as DP

    mt, aw, ast_, streamer, _ = pair
    tracked, st = store
    tokens = zipf_windows(N_WIN, seed=5)
    doc_ids = np.repeat(np.arange(N_WIN)[:, None] // 3, tokens.shape[1], axis=1)
    kw = dict(min_count=1, batch_size=BATCH, progress=False)
    want = DP.deviation_shard(aw.model, aw, tokens, doc_ids, tracked, st, **kw)
    streamer.reset_peak()
    counter = BlockCount(ast_)
    try:
        got = DP.deviation_shard(ast_.model, ast_, tokens, doc_ids, tracked, st, **kw)
    finally:
        counter.close()
    _equal(want[0], got[0], f"{mt} pass-2 sums")
    _equal({k: v for k, v in want[1].items() if k != "seconds"}, {k: v for k, v in got[1].items() if k != "seconds"},
           f"{mt} pass-2 meta")
    _assert_streamed_within_one_block(ast_, streamer, counter)


def test_substitution_is_bit_identical_and_holds_one_block(pair, store):
    from mfpipe.experiments.substitution import substitute as SU
    from mfpipe.meanfield.kernel import kernel_from_store

    mt, aw, ast_, streamer, _ = pair
    tracked, st = store
    kernel = kernel_from_store(st, tracked, min_count=1)
    ev = zipf_windows(6, seed=2)
    want = SU.substitution_pass(aw, kernel, ev, batch_size=BATCH)
    streamer.reset_peak()
    counter = BlockCount(ast_)
    try:
        got = SU.substitution_pass(ast_, kernel, ev, batch_size=BATCH)
    finally:
        counter.close()
    assert want.n_substituted > 5 and abs(want.summary()["delta_L"]) > 1e-6  # the substitution is live
    for f in fields(want):
        _equal(getattr(want, f.name), getattr(got, f.name), f"{mt} substitution.{f.name}")
    _assert_streamed_within_one_block(ast_, streamer, counter)


# ------------------------------------------------------------------------------------ the knob and the errors
def test_a_pytorch_bin_checkpoint_is_refused_naming_the_model_and_the_fix(tmp_path):
    model = make_tiny_model("gpt2", seed=0)
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    spec = {"name": "old-bin", "source": "local", "path": str(tmp_path)}
    with pytest.raises(ModelLoadError) as e:
        load_model(spec, stream=True)
    msg = str(e.value)
    for part in ("'old-bin'", "pytorch_model.bin", "safetensors", "save_pretrained", "runtime.stream_weights: false"):
        assert part in msg, (part, msg)


def test_auto_streams_where_the_weights_would_not_fit(tmp_path, monkeypatch):
    from mfpipe.models import streamed

    assert streams("auto", 79, 100) is False and streams("auto", 81, 100) is True and STREAM_SHARE == 0.8
    assert streams(True, 1, 100) is True and streams("false", 99, 1) is False and streams("never", 99, 1) is False
    assert stream_mode("true") is True and stream_mode(False) is False and stream_mode("AUTO") == "auto"
    with pytest.raises(Exception, match="auto, true or false"):
        stream_mode("sometimes")
    folder = tmp_path / "m"
    model = make_tiny_model("llama", seed=1)
    model.save_pretrained(folder)  # one file, no index: the single-file path
    need = sum(p.numel() * p.element_size() for p in model.parameters())
    spec = {"name": "tiny", "source": "local", "path": str(folder)}
    monkeypatch.setattr(streamed, "memory_available", lambda device=None: int(need / STREAM_SHARE) + 1)
    roomy = get_adapter(load_model(spec, stream="auto"))
    assert streamer_of(roomy.block_module(0)) is None  # fits: loaded whole
    monkeypatch.setattr(streamed, "memory_available", lambda device=None: int(need / STREAM_SHARE) - 1)
    tight = get_adapter(load_model(spec, stream="auto"))
    assert streamer_of(tight.block_module(0)) is not None
    ids = torch.as_tensor(zipf_windows(2, seed=0), dtype=torch.long)
    with torch.no_grad():
        assert torch.equal(roomy.model(ids).logits, tight.model(ids).logits)
    # a job that cannot stream loads whole where the weights fit, and refuses where they do not
    monkeypatch.setattr(streamed, "memory_available", lambda device=None: need)
    assert streamer_of(get_adapter(load_model(spec, stream="never")).block_module(0)) is None
    monkeypatch.setattr(streamed, "memory_available", lambda device=None: need - 1)
    with pytest.raises(ModelLoadError, match="'tiny'.*cannot stream them one block at a time.*more memory"):
        load_model(spec, stream="never")


def test_stream_weights_is_a_schema_default_and_no_rule_param(repo):
    from mfpipe.workflow.config import apply_defaults, load_schema

    schema = load_schema()
    runtime = schema["definitions"]["runtime"] if "runtime" in schema.get("definitions", {}) else \
        schema["properties"]["runtime"]
    assert runtime["properties"]["stream_weights"]["default"] == "auto"
    assert apply_defaults({"runtime": {"dtype": "float32", "device": "cpu", "batch_size": 1}})["runtime"][
        "stream_weights"] == "auto"
    # it changes no result: no rule passes it as a param (a param's change reruns the job); jobs read the config
    rules = list((repo / "workflow" / "rules").glob("*.smk"))
    assert rules and not [r.name for r in rules if "stream_weights" in r.read_text()]


# ------------------------------------------------------------------------------------------ mfpipe estimate
def test_the_estimate_prices_one_block_and_a_read_of_every_block_per_batch(pair):
    """mfpipe.estimate.weights: a streamed model's jobs hold one block (1.5 of a float32 model: the cast's read buffer)
    in place of all, and read every block once per batch at the rate measured on a checkpoint."""
    from mfpipe.estimate.weights import read_rates, stream_fields, stream_line, streamed, weight_reads

    mt, aw, ast_, streamer, folder = pair
    cold, warm = read_rates(folder)
    assert 0 < cold < 1e-3 and 0 < warm < 1e-3  # seconds per byte: something was read, at some MB/s at least
    sizes = streamer.block_bytes
    whole = sum(p.numel() * p.element_size() for p in aw.model.parameters())
    mem = {"peak_mb": {"forward": 900.0, "pass1": 1000.0}, "param_bytes": whole + 2 * sum(sizes)}  # cut from 3x
    config = {"runtime": {"dtype": "float32", "stream_weights": True}}
    f = stream_fields(config, {"name": "m"}, ast_, mem, 1.0, 3.0, (cold, warm), "cpu")
    assert f["streams"] and f["block_bytes"] == max(sizes) and f["blocks_bytes"] == 3 * sum(sizes)
    assert f["stream_saving_mb"] == pytest.approx((3 * sum(sizes) - 1.5 * max(sizes)) / 2**20)
    assert f["resident_param_bytes"] == whole - sum(sizes)
    assert f["blocks_cached"] and f["blocks_read_s"] == pytest.approx(3 * sum(sizes) * warm)
    c = {**mem, **f}
    assert weight_reads(c, 10, 4, 1) == pytest.approx(4 * f["blocks_read_s"])  # 3 batches and one more read
    assert streamed(c, "stats_shard") and streamed(c, "jlens") and not streamed(c, "minisuite_train")
    assert "per backward call for the J-lens's" in stream_line("m", c)
    off = stream_fields({"runtime": {"dtype": "float32", "stream_weights": False}}, {}, ast_, mem, 1.0, 3.0,
                        (cold, warm), "cpu")
    assert not off["streams"] and weight_reads({**mem, **off}, 10, 4) == 0 and stream_line("m", {**mem, **off}) is None
    auto = stream_fields({"runtime": {"dtype": "float32", "stream_weights": "auto"}}, {}, ast_,
                         {**mem, "param_bytes": 1 << 50}, 1.0, 3.0, (cold, warm), "cpu")
    assert auto["streams"]  # a petabyte of weights does not fit this machine


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_streamed_onto_a_gpu_equals_the_whole_model_there(tmp_path):
    """On a GPU the blocks are read onto the device: the logits equal the whole model's there bit for bit (the same
    kernels on the same weights), with one block's parameters resident at a time."""
    folder = _save_sharded(make_tiny_model("llama", seed=2), tmp_path / "ckpt")
    spec = {"name": "tiny-llama", "source": "local", "path": str(folder)}
    whole = get_adapter(load_model(spec, device="cuda"))
    streamed = get_adapter(load_model(spec, device="cuda", stream=True))
    streamer = streamer_of(streamed.block_module(0))[0]
    assert streamed.device.type == "cuda" and all(b.device.type == "cuda" for b in streamed.model.buffers())
    ids = torch.as_tensor(zipf_windows(4, seed=3), dtype=torch.long)
    streamer.reset_peak()
    counter = BlockCount(streamed)
    try:
        got = streamed.run(ids, select=("attn_probs",), logits=True)
    finally:
        counter.close()
    want = whole.run(ids, select=("attn_probs",), logits=True)
    assert torch.equal(want.logits, got.logits)
    _assert_streamed_within_one_block(streamed, streamer, counter)


def test_the_estimate_counts_the_kernel_and_pass2_sums_as_allocated(pair, store):
    """mfpipe.estimate.calibrate.layer_arrays: the arrays the substitution (the kernel W, mu) and pass 2 (its sums
    and Grams) hold whole, counted by formula at full depth, equal the bytes the real ones allocate."""
    from mfpipe.deviation.pass2 import DeviationAccumulator
    from mfpipe.estimate.calibrate import layer_arrays
    from mfpipe.meanfield.deviation import layer_grams
    from mfpipe.meanfield.kernel import kernel_from_store

    mt, aw, *_ = pair
    tracked, st = store
    kernel = kernel_from_store(st, tracked, min_count=1)
    grams = layer_grams(aw)
    top_k = 7
    acc = DeviationAccumulator(kernel.W, kernel.mu, grams, tracked.n, 16, np.zeros(3, dtype=np.int64), "cpu", top_k)
    want = layer_arrays(aw.n_layers, aw.n_heads, tracked.n, aw.d_head, top_k)
    nbytes = lambda *ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    assert want["substitution"] == nbytes(kernel.W, kernel.mu)
    held = {id(t): t for t in vars(acc).values() if isinstance(t, torch.Tensor) and t.numel() > 1}
    held.pop(id(acc.halves))  # the shard's windows' halves: per window, not per layer
    assert acc.W is kernel.W and acc.mu is kernel.mu  # the accumulator holds the kernel itself, no copy
    assert want["pass2"] == nbytes(*held.values()), sorted((k, tuple(t.shape)) for k, t in vars(acc).items()
                                                           if isinstance(t, torch.Tensor))


# ------------------------------------------------------------------------------------------------ the J-lens
def test_the_jlens_streamed_equals_the_whole_model_and_reads_its_blocks_again_in_the_backward(pair, monkeypatch):
    """The J-lens of a streamed model (its graph saves where a block's weights are read from, and each backward call
    reads them again: mfpipe.models.adapters.streaming.saved_from_checkpoint) equals the whole model's bit for bit,
    holds no block after it, and reads every block's weights in its backward calls, not only in its forwards."""
    from mfpipe.jlens.lens import estimate_jlens

    mt, _, ast_, streamer, folder = pair
    # the whole model's weights copied to fresh (aligned) memory as a streamed block's are read: a product of one
    # row (the J-lens's token after its cached prefix) rounds by the weight's address (transformers leaves the
    # safetensors' tensors where the file puts them), so only equally placed weights give equal bits
    aw = get_adapter(load_model({"name": f"tiny-{mt}", "source": "local", "path": str(folder)}))
    with torch.no_grad():
        for p in aw.model.parameters():
            p.data = p.data.clone()
    windows = zipf_windows(4, seed=6)
    kw = dict(n_positions=4, seed=1, batch_size=2, grad_chunk=8, progress=False, check_rows=8)
    want = estimate_jlens(aw, windows, **kw)
    reads: dict[str, int] = {}
    real = Checkpoint.read
    monkeypatch.setattr(Checkpoint, "read", lambda self, name: reads.__setitem__(name, reads.get(name, 0) + 1)
                        or real(self, name))
    blocks = streamer.reads
    got = estimate_jlens(ast_, windows, **kw)
    for k in ("J", "check_split_half", "check_convergence"):
        assert np.array_equal(want[k].values, got[k].values, equal_nan=True), k
    assert streamer.resident_bytes == 0
    forwards = streamer.reads - blocks  # block loads by the forwards' hooks
    weight = next(k for k in reads if k.endswith("weight") and ("mlp" in k or "c_fc" in k))
    # each block's forwards read it once each; its backward calls, d / grad_chunk per position, read it again
    assert reads[weight] > forwards / ast_.n_layers, (weight, reads[weight], forwards)


def test_the_jlens_of_a_streamed_bfloat16_model_equals_its_whole_load(tmp_path):
    """The 16-bit CPU path (mfpipe.models.adapters.backward16: the float32 product's gradient, its weight rebuilt per
    backward) reads a streamed block's weight again in place of keeping it: J equal bit for bit; float32 sums within
    float32 rounding of float64 ones."""
    from mfpipe.jlens.lens import estimate_jlens

    folder = _save_sharded(make_tiny_model("llama", seed=3).to(torch.bfloat16), tmp_path / "bf16")
    spec = {"name": "tiny-bf16", "source": "local", "path": str(folder)}
    whole = get_adapter(load_model(spec, dtype="bfloat16"))
    streamed = get_adapter(load_model(spec, dtype="bfloat16", stream=True))
    with torch.no_grad():  # placed as a streamed block's are (the test above)
        for p in whole.model.parameters():
            p.data = p.data.clone()
    assert whole.dtype == torch.bfloat16 and streamer_of(streamed.block_module(0)) is not None
    windows = zipf_windows(3, seed=2)
    kw = dict(n_positions=3, seed=0, batch_size=3, grad_chunk=64, progress=False, check_rows=None)
    want, got = estimate_jlens(whole, windows, **kw), estimate_jlens(streamed, windows, **kw)
    assert np.array_equal(want["J"].values, got["J"].values, equal_nan=True)
    narrow = estimate_jlens(streamed, windows, **kw, sum_dtype="float32")["J"].values
    ok = np.isfinite(want["J"].values)
    assert np.allclose(narrow[ok], want["J"].values[ok], rtol=1e-5, atol=1e-6)
    assert not np.array_equal(narrow[ok], np.zeros_like(narrow[ok]))


def test_an_address_is_read_again_only_while_the_parameter_loaded_there_lives(pair):
    """mfpipe.models.adapters.streaming.source_of: a parameter gone without its block's release (a dropped model's
    resident parts) leaves its address to other tensors; one there is not taken for it (a stale entry made the J-lens
    of one model read another's weights in its backward when the allocator reused a freed address)."""
    from mfpipe.models.adapters.streaming import source_of

    _, _, _, streamer, _ = pair
    owner, attr, key, placeholder = streamer.slots[0][0]
    streamer.acquire(0)
    try:
        param = owner._parameters[attr]
        assert source_of(param)[1] == key  # live: read again from where it was loaded
        other = param.detach()  # another tensor on the same memory, which outlives the parameter
        owner._parameters[attr] = placeholder
        del param
        assert source_of(other) is None
    finally:
        streamer.release(0)
