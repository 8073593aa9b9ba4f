"""Acceptance cases C07, C11, C12, C13 and C29 of shared/cases/openai-and-kserve.md, against the real
server. Each asserts the behaviour the case states, then that the server is healthy: /health is 200 and
a fixed greedy request returns exactly the text it returned before."""

from __future__ import annotations

import threading
import time

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
        assert r.json()["error"]["message"]
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
    assert_healthy(base, ref)
