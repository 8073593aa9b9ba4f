"""inferd's compiled CPU kernels: the paged attention kernel (inferd/model/csrc/paged_attention.cpp), decode and
prefill rows, against the torch path it replaces (gather the sequence's KV blocks, then
scaled_dot_product_attention) and an FP64 reference, the GEMM for BF16 and FP32 weights on AVX2 CPUs
(inferd/model/csrc/panel_gemm.cpp) against an FP64 reference, and the fused element-wise ops and argmax
(inferd/model/csrc/fused_ops.cpp) against torch."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from inferd.model.attention import attention_bias, decode_attention, gather_blocks
from inferd.model.kernels import paged_attention_kernel

paged_attention = paged_attention_kernel()


def _toolchain() -> bool:
    """A C++ compiler and ninja, as torch.utils.cpp_extension needs them to build the kernels."""
    from torch.utils.cpp_extension import is_ninja_available

    return shutil.which(os.environ.get("CXX", "c++")) is not None and is_ninja_available()


# Skipped only where the kernels cannot be built; where they can and the build fails, every test here fails.
pytestmark = pytest.mark.skipif(
    paged_attention is None and (os.environ.get("INFERD_CPU_KERNELS") == "0" or not _toolchain()),
    reason="kernels off, or no C++ toolchain here: the engine uses gather + SDPA")


def test_kernels_are_built():
    """Where they can be built, they are (first in this file: the reason, before the other tests' errors), with the
    AVX512-BF16 GEMM micro-kernel exactly where the CPU has AVX512-BF16 and the compiler's -march=native enables it."""
    import subprocess

    from inferd.model import kernels

    assert paged_attention is not None, "inferd's CPU kernels failed to build: see the 'inferd.kernels' warning"
    flags = kernels._cpu_id().split()
    macros = subprocess.run(["c++", "-march=native", "-dM", "-E", "-x", "c++", "/dev/null"], capture_output=True,
                            text=True).stdout
    expected = all(f in flags for f in ("avx512f", "avx512bw", "avx512dq", "avx512_bf16")) and "__AVX512BF16__" in macros
    assert kernels._module().bf16_pairs == expected
    assert kernels.bf16_pair_panels() == expected
    # AMX tiles for the pair panels where the CPU and the build have them (Linux grants the tile state on 5.16+).
    amx = expected and "amx_bf16" in flags and "__AMX_BF16__" in macros and os.environ.get("INFERD_AMX") != "0"
    assert kernels._module().amx == amx


def test_a_build_killed_part_way_does_not_stop_the_next(tmp_path):
    """A process killed while it builds the kernels (inside torch's load(), which has written its lock file) leaves
    that file behind, and its compiler running; the next process waits for the compiler to exit, then builds
    instead of waiting on the file forever, and processes that start together build one at a time
    (kernels.build_once: an flock that the kernel releases when its holder dies)."""
    import signal
    import subprocess
    import sys
    import threading
    import time

    from inferd.model.kernels import build_once

    build_dir = str(tmp_path / "inferd_cpu_kernels_x")
    started = tmp_path / "started"
    # The builder writes torch's lock file, then starts a "compiler" in the build folder that outlives it by ~2 s
    # (ninja's children survive a kill -9 of the server alone).
    code = ("import os, subprocess, sys, time; from inferd.model.kernels import build_once; d, started = sys.argv[1:3]\n"
            "def build():\n"
            "    open(os.path.join(d, 'lock'), 'w').close()  # as torch's load() does before it compiles\n"
            "    subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(3); open(\"compiled\", \"w\")'],"
            " cwd=d, start_new_session=True)\n"
            "    open(started, 'w').close(); time.sleep(60)\n"
            "build_once(d, build)\n")
    builder = subprocess.Popen([sys.executable, "-c", code, build_dir, str(started)])
    try:
        deadline = time.monotonic() + 60
        while not started.exists():
            assert builder.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        waited = []

        def second():  # runs only once the first has let go of the flock and its compiler has exited
            waited.append((os.path.exists(os.path.join(build_dir, "lock")),
                           os.path.exists(os.path.join(build_dir, "compiled"))))
            return "built"

        result = []
        waiter = threading.Thread(target=lambda: result.append(build_once(build_dir, second, poll_s=0.05)))
        waiter.start()
        waiter.join(1.0)
        assert waiter.is_alive() and not waited  # the first still holds the lock
        builder.send_signal(signal.SIGKILL)
        waiter.join(20)
        assert result == ["built"] and waited == [(False, True)]
    finally:
        builder.kill()
        builder.wait()


def test_amx_is_off_with_inferd_amx_0():
    """INFERD_AMX=0 keeps the pair panels on the vdpbf16ps micro-kernel (a process of its own: the choice is made once
    per process), and a GEMM there gives the FP32 sums too."""
    import subprocess
    import sys

    code = ("import torch; from inferd.model import kernels, layers; m = kernels._module(); print(m.amx); "
            "w = torch.randn(100, 70).bfloat16(); x = torch.randn(3, 70).bfloat16(); "
            "out = m.panel_linear(x, layers.pack_panels(w).data, 100, None, True); "
            "print(bool(torch.allclose(out.double(), x.double() @ w.double().T, atol=1e-4)))")
    env = {**os.environ, "INFERD_AMX": "0"}
    lines = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                           timeout=600).stdout.split()
    assert lines == ["False", "True"]


def kernel(q, k_cache, v_cache, tables, ctx, scale):
    """Decode rows: row i of q is sequence i's one new token."""
    b = q.shape[0]
    return paged_attention(q, k_cache, v_cache, tables, torch.arange(b), ctx, b, scale)


def _case(dtype, num_heads, num_kv, head_dim, lens, block_size=16, num_blocks=200, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_kv, num_blocks + 1, block_size, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_kv, num_blocks + 1, block_size, head_dim, generator=gen).to(dtype)
    max_blocks = -(-max(lens) // block_size)
    # Each sequence's blocks scattered over the cache; tables padded with the null (last) block.
    perm = torch.randperm(num_blocks, generator=gen)
    tables, used = [], 0
    for n in lens:
        nb = -(-n // block_size)
        tables.append(perm[used : used + nb].tolist() + [num_blocks] * (max_blocks - nb))
        used += nb
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, torch.tensor(tables), torch.tensor(lens)


def _reference(q, k_cache, v_cache, tables, lens, scale):
    b, (n_kv, _, _, d) = q.shape[0], k_cache.shape
    keys = gather_blocks(k_cache, tables).view(n_kv, b, -1, d).double()
    vals = gather_blocks(v_cache, tables).view(n_kv, b, -1, d).double()
    visible = torch.arange(keys.shape[2]).view(1, 1, 1, -1) < lens.view(-1, 1, 1, 1)
    return decode_attention(q.double(), keys, vals, attention_bias(visible, torch.float64), scale)


@pytest.mark.parametrize("dtype,shape,block_size", [
    (torch.bfloat16, (9, 3, 64), 16),   # SmolLM2: the compiled fast path (vdpbf16ps with AVX512-BF16)
    (torch.float32, (9, 3, 64), 16),
    (torch.bfloat16, (14, 2, 64), 16),  # Qwen2-0.5B's heads: 7 per KV head, more than one pass over the values
    (torch.float32, (4, 4, 32), 16),    # no GQA
    (torch.bfloat16, (8, 2, 128), 16),  # head dim 128
    (torch.bfloat16, (9, 3, 64), 8),    # blocks smaller and larger than the 16 keys scored at a time
    (torch.bfloat16, (9, 3, 64), 32),
    (torch.bfloat16, (9, 3, 64), 1),    # one key a block: a value pair's two rows in two blocks
    (torch.bfloat16, (9, 3, 64), 4),
    (torch.bfloat16, (4, 2, 40), 16),   # a head dim the pair path does not take
])
def test_matches_gather_and_sdpa(dtype, shape, block_size):
    """Each row as close to an FP64 reference as the SDPA path is, for contexts that end inside a block,
    on a block boundary, span one key or many blocks."""
    num_heads, num_kv, head_dim = shape
    lens = [1, 15, 16, 17, 100, 333, 64]
    q, k_cache, v_cache, tables, ctx = _case(dtype, num_heads, num_kv, head_dim, lens, block_size=block_size,
                                             num_blocks=200 * 16 // block_size)
    scale = head_dim ** -0.5
    out = kernel(q, k_cache, v_cache, tables, ctx, scale)
    assert out.shape == q.shape and out.dtype == dtype
    exact = _reference(q, k_cache, v_cache, tables, ctx, scale)
    b, n_kv, d = q.shape[0], num_kv, head_dim
    keys = gather_blocks(k_cache, tables).view(n_kv, b, -1, d)
    vals = gather_blocks(v_cache, tables).view(n_kv, b, -1, d)
    visible = torch.arange(keys.shape[2]).view(1, 1, 1, -1) < ctx.view(-1, 1, 1, 1)
    sdpa = decode_attention(q, keys, vals, attention_bias(visible, dtype), scale)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7  # one BF16 rounding of values of size ~1
    assert (out.double() - exact).abs().max() <= max(tol, 1.5 * (sdpa.double() - exact).abs().max())


@pytest.mark.parametrize("shape", [(9, 3, 64), (8, 2, 128)])
def test_a_row_does_not_depend_on_the_batch(shape):
    """The same bits for a sequence alone and in any batch (each (sequence, KV head) is one work item; in a batch of
    more items than threads, each prefetches its thread's next item's first 512 keys, DecodeAhead), at head dims 64
    and 128, contexts of 1 to 600 keys."""
    q, k_cache, v_cache, tables, ctx = _case(torch.bfloat16, *shape, [40, 300, 7, 129, 16, 250, 90, 1, 600, 513] * 3,
                                             num_blocks=400)
    batch = kernel(q, k_cache, v_cache, tables, ctx, 0.125)
    for i in (0, 1, 5, 8, 9, 29):
        alone = kernel(q[i : i + 1].contiguous(), k_cache, v_cache, tables[i : i + 1].contiguous(), ctx[i : i + 1], 0.125)
        assert torch.equal(alone[0], batch[i])


def _prompt(dtype, num_heads, num_kv, head_dim, n, seed=1, block_size=16):
    """One sequence of n tokens with its blocks scattered over the cache: q [n, Hq, D], caches, table [1, nb]."""
    q, k_cache, v_cache, tables, _ = _case(dtype, num_heads, num_kv, head_dim, [n], block_size=block_size,
                                           num_blocks=n // block_size + 8, seed=seed)
    q = torch.randn(n, num_heads, head_dim, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    return q, k_cache, v_cache, tables


def _causal_reference(q, k_cache, v_cache, table, scale):
    n = q.shape[0]
    keys = gather_blocks(k_cache, table[0]).double()[:, :n]  # [Hkv, n, D]
    vals = gather_blocks(v_cache, table[0]).double()[:, :n]
    o = torch.nn.functional.scaled_dot_product_attention(q.double().transpose(0, 1).unsqueeze(0), keys.unsqueeze(0),
                                                         vals.unsqueeze(0), is_causal=True, scale=scale,
                                                         enable_gqa=True)
    return o[0].transpose(0, 1)  # [n, Hq, D]


@pytest.mark.parametrize("dtype,shape,block_size", [
    (torch.bfloat16, (9, 3, 64), 16), (torch.float32, (9, 3, 64), 16), (torch.bfloat16, (14, 2, 64), 16),
    (torch.float32, (4, 4, 32), 16), (torch.bfloat16, (8, 2, 128), 16),
    # With AMX, 16 keys are one tile read in place from a block of 16 or more, gathered from smaller blocks
    (torch.bfloat16, (9, 3, 64), 4), (torch.bfloat16, (9, 3, 64), 64),
])
def test_prefill_rows_match_causal_attention(dtype, shape, block_size):
    """A whole prompt of prefill rows (the causal mask implied by each row's context length), over more than one
    key chunk (256 keys), as close to an FP64 reference as the roundings allow: FP32 within summation error; BF16
    within two roundings (the probabilities are rounded to BF16 before P V where the CPU has AVX512-BF16, as
    FlashAttention and torch's own BF16 attention on CPU round them) and on average no further from it than torch's
    BF16 SDPA on the same inputs."""
    num_heads, num_kv, head_dim = shape
    n = 600
    q, k_cache, v_cache, table = _prompt(dtype, num_heads, num_kv, head_dim, n, block_size=block_size)
    scale = head_dim ** -0.5
    out = paged_attention(q, k_cache, v_cache, table, torch.zeros(n, dtype=torch.long), torch.arange(1, n + 1), 0,
                          scale)
    assert out.shape == q.shape and out.dtype == dtype
    exact = _causal_reference(q, k_cache, v_cache, table, scale)
    err = (out.double() - exact).abs() / exact.abs().clamp(min=1)
    assert err.max() <= (2e-6 if dtype == torch.float32 else 2 ** -7)
    if dtype == torch.bfloat16:
        keys, vals = gather_blocks(k_cache, table[0])[:, :n], gather_blocks(v_cache, table[0])[:, :n]
        torch_out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), keys.unsqueeze(0), vals.unsqueeze(0), is_causal=True, scale=scale,
            enable_gqa=True)[0].transpose(0, 1)
        torch_err = (torch_out.double() - exact).abs() / exact.abs().clamp(min=1)
        assert err.mean() <= 1.05 * torch_err.mean(), (err.mean(), torch_err.mean())


@pytest.mark.parametrize("shape", [(9, 3, 64), (8, 2, 128)])
def test_prefill_rows_keep_denormal_outputs(shape):
    """Outputs so small that they are BF16 denormals come out as at::BFloat16(float) rounds them, not flushed to zero
    (the AMX tiles' output went through VCVTNEPS2BF16, which flushes them; vec.h's store_bf16_16 does not take it
    for those). With q = 0 every probability is 1, and the values (normal numbers: the tile products flush denormal
    inputs) are 3e-38 at position 0 then +-2e-38 alternately, so row p's output is about (1e-38 or 3e-38) / (p + 1).
    (The sums themselves are the tile products', which flush denormal partial sums: not compared here.)"""
    num_heads, num_kv, head_dim = shape
    n, bs = 40, 16
    _, k_cache, v_cache, table = _prompt(torch.bfloat16, num_heads, num_kv, head_dim, n)
    q = torch.zeros(n, num_heads, head_dim, dtype=torch.bfloat16)
    for t in range(n):
        v_cache[:, table[0, t // bs], t % bs] = 3e-38 if t == 0 else (2e-38 if t % 2 else -2e-38)
    out = paged_attention(q, k_cache, v_cache, table, torch.zeros(n, dtype=torch.long), torch.arange(1, n + 1), 0,
                          head_dim ** -0.5)
    exact = _causal_reference(q, k_cache, v_cache, table, head_dim ** -0.5)
    assert (exact[5:].abs() < 1.1754944e-38).all() and (exact.abs() > 5e-40).all()  # denormal from row 5 on
    assert (out[5:].float().abs() < 1.1754944e-38).all() and (out != 0).all()  # denormal outputs, kept


@pytest.mark.parametrize("dtype,shape,block_size", [(torch.bfloat16, (9, 3, 64), 16), (torch.float32, (8, 2, 128), 16),
                                                    (torch.bfloat16, (9, 3, 64), 4)])
def test_a_prefill_row_does_not_depend_on_its_chunk_or_batch(dtype, shape, block_size):
    """The same bits for a prompt token whatever chunk of its prompt it is computed in (so whatever tile and key
    range the kernel gives it), and whatever other rows share the call: decode rows of other sequences, another
    prompt."""
    n = 700
    q, k_cache, v_cache, table = _prompt(dtype, *shape, n, block_size=block_size)
    seq0, lens = torch.zeros(n, dtype=torch.long), torch.arange(1, n + 1)
    whole = paged_attention(q, k_cache, v_cache, table, seq0, lens, 0, 0.125)
    for a, b in [(0, 1), (5, 6), (255, 257), (17, 50), (240, 300), (600, 700), (0, 700 // 3)]:
        chunk = paged_attention(q[a:b].contiguous(), k_cache, v_cache, table, seq0[a:b].contiguous(),
                                lens[a:b].contiguous(), 0, 0.125)
        assert torch.equal(chunk, whole[a:b]), (a, b)
    # Beside 3 decode rows of the same prompt (as sequences 1-3) and a chunk of the same prompt as sequence 4.
    tables = table.expand(5, -1).contiguous()
    rows = torch.cat([q[[99, 400, 650]], q[300:340], q[10:30]])
    seq = torch.tensor([1, 2, 3] + [0] * 40 + [4] * 20)
    ctx = torch.cat([torch.tensor([100, 401, 651]), lens[300:340], lens[10:30]])
    mixed = paged_attention(rows.contiguous(), k_cache, v_cache, tables, seq, ctx, 3, 0.125)
    assert torch.equal(mixed[3:43], whole[300:340]) and torch.equal(mixed[43:], whole[10:30])
    decode = paged_attention(q[[99, 400, 650]].contiguous(), k_cache, v_cache, tables[:3].contiguous(),
                             torch.arange(3), torch.tensor([100, 401, 651]), 3, 0.125)
    assert torch.equal(mixed[:3], decode)


def test_bad_input_is_refused():
    q, k_cache, v_cache, tables, ctx = _case(torch.bfloat16, 9, 3, 64, [20, 30])
    with pytest.raises(RuntimeError, match="context lengths"):
        kernel(q, k_cache, v_cache, tables, torch.tensor([20, 33]), 0.125)  # past the table's 2 blocks
    with pytest.raises(RuntimeError, match="context lengths"):
        kernel(q, k_cache, v_cache, tables, torch.tensor([0, 30]), 0.125)
    with pytest.raises(RuntimeError, match="block ids"):
        kernel(q, k_cache, v_cache, torch.full_like(tables, k_cache.shape[1]), ctx, 0.125)  # past the cache
    with pytest.raises(RuntimeError, match="one dtype"):
        kernel(q.float(), k_cache, v_cache, tables, ctx, 0.125)
    with pytest.raises(RuntimeError, match="int64"):
        kernel(q, k_cache, v_cache, tables.int(), ctx, 0.125)
    with pytest.raises(RuntimeError, match="sequence indices"):
        paged_attention(q, k_cache, v_cache, tables, torch.tensor([0, 2]), ctx, 2, 0.125)
    with pytest.raises(RuntimeError, match="num_decode"):
        paged_attention(q, k_cache, v_cache, tables, torch.arange(2), ctx, 3, 0.125)


@pytest.mark.parametrize("flags,native,amx,onednn", [
    ("avx2 fma avx512f avx512bw avx512dq avx512_bf16", True, False, False),  # AMD Zen 4/5: inferd's panels
    ("avx2 fma avx512f avx512bw avx512dq avx512_bf16 amx_bf16 amx_tile", True, True, False),  # Sapphire Rapids: AMX
    # AMX in the CPU but not in the build or not granted (INFERD_AMX=0): oneDNN's AMX kernels
    ("avx2 fma avx512f avx512bw avx512dq avx512_bf16 amx_bf16 amx_tile", True, False, True),
    ("avx2 fma", False, False, False),  # AMD Zen 3: panels (torch has no fast BF16 there)
    ("sse4_2", True, False, True),  # native BF16 but not inferd's kernels: oneDNN
])
def test_onednn_serves_bf16_only_where_inferd_cannot(flags, native, amx, onednn):
    """Which GEMM serves BF16 by what the CPU has: inferd's panels and decoder stack on AVX2 CPUs, on AMX tiles where
    the module multiplies pair panels there (docs/performance.md, stops 24 and 28); oneDNN where the CPU has AMX and
    the module does not use it, or inferd's kernels cannot serve."""
    from inferd.model import kernels

    real = kernels._module()  # built (and cached) for the real CPU before its flags are faked

    class Module:  # the real module, its AMX answer set
        def __getattr__(self, name):
            return amx if name == "amx" else getattr(real, name)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "_cpu_id", lambda: f"flags\t: {flags}\n")
        mp.setattr(kernels, "native_bf16_matmul", lambda: native)
        mp.setattr(kernels, "_module", lambda: Module())
        kernels.onednn_bf16_gemm.cache_clear()
        kernels.panel_linear_kernel.cache_clear()
        try:
            assert kernels.onednn_bf16_gemm() == onednn
            assert (kernels.panel_linear_kernel() is None) == (onednn or "avx2" not in flags)
        finally:
            kernels.onednn_bf16_gemm.cache_clear()
            kernels.panel_linear_kernel.cache_clear()


# inferd's GEMM for AVX2 CPUs without native BF16 matmul (inferd/model/csrc/panel_gemm.cpp), BF16 and FP32 weights.
# The compiled function is tested wherever the CPU has AVX2, including CPUs where the engine uses oneDNN instead.
def _panel_linear():
    from inferd.model import kernels

    module = kernels._module()
    return module.panel_linear if module is not None and kernels._has_avx2_fma() else None


panel_linear = _panel_linear()
needs_avx2 = pytest.mark.skipif(panel_linear is None, reason="no AVX2 and FMA on this CPU")
BOTH = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])


def _panels(w, layout="default"):
    """w's panels: the CPU's default layout, or BF16 "interleaved" for the AVX2 micro-kernel (also where the default
    is pairs of k, so that kernel is tested on every AVX2 CPU)."""
    from inferd.model.kernels import pack_panels_kernel
    from inferd.model.layers import PanelWeight, pack_panels

    if layout == "interleaved" and w.dtype == torch.bfloat16:
        return PanelWeight(pack_panels_kernel()(w, None, False), w.shape[0])
    return pack_panels(w)


LAYOUTS = pytest.mark.parametrize("layout", ["default", "interleaved"])


@needs_avx2
@BOTH
@pytest.mark.parametrize("n,k", [(960, 576), (100, 70), (16, 1), (1, 33)])
def test_packed_panels_are_the_documented_layout(n, k, dtype):
    """The compiled packing gives BF16 [p, k, j, h] and FP32 [p, k, h, j] = W[16 p + 8 h + j, k], and BF16 of an
    even K in pairs [p, kk, j, t] = W[16 p + j, 2 kk + t] where the build has AVX512-BF16 (odd K stays interleaved
    there), zero past N, bit for bit, as the torch fallback does; it refuses other dtypes and buffers of the wrong
    shape or dtype."""
    from inferd.model import kernels
    from inferd.model.kernels import pack_panels_kernel

    pack = pack_panels_kernel()
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)).to(dtype)
    panels = -(-n // 16)
    padded = torch.cat([w, torch.zeros(panels * 16 - n, k, dtype=dtype)])
    pairs = dtype == torch.bfloat16 and k % 2 == 0 and kernels._module().bf16_pairs
    if pairs:  # element by element: [p, kk, j, t] = W[16 p + j, 2 kk + t]
        p, kk, j, t = torch.meshgrid(torch.arange(panels), torch.arange(k // 2), torch.arange(16), torch.arange(2),
                                     indexing="ij")
        expected = padded[16 * p + j, 2 * kk + t]
        shape = (panels, k // 2, 16, 2)
    else:
        order = (0, 3, 2, 1) if dtype == torch.bfloat16 else (0, 3, 1, 2)  # from [p, h, j, k]
        expected = padded.reshape(panels, 2, 8, k).permute(order)
        shape = (panels, k, 8, 2) if dtype == torch.bfloat16 else (panels, k, 2, 8)
    got = pack(w)
    assert got.shape == shape and got.dtype == dtype
    assert torch.equal(got, expected)
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        pack(w.half())
    # Into a buffer given (the model's panels share one in huge pages): every element written, the padding too.
    out = torch.full(shape, 7.0, dtype=dtype)
    assert pack(w, out).data_ptr() == out.data_ptr() and torch.equal(out, expected)
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    for bad in (torch.empty(panels + 1, *shape[1:], dtype=dtype), torch.empty(shape, dtype=other),
                torch.empty(*shape[:2], shape[3], shape[2], dtype=dtype).transpose(2, 3)):
        with pytest.raises(RuntimeError, match="out must be a contiguous"):
            pack(w, bad)
    if pairs:  # the interleaved layout on request too (the AVX2 micro-kernel serves it there as well)
        assert pack(w, None, False).shape == (panels, k, 8, 2)
    else:
        with pytest.raises(RuntimeError, match="pairs of k need BF16 weights of an even K"):
            pack(w, None, True)
    with pytest.MonkeyPatch.context() as mp:  # the torch fallback (no compiled kernels): the same panels
        mp.setattr(kernels, "_module", lambda: None)
        from inferd.model.layers import pack_panels

        assert torch.equal(pack_panels(w).data, expected)


@needs_avx2
@BOTH
@LAYOUTS
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (100, 70), (16, 1), (1, 33)])
def test_panel_linear_sums_in_fp32(n, k, dtype, layout):
    """FP32 output: within FP32 summation error of an FP64 reference over the same inputs, with bias, for row
    counts that fill the 6-row micro-tiles, leave tails, and output widths that are not whole panels. BF16 output
    (BF16 weights only): the FP32 result rounded once to nearest even."""
    gen = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    b = torch.randn(n, generator=gen)
    packed = _panels(w, layout)
    for m in (1, 2, 3, 5, 6, 7, 13, 32, 96, 97, 128, 192, 200):  # 8-192: AMX's weight look-ahead (WeightsAhead)
        x = torch.randn(m, k, generator=gen).to(dtype)
        exact = x.double() @ w.double().T + b.double()
        bound = 4 * k * 2**-24 * ((x.double().abs() @ w.double().abs().T) + b.double().abs()) + 1e-30
        out = panel_linear(x, packed.data, n, b, True)
        assert out.shape == (m, n) and out.dtype == torch.float32
        assert ((out.double() - exact).abs() <= bound).all(), (m, n, k)
        if dtype == torch.bfloat16:
            assert torch.equal(panel_linear(x, packed.data, n, b, False), out.to(torch.bfloat16))
            assert torch.equal(panel_linear(x.float(), packed.data, n, b, True), out)  # FP32 input: same values
            wide = torch.cat([x, x], dim=1)[:, :k]  # a view whose rows are not contiguous: the same values
            assert torch.equal(panel_linear(wide, packed.data, n, b, True), out)
            if packed.pairs:  # the AVX512-BF16 kernel multiplies BF16 pairs: FP32 x rounded to nearest even first
                xf = torch.randn(m, k, generator=gen)
                assert not torch.equal(xf.bfloat16().float(), xf)
                assert torch.equal(panel_linear(xf, packed.data, n, b, True),
                                   panel_linear(xf.bfloat16(), packed.data, n, b, True))
        else:
            with pytest.raises(RuntimeError, match="FP32 weights give FP32 outputs"):
                panel_linear(x, packed.data, n, b, False)


@needs_avx2
@LAYOUTS
@pytest.mark.parametrize("m", [1, 7, 32, 40, 200])
def test_panel_linear_bf16_output_rounds_as_torch_for_every_value(m, layout):
    """The BF16 output's bits are torch's rounding of the FP32 output for every value, the ones VCVTNEPS2BF16 rounds
    otherwise included (vec.h's store_bf16_16 takes it only for vectors without them): denormals (kept, not flushed),
    NaN of either sign or any payload (0x7fc0, c10::BFloat16's; torch's vectorised ``.to(bfloat16)`` gives 0xffff
    for some), infinities, signed zeros; beside ordinary values. Rows of zeros give the bias itself."""
    n, k = 48, 64
    gen = torch.Generator().manual_seed(m)
    w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    nan_payload = torch.tensor([0x7FA00001, -0x00400001], dtype=torch.int32).view(torch.float32)  # signalling, -NaN
    special = torch.cat([torch.tensor([1e-39, -3e-39, 1.4e-45, float("nan"), float("inf"), -float("inf"), 0.0, -0.0,
                                       1.1754942e-38, 1.1754944e-38, 3.3e38]), nan_payload])
    b = torch.randn(n, generator=gen)
    b[torch.randperm(n, generator=gen)[: special.numel()]] = special
    x = torch.randn(m, k, generator=gen).bfloat16()
    x[::2] = 0  # the bias alone, so each special value reaches the output
    packed = _panels(w, layout)
    out = panel_linear(x, packed.data, n, b, False).view(torch.int16).long() & 0xFFFF
    fp32 = panel_linear(x, packed.data, n, b, True)
    u = fp32.view(torch.int32).long() & 0xFFFFFFFF
    want = torch.where(fp32.isnan(), 0x7FC0, (u + 0x7FFF + ((u >> 16) & 1)) >> 16)  # c10::BFloat16(float)'s rule
    assert fp32.isnan().any() and ((fp32.abs() < 1.1754944e-38) & (fp32 != 0)).any()  # both reached the output
    assert torch.equal(out, want)


@needs_avx2
@LAYOUTS
@pytest.mark.parametrize("inter,k", [(1536, 576), (48, 576), (64, 1536), (40, 576), (48, 70)])
def test_panel_linear_silu_is_the_gemm_then_silu_mul(inter, k, layout):
    """SiLU(gate) * up of a fused gate_up weight in one call: the bits of the BF16 gate_up GEMM followed by
    silu_mul, for row counts that fill AMX's 16-row blocks, leave a partial one, and span several 192-row chunks;
    for shapes it fuses on AMX (K a multiple of 32, I of 16) and shapes it computes in two calls."""
    from inferd.model import kernels

    module = kernels._module()
    gen = torch.Generator().manual_seed(inter + k)
    w = _panels((torch.randn(2 * inter, k, generator=gen) * 0.05).to(torch.bfloat16), layout)
    for m in (1, 5, 16, 17, 97, 200, 1000):
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        expected = module.silu_mul(panel_linear(x, w.data, 2 * inter, None, False))
        out = module.panel_linear_silu(x, w.data, inter)
        assert out.shape == (m, inter) and out.dtype == torch.bfloat16
        assert torch.equal(out, expected), (inter, k, m)
    assert torch.equal(module.panel_linear_silu(x.float(), w.data, inter), expected)  # FP32 x: rounded first
    w32 = _panels(torch.randn(2 * inter, k, generator=gen) * 0.05)  # FP32 weights: FP32 sums and SiLU
    x = torch.randn(7, k, generator=gen)
    assert torch.equal(module.panel_linear_silu(x, w32.data, inter),
                       module.silu_mul(panel_linear(x, w32.data, 2 * inter, None, True)))


@needs_avx2
@BOTH
@LAYOUTS
@pytest.mark.parametrize("n,k", [(576, 576), (576, 1536), (100, 64), (40, 70)])
def test_panel_linear_into_adds_the_fp32_sums_in_place(n, k, dtype, layout):
    """``into`` (the FP32 residual stream): into + x @ W.T (+ b), each element one FP32 add of the FP32 output,
    the bits of ``into + panel_linear(..., out_fp32=True)`` (as add_rms_norm adds a delta), in place, for row
    counts that leave partial AMX row blocks and span several 192-row passes, widths that are not whole panels,
    and K that AMX reads in place or not; a mismatched ``into`` is refused."""
    gen = torch.Generator().manual_seed(n * k)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    b = torch.randn(n, generator=gen)
    packed = _panels(w, layout)
    for m in (1, 5, 17, 200, 500):
        x = torch.randn(m, k, generator=gen).to(dtype)
        h = torch.randn(m, n, generator=gen) * 4
        for bias in (None, b):
            expected = h + panel_linear(x, packed.data, n, bias, True)
            into = h.clone()
            out = panel_linear(x, packed.data, n, bias, True, into)
            assert out.data_ptr() == into.data_ptr() and torch.equal(into, expected), (m, n, k)
    for bad in (h[:, :-1], h.double(), h.t().contiguous().t()):
        with pytest.raises(RuntimeError, match="`into` must be a contiguous FP32"):
            panel_linear(x, packed.data, n, None, True, bad)
    if dtype == torch.bfloat16:
        with pytest.raises(RuntimeError, match="`into` must be a contiguous FP32"):
            panel_linear(x, packed.data, n, None, False, h)


@needs_avx2
@BOTH
@LAYOUTS
def test_panel_linear_rows_do_not_depend_on_the_batch(dtype, layout):
    """Each output element is one FMA chain in a fixed order: a row gives the same bits alone, at any place in
    a batch of any size, and with either thread count."""
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(3072, 576, generator=gen) * 0.05).to(dtype)
    packed = _panels(w, layout)
    rows = torch.randn(300, 576, generator=gen).to(dtype)
    alone = panel_linear(rows[:1], packed.data, 3072, None, True)[0]
    # (up to 3 rows the AVX512-BF16 kernel prefetches its own panels ahead; from 4 it does not; on AMX, 8-192 rows
    # prefetch the next panels' weights: the same bits)
    for before, after in ((0, 1), (1, 0), (1, 1), (2, 0), (5, 0), (2, 3), (6, 6), (95, 1), (64, 63), (100, 91),
                          (96, 100), (150, 149)):
        x = torch.cat([rows[1 : 1 + before], rows[:1], rows[1 + before : 1 + before + after]])
        assert torch.equal(panel_linear(x, packed.data, 3072, None, True)[before], alone), (before, after)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(panel_linear(rows[:7], packed.data, 3072, None, True)[0], alone)
    finally:
        torch.set_num_threads(threads)


@needs_avx2
def test_panel_linear_refuses_what_does_not_match():
    w = _panels(torch.randn(32, 64).to(torch.bfloat16))
    x = torch.randn(3, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"panels of a \[32, K\] weight, not x \[3, 63\]"):
        panel_linear(torch.randn(3, 63).to(torch.bfloat16), w.data, 32, None, True)
    with pytest.raises(RuntimeError, match=r"panels of a \[48, K\] weight"):
        panel_linear(x, w.data, 48, None, True)
    with pytest.raises(RuntimeError, match="bias"):
        panel_linear(x, w.data, 32, torch.zeros(31), True)
    with pytest.raises(RuntimeError, match="panels of a"):  # BF16 panels' shape in FP32: not FP32's layout
        panel_linear(x, w.data.float(), 32, None, True)
    with pytest.raises(RuntimeError, match="packed weight: contiguous BF16 or FP32"):
        panel_linear(x, w.data.half(), 32, None, True)
    assert panel_linear(x[:0], w.data, 32, None, True).shape == (0, 32)


@needs_avx2
@BOTH
@LAYOUTS
@pytest.mark.parametrize("n,k", [(49152, 576), (1000, 576), (100, 64), (40, 70)])
def test_panel_linear_argmax_is_the_argmax_of_its_logits(n, k, dtype, layout):
    """panel_linear_argmax gives argmax_rows(panel_linear(..., out_fp32=True)) for every row: on AMX (BF16 pair
    panels, K a multiple of 32) from the C tiles' sums without writing the logits, elsewhere by those two calls.
    Rows that fill 16-row tiles and leave tails, up to 200 (several passes of row blocks); widths that are not
    whole panels; equal largest logits in different panels, lanes and threads' columns (the first wins); a NaN
    column (the first NaN wins); rows of -inf; a bias."""
    from inferd.model import kernels

    argmax = kernels._module().panel_linear_argmax
    gen = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    for j in (n - 1, n // 2 + 3, 17 % n):  # columns equal to column n // 3: the same sums, bit for bit
        w[j] = w[n // 3]
    packed = _panels(w, layout)
    for m in (1, 5, 16, 17, 32, 97, 128, 200):
        x = torch.randn(m, k, generator=gen).to(dtype)
        x[0] = w[n // 3] * 40  # row 0's largest logit is column n // 3's, tied with three others
        for bias in (None, torch.randn(n, generator=gen), torch.full((n,), float("-inf"))):
            expected = _fused().argmax_rows(panel_linear(x, packed.data, n, bias, True))
            assert torch.equal(argmax(x, packed.data, n, bias), expected), (m, bias is None)
            if bias is None:
                assert expected[0] == min(17 % n, n // 3)
        nan = torch.zeros(n)
        nan[[n - 1, n // 2]] = float("nan")
        expected = _fused().argmax_rows(panel_linear(x, packed.data, n, nan, True))
        assert torch.equal(argmax(x, packed.data, n, nan), expected)
        assert (expected == n // 2).all()
    assert argmax(x[:0], packed.data, n).shape == (0,)


# Each layer's element-wise work fused (inferd/model/csrc/fused_ops.cpp) against the torch operators it replaces.
def _fused():
    from inferd.model import kernels

    return kernels.fused_ops()


def test_argmax_rows_is_torch_argmax():
    """Each row's argmax is torch.argmax's answer, bit for bit: random logits of widths around the 8-lane vector
    (1 to 17, SmolLM2's 49,152 and 49,155); equal maxima in several lanes, in one lane twice and in the tail (the
    first wins); rows of -inf; a NaN anywhere (its first index wins, as in torch); the sampler's entry point."""
    from inferd.engine.sampler import argmax_rows

    ops = _fused()
    gen = torch.Generator().manual_seed(5)
    for vocab in (*range(1, 18), 49152, 49155):
        x = torch.randn(33, vocab, generator=gen)
        x[1] = 0.0  # every value equal
        x[2] = float("-inf")
        if vocab > 3:
            x[3, [vocab - 1, 1, 2]] = 9.0  # ties across lanes and in the tail
            x[4, [vocab - 2, vocab // 2]] = float("nan")
            x[5, vocab - 1] = float("nan")
            x[6, [0, vocab - 1]] = float("inf")
        if vocab > 17:
            x[7, [3, 11, 19]] = 5.0  # one lane twice, another once: the first
            x[8] = torch.round(x[8])  # many ties
        expected = x.argmax(dim=-1)
        assert torch.equal(ops.argmax_rows(x), expected), vocab
        assert torch.equal(argmax_rows(x), expected)
        assert torch.equal(ops.argmax_rows(x[::2]), expected[::2])  # a strided view
    with pytest.raises(RuntimeError, match="float32"):
        ops.argmax_rows(torch.zeros(2, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="0 < V < 2\\^31"):
        ops.argmax_rows(torch.zeros(2, 0))
    # Where the kernels are not built (or for other dtypes) the sampler takes torch's argmax.
    import inferd.engine.sampler as sampler

    x = torch.randn(3, 100, generator=gen)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sampler, "fused_ops", lambda: None)
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert torch.equal(argmax_rows(x.double()), x.double().argmax(dim=-1))


def test_nucleus_floor_is_the_sorted_rows_answer():
    """Each row's top-p floor by the radix select equals the one a sort of the row gives (the sampler's fallback
    off the CPU), bit for bit: widths from 1 token to SmolLM2's 49,152, distributions from flat to peaked, many
    tokens tied (half a row equal, then all of it), top_p from 0.0005 to just under 1 (past the sums of some rows:
    their least token), and 1 (0: no cut); a one-hot row (its token), a row that holds less than top_p (its least token: every token
    kept), a NaN row (0), a strided view; and shapes it refuses."""
    from inferd.engine.sampler import nucleus_floor_sorted

    ops = _fused()
    gen = torch.Generator().manual_seed(11)
    for scale in (0.01, 0.5, 2, 8, 30):
        for vocab in (1, 5, 33, 65, 1000, 49152):
            logits = torch.randn(48, vocab, generator=gen) * scale
            logits[:6, : vocab // 2] = 0.0
            logits[6] = 1.0
            probs = logits.softmax(dim=-1)
            top_p = torch.rand(48, generator=gen) * 0.999 + 0.0005
            top_p[-5:] = torch.tensor([0.9999, 0.999999, 0.9999999, 1 - 2**-24, 1.0])  # past the rows' sums; none
            got = ops.nucleus_floor(probs, top_p)
            assert got.shape == (48, 1) and torch.equal(got, nucleus_floor_sorted(probs, top_p)), (scale, vocab)
            assert torch.equal(ops.nucleus_floor(probs[::2], top_p[::2]), got[::2])
    probs = torch.zeros(3, 1000)
    probs[0, 5] = 1.0
    probs[1, :10] = 0.05  # holds 0.5
    probs[2, 7] = float("nan")
    assert ops.nucleus_floor(probs, torch.tensor([0.3, 0.9, 0.5])).flatten().tolist() == [1.0, 0.0, 0.0]
    with pytest.raises(RuntimeError, match="float32"):
        ops.nucleus_floor(probs.double(), torch.tensor([0.3, 0.9, 0.5]))
    with pytest.raises(RuntimeError, match=r"top_p \[S\]"):
        ops.nucleus_floor(probs, torch.tensor([0.3, 0.9]))


def test_sample_probs_draws_by_inverse_transform():
    """The token whose running sum first passes u times the kept tokens' total: never one of probability 0 (u = 0
    skips the leading zeros; u just under 1 gives the last kept token, not a zero after it); top-p and min-p floors
    drop the tokens under them; a NaN is never drawn. (The draws' distribution: tests/test_sampler.py.)"""
    ops = _fused()
    probs = torch.tensor([[0.0, 0.1, 0.0, 0.2, 0.3, 0.4, 0.0]] * 6)
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.5, 1.0, 0.65])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.6, 0.0])
    u = torch.tensor([0.0, 0.25, 1 - 2**-53, 0.0, 0.5, 0.99], dtype=torch.float64)
    # 0.25 of 1.0: past 0.1 at token 3 (0.3); top_p 0.5 keeps 0.4 and 0.3 (0.4 above it < 0.5): u = 0, token 4;
    # min_p 0.6 keeps 0.3 and 0.4 (>= 0.24): 0.5 of 0.7 is passed at token 5; top_p 0.65 keeps 0.4 and 0.3 (0.7
    # above the 0.2): 0.99 of 0.7, token 5, not token 6 (probability 0)
    assert ops.sample_probs(probs, top_p, min_p, u).tolist() == [1, 3, 5, 4, 5, 5]
    nan = torch.tensor([[0.5, float("nan"), 0.5]])
    for value in (0.0, 0.6, 1 - 2**-53):
        assert ops.sample_probs(nan, torch.tensor([1.0]), torch.tensor([0.0]),
                                torch.tensor([value], dtype=torch.float64)).item() in (0, 2)
    with pytest.raises(RuntimeError, match="u \\[S\\] float64"):
        ops.sample_probs(probs, top_p, min_p, u.float())


def test_sample_probs_draws_each_row_of_a_batch_as_alone():
    """The threads of one call share nothing but their own scratch row for the radix select: 64 rows of SmolLM2's
    vocabulary, each with its own top_p, min_p and u, draw in one call the tokens that each row draws alone."""
    ops = _fused()
    gen = torch.Generator().manual_seed(5)
    probs = (torch.randn(64, 49152, generator=gen) * torch.linspace(0.5, 12, 64).unsqueeze(1)).softmax(dim=-1)
    top_p = torch.rand(64, generator=gen) * 0.99 + 0.005
    top_p[::7] = 1.0
    min_p = torch.where(torch.arange(64) % 5 == 0, 0.05, 0.0)
    u = torch.rand(64, generator=gen, dtype=torch.float64)
    alone = [ops.sample_probs(probs[r:r + 1], top_p[r:r + 1], min_p[r:r + 1], u[r:r + 1]).item() for r in range(64)]
    threads = torch.get_num_threads()
    torch.set_num_threads(max(threads, 2))
    try:
        assert ops.sample_probs(probs, top_p, min_p, u).tolist() == alone
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_add_rms_norm_and_silu_mul_match_torch(dtype):
    """The residual add in place and RMSNorm: within one rounding of the dtype of the torch path (the FP32 sum of
    squares is in another order); SiLU * up: the torch path's values."""
    from inferd.model.layers import rms_norm

    ops = _fused()
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(37, 576, generator=gen) * 4
    delta = torch.randn(37, 576, generator=gen).to(dtype)
    w = torch.randn(576, generator=gen).to(dtype)
    expected_h = h + delta
    expected = rms_norm(expected_h, w, 1e-5, dtype)
    got_h = h.clone()
    got = ops.add_rms_norm(got_h, delta, w, 1e-5)
    assert torch.equal(got_h, expected_h) and got.dtype == dtype
    tol = 2**-7 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(got.float(), expected.float(), rtol=tol, atol=tol)
    assert torch.equal(ops.add_rms_norm(expected_h.clone(), None, w, 1e-5), got)  # no delta: the norm alone
    # SiLU * up (16 values at a time with AVX-512, then 8, then the tail: 1,531 = 95 x 16 + 8 + 3; on AVX2
    # 191 x 8 + 3): the torch path's values, also where e^-g overflows (-0 as torch), at infinities and NaN.
    gate_up = torch.randn(5, 2 * 1531, generator=gen).to(dtype) * 4
    edges = [-100.0, -88.5, -88.0, -87.0, 100.0, float("inf"), float("nan"), 0.0]
    gate_up[0, : len(edges)] = torch.tensor(edges).to(dtype)
    gate_up[0, 1531 : 1531 + len(edges)] = 3.0
    gate, up = gate_up.chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    got = ops.silu_mul(gate_up)
    assert torch.allclose(got.float(), ref.float(), rtol=tol, atol=tol, equal_nan=True)
    # the tiny values of e^-g near its overflow (ln(FLT_MAX) = 88.72) relative to themselves, not to atol
    assert torch.allclose(got[0, 1:4].float(), ref[0, 1:4].float(), rtol=tol, atol=0)
    assert got[0, 0].item() == 0.0 and got[0, 5].item() == float("inf") and got[0, 6].isnan()


def test_fused_rope_and_cache_matches_torch():
    """Rotated queries returned, rotated keys and the values written to their slots, as RotaryEmbedding.apply and
    index_copy_ do; a slot outside the cache is refused before anything is written."""
    from inferd.model.layers import RotaryEmbedding, rope_inv_freq

    ops = _fused()
    gen = torch.Generator().manual_seed(4)
    dtype, hq, hkv, d, n = torch.bfloat16, 9, 3, 64, 7
    rot = RotaryEmbedding(rope_inv_freq(d, 10000.0, None), 512, dtype, torch.device("cpu"))
    positions = torch.tensor([0, 5, 17, 100, 101, 300, 511])
    cos, sin = rot.lookup(positions)
    qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    k_cache = torch.zeros(hkv, 40, 16, d, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([3, 20, 21, 300, 301, 639, 0])
    q = ops.rope_and_cache(qkv, cos.view(n, d), sin.view(n, d), k_cache, v_cache, slots, hq, hkv)
    qk = rot.apply(qkv[:, : (hq + hkv) * d].view(n, hq + hkv, d), cos, sin)
    assert torch.allclose(q.float(), qk[:, :hq].float(), rtol=2**-7, atol=2**-7)
    k_ref = torch.zeros_like(k_cache)
    k_ref.view(hkv, -1, d).index_copy_(1, slots, qk[:, hq:].transpose(0, 1))
    v_ref = torch.zeros_like(v_cache)
    v_ref.view(hkv, -1, d).index_copy_(1, slots, qkv[:, (hq + hkv) * d :].view(n, hkv, d).transpose(0, 1))
    assert torch.allclose(k_cache.float(), k_ref.float(), rtol=2**-7, atol=2**-7)
    assert torch.equal(v_cache, v_ref)
    before = k_cache.clone()
    with pytest.raises(RuntimeError, match="slots"):
        ops.rope_and_cache(qkv, cos.view(n, d), sin.view(n, d), k_cache, v_cache, slots + 400, hq, hkv)
    assert torch.equal(k_cache, before)


@pytest.mark.parametrize("d", [8, 16, 32, 64, 128])
def test_fused_rope_gives_the_bits_of_its_arithmetic(d):
    """In BF16 each rotated value is x * cos and rotate_half(x) * sin, each product rounded to BF16, their FP32 sum
    rounded to BF16, bit for bit (the eager path's arithmetic, RotaryEmbedding.apply), for head dims 8-128, over values
    with NaN, infinities, denormals and zeros."""
    ops = _fused()
    gen = torch.Generator().manual_seed(d)
    hq, hkv, n = 3, 1, 5
    qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=gen) * 3
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-40, -1e-40, 0.0, -0.0, 3e38])
    qkv.view(-1)[torch.randperm(qkv.numel(), generator=gen)[: 4 * len(special)]] = special.repeat(4)
    qkv = qkv.bfloat16()
    angles = torch.rand(n, d, generator=gen) * 6
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    cos[0, 0], sin[1, 1] = float("nan"), 0.0
    k_cache, v_cache = torch.zeros(hkv, 4, 16, d, dtype=torch.bfloat16), torch.zeros(hkv, 4, 16, d, dtype=torch.bfloat16)
    slots = torch.tensor([0, 9, 17, 40, 63])
    q = ops.rope_and_cache(qkv, cos, sin, k_cache, v_cache, slots, hq, hkv)
    x = qkv[:, : (hq + hkv) * d].view(n, hq + hkv, d).float()
    rot = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
    a = (x * cos.float().unsqueeze(1)).bfloat16().float()
    b = (rot * sin.float().unsqueeze(1)).bfloat16().float()
    ref = (a + b).bfloat16()

    def same_bits(got, want):  # NaN where the reference has one (torch's conversion keeps a NaN's sign), else equal
        nan = want.isnan()
        return torch.equal(got.isnan(), nan) and torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))

    assert ref.isnan().any() and ref.isinf().any()
    assert same_bits(q, ref[:, :hq])
    assert same_bits(k_cache.view(hkv, -1, d)[0, slots], ref[:, hq])


# The decoder stack (inferd/model/csrc/decode_stack.cpp): a decode step's layers in one call, against the same
# step through the per-operator kernels as LlamaForCausalLM._forward_fused runs them.
def _stack_case(bias: bool, seed: int = 5, pairs: bool | None = None, inter: int = 532):
    from inferd.model.kernels import _has_avx2_fma, pack_panels_kernel

    if not _has_avx2_fma():
        pytest.skip("inferd's BF16 GEMM (and so the stack) is built for AVX2 + FMA CPUs only")
    gen = torch.Generator().manual_seed(seed)
    # inter = 532, not a multiple of 16: a partial panel, SiLU * up in a phase of its own, a row's in three items
    # (256, 256, 20 columns); 528 = 33 panels: SiLU * up inside the gate_up GEMM's loop, 64 columns at a time, the
    # last unit one panel. 6 + 2 + 2 heads: each attention item rotates its 3 query heads and its K head.
    hidden, hq, hkv, d = 192, 6, 2, 32
    pack = pack_panels_kernel()

    def rand(*shape, s=0.1):
        return (torch.randn(*shape, generator=gen) * s).bfloat16()

    layers = []
    for _ in range(3):
        layers.append({"input_norm": 1 + rand(hidden), "post_norm": 1 + rand(hidden),
                       "qkv": rand((hq + 2 * hkv) * d, hidden), "o": rand(hidden, hq * d),
                       "gate_up": rand(2 * inter, hidden), "down": rand(hidden, inter),
                       "bias": rand((hq + 2 * hkv) * d, s=0.5) if bias else None})
    for layer in layers:
        for name in ("qkv", "o", "gate_up", "down"):
            layer[name] = (pack(layer[name], None, pairs), layer[name].shape[0])
    return layers, 1 + rand(hidden), (hidden, inter, hq, hkv, d), gen


def _step_inputs(gen, dims, lens, block_size=16, num_blocks=64):
    hidden, _, hq, hkv, d = dims
    t = len(lens)
    perm = torch.randperm(num_blocks, generator=gen)
    max_blocks = -(-max(lens) // block_size)
    tables, used = [], 0
    for n in lens:
        nb = -(-n // block_size)
        tables.append(perm[used : used + nb].tolist() + [num_blocks] * (max_blocks - nb))
        used += nb
    tables = torch.tensor(tables)
    slots = torch.tensor([int(tables[i, (n - 1) // block_size]) * block_size + (n - 1) % block_size
                          for i, n in enumerate(lens)])
    angles = torch.tensor(lens).view(-1, 1).float() * torch.linspace(0.01, 1.0, d)
    caches = [((torch.randn(hkv, num_blocks + 1, block_size, d, generator=gen)).bfloat16(),
               (torch.randn(hkv, num_blocks + 1, block_size, d, generator=gen)).bfloat16()) for _ in range(3)]
    h = torch.randn(t, hidden, generator=gen)
    return h, angles.cos().bfloat16(), angles.sin().bfloat16(), caches, slots, tables, torch.arange(t), torch.tensor(lens)


def _per_operator(layers, norm, dims, h, cos, sin, caches, slots, tables, seq_idx, lens, scale, eps=1e-5,
                  num_decode=None):
    from inferd.model.kernels import panel_linear_kernel

    ops, lin = _fused(), panel_linear_kernel() or _fused().panel_linear
    _, _, hq, hkv, _ = dims
    n, delta = h.shape[0], None
    for layer, (k, v) in zip(layers, caches):
        x = ops.add_rms_norm(h, delta, layer["input_norm"], eps)
        qkv = lin(x, *layer["qkv"], layer["bias"], False)
        q = ops.rope_and_cache(qkv, cos, sin, k, v, slots, hq, hkv)
        nd = n if num_decode is None else num_decode
        attn = paged_attention(q, k, v, tables, seq_idx, lens, nd, scale).view(n, -1)
        # The o and down projections' FP32 sums into the FP32 residual stream, as LlamaForCausalLM._forward_fused
        x = ops.add_rms_norm(h, lin(attn, *layer["o"], None, True), layer["post_norm"], eps)
        delta = lin(ops.silu_mul(lin(x, *layer["gate_up"], None, False)), *layer["down"], None, True)
    return ops.add_rms_norm(h, delta, norm, eps)


def _stack(layers, norm, dims, bias):
    _, _, hq, hkv, d = dims
    weights = [w for layer in layers for w in (layer["input_norm"], layer["post_norm"], layer["qkv"][0],
                                                layer["o"][0], layer["gate_up"][0], layer["down"][0])]
    biases = [layer["bias"] for layer in layers] if bias else []
    return _fused().DecodeStack(weights, biases, norm, hq, hkv, d, 1e-5, d ** -0.5)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("pairs", [None, False], ids=["default-panels", "interleaved-panels"])
@pytest.mark.parametrize("inter", [532, 528])
def test_decode_stack_gives_the_per_operator_bits(bias, pairs, inter):
    """Every output row, the residual stream and every K/V cache entry written equal the per-operator path's bits,
    for 1, 3, 8 and 12 decode rows (8: more than one 6-row GEMM tile and the most whose norms every thread
    computes; 12: norms split between the threads) at contexts inside one block, across blocks and of different
    lengths in one batch; a row's output is the same alone and in the batch. With the CPU's default panels (BF16
    pairs where it has AVX512-BF16) and with the AVX2 kernel's interleaved ones."""
    layers, norm, dims, gen = _stack_case(bias, pairs=pairs, inter=inter)
    stack = _stack(layers, norm, dims, bias)
    for lens in ([1], [37, 5, 16], [17, 80, 3, 129, 64, 1, 250, 33], [9, 40, 2, 77, 16, 31, 100, 5, 64, 3, 18, 50]):
        h, cos, sin, caches, slots, tables, seq_idx, ctx = _step_inputs(gen, dims, lens)
        ref_h, ref_caches = h.clone(), [(k.clone(), v.clone()) for k, v in caches]
        ref = _per_operator(layers, norm, dims, ref_h, cos, sin, ref_caches, slots, tables, seq_idx, ctx,
                            dims[4] ** -0.5)
        got_h = h.clone()
        got = stack.run(got_h, cos, sin, [k for k, _ in caches], [v for _, v in caches], slots, tables, seq_idx, ctx,
                        len(lens))
        assert got.dtype == torch.bfloat16 and torch.equal(got, ref), lens
        assert torch.equal(got_h, ref_h)
        for (k, v), (rk, rv) in zip(caches, ref_caches):
            assert torch.equal(k, rk) and torch.equal(v, rv)
        i = len(lens) - 1  # the last row by itself: its own block table row, the same bits
        alone = stack.run(h[i:].clone(), cos[i:], sin[i:], [k for k, _ in caches], [v for _, v in caches],
                          slots[i:], tables[i:], torch.zeros(1, dtype=torch.long), ctx[i:], 1)
        assert torch.equal(alone[0], got[i])


def _mixed_inputs(gen, dims, decode_lens, chunks, block_size=16, num_blocks=96):
    """A step of decode rows (one per sequence, these context lengths) then prefill rows: per chunk (p0, n) a
    sequence's positions p0 .. p0 + n - 1 on consecutive rows (its keys before p0 already in the cache)."""
    hidden, _, hq, hkv, d = dims
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    ends = list(decode_lens) + [p0 + n for p0, n in chunks]  # each sequence's tokens in the cache after the step
    max_blocks = -(-max(ends) // block_size)
    tables, rows = [], []  # rows: (sequence, position) of each row of the step
    for i, end in enumerate(ends):
        nb = -(-end // block_size)
        tables.append([perm.pop() for _ in range(nb)] + [num_blocks] * (max_blocks - nb))
    for i, n in enumerate(decode_lens):
        rows.append((i, n - 1))
    for j, (p0, n) in enumerate(chunks):
        rows += [(len(decode_lens) + j, p) for p in range(p0, p0 + n)]
    tables = torch.tensor(tables)
    slots = torch.tensor([int(tables[i, p // block_size]) * block_size + p % block_size for i, p in rows])
    positions = torch.tensor([p for _, p in rows])
    angles = (positions + 1).view(-1, 1).float() * torch.linspace(0.01, 1.0, d)
    caches = [((torch.randn(hkv, num_blocks + 1, block_size, d, generator=gen)).bfloat16(),
               (torch.randn(hkv, num_blocks + 1, block_size, d, generator=gen)).bfloat16()) for _ in range(3)]
    h = torch.randn(len(rows), hidden, generator=gen)
    return (h, angles.cos().bfloat16(), angles.sin().bfloat16(), caches, slots, tables,
            torch.tensor([i for i, _ in rows]), positions + 1)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("inter", [532, 528])
def test_decode_stack_runs_prefill_rows_with_the_per_operator_bits(bias, inter):
    """A step with prefill rows through the stack (num_decode < T): every output row, the residual stream and every
    K/V cache entry equal the per-operator path's bits (paged_attention's decode and prefill kernels), for a prompt's
    first chunk beside two decode rows, a 33-row chunk (two tiles) and a single-row one beside a decode row, prefill
    rows alone (48, past a block boundary), and 96 rows; a prompt chunk's rows are the same alone and beside
    others."""
    layers, norm, dims, gen = _stack_case(bias, seed=11, inter=inter)
    stack = _stack(layers, norm, dims, bias)
    for decode_lens, chunks in (([37, 5], [(0, 20)]), ([100], [(40, 33), (7, 1)]), ([], [(16, 48)]),
                                ([9, 60, 3, 17], [(0, 50), (30, 42)])):
        h, cos, sin, caches, slots, tables, seq_idx, ctx = _mixed_inputs(gen, dims, decode_lens, chunks)
        nd = len(decode_lens)
        ref_h, ref_caches = h.clone(), [(k.clone(), v.clone()) for k, v in caches]
        ref = _per_operator(layers, norm, dims, ref_h, cos, sin, ref_caches, slots, tables, seq_idx, ctx,
                            dims[4] ** -0.5, num_decode=nd)
        got_h = h.clone()
        got = stack.run(got_h, cos, sin, [k for k, _ in caches], [v for _, v in caches], slots, tables, seq_idx, ctx,
                        nd)
        assert torch.equal(got, ref), (decode_lens, chunks)
        assert torch.equal(got_h, ref_h)
        for (k, v), (rk, rv) in zip(caches, ref_caches):
            assert torch.equal(k, rk) and torch.equal(v, rv)
        p0, n = chunks[-1]  # the last chunk alone: its own rows, the same bits
        alone = stack.run(h[-n:].clone(), cos[-n:], sin[-n:], [k for k, _ in caches], [v for _, v in caches],
                          slots[-n:], tables[-1:], torch.zeros(n, dtype=torch.long), ctx[-n:], 0)
        assert torch.equal(alone, got[-n:])
    for bad in (-1, h.shape[0] + 1):
        with pytest.raises(RuntimeError, match="num_decode must be in"):
            stack.run(h.clone(), cos, sin, [k for k, _ in caches], [v for _, v in caches], slots, tables, seq_idx,
                      ctx, bad)


def test_decode_stack_refuses_what_does_not_match():
    """Weights that do not fit together are refused when the stack is built; a step's slot, sequence index,
    context length or block id out of range is refused before anything is written."""
    layers, norm, dims, gen = _stack_case(False)
    stack = _stack(layers, norm, dims, False)
    with pytest.raises(RuntimeError, match="6 weights per layer"):
        _fused().DecodeStack([norm], [], norm, 6, 2, 32, 1e-5, 0.1)
    wrong = [dict(layer) for layer in layers]
    wrong[1]["o"] = layers[1]["gate_up"]
    with pytest.raises(RuntimeError, match="o must be packed panels"):
        _stack(wrong, norm, dims, False)
    h, cos, sin, caches, slots, tables, seq_idx, ctx = _step_inputs(gen, dims, [20, 40])
    ks, vs = [k for k, _ in caches], [v for _, v in caches]
    before = [k.clone() for k in ks]
    cap = ks[0].shape[1] * ks[0].shape[2]
    for args, match in (((slots + cap, tables, seq_idx, ctx), "slots"),
                        ((slots, tables, seq_idx + 2, ctx), "sequence indices"),
                        ((slots, tables, seq_idx, ctx * 0), "context lengths"),
                        ((slots, tables, seq_idx, ctx + 64), "context lengths"),
                        ((slots, tables + 100, seq_idx, ctx), "block ids")):
        with pytest.raises(RuntimeError, match=match):
            stack.run(h.clone(), cos, sin, ks, vs, *args, 2)
    with pytest.raises(RuntimeError, match="one K and one V cache per layer"):
        stack.run(h.clone(), cos, sin, ks[:2], vs[:2], slots, tables, seq_idx, ctx, 2)
    assert all(torch.equal(k, b) for k, b in zip(ks, before))
