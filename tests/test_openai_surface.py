"""The OpenAI request surface beyond the basics: n, logprobs, echo, penalties, logit_bias, min_tokens,
max_tokens=0 scoring, the tokenizer endpoints. Streamed output must equal non-streamed output."""

from __future__ import annotations

import json
import math

import httpx
import pytest


def post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + route, json=body, timeout=120)


def stream_choices(server, route: str, body: dict) -> tuple[dict[int, str], list[dict]]:
    """Concatenated text per choice index, and every parsed chunk."""
    texts: dict[int, str] = {}
    chunks = []
    with httpx.stream("POST", server.base_url + route, json=body | {"stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            c = json.loads(line[6:])
            chunks.append(c)
            for ch in c["choices"]:
                piece = ch["delta"].get("content") if "delta" in ch else ch["text"]
                texts[ch["index"]] = texts.get(ch["index"], "") + (piece or "")
    return texts, chunks


def test_n_choices_are_seeded_distinct_and_reproducible(server):
    body = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 1.0, "n": 3, "seed": 42,
            "ignore_eos": True}
    a = post(server, "/v1/completions", body).json()
    b = post(server, "/v1/completions", body).json()
    texts = [c["text"] for c in a["choices"]]
    assert [c["index"] for c in a["choices"]] == [0, 1, 2]
    assert texts == [c["text"] for c in b["choices"]]
    assert len(set(texts)) == 3
    assert a["usage"]["completion_tokens"] == 36 and a["usage"]["prompt_tokens"] == 5
    # Choice i is the request with seed 42 + i.
    one = post(server, "/v1/completions", body | {"n": 1, "seed": 43}).json()
    assert one["choices"][0]["text"] == texts[1]
    streamed, _ = stream_choices(server, "/v1/completions", body)
    assert [streamed[i] for i in range(3)] == texts


def test_completion_logprobs_integer_form(server):
    body = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0, "logprobs": 3}
    r = post(server, "/v1/completions", body).json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 6
    assert "".join(lp["tokens"]) == r["choices"][0]["text"]
    for tok, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert value <= 0 and len(top) == 3
        assert max(top.values()) == pytest.approx(value)  # greedy picks the most likely token
        assert top[tok] == pytest.approx(value)
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(6)]
    _, chunks = stream_choices(server, "/v1/completions", body)
    streamed = [v for c in chunks for ch in c["choices"] if ch["logprobs"] for v in ch["logprobs"]["token_logprobs"]]
    assert streamed == pytest.approx(lp["token_logprobs"])


def test_chat_logprobs_and_top_logprobs(server):
    body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 5, "temperature": 0,
            "logprobs": True, "top_logprobs": 2}
    r = post(server, "/v1/chat/completions", body).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert "".join(c["token"] for c in content) == r["choices"][0]["message"]["content"]
    for c in content:
        assert len(c["top_logprobs"]) == 2 and c["top_logprobs"][0]["logprob"] == pytest.approx(c["logprob"])
        assert bytes(c["bytes"]).decode() == c["token"]
    r = post(server, "/v1/chat/completions", body | {"logprobs": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_c08_echo_with_max_tokens_zero_scores_the_prompt(server):
    body = {"prompt": "Your answer: Yes", "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200
    c = r.json()["choices"][0]
    prompt_ids = post(server, "/tokenize", {"prompt": "Your answer: Yes"}).json()["tokens"]
    assert c["text"] == "Your answer: Yes"
    assert len(c["logprobs"]["tokens"]) == len(prompt_ids) and "".join(c["logprobs"]["tokens"]) == c["text"]
    assert c["logprobs"]["token_logprobs"][0] is None
    assert all(v <= 0 for v in c["logprobs"]["token_logprobs"][1:])
    assert r.json()["usage"]["completion_tokens"] == 0
    plain = post(server, "/v1/completions", {"prompt": "Your answer: Yes", "max_tokens": 0})
    assert plain.status_code == 200 and plain.json()["choices"][0]["text"] == ""
    # Echo with generation: prompt text, then the completion.
    full = post(server, "/v1/completions", {"prompt": "Your answer: Yes", "max_tokens": 4, "temperature": 0}).json()
    echoed = post(server, "/v1/completions", {"prompt": "Your answer: Yes", "max_tokens": 4, "temperature": 0,
                                              "echo": True}).json()
    assert echoed["choices"][0]["text"] == "Your answer: Yes" + full["choices"][0]["text"]
    streamed, _ = stream_choices(server, "/v1/completions", {"prompt": "Your answer: Yes", "max_tokens": 4,
                                                             "temperature": 0, "echo": True})
    assert streamed[0] == echoed["choices"][0]["text"]


def test_penalties_reduce_or_encourage_repetition(server):
    base = {"prompt": "one one one one one one", "max_tokens": 8, "temperature": 0, "logprobs": 0,
            "ignore_eos": True}

    def distinct(extra: dict) -> tuple[str, int]:
        c = post(server, "/v1/completions", base | extra).json()["choices"][0]
        return c["text"], len(set(c["logprobs"]["tokens"]))

    plain, plain_distinct = distinct({})
    assert plain_distinct < 8  # the model repeats itself here
    for extra in ({"frequency_penalty": 2.0}, {"repetition_penalty": 5.0}):
        text, n = distinct(extra)
        assert text != plain and n > plain_distinct, extra
        streamed, _ = stream_choices(server, "/v1/completions", base | extra)
        assert streamed[0] == text
    _, n = distinct({"presence_penalty": -2.0})  # encouragement
    assert n <= plain_distinct


@pytest.mark.parametrize("name", ["presence_penalty", "frequency_penalty"])
def test_penalty_matches_the_openai_definition(server, name):
    """Second token, with one token generated: logit - penalty * [token == first] (count is 1, so both
    penalties act alike), predicted from the unpenalized top-5 logprobs."""
    base = {"prompt": "Hello Hello Hello Hello Hello", "max_tokens": 2, "temperature": 0, "logprobs": 5,
            "ignore_eos": True}
    plain = post(server, "/v1/completions", base).json()["choices"][0]["logprobs"]
    first, top = plain["tokens"][0], plain["top_logprobs"][1]
    assert first in top  # the first token is a candidate again
    outcomes = set()
    for penalty in (0.5, 1.0, 2.0, -1.0):
        scores = {t: lp - (penalty if t == first else 0.0) for t, lp in top.items()}
        expected = max(scores, key=scores.get)
        got = post(server, "/v1/completions", base | {name: penalty}).json()["choices"][0]["logprobs"]["tokens"]
        assert got == [first, expected], (penalty, top)
        outcomes.add(expected)
    assert len(outcomes) == 2  # the penalties were large enough to change the choice


def test_logit_bias_and_min_tokens(server):
    hello = post(server, "/tokenize", {"prompt": "Hello", "add_special_tokens": False}).json()["tokens"]
    assert len(hello) == 1
    r = post(server, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0,
                                         "logit_bias": {str(hello[0]): 100}}).json()
    assert r["choices"][0]["text"] == "HelloHelloHello"
    chat = {"messages": [{"role": "user", "content": "Say hi."}], "temperature": 0, "max_tokens": 40}
    short = post(server, "/v1/chat/completions", chat).json()
    n = short["usage"]["completion_tokens"]
    assert short["choices"][0]["finish_reason"] == "stop" and n < 30
    longer = post(server, "/v1/chat/completions", chat | {"min_tokens": n + 5}).json()
    assert longer["usage"]["completion_tokens"] >= n + 5
    # "--5", "²" (a digit to str.isdigit, not to int()) and 5,000 digits (past int()'s 4,300) were a 500
    for bad in ({"999999": 1}, {"-1": 1}, {"abc": 1}, {"5": 101}, {"--5": 1}, {"\u00b2": 1}, {"1" * 5000: 1}):
        for route, body in (("/v1/completions", {"prompt": "Hi"}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
            r = post(server, route, body | {"logit_bias": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", (route, bad, r.text)
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                              "stop_token_ids": [2, 49152]})
    assert r.status_code == 400
    assert r.json()["error"] == {"message": "stop_token_ids has token id 49152 outside the vocabulary [0, 49152)",
                                 "type": "invalid_request_error", "param": "stop_token_ids", "code": 400}
    r = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 4, "min_tokens": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"


def test_tokenize_and_detokenize(server):
    r = post(server, "/tokenize", {"prompt": "Hello world"}).json()
    assert r["count"] == len(r["tokens"]) == 2 and r["max_model_len"] == 8192
    assert post(server, "/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": "Hello world"}
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}).json()
    full = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                 "max_tokens": 1}).json()
    assert chat["count"] == full["usage"]["prompt_tokens"]
    for bad in ({"tokens": [-1]}, {"tokens": [49152]}, {"tokens": [1.5]}, {"tokens": "abc"}):
        r = post(server, "/detokenize", bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = post(server, "/tokenize", {})
    assert r.status_code == 400


def test_null_fields_take_their_defaults(server):
    """OpenAI's API takes null for an optional field as its default ("temperature": null samples at 1), so the same
    seeded request answers the same with and without them; a required field stays required."""
    nulls = {"temperature": None, "top_p": None, "n": None, "stream": None, "presence_penalty": None,
             "frequency_penalty": None, "logit_bias": None, "stop": None, "user": None}
    for route, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "logprobs": None}),
                        ("/v1/completions", {"prompt": "Hi", "echo": None, "best_of": None, "logprobs": None})):
        body = {**body, "seed": 7, "max_tokens": 6}
        plain = post(server, route, {k: v for k, v in body.items() if v is not None})
        with_nulls = post(server, route, {**body, **nulls})
        assert plain.status_code == with_nulls.status_code == 200, with_nulls.text
        assert plain.json()["choices"] == with_nulls.json()["choices"]
    r = post(server, "/v1/chat/completions", {"messages": None})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "messages")


def test_unknown_fields_are_ignored_and_max_completion_tokens(server):
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "temperature": 0,
                                              "max_completion_tokens": 3, "user": "u1", "frobnicate": {"x": 1},
                                              "parallel_tool_calls": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert not math.isnan(r.json()["created"])
    # A refused value is named as the client sent it.
    for field in ("max_completion_tokens", "max_tokens"):
        r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], field: 0})
        assert (r.status_code, r.json()["error"]["message"], r.json()["error"]["param"]) == (
            400, f"{field}: must be at least 1 for chat completions", field)
    # stream_options belongs to streamed requests (OpenAI answers 400 too); null is no options.
    for route, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
                        ("/v1/completions", {"prompt": "Hi"})):
        r = post(server, route, {**body, "max_tokens": 2, "stream_options": {"include_usage": True}})
        assert (r.status_code, r.json()["error"]["message"], r.json()["error"]["param"]) == (
            400, "stream_options: only allowed when stream is true", "stream_options")
        assert post(server, route, {**body, "max_tokens": 2, "stream_options": None}).status_code == 200
    # Over the context too: the error names the field whose value was refused.
    limit = httpx.get(server.base_url + "/v1/models").json()["data"][0]["max_model_len"]
    for route, body, field in (
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                      "max_completion_tokens": limit, "max_tokens": 5}, "max_completion_tokens"),
            ("/v1/completions", {"prompt": [7, 8], "max_completion_tokens": limit}, "max_completion_tokens"),
            ("/v1/completions", {"prompt": [7, 8], "max_completion_tokens": 5, "max_tokens": limit}, "max_tokens")):
        r = post(server, route, body)
        err = r.json()["error"]
        assert (r.status_code, err["param"]) == (400, field), r.text
        msg = err["message"]
        assert f"{field} is {limit}, " in msg and f": lower {field} to at most " in msg, msg
        assert "max_tokens" not in msg.replace(field, ""), msg  # the other field is not named
    # One token is "1 token".
    r = post(server, "/v1/completions", {"prompt": [7], "max_tokens": limit})
    assert (r.status_code, r.json()["error"]["message"]) == (
        400, f"this model's maximum context length is {limit} tokens; the prompt has 1 token and max_tokens is "
             f"{limit}, {limit + 1} in all: lower max_tokens to at most {limit - 1}")
