"""The model against the reference implementation (Hugging Face transformers) and the numerics that
make batching invisible."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import collapse_supported, hf_greedy_tokens

from inferd import LLM, SamplingParams
from inferd.model.attention import attention_bias
from inferd.model.kernels import onednn_bf16_gemm, panel_linear_kernel
from inferd.model.layers import (BatchInvariantLinear, PanelWeight, pack_linear_weight, panel_buffers,
                                 rows_invariant_in_tiles, rows_invariant_up_to, takes_panels)
from inferd.model.llama import PREFILL_GEMM_TILE, STACK_MAX_ROWS, refine_near_max
from inferd.model.loader import SafetensorsStateDict, unpermute_qk

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
    "Water boils at",
    "In 1492, Columbus",
    "import numpy as np\nx = np.",
]
NEW_TOKENS = 32


def hf_greedy(hf_model, prompt_ids: list[int], n: int) -> list[int]:
    """Plain argmax decoding with transformers' KV cache, past EOS (no logits processors)."""
    model, _ = hf_model
    out, past, ids = [], None, torch.tensor([prompt_ids])
    with torch.no_grad():
        for _ in range(n):
            # `cache`: transformers 5.24's name for what was `past_key_values` (deprecated, warned about in CI)
            res = model(input_ids=ids, cache=past, use_cache=True)
            past = res.cache
            nxt = int(res.logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.tensor([[nxt]])
    return out


@pytest.fixture(scope="module")
def reference(hf_model):
    _, tok = hf_model
    ids = [tok.encode(p) for p in PROMPTS]
    return ids, [hf_greedy(hf_model, i, NEW_TOKENS) for i in ids]


def test_greedy_matches_transformers_alone_and_batched(llm_fp32, reference):
    prompt_ids, expected = reference
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    alone = [llm_fp32.generate([ids], params)[0].outputs[0].token_ids for ids in prompt_ids]
    batched = [o.outputs[0].token_ids for o in llm_fp32.generate(prompt_ids, params)]
    for i in range(len(PROMPTS)):
        assert alone[i] == expected[i], f"prompt {i} alone differs from transformers"
        assert batched[i] == expected[i], f"prompt {i} batched differs from transformers"


def test_greedy_matches_transformers_without_the_cpu_kernel(reference, monkeypatch):
    """Where the CPU kernels cannot be built (no C++ compiler) or are turned off, attention gathers the KV blocks
    for SDPA (the path CUDA takes too): the same tokens as transformers, batched and (one prompt, to keep the
    suite's time: this path is several times slower) alone."""
    from inferd.model import kernels

    monkeypatch.setenv("INFERD_CPU_KERNELS", "0")
    kernels.reset()
    try:
        llm = LLM(dtype="float32", kv_cache_memory_bytes=128 * 1024**2, max_model_len=2048)
        assert llm.engine.runner.paged is None
        prompt_ids, expected = reference
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        alone = llm.generate([prompt_ids[4]], params)[0].outputs[0].token_ids  # the chat prompt, the longest
        batched = [o.outputs[0].token_ids for o in llm.generate(prompt_ids, params)]
        assert alone == expected[4] and batched == expected
    finally:
        kernels.reset()  # the next engine loads the kernels again


def test_safetensors_folder_matches_gguf(tmp_path, hf_model, reference):
    """The same weights saved by transformers as a safetensors folder load through the other path."""
    from safetensors.torch import save_file

    model, tok = hf_model
    weights = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    save_file(weights, str(tmp_path / "model.safetensors"))
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    tok.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory_bytes=128 * 1024**2, max_model_len=2048)
    prompt_ids, expected = reference
    out = llm.generate(prompt_ids[:2], SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in out] == expected[:2]


def test_unpermute_inverts_llama_cpp_permutation():
    n_head, head_dim, cols = 3, 8, 5
    w = np.arange(n_head * head_dim * cols, dtype=np.float32).reshape(n_head * head_dim, cols)
    # llama.cpp's convert_hf_to_gguf permute: reshape(n_head, 2, dim/2, ...).swapaxes(1, 2)
    permuted = w.reshape(n_head, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(w.shape)
    np.testing.assert_array_equal(unpermute_qk(permuted, n_head), w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_rows_do_not_depend_on_the_batch(dtype):
    torch.manual_seed(0)
    lin = BatchInvariantLinear(16)
    w = torch.randn(1536, 576).to(dtype)
    rows = torch.randn(64, 576).to(dtype)
    alone = lin(torch.cat([rows[:1], torch.zeros(15, 576, dtype=dtype)]), w)[0]
    for n in (16, 32, 48, 64):
        batch = torch.cat([rows[1:n], rows[:1]])  # the row moves to the end of a bigger batch
        assert torch.equal(lin(batch, w)[-1], alone)


def test_packed_weights_give_the_unpacked_results():
    """BF16 weights packed once for oneDNN (CPUs with native BF16 matmul and AMX) give exactly F.linear's result, with
    and without bias, alone and tiled. On other AVX2 CPUs they are packed for inferd's kernel instead, whose
    result is an FP64 reference rounded once to BF16 (tests/test_kernels.py has the kernel's own checks), and FP32
    weights too, within FP32 summation error; elsewhere the weight stays plain."""
    torch.manual_seed(0)
    lin = BatchInvariantLinear(16)
    for out_features, in_features in ((960, 576), (576, 1536), (4096, 576)):
        w = torch.randn(out_features, in_features).to(torch.bfloat16)
        b = torch.randn(out_features).to(torch.bfloat16)
        packed = pack_linear_weight(w, 16)
        assert packed.shape == w.shape
        x = torch.randn(48, in_features).to(torch.bfloat16)
        if onednn_bf16_gemm():
            assert packed.is_mkldnn
            assert torch.equal(lin(x, packed), lin(x, w))
            assert torch.equal(lin(x, packed, b), lin(x, w, b))
            assert torch.equal(BatchInvariantLinear(0)(x[:5], packed), F.linear(x[:5], w))
        elif panel_linear_kernel() is not None:
            assert isinstance(packed, PanelWeight) and packed.dtype == torch.bfloat16
            exact = x.double() @ w.double().T + b.double()
            ours = BatchInvariantLinear(0)(x, packed, b)
            assert ours.dtype == torch.bfloat16
            # One BF16 rounding (half a unit in the last place, 2**-9 relative) of an FP32 sum.
            assert ((ours.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-3).all()
        else:
            assert packed is w
    fp32 = w.float()
    packed = pack_linear_weight(fp32, 16)
    if takes_panels(torch.float32, fp32.device):  # inferd's kernel reads FP32 weights too: FP32 sums, FP32 out
        assert isinstance(packed, PanelWeight) and packed.dtype == torch.float32 and packed.out_fp32
        x = torch.randn(48, fp32.shape[1])
        exact = x.double() @ fp32.double().T + b.double()
        ours = BatchInvariantLinear(0)(x, packed, b)
        assert ours.dtype == torch.float32
        bound = 4 * fp32.shape[1] * 2**-24 * (x.double().abs() @ fp32.double().abs().T + b.double().abs())
        assert ((ours.double() - exact).abs() <= bound).all()
    else:
        assert packed is fp32  # MKL's FP32 GEMM serves


def test_ragged_tiles_only_where_rows_are_invariant():
    """The load-time probe picks ragged 32-row tiles (no padding) only where every row's bits are the same
    for any M up to 32; whichever tiling it picks, a row's result does not depend on the batch."""
    torch.manual_seed(0)
    w = torch.randn(3072, 576).to(torch.bfloat16)
    packed = pack_linear_weight(w, 32)
    ragged = rows_invariant_up_to([packed], 32)
    # MKL's FP32 GEMM changes a row's result with M (gemv for one row): the probe must say no.
    assert not rows_invariant_up_to([w.float()], 32)
    lin = BatchInvariantLinear(32, ragged=True) if ragged else BatchInvariantLinear(16)
    rows = torch.randn(70, 576).to(torch.bfloat16)
    pad = lin.row_multiple - 1
    alone = lin(torch.cat([rows[:1], rows.new_zeros(pad, 576)]), packed)[0]
    for n in (1, 2, 7, 31, 32, 33, 64, 70):
        batch = torch.cat([rows[1:n], rows[:1]])
        extra = (-n) % lin.row_multiple
        batch = torch.cat([batch, rows.new_zeros(extra, 576)])
        assert torch.equal(lin(batch, packed)[n - 1], alone), n
    if packed.is_mkldnn or isinstance(packed, PanelWeight):  # oneDNN's packed BF16 kernels, or inferd's
        assert ragged and lin.row_multiple == 1


def test_prefill_rows_in_fixed_tiles_only_where_invariant():
    """The load-time probe puts prefill rows in fixed 64-row tiles only where a row's bits then depend
    neither on its place in the tile nor on the other rows; with them, a prompt row gives the same result
    whatever the decode rows before it and the prefill rows around it."""
    torch.manual_seed(0)
    w = torch.randn(1536, 576).to(torch.bfloat16)
    packed = pack_linear_weight(w, 32)
    if isinstance(packed, PanelWeight):  # inferd's AVX2 kernel: any rows, anywhere, give the same bits
        rows = torch.randn(300, 576).to(torch.bfloat16)
        alone = BatchInvariantLinear(0)(rows[:1], packed)[0]
        for before, after in ((0, 0), (3, 10), (50, 77), (63, 0), (200, 99)):
            x = torch.cat([rows[1 : 1 + before], rows[:1], rows[1 + before : 1 + before + after]])
            assert torch.equal(BatchInvariantLinear(0)(x, packed)[before], alone), (before, after)
        return
    if not packed.is_mkldnn:
        pytest.skip("neither oneDNN BF16 nor AVX2 on this CPU: prefill rows stay in the model's 16-row tiles")
    assert rows_invariant_in_tiles([packed], PREFILL_GEMM_TILE)
    lin = BatchInvariantLinear(32, ragged=True, prefill_tile=PREFILL_GEMM_TILE)
    rows = torch.randn(400, 576).to(torch.bfloat16)
    probe = rows[:1]
    alone = lin(torch.cat([probe, rows.new_zeros(PREFILL_GEMM_TILE - 1, 576)]), packed, num_decode=0)[0]
    for n_dec, before, after in ((0, 0, 0), (3, 0, 10), (31, 50, 77), (40, 63, 0), (1, 200, 150)):
        n_pre = before + 1 + after
        pad = lin.padded_rows(n_dec, n_pre) - n_dec - n_pre
        assert pad == (-n_pre) % PREFILL_GEMM_TILE
        x = torch.cat([rows[100 : 100 + n_dec], rows[1 : 1 + before], probe, rows[200 : 200 + after],
                       rows.new_zeros(pad, 576)])
        y = lin(x, packed, num_decode=n_dec)
        assert torch.equal(y[n_dec + before], alone), (n_dec, before, after)
        if n_dec:  # decode rows keep their ragged tiles
            assert torch.equal(y[:n_dec], lin(x[:n_dec], packed))
    with pytest.raises(ValueError):
        lin(rows[: PREFILL_GEMM_TILE + 2], packed, num_decode=0)  # prefill rows not padded to the tile


def test_bf16_logits_near_the_maximum_are_recomputed_in_fp32():
    """The BF16 lm_head rounds logits to 8 significant bits (0.125 near 25): the tokens that rounding could
    reorder are recomputed in FP32, so each row's largest logit and its argmax are those of an FP32-output
    GEMM over the same BF16 inputs, while the other logits keep their BF16 values."""
    torch.manual_seed(0)
    weight = (torch.randn(5000, 576) * 0.05).to(torch.bfloat16)
    hidden = (torch.randn(24, 576) * 3).to(torch.bfloat16)
    hidden[5:] = hidden[4]  # rows 4..23 identical: a tie resolved the same in every row
    hidden[3] = 0  # all logits 0: every token a candidate (more than one chunk of 4,096)
    exact = hidden.double() @ weight.double().T  # [24, 5000], exact products, FP64 sums
    rounded = F.linear(hidden, weight).float()
    logits = rounded.clone()
    refine_near_max(logits, hidden, weight, block=256)  # 5000 = 19 blocks + a tail of 136 columns
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))
    assert torch.allclose(logits.max(-1).values.double(), exact.max(-1).values, rtol=0, atol=1e-4)
    assert torch.equal(logits[3], torch.zeros(5000))
    changed = logits != rounded
    assert changed.any() and (changed.sum(-1) < 50).all()  # only candidates near the top are touched
    top = rounded.amax(-1, keepdim=True)
    assert (rounded[changed.nonzero(as_tuple=True)] >= (top - top.abs().clamp_min(1) / 64).expand_as(rounded)[changed]).all()
    assert (logits[4:] == logits[4]).all()  # a row's result does not depend on the others


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_additive_attention_masks_give_the_bool_masks_bits(dtype):
    """The runner builds each step's masks once as additive masks (attention_bias) instead of bool masks
    that scaled_dot_product_attention converts in every layer: the attention output must be the same bits."""
    torch.manual_seed(0)
    for b, t, length in ((8, 16, 208), (5, 1, 64)):  # prefill tiles, decode rows
        q = torch.randn(b, 9, t, 64).to(dtype)
        k, v = torch.randn(2, b, 3, length, 64).to(dtype)
        visible = torch.rand(b, 1, t, length) > 0.4
        visible[..., 0] = True
        bias = attention_bias(visible, dtype)
        assert bias.dtype == dtype and set(bias.unique().tolist()) == {0.0, float("-inf")}
        with_bool = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=0.125, enable_gqa=True)
        with_bias = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=0.125, enable_gqa=True)
        assert torch.equal(with_bool, with_bias)


def _trace(llm: LLM, rid: str, ids: list[int], params: SamplingParams, others: list[list[int]] = ()):
    """(output tokens, their logprobs with top-k, prompt logprobs, cached prompt tokens) of one request,
    run beside ``others``."""
    eng = llm.engine
    for i, o in enumerate(others):
        eng.add_request(f"{rid}-other{i}", o, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    eng.add_request(rid, ids, params)
    tokens, lps, prompt_lps, cached = [], [], None, None
    while eng.has_unfinished():
        for out in eng.step():
            if out.request_id == rid:
                tokens += out.delta_token_ids
                lps += [(e.token_id, e.logprob, e.top) for e in out.delta_logprobs or []]
                prompt_lps = out.prompt_logprobs or prompt_lps
                cached = out.num_cached_tokens
    return tokens, lps, prompt_lps, cached


def test_logits_bit_identical_alone_chunked_batched_and_from_prefix_cache():
    """What makes chunked prefill and prefix caching invisible: every prompt token's logprobs and the
    output's logprobs are the same floats whether the prompt was prefilled alone in one step, in chunks of
    150 tokens (prefill tiles cut at other places) beside other requests, or with its first blocks taken
    from the prefix cache (BF16, the default). An engine with a token budget under
    PREFILL_TILES_MIN_BUDGET keeps its prefill rows in the ragged tiles (other bits than the default's):
    there too, a prompt chunked beside other requests gives the bits it gives alone."""
    kw = dict(dtype="bfloat16", kv_cache_memory_bytes=64 * 1024**2, max_model_len=2048)
    one = LLM(enable_prefix_caching=False, **kw)
    ids = one.engine.encode(" ".join(f"Item {i}: the {w} of {i * 7 % 13}." for i, w in
                                     enumerate(["colour", "weight", "price", "size", "age"] * 8)))
    assert len(ids) > 250
    others = [one.engine.encode(p) for p in PROMPTS[:3]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3, prompt_logprobs=3)
    alone = _trace(one, "alone", ids, params)
    assert len(alone[2]) == len(ids) and len(alone[1]) == 12
    del one

    chunked = LLM(enable_prefix_caching=False, max_num_batched_tokens=150, **kw)
    # Fixed prefill tiles with oneDNN; inferd's AVX2 kernel needs no tiles (its rows are invariant for any M).
    tiles = chunked.engine.runner.model.gemm == "onednn"
    assert chunked.engine.runner.model.linear.prefill_tile == (PREFILL_GEMM_TILE if tiles else 0)
    assert _trace(chunked, "chunked", ids, params, others)[:3] == alone[:3]
    del chunked

    small = LLM(enable_prefix_caching=False, max_num_batched_tokens=40, **kw)
    assert small.engine.runner.model.linear.prefill_tile == 0
    small_alone = _trace(small, "alone", ids, params)
    assert _trace(small, "beside", ids, params, others)[:3] == small_alone[:3]
    del small

    cached = LLM(enable_prefix_caching=True, **kw)
    _trace(cached, "warm", ids[:200] + others[0], SamplingParams(temperature=0, max_tokens=1))
    no_prompt_lps = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    tokens, lps, _, n_cached = _trace(cached, "hit", ids, no_prompt_lps, others)
    assert n_cached >= 192 and (tokens, lps) == (alone[0], alone[1])



def test_decode_stack_gives_the_per_operator_logits():
    """Decode-only steps run through the compiled decoder stack, steps with prefill rows per operator: a generated
    token's logprobs are the same floats either way (both add the o and down projections' FP32 sums to the residual
    stream, for one), for one sequence and for three decoding together."""
    llm = LLM(dtype="bfloat16", kv_cache_memory_bytes=64 * 1024**2, max_model_len=2048, enable_prefix_caching=False)
    model = llm.engine.runner.model
    if model.gemm != "panel":  # oneDNN's or torch's GEMMs: no stack, every step per operator
        assert model.stack is None
        return
    assert model.stack is not None
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
    ids = llm.engine.encode(PROMPTS[0])
    others = [llm.engine.encode(p) for p in PROMPTS[1:3]]
    stacked = [_trace(llm, "stack", ids, params)[:2], _trace(llm, "stack-3", ids, params, others)[:2]]
    model.stack = None
    per_operator = [_trace(llm, "ops", ids, params)[:2], _trace(llm, "ops-3", ids, params, others)[:2]]
    assert stacked == per_operator


def test_steps_with_prefill_rows_give_the_same_logits_in_the_stack():
    """Steps of up to STACK_MAX_ROWS rows with prefill rows (here a prompt in 40-token chunks beside three decoding
    requests) run in the compiled stack: every prompt token's logprobs and the output's are the same floats as
    through the per-operator path, for those steps alone (stack_max_rows = 0) or for every step."""
    llm = LLM(dtype="bfloat16", kv_cache_memory_bytes=64 * 1024**2, max_model_len=2048, enable_prefix_caching=False,
              max_num_batched_tokens=40)
    model = llm.engine.runner.model
    if model.stack is None:  # oneDNN's or torch's GEMMs: every step per operator
        return
    ids = llm.engine.encode(" ".join(f"Item {i}: the {w} of {i * 7 % 13}." for i, w in
                                     enumerate(["colour", "weight", "price", "size"] * 4)))
    assert len(ids) > 3 * 40
    others = [llm.engine.encode(p) for p in PROMPTS[:3]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3, prompt_logprobs=3)
    calls = []
    run = model.stack.run
    model.stack = type("Counting", (), {"run": lambda self, *a: calls.append((a[-1], a[0].shape[0])) or run(*a)})()
    stacked = _trace(llm, "stack", ids, params, others)[:3]
    assert any(nd < rows for nd, rows in calls) and any(0 < nd < rows for nd, rows in calls)  # prefill rows went in
    calls.clear()
    model.stack_max_rows = 0  # steps with prompt rows per operator, decode-only steps still in the stack
    assert _trace(llm, "mixed-ops", ids, params, others)[:3] == stacked
    assert calls and all(nd == rows for nd, rows in calls)
    model.stack = None
    assert _trace(llm, "ops", ids, params, others)[:3] == stacked


def test_mlp_in_row_passes_gives_the_one_pass_logits():
    """The per-operator path runs a large step's MLP over its rows in passes of ``mlp_rows`` rows (MLP_PASS_BYTES of
    gate_up output each, for the peak RSS): a prompt prefilled in one step, alone and in a step beside three decoding
    requests, gives the same prompt and output logprobs, as floats, and the others the same output logprobs, in
    passes of 32 rows as in one pass."""
    llm = LLM(dtype="bfloat16", kv_cache_memory_bytes=64 * 1024**2, max_model_len=2048, enable_prefix_caching=False,
              max_prefill_tokens_with_decodes=0)  # the whole prompt in the step beside the decoding requests
    model = llm.engine.runner.model
    if model.gemm != "panel":
        pytest.skip("oneDNN's or torch's GEMMs serve on this CPU: one pass (their rows' bits depend on the tiles)")
    assert model.mlp_rows == 512  # SmolLM2-135M's 1,536-wide MLP in BF16: 3 MiB of gate_up output
    ids = llm.engine.encode(" ".join(f"Item {i}: the {w} of {i * 7 % 13}." for i, w in
                                     enumerate(["colour", "weight", "price", "size", "age"] * 8)))
    assert len(ids) > 250 > STACK_MAX_ROWS  # one step, per operator
    others = [llm.engine.encode(p) for p in PROMPTS[:3]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3, prompt_logprobs=3)
    steps, forward = [], model.forward
    model.forward = lambda *a: steps.append((a[3].num_decode_tokens, a[3].num_tokens)) or forward(*a)

    def run(rows: int) -> list:
        model.mlp_rows = rows
        eng, got = llm.engine, {}
        alone = _trace(llm, f"{rows}-alone", ids, params)[:3]
        for i, o in enumerate(others):
            eng.add_request(f"{rows}-other{i}", o, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                                  logprobs=3))
        eng.step()  # their prompts: from the next step on they decode
        eng.add_request(f"{rows}-beside", ids, params)
        steps.clear()
        while eng.has_unfinished():
            for out in eng.step():
                rid = out.request_id.split("-", 1)[1]
                tokens, lps, prompt_lps = got.setdefault(rid, ([], [], []))
                tokens += out.delta_token_ids
                lps += [(e.token_id, e.logprob, e.top) for e in out.delta_logprobs or []]
                prompt_lps += out.prompt_logprobs or []
        assert steps[0] == (len(others), len(others) + len(ids))  # the prompt's rows beside the decode rows
        return [alone, got]

    one_pass = run(1 << 20)
    assert len(one_pass[1]["beside"][2]) == len(ids) and one_pass[1]["beside"][0] == one_pass[0][0]
    assert run(32) == one_pass


def test_logits_bit_identical_alone_and_chunked_on_the_sdpa_path(monkeypatch):
    """The path of a GPU, or of a CPU without the compiled kernels (prefill rows in position-aligned SDPA tiles,
    decode rows grouped by length): prompt logprobs and output logprobs the same floats alone and chunked beside
    other requests."""
    from inferd.model import kernels

    monkeypatch.setenv("INFERD_CPU_KERNELS", "0")
    kernels.reset()
    try:
        kw = dict(dtype="float32", kv_cache_memory_bytes=64 * 1024**2, max_model_len=1024, enable_prefix_caching=False)
        one = LLM(**kw)
        assert one.engine.runner.paged is None
        ids = one.engine.encode(" ".join(f"Item {i}: the {w} of {i * 7 % 13}." for i, w in
                                         enumerate(["colour", "weight", "price", "size"] * 6)))[:170]
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=3)
        alone = _trace(one, "alone", ids, params)
        del one
        chunked = LLM(max_num_batched_tokens=50, **kw)
        others = [chunked.engine.encode(p) for p in PROMPTS[:2]]
        assert _trace(chunked, "chunked", ids, params, others)[:3] == alone[:3]
    finally:
        kernels.reset()


def test_bf16_default_answers_and_is_batch_invariant():
    """In the default dtype, every prompt gives the same greedy tokens alone and in a batch; the embedding lookup
    gives the checkpoint's table, also where it reads the lm_head's packed copy (AVX2: no plain copy is kept)."""
    from inferd.config import default_model_path
    from inferd.model.loader import load_checkpoint

    llm = LLM(dtype="bfloat16", kv_cache_memory_bytes=64 * 1024**2, max_model_len=2048)
    model = llm.engine.runner.model
    table = load_checkpoint(default_model_path()).state_dict["model.embed_tokens.weight"].to(torch.bfloat16)
    assert torch.equal(model.embed_tokens(torch.arange(table.shape[0])), table)
    assert (model.embed is None) == (model.gemm == "panel")
    tok = llm.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     tokenize=False, add_generation_prompt=True)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32))[0].outputs[0]
    assert "Paris" in out.text
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in PROMPTS]
    batched = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert batched == alone


def _anon_huge_pages_kib(start: int, end: int) -> int:
    """AnonHugePages (KiB) of this process's mappings overlapping [start, end) (proc(5), /proc/PID/smaps)."""
    total, overlaps = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                overlaps = lo < end and hi > start
            elif head == "AnonHugePages:" and overlaps:
                total += int(line.split()[1])
    return total


def test_gemm_panels_share_one_buffer_in_huge_pages():
    """Where inferd's AVX2 GEMM serves, the panels of every GEMM weight (each layer's four and the lm_head) lie in
    one buffer from a 2 MiB boundary, 64-byte aligned and back to back, which LLM() moves into transparent huge
    pages (docs/performance.md, stop 21: a single-stream step 10% shorter); the greedy answer is unchanged (the
    other tests here check the bits)."""
    llm = LLM(dtype="bfloat16", kv_cache_memory_bytes=64 * 1024**2, max_model_len=2048)
    model = llm.engine.runner.model
    if model.gemm != "panel":  # oneDNN's packed weights, or torch's: no panels to place
        assert panel_buffers([(16, 16)], torch.bfloat16, torch.device("cpu")) is None
        return
    data = [layer[n].data for layer in model.layers for n in ("qkv", "o", "gate_up", "down")] + [model.lm_head.data]
    spans = sorted((d.data_ptr(), d.data_ptr() + d.numel() * d.element_size()) for d in data)
    assert spans[0][0] % (2 << 20) == 0 and all(start % 64 == 0 for start, _ in spans)
    assert all(0 <= b - a < 64 for (_, a), (b, _) in zip(spans, spans[1:]))
    size = spans[-1][1] - spans[0][0]
    assert size == sum(d.numel() * 2 for d in data) + sum(b - a for (_, a), (b, _) in zip(spans, spans[1:]))
    # LLM() has collapsed them already (a second call finds them in huge pages); MADV_COLLAPSE is Linux 6.1's.
    able = collapse_supported()
    assert model.collapse_weights() == able
    if able:
        assert _anon_huge_pages_kib(spans[0][0], spans[-1][1]) * 1024 >= size // 2
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    assert "Paris" in out.text


def write_small_gguf(path, seed: int = 0) -> None:
    """A two-layer llama GGUF written by gguf's own writer: the embedding in Q8_0, the matrices in Q4_1 and the
    norms in F32, as in the default model's file (which takes ~10 s to read; this one a fraction of a second)."""
    import gguf

    rng = np.random.default_rng(seed)
    hidden, ffn, heads, kv_heads, vocab = 64, 128, 4, 2, 256
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def add(name, shape, qtype):
        a = rng.standard_normal(shape, dtype=np.float32)
        if qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, a)
        else:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)

    q4, f32 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.F32
    add("token_embd.weight", (vocab, hidden), gguf.GGMLQuantizationType.Q8_0)
    add("output_norm.weight", (hidden,), f32)
    kv_dim = hidden // heads * kv_heads
    for i in range(2):
        for name, shape, qtype in [("attn_norm", (hidden,), f32), ("ffn_norm", (hidden,), f32),
                                   ("attn_q", (hidden, hidden), q4), ("attn_k", (kv_dim, hidden), q4),
                                   ("attn_v", (kv_dim, hidden), q4), ("attn_output", (hidden, hidden), q4),
                                   ("ffn_gate", (ffn, hidden), q4), ("ffn_up", (ffn, hidden), q4),
                                   ("ffn_down", (hidden, ffn), q4)]:
            add(f"blk.{i}.{name}.weight", shape, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_checkpoint_cache_is_bit_identical_keyed_by_content_and_self_healing(tmp_path, monkeypatch):
    """The dequantized GGUF weights are saved once (safetensors) and read back bit for bit; a copy of the file
    elsewhere reads the same entry, a different file makes its own; a damaged entry is replaced by reading
    the GGUF file again."""
    import os
    import shutil

    from inferd.cache import cache_dir
    from inferd.model.loader import load_checkpoint

    monkeypatch.setenv("INFERD_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "a").mkdir()
    path = str(tmp_path / "a" / "model.gguf")
    write_small_gguf(path)
    direct = load_checkpoint(path)  # read from the GGUF file; writes the entry
    assert direct.config.num_hidden_layers == 2 and direct.config.tie_word_embeddings
    (entry,) = os.listdir(cache_dir("checkpoints"))
    cached = load_checkpoint(path)
    assert cached.config == direct.config and cached.tokenizer_source == direct.tokenizer_source
    assert cached.state_dict.keys() == direct.state_dict.keys()
    for k, v in direct.state_dict.items():
        assert cached.state_dict[k].dtype == v.dtype and torch.equal(cached.state_dict[k], v), k

    # A copy (another folder, name and mtime, as in a model repository) is the same entry, its own folder kept.
    (tmp_path / "repo" / "1").mkdir(parents=True)
    copy = str(tmp_path / "repo" / "1" / "weights.gguf")
    shutil.copyfile(path, copy)
    copied = load_checkpoint(copy)
    assert os.listdir(cache_dir("checkpoints")) == [entry]
    assert copied.tokenizer_source == (str(tmp_path / "repo" / "1"), "weights.gguf")
    assert all(torch.equal(copied.state_dict[k], v) for k, v in direct.state_dict.items())
    write_small_gguf(copy, seed=1)  # new bytes at the same path: a new entry
    other = load_checkpoint(copy)
    assert len(os.listdir(cache_dir("checkpoints"))) == 2
    assert not torch.equal(other.state_dict["model.norm.weight"], direct.state_dict["model.norm.weight"])

    with open(os.path.join(cache_dir("checkpoints"), entry), "r+b") as f:
        f.write(b"\xff" * 64)  # the safetensors header is now garbage
    healed = load_checkpoint(path)
    assert all(torch.equal(healed.state_dict[k], v) for k, v in direct.state_dict.items())
    assert load_checkpoint(path).config == direct.config  # the rewritten entry reads back
    # Tensors are read lazily, so a truncated entry must be refused when opened, not when a tensor is read (and
    # then it is rebuilt as above).
    entry_path = os.path.join(cache_dir("checkpoints"), entry)
    os.truncate(entry_path, os.path.getsize(entry_path) - 100)
    from safetensors import SafetensorError

    with pytest.raises(SafetensorError):
        SafetensorsStateDict([entry_path])
    assert all(torch.equal(load_checkpoint(path).state_dict[k], v) for k, v in direct.state_dict.items())


def test_a_gguf_file_replaced_while_it_is_converted_writes_no_entry(tmp_path, monkeypatch):
    """The key is the bytes hashed before the conversion: a file replaced between that hash and the conversion's
    read (here by a wrapper around the real conversion) must not leave the new file's weights under the old key,
    where every copy of the old file would find them."""
    import os

    import inferd.model.loader as loader
    from inferd.cache import cache_dir

    monkeypatch.setenv("INFERD_CACHE_DIR", str(tmp_path / "cache"))
    path, other = str(tmp_path / "model.gguf"), str(tmp_path / "other.gguf")
    write_small_gguf(path)
    write_small_gguf(other, seed=1)
    convert = loader._load_gguf

    def replaced_first(p):
        os.replace(other, p)
        return convert(p)

    monkeypatch.setattr(loader, "_load_gguf", replaced_first)
    loader.load_checkpoint(path)
    assert not os.path.exists(cache_dir("checkpoints")) or os.listdir(cache_dir("checkpoints")) == []


def _random_llama(path, tok, hidden: int, heads: int, kv_heads: int):
    """A 2-layer random-weight Llama saved as a safetensors folder with SmolLM2's tokenizer; returns the model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return model


@pytest.mark.parametrize("hidden,heads,kv_heads", [(48, 8, 2), (256, 32, 1)])
def test_head_shapes_the_attention_kernel_does_not_take_still_serve_in_bf16(tmp_path, hf_model, hidden, heads,
                                                                            kv_heads):
    """A head dimension of 6 (not a multiple of 8) and 32 query heads per KV head are outside the compiled attention
    kernel and the decoder stack: such a model still loads in BF16 (it failed to, with the stack's shape check) and
    its greedy tokens equal transformers' FP32 ones, alone and batched (with 32 heads per KV head the kernel refused
    every step before)."""
    _, tok = hf_model
    reference = _random_llama(tmp_path, tok, hidden, heads, kv_heads)
    prompts = ["Hello there", "The quick brown fox", "1 2 3 4"]
    expected = hf_greedy_tokens(reference, tok, prompts, 8)
    llm = LLM(str(tmp_path), dtype="bfloat16", kv_cache_memory_bytes=16 * 1024**2)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts] == expected


def test_a_checkpoint_that_does_not_match_its_config_is_refused_at_load(tmp_path, hf_model):
    """A weight whose shape differs from what the config gives is a ValueError naming it when the model loads (it
    loaded, and the first request failed)."""
    from safetensors.torch import load_file, save_file

    _random_llama(tmp_path, hf_model[1], 48, 8, 2)
    (weights,) = tmp_path.glob("*.safetensors")
    state = load_file(weights)
    state["model.layers.1.self_attn.q_proj.weight"] = state["model.layers.1.self_attn.q_proj.weight"][:40].clone()
    save_file(state, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.q_proj\.weight: shape \[40, 48\], but the "
                                         r"model's config needs \[48, 48\]"):
        LLM(str(tmp_path), dtype="bfloat16", kv_cache_memory_bytes=16 * 1024**2)
