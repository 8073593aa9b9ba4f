"""The OpenAI-compatible server, through the official ``openai`` client and httpx."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from conftest import CHAT_QUESTIONS, collapse_supported, kv_blocks_used, metric


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def chat_stream_text(client, model, question: str, **kw) -> tuple[str, str]:
    text, reason = "", None
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                            temperature=0, stream=True, **kw)
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
    return text, reason


def test_chat_answers_the_capital_of_france(client, model_name):
    r = client.chat.completions.create(model=model_name, temperature=0,
                                       messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_models_lists_the_served_model(client, model_name, server):
    models = client.models.list().data
    assert [m.id for m in models] == [model_name]
    raw = httpx.get(server.base_url + "/v1/models").json()
    assert raw["data"][0]["max_model_len"] == 8192
    # Over KServe too, where Triton's repository index lists it (it listed nothing without a repository).
    index = httpx.post(server.base_url + "/v2/repository/index").json()
    assert [(m["name"], m["state"]) for m in index] == [(model_name, "READY")]


def test_completion_streamed_equals_non_streamed(client, model_name):
    kw = dict(model=model_name, prompt="Here is a short poem about autumn:", max_tokens=40, temperature=0)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text and text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == full.choices[0].finish_reason and all(r is None for r in reasons[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_streamed_equals_non_streamed(client, model_name):
    q = "Give me a tip for learning Python."
    full = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": q}],
                                          temperature=0, max_tokens=60)
    text, reason = chat_stream_text(client, model_name, q, max_tokens=60)
    assert text == full.choices[0].message.content and reason == full.choices[0].finish_reason


def test_sixteen_concurrent_streams_equal_sequential_and_free_the_cache(client, model_name, server):
    sequential = [chat_stream_text(client, model_name, q, max_tokens=24) for q in CHAT_QUESTIONS]
    with ThreadPoolExecutor(16) as pool:
        concurrent = list(pool.map(lambda q: chat_stream_text(client, model_name, q, max_tokens=24),
                                   CHAT_QUESTIONS))
    assert concurrent == sequential
    assert all(t for t, _ in sequential)
    deadline = time.monotonic() + 5
    while kv_blocks_used(server.base_url) != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert kv_blocks_used(server.base_url) == 0
    assert metric(server.base_url, "inferd:num_requests_running") == 0


def test_stop_strings_and_seed_through_the_api(client, model_name):
    kw = dict(model=model_name, prompt="Here is the English alphabet: ABC", max_tokens=24, temperature=0)
    text = client.completions.create(**kw).choices[0].text
    stop = text[3:9]
    cut = client.completions.create(stop=[stop], **kw)
    streamed = "".join(c.choices[0].text for c in client.completions.create(stop=[stop], stream=True, **kw))
    assert cut.choices[0].text == streamed == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    seeded = dict(model=model_name, prompt="Once upon a time", max_tokens=16, temperature=0.9, seed=3)
    assert client.completions.create(**seeded).choices[0].text == client.completions.create(**seeded).choices[0].text


def test_several_prompts_are_several_choices(client, model_name):
    r = client.completions.create(model=model_name, prompt=["The sky is", "Grass is"], max_tokens=5, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    one = client.completions.create(model=model_name, prompt="Grass is", max_tokens=5, temperature=0)
    assert r.choices[1].text == one.choices[0].text


def test_unknown_model_is_404(server):
    r = httpx.post(server.base_url + "/v1/completions", json={"model": "gpt-9", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def _wait_idle(base_url: str, timeout: float = 2.0) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if metric(base_url, "inferd:num_requests_running") == 0 and kv_blocks_used(base_url) == 0:
            return time.monotonic() - start
        time.sleep(0.02)
    raise AssertionError("the aborted request still holds KV blocks")


def test_client_disconnect_aborts_the_request(server, model_name):
    body = {"model": model_name, "messages": [{"role": "user", "content": "Write a very long story."}],
            "max_tokens": 4000, "ignore_eos": True}
    aborted = metric(server.base_url, 'inferd:request_success_total{finished_reason="abort",model_name="%s"}'
                     % model_name)
    with httpx.Client(timeout=30) as h:  # streamed: close after a few chunks
        with h.stream("POST", server.base_url + "/v1/chat/completions", json=body | {"stream": True}) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i > 5:
                    break
        assert metric(server.base_url, "inferd:num_requests_running") <= 1
    _wait_idle(server.base_url)
    with pytest.raises(httpx.ReadTimeout):  # not streamed: the client gives up after 1 s
        httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=1.0)
    _wait_idle(server.base_url)
    assert metric(server.base_url, 'inferd:request_success_total{finished_reason="abort",model_name="%s"}'
                  % model_name) == aborted + 2
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=30)
    assert r.status_code == 200


def test_metrics_count_tokens_and_latencies(server, model_name):
    before = metric(server.base_url, "inferd:generation_tokens_total")
    httpx.post(server.base_url + "/v1/completions",
               json={"prompt": "One two three", "max_tokens": 7, "ignore_eos": True}, timeout=30)
    text = httpx.get(server.base_url + "/metrics").text
    assert metric(server.base_url, "inferd:generation_tokens_total") == before + 7
    for name in ("inferd:time_to_first_token_seconds_bucket", "inferd:inter_token_latency_seconds_bucket",
                 "inferd:num_requests_waiting", "inferd:prompt_tokens_total"):
        assert name in text



def test_a_long_prefill_is_visible_before_its_first_token(server, model_name):
    """A streamed chat with a long prompt (one prefill step of seconds): its headers and role chunk arrive once
    the request is accepted, before its first token, and /metrics meanwhile counts it running with its KV blocks,
    and a request accepted during the step as waiting (the gauges read the engine when scraped). Before, nothing
    came back and the gauges read 0 until the prefill ended: a client or a monitor could not tell it from a hung
    server."""
    messages = [{"role": "user", "content": "word " * 1500}]
    tokens = httpx.post(server.base_url + "/tokenize", json={"messages": messages}).json()["count"]
    assert tokens <= 2048  # one step at the default max_num_batched_tokens
    generated = metric(server.base_url, "inferd:generation_tokens_total")
    # ignore_eos: exactly 2 tokens (sampled without it, an end-of-text token among them made the count one short,
    # depending on the tests before)
    body = {"model": model_name, "messages": messages, "max_tokens": 2, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        first = next(line for line in lines if line)
        assert json.loads(first[6:])["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        # still in the prefill step: no token yet, the request running and holding its prompt's blocks
        assert metric(server.base_url, "inferd:generation_tokens_total") == generated
        assert metric(server.base_url, "inferd:num_requests_running") == 1
        assert kv_blocks_used(server.base_url) == -(-tokens // 16)
        # a request accepted meanwhile counts as waiting, though it reaches the scheduler only after the step
        with ThreadPoolExecutor(1) as pool:
            other = pool.submit(httpx.post, server.base_url + "/v1/completions", timeout=120,
                                json={"model": model_name, "prompt": "Hi", "max_tokens": 1, "ignore_eos": True})
            waiting = []
            while not other.done() and waiting[-1:] != [1]:
                waiting.append(metric(server.base_url, "inferd:num_requests_waiting"))
                time.sleep(0.02)
            assert metric(server.base_url, "inferd:generation_tokens_total") == generated  # still prefilling
            assert waiting[-1] == 1, waiting
            assert other.result().status_code == 200
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    assert metric(server.base_url, "inferd:generation_tokens_total") == generated + 3
    assert kv_blocks_used(server.base_url) == 0
    assert metric(server.base_url, "inferd:num_requests_running") == 0
    assert metric(server.base_url, "inferd:num_requests_waiting") == 0


def _panels_collapse_here() -> bool:
    """Whether the server's weights are packed in panels (AVX2 GEMM) and the kernel can move them."""
    from inferd.model.layers import takes_panels

    return takes_panels(torch.bfloat16, torch.device("cpu")) and collapse_supported()


@pytest.mark.skipif(not _panels_collapse_here(), reason="the weights are not in AVX2 panels, or Linux < 6.1")
def test_weights_move_into_huge_pages_once_a_request_is_answered(client, model_name, server):
    """Once it has answered a request, the server moves its packed weights (269 MB for the default model) into
    transparent huge pages on a thread of its own (docs/performance.md, stop 21)."""
    r = client.completions.create(model=model_name, prompt="The capital of France is", max_tokens=4, temperature=0)
    assert r.choices[0].text
    deadline, huge = time.monotonic() + 30, 0
    while time.monotonic() < deadline:
        with open(f"/proc/{server.proc.pid}/smaps_rollup") as f:
            huge = next(int(line.split()[1]) * 1024 for line in f if line.startswith("AnonHugePages:"))
        if huge >= 128 * 2**20:
            break
        time.sleep(0.1)
    assert huge >= 128 * 2**20
