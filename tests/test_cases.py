"""Acceptance cases of shared/cases/openai-and-kserve.md that concern the OpenAI API, against the real
server (C14's policy, a 400 stating all three numbers, is checked in the C13 test; C21 in
test_server.py; C08 in test_openai_surface.py). Each asserts the behaviour the case states, then that the server is healthy: /health is 200 and
a fixed greedy request returns exactly the text it returned before."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import ServerProcess

REFERENCE = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def reference_text(server):
    r = httpx.post(server.base_url + "/v1/completions", json=REFERENCE, timeout=60)
    assert r.status_code == 200
    return r.json()["choices"][0]["text"]


def assert_healthy(base_url: str, reference: str) -> None:
    assert httpx.get(base_url + "/health").status_code == 200
    r = httpx.post(base_url + "/v1/completions", json=REFERENCE, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["code"] == status and err["type"]
    if param is not None:
        assert err["param"] == param, err
        assert param in err["message"]
    return err


# ---- C07: empty prompts -------------------------------------------------------------------------
@pytest.mark.parametrize("route,body,status", [
    ("/v1/completions", {"prompt": ""}, 400),
    ("/v1/completions", {"prompt": [""]}, 400),
    ("/v1/completions", {"prompt": []}, 400),
    ("/v1/completions", {"prompt": "", "stream": True}, 400),
    ("/v1/chat/completions", {"messages": []}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": ""}], "max_tokens": 8}, 200),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": ""}], "max_tokens": 8, "stream": True}, 200),
])
def test_c07_empty_prompt(server, reference_text, route, body, status):
    result = {}

    def normal():  # a normal request issued while the bad one is handled
        result["r"] = httpx.post(server.base_url + "/v1/completions", json=REFERENCE, timeout=60)

    t = threading.Thread(target=normal)
    t.start()
    r = httpx.post(server.base_url + route, json=body, timeout=60)
    t.join()
    if status == 400:
        assert_openai_error(r, 400, "prompt" if "prompt" in body else "messages")
    else:
        assert r.status_code == 200
    assert result["r"].status_code == 200 and result["r"].json()["choices"][0]["text"] == reference_text
    assert_healthy(server.base_url, reference_text)


# ---- C11: content type and non-JSON bodies ------------------------------------------------------
GOOD_CHAT = b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}'


@pytest.mark.parametrize("name,headers,content,statuses", [
    ("no content-type", {}, GOOD_CHAT, {200}),
    ("text/plain", {"content-type": "text/plain"}, GOOD_CHAT, {400, 415}),
    ("truncated", {"content-type": "application/json"}, b'{"model":', {400}),
    ("empty", {"content-type": "application/json"}, b"", {400}),
    ("array", {"content-type": "application/json"}, b"[]", {400}),
    ("gbk", {"content-type": "application/json"},
     '{"messages": [{"role": "user", "content": "你好"}]}'.encode("gbk"), {400}),
])
def test_c11_bodies_that_are_not_json(server, reference_text, name, headers, content, statuses):
    r = httpx.post(server.base_url + "/v1/chat/completions", headers=headers, content=content, timeout=60)
    assert r.status_code in statuses, (name, r.status_code, r.text)
    if r.status_code != 200:
        assert r.json()["error"]["message"] and r.json()["error"]["param"] is None
    assert_healthy(server.base_url, reference_text)


# ---- C12: wrong types and shapes ----------------------------------------------------------------
@pytest.mark.parametrize("field,value,param", [
    ("max_tokens", "ten", "max_tokens"),
    ("max_tokens", -5, "max_tokens"),
    ("n", 0, "n"),
    ("temperature", -1, "temperature"),
    ("top_p", 1.5, "top_p"),
    ("stop", 5, "stop"),
    ("messages", "hi", "messages"),
    ("messages", [{"role": "wizard", "content": "x"}], "messages"),
    ("response_format", {"type": "json_schema", "schema": {}}, "response_format"),
    ("logprobs", True, "logprobs"),
])
def test_c12_wrong_types(server, reference_text, field, value, param):
    body = {"messages": [{"role": "user", "content": "Hi"}], field: value}
    if field == "logprobs":
        body["top_logprobs"] = 10000
    r = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)
    err = assert_openai_error(r, 400)
    assert err["param"] in (param, "top_logprobs") and err["param"] in err["message"]
    assert_healthy(server.base_url, reference_text)


# ---- C29 then C13, on a server with a 512-token context ------------------------------------------
@pytest.fixture(scope="module")
def small_server():
    s = ServerProcess("--max-model-len", "512")
    yield s
    s.stop()


def test_c29_not_ready_until_a_completion_can_succeed(small_server):
    base = small_server.base_url
    seen_503 = {"/health": 0, "/v1/models": 0, "/v1/completions": 0}
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            health = httpx.get(base + "/health", timeout=2)
        except httpx.TransportError:
            time.sleep(0.05)
            continue
        if health.status_code == 200:
            break
        assert health.status_code == 503 and health.json()["error"]["message"]
        seen_503["/health"] += 1
        models = httpx.get(base + "/v1/models", timeout=2)
        if models.status_code == 503:
            seen_503["/v1/models"] += 1
        else:  # it became ready between the two calls
            assert models.status_code == 200
        comp = httpx.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert comp.status_code in (200, 503)
        if comp.status_code == 503:
            seen_503["/v1/completions"] += 1
            assert comp.json()["error"]["type"] == "service_unavailable"
        time.sleep(0.05)
    # The instant it is ready, a completion succeeds.
    r = httpx.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert all(n > 0 for n in seen_503.values()), seen_503  # loading takes seconds: 503s were seen


def test_c13_over_long_prompt_is_400_and_the_limit_is_the_advertised_one(small_server):
    small_server.wait_ready()
    base = small_server.base_url
    limit = httpx.get(base + "/v1/models").json()["data"][0]["max_model_len"]
    assert limit == 512
    tok = httpx.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}).json()
    assert tok["usage"]["prompt_tokens"] == 1
    ref = httpx.post(base + "/v1/completions", json=REFERENCE, timeout=60).json()["choices"][0]["text"]
    def words(n: int) -> str:  # "word" and " word" are one token each: n tokens
        return " ".join(["word"] * n)

    long_prompt = words(limit + 50)
    for stream in (False, True):
        t0 = time.monotonic()
        r = httpx.post(base + "/v1/completions", json={"prompt": long_prompt, "stream": stream}, timeout=30)
        err = assert_openai_error(r, 400, "prompt")
        assert time.monotonic() - t0 < 5
        assert str(limit) in err["message"] and str(limit + 50) in err["message"]
        r = httpx.post(base + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": long_prompt}], "stream": stream}, timeout=30)
        err = assert_openai_error(r, 400, "prompt")
        assert str(limit) in err["message"]
    # Exactly the limit minus one token, with max_tokens 1, succeeds.
    r = httpx.post(base + "/v1/completions", json={"prompt": words(limit - 1), "max_tokens": 1}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == limit - 1
    # prompt + max_tokens over the limit is a 400 that states all three numbers (C14's policy).
    r = httpx.post(base + "/v1/completions", json={"prompt": words(10), "max_tokens": limit - 2}, timeout=30)
    err = assert_openai_error(r, 400, "max_tokens")
    assert all(str(n) in err["message"] for n in (limit, 10, limit - 2))
    # Without max_tokens a completion gets OpenAI's 16, or the room its own prompt leaves if less (vLLM's
    # behaviour), not a 400 about a max_tokens the client never sent.
    r = httpx.post(base + "/v1/completions", json={"prompt": [words(limit - 5), words(10)], "ignore_eos": True},
                   timeout=60)
    assert r.status_code == 200, r.text
    lengths = {c["index"]: c["finish_reason"] for c in r.json()["choices"]}
    assert lengths == {0: "length", 1: "length"} and r.json()["usage"]["completion_tokens"] == 5 + 16
    # min_tokens past the room left is refused for what it is, and so is a default max_tokens below min_tokens.
    r = httpx.post(base + "/v1/completions", json={"prompt": words(limit - 5), "min_tokens": 10}, timeout=60)
    err = assert_openai_error(r, 400, "min_tokens")
    assert err["message"] == (f"this model's maximum context length is {limit} tokens; the prompt has {limit - 5} "
                              "tokens, which leaves room for 5, fewer than min_tokens (10)")
    r = httpx.post(base + "/v1/completions", json={"prompt": "Hi", "min_tokens": 20}, timeout=60)
    assert assert_openai_error(r, 400, "min_tokens")["message"] == "min_tokens must be in [0, max_tokens] = [0, 16], got 20"
    # Of several prompts, the error names the one at fault.
    r = httpx.post(base + "/v1/completions", json={"prompt": ["Hi", words(limit + 10)], "max_tokens": 1}, timeout=60)
    err = assert_openai_error(r, 400, "prompt")
    assert err["message"].startswith(f"prompt 1: this model's maximum context length is {limit} tokens, but the "
                                     f"prompt has {limit + 10} tokens"), err
    assert_healthy(base, ref)


# ---- helpers for the streaming cases -------------------------------------------------------------
def sse(base_url: str, route: str, body: dict) -> tuple[list[str], list[dict]]:
    """Raw ``data:`` payloads (in order) and the parsed JSON chunks of a streamed request."""
    raw, chunks = [], []
    with httpx.stream("POST", base_url + route, json=body | {"stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                raw.append(line[6:])
                if line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
    return raw, chunks


def streamed_text(chunks: list[dict], index: int = 0) -> str:
    out = ""
    for c in chunks:
        for ch in c["choices"]:
            if ch["index"] == index:
                out += (ch["delta"].get("content") or "") if "delta" in ch else ch["text"]
    return out


def completion(base_url: str, body: dict) -> dict:
    r = httpx.post(base_url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


# ---- C01: multi-token stop string while streaming ------------------------------------------------
def test_c01_stop_string_spanning_tokens_does_not_leak(server):
    body = {"prompt": "Here is the English alphabet: ABC", "max_tokens": 24, "temperature": 0, "logprobs": 0}
    full = completion(server.base_url, body)["choices"][0]
    text, toks = full["text"], full["logprobs"]["tokens"]
    stop = "".join(toks[3:6])  # exactly three tokens from inside the output
    expected = text[: text.index(stop)]
    cut = completion(server.base_url, body | {"stop": [stop]})["choices"][0]
    _, chunks = sse(server.base_url, "/v1/completions", body | {"stop": [stop]})
    assert cut["text"] == streamed_text(chunks) == expected
    assert cut["finish_reason"] == "stop" and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    # A stop string whose start ends the output but never completes: everything is flushed at the end.
    never = text[-3:] + "ZZZ"
    _, chunks = sse(server.base_url, "/v1/completions", body | {"stop": [never]})
    assert streamed_text(chunks) == text and chunks[-1]["choices"][0]["finish_reason"] == "length"


# ---- C02: stop string ending inside a token ------------------------------------------------------
def test_c02_stop_string_ending_mid_token(server):
    body = {"prompt": "The capital city of France", "max_tokens": 32, "temperature": 0, "logprobs": 0}
    full = completion(server.base_url, body)
    text, toks = full["choices"][0]["text"], full["choices"][0]["logprobs"]["tokens"]
    k = next(i for i, t in enumerate(toks) if i > 0 and len(t.strip()) >= 3)
    end = sum(len(t) for t in toks[: k + 1]) - 1  # one character before the token boundary
    stop = text[end - 4:end]
    for stream in (False, True):
        if stream:
            _, chunks = sse(server.base_url, "/v1/completions", body | {"stop": [stop]})
            got, reason = streamed_text(chunks), chunks[-1]["choices"][0]["finish_reason"]
        else:
            r = completion(server.base_url, body | {"stop": [stop]})
            got, reason = r["choices"][0]["text"], r["choices"][0]["finish_reason"]
            assert r["usage"]["completion_tokens"] <= full["usage"]["completion_tokens"]
        assert got == text[: text.index(stop)] and stop not in got and reason == "stop"


# ---- C03: an empty stop list keeps the model's end-of-turn stop ---------------------------------
def test_c03_empty_stop_list_keeps_eos(server):
    base = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 64, "temperature": 0}
    results = [httpx.post(server.base_url + "/v1/chat/completions", json=base | extra, timeout=300).json()
               for extra in ({}, {"stop": []}, {"stop": None})]
    contents = {(r["choices"][0]["message"]["content"], r["choices"][0]["finish_reason"]) for r in results}
    assert len(contents) == 1
    content, reason = contents.pop()
    assert reason == "stop" and "<|im_end|>" not in content and "<|im_start|>" not in content


# ---- C05: multi-byte characters across streamed chunks ------------------------------------------
@pytest.mark.parametrize("route,body", [
    ("/v1/completions", {"prompt": "请用中文简单介绍一下你自己。", "max_tokens": 40, "temperature": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "请用中文简单介绍一下你自己。"}],
                              "max_tokens": 40, "temperature": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Reply with five emoji 😶‍🌫️🦙👍"}],
                              "max_tokens": 40, "temperature": 0}),
    ("/v1/completions", {"prompt": "歪聪 🦙🦙", "max_tokens": 40, "temperature": 1.0, "seed": 7,
                         "ignore_eos": True}),
])
def test_c05_utf8_across_chunks(server, route, body):
    r = httpx.post(server.base_url + route, json=body, timeout=120).json()
    full = r["choices"][0]["message"]["content"] if "message" in r["choices"][0] else r["choices"][0]["text"]
    raw, chunks = sse(server.base_url, route, body)
    assert raw[-1] == "[DONE]"
    text = streamed_text(chunks)
    assert text.encode("utf-8") == full.encode("utf-8")
    pieces = [(ch["delta"].get("content") or "") if "delta" in ch else ch["text"]
              for c in chunks for ch in c["choices"]]
    pos = 0
    for p in pieces:  # U+FFFD only where the full text has it at the same position
        for j, ch in enumerate(p):
            if ch == "\ufffd":
                assert full[pos + j] == "\ufffd"
        pos += len(p)


# ---- C16: a seeded request is reproducible beside unseeded ones ---------------------------------
def test_c16_seed_respected_in_a_batch(server):
    a = {"prompt": "The capital of France is", "temperature": 0.8, "max_tokens": 16, "seed": 42,
         "ignore_eos": True}
    b = {"prompt": "My favourite animal is", "temperature": 0.8, "max_tokens": 16, "ignore_eos": True}
    alone = completion(server.base_url, a)["choices"][0]["text"]
    n3 = [c["text"] for c in completion(server.base_url, a | {"n": 3})["choices"]]
    for _ in range(4):
        with ThreadPoolExecutor(3) as pool:
            fa = pool.submit(completion, server.base_url, a)
            fb = pool.submit(completion, server.base_url, b)
            fn = pool.submit(completion, server.base_url, a | {"n": 3})
            assert fa.result()["choices"][0]["text"] == alone
            assert [c["text"] for c in fn.result()["choices"]] == n3
            fb.result()


# ---- C17: greedy output does not change under continuous batching -------------------------------
def test_c17_greedy_invariant_to_batching(server):
    prompts = [f"Question {i}: what is {i} plus {i}? Answer:" for i in range(8)]
    greedy = [{"prompt": p, "max_tokens": 48, "temperature": 0} for p in prompts]
    noisy = [{"prompt": f"Tell a long story number {i}.", "max_tokens": 64, "temperature": 1.0,
              "ignore_eos": True} for i in range(8)]
    sequential = [completion(server.base_url, g)["choices"][0]["text"] for g in greedy]
    with ThreadPoolExecutor(16) as pool:
        concurrent = [f.result()["choices"][0]["text"]
                      for f in [pool.submit(completion, server.base_url, g) for g in greedy]]
        futures = [pool.submit(completion, server.base_url, x) for x in noisy]
        mixed = [f.result()["choices"][0]["text"]
                 for f in [pool.submit(completion, server.base_url, g) for g in greedy]]
        for f in futures:
            f.result()
    assert concurrent == sequential and mixed == sequential


# ---- C19: streaming usage -------------------------------------------------------------------------
def test_c19_streaming_usage(server):
    chat = {"messages": [{"role": "user", "content": "Hello"}], "n": 2, "max_tokens": 20, "temperature": 0,
            "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    plain = {k: v for k, v in chat.items() if k != "stream_options"}  # the non-streamed equivalent
    full = httpx.post(server.base_url + "/v1/chat/completions", json=plain, timeout=60).json()
    raw, chunks = sse(server.base_url, "/v1/chat/completions", chat)
    usage_chunks = [c for c in chunks if c.get("usage")]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1] and chunks[-1]["choices"] == []
    assert raw[-1] == "[DONE]"
    u = usage_chunks[0]["usage"]
    assert u["prompt_tokens"] == full["usage"]["prompt_tokens"]
    assert u["completion_tokens"] == full["usage"]["completion_tokens"] == 40
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert all(c["usage"] is None for c in chunks[:-1])
    long = {"prompt": "test " * 1000, "max_tokens": 1}
    full = completion(server.base_url, long)
    _, chunks = sse(server.base_url, "/v1/completions", {**long, "stream_options": {"include_usage": True}})
    assert chunks[-1]["usage"] == full["usage"] and full["usage"]["prompt_tokens"] == 1001
    _, chunks = sse(server.base_url, "/v1/completions", {"prompt": "Hi", "max_tokens": 3})
    assert all("usage" not in c for c in chunks)


# ---- C20: finish_reason in streams ---------------------------------------------------------------
@pytest.mark.parametrize("max_tokens", [16, 2])
def test_c20_stream_finish_reason(server, max_tokens):
    raw, chunks = sse(server.base_url, "/v1/chat/completions",
                      {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": max_tokens})
    assert raw[-1] == "[DONE]"
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    assert all(r is None for r in reasons[:-1]) and reasons[-1] in ("stop", "length")
    if max_tokens == 2:
        assert reasons[-1] == "length"
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"


# ---- C24: extreme sampling values ----------------------------------------------------------------
@pytest.mark.parametrize("extra", [
    {"temperature": 1e-4}, {"temperature": 1e-8}, {"temperature": 1e-12}, {"top_p": 1e-4},
    {"top_k": 1}, {"min_p": 1.0}, {"temperature": 0, "top_k": 0}, {"temperature": 0, "top_k": -1},
    {"temperature": 0, "top_k": 49153},
])
def test_c24_extreme_sampling_values(server, extra):
    base = {"prompt": "The capital of France is", "max_tokens": 16, "ignore_eos": True, "logprobs": 1}
    greedy = completion(server.base_url, base | {"temperature": 0})["choices"][0]
    got = completion(server.base_url, base | {"seed": 1} | extra)
    choice = got["choices"][0]
    assert got["usage"]["completion_tokens"] == 16 and choice["text"] == greedy["text"]
    assert all(v == v and v <= 0 for v in choice["logprobs"]["token_logprobs"])  # no NaN


def test_c24_top_p_zero_is_invalid(server):
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "Hi", "top_p": 0}, timeout=30)
    assert_openai_error(r, 400, "top_p")


# ---- C26: invalid token ids do not poison later requests ----------------------------------------
def test_c26_invalid_token_ids(server):
    ref = {"prompt": "What is the meaning of life?", "max_tokens": 16, "temperature": 0}
    expected = completion(server.base_url, ref)["choices"][0]["text"]
    for bad in ([-1], [49152], [1.5], ["a", 2], [[1, 2], [-7]]):
        r = httpx.post(server.base_url + "/v1/completions", json={"prompt": bad, "max_tokens": 4}, timeout=30)
        assert_openai_error(r, 400, "prompt")
    assert completion(server.base_url, ref)["choices"][0]["text"] == expected
    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(lambda _: completion(server.base_url, ref)["choices"][0]["text"], range(4)))
    assert texts == [expected] * 4
