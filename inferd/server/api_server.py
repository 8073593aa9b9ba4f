"""OpenAI-compatible HTTP server (FastAPI on uvicorn).

Routes: POST /v1/completions, POST /v1/chat/completions (streamed as server-sent events or not),
GET /v1/models, GET /health (503 until the model is loaded), GET /metrics (Prometheus text format).
Errors use OpenAI's body: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from inferd.config import EngineConfig
from inferd.engine.async_engine import AsyncLLMEngine
from inferd.engine.llm_engine import LLMEngine, RequestOutput
from inferd.engine.metrics import EngineMetrics
from inferd.engine.sampling_params import SamplingParams
from inferd.errors import EngineDeadError, InvalidRequestError
from inferd.server.protocol import ChatCompletionRequest, CompletionRequest

logger = logging.getLogger("inferd.server")


def error_response(status: int, message: str, param: str | None = None,
                   type_: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(status_code=status,
                        content={"error": {"message": message, "type": type_, "param": param, "code": status}})


class ServerState:
    """The engine once loaded, the load error if it failed, and the server-level metrics."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.registry = CollectorRegistry()
        self.http_requests = Counter("inferd:http_requests", "HTTP requests by route and status code",
                                     ["route", "status"], registry=self.registry)
        self.metrics = EngineMetrics(config.model_name(), self.registry)
        self.engine: AsyncLLMEngine | None = None
        self.load_error: BaseException | None = None
        self.created = int(time.time())

    def load(self) -> None:
        try:
            engine = LLMEngine(self.config, self.metrics)
            self.engine = AsyncLLMEngine(engine)
        except BaseException as e:  # noqa: BLE001 - reported by /health and the log
            logger.exception("model load failed")
            self.load_error = e


def create_app(config: EngineConfig) -> FastAPI:
    """Build the app; the model loads on a background thread when the app starts, so /health answers
    503 while loading."""
    state = ServerState(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        threading.Thread(target=state.load, name="inferd-load", daemon=True).start()
        yield
        if state.engine is not None:
            state.engine.shutdown()

    app = FastAPI(title="inferd", version="0.1.0", lifespan=lifespan)
    app.state.inferd = state

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        err = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        param = loc[0] if loc else None
        kind = err.get("type", "")
        if kind == "json_invalid":
            msg = "the request body is not valid JSON"
        elif kind == "missing" and not loc:
            msg = "the request body is empty: send a JSON object"
        elif kind in ("model_attributes_type", "model_type", "dict_type") and not loc:
            msg = "the request body must be a JSON object (with Content-Type: application/json)"
        else:
            where = ".".join(loc) if loc else "body"
            msg = f"{where}: {err.get('msg', 'invalid value')}"
        return error_response(400, msg, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), None,
                              "not_found_error" if exc.status_code == 404 else "invalid_request_error")

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        logger.exception("internal error on %s", request.url.path)
        return error_response(500, "internal server error", None, "internal_server_error")

    app.add_middleware(_CountRequests, counter=state.http_requests)
    app.add_middleware(_DefaultJSONContentType)

    def engine_or_503() -> AsyncLLMEngine | JSONResponse:
        if state.engine is None:
            if state.load_error is not None:
                return error_response(503, f"the model failed to load: {state.load_error}", None,
                                      "service_unavailable")
            return error_response(503, "the model is loading", None, "service_unavailable")
        if state.engine.dead is not None:
            return error_response(503, "the engine has stopped; see the server log", None,
                                  "service_unavailable")
        return state.engine

    @app.get("/health")
    async def health():
        eng = engine_or_503()
        return eng if isinstance(eng, JSONResponse) else Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        eng = engine_or_503()
        if isinstance(eng, JSONResponse):
            return eng
        e = eng.engine
        return {"object": "list", "data": [{"id": e.model_name, "object": "model", "created": state.created,
                                            "owned_by": "inferd", "max_model_len": e.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        eng = engine_or_503()
        if isinstance(eng, JSONResponse):
            return eng
        err = _check_model(eng, body.model)
        if err:
            return err
        prompts = _completion_prompts(eng.engine, body.prompt)
        if isinstance(prompts, JSONResponse):
            return prompts
        max_tokens = body.max_tokens or body.max_completion_tokens or 16
        return await _serve(eng, request, body, prompts, max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        eng = engine_or_503()
        if isinstance(eng, JSONResponse):
            return eng
        err = _check_model(eng, body.model)
        if err:
            return err
        messages = []
        for m in body.messages:
            content = m.content if isinstance(m.content, str) or m.content is None else \
                "".join(p.text for p in m.content)
            messages.append({"role": "system" if m.role == "developer" else m.role, "content": content or ""})
        try:
            text = eng.engine.apply_chat_template(messages, body.add_generation_prompt)
        except Exception as e:  # noqa: BLE001 - a template that rejects these messages
            return error_response(400, f"messages: the chat template rejected them: {e}", "messages")
        ids = eng.engine.encode(text, add_special_tokens=False)
        max_tokens = body.max_completion_tokens or body.max_tokens
        return await _serve(eng, request, body, [ids], max_tokens, chat=True)

    return app


class _DefaultJSONContentType:
    """A POST without a Content-Type header is read as JSON (the body is still validated); any other
    declared type that is not JSON is refused by the route with a 400."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST" and \
                not any(k == b"content-type" for k, _ in scope["headers"]):
            scope = dict(scope, headers=[*scope["headers"], (b"content-type", b"application/json")])
        await self.app(scope, receive, send)


class _CountRequests:
    """Pure ASGI middleware counting responses by route and status (a BaseHTTPMiddleware would hide
    client disconnects from the handlers)."""

    def __init__(self, app, counter: Counter) -> None:
        self.app = app
        self.counter = counter

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_counted(message):
            if message["type"] == "http.response.start":
                route = scope.get("route")
                self.counter.labels(getattr(route, "path", "unmatched"), str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, send_counted)


def _check_model(eng: AsyncLLMEngine, model: str | None) -> JSONResponse | None:
    if model is not None and model != eng.engine.model_name:
        return error_response(404, f"the model {model!r} does not exist; this server serves "
                                   f"{eng.engine.model_name!r}", "model", "not_found_error")
    return None


def _completion_prompts(engine: LLMEngine, prompt) -> list[list[int]] | JSONResponse:
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        return error_response(400, "prompt: must not be an empty list", "prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return [engine.encode(p) if isinstance(p, str) else list(p) for p in prompt]


async def _serve(eng: AsyncLLMEngine, request: Request, body, prompts: list[list[int]],
                 max_tokens: int | None, chat: bool):
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                                top_k=body.top_k, min_p=body.min_p, seed=body.seed, stop=body.stop or [],
                                stop_token_ids=body.stop_token_ids or [], ignore_eos=body.ignore_eos)
        base_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        streams = []
        for i, ids in enumerate(prompts):
            gen = eng.generate(f"{base_id}-{i}", ids, params)
            first = await anext(gen)  # raises InvalidRequestError before any byte is sent
            streams.append((i, first, gen))
    except InvalidRequestError as e:
        for _, _, g in streams:
            await g.aclose()
        return error_response(400, e.message, e.param)
    except EngineDeadError as e:
        return error_response(503, str(e), None, "service_unavailable")
    created = int(time.time())
    model = eng.engine.model_name
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    if body.stream:
        return StreamingResponse(_stream(streams, base_id, created, model, chat, include_usage),
                                 media_type="text/event-stream")
    return await _collect(request, streams, base_id, created, model, chat)


async def _merged(streams) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come, tagged with their choice index."""
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i, first, gen):
        try:
            await q.put((i, first))
            if not first.finished:
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
        for _, _, gen in streams:
            await gen.aclose()  # aborts the requests that have not finished


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def _collect(request: Request, streams, base_id, created, model, chat):
    texts = {i: "" for i, _, _ in streams}
    finals: dict[int, RequestOutput] = {}

    async def run():
        async for i, out in _merged(streams):
            texts[i] += out.delta_text
            if out.finished:
                finals[i] = out

    task = asyncio.create_task(run())
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
    task.result()
    if any(f.finish_reason == "error" for f in finals.values()):
        return error_response(500, "the model failed on this request; see the server log", None,
                              "internal_server_error")
    choices = []
    for i in sorted(finals):
        f = finals[i]
        if chat:
            choices.append({"index": i, "message": {"role": "assistant", "content": texts[i]},
                            "logprobs": None, "finish_reason": f.finish_reason, "stop_reason": f.stop_reason})
        else:
            choices.append({"index": i, "text": texts[i], "logprobs": None, "finish_reason": f.finish_reason,
                            "stop_reason": f.stop_reason})
    usage = _usage(sum(f.num_prompt_tokens for f in finals.values()),
                   sum(f.num_output_tokens for f in finals.values()))
    return {"id": base_id, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": choices, "usage": usage}


async def _stream(streams, base_id, created, model, chat, include_usage) -> AsyncIterator[str]:
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choices, usage=None) -> str:
        data = {"id": base_id, "object": obj, "created": created, "model": model, "choices": choices}
        if include_usage:
            data["usage"] = usage
        return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

    prompt_tokens = {}
    output_tokens = {}
    if chat:
        for i, _, _ in streams:
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
    async for i, out in _merged(streams):
        prompt_tokens[i] = out.num_prompt_tokens
        output_tokens[i] = out.num_output_tokens
        if out.finish_reason == "error":
            err = {"error": {"message": "the model failed on this request; see the server log",
                             "type": "internal_server_error", "param": None, "code": 500}}
            yield f"data: {json.dumps(err)}\n\n"
            return
        if not out.delta_text and not out.finished:
            continue
        reason = out.finish_reason if out.finished else None
        if chat:
            delta = {"content": out.delta_text} if out.delta_text or not out.finished else {}
            c = {"index": i, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            c = {"index": i, "text": out.delta_text, "logprobs": None, "finish_reason": reason}
        if out.finished:
            c["stop_reason"] = out.stop_reason
        yield chunk([c])
    if include_usage:
        yield chunk([], _usage(sum(prompt_tokens.values()), sum(output_tokens.values())))
    yield "data: [DONE]\n\n"
