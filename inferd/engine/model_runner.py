"""Turns a scheduler step into tensors, runs the model, samples.

Owns the KV cache: per layer a K and a V tensor ``[num_kv_heads, num_blocks + 1, block_size, head_dim]``
(the extra block is the null block used to pad block tables; it stays zero).
"""

from __future__ import annotations

import math
import mmap
from itertools import groupby

import torch

from inferd.engine.sampler import TokenLogprobs, logprobs_of, plain_greedy, sample
from inferd.engine.scheduler import SchedulerOutput
from inferd.engine.sequence import Sequence
from inferd.model.attention import (KEY_ALIGN, PREFILL_TILE, AttentionMetadata, DecodeGroup,
                                    PrefillGroup, attention_bias, key_len, length_bucket)
from inferd.model.kernels import paged_attention_fits, paged_attention_kernel
from inferd.model.llama import LlamaForCausalLM


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor for the KV cache. On a CPU its memory is an anonymous private mapping, which the OS
    hands out zero-filled and commits page by page on first write (mmap(2)): the process's resident size
    grows with the KV blocks actually written, up to the budget, and start-up does not write the whole
    budget (``torch.zeros`` does: 0.2-0.7 s for 0.5-1 GiB on this machine). Elsewhere ``torch.zeros``.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    buf = mmap.mmap(-1, max(numel * dtype.itemsize, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=dtype, count=numel).view(shape)  # the tensor keeps ``buf`` alive


class ModelRunner:
    """Runs one step of the model over the scheduled tokens.

    Args:
        model: the decoder.
        num_blocks: KV-cache blocks to allocate.
        block_size: tokens per block.

    The flat batch holds the decode rows first, then the prefill rows, then the padding that
    ``model.linear.padded_rows`` asks for.
    """

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int) -> None:
        cfg = model.config
        self.model = model
        self.device = model.device
        self.block_size = block_size
        self.key_align = max(KEY_ALIGN, block_size)  # both powers of two
        self.null_block = num_blocks
        # Attention of every row reading the KV blocks in place (CPU, compiled on first start), else gather + SDPA.
        self.paged = (paged_attention_kernel() if self.device.type == "cpu" and paged_attention_fits(
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) else None)
        shape = (cfg.num_key_value_heads, num_blocks + 1, block_size, cfg.head_dim)  # head-major
        self.kv_caches = [(zeroed(shape, model.dtype, self.device), zeroed(shape, model.dtype, self.device))
                          for _ in range(cfg.num_hidden_layers)]

    def _block_table(self, seq: Sequence, length: int) -> list[int]:
        nb = length // self.block_size
        table = seq.block_table[:nb]
        return table + [self.null_block] * (nb - len(table))

    def _prefill_group(self, seq: Sequence, row0: int, start: int, n: int) -> PrefillGroup:
        """SDPA path: a sequence's prefill rows (prompt tokens, always; output tokens when recomputed after
        preemption) at flat rows ``row0 ..``, positions ``start ..``: in tiles of PREFILL_TILE query rows aligned
        to absolute positions, each over the keys up to its own end, so a token is computed in the same tile slot
        over the same keys however its prompt was chunked."""
        dev = self.device
        t0 = start // PREFILL_TILE * PREFILL_TILE
        first = start - t0
        n_tiles = -(-(first + n) // PREFILL_TILE)
        tail = n_tiles * PREFILL_TILE - first - n
        key_lens = [key_len(t0 + (i + 1) * PREFILL_TILE, self.key_align) for i in range(n_tiles)]
        slot_pos = torch.arange(t0, t0 + n_tiles * PREFILL_TILE, device=dev).view(n_tiles, 1, PREFILL_TILE, 1)
        return PrefillGroup(
            token_idx=torch.tensor([row0] * first + list(range(row0, row0 + n)) + [row0] * tail, device=dev),
            first=first,
            rows=torch.arange(row0, row0 + n, device=dev),
            block_table=torch.tensor(self._block_table(seq, key_lens[-1]), device=dev),
            key_lens=key_lens,
            mask=attention_bias(torch.arange(key_lens[-1], device=dev).view(1, 1, 1, -1) <= slot_pos,
                                self.model.dtype))

    def _decode_groups(self, decode_rows: list[tuple[int, Sequence, int]]) -> list[DecodeGroup]:
        """SDPA path: decode rows (flat row, sequence, position) grouped by power-of-two context length."""
        dev = self.device
        groups = []
        decode_rows = sorted(decode_rows, key=lambda x: x[2])
        for _, grp in groupby(decode_rows, key=lambda x: length_bucket(x[2] + 1)):
            g = list(grp)
            length = key_len(g[-1][2] + 1, self.key_align)
            lens = torch.tensor([p + 1 for _, _, p in g], device=dev)
            visible = torch.arange(length, device=dev).view(1, 1, 1, -1) < lens.view(-1, 1, 1, 1)
            groups.append(DecodeGroup(
                token_idx=torch.tensor([row for row, _, _ in g], device=dev),
                block_tables=torch.tensor([self._block_table(s, length) for _, s, _ in g], device=dev),
                key_mask=attention_bias(visible, self.model.dtype),
                context_lens=lens))
        return groups

    def prepare(self, out: SchedulerOutput):
        """Build the flat batch.

        Returns:
            (input_ids [Tp] int64, positions [Tp] int64, AttentionMetadata, logits row indices [S] int64,
            the S sequences to sample for, prompt-logprob rows as (seq, flat row, next prompt token)).
        """
        bs = self.block_size
        dev = self.device
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_rows: list[tuple[int, Sequence, int]] = []  # (flat row, seq, position)
        prefill_groups: list[PrefillGroup] = []
        logits_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        prompt_rows: list[tuple[Sequence, int, int]] = []
        tables: list[list[int]] = []  # the paged kernel's block table, sequence index and context length per row
        seq_idx: list[int] = []
        context_lens: list[int] = []
        # Decode items (one generated token) first: their rows and the prefill rows are tiled apart.
        items = sorted(out.scheduled, key=lambda it: not it.seq.is_decoding)
        for item in items:
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            row0 = len(input_ids)
            pos = list(range(start, start + n))
            input_ids.extend(seq.tokens(start, start + n))
            positions.extend(pos)
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            if start + n == seq.num_tokens:
                logits_rows.append(row0 + n - 1)
                sample_seqs.append(seq)
            if seq.params.prompt_logprobs is not None:
                prompt_rows.extend((seq, row0 + p - start, seq.prompt_token_ids[p + 1]) for p in pos
                                   if len(seq.prompt_logprobs) <= p + 1 < seq.num_prompt_tokens)
            decode = seq.is_decoding
            if decode:
                decode_rows.append((row0, seq, start))
            if self.paged is not None:  # every row over its own keys 0..position
                seq_idx.extend([len(tables)] * n)
                context_lens.extend(range(start + 1, start + n + 1))
                tables.append(table)
            elif not decode:
                prefill_groups.append(self._prefill_group(seq, row0, start, n))
        decode_groups = self._decode_groups(decode_rows) if self.paged is None else []
        n_tok, n_dec = len(input_ids), len(decode_rows)
        pad = self.model.linear.padded_rows(n_dec, n_tok - n_dec) - n_tok
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, device=dev), num_tokens=n_tok,
                                 num_decode_tokens=n_dec, decode_groups=decode_groups,
                                 prefill_groups=prefill_groups, paged=self.paged)
        if self.paged is not None:
            width = max(len(t) for t in tables)
            meta.block_tables = torch.tensor([t + [self.null_block] * (width - len(t)) for t in tables], device=dev)
            meta.seq_idx = torch.tensor(seq_idx, device=dev)
            meta.context_lens = torch.tensor(context_lens, device=dev)
        ids = torch.tensor(input_ids + [0] * pad, device=dev)
        posn = torch.tensor(positions + [0] * pad, device=dev)
        rows = torch.tensor(logits_rows, device=dev, dtype=torch.long)
        return ids, posn, meta, rows, sample_seqs, prompt_rows

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput,
                eos_token_ids: frozenset[int] = frozenset()) -> list[tuple[Sequence, int, TokenLogprobs | None]]:
        """Run one step.

        Returns:
            (sequence, sampled token, its logprobs or None) for every sequence whose scheduled tokens
            reach its end (a partial prefill chunk samples nothing). Prompt logprobs are appended to
            ``seq.prompt_logprobs``.
        """
        ids, positions, meta, logits_rows, seqs, prompt_rows = self.prepare(out)
        hidden = self.model.forward(ids, positions, self.kv_caches, meta)
        if not seqs and not prompt_rows:
            return []
        if prompt_rows:
            extra = torch.tensor([r for _, r, _ in prompt_rows], device=self.device, dtype=torch.long)
            logits_rows = torch.cat([logits_rows, extra])
        h = hidden.index_select(0, logits_rows)
        s = h.shape[0]
        pad = self.model.linear.padded_rows(s, 0) - s
        if pad:
            h = torch.cat([h, h.new_zeros(pad, h.shape[1])])
        if not prompt_rows and all(plain_greedy(seq) for seq in seqs):
            # what sample() would pick from the logits, without writing them (LlamaForCausalLM.greedy_tokens)
            tokens = self.model.greedy_tokens(h, s)
            if tokens is not None:
                return [(seq, token, None) for seq, token in zip(seqs, tokens.tolist())]
        logits = self.model.compute_logits(h, s)
        if prompt_rows:
            entries = logprobs_of(logits[len(seqs):], [t for _, _, t in prompt_rows],
                                  [seq.params.prompt_logprobs for seq, _, _ in prompt_rows])
            for (seq, _, _), e in zip(prompt_rows, entries):
                seq.prompt_logprobs.append(e)
            logits = logits[: len(seqs)]
        if not seqs:
            return []
        tokens, logprobs = sample(logits, seqs, eos_token_ids)
        return list(zip(seqs, tokens, logprobs))
