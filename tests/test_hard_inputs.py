"""The ten hard inputs of shared/cases/openai-and-kserve.md, through /v1/completions and
/v1/chat/completions, streamed and not: never a 5xx, a 400 naming the field for invalid input, and the
streamed text equal to the non-streamed text."""

from __future__ import annotations

import gzip
import json
import sys
import zlib

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


def test_a_prompt_longer_than_any_context_can_hold_is_refused_before_it_is_tokenized(server):
    """A 10 MB prompt (tokenizing it held the tokenizer and the GIL for ~9 s, stalling every stream and /health,
    and a 20 MB one took 2 GB) gets a 400 that counts its characters, not its tokens, on every route that
    tokenizes text; the limit is the context times the longest token's characters, and a prompt at the limit
    is tokenized (its 400 counts tokens). The server answers normally afterwards."""
    import re

    text = "hello world, this is a test. " * 350_000
    pattern = (r"the prompt has (\d+) characters: more than this model's maximum context length of 8192 tokens can "
               r"hold \(a token is at most (\d+) characters, so at most (\d+) characters are tokenized\)")
    for route, body, param in (("/v1/completions", {"prompt": text, "max_tokens": 1}, "prompt"),
                               ("/v1/completions", {"prompt": ["hi", text], "max_tokens": 1}, "prompt"),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}, "messages"),
                               ("/tokenize", {"prompt": text}, "prompt")):
        r = httpx.post(server.base_url + route, json=body, timeout=120)
        assert r.status_code == 400, (route, r.text[:300])
        err = r.json()["error"]
        m = re.fullmatch(pattern, err["message"])
        assert m and err["param"] == param, (route, err)
        assert int(m[1]) >= len(text) and int(m[3]) == int(m[2]) * 8192 < len(text)
    limit = int(m[3])
    at_limit = ("a" * 1000 + " ") * (limit // 1001) + "a" * (limit % 1001)  # ~one token a few characters
    assert len(at_limit) == limit
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": at_limit, "max_tokens": 1}, timeout=120)
    assert r.status_code == 400 and re.search(r"but the prompt has \d+ tokens", r.json()["error"]["message"]), r.text
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
    ok = httpx.post(server.base_url + "/v1/completions",
                    json={"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}, timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"]


@pytest.mark.parametrize("extra,param,message", [
    ({"temperature": float("nan")}, "temperature", "temperature: Input should be a finite number"),
    ({"top_p": float("inf")}, "top_p", "top_p: Input should be a finite number"),
    ({"logit_bias": {"5": float("nan")}}, "logit_bias", "logit_bias.5: Input should be a finite number"),
    ({"logit_bias": {"-5": float("inf")}}, "logit_bias", "logit_bias.-5: Input should be a finite number"),
    ({"stop": [f"s{i}" for i in range(17)]}, "stop",
     "stop: List should have at most 16 items after validation, not 17"),
    ({"stop": 5}, "stop", "stop: Input should be a valid string or list"),  # every type wrong: all of them
])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_field_error_names_the_values_own_fault(server, route, extra, param, message):
    """NaN and infinities are refused as not finite (not as out of range), and a field of several types reports
    what is wrong with the value (17 stop strings: too many) rather than that it is not the first type."""
    body = json.dumps(_body(route, "Hi", extra))  # NaN and Infinity as Python's json writes them (httpx's refuses)
    r = httpx.post(server.base_url + route, content=body, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["message"], err["param"], err["type"]) == (message, param, "invalid_request_error")


@pytest.mark.parametrize("route,body,param,message", [
    ("/v1/completions", {"prompt": 5}, "prompt", "prompt: Input should be a valid string or list"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages",
     "messages.0.content: Input should be a valid string or list"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image", "text": "x"}]}]},
     "messages", "messages.0.content.0.type: Input should be 'text'"),
])
def test_a_field_of_several_types_names_them_not_pydantics_members(server, route, body, param, message):
    """A value of none of a field's types gets the types it may have, at the field's own location (not pydantic's
    names of the union's members, such as "str" or "list[TextPart]")."""
    r = httpx.post(server.base_url + route, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["message"], err["param"]) == (message, param)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
TOOLS_UNSUPPORTED = ('tool calling is not supported (this server does not parse tool calls); leave out tools and '
                     'tool_choice, or send tool_choice "none"')


@pytest.mark.parametrize("extra,param,message", [
    ({"tools": TOOLS}, "tools", None),
    ({"tools": TOOLS, "tool_choice": "auto"}, "tools", None),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tools", None),
    ({"tool_choice": "required"}, "tool_choice", None),
    ({"functions": [TOOLS[0]["function"]]}, "functions", None),
    ({"function_call": "auto"}, "function_call", None),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}]},
     "messages", "messages.1.tool_calls: " + TOOLS_UNSUPPORTED),
    ({"tool_choice": "bogus"}, "tool_choice", "tool_choice: Input should be 'none', 'auto' or 'required'"),
])
def test_tool_calls_are_refused_not_ignored(server, extra, param, message):
    """A request that asks for tool calls gets a 400 saying so (as ``response_format`` other than text does), not
    an answer that silently never calls the tool; ``tool_choice: "none"`` is the same request without tools."""
    r = httpx.post(server.base_url + "/v1/chat/completions", json=_body("/v1/chat/completions", "Hi", {}) | extra,
                   timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    message = message or f"{param}: {TOOLS_UNSUPPORTED}"
    assert (err["message"], err["param"], err["type"]) == (message, param, "invalid_request_error")
    plain = httpx.post(server.base_url + "/v1/chat/completions", json=_body("/v1/chat/completions", "Hi", {}),
                       timeout=60)
    none = httpx.post(server.base_url + "/v1/chat/completions",
                      json=_body("/v1/chat/completions", "Hi", {"tools": TOOLS, "tool_choice": "none"}), timeout=60)
    assert plain.status_code == none.status_code == 200, none.text
    assert none.json()["choices"][0]["message"]["content"] == plain.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("extra,status,message", [
    ({"suffix": " the end."}, 400, "suffix: is not supported (this server does not insert text)"),
    ({"best_of": 3}, 400, "best_of: only best_of equal to n (1) is supported (this server does not generate extra "
                          "candidates to choose from)"),
    ({"best_of": 1}, 200, None),
    ({"best_of": 2, "n": 2}, 200, None),
    ({"suffix": ""}, 200, None),
])
def test_completion_fields_that_would_be_ignored_are_refused(server, extra, status, message):
    """``suffix`` and a ``best_of`` above ``n`` change what OpenAI returns; ignoring them would answer another
    request, so they are a 400 (vLLM refuses them too). best_of equal to n is the same request."""
    r = httpx.post(server.base_url + "/v1/completions", json=_body("/v1/completions", "Hi", extra), timeout=60)
    assert r.status_code == status, r.text
    if message is not None:
        err = r.json()["error"]
        assert (err["message"], err["param"]) == (message, next(iter(extra)))
    else:
        assert len(r.json()["choices"]) == extra.get("n", 1)


LONE_SURROGATE = {"message": "the request body is not valid JSON text: a string in it holds a lone UTF-16 surrogate "
                             "(U+D800-U+DFFF)", "type": "invalid_request_error", "param": None, "code": 400}
LLM_INFER = "/v2/models/SmolLM2-135M-Instruct/infer"


def _infer_body(text: str) -> str:
    return json.dumps({"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["hi"]},
                                  {"name": "sampling_parameters", "datatype": "BYTES", "shape": [1],
                                   "data": ['{"max_tokens": 2}']}],
                       "id": "ID"}).replace('"ID"', f'"{text}"')


@pytest.mark.parametrize("route,body,headers", [
    ("/v1/completions", b'{"prompt": "hi \\ud800", "max_tokens": 2}', {}),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x\\udc00y"}], "max_tokens": 2}', {}),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udd99\\ud83e"}], "max_tokens": 2}', {}),
    ("/tokenize", b'{"prompt": "\\udbff"}', {}),
    ("/tokenize", b'{"prompt": "hi \xed\xa0\x80"}', {}),  # the bytes of a surrogate, which json decodes
    ("/tokenize", '{"prompt": "\\ud800"}'.encode("utf-16"), {}),  # JSON in UTF-16, which json detects
    ("/v1/embeddings", b'{"input": "\\ud800\\ud800"}', {}),
    ("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 2}', {"content-type": "application/x-ndjson+json"}),
    (LLM_INFER, _infer_body("\\ud800").encode(), {}),
    (LLM_INFER, gzip.compress(_infer_body("\\ud800").encode()), {"content-encoding": "gzip"}),
], ids=["completion", "chat", "chat-reversed-pair", "tokenize", "tokenize-bytes", "tokenize-utf16", "embeddings",
        "completion-plus-json", "kserve", "kserve-gzip"])
def test_lone_surrogate_is_a_400(server, route, body, headers):
    """A JSON string with a lone UTF-16 surrogate (not Unicode text, though Python's json decodes it) is a 400 in
    the route's error shape, however it is written or compressed, and the server goes on."""
    r = httpx.post(server.base_url + route, content=body, timeout=60,
                   headers={"content-type": "application/json", **headers})
    assert r.status_code == 400, r.text
    if route == LLM_INFER:
        assert r.json() == {"error": LONE_SURROGATE["message"]}
    else:
        assert r.json()["error"] == LONE_SURROGATE
    assert httpx.get(server.base_url + "/health").status_code == 200


@pytest.mark.parametrize("route,body,detail", [
    ("/v1/completions", b'{"prompt": "caf\xe9", "max_tokens": 2}', "0xe9: invalid continuation byte"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xff"}]}', "0xff: invalid start byte"),
    (LLM_INFER, _infer_body("x").encode().replace(b'"x"', b'"\xc3"'), "0xc3: invalid continuation byte"),
], ids=["completion-latin1", "chat", "kserve"])
def test_invalid_utf8_names_the_byte(server, route, body, detail):
    """A body that is not UTF-8 (Latin-1 text, say) gets a 400 naming the first bad byte, in the route's error
    shape, not a generic parse error."""
    offset = next(i for i, b in enumerate(body) if b >= 0x80)
    r = httpx.post(server.base_url + route, content=body, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    message = f"the request body is not valid UTF-8 at byte offset {offset} ({detail})"
    if route == LLM_INFER:
        assert r.json() == {"error": message}
    else:
        assert r.json()["error"] == {"message": message, "type": "invalid_request_error", "param": None, "code": 400}
    assert httpx.get(server.base_url + "/health").status_code == 200


@pytest.mark.parametrize("encoding", ["utf-16", "utf-32-be"])
def test_kserve_json_in_utf16_or_utf32_answers_as_in_utf8(server, encoding):
    """KServe's JSON in UTF-16 or UTF-32 (which its first bytes announce) gets the answer the same request gets in
    UTF-8, as the OpenAI routes already gave (json.loads detects the encoding): before, KServe decoded every body as
    UTF-8 and answered "Expecting property name enclosed in double quotes" to UTF-16 without a byte order mark."""
    body = json.dumps({"id": "caf\u00e9", "inputs": [
        {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["Bonjour, \u00e7a va"]},
        {"name": "sampling_parameters", "datatype": "BYTES", "shape": [1],
         "data": ['{"max_tokens": 4, "temperature": 0}']}]}, ensure_ascii=False)
    answers = [httpx.post(server.base_url + LLM_INFER, content=body.encode(e), timeout=60,
                          headers={"content-type": "application/json"}) for e in ("utf-8", encoding)]
    assert [r.status_code for r in answers] == [200, 200], answers[1].text
    assert answers[1].json() == answers[0].json() and answers[0].json()["id"] == "caf\u00e9"
    bad = body.encode(encoding)[:-1]  # a code unit cut short: the same 400 on the KServe and the OpenAI routes
    name, unit = {"utf-16": ("UTF-16", 2), "utf-32-be": ("UTF-32BE", 4)}[encoding]
    message = (f"the request body is not valid {name} at byte offset {len(bad) - unit + 1} "
               f"(bytes {bad[-unit + 1:].hex(' ')}: truncated data)")
    r = httpx.post(server.base_url + LLM_INFER, content=bad, headers={"content-type": "application/json"}, timeout=60)
    assert (r.status_code, r.json()) == (400, {"error": message})
    for extra in ({}, {"content-encoding": "identity"}):  # identity is no encoding: checked as any plain body
        r = httpx.post(server.base_url + "/v1/completions", content=json.dumps({"prompt": "hi"}).encode(encoding)[:-1],
                       headers={"content-type": "application/json", **extra}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(f"the request body is not valid {name} ")
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_kserve_number_too_long_for_int_is_a_400(server):
    """An integer of more digits than Python's int() reads (4,300) is a 400 on KServe's infer route, as on the OpenAI
    routes; it was a 500 (a ValueError that is not a JSONDecodeError)."""
    body = _infer_body("x").replace('"id"', '"parameters": {"x": ' + "1" * 5000 + '}, "id"')
    r = httpx.post(server.base_url + LLM_INFER, content=body, headers={"content-type": "application/json"}, timeout=60)
    assert (r.status_code, r.json()) == (400, {"error": "request body is not valid JSON: a number with more than "
                                                        f"{sys.get_int_max_str_digits()} digits"})
    assert httpx.get(server.base_url + "/health").status_code == 200


PARSE = "the request body could not be parsed as JSON: arrays or objects nested too deeply, or a number with too many digits"


@pytest.mark.parametrize("body,headers,status,message", [
    (gzip.compress(b'{"prompt": "hi", "max_tokens": 2}'), {"content-encoding": "gzip"}, 415,
     "Content-Encoding 'gzip' is not supported on this route: send the body uncompressed"),
    (b'{"prompt": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", {}, 400, PARSE),
    (b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", {}, 400, PARSE),
], ids=["gzip", "deep", "long-number"])
def test_bodies_that_json_cannot_read_get_a_clear_error(server, body, headers, status, message):
    """A compressed body on an OpenAI route (only the KServe routes decompress), or JSON that Python's parser gives
    up on, gets an error that says which, not FastAPI's "There was an error parsing the body"."""
    r = httpx.post(server.base_url + "/v1/completions", content=body, timeout=60,
                   headers={"content-type": "application/json", **headers})
    assert r.status_code == status, r.text
    assert r.json()["error"] == {"message": message, "type": "invalid_request_error", "param": None, "code": status}
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_escaped_surrogate_pair_is_text(server):
    """An escaped pair (an emoji as JSON encoders that escape non-ASCII write it) is text like any other."""
    pair = httpx.post(server.base_url + "/tokenize", content='{"prompt": "\\ud83e\\udd99"}',
                      headers={"content-type": "application/json"})
    direct = httpx.post(server.base_url + "/tokenize", json={"prompt": "🦙"})
    assert pair.status_code == 200 and pair.json()["tokens"] == direct.json()["tokens"]
    r = httpx.post(server.base_url + LLM_INFER, content=gzip.compress(_infer_body("\\ud83e\\udd99").encode()),
                   headers={"content-type": "application/json", "content-encoding": "gzip"}, timeout=60)
    assert r.status_code == 200 and r.json()["id"] == "🦙"


def test_kserve_gzip_members_are_all_read_and_trailing_bytes_refused(server):
    """A gzip body of two members is the two decompressed one after the other (RFC 1952 section 2.2), as the same
    body in one member answers; bytes after the last member, or after a deflate stream, are a 400 (they were
    dropped unread)."""
    body = json.dumps({"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["hi"]},
                                 {"name": "sampling_parameters", "datatype": "BYTES", "shape": [1],
                                  "data": [json.dumps({"max_tokens": 4, "temperature": 0})]}]}).encode()
    url, json_headers = server.base_url + LLM_INFER, {"content-type": "application/json"}
    one = httpx.post(url, content=gzip.compress(body), headers={**json_headers, "content-encoding": "gzip"},
                     timeout=60)
    two = httpx.post(url, content=gzip.compress(body[:40]) + gzip.compress(body[40:]),
                     headers={**json_headers, "content-encoding": "gzip"}, timeout=60)
    assert one.status_code == 200 and two.json() == one.json()
    for encoding, data, message in (
            ("gzip", gzip.compress(body) + b"junk", "the request body is not valid gzip data"),
            ("deflate", zlib.compress(body) + b"junk", "the request body has data after the end of its deflate "
                                                       "stream")):
        r = httpx.post(url, content=data, headers={**json_headers, "content-encoding": encoding}, timeout=60)
        assert (r.status_code, r.json()) == (400, {"error": message})


def test_oversized_headers_are_refused_at_once(server):
    """A request whose headers run past 16 KiB (here 4 MiB of one header, never finished) is refused as soon as the
    limit is passed, a 400 or a closed connection, and never held open while its bytes come in: uvicorn's
    httptools protocol had no bound, and a 128 MiB header stalled every other request for seconds (review of stop
    21). A health check meanwhile answers."""
    import socket
    import time

    host, port = server.base_url.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
        t0, answer = time.monotonic(), b""
        try:
            for _ in range(4 * 64):  # 4 MiB in 16 KiB pieces, unless the server stops reading
                s.sendall(b"a" * 16384)
            s.settimeout(5)
            answer = s.recv(4096)  # the refusal, or b"" (closed)
        except (ConnectionResetError, BrokenPipeError):
            pass  # closed while we were still sending
        assert time.monotonic() - t0 < 5
        assert answer == b"" or answer.startswith(b"HTTP/1.1 4"), answer[:200]
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize("request_bytes", [
    b"GARBAGE\r\n\r\n",  # no request line
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",  # a header without a colon
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: ten\r\n\r\n"])  # not a length
def test_malformed_http_is_a_json_400(server, request_bytes):
    """A request uvicorn cannot parse never reaches the app; its 400 still carries the JSON error body every other
    error has (uvicorn's own is plain text), and the connection is closed."""
    import socket

    host, port = server.base_url.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(request_bytes)
        answer = b""
        while chunk := s.recv(65536):  # until the server closes the connection
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"HTTP/1.1 400 Bad Request", answer[:300]
    assert b"content-type: application/json" in lines and b"connection: close" in lines
    assert json.loads(body) == {"error": {
        "message": "malformed HTTP request: it could not be parsed as HTTP/1.1 (request line, headers or body "
                   "framing), or its unfinished head passed 16 KiB",
        "type": "invalid_request_error", "param": None, "code": 400}}


def test_malformed_body_after_the_answer_only_closes(server):
    """A chunked body gone bad after the route has answered (GET /health does not read it) closes the connection;
    no second response is attempted (h11 would raise on it: uvicorn's own 400 logs a fatal transport error)."""
    import socket
    import time

    host, port = server.base_url.split("//")[1].split(":")
    with open(server.log_path, "rb") as f:
        log_before = len(f.read())
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        time.sleep(0.5)
        s.sendall(b"zz\r\nxx\r\n")  # not a chunk size
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200 OK") and answer.count(b"HTTP/1.1") == 1, answer[:300]
    time.sleep(0.2)
    with open(server.log_path, "rb") as f:
        assert b"Fatal error" not in f.read()[log_before:]


def test_server_healthy_after_hard_inputs(server):
    assert httpx.get(server.base_url + "/health").status_code == 200
    a = httpx.post(server.base_url + "/v1/completions", json=REFERENCE, timeout=60).json()["choices"][0]["text"]
    b = httpx.post(server.base_url + "/v1/completions", json=REFERENCE, timeout=60).json()["choices"][0]["text"]
    assert a == b


def test_chat_message_without_content_is_a_400(server):
    """A user or system message with no content is refused, as OpenAI's API refuses it (it was answered); an
    assistant turn may leave it out."""
    url = server.base_url + "/v1/chat/completions"
    for role in ("user", "system"):
        r = httpx.post(url, json={"messages": [{"role": role}], "max_tokens": 2}, timeout=60)
        assert r.status_code == 400
        assert r.json() == {"error": {"message": f"messages.0: a {role} message needs content",
                                      "type": "invalid_request_error", "param": "messages", "code": 400}}
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant"}, {"role": "user", "content": "Hi"}]
    assert httpx.post(url, json={"messages": turns, "max_tokens": 2}, timeout=60).status_code == 200
