"""The HTTP server (FastAPI on uvicorn): the OpenAI API over the LLM and embedding models, and the KServe
v2 routes (:mod:`inferd.server.kserve`) over every model of the :class:`ModelManager`.

OpenAI routes: POST /v1/completions, POST /v1/chat/completions (streamed as server-sent events or not),
POST /v1/embeddings, GET /v1/models, POST /tokenize and /detokenize, GET /health (503 until every model
is loaded), GET /metrics (Prometheus text format). Their errors use OpenAI's body:
``{"error": {"message", "type", "param", "code"}}``. Tokenization and chat templates run in the thread
pool, off the event loop. ``inferd serve --model`` is a manager with one model defined in code.
"""

from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from inferd.config import EngineConfig
from inferd.engine.async_engine import AsyncLLMEngine
from inferd.engine.llm_engine import LLMEngine
from inferd.engine.sampling_params import SamplingParams
from inferd.errors import InvalidRequestError, first_field_error
from inferd.gateway import context as gateway_context
from inferd.gateway.config import GatewayConfig
from inferd.gateway.gateway import Gateway
from inferd.gateway.http import GatewayMiddleware
from inferd.repository.config import parse_config
from inferd.repository.manager import LoadedVersion, ModelManager, ModelNotFoundError, ModelUnavailableError
from inferd.server.embeddings import create_embeddings
from inferd.server.kserve import create_router
from inferd.server.limits import LONE_SURROGATE_MESSAGE, BodySizeLimit, decode_error, has_lone_surrogate
from inferd.server.protocol import (TOOLS_UNSUPPORTED, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                    EmbeddingRequest, TokenizeRequest)
from inferd.server.serving import Job, Serving, as_sent, error_response

logger = logging.getLogger("inferd.server")

class ServerState:
    """The models (a :class:`ModelManager`) and the server-level metrics."""

    def __init__(self, manager: ModelManager, registry: CollectorRegistry, default_model: str | None) -> None:
        self.manager = manager
        self.registry = registry
        self.default_model = default_model  # what a request without "model" gets (single-model mode)
        self.http_requests = Counter("inferd:http_requests", "HTTP requests by route and status code",
                                     ["route", "status"], registry=registry)
        self.created = int(time.time())
        self.grpc_server = None
        self.gateway: Gateway | None = None
        # Why the server must stop: the model given on the command line failed to load (DrainingServer exits).
        self.fatal_error: str | None = None

    async def stop_grpc(self, grace: float) -> None:
        """Stop the gRPC server (new calls refused, running ones get ``grace`` seconds); idempotent, so
        the drain can start it as soon as shutdown begins."""
        server, self.grpc_server = self.grpc_server, None
        if server is not None:
            await server.stop(grace=grace)


def create_app(config: EngineConfig | None = None, *, repository: str | None = None,
               control_mode: str = "none", poll_interval: float = 15.0, startup_models: tuple[str, ...] = (),
               grpc_port: int | None = None, grpc_host: str = "127.0.0.1",
               gateway: GatewayConfig | None = None) -> FastAPI:
    """Build the app over one LLM (``config``), a model repository, or both.

    Models load on a background thread when the app starts, so the readiness routes answer 503 (400 on
    /v2) while loading. With ``grpc_port`` the KServe gRPC service starts on the same event loop
    (port 0 = any free port; the bound port is ``app.state.inferd.grpc_server.bound_port``). Every
    route, HTTP and gRPC, is behind the :mod:`inferd.gateway` configured by ``gateway`` (defaults:
    no authentication, a 100 MiB body limit, 1024 waiting requests per model, circuit breakers).

    Raises:
        FileNotFoundError: ``repository`` is not a folder.
        ValueError: an unknown control mode, or an unusable gateway configuration (ConfigError).
    """
    registry = CollectorRegistry()
    gateway_config = gateway or GatewayConfig()
    gw = Gateway(gateway_config, registry)
    static = {}
    default_model = None
    if config is not None:
        default_model = config.model_name()
        static[default_model] = (parse_config('backend: "llm"', default_model), config)
    elif repository is None:
        raise ValueError("give a model or a model repository")
    manager = ModelManager(registry, repository, control_mode, poll_interval, startup_models, static,
                           engine_setup=gw.setup_engine)
    state = ServerState(manager, registry, default_model)
    state.gateway = gw

    def _static_error(name: str, message: str) -> None:
        state.fatal_error = f"model {name!r} failed to load: {message}"

    manager.on_static_error = _static_error

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        manager.start(background=True)
        if grpc_port is not None:
            from inferd.server.kserve_grpc import start_grpc_server

            state.grpc_server = await start_grpc_server(manager, grpc_host, grpc_port, gw)
        yield
        await state.stop_grpc(gateway_config.shedding.drain_timeout_s)
        await run_in_threadpool(manager.stop)
        gw.close()

    app = FastAPI(title="inferd", version="0.1.0", lifespan=lifespan)
    app.state.inferd = state
    app.include_router(create_router(manager, gateway_config.shedding.max_request_body_bytes))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        loc, message, kind = first_field_error(exc.errors())
        param = loc[0] if loc and kind != "json_invalid" else None  # json_invalid's loc is a char offset
        if kind == "json_invalid":
            msg = "the request body is not valid JSON"
        elif kind == "missing" and not loc:
            msg = "the request body is empty: send a JSON object"
        elif kind in ("model_attributes_type", "model_type", "dict_type") and not loc:
            msg = "the request body must be a JSON object (with Content-Type: application/json)"
        else:
            where = ".".join(loc) if loc else "body"
            msg = f"{where}: {message}"
        return error_response(400, msg, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if request.url.path.startswith("/v2"):  # KServe's error shape
            return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code)
        if exc.status_code == 400 and exc.detail == "There was an error parsing the body":  # FastAPI's, for any
            # exception of json.loads but a JSONDecodeError: RecursionError, or ValueError for an integer of more
            # digits than Python converts (sys.get_int_max_str_digits)
            return error_response(400, "the request body could not be parsed as JSON: arrays or objects nested too "
                                       "deeply, or a number with too many digits", None)
        return error_response(exc.status_code, str(exc.detail), None,
                              "not_found_error" if exc.status_code == 404 else "invalid_request_error")

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        logger.exception("internal error on %s", request.url.path)
        if request.url.path.startswith("/v2"):
            return JSONResponse({"error": "internal server error"}, status_code=500)
        return error_response(500, "internal server error", None, "internal_server_error")

    app.add_middleware(BodySizeLimit, max_bytes=gateway_config.shedding.max_request_body_bytes)
    app.add_middleware(_CountRequests, counter=state.http_requests)
    app.add_middleware(_DefaultJSONContentType)
    app.add_middleware(GatewayMiddleware, gateway=gw)

    def served_names() -> str:
        """The models this request's credential may use (not the others: their names are not its business)."""
        ctx = gateway_context.current.get()
        ready = manager.ready_models()
        names = [lv.name for lv in ready if ctx is None or ctx.principal.may_use(lv.name)]
        return ", ".join(repr(n) for n in names) or ("no model yet" if not ready else "no model this credential "
                                                                                      "may use")

    def model_for(model: str | None, kind: str, admit: bool = True) -> LoadedVersion | JSONResponse:
        """The ready model a request names (None = the server's only model of that kind), or the error.
        ``admit``: it is an inference request (rate limits and the circuit breaker apply), else only the
        credential's grant is checked.

        Raises:
            GatewayError: 403 / 429 / 503 (answered by the gateway middleware).
        """
        if model is None:
            if state.default_model is not None and kind == "llm":
                model = state.default_model
            else:
                of_kind = [lv for lv in manager.ready_models() if (lv.llm is not None) == (kind == "llm")]
                if len(of_kind) != 1:
                    return error_response(400, "model: required (this server serves " + served_names() + ")",
                                          "model")
                model = of_kind[0].name
        try:
            lv = manager.get(model)
        except ModelNotFoundError:
            return error_response(404, f"the model {model!r} does not exist; this server serves {served_names()}",
                                  "model", "not_found_error")
        except ModelUnavailableError as e:
            return error_response(503, str(e), None, "service_unavailable")
        if kind == "llm" and lv.llm is None:
            return error_response(400, f"the model {model!r} is a {lv.backend} model: it does not generate text",
                                  "model")
        if kind == "embedding" and lv.backend != "embedding":
            return error_response(400, f"the model {model!r} is a {lv.backend} model, not an embedding model",
                                  "model")
        if admit:
            gateway_context.admit(lv.name)
        else:
            gateway_context.authorize_model(lv.name)
        if lv.llm is not None and lv.llm.dead is not None:
            gateway_context.record_outcome(False)
            return error_response(503, "the engine has stopped; see the server log", None, "service_unavailable")
        return lv

    def engine_for(model: str | None, admit: bool = True) -> AsyncLLMEngine | JSONResponse:
        """The engine serving ``model`` (None = the server's LLM), or the 503/404/400 to return."""
        lv = model_for(model, "llm", admit)
        return lv if isinstance(lv, JSONResponse) else lv.llm

    @app.get("/health")
    async def health():
        if not manager.is_ready():
            return error_response(503, "the models are loading or failed to load: see /v2/repository/index",
                                  None, "service_unavailable")
        if any(lv.llm is not None and lv.llm.dead is not None for lv in manager.ready_models()):
            return error_response(503, "the engine has stopped; see the server log", None, "service_unavailable")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        if not manager.started:
            return error_response(503, "the models are loading", None, "service_unavailable")
        data = []
        ctx = gateway_context.current.get()
        for lv in manager.ready_models():
            if (lv.llm is None and lv.backend != "embedding") or (ctx and not ctx.principal.may_use(lv.name)):
                continue
            entry = {"id": lv.name, "object": "model", "created": int(lv.loaded_at), "owned_by": "inferd"}
            if lv.llm is not None:
                entry["max_model_len"] = lv.llm.engine.max_model_len
            data.append(entry)
        return {"object": "list", "data": data}

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest):
        lv = model_for(body.model, "embedding")
        if isinstance(lv, JSONResponse):
            return lv
        return await create_embeddings(lv, body)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        eng = engine_for(body.model)
        if isinstance(eng, JSONResponse):
            return eng
        if body.suffix:
            return error_response(400, "suffix: is not supported (this server does not insert text)", "suffix")
        if body.best_of is not None and body.best_of != body.n:
            return error_response(400, f"best_of: only best_of equal to n ({body.n}) is supported (this server does "
                                       "not generate extra candidates to choose from)", "best_of")
        prompts = await run_in_threadpool(_completion_prompts, eng.engine, body.prompt)
        if isinstance(prompts, JSONResponse):
            return prompts
        max_tokens = body.max_tokens if body.max_tokens is not None else body.max_completion_tokens
        sent = "max_completion_tokens" if body.max_tokens is None and body.max_completion_tokens is not None \
            else "max_tokens"
        job = _job(body, prompts, 16 if max_tokens is None else max_tokens, chat=False, logprobs=body.logprobs,
                   echo=body.echo, default_max_tokens=max_tokens is None, max_tokens_field=sent)
        if isinstance(job, JSONResponse):
            return job
        return await Serving(eng).run(request, job)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        eng = engine_for(body.model)
        if isinstance(eng, JSONResponse):
            return eng
        for tools, choice, names in ((body.tools, body.tool_choice, ("tools", "tool_choice")),
                                     (body.functions, body.function_call, ("functions", "function_call"))):
            if choice not in (None, "none") or (tools and choice is None):
                param = names[0] if tools else names[1]
                return error_response(400, f"{param}: {TOOLS_UNSUPPORTED}", param)
        ids = await run_in_threadpool(_chat_prompt, eng.engine, body.messages, body.add_generation_prompt)
        if isinstance(ids, JSONResponse):
            return ids
        sent = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens == 0:
            return error_response(400, f"{sent}: must be at least 1 for chat completions", sent)
        if body.top_logprobs is not None and not body.logprobs:
            return error_response(400, "top_logprobs: requires logprobs to be true", "top_logprobs")
        job = _job(body, [ids], max_tokens, chat=True,
                   logprobs=(body.top_logprobs or 0) if body.logprobs else None, echo=False, max_tokens_field=sent)
        if isinstance(job, JSONResponse):
            return job
        return await Serving(eng).run(request, job)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        eng = engine_for(body.model, admit=False)
        if isinstance(eng, JSONResponse):
            return eng
        if (body.prompt is None) == (body.messages is None):
            return error_response(400, "prompt: give either prompt or messages", "prompt")
        if body.messages is not None:
            ids = await run_in_threadpool(_chat_prompt, eng.engine, body.messages, body.add_generation_prompt)
            if isinstance(ids, JSONResponse):
                return ids
        else:
            try:
                ids = await run_in_threadpool(eng.engine.encode, body.prompt, body.add_special_tokens)
            except InvalidRequestError as e:
                return error_response(400, e.message, e.param)
        return {"count": len(ids), "max_model_len": eng.engine.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        eng = engine_for(body.model, admit=False)
        if isinstance(eng, JSONResponse):
            return eng
        e = eng.engine
        bad = [t for t in body.tokens if not 0 <= t < e.vocab_size]
        if bad:
            return error_response(400, f"tokens: token id {bad[0]} is outside the vocabulary [0, {e.vocab_size})",
                                  "tokens")

        def decode() -> str:
            with e.tokenizer_lock:
                return e.tokenizer.decode(body.tokens)

        return {"prompt": await run_in_threadpool(decode)}

    return app


def _chat_prompt(engine: LLMEngine, messages, add_generation_prompt: bool) -> list[int] | JSONResponse:
    """Token ids of chat messages rendered with the model's chat template (a 400 if it refuses them)."""
    plain = []
    for m in messages:
        content = m.content if isinstance(m.content, str) or m.content is None else \
            "".join(p.text for p in m.content)
        plain.append({"role": "system" if m.role == "developer" else m.role, "content": content or ""})
    try:
        text = engine.apply_chat_template(plain, add_generation_prompt)
    except ImportError as e:  # transformers' renderer: the server's fault, not the messages'
        return error_response(500, f"the chat template cannot be rendered: {e}", None, "internal_server_error")
    except Exception as e:  # noqa: BLE001 - a template that rejects these messages
        return error_response(400, f"messages: the chat template rejected them: {e}", "messages")
    try:
        return engine.encode(text, add_special_tokens=False)
    except InvalidRequestError as e:
        return error_response(400, e.message, "messages")


def _job(body, prompts: list[list[int]], max_tokens: int | None, chat: bool, logprobs: int | None,
         echo: bool, default_max_tokens: bool = False, max_tokens_field: str = "max_tokens") -> Job | JSONResponse:
    """Sampling parameters from an OpenAI request body (a 400 for values the engine refuses, an output length
    named by ``max_tokens_field``, the field the client sent it in)."""
    score_only = max_tokens == 0
    try:
        params = SamplingParams(
            max_tokens=1 if score_only else max_tokens, temperature=body.temperature, top_p=body.top_p,
            top_k=body.top_k, min_p=body.min_p, seed=body.seed, stop=body.stop or [],
            stop_token_ids=body.stop_token_ids or [], ignore_eos=body.ignore_eos,
            min_tokens=0 if score_only else body.min_tokens, presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
            logit_bias={int(k): v for k, v in (body.logit_bias or {}).items()},
            logprobs=logprobs, prompt_logprobs=logprobs if echo and logprobs is not None else None)
    except InvalidRequestError as e:
        return error_response(400, *as_sent(e, max_tokens_field))
    return Job(prompts=prompts, params=params, n=body.n, chat=chat, echo=echo, score_only=score_only,
               logprobs=logprobs, stream=body.stream,
               include_usage=bool(body.stream_options and body.stream_options.include_usage),
               default_max_tokens=default_max_tokens, max_tokens_field=max_tokens_field)


class _DefaultJSONContentType:
    """A POST without a Content-Type header, or with curl's default for ``-d``
    (application/x-www-form-urlencoded), is read as JSON (the body is still validated); any other
    declared type that is not JSON is refused by the route with a 400.

    A JSON body with a string holding a lone UTF-16 surrogate (:func:`inferd.server.limits.has_lone_surrogate`)
    is refused with a 400 as it is read (as BodySizeLimit refuses a body too large), before any route tries to
    encode it, and so is an uncompressed one that is not text in the encoding its first bytes announce (UTF-8, or
    UTF-16/32; naming the offset and the bytes); KServe's decoder checks the
    JSON of compressed and binary-extension bodies itself. A compressed body (Content-Encoding) is a 415 outside
    the KServe routes, which decompress gzip and deflate."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        ctype = next((v for k, v in scope["headers"] if k == b"content-type"), None)
        media = None if ctype is None else ctype.split(b";")[0].strip().lower()
        if media is None or media == b"application/x-www-form-urlencoded":
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = dict(scope, headers=[*headers, (b"content-type", b"application/json")])
        elif media != b"application/json" and not media.endswith(b"+json"):
            return await self.app(scope, receive, send)  # binary tensors (KServe), or a type the route refuses
        encoding = next((v for k, v in scope["headers"] if k == b"content-encoding"), b"identity")
        if encoding.strip().lower() != b"identity" and not scope["path"].startswith("/v2"):
            return await error_response(  # RFC 9110 section 15.5.16
                415, f"Content-Encoding {encoding.decode('latin-1')!r} is not supported on this route: send the body "
                     "uncompressed", None)(scope, receive, send)
        body = bytearray()
        # Whole JSON text as sent (KServe decodes a compressed body, and the JSON part of a binary one, itself).
        binary = any(k == b"inference-header-content-length" for k, _ in scope["headers"])
        plain = encoding.strip().lower() == b"identity" and not (binary and scope["path"].startswith("/v2"))

        async def checked_receive():
            message = await receive()
            if message["type"] == "http.request":
                body.extend(message.get("body", b""))
                if not message.get("more_body", False):
                    if has_lone_surrogate(body):
                        raise StarletteHTTPException(400, LONE_SURROGATE_MESSAGE)
                    if plain and (why := decode_error(body)) is not None:
                        raise StarletteHTTPException(400, why)
            return message

        await self.app(scope, checked_receive, send)


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


def _completion_prompts(engine: LLMEngine, prompt) -> list[list[int]] | JSONResponse:
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        return error_response(400, "prompt: must not be an empty list", "prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    try:
        return [engine.encode(p) if isinstance(p, str) else list(p) for p in prompt]
    except InvalidRequestError as e:  # a text longer than the context can hold: refused before tokenizing
        return error_response(400, e.message, e.param)


