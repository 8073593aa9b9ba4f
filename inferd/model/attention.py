"""Paged attention over a block-structured KV cache (Kwon et al. 2023, "Efficient Memory Management for
Large Language Model Serving with PagedAttention", arXiv:2309.06180), in plain torch ops.

The KV cache of one layer is two tensors ``[num_kv_heads, num_blocks + 1, block_size, head_dim]``
(head-major, so that the keys one head gathers from a block table are already contiguous and go to the
attention GEMMs without another copy); the last block is a null block of zeros that pads block tables.
A token's K and V go to the flat slot ``block_id * block_size + offset`` given by the slot mapping.

Shapes are chosen so that a query row's result depends only on its own position and sequence, never on
the batch (see docs/architecture.md, "Determinism"):
- every row attends over ``padded_len(position + 1)`` keys (a power of two, at least 64), the keys past
  its context masked out;
- prefill rows are processed in tiles of ``PREFILL_TILE`` rows; decode rows one per sequence, batched
  over sequences that share a padded length (bmm results do not depend on the batch count).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

PREFILL_TILE = 16
MIN_PADDED_LEN = 64


def padded_len(n: int) -> int:
    """Key length, in tokens, that a query with ``n`` visible keys attends over: the next power of two,
    at least ``MIN_PADDED_LEN``."""
    return max(MIN_PADDED_LEN, 1 << (n - 1).bit_length())


@dataclass
class DecodeGroup:
    """Decode rows of several sequences sharing one padded key length L.

    Attributes:
        token_idx: [b] int64, rows of these tokens in the flat batch.
        block_tables: [b, L // block_size] int64, padded with the null block.
        key_mask: [b, 1, 1, L] bool, True for keys the row may see.
    """

    token_idx: torch.Tensor
    block_tables: torch.Tensor
    key_mask: torch.Tensor


@dataclass
class PrefillGroup:
    """Consecutive prefill rows of one sequence sharing one padded key length L, in tiles.

    Attributes:
        token_idx: [n_tiles * PREFILL_TILE] int64, rows of the flat batch; padding repeats the first row.
        num_valid: real rows (the first ``num_valid`` of ``token_idx``).
        block_table: [L // block_size] int64.
        mask: [n_tiles, 1, PREFILL_TILE, L] bool, causal mask by absolute position.
    """

    token_idx: torch.Tensor
    num_valid: int
    block_table: torch.Tensor
    mask: torch.Tensor


@dataclass
class AttentionMetadata:
    """What every layer's attention needs for one step; built once by the model runner.

    Attributes:
        slot_mapping: [T] int64, KV-cache slot of each real token of the flat batch.
        num_tokens: T, real tokens (the batch may carry padding rows after them).
    """

    slot_mapping: torch.Tensor
    num_tokens: int
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefill_groups: list[PrefillGroup] = field(default_factory=list)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend.

    Args:
        q: [T, Hq, D]; k, v: [T, Hkv, D] (real tokens only), model dtype.
        k_cache, v_cache: [Hkv, num_blocks + 1, block_size, D].
        scale: softmax scale, usually ``D ** -0.5``.

    Returns:
        [T, Hq, D] attention output.
    """
    n_tok, n_head, d = q.shape
    n_kv = k.shape[1]
    group = n_head // n_kv
    k_cache.view(n_kv, -1, d).index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
    v_cache.view(n_kv, -1, d).index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
    out = torch.empty_like(q)

    for g in meta.decode_groups:
        b = g.token_idx.shape[0]
        # [Hkv * b, G, D]: heads outermost, as the cache.
        qg = q.index_select(0, g.token_idx).view(b, n_kv, group, d).transpose(0, 1).reshape(n_kv * b, group, d)
        keys = k_cache[:, g.block_tables].view(n_kv * b, -1, d)  # [Hkv * b, L, D], contiguous
        vals = v_cache[:, g.block_tables].view(n_kv * b, -1, d)
        scores = torch.bmm(qg, keys.transpose(1, 2)).float() * scale  # [Hkv * b, G, L]
        scores = scores.view(n_kv, b, group, -1).masked_fill_(~g.key_mask.view(1, b, 1, -1), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype).view(n_kv * b, group, -1)
        o = torch.bmm(probs, vals).view(n_kv, b, group, d)  # [Hkv, b, G, D]
        out.index_copy_(0, g.token_idx, o.transpose(0, 1).reshape(b, n_head, d))

    for g in meta.prefill_groups:
        tile = g.mask.shape[2]
        n_tiles = g.mask.shape[0]
        qg = q.index_select(0, g.token_idx).view(n_tiles, tile, n_kv, group, d)
        qg = qg.permute(0, 2, 3, 1, 4).reshape(n_tiles, n_kv, group * tile, d)
        keys = k_cache[:, g.block_table].view(n_kv, -1, d)  # [Hkv, L, D]
        vals = v_cache[:, g.block_table].view(n_kv, -1, d)
        scores = torch.matmul(qg, keys.transpose(1, 2).unsqueeze(0)).float() * scale  # [n, Hkv, G*t, L]
        scores = scores.view(n_tiles, n_kv, group, tile, -1)
        scores.masked_fill_(~g.mask.unsqueeze(1), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype).view(n_tiles, n_kv, group * tile, -1)
        o = torch.matmul(probs, vals.unsqueeze(0))  # [n, Hkv, G*t, D]
        o = o.view(n_tiles, n_kv, group, tile, d).permute(0, 3, 1, 2, 4).reshape(-1, n_head, d)
        out.index_copy_(0, g.token_idx[: g.num_valid], o[: g.num_valid])
    return out
