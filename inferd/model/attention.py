"""Paged attention over a block-structured KV cache (Kwon et al. 2023, "Efficient Memory Management for
Large Language Model Serving with PagedAttention", arXiv:2309.06180). On CPU every query row of a step, decode
or prefill, goes to inferd's compiled kernel that reads the blocks in place (:mod:`inferd.model.kernels`;
``AttentionMetadata.paged``). Elsewhere (a GPU, or a CPU where the kernel could not be built) the blocks a
sequence uses are gathered, then attended with torch's fused ``scaled_dot_product_attention`` (a
FlashAttention-style kernel, Dao et al. 2022, arXiv:2205.14135, that never materialises the score matrix).

The KV cache of one layer is two tensors ``[num_kv_heads, num_blocks + 1, block_size, head_dim]``
(head-major, so that the keys one head gathers from a block table are already contiguous and go to the
attention GEMMs without another copy); the last block is a null block of zeros that pads block tables.
A token's K and V go to the flat slot ``block_id * block_size + offset`` given by the slot mapping.

A query row's result depends only on its own position and sequence, never on the batch (see
docs/architecture.md, "Determinism"). The compiled kernel computes each (query row, KV head) by itself over the
keys up to the row's position, so that holds by construction. On the SDPA path, decode rows are grouped by
context length and prefill rows go to torch's fused kernel in tiles of exactly ``PREFILL_TILE`` query rows
aligned to absolute positions, each tile over the keys up to its own end, so a prompt token always sits in the
same slot of the same tile over the same keys, whatever the chunking, the batch or the prefix cache. The one
measured property of the fused kernel this relies on: it computes each query row by itself, so the other rows of
a tile do not change its bits. (Its bits for a row do change with the key length on some CPUs, measured on an
AMD EPYC with torch 2.13 for lengths 208-272 against 160-192 and 288 up, and with the number of query rows.)
tests/test_model.py checks the result: every prompt token's logprobs are the same bits prefilled alone, in
chunks beside other requests and from the prefix cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

# Prefill query rows go to the kernel in tiles of exactly this many rows, aligned to absolute positions (its
# bits for a row change with the number of query rows in some cases, e.g. one row or 33 or 64 rows, measured on
# torch 2.13).
PREFILL_TILE = 16
# Key lengths are multiples of this (and of the block size).
KEY_ALIGN = 16


def key_len(n: int, align: int) -> int:
    """Keys, in tokens, a call attends over when its longest row sees ``n``: ``n`` rounded up to ``align``."""
    return -(-n // align) * align


def length_bucket(n: int) -> int:
    """Power-of-two bucket of a context length: decode rows of one bucket share a call."""
    return (n - 1).bit_length()


@dataclass
class DecodeGroup:
    """Decode rows (one query row per sequence) of several sequences attending over L keys.

    Attributes:
        token_idx: [b] int64, rows of these tokens in the flat batch.
        block_tables: [b, L // block_size] int64, padded with the null block.
        key_mask: [b, 1, 1, L] additive mask in the model dtype (:func:`attention_bias`): 0 for keys the row
            may see, -inf for the others.
        context_lens: [b] int64, keys each row sees (its position + 1).
    """

    token_idx: torch.Tensor
    block_tables: torch.Tensor
    key_mask: torch.Tensor
    context_lens: torch.Tensor


@dataclass
class PrefillGroup:
    """One sequence's prefill rows of a step, in tiles of ``PREFILL_TILE`` query rows aligned to absolute
    positions (a tile covers positions ``[t * PREFILL_TILE, (t + 1) * PREFILL_TILE)``), each tile attending over
    the keys up to its own end: a token is computed in the same slot of the same tile over the same keys whether
    its prompt was prefilled at once, in chunks beside other requests, or after a prefix-cache hit.

    Attributes:
        token_idx: [n_tiles * PREFILL_TILE] int64, the flat-batch row of each tile slot; slots outside this step's
            rows (before its first position, after its last) repeat its first row, and their results are dropped.
        first: the slot of the step's first row (its position modulo ``PREFILL_TILE``).
        rows: [n] int64, the flat-batch rows of the step's n prefill rows of this sequence.
        block_table: [key_lens[-1] // block_size] int64.
        key_lens: keys each tile attends over, in tokens (its end rounded up to the key alignment).
        mask: [n_tiles, 1, PREFILL_TILE, key_lens[-1]] additive mask in the model dtype (:func:`attention_bias`),
            causal by absolute position; tile i uses its first ``key_lens[i]`` columns.
    """

    token_idx: torch.Tensor
    first: int
    rows: torch.Tensor
    block_table: torch.Tensor
    key_lens: list[int]
    mask: torch.Tensor


@dataclass
class AttentionMetadata:
    """What every layer's attention needs for one step; built once by the model runner.

    Attributes:
        slot_mapping: [T] int64, KV-cache slot of each real token of the flat batch.
        num_tokens: T, real tokens (the batch may carry padding rows after them).
        num_decode_tokens: the first rows of the batch that are decode rows (one generated token of a
            sequence); the prefill rows follow them.
        paged: the compiled CPU kernel (:func:`inferd.model.kernels.paged_attention_kernel`) that attends every
            row over the KV blocks in place, with ``block_tables``, ``seq_idx`` and ``context_lens``; or None: the
            rows then go by ``decode_groups`` and ``prefill_groups`` to SDPA.
        block_tables: [S, max_blocks] int64, the block table of each scheduled sequence, padded with the null
            block (``paged`` only).
        seq_idx: [T] int64, each real row's sequence, a row of ``block_tables`` (``paged`` only).
        context_lens: [T] int64, the keys each real row attends over: its position + 1 (``paged`` only).
    """

    slot_mapping: torch.Tensor
    num_tokens: int
    num_decode_tokens: int = 0
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefill_groups: list[PrefillGroup] = field(default_factory=list)
    paged: Callable | None = None
    block_tables: torch.Tensor | None = None
    seq_idx: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None


def attention_bias(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """visible: [..., L] bool (True = the row may see the key) -> the same shape in ``dtype``: 0 where
    visible, -inf elsewhere.

    This is the additive mask torch's ``scaled_dot_product_attention`` builds from a bool mask in the query's
    dtype at every call, so passing it instead gives bit-identical results; the runner builds it once per
    step for all layers (a prefill call over 2,000 keys: 4.5 -> 3.2 ms in a micro-benchmark,
    docs/performance.md).
    """
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """The KV blocks a block table names, copied out contiguously.

    cache: [Hkv, num_blocks + 1, block_size, D]; block_tables: [...] int64 block ids ->
    [Hkv, block_tables.numel() * block_size, D]. ``index_select`` over the flattened blocks moves each block
    as one memcpy, about 2x faster than advanced indexing ``cache[:, block_tables]`` (docs/performance.md).
    """
    n_kv, _, bs, d = cache.shape
    return cache.view(n_kv, -1, bs * d).index_select(1, block_tables.reshape(-1)).view(n_kv, -1, d)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, key_mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """One query row per sequence: q [b, Hq, D]; keys, vals [Hkv, b, L, D]; key_mask [b, 1, 1, L] additive
    (:func:`attention_bias`) -> [b, Hq, D]."""
    b, n_head, d = q.shape
    o = F.scaled_dot_product_attention(q.view(b, n_head, 1, d), keys.transpose(0, 1), vals.transpose(0, 1),
                                       attn_mask=key_mask, scale=scale, enable_gqa=True)
    return o.view(b, n_head, d)


def paged_attention(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend.

    Args:
        q: [T, Hq, D]; k, v: [T, Hkv, D] (real tokens only), model dtype; None if already in the cache.
        k_cache, v_cache: [Hkv, num_blocks + 1, block_size, D].
        scale: softmax scale, usually ``D ** -0.5``.

    Returns:
        [T, Hq, D] attention output.
    """
    n_tok, n_head, d = q.shape
    n_kv = k_cache.shape[0]
    if k is not None:  # None: the caller has written them (inferd.model.kernels.fused_ops' rope_and_cache)
        k_cache.view(n_kv, -1, d).index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
        v_cache.view(n_kv, -1, d).index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
    if meta.paged is not None:
        return meta.paged(q.contiguous(), k_cache, v_cache, meta.block_tables, meta.seq_idx, meta.context_lens,
                          meta.num_decode_tokens, scale)
    out = q.new_empty(q.shape)  # contiguous (q may be a view into the fused QKV output)

    for g in meta.decode_groups:
        b = g.token_idx.shape[0]
        keys = gather_blocks(k_cache, g.block_tables).view(n_kv, b, -1, d)  # [Hkv, b, L, D]
        vals = gather_blocks(v_cache, g.block_tables).view(n_kv, b, -1, d)
        o = decode_attention(q.index_select(0, g.token_idx), keys, vals, g.key_mask, scale)
        out.index_copy_(0, g.token_idx, o)

    for g in meta.prefill_groups:
        n_tiles, _, tile, _ = g.mask.shape
        qg = q.index_select(0, g.token_idx).view(n_tiles, tile, n_head, d).transpose(1, 2)  # [n, Hq, t, D]
        keys = gather_blocks(k_cache, g.block_table).unsqueeze(0)  # [1, Hkv, L, D]
        vals = gather_blocks(v_cache, g.block_table).unsqueeze(0)
        o = torch.cat([F.scaled_dot_product_attention(qg[i : i + 1], keys[:, :, :length], vals[:, :, :length],
                                                      attn_mask=g.mask[i : i + 1, :, :, :length], scale=scale,
                                                      enable_gqa=True)
                       for i, length in enumerate(g.key_lens)])  # [n, Hq, t, D]
        o = o.transpose(1, 2).reshape(-1, n_head, d)  # [n * t, Hq, D]
        out.index_copy_(0, g.rows, o[g.first : g.first + g.rows.shape[0]])
    return out
