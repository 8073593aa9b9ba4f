"""The ten hard inputs of shared/cases/openai-and-kserve.md, through /v1/completions and
/v1/chat/completions, streamed and not: never a 5xx, a 400 naming the field for invalid input, and the
streamed text equal to the non-streamed text."""

from __future__ import annotations

import json

import httpx
import pytest

from test_cases import REFERENCE

TOKENIZER_TEST = ("\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶‍🌫️ (multiple emojis concatenated) ✅ "
                  "🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 ក្នុងក្រុង Привет, мир "
                  "こんにちは 'RE you sure? 'll 've 'd")

# (name, text prompt or token ids, extra parameters, expected status)
CASES = [
    ("cjk", "请用中文回答：歪和聪是什么意思？", {}, 200),
    ("emoji", "Describe these: 😶‍🌫️ 🦙🦙 👍", {}, 200),
    ("byte-fallback scripts", "Привет! こんにちは。ក្នុងក្រុង Bulgarian: Здравей", {}, 200),
    ("whitespace and digits", TOKENIZER_TEST, {}, 200),
    ("empty", "", {}, 400),
    ("invalid token ids", [-1, 49152], {}, 400),
    ("over the context", " ".join(["word"] * 8300), {}, 400),
    ("unaligned stops", "Observation: the sky is blue.\nObservation: grass is",
     {"stop": ["Pari", "\nObservation", "\n<|endoftext|>", "DEFGHIJ"]}, 200),
    ("special-token text", "<s><|begin_of_text|><|im_end|><|im_start|>assistant\n<|im_end|>", {}, 200),
    ("extreme sampling", "The capital of France is",
     {"temperature": 1e-12, "top_p": 1e-4, "top_k": 49153, "stop_token_ids": [49150],
      "logit_bias": {"0": -100, "49151": 100}}, 200),
    # Side parameters with ids outside the vocabulary are refused, like prompt token ids (vllm #54195).
    ("out-of-vocab stop id", "The capital of France is", {"stop_token_ids": [10**9]}, 400),
]


def _body(route: str, prompt, extra: dict) -> dict:
    base = {"max_tokens": 24, "temperature": 0, "seed": 0} | extra
    if route == "/v1/completions":
        return base | {"prompt": prompt}
    if isinstance(prompt, list):
        return base | {"messages": [{"role": "user", "content": prompt}]}  # wrong type for chat
    return base | {"messages": [{"role": "user", "content": prompt}]}


def _text(choice: dict) -> str:
    return choice["message"]["content"] if "message" in choice else choice["text"]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("name,prompt,extra,status", CASES, ids=[c[0] for c in CASES])
def test_hard_input(server, route, name, prompt, extra, status):
    body = _body(route, prompt, extra)
    if route == "/v1/chat/completions" and name == "empty":
        status = 200  # the chat template adds text around an empty message
    r = httpx.post(server.base_url + route, json=body, timeout=120)
    assert r.status_code == status, r.text
    streamed = httpx.post(server.base_url + route, json=body | {"stream": True}, timeout=120)
    if status != 200:
        err = r.json()["error"]
        assert err["param"] in ("prompt", "messages", "stop_token_ids") and err["message"]
        assert streamed.status_code == status and streamed.json()["error"]["param"] == err["param"]
        return
    full = _text(r.json()["choices"][0])
    lines = [ln[6:] for ln in streamed.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    text = ""
    for ln in lines[:-1]:
        for ch in json.loads(ln)["choices"]:
            text += (ch["delta"].get("content") or "") if "delta" in ch else ch["text"]
    assert text == full
    if name == "special-token text" or route == "/v1/chat/completions":
        assert "<|im_end|>" not in full
    if name == "unaligned stops":
        assert not any(s in full for s in extra["stop"])


@pytest.mark.parametrize("route,body", [
    ("/v1/completions", '{"prompt": "hi \\ud800", "max_tokens": 2}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x\\udc00y"}], "max_tokens": 2}'),
    ("/tokenize", '{"prompt": "\\udbff"}'),
    ("/v1/embeddings", '{"input": "\\ud800\\ud800"}'),
])
def test_lone_surrogate_is_a_400(server, route, body):
    """A JSON string with a lone UTF-16 surrogate escape (not Unicode text; Python's json accepts it) is a 400,
    while an escaped pair (an emoji as ``ensure_ascii`` JSON writes it) is text like any other."""
    r = httpx.post(server.base_url + route, content=body, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {
        "message": "the request body is not valid JSON text: a string in it holds a lone UTF-16 surrogate escape "
                   "(\\ud800-\\udfff)", "type": "invalid_request_error", "param": None, "code": 400}
    pair = httpx.post(server.base_url + "/tokenize", content='{"prompt": "\\ud83e\\udd99"}',
                      headers={"content-type": "application/json"})
    direct = httpx.post(server.base_url + "/tokenize", json={"prompt": "🦙"})
    assert pair.status_code == 200 and pair.json()["tokens"] == direct.json()["tokens"]


def test_server_healthy_after_hard_inputs(server):
    assert httpx.get(server.base_url + "/health").status_code == 200
    a = httpx.post(server.base_url + "/v1/completions", json=REFERENCE, timeout=60).json()["choices"][0]["text"]
    b = httpx.post(server.base_url + "/v1/completions", json=REFERENCE, timeout=60).json()["choices"][0]["text"]
    assert a == b
