"""What a model's weights cost a job where they are streamed one block at a time (``runtime.stream_weights``,
:mod:`mfpipe.models.streamed`): memory for one block beside the resident embedding, final norm and LM head instead of
all of them, and a read of every block's weights per batch, at the rate the calibration measures on a checkpoint it
wrote (:func:`read_rates`: the disk's where the blocks cannot stay in the page cache, the cache's where they can).

The streamed jobs: every job that loads a model (:data:`STREAMING_RULES`), except the mini suite's training. Their
weight reads are priced for the corpus passes (:func:`weight_reads`: the statistics pass, pass 2, the substitution)
and the J-lens (its backward passes read every block again per call: ``mfpipe.estimate.prompts.jlens``); the other
streamed jobs' are not, and :func:`stream_line` says so.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

__all__ = ["NOT_STREAMED", "STARTUP_READS", "read_rates", "stream_fields", "stream_line", "streamed", "weight_reads"]

NOT_STREAMED = {"minisuite_train": "it trains"}
# the structural probe of a streamed model's load runs two forwards (mfpipe.models.adapters.probe): two reads of
# every block at a job's start
STARTUP_READS = 2
READ_MAX = 1 << 29  # the read rate is timed on the checkpoint's tensors up to this size


def read_rates(folder: str | Path) -> tuple[float, float]:
    """(cold, warm) seconds per byte of reading a checkpoint folder's tensors as a streamed model reads its blocks
    (:class:`~mfpipe.models.adapters.streaming.Checkpoint`): cold with the files' pages dropped from the page cache
    first (``posix_fadvise`` DONTNEED after an fsync: the disk's rate), warm straight after (the page cache's)."""
    from mfpipe.models.adapters.streaming import Checkpoint
    from mfpipe.models.streamed import safetensors_files

    files = safetensors_files(folder)
    ck = Checkpoint(files)
    # a block's tensors (a cut model's embedding and LM head, GiBs each, would only add to the calibration's peak)
    names = [n for n, e in ck.entries.items() if e[4] - e[3] <= READ_MAX] or list(ck.entries)
    nbytes = sum(ck.entries[n][4] - ck.entries[n][3] for n in names)
    out = []
    for cold in (True, False):
        if cold and hasattr(os, "posix_fadvise"):
            for f in files:
                fd = os.open(f, os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
        t0 = time.perf_counter()
        for name in names:
            ck.read(name)
        out.append((time.perf_counter() - t0) / max(nbytes, 1))
    return out[0], out[1]


def stream_fields(config: dict, spec: dict, adapter, mem: dict, width: float, scale: float, rates,
                  device: str) -> dict:
    """The calibration's streaming fields of model ``spec``: whether its jobs stream (``runtime.stream_weights``
    against this machine's memory, as a job decides against what it finds available), its largest block's and all its
    blocks' bytes at full depth (the ``adapter``'s blocks times ``width``, the depth run times ``scale``), the seconds
    to read them all once (at the cold rate of ``rates`` where they cannot stay in the page cache beside the job, else
    the warm one), and the MiB a streamed job's peak is below a whole one's: all blocks less the one resident
    (``mem``: the calibration's memory fields; a float32 model of a 16-bit checkpoint also holds the read buffer of
    the block it casts: counted)."""
    import psutil

    from mfpipe.models.streamed import streams

    sizes = [sum(p.numel() * p.element_size() for p in adapter.block_module(l).parameters()) * width
             for l in range(adapter.n_layers)]
    block, blocks = max(sizes), sum(sizes) * scale
    host = psutil.virtual_memory().total
    if device.startswith("cuda"):
        import torch

        host = min(host, torch.cuda.get_device_properties(0).total_memory)
    mode = (config.get("runtime") or {}).get("stream_weights", "auto")
    dtype = str(spec.get("dtype") or config["runtime"]["dtype"])
    saving = (blocks - block * (1.5 if dtype == "float32" else 1.0)) / 2**20
    cached = blocks <= host - (max(mem["peak_mb"].values()) - saving) * 2**20  # the page cache keeps every block
    return {"stream_mode": str(mode).lower(), "streams": bool(streams(mode, mem["param_bytes"], host)),
            "block_bytes": float(block), "blocks_bytes": float(blocks),
            "resident_param_bytes": float(mem["param_bytes"] - blocks), "read_cold_s_per_byte": rates[0],
            "read_warm_s_per_byte": rates[1], "blocks_cached": bool(cached),
            "blocks_read_s": blocks * (rates[1] if cached else rates[0]), "stream_saving_mb": saving}


def streamed(c: dict | None, rule: str) -> bool:
    """Whether the job of ``rule`` streams its model's weights (calibration ``c``)."""
    return bool(c and c.get("streams")) and rule not in NOT_STREAMED


def weight_reads(c: dict | None, windows: float, batch: int, extra: float = 0.0) -> float:
    """Seconds a streamed corpus pass spends reading its blocks: once per batch of ``batch`` of its ``windows`` and
    ``extra`` times more (what it reads outside its forwards); 0 where its model loads whole."""
    if not (c and c.get("streams")):
        return 0.0
    return (math.ceil(windows / max(int(batch), 1)) + extra) * c["blocks_read_s"]


def stream_line(name: str, c: dict) -> str | None:
    """The estimate's line on a streamed model, or None where its jobs load it whole."""
    if not c.get("streams"):
        return None
    where = "the page cache" if c["blocks_cached"] else "disk"
    rate = c["blocks_bytes"] / max(c["blocks_read_s"], 1e-12) / 1e9
    why = "runtime.stream_weights: true" if c["stream_mode"] == "true" else \
        f"{c['param_bytes'] / 2**30:.1f} GiB of weights, over 80 % of this machine's memory"
    return (f"{name}: weights streamed one block at a time ({why}): its jobs hold one block "
            f"({c['block_bytes'] / 2**30:.2f} GiB) beside the embedding, final norm and LM head "
            f"({c['resident_param_bytes'] / 2**30:.2f} GiB) and read its {c['blocks_bytes'] / 2**30:.1f} GiB of blocks "
            f"per batch from {where} at {rate:.2f} GB/s ({c['blocks_read_s']:.1f} s a batch, priced for the "
            "statistics, pass-2 and substitution jobs, and per backward call for the J-lens's: a larger "
            "runtime.batch_size, jlens.grad_chunk amortizes it; the other jobs' reads are not priced)")
