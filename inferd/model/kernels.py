"""CPU kernels of our own, compiled on the machine that runs them.

``torch.utils.cpp_extension`` builds ``csrc/*.cpp`` into one module with ``-O3 -march=native -ffast-math`` the first
time an engine starts on a machine (about a minute on two idle cores, longer on a busy machine; it needs a C++
compiler and ninja) into
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
_CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
_SOURCES = [os.path.join(_CSRC, f)
            for f in ("module.cpp", "paged_attention.cpp", "panel_gemm.cpp", "fused_ops.cpp", "decode_stack.cpp")]
_HEADERS = [os.path.join(_CSRC, f) for f in ("ops.h", "vec.h")]
# -fopenmp: at::parallel_for is OpenMP pragmas in ATen's headers, so without it the kernels run on one thread.
# The module then needs libgomp.so.1, which resolves to the copy torch has already loaded (one thread pool).
_CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp"]


def _working_in(path: str) -> list[int]:
    """Pids of the other processes whose working directory is ``path`` (ninja runs the compiler there, and the
    compiler processes inherit it); [] where /proc cannot tell."""
    pids = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if os.readlink(f"/proc/{entry}/cwd") == path:
                    pids.append(int(entry))
            except OSError:
                pass
    return pids


def build_once(build_dir: str, build: Callable[[], object], poll_s: float = 0.5) -> object:
    """``build()`` while this process holds an exclusive ``flock`` on ``build_dir + ".flock"``: processes that
    start together build ``build_dir`` one at a time (the others log that they wait), and the kernel releases the
    lock when its holder exits, however it ends.

    torch's ``load()`` keeps its own lock file, ``build_dir/lock``, and waits without end while that file exists;
    a build killed part way (a server stopped during its first start) leaves it behind, so every later start
    would wait forever. A ``lock`` found while holding the flock was left by a process that has died. Its ninja
    and compiler processes can outlive it (``kill -9`` of the server alone leaves them running), so this waits
    until no process works in ``build_dir`` any more, then removes the file and builds.

    Returns what ``build()`` returns; its exceptions propagate. Raises OSError where the lock file cannot be
    created.
    """
    import fcntl
    import time

    os.makedirs(build_dir, exist_ok=True)
    with open(build_dir + ".flock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process's build of inferd's CPU kernels in %s", build_dir)
            fcntl.flock(lock, fcntl.LOCK_EX)
        leftover = os.path.join(build_dir, "lock")
        if os.path.exists(leftover):
            real = os.path.realpath(build_dir)
            if _working_in(real):
                logger.warning("waiting for the compiler processes of an unfinished build in %s to exit", build_dir)
                while _working_in(real):
                    time.sleep(poll_s)
            logger.warning("removing %s, left by a build of inferd's CPU kernels that did not finish", leftover)
            os.remove(leftover)
        return build()


@functools.cache
def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return "".join(line for line in f if line.startswith(("model name", "flags")))
    except OSError:
        return platform.processor()


@functools.cache
def _module():
    """The compiled module (csrc/module.cpp and the kernels it binds), built on first use; None where it cannot
    be built or ``INFERD_CPU_KERNELS=0``."""
    if os.environ.get("INFERD_CPU_KERNELS", "1") == "0":
        return None
    digest = hashlib.sha256(torch.__version__.encode() + " ".join(_CFLAGS).encode() + _cpu_id().encode())
    for path in _SOURCES + _HEADERS:
        with open(path, "rb") as f:
            digest.update(f.read())
    name = f"inferd_cpu_kernels_{digest.hexdigest()[:16]}"
    build_dir = os.path.join(cache_dir("extensions"), name)
    built = os.path.join(build_dir, f"{name}.so")
    if os.path.exists(built):  # the name is the key: load it directly (torch's load() re-runs ninja, ~0.4 s)
        try:
            return _import_module(name, built)
        except (ImportError, OSError):
            pass  # a build still being written by another process, or damaged: load() below waits or rebuilds
    try:
        from torch.utils.cpp_extension import load

        def build():
            if os.path.exists(built):  # another process built it while this one waited
                try:
                    return _import_module(name, built)
                except (ImportError, OSError):
                    pass
            logger.info("building inferd's CPU kernels (once per machine and kernel version, about a minute)")
            return load(name=name, sources=_SOURCES, extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"],
                        build_directory=build_dir, verbose=False)

        return build_once(build_dir, build)
    except Exception as e:  # no compiler, no ninja, no Python headers: the torch path serves instead
        logger.warning("inferd's CPU kernels unavailable, using torch's operators instead: %s",
                       str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__)
        return None


@functools.cache
def paged_attention_kernel() -> Callable | None:
    """The compiled ``paged_attention(q, k_cache, v_cache, block_tables, seq_idx, context_lens, scale)``
    (inferd/model/csrc/paged_attention.cpp); None where the kernels cannot be built or ``INFERD_CPU_KERNELS=0``
    (attention then gathers the KV blocks for torch's SDPA).

    The kernel: q [T, Hq, D] and caches [Hkv, num_blocks, block_size, D] contiguous, one dtype (float32 or
    bfloat16); block_tables [S, max_blocks] int64; seq_idx [T] int64 (each query row's row of block_tables);
    context_lens [T] int64 (the keys each row sees, its position + 1, 1 to max_blocks * block_size) -> [T, Hq, D].
    Raises RuntimeError on shapes, indices, lengths or block ids outside those (nothing is read outside the cache).
    """
    module = _module()
    return module.paged_attention if module is not None else None


def paged_attention_fits(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the compiled attention kernel (and the decoder stack, which calls it) takes these head shapes: a head
    dimension that is a multiple of 8 and at most 256, and at most 16 query heads per KV head (its
    ``TORCH_CHECK``s in csrc/paged_attention.cpp and csrc/decode_stack.cpp). Other models attend through torch's
    SDPA."""
    return (head_dim % 8 == 0 and 0 < head_dim <= 256 and num_kv_heads > 0 and num_heads % num_kv_heads == 0
            and num_heads // num_kv_heads <= 16)


@functools.cache
def panel_linear_kernel() -> Callable | None:
    """The compiled ``panel_linear(x, w_packed, n, bias, out_fp32)`` (inferd/model/csrc/panel_gemm.cpp) where it is
    the CPU's fast GEMM for BF16 and FP32 weights: on an x86 CPU with AVX2 and FMA where oneDNN's BF16 GEMM does not
    serve (:func:`onednn_bf16_gemm`). None elsewhere, or where the kernels cannot be built.

    The kernel: x [M, K] float32 or bfloat16; w_packed the weight's panels (:func:`pack_panels_kernel`:
    [ceil(N / 16), K / 2, 16, 2] or [ceil(N / 16), K, 8, 2] bfloat16, [ceil(N / 16), K, 2, 8] float32); bias [N] or
    None -> [M, N] float32 if ``out_fp32`` (always, with FP32 weights) else bfloat16. Each output element is one
    chain over K in order in FP32 (FMAs; on pair panels ``vdpbf16ps`` over the k-pairs in order, which takes x in
    BF16, or AMX's ``tdpbf16ps`` 16 k-pairs a step where the module's ``amx`` is true), so a row's bits do not depend
    on the batch. Raises RuntimeError on shapes that do not match.
    """
    if not _has_avx2_fma() or onednn_bf16_gemm():
        return None
    module = _module()
    return module.panel_linear if module is not None else None


def pack_panels_kernel() -> Callable | None:
    """The compiled ``pack_panels(w, out=None, pairs=None)`` (inferd/model/csrc/panel_gemm.cpp): w [N, K] -> the
    layout of :func:`panel_linear_kernel`'s weight, in one parallel pass, zero past N: bfloat16 in pairs of k (where
    :func:`bf16_pair_panels` and K is even, unless ``pairs`` is False) [ceil(N / 16), K / 2, 16, 2] with ``[p, kk,
    j, t] = w[16 p + j, 2 kk + t]``, else interleaved [ceil(N / 16), K, 8, 2] with ``[p, k, j, h] = w[16 p + 8 h +
    j, k]``; float32 [ceil(N / 16), K, 2, 8] with ``[p, k, h, j] = w[16 p + 8 h + j, k]``; written into ``out`` (a
    contiguous tensor of that shape and dtype) where given. Raises RuntimeError on an ``out`` that does not fit, or
    ``pairs=True`` where the layout cannot be (FP32, an odd K, a build without AVX512-BF16). None where the kernels
    cannot be built.
    """
    module = _module()
    return module.pack_panels if module is not None else None


@functools.cache
def fused_ops():
    """The compiled element-wise ops of a decoder layer (inferd/model/csrc/fused_ops.cpp), or None where the kernels
    cannot be built or ``INFERD_CPU_KERNELS=0``:

    - ``add_rms_norm(h, delta, weight, eps)``: h [T, hidden] FP32 updated in place to ``h + delta`` (delta None,
      FP32 or the weight's dtype), returns RMSNorm(h) * weight [T, hidden] in the weight's dtype;
    - ``silu_mul(gate_up)``: [T, 2 I] -> SiLU(gate) * up [T, I];
    - ``panel_linear_silu(x, w_packed, inter)``: x [T, K] and a fused [2 I, K] gate_up weight in panels ->
      SiLU(gate) * up [T, I] BF16, the bits of ``panel_linear`` then ``silu_mul``, in one pass on AMX (K a multiple
      of 32, I of 16), without writing gate_up to memory;
    - ``argmax_rows(logits)``: [S, V] FP32 -> [S] int64, what ``logits.argmax(dim=-1)`` gives (the first of equal
      maxima, the first NaN of a row that has one);
    - ``nucleus_floor(probs, top_p)``: probs [S, V] FP32 and top_p [S] FP32 -> [S, 1] FP32, each row's top-p
      floor (the probability of the least likely token of its nucleus; 0 for a row with a NaN), by a radix select
      on the mass (two to four passes over the row, where a sort is O(V log V));
    - ``sample_probs(probs, top_p, min_p, u)``: probs [S, V] FP32, top_p and min_p [S] FP32, u [S] FP64 in [0, 1) ->
      [S] int64, one token per row by inverse transform sampling over the tokens kept by the top-p and min-p floors;
    - ``rope_and_cache(qkv, cos, sin, k_cache, v_cache, slots, num_heads, num_kv)``: rotates the query and key
      heads of the fused QKV output [>= T, (Hq + 2 Hkv) D] by cos, sin [T, D], writes K and V to the cache
      [Hkv, num_blocks, block_size, D] at the flat slots [T], returns the queries [T, Hq, D].

    Each replaces 3-12 torch operators of a few microseconds each (docs/performance.md). Raises RuntimeError on
    shapes, dtypes or slots that do not match.
    """
    return _module()


def reset() -> None:
    """Forget the loaded kernels, so that the next use reads ``INFERD_CPU_KERNELS`` again (for tests)."""
    for f in (_module, paged_attention_kernel, panel_linear_kernel, fused_ops, onednn_bf16_gemm):
        f.cache_clear()


def _has_avx2_fma() -> bool:
    flags = _cpu_id().split()
    return "avx2" in flags and "fma" in flags


def _has_amx() -> bool:
    return "amx_bf16" in _cpu_id().split()


def amx_tiles() -> bool:
    """Whether this process multiplies BF16 pair panels on AMX tiles: the compiled module is built with AMX
    (Sapphire Rapids and later), Linux granted the tile state and ``INFERD_AMX`` is not 0."""
    module = _module()
    return module is not None and bool(getattr(module, "amx", False))


def bf16_pair_panels() -> bool:
    """Whether BF16 weights of an even K are packed in pairs of k for the AVX512-BF16 micro-kernel (vdpbf16ps): the
    compiled module's answer (its -march=native build has AVX512-BF16), or the CPU's flags where it is not built (the
    torch fallback of :func:`inferd.model.layers.pack_panels` packs the same layout)."""
    module = _module()
    if module is not None:
        return bool(module.bf16_pairs)
    flags = _cpu_id().split()
    return all(f in flags for f in ("avx512f", "avx512bw", "avx512dq", "avx512_bf16"))


@functools.cache
def onednn_bf16_gemm() -> bool:
    """Whether BF16 weights are packed for oneDNN's GEMM (``torch.ops.mkldnn``) rather than inferd's panels: where
    the CPU has native BF16 matmul and inferd's kernels cannot serve it well: none built, no AVX2, or AMX that the
    module does not use (``INFERD_AMX=0``, or Linux refused the tile state: oneDNN's AMX kernels beat the vdpbf16ps
    panels from 32 rows and in prefill there). On AMD Zen 5 (AVX512-BF16, no AMX) inferd's pair panels and the
    decoder stack measured faster than oneDNN at every batch size and in prefill (docs/performance.md, stop 24); on
    Sapphire Rapids the panels on AMX tiles and the stack did too (stop 28). Not measured: Zen 4 and Cooper Lake
    (pair panels too), and Intel's AVX-512 CPUs without BF16 (Skylake-SP to Ice Lake, where torch counts oneDNN's
    emulated BF16 as native), which get the AVX2 panels and the stack instead of oneDNN."""
    if not native_bf16_matmul():
        return False
    module = _module()
    return module is None or not _has_avx2_fma() or (_has_amx() and not getattr(module, "amx", False))


@functools.cache
def native_bf16_matmul() -> bool:
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def _import_module(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
