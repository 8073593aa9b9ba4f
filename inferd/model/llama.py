"""Llama-family decoder (Llama 2/3, SmolLM2, Qwen2 with QKV bias) over a flat batch of tokens.

There is no padding between sequences: a step's tokens from all scheduled requests form one
``[T, hidden]`` matrix, and the attention metadata says which rows belong together (nano-vllm's layout).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inferd.config import ModelConfig
from inferd.model.attention import AttentionMetadata, paged_attention
from inferd.model.layers import (BatchInvariantLinear, RotaryEmbedding, pack_linear_weight, rms_norm,
                                 rope_inv_freq, rows_invariant_up_to)

# Rows per GEMM where oneDNN's packed BF16 GEMMs give every row the same bits for any M up to it (checked
# at load; 32 on Sapphire Rapids, where 33 rows already differ): no padding, and 32 decode rows in one call.
RAGGED_TILE = 32
# Rows per GEMM elsewhere (FP32 and MKL, or a CPU where the probe fails): exactly this many, the batch padded.
PADDED_TILE = 16


class LlamaForCausalLM:
    """Weights and forward pass of a Llama/Qwen2 decoder.

    Args:
        config: the architecture.
        state_dict: Hugging Face-named tensors, any float dtype (see :mod:`inferd.model.loader`); each is read
            once and converted to ``dtype``, so a lazy mapping keeps only one source tensor alive at a time.
        dtype: serving dtype (``torch.bfloat16`` or ``torch.float32``).
        max_len: longest position to precompute RoPE tables for, in tokens.
        linear_tile: rows per GEMM (see :class:`BatchInvariantLinear`); 0 = one GEMM per op. Where the
            weights are packed for oneDNN and its rows are checked invariant up to ``RAGGED_TILE`` rows,
            GEMMs run in ragged tiles of that many rows instead and the batch needs no padding
            (``self.linear.row_multiple`` says what the caller pads to).

    Raises:
        KeyError: a weight is missing from the state dict.
    """

    def __init__(self, config: ModelConfig, state_dict: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, max_len: int, linear_tile: int) -> None:
        self.config = config
        self.dtype = dtype
        self.device = device
        self.scale = config.head_dim ** -0.5

        def w(name: str) -> torch.Tensor:  # a copy: the state dict's tensor may be a view of a mapped file
            return state_dict[name].to(device=device, dtype=dtype, copy=True).contiguous()

        self.embed = w("model.embed_tokens.weight")  # [V, hidden]
        self.lm_head = self.embed if config.tie_word_embeddings else w("lm_head.weight")
        self.norm = w("model.norm.weight")
        self.layers = []
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            layer = {
                "input_norm": w(p + "input_layernorm.weight"),
                "post_norm": w(p + "post_attention_layernorm.weight"),
                # Q, K and V fused into one [(Hq + 2 Hkv) * D, hidden] matrix, gate and up into one.
                "qkv": torch.cat([w(a + "q_proj.weight"), w(a + "k_proj.weight"), w(a + "v_proj.weight")]),
                "qkv_bias": (torch.cat([w(a + "q_proj.bias"), w(a + "k_proj.bias"), w(a + "v_proj.bias")])
                             if config.attention_bias else None),
                "o": w(a + "o_proj.weight"),
                "gate_up": torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")]),
                "down": w(p + "mlp.down_proj.weight"),
            }
            self.layers.append(layer)
        # Weights of the GEMMs packed once for the CPU's BF16 kernels (a no-op elsewhere); the embedding
        # table stays plain for the lookup, so a tied lm_head gets its own packed copy.
        for layer in self.layers:
            for name in ("qkv", "o", "gate_up", "down"):
                layer[name] = pack_linear_weight(layer[name], RAGGED_TILE)
        self.lm_head = pack_linear_weight(self.lm_head, RAGGED_TILE)
        first = [self.layers[0][name] for name in ("qkv", "o", "gate_up", "down")] + [self.lm_head]
        ragged = linear_tile and all(w.is_mkldnn for w in first) and rows_invariant_up_to(first, RAGGED_TILE)
        self.linear = BatchInvariantLinear(RAGGED_TILE, ragged=True) if ragged else BatchInvariantLinear(linear_tile)
        factors = state_dict.get("rope_freq_factors")
        inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling, factors)
        self.rotary = RotaryEmbedding(inv_freq, max_len, dtype, device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """Run the decoder over one step's flat batch.

        Args:
            input_ids: [Tp] int64, the real tokens then padding rows (Tp a multiple of
                ``self.linear.row_multiple``).
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
        lin = self.linear
        # The residual stream stays in FP32 whatever the serving dtype: in BF16 its rounding error
        # otherwise accumulates over the layers (matmuls and attention still run in the serving dtype).
        h = F.embedding(input_ids, self.embed).float()  # [Tp, hidden] FP32
        cos, sin = self.rotary.lookup(positions[:n])  # [n, 1, D] each, for every layer
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

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [S, hidden] (S a multiple of ``self.linear.row_multiple``) -> logits [S, V] FP32."""
        return self.linear(hidden, self.lm_head).float()
