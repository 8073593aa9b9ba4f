"""Running OpenAI completion and chat requests on the async engine: choices, usage, logprobs, SSE."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from inferd.engine.async_engine import AsyncLLMEngine
from inferd.engine.llm_engine import RequestOutput
from inferd.engine.sampler import TokenLogprobs
from inferd.engine.sampling_params import SamplingParams
from inferd.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
from inferd.gateway import context as gateway_context
from inferd.gateway.context import EngineTimes


def error_response(status: int, message: str, param: str | None = None,
                   type_: str = "invalid_request_error", headers: dict[str, str] | None = None) -> JSONResponse:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return JSONResponse(status_code=status, headers=headers,
                        content={"error": {"message": message, "type": type_, "param": param, "code": status}})


def as_sent(e: InvalidRequestError, max_tokens_field: str) -> tuple[str, str | None]:
    """The error's message and param, an error about ``max_tokens`` naming the field the client sent instead."""
    if e.param == "max_tokens" and max_tokens_field != "max_tokens":
        return e.message.replace("max_tokens", max_tokens_field), max_tokens_field
    return e.message, e.param


@dataclass
class Job:
    """What to run for one HTTP request.

    Attributes:
        prompts: token ids of each prompt; each gives ``n`` choices (index ``prompt * n + i``).
        params: sampling parameters of choice 0; choice i of a seeded request uses ``seed + i``.
        chat: chat.completion shapes instead of text_completion.
        echo: put the prompt text (and its logprobs) in front of each completion.
        score_only: ``max_tokens`` was 0: compute the prompt only, return no generated token.
        logprobs: top-k per token for the logprobs block, or None for no logprobs.
        max_tokens_field: the field the client sent the output length in (``max_tokens`` or
            ``max_completion_tokens``), which an error about it names.
        default_max_tokens: ``max_tokens`` was not sent and ``params.max_tokens`` is the API's default (16 for
            completions): each prompt gets at most the room its context leaves, as vLLM does, rather than a 400
            about a value the client never sent.
    """

    prompts: list[list[int]]
    params: SamplingParams
    n: int = 1
    chat: bool = False
    echo: bool = False
    score_only: bool = False
    logprobs: int | None = None
    stream: bool = False
    include_usage: bool = False
    default_max_tokens: bool = False
    max_tokens_field: str = "max_tokens"
    id: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass
class _ChoiceState:
    prompt_idx: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list | None = None
    final: RequestOutput | None = None
    echo_len: int = 0


class Serving:
    """Formats engine outputs as OpenAI responses for one model."""

    def __init__(self, eng: AsyncLLMEngine) -> None:
        self.eng = eng
        self.engine = eng.engine

    def _token_text(self, token_id: int) -> str:
        with self.engine.tokenizer_lock:
            return self.engine.tokenizer.decode([token_id])

    async def run(self, request: Request, job: Job):
        """Start every choice (validation errors become a 400 before anything is sent), then stream or
        collect. A stream's headers (and a chat stream's role chunk) go out once every choice is accepted,
        before the first token: a client can tell a long prefill from a server that does not answer."""
        base_id = ("chatcmpl-" if job.chat else "cmpl-") + job.id
        streams = []
        priority = gateway_context.priority()
        try:
            for p, ids in enumerate(job.prompts):
                prompt_params, room = job.params, self.engine.max_model_len - len(ids)
                if job.default_max_tokens and max(1, prompt_params.min_tokens) <= room < prompt_params.max_tokens:
                    prompt_params = dataclasses.replace(prompt_params, max_tokens=room)
                for i in range(job.n):
                    params = prompt_params
                    if job.n > 1 and params.seed is not None:
                        params = dataclasses.replace(params, seed=params.seed + i)
                    gen = self.eng.generate(f"{base_id}-{p * job.n + i}", ids, params, priority, announce=True)
                    streams.append((p * job.n + i, None, gen))
                    await anext(gen)  # accepted (or refused: raised here)
                    if not job.stream:
                        streams[-1] = (p * job.n + i, await anext(gen), gen)
        except InvalidRequestError as e:
            await _close(streams)
            message, param = as_sent(e, job.max_tokens_field)
            return error_response(400, f"prompt {p}: {message}" if len(job.prompts) > 1 else message, param)
        except EngineOverloadedError as e:
            await _close(streams)
            gateway_context.record_shed()
            return error_response(503, str(e), None, "service_unavailable", {"retry-after": str(e.retry_after)})
        except EngineDeadError as e:
            await _close(streams)
            gateway_context.record_outcome(False)
            return error_response(503, str(e), None, "service_unavailable")
        except BaseException:  # cancelled (a deadline): abort what was added
            await _close(streams)
            raise
        states = {idx: _ChoiceState(idx // job.n) for idx, _, _ in streams}
        created = int(time.time())
        if job.stream:
            return StreamingResponse(self._stream(job, streams, states, base_id, created),
                                     media_type="text/event-stream")
        return await self._collect(request, job, streams, states, base_id, created)

    def _account(self, job: Job, states: dict[int, _ChoiceState]) -> None:
        """Tell the gateway the request's tokens (quotas, audit), timeline (tracing) and outcome
        (circuit breaker)."""
        usage = self._usage(job, states)
        prompts = None
        ctx = gateway_context.current.get()
        if ctx is not None and ctx.keep_text:
            with self.engine.tokenizer_lock:
                prompts = [self.engine.tokenizer.decode(ids) for ids in job.prompts]
        gateway_context.record_usage(usage["prompt_tokens"], usage["completion_tokens"], prompts,
                                     [states[i].text for i in sorted(states)])
        for st in states.values():
            if st.final is not None and st.final.times is not None:
                gateway_context.record_engine_times(EngineTimes(*st.final.times))
        reasons = [None if st.final is None else st.final.finish_reason for st in states.values()]
        if "error" in reasons:
            gateway_context.record_outcome(False)
        elif None not in reasons:
            gateway_context.record_outcome(True)

    # ---- shapes ------------------------------------------------------------------------------------
    def _usage(self, job: Job, states: dict[int, _ChoiceState]) -> dict:
        prompt = sum(len(ids) for ids in job.prompts)
        completion = 0 if job.score_only else sum(len(s.token_ids) for s in states.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _completion_logprobs(self, entries: list[TokenLogprobs | None], token_ids: list[int], offset: int) -> dict:
        tokens, lps, tops, offsets = [], [], [], []
        for tid, e in zip(token_ids, entries):
            t = self._token_text(tid)
            tokens.append(t)
            offsets.append(offset)
            offset += len(t)
            lps.append(None if e is None else e.logprob)
            tops.append(None if e is None else {self._token_text(i): lp for i, lp in e.top})
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def _chat_logprobs(self, entries: list[TokenLogprobs]) -> dict:
        def item(tid: int, lp: float) -> dict:
            t = self._token_text(tid)
            return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}

        return {"content": [item(e.token_id, e.logprob) | {"top_logprobs": [item(i, lp) for i, lp in e.top]}
                            for e in entries]}

    def _prompt_part(self, job: Job, st: _ChoiceState) -> tuple[str, dict | None]:
        """Echoed prompt text and its logprobs block (completions only)."""
        ids = job.prompts[st.prompt_idx]
        with self.engine.tokenizer_lock:
            text = self.engine.tokenizer.decode(ids)
        lp = None
        if job.logprobs is not None:
            lp = self._completion_logprobs(st.prompt_logprobs or [None] * len(ids), ids, 0)
        return text, lp

    # ---- non-streamed ------------------------------------------------------------------------------
    async def _collect(self, request: Request, job: Job, streams, states, base_id: str, created: int):
        async def run():
            async for idx, out in _merged(streams):
                _absorb(states[idx], out)

        task = asyncio.create_task(run())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.25)
                if done:
                    break
                if await request.is_disconnected():
                    task.cancel()  # closes the generators, which abort the requests
                    try:
                        await task
                    except asyncio.CancelledError:
                        pass
                    return Response(status_code=499)
        finally:
            if not task.done():  # this handler was cancelled (a deadline): abort the requests
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            self._account(job, states)
        task.result()
        if any(s.final.finish_reason == "error" for s in states.values()):
            return error_response(500, "the model failed on this request; see the server log", None,
                                  "internal_server_error")
        choices = []
        for idx in sorted(states):
            st = states[idx]
            f = st.final
            reason = "length" if job.score_only else f.finish_reason
            text = "" if job.score_only else st.text
            if job.chat:
                lp = self._chat_logprobs(st.logprobs) if job.logprobs is not None else None
                choices.append({"index": idx, "message": {"role": "assistant", "content": text},
                                "logprobs": lp, "finish_reason": reason, "stop_reason": f.stop_reason})
                continue
            lp = None
            out_ids = [] if job.score_only else st.token_ids
            out_lps = [] if job.score_only else st.logprobs
            if job.echo:
                ptext, plp = self._prompt_part(job, st)
                text = ptext + text
                if plp is not None:
                    more = self._completion_logprobs(out_lps, out_ids, len(ptext))
                    lp = {k: plp[k] + more[k] for k in plp}
            elif job.logprobs is not None:
                lp = self._completion_logprobs(out_lps, out_ids, 0)
            choices.append({"index": idx, "text": text, "logprobs": lp, "finish_reason": reason,
                            "stop_reason": f.stop_reason})
        return {"id": base_id, "object": "chat.completion" if job.chat else "text_completion",
                "created": created, "model": self.engine.model_name, "choices": choices,
                "usage": self._usage(job, states)}

    # ---- streamed ----------------------------------------------------------------------------------
    async def _stream(self, job: Job, streams, states, base_id: str, created: int) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if job.chat else "text_completion"
        model = self.engine.model_name

        def chunk(choices, usage=None) -> str:
            data = {"id": base_id, "object": obj, "created": created, "model": model, "choices": choices}
            if job.include_usage:
                data["usage"] = usage
            return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

        try:
            for idx in sorted(states):
                if job.chat:
                    yield chunk([{"index": idx, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}])
            echoed: set[int] = set()
            merged = _merged(streams)
            while True:
                try:
                    idx, out = await anext(merged)
                except StopAsyncIteration:
                    break
                except (EngineDeadError, InvalidRequestError) as e:  # after the headers: an error event
                    bad = isinstance(e, InvalidRequestError)
                    err = {"error": {"message": str(e), "param": getattr(e, "param", None),
                                     "type": "invalid_request_error" if bad else "service_unavailable",
                                     "code": 400 if bad else 503}}
                    yield f"data: {json.dumps(err)}\n\n"
                    return
                st = states[idx]
                _absorb(st, out)
                if out.finish_reason == "error":
                    err = {"error": {"message": "the model failed on this request; see the server log",
                                     "type": "internal_server_error", "param": None, "code": 500}}
                    yield f"data: {json.dumps(err)}\n\n"
                    return
                text = "" if job.score_only else out.delta_text
                lps = [] if job.score_only else out.delta_logprobs
                ids = [] if job.score_only else out.delta_token_ids
                prefix, prefix_lp = "", None
                if job.echo and idx not in echoed:
                    echoed.add(idx)
                    prefix, prefix_lp = self._prompt_part(job, st)
                    st.echo_len = len(prefix)
                if not (text or prefix or out.finished or (job.logprobs is not None and lps)):
                    continue
                reason = ("length" if job.score_only else out.finish_reason) if out.finished else None
                if job.chat:
                    delta = {"content": text} if text or not out.finished else {}
                    lp = self._chat_logprobs(lps) if job.logprobs is not None else None
                    c = {"index": idx, "delta": delta, "logprobs": lp, "finish_reason": reason}
                else:
                    lp = None
                    if job.logprobs is not None:
                        offset = st.echo_len + (0 if job.score_only else len(st.text) - len(text))
                        lp = self._completion_logprobs(lps, ids, offset)
                        if prefix_lp is not None:
                            lp = {k: prefix_lp[k] + lp[k] for k in lp}
                    c = {"index": idx, "text": prefix + text, "logprobs": lp, "finish_reason": reason}
                if out.finished:
                    c["stop_reason"] = out.stop_reason
                yield chunk([c])
            if job.include_usage:
                yield chunk([], self._usage(job, states))
            yield "data: [DONE]\n\n"
        finally:
            self._account(job, states)


def _absorb(st: _ChoiceState, out: RequestOutput) -> None:
    st.text += out.delta_text
    st.token_ids.extend(out.delta_token_ids)
    st.logprobs.extend(out.delta_logprobs)
    if out.prompt_logprobs is not None:
        st.prompt_logprobs = out.prompt_logprobs
    if out.finished:
        st.final = out


async def _close(streams) -> None:
    for _, _, gen in streams:
        await gen.aclose()


async def _merged(streams) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come, tagged with their choice index; closing it aborts the
    requests that have not finished."""
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i, first, gen):
        try:
            if first is not None:  # fetched already (None: a stream that starts before its first output)
                await q.put((i, first))
            if first is None or not first.finished:
                async for out in gen:
                    await q.put((i, out))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            await q.put((i, e))

    tasks = [asyncio.create_task(pump(*s)) for s in streams]
    remaining = len(streams)
    try:
        while remaining:
            i, item = await q.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                remaining -= 1
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await _close(streams)
