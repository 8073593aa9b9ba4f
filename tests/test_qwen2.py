"""The Qwen2 path (QKV bias, untied head): a small random-weight Qwen2 saved as a safetensors folder,
against transformers' Qwen2ForCausalLM on the same weights, in FP32."""

from __future__ import annotations

import torch

from conftest import hf_greedy_tokens

from inferd import LLM, SamplingParams


def test_random_qwen2_matches_transformers(tmp_path, hf_model):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    _, tok = hf_model  # any tokenizer will do; the SmolLM2 one covers the vocabulary
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # random biases, so the bias path matters
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    model.save_pretrained(tmp_path, safe_serialization=True)
    tok.save_pretrained(tmp_path)
    assert not list(tmp_path.glob("*.bin"))

    prompts = ["Hello there", "The quick brown fox", "1 2 3 4"]
    expected = hf_greedy_tokens(model, tok, prompts, 12)

    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory_bytes=16 * 1024**2)
    assert llm.engine.model_config.architecture == "qwen2" and llm.engine.model_config.attention_bias
    got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in got] == expected
