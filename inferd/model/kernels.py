"""CPU kernels of our own, compiled on the machine that runs them.

``torch.utils.cpp_extension`` builds ``csrc/*.cpp`` with ``-O3 -march=native -ffast-math`` the first time an
engine starts on a machine (about 30 s on two cores; it needs a C++ compiler and ninja) into
``~/.cache/inferd/extensions`` (``INFERD_CACHE_DIR``), keyed by the source, the torch version and the CPU, and
loads the cached build afterwards. Where the build is not possible the engine logs why and uses the plain torch
path instead; ``INFERD_CPU_KERNELS=0`` turns the kernels off.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import platform
from typing import Callable

import torch

from inferd.cache import cache_dir

logger = logging.getLogger("inferd.kernels")
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "paged_decode_attention.cpp")
_CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only"]


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return "".join(line for line in f if line.startswith(("model name", "flags")))
    except OSError:
        return platform.processor()


@functools.cache
def paged_decode_attention_kernel() -> Callable | None:
    """The compiled ``paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)``
    (inferd/model/csrc/paged_decode_attention.cpp), built on first use; None where it cannot be built or
    ``INFERD_CPU_KERNELS=0``.

    The kernel: q [b, Hq, D] and caches [Hkv, num_blocks, block_size, D] contiguous, one dtype (float32 or
    bfloat16); block_tables [b, max_blocks] int64; context_lens [b] int64 (tokens, 1 to max_blocks *
    block_size) -> [b, Hq, D]. Raises RuntimeError on shapes, lengths or block ids outside those (nothing is
    read outside the cache).
    """
    if os.environ.get("INFERD_CPU_KERNELS", "1") == "0":
        return None
    with open(_SOURCE, "rb") as f:
        source = f.read()
    key = hashlib.sha256(source + torch.__version__.encode() + " ".join(_CFLAGS).encode()
                         + _cpu_id().encode()).hexdigest()[:16]
    name = f"inferd_paged_decode_{key}"
    build_dir = os.path.join(cache_dir("extensions"), name)
    built = os.path.join(build_dir, f"{name}.so")
    if os.path.exists(built):  # the name is the key: load it directly (torch's load() re-runs ninja, ~0.4 s)
        try:
            return _import_module(name, built).paged_decode_attention
        except (ImportError, OSError):
            pass  # a build still being written by another process, or damaged: load() below waits or rebuilds
    try:
        from torch.utils.cpp_extension import load

        os.makedirs(build_dir, exist_ok=True)
        logger.info("building the CPU decode attention kernel (once per machine, about 30 s)")
        module = load(name=name, sources=[_SOURCE], extra_cflags=_CFLAGS, build_directory=build_dir, verbose=False)
    except Exception as e:  # no compiler, no ninja, no Python headers: the torch path serves instead
        logger.warning("CPU decode attention kernel unavailable, using gather + SDPA instead: %s",
                       str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__)
        return None
    return module.paged_decode_attention


def _import_module(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
