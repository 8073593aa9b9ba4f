"""The compiled CPU decode attention kernel (inferd/model/csrc/paged_decode_attention.cpp) against the torch
path it replaces: gather the sequence's KV blocks, then scaled_dot_product_attention."""

from __future__ import annotations

import pytest
import torch

from inferd.model.attention import attention_bias, decode_attention, gather_blocks
from inferd.model.kernels import paged_decode_attention_kernel

kernel = paged_decode_attention_kernel()
pytestmark = pytest.mark.skipif(kernel is None, reason="no C++ toolchain here: the engine uses gather + SDPA")


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


@pytest.mark.parametrize("dtype,shape", [
    (torch.bfloat16, (9, 3, 64)),   # SmolLM2: the compiled fast path
    (torch.float32, (9, 3, 64)),
    (torch.bfloat16, (14, 2, 64)),  # Qwen2-0.5B's heads: the general path
    (torch.float32, (4, 4, 32)),    # no GQA
])
def test_matches_gather_and_sdpa(dtype, shape):
    """Each row as close to an FP64 reference as the SDPA path is, for contexts that end inside a block,
    on a block boundary, span one key or many blocks."""
    num_heads, num_kv, head_dim = shape
    lens = [1, 15, 16, 17, 100, 333, 64]
    q, k_cache, v_cache, tables, ctx = _case(dtype, num_heads, num_kv, head_dim, lens)
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


def test_a_row_does_not_depend_on_the_batch():
    """The same bits for a sequence alone and in any batch (each (sequence, KV head) is one work item)."""
    q, k_cache, v_cache, tables, ctx = _case(torch.bfloat16, 9, 3, 64, [40, 300, 7, 129, 16, 250, 90, 1] * 4,
                                             num_blocks=400)
    batch = kernel(q, k_cache, v_cache, tables, ctx, 0.125)
    for i in (0, 1, 5, 31):
        alone = kernel(q[i : i + 1].contiguous(), k_cache, v_cache, tables[i : i + 1].contiguous(), ctx[i : i + 1], 0.125)
        assert torch.equal(alone[0], batch[i])


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
