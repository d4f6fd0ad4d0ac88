"""Pinned CPU numerics: the same bits from a CPU run whatever code paths the machine would pick by itself (issue 42;
measured on AMD EPYC machines only, and aimed at every x86-64 CPU with AVX2), and the record of the numerics a result
ran under (its provenance).

What changes a CPU run's bits (measured on torch 2.13 CPU, MKL 2024.2, an AVX-512 machine; benchmarks/HISTORY.md,
"Issue 42"): ATen's kernel set (``ATEN_CPU_CAPABILITY``, default the best the CPU has: softmax, layer norm, sums and
``normal_`` differ between ``default``, ``avx2`` and ``avx512``); MKL's GEMM code branch (``MKL_CBWR``, default
picked per CPU: ``COMPATIBLE`` is the one branch Intel documents as the same on every CPU; ``AVX2`` falls back to
``AUTO`` on non-Intel CPUs); oneDNN, which picks its own code per CPU (NeoX's erf GELU); the thread count (ATen
splits reductions, e.g. a LayerNorm weight's gradient, across threads). NumPy and its OpenBLAS dispatch per CPU too
(``NPY_DISABLE_CPU_FEATURES``, ``OPENBLAS_CORETYPE``), and numba compiles pass 1's loops for the host CPU
(``NUMBA_CPU_NAME``).

The environment variables take effect when each library first reads them (ATen at its first kernel, MKL at its
first call, NumPy at import, OpenBLAS at load), so :func:`pin_env` runs before those: the workflow puts
:func:`pinned_env` into the environment of every job it starts (workflow/rules/common.smk) and the job runner pins
again before it imports anything. :func:`pin_torch` turns oneDNN off, which torch reads per call. Training also
fixes the thread count (:func:`pinned`); a forward pass's bits do not depend on it (measured)."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import platform
import re
import sys

log = logging.getLogger(__name__)

# What a pinned process runs on (an x86-64 CPU with AVX2 and FMA; elsewhere only MKL's branch, which is harmless)
ATEN_CAPABILITY = "avx2"
MKL_BRANCH = "COMPATIBLE"
# NumPy's dispatch groups above AVX2 (NumPy 2.x x86-64 wheels: baseline X86_V2, dispatch X86_V3, X86_V4 and the
# AVX-512 generations); names a build does not know are ignored
NUMPY_DISABLED = "X86_V4 AVX512_SKX AVX512_CLX AVX512_CNL AVX512_ICL AVX512_SPR"
OPENBLAS_CORE = "Haswell"
# numba compiles pass 1's loops for the CPU it runs on; the norm's row moments may add in any order (fastmath), so
# the vector width of the CPU would set the order
NUMBA_CPU = "haswell"
# training's thread count: one, so that two trainings run side by side on two cores
TRAIN_THREADS = 1
# MFPIPE_NUMERICS=native in the environment of the workflow (or of a process using the library) leaves every library
# its own code paths: faster (MKL's portable branch costs most on large matrix multiplies), the same bits only on
# the same machine. The stores then record `pinned: false`. A switch of mode does not rerun existing outputs.
MODE_ENV = "MFPIPE_NUMERICS"


def native() -> bool:
    """Whether this process was asked to run on the machine's own code paths (``MFPIPE_NUMERICS=native``)."""
    mode = os.environ.get(MODE_ENV, "pinned").strip().lower()
    if mode not in ("pinned", "native"):
        raise ValueError(f"{MODE_ENV}={os.environ[MODE_ENV]!r}: use 'pinned' (the default) or 'native'")
    return mode == "native"

# mkl_cbwr.h: MKL_CBWR_BRANCH and the branch codes
_CBWR_BRANCH = 1
_CBWR_NAMES = {1: "OFF", 2: "AUTO", 3: "COMPATIBLE", 4: "SSE2", 6: "SSSE3", 7: "SSE4_1", 8: "SSE4_2", 9: "AVX",
               10: "AVX2", 11: "AVX512_MIC", 12: "AVX512", 13: "AVX512_MIC_E1", 14: "AVX512_E1"}


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def has_avx2() -> bool:
    """Whether this is an x86-64 CPU with AVX2 and FMA (read from /proc/cpuinfo: False where it cannot be read)."""
    return platform.machine().lower() in ("x86_64", "amd64") and {"avx2", "fma"} <= _cpu_flags()


def pinned_env() -> dict[str, str]:
    """The environment variables of pinned numerics on this machine (none where :func:`native`)."""
    if native():
        return {}
    env = {"MKL_CBWR": MKL_BRANCH}
    if has_avx2():
        env.update({"ATEN_CPU_CAPABILITY": ATEN_CAPABILITY, "NPY_DISABLE_CPU_FEATURES": NUMPY_DISABLED,
                    "OPENBLAS_CORETYPE": OPENBLAS_CORE, "NUMBA_CPU_NAME": NUMBA_CPU})
    return env


def pin_env() -> dict[str, str]:
    """Put :func:`pinned_env` into ``os.environ`` (effective for libraries that have not read it yet, and for every
    process started from here). Returns what it set."""
    env = pinned_env()
    os.environ.update(env)
    return env


def pin_torch(threads: int | None = None) -> list[str]:
    """Turn oneDNN off (torch reads the flag per call) and, given ``threads``, fix torch's thread count. Returns
    what differs from pinned numerics (:func:`pinned_problems`), which a caller logs."""
    import torch

    if not native():
        torch.backends.mkldnn.enabled = False
    if threads is not None:
        torch.set_num_threads(int(threads))
    return pinned_problems()


def _torch_lib():
    import torch

    return ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))


def mkl_branch() -> str | None:
    """The code branch MKL runs (``OFF``: none pinned, results depend on the CPU), or None where torch has no MKL."""
    import torch

    if not torch.backends.mkl.is_available():
        return None
    try:
        get = _torch_lib().mkl_serv_cbwr_get
    except (OSError, AttributeError):
        return None
    get.argtypes, get.restype = [ctypes.c_int], ctypes.c_int
    v = get(_CBWR_BRANCH)
    return _CBWR_NAMES.get(v, str(v))


def pinned_problems() -> list[str]:
    """What in this process differs from pinned numerics (empty: pinned). The thread count is the caller's."""
    import torch

    if native():
        return ["MFPIPE_NUMERICS=native"]
    out = []
    env = pinned_env()
    cap = torch.backends.cpu.get_cpu_capability()
    if "ATEN_CPU_CAPABILITY" in env and cap != ATEN_CAPABILITY.upper():
        out.append(f"ATen runs its {cap} kernels, not {ATEN_CAPABILITY.upper()}")
    branch = mkl_branch()
    if branch is not None and branch != MKL_BRANCH:
        out.append(f"MKL runs its {branch} branch, not {MKL_BRANCH}")
    if torch.backends.mkldnn.enabled:
        out.append("oneDNN is on")
    numpy_v4 = _numpy_simd().get("X86_V4")
    if "NPY_DISABLE_CPU_FEATURES" in env and numpy_v4:
        out.append("NumPy runs its AVX-512 loops")
    return out


def _numpy_simd() -> dict[str, bool]:
    if "numpy" not in sys.modules:
        return {}
    try:
        from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__
    except ImportError:  # NumPy < 2
        return {}
    return {k: bool(__cpu_features__.get(k)) for k in __cpu_dispatch__}


def numerics_info() -> dict:
    """The numerics in force in this process, for a result's provenance: torch's version, ATen's CPU kernels, the
    BLAS and its branch, oneDNN, torch's threads, NumPy's dispatch, and whether all of it is pinned. Only settings in
    force, no machine names: two runs on one machine under different environments record the same when pinned."""
    import torch

    cfg = torch.__config__.show()
    mkl = re.search(r"Math Kernel Library Version (\S+)", cfg)
    blas = re.search(r"BLAS_INFO=(\w+)", cfg)
    simd = _numpy_simd()
    info = {
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "blas": blas.group(1) if blas else None,
        "mkl": mkl.group(1) if mkl else None,
        "mkl_branch": mkl_branch(),
        "onednn": bool(torch.backends.mkldnn.enabled),
        "threads": int(torch.get_num_threads()),
        "numpy_simd": ",".join(k for k, on in simd.items() if on) or None,
        "openblas_core": os.environ.get("OPENBLAS_CORETYPE"),
        "numba_cpu": os.environ.get("NUMBA_CPU_NAME"),
        "pinned": not pinned_problems(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # a GPU run: its kernels are the device's
        info.update({"cuda": torch.version.cuda, "device": torch.cuda.get_device_name(),
                     "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32)})
    return info


@contextlib.contextmanager
def pinned(threads: int = TRAIN_THREADS, strict: bool = False):
    """Run the block on pinned numerics with ``threads`` torch threads (the thread count, oneDNN and the environment
    variables restored afterwards: processes started later get the caller's environment). :func:`pin_env` takes
    effect only where torch has run no kernel and MKL no call yet in this process: otherwise a warning (or
    RuntimeError when ``strict``) says what is not pinned. Yields :func:`numerics_info`."""
    saved = {k: os.environ.get(k) for k in pinned_env()}
    pin_env()
    import torch

    prev, prev_onednn = torch.get_num_threads(), torch.backends.mkldnn.enabled
    problems = pin_torch(threads)
    if problems and not native():
        msg = ("numerics not pinned (" + "; ".join(problems) + "): the results may differ between machines; set "
               + " ".join(f"{k}={v}" for k, v in pinned_env().items()) + " before the process starts")
        if strict:
            raise RuntimeError(msg)
        log.warning(msg)
    try:
        yield numerics_info()
    finally:
        torch.set_num_threads(prev)
        torch.backends.mkldnn.enabled = prev_onednn
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
