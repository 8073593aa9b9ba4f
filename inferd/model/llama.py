"""Llama-family decoder (Llama 2/3, SmolLM2, Qwen2 with QKV bias) over a flat batch of tokens.

There is no padding between sequences: a step's tokens from all scheduled requests form one
``[T, hidden]`` matrix, and the attention metadata says which rows belong together (nano-vllm's layout).
"""

from __future__ import annotations

import functools
import itertools

import torch
import torch.nn.functional as F

from inferd.config import ModelConfig
from inferd.model.attention import AttentionMetadata, paged_attention
from inferd.model.kernels import fused_ops, paged_attention_fits, panel_linear_kernel
from inferd.model.layers import (BatchInvariantLinear, PanelWeight, RotaryEmbedding, pack_linear_weight, panel_buffers,
                                 rms_norm, rope_inv_freq, rows_invariant_in_tiles, rows_invariant_up_to)
from inferd.model.loader import SafetensorsStateDict

# Rows per GEMM where oneDNN's packed BF16 GEMMs give every row the same bits for any M up to it (checked
# at load; 32 on Sapphire Rapids, where 33 rows already differ): no padding, and 32 decode rows in one call.
RAGGED_TILE = 32
# Rows per GEMM elsewhere (FP32 and MKL, or a CPU where the probe fails): exactly this many, the batch padded.
PADDED_TILE = 16
# Rows per GEMM of the prefill rows where the ragged tiles apply and a fixed M of this many rows is checked
# to give a row the same bits wherever it sits (the step's prefill rows are padded to a multiple of it).
# Measured against 32 and 128 (docs/performance.md): 64 is 1.3-1.5x faster than 32-row tiles from 60 prompt
# tokens up, and pads a short prompt less than 128 (a 16-token prefill 1.18x slower instead of 1.54x).
PREFILL_GEMM_TILE = 64
# The engine uses the fixed prefill tiles only when a step may carry at least this many tokens: with a
# smaller max_num_batched_tokens (chosen for inter-token latency), a step's decode rows and its few prefill
# rows fit one ragged 32-row GEMM, while apart they would read every weight twice.
PREFILL_TILES_MIN_BUDGET = 2 * PREFILL_GEMM_TILE
# Steps with prompt rows run in the compiled decoder stack where it is built up to this many rows (one OpenMP region
# a step instead of a parallel region per kernel call: 1.01-1.12x, docs/performance.md, stop 40); larger ones per
# operator, whose GEMMs split many rows by panels in 96-row passes (panel_gemm.cpp's kMChunk). Decode-only steps
# run there whatever their size.
STACK_MAX_ROWS = 96
# Bytes of a step's gate_up output per pass of the MLP over the step's rows, where inferd's panel GEMM serves (its
# rows do not depend on M, so the passes give the same bits). In one pass a 2,048-row prefill of SmolLM2-135M
# allocated per layer a 6.3 MB SiLU product, and everywhere but AMX a 12.6 MB gate_up output before it (25 MB in
# FP32). glibc keeps freed memory for the next step (loader's keep_freed_heap): the heap grew ~150 MiB from idle to
# the peak while the run held at most ~44 MB live at once, and at the peak ~210 MiB of the heap was free memory glibc
# kept: peak RSS 904-926 MiB on issue 6's 32-stream workload. In passes of 512 rows (3 MiB): 824-825 MiB, the
# prefill step's time unchanged (docs/performance.md, stop 48).
MLP_PASS_BYTES = 3 * 2**20


class LlamaForCausalLM:
    """Weights and forward pass of a Llama/Qwen2 decoder.

    Args:
        config: the architecture.
        state_dict: Hugging Face-named tensors, any float dtype (see :mod:`inferd.model.loader`); each is read
            once and converted to ``dtype``, so a lazy mapping keeps only one source tensor alive at a time.
        dtype: serving dtype (``torch.bfloat16`` or ``torch.float32``).
        max_len: longest position to precompute RoPE tables for, in tokens.
        linear_tile: rows per GEMM (see :class:`BatchInvariantLinear`); 0 = one GEMM per op. Where inferd's
            panel kernel serves (``self.gemm == "panel"``, BF16 or FP32), one GEMM per op whatever this says: the
            kernel's rows are invariant by construction. Where the weights are packed for oneDNN and its rows are
            checked invariant up to ``RAGGED_TILE`` rows,
            GEMMs run in ragged tiles of that many rows instead and the decode rows need no padding; the
            prefill rows then go in tiles of ``PREFILL_GEMM_TILE`` rows where that is checked invariant too
            and ``prefill_tiles`` is set (``self.linear.padded_rows`` says what the caller pads to).
        prefill_tiles: allow the fixed prefill tiles; the engine sets it from its token budget per step, as
            a step's few prefill rows padded to a tile cost more than they save (docs/performance.md).

    Raises:
        KeyError: a weight is missing from the state dict.
        ValueError: a weight whose shape does not match the config (head_dim x heads, hidden, intermediate, vocab).
    """

    def __init__(self, config: ModelConfig, state_dict: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, max_len: int, linear_tile: int, prefill_tiles: bool = True) -> None:
        self.config = config
        self.dtype = dtype
        self.device = device
        self.scale = config.head_dim ** -0.5

        hq, hkv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
        hidden, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
        # By the end of the Hugging Face name ("norm.weight": the final norm and both layer norms).
        shapes = {"embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden), "norm.weight": (hidden,),
                  "q_proj.weight": (hq, hidden), "k_proj.weight": (hkv, hidden),
                  "v_proj.weight": (hkv, hidden), "o_proj.weight": (hidden, hq), "q_proj.bias": (hq,),
                  "k_proj.bias": (hkv,), "v_proj.bias": (hkv,), "gate_proj.weight": (inter, hidden),
                  "up_proj.weight": (inter, hidden), "down_proj.weight": (hidden, inter)}

        def w(name: str) -> torch.Tensor:  # a copy: the state dict's tensor may be a view of a mapped file
            t = state_dict[name]
            expected = next((v for k, v in shapes.items() if name.endswith(k)), None)
            if expected is not None and tuple(t.shape) != expected:  # a checkpoint that does not match its config
                raise ValueError(f"{name}: shape {list(t.shape)}, but the model's config needs {list(expected)}")
            out = t.to(device=device, dtype=dtype, copy=True).contiguous()
            if isinstance(state_dict, SafetensorsStateDict):
                state_dict.release(t)  # its file pages leave the resident size
            return out

        self.embed = w("model.embed_tokens.weight")  # [V, hidden]
        self.lm_head = self.embed if config.tie_word_embeddings else w("lm_head.weight")
        self.norm = w("model.norm.weight")
        # The GEMMs' weights are packed once for the CPU's kernels (a no-op elsewhere) as each layer is read, so
        # that at most one layer's plain weights sit beside the packed ones; inferd's panels are written into one buffer
        # in huge pages (panel_buffers). A tied lm_head gets its own packed copy, and the plain embedding table stays
        # for the lookup where the packed one cannot serve it.
        gemms = [(hq + 2 * hkv, hidden), (hidden, hq), (2 * inter, hidden), (hidden, inter)]
        panels = panel_buffers(gemms * config.num_hidden_layers + [(vocab, hidden)], dtype, device)
        self.panel_buffer = panels[0] if panels is not None else None  # moved to huge pages by collapse_weights()
        outs = iter(panels[1] if panels is not None else itertools.repeat(None))

        def pack(weight: torch.Tensor) -> torch.Tensor | PanelWeight:
            return pack_linear_weight(weight, RAGGED_TILE, out=next(outs))

        self.layers = []
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            layer = {  # (the GEMMs in the order of ``gemms``)
                "input_norm": w(p + "input_layernorm.weight"),
                "post_norm": w(p + "post_attention_layernorm.weight"),
                # Q, K and V fused into one [(Hq + 2 Hkv) * D, hidden] matrix, gate and up into one.
                "qkv": pack(torch.cat([w(a + "q_proj.weight"), w(a + "k_proj.weight"), w(a + "v_proj.weight")])),
                "qkv_bias": (torch.cat([w(a + "q_proj.bias"), w(a + "k_proj.bias"), w(a + "v_proj.bias")])
                             if config.attention_bias else None),
                "o": pack(w(a + "o_proj.weight")),
                "gate_up": pack(torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")])),
                "down": pack(w(p + "mlp.down_proj.weight")),
            }
            self.layers.append(layer)
        plain_lm_head = self.lm_head
        self.lm_head = pack_linear_weight(self.lm_head, RAGGED_TILE, out_fp32=True, out=next(outs))
        first = [self.layers[0][name] for name in ("qkv", "o", "gate_up", "down")] + [self.lm_head]
        # Which GEMM serves: "onednn" (packed for oneDNN, with AMX), "panel" (inferd's kernel), "torch".
        self.gemm = "onednn" if first[0].is_mkldnn else "panel" if isinstance(first[0], PanelWeight) else "torch"
        # Plain [V, hidden] rows of the lm_head for re-scoring near-tied logits in FP32 (compute_logits) where
        # its GEMM rounds them to BF16: the embedding itself when tied, else a second copy beside the packed one.
        self.lm_head_rows = plain_lm_head if dtype != torch.float32 and self.gemm != "panel" else None
        # A tied table packed in panels serves the embedding lookup too (embed_tokens): no plain copy beside it
        # (56.6 MB for SmolLM2-135M).
        if config.tie_word_embeddings and self.gemm == "panel":
            self.embed = None
        ragged = linear_tile and self.gemm == "onednn" and rows_invariant_up_to(first, RAGGED_TILE)
        if self.gemm == "panel":  # every output element one FMA chain over K: invariant for any rows, no tiles
            self.linear = BatchInvariantLinear(0)
        elif ragged:
            tiled = prefill_tiles and rows_invariant_in_tiles(first[:4], PREFILL_GEMM_TILE)
            prefill = PREFILL_GEMM_TILE if tiled else 0
            self.linear = BatchInvariantLinear(RAGGED_TILE, ragged=True, prefill_tile=prefill)
        else:
            self.linear = BatchInvariantLinear(linear_tile)
        # Element-wise ops compiled for the CPU (inferd.model.kernels.fused_ops), None elsewhere.
        self.fused = fused_ops() if device.type == "cpu" else None
        # Every layer of a decode-only step, or of a step with prompt rows of up to stack_max_rows rows, in one
        # compiled call where inferd's GEMM serves, else None. (Only for head shapes the attention kernel takes: the
        # runner attends through SDPA otherwise.) stack_max_rows = 0: steps with prompt rows per operator (the
        # baseline of benchmarks/ab_stack_steps.py).
        self.stack_max_rows = STACK_MAX_ROWS
        # Rows per pass of the per-operator path's MLP: MLP_PASS_BYTES of gate_up, 512 in BF16 and 256 in FP32 for
        # SmolLM2-135M; a multiple of 32 (the GEMM's row tile), so that only the last pass has a partial tile.
        row_bytes = 2 * config.intermediate_size * dtype.itemsize
        self.mlp_rows = max(32, MLP_PASS_BYTES // row_bytes // 32 * 32)
        fits = paged_attention_fits(config.num_attention_heads, config.num_key_value_heads, config.head_dim)
        self.stack = (decode_stack(self.fused, self.layers, self.norm, config, self.scale)
                      if self.fused is not None and self.gemm == "panel" and dtype == torch.bfloat16 and fits
                      else None)
        factors = state_dict.get("rope_freq_factors")
        inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling, factors)
        self.rotary = RotaryEmbedding(inv_freq, max_len, dtype, device)

    def collapse_weights(self) -> bool:
        """Move the packed GEMM weights into transparent huge pages (:meth:`inferd.model.layers.HugePageBuffer.collapse`: blocks for
        0.1-1.1 s, so call it off the serving path; the weights stay readable meanwhile). Returns whether it
        did: False where no panels are packed (other GEMM paths) or the kernel cannot."""
        return self.panel_buffer is not None and self.panel_buffer.collapse()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """Run the decoder over one step's flat batch.

        Args:
            input_ids: [Tp] int64, the real tokens (``meta.num_decode_tokens`` decode rows first, then the
                prefill rows) then padding rows (Tp is ``self.linear.padded_rows`` of the two counts).
            positions: [Tp] int64, each token's position in its sequence.
            kv_caches: per layer (k_cache, v_cache), each [Hkv, num_blocks + 1, block_size, D].
            meta: attention metadata for the first ``meta.num_tokens`` rows.

        Returns:
            [Tp, hidden] final hidden states after the last RMSNorm, in the serving dtype (padding rows
            are garbage).
        """
        cfg = self.config
        n = meta.num_tokens
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        if self.gemm == "panel":  # one kernel call per GEMM (no tiles): skip the tiling wrapper's Python
            kernel = panel_linear_kernel()

            def lin(x: torch.Tensor, w: PanelWeight, b: torch.Tensor | None = None, fp32: bool = False,
                    into: torch.Tensor | None = None) -> torch.Tensor:
                return kernel(x, w.data, w.out_features, b, w.out_fp32 or fp32, into)
        else:
            tiled = functools.partial(self.linear, num_decode=meta.num_decode_tokens)

            def lin(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, fp32: bool = False,
                    into: torch.Tensor | None = None) -> torch.Tensor:
                # oneDNN's and torch's GEMMs return the serving dtype; `into` (FP32) += that output exactly
                return tiled(x, w, b) if into is None else into.add_(tiled(x, w, b))
        # The residual stream stays in FP32 whatever the serving dtype: in BF16 its rounding error
        # otherwise accumulates over the layers (matmuls and attention still run in the serving dtype).
        h = self.embed_tokens(input_ids).float()  # [Tp, hidden] FP32
        cos, sin = self.rotary.lookup(positions[:n])  # [n, 1, D] each, for every layer
        if (self.stack is not None and meta.paged is not None and n == h.shape[0]
                and (meta.num_decode_tokens == n or n <= self.stack_max_rows)):
            return self.stack.run(h, cos.view(n, -1), sin.view(n, -1), [k for k, _ in kv_caches],
                                  [v for _, v in kv_caches], meta.slot_mapping, meta.block_tables, meta.seq_idx,
                                  meta.context_lens, meta.num_decode_tokens)
        if self.fused is not None:
            return self._forward_fused(h, cos, sin, kv_caches, meta, lin)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = rms_norm(h, layer["input_norm"], eps, self.dtype)
            qkv = lin(x, layer["qkv"], layer["qkv_bias"])  # [Tp, (Hq + 2 Hkv) * D]
            qk = self.rotary.apply(qkv[:n, : (hq + hkv) * d].view(n, hq + hkv, d), cos, sin)  # one rotation
            v = qkv[:n, (hq + hkv) * d :].view(n, hkv, d)
            attn = paged_attention(qk[:, :hq], qk[:, hq:], v, k_cache, v_cache, meta, self.scale)
            if n < h.shape[0]:
                attn = torch.cat([attn.view(n, hq * d), attn.new_zeros(h.shape[0] - n, hq * d)])
            h = h + lin(attn.view(h.shape[0], hq * d), layer["o"])  # BF16 promoted to FP32 exactly, one op
            x = rms_norm(h, layer["post_norm"], eps, self.dtype)
            gate, up = lin(x, layer["gate_up"]).chunk(2, dim=-1)
            h = h + lin(F.silu(gate) * up, layer["down"])
        return rms_norm(h, self.norm, eps, self.dtype)

    def _forward_fused(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                       lin) -> torch.Tensor:
        """:meth:`forward` with each layer's element-wise work in inferd's compiled ops (every step on a CPU
        where they are built, so a row never changes path with the batch): the residual add and RMSNorm in one
        pass, RoPE with the K/V cache write, SiLU with the product. The same operations in the same rounding
        points as the torch path, about 40 fewer operator calls per layer (docs/performance.md)."""
        cfg, ops = self.config, self.fused
        n, hq, hkv, eps = meta.num_tokens, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.rms_norm_eps
        pad = h.shape[0] - n  # padding rows of the GEMM tiles (none with inferd's kernel)
        cos, sin = cos.view(n, -1), sin.view(n, -1)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = ops.add_rms_norm(h, None, layer["input_norm"], eps)
            qkv = lin(x, layer["qkv"], layer["qkv_bias"])
            q = ops.rope_and_cache(qkv, cos, sin, k_cache, v_cache, meta.slot_mapping, hq, hkv)
            if meta.paged is not None:  # the kernel directly (q is contiguous: rope_and_cache's output)
                attn = meta.paged(q, k_cache, v_cache, meta.block_tables, meta.seq_idx, meta.context_lens,
                                  meta.num_decode_tokens, self.scale).view(n, -1)
            else:
                attn = paged_attention(q, None, None, k_cache, v_cache, meta, self.scale).view(n, -1)
            if pad:
                attn = torch.cat([attn, attn.new_zeros(pad, attn.shape[1])])
            # The o and down projections' FP32 sums go into the FP32 residual stream unrounded where inferd's GEMM
            # serves (docs/performance.md, stop 28: closer to FP32's logits, and the README's answer under AMX),
            # added to h by the GEMM itself (`into`: no [T, hidden] FP32 delta written and read back, stop 31).
            lin(attn, layer["o"], fp32=True, into=h)
            x = ops.add_rms_norm(h, None, layer["post_norm"], eps)
            if self.gemm == "panel":  # gate_up and SiLU * up in one pass where it can (AMX), the same bits
                for r in range(0, h.shape[0], self.mlp_rows):  # rows in passes: see MLP_PASS_BYTES
                    mlp = ops.panel_linear_silu(x[r:r + self.mlp_rows], layer["gate_up"].data, cfg.intermediate_size)
                    lin(mlp, layer["down"], fp32=True, into=h[r:r + self.mlp_rows])
                    del mlp  # before the next pass allocates its own
            else:
                lin(ops.silu_mul(lin(x, layer["gate_up"])), layer["down"], fp32=True, into=h)
        return ops.add_rms_norm(h, None, self.norm, eps)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Rows of the embedding table: input_ids [T] int64 -> [T, hidden] in the serving dtype. Where the table
        is only kept packed in the lm_head's panels (``PanelWeight``: token r is column ``r % 16`` of panel
        ``r // 16``, at ``[r // 16, :, r % 16, :]`` in BF16 pairs, ``[r // 16, :, r % 8, r % 16 // 8]`` in
        interleaved BF16, ``[r // 16, :, r % 16 // 8, r % 8]`` in FP32), gathered from there: the same values."""
        if self.embed is not None:
            return F.embedding(input_ids, self.embed)
        col = input_ids % 16
        if self.lm_head.pairs:
            return self.lm_head.data[input_ids // 16, :, col, :].reshape(input_ids.shape[0], -1)
        if self.dtype == torch.bfloat16:
            return self.lm_head.data[input_ids // 16, :, col % 8, col // 8]
        return self.lm_head.data[input_ids // 16, :, col // 8, col % 8]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, num_rows: int) -> torch.Tensor:
        """Logits of the final hidden states.

        hidden: [Sp, hidden] in the serving dtype (Sp a multiple of ``self.linear.row_multiple``), of which the
        first ``num_rows`` are real -> [num_rows, V] FP32.
        In BF16 oneDNN's GEMM output is rounded to BF16 (steps of 0.125 near a logit of 25), which is enough
        to reorder near-tied tokens; the tokens within that rounding of each row's maximum are computed again
        in FP32 (:func:`refine_near_max`), so greedy choices and top log-probabilities are those of an
        FP32-output GEMM over the same BF16 hidden state (inferd's panel kernel returns FP32 logits directly).
        """
        logits = self.linear(hidden, self.lm_head)[:num_rows].float()
        if self.lm_head_rows is not None:
            refine_near_max(logits, hidden[:num_rows], self.lm_head_rows)
        return logits

    def greedy_tokens(self, hidden: torch.Tensor, num_rows: int) -> torch.Tensor | None:
        """Each row's greedy token without the logits: the ids ``argmax_rows(compute_logits(hidden, num_rows))``
        gives ([num_rows] int64; the first of equal largest logits, the first NaN of a row that has one), from
        ``panel_linear_argmax``, which keeps each row's largest FP32 sum as the lm_head's tiles produce it instead
        of writing [rows, vocab] FP32 logits (on AMX: 25 MB a step fewer at 128 rows, docs/performance.md, stop
        52). None where the lm_head is not inferd's panel GEMM on a CPU (the caller computes the logits)."""
        if not isinstance(self.lm_head, PanelWeight) or hidden.device.type != "cpu":
            return None
        ops = fused_ops()
        if ops is None:
            return None
        return ops.panel_linear_argmax(hidden, self.lm_head.data, self.lm_head.out_features)[:num_rows]


def decode_stack(ops, layers: list[dict], norm: torch.Tensor, config: ModelConfig, scale: float):
    """The compiled decoder stack (inferd/model/csrc/decode_stack.cpp) over these layers' BF16 weights, their GEMM
    weights packed in inferd's kernel's panels (:class:`PanelWeight`): ``stack.run(h, cos, sin, k_caches, v_caches,
    slot_mapping, block_tables, seq_idx, context_lens, num_decode)`` runs every layer of a step, its ``num_decode``
    decode rows first then prefill rows, in one OpenMP region (one call instead of nine kernel calls per layer:
    docs/performance.md, stops 19 and 40) and returns the final RMSNorm, [T, hidden] BF16. Each row is computed by
    the functions the per-operator kernels call, so its bits are those of :meth:`LlamaForCausalLM._forward_fused`,
    which serves steps with prompt rows of more than ``STACK_MAX_ROWS`` rows. For head shapes the attention kernel takes
    (:func:`inferd.model.kernels.paged_attention_fits`).

    Raises:
        RuntimeError: weights whose shapes do not fit the config, or head shapes outside those.
    """
    weights = [t for layer in layers for t in (layer["input_norm"], layer["post_norm"], layer["qkv"].data,
                                                layer["o"].data, layer["gate_up"].data, layer["down"].data)]
    biases = [layer["qkv_bias"] for layer in layers] if config.attention_bias else []
    return ops.DecodeStack(weights, biases, norm, config.num_attention_heads, config.num_key_value_heads,
                           config.head_dim, config.rms_norm_eps, scale)


def refine_near_max(logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, block: int = 256,
                    chunk: int = 4096) -> None:
    """Recompute in FP32, in place, every logit that BF16 output rounding could have placed at or below
    its row's maximum although it is the largest.

    A BF16 value's rounding error is at most half a unit in the last place, 2**-8 of its magnitude, so the
    true largest logit of a row is within 2**-7 |max| of the rounded maximum; every token within 2**-6
    |max| (at least 2**-6) of it is recomputed as an FP32 dot product of the BF16 hidden state and the BF16
    weight row (the products are exact in FP32). The candidates are found block by block (``block``
    columns; 0.7 ms for 32 rows of 49,152 logits instead of 3.9 ms comparing every logit) and recomputed
    ``chunk`` at a time, so a row whose logits are all nearly equal (every token a candidate) costs time,
    not a [V, hidden] FP32 temporary per row. Each logit depends only on its own row, so this keeps the
    engine's batch invariance.

    Args:
        logits: [S, V] FP32, the GEMM's output cast from BF16; updated in place.
        hidden: [S, hidden] BF16, the GEMM's input.
        weight: [V, hidden] BF16, the lm_head (plain layout).
    """
    s, vocab = logits.shape
    top = logits.amax(dim=-1, keepdim=True)
    threshold = top - top.abs().clamp_min(1.0) * 2**-6  # [S, 1]
    main = vocab // block * block
    blocks = logits[:, :main].view(s, -1, block)  # [S, V // block, block]
    r, b = (blocks.amax(dim=-1) >= threshold).nonzero(as_tuple=True)  # blocks holding a candidate
    i, c = (blocks[r, b] >= threshold[r]).nonzero(as_tuple=True)
    rows, cols = r[i], b[i] * block + c
    if main < vocab:
        tail_rows, tail_cols = (logits[:, main:] >= threshold).nonzero(as_tuple=True)
        rows, cols = torch.cat([rows, tail_rows]), torch.cat([cols, tail_cols + main])
    exact = torch.empty(rows.shape[0], dtype=torch.float32, device=logits.device)
    for i in range(0, rows.shape[0], chunk):  # one pass unless a row's logits are nearly flat
        r, c = rows[i : i + chunk], cols[i : i + chunk]
        exact[i : i + chunk] = (hidden.index_select(0, r).float() * weight.index_select(0, c).float()).sum(dim=-1)
    logits.index_put_((rows, cols), exact)
