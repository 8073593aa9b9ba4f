"""The KServe v2 inference protocol over HTTP (what Triton speaks), and the parts the gRPC service shares.

Routes (``{v}`` optional as ``/versions/{v}``): ``GET /v2/health/live``, ``GET /v2/health/ready``,
``GET /v2`` (server metadata), ``GET /v2/models/{m}`` (model metadata), ``GET /v2/models/{m}/ready``,
``GET /v2/models/{m}/config``, ``POST /v2/models/{m}/infer`` (JSON tensors or Triton's binary tensor
extension), and Triton's repository extension: ``POST /v2/repository/index``,
``POST /v2/repository/models/{m}/load`` and ``/unload`` (explicit model control mode only).
Errors are ``{"error": "<message>"}`` with a 4xx for the client's mistakes, 503 when a model asked to infer is
not ready or its queue is full; the readiness routes answer 400 while the server or model is not ready, as
Triton's do.

Sources: KServe "Open Inference Protocol" (v2) REST spec; Triton's docs/protocol/extension_binary_data.md
and extension_model_repository.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gzip
import json
import logging
import zlib

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

import inferd
from inferd.backends.base import BackendError, InvalidInputError
from inferd.errors import EngineDeadError, EngineOverloadedError
from inferd.batching.dynamic_batcher import BatcherClosedError, QueueFullError, QueueTimeoutError
from inferd.gateway import context as gateway_context
from inferd.gateway.gateway import GatewayError
from inferd.repository.config import DTYPE_NAMES, ModelConfigError, config_to_json
from inferd.repository.manager import (LoadedVersion, ModelManager, ModelNotFoundError,
                                       ModelUnavailableError)
from inferd.repository.repository import IntegrityError
from inferd.server.limits import LONE_SURROGATE_MESSAGE, has_lone_surrogate
from inferd.server.kserve_tensors import (InferRequest, TensorError, decode_http_request,
                                          encode_http_response, parse_header_length, validate_inputs)

logger = logging.getLogger("inferd.kserve")

EXTENSIONS = ["binary_tensor_data", "model_repository", "model_repository(unload_dependents)"]
MAX_DECOMPRESSED_BYTES = 1 << 30
"""The most a compressed infer body may decompress to where the server sets no body limit (bytes)."""


class KServeError(Exception):
    """An error to answer with: HTTP status, message and extra headers such as Retry-After (the gRPC
    service maps the status to a code)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers


def kserve_datatype(data_type: int) -> str:
    name = DTYPE_NAMES[data_type]
    return "BYTES" if name == "STRING" else name


def resolve(manager: ModelManager, name: str, version: str | None) -> LoadedVersion:
    """The ready model version a request names.

    Raises:
        KServeError: 400 for a version that is not a number, 404 unknown, 503 not ready.
        GatewayError: 403, the credential is not granted this model.
    """
    v = None
    if version:
        if not (version.isascii() and version.isdigit()):
            raise KServeError(400, f"model version {version!r} is not a positive integer")
        v = int(version)
    try:
        lv = manager.get(name, v)
    except ModelNotFoundError as e:
        raise KServeError(404, str(e)) from None
    except ModelUnavailableError as e:
        raise KServeError(503, str(e)) from None
    gateway_context.authorize_model(lv.name)
    return lv


def model_ready(manager: ModelManager, name: str, version: str | None) -> bool:
    """KServe model readiness: loaded, and its circuit breaker not open.

    Raises:
        KServeError: 400 for a version that is not a number, 404 unknown.
        GatewayError: 403.
    """
    try:
        resolve(manager, name, version)
    except KServeError as e:
        if e.status == 503:
            return False
        raise
    return gateway_context.model_ready(name)


def server_metadata() -> dict:
    return {"name": "inferd", "version": inferd.__version__, "extensions": EXTENSIONS}


def model_metadata(manager: ModelManager, lv: LoadedVersion) -> dict:
    """KServe model metadata: name, versions, platform, inputs and outputs (a leading -1 for the batch)."""
    cfg = lv.config
    batch = [-1] if cfg.max_batch_size else []

    def tensors(ts):
        return [{"name": t.name, "datatype": kserve_datatype(t.data_type), "shape": batch + list(t.dims)}
                for t in ts]

    versions = sorted({lv.version} | {m.version for m in manager.ready_models() if m.name == lv.name})
    return {"name": lv.name, "versions": [str(v) for v in versions],
            "platform": cfg.platform or cfg.backend, "inputs": tensors(cfg.input), "outputs": tensors(cfg.output)}


async def infer(manager: ModelManager, name: str, version: str | None, request: InferRequest
                ) -> tuple[LoadedVersion, dict[str, np.ndarray]]:
    """Validate and run one request; a version that starts unloading meanwhile hands it to its successor.

    Raises:
        KServeError: 400 bad tensors or inputs the model cannot take, 404/503 model not found or not
            ready, 503 queue full or timed out, 500 the backend failed.
        GatewayError: 403 / 429 / 503 from the gateway (grant, rate limits, circuit breaker).
    """
    for attempt in range(3):
        lv = resolve(manager, name, version)
        if attempt == 0:
            gateway_context.admit(lv.name)
        try:
            inputs = validate_inputs(request, lv.config)
        except TensorError as e:
            raise KServeError(400, str(e)) from None
        if not inputs:
            raise KServeError(400, f"the request has no inputs; model {name!r} takes one of "
                                   f"{', '.join(repr(i.name) for i in lv.config.input)}")
        try:
            if lv.llm is not None:
                from inferd.backends import llm

                outputs = await llm.infer(lv.llm, inputs)
            else:
                timeout = request.parameters.get("timeout") if request.parameters else None
                if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int) or timeout < 0):
                    raise KServeError(400, "parameter timeout must be a non-negative integer (microseconds)")
                fut = lv.batcher.submit(inputs, timeout)
                try:
                    outputs = await asyncio.wrap_future(fut)
                except asyncio.CancelledError:
                    fut.cancel()
                    raise
        except BatcherClosedError:
            if attempt == 2:
                raise KServeError(503, f"model {name!r} is unloading") from None
            await asyncio.sleep(0.01)
            continue
        except InvalidInputError as e:
            raise KServeError(400, str(e)) from None
        except (QueueFullError, QueueTimeoutError) as e:
            if isinstance(e, QueueFullError):
                gateway_context.record_shed()
            raise KServeError(503, str(e), {"retry-after": "1"}) from None
        except EngineOverloadedError as e:
            gateway_context.record_shed()
            raise KServeError(503, str(e), {"retry-after": str(e.retry_after)}) from None
        except (BackendError, EngineDeadError) as e:
            gateway_context.record_outcome(False)
            raise KServeError(500 if isinstance(e, BackendError) else 503, str(e)) from None
        gateway_context.record_outcome(True)
        wanted = [o.name for o in request.outputs] or [o.name for o in lv.config.output]
        return lv, {n: outputs[n] for n in wanted}
    raise AssertionError("unreachable")


def control_error(manager: ModelManager, parameters) -> KServeError | None:
    """Why a repository load/unload call (HTTP or gRPC) is refused, or None: only in explicit mode, and
    with no parameters but ``unload_dependents`` (a no-op: inferd has no ensembles)."""
    if manager.control_mode != "explicit":
        return KServeError(400, f"explicit model load / unload is not allowed in model control mode "
                                f"{manager.control_mode!r} (start with --model-control-mode explicit)")
    if set(parameters) - {"unload_dependents"}:
        return KServeError(400, "load and unload parameters are not supported (only unload_dependents, "
                                "which has no effect: inferd has no ensembles)")
    return None


def kserve_error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def create_router(manager: ModelManager, max_body_bytes: int = 0) -> APIRouter:
    """The KServe v2 HTTP routes over ``manager``'s models.

    Args:
        max_body_bytes: the server's request body limit (``--max-request-body-bytes``; 0 = none), which an infer
            body compressed with gzip or deflate must keep once decompressed too: a 413 otherwise, as for a plain
            body over it. Without a limit, 1 GiB (:data:`MAX_DECOMPRESSED_BYTES`).
    """
    router = APIRouter()
    decompressed_limit = max_body_bytes or MAX_DECOMPRESSED_BYTES
    # One thread decompresses, one body at a time: each may take up to the limit in memory, and a pool's threads
    # each keep a malloc arena of their own (40 1 MB gzip bodies at once, each expanding past 100 MiB, left the
    # server at 7.9 GiB through the shared pool, 4.9 GiB two at a time).
    decompressor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="inferd-decompress")

    @router.get("/v2/health/live")
    async def live():
        return Response(status_code=200)

    @router.get("/v2/health/ready")
    async def ready():
        if manager.is_ready():
            return Response(status_code=200)
        return kserve_error(400, "the server is not ready: models are loading or failed to load")

    @router.get("/v2")
    async def metadata():
        return server_metadata()

    async def _model_metadata(model: str, version: str | None = None):
        try:
            return model_metadata(manager, resolve(manager, model, version))
        except KServeError as e:
            return kserve_error(e.status, e.message)

    async def _model_ready(model: str, version: str | None = None):
        try:
            ready = model_ready(manager, model, version)
        except KServeError as e:
            return kserve_error(e.status, e.message)
        if not ready:
            return kserve_error(400, f"model {model!r} is not ready (loading, unloading or its circuit breaker "
                                     "is open)")
        return Response(status_code=200)

    async def _model_config(model: str, version: str | None = None):
        try:
            return config_to_json(resolve(manager, model, version).config)
        except KServeError as e:
            return kserve_error(e.status, e.message)

    async def _infer(request: Request, model: str, version: str | None = None):
        try:
            resolve(manager, model, version)  # an unknown model is a 404 whatever the body
            # JSON, or the binary tensor extension's bytes (no Content-Type, as tritonclient sends, reads as JSON).
            media = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
            if media not in ("application/json", "application/octet-stream") and not media.endswith("+json"):
                raise KServeError(400, f"the request body must be JSON (Content-Type: application/json) or the "
                                       f"binary tensor extension's (application/octet-stream), not {media!r}")
            body = await request.body()
            encoding = (request.headers.get("content-encoding") or "").strip().lower()
            if encoding and encoding != "identity":  # zlib lets go of the GIL: the event loop serves meanwhile
                body = await asyncio.get_running_loop().run_in_executor(decompressor, _decompress, body, encoding,
                                                                        decompressed_limit)
            try:
                hl = parse_header_length(request.headers.get("inference-header-content-length"))
                req = decode_http_request(body, hl)
            except TensorError as e:
                raise KServeError(400, str(e)) from None
            if has_lone_surrogate(body if hl is None else body[:hl]):  # after gzip, or the binary extension's JSON
                raise KServeError(400, LONE_SURROGATE_MESSAGE)
            lv, outputs = await _until_disconnected(request, infer(manager, model, version, req))
            try:
                out_body, json_len = encode_http_response(lv.name, str(lv.version), req.id, outputs, req.outputs,
                                                          req.binary_data_output)
            except ValueError as e:  # the model produced something KServe cannot carry
                raise KServeError(500, f"model {lv.name!r} returned an invalid output: {e}") from None
        except KServeError as e:
            return kserve_error(e.status, e.message, e.headers)
        except _ClientGone:
            return Response(status_code=499)
        except (HTTPException, GatewayError):  # the body-size limit (413) and the gateway's refusals
            raise
        except Exception:  # noqa: BLE001 - a bug: logged, answered in the protocol's shape
            logger.exception("internal error on %s", request.url.path)
            return kserve_error(500, "internal server error")
        if json_len is None:
            return Response(out_body, media_type="application/json")
        return Response(out_body, media_type="application/octet-stream",
                        headers={"Inference-Header-Content-Length": str(json_len)})

    for path, fn, method in (("", _model_metadata, "GET"), ("/ready", _model_ready, "GET"),
                             ("/config", _model_config, "GET"), ("/infer", _infer, "POST")):
        router.add_api_route("/v2/models/{model}" + path, fn, methods=[method])
        router.add_api_route("/v2/models/{model}/versions/{version}" + path, fn, methods=[method])

    @router.post("/v2/repository/index")
    async def repository_index():  # without a repository: the models served from the command line
        return await run_in_threadpool(manager.index)

    @router.post("/v2/repository/models/{model}/load")
    async def repository_load(model: str, request: Request):
        err = await _control_checks(request)
        if err is not None:
            return err
        try:
            await run_in_threadpool(manager.load, model)
        except ModelNotFoundError as e:
            return kserve_error(404, str(e))
        except (BackendError, ModelConfigError, IntegrityError) as e:
            return kserve_error(400, str(e))
        return JSONResponse({})

    @router.post("/v2/repository/models/{model}/unload")
    async def repository_unload(model: str, request: Request):
        err = await _control_checks(request)
        if err is not None:
            return err
        try:
            await run_in_threadpool(manager.unload, model)
        except ModelNotFoundError as e:
            return kserve_error(404, str(e))
        return JSONResponse({})

    async def _control_checks(request: Request) -> JSONResponse | None:
        err = control_error(manager, {})  # the mode first, whatever the body
        if err is not None:
            return kserve_error(err.status, err.message)
        body = await request.body()
        params: object = {}
        if body.strip():
            try:
                doc = json.loads(body)
            except (ValueError, RecursionError):  # not JSON, not text, nested too deeply, or a too long number
                return kserve_error(400, "the request body is not valid JSON")
            params = doc.get("parameters") or {} if isinstance(doc, dict) else None
        err = control_error(manager, params if isinstance(params, dict) else {"": None})
        return kserve_error(err.status, err.message) if err else None

    return router


class _ClientGone(Exception):
    """The client closed the connection before the answer was ready."""


async def _until_disconnected(request: Request, coro):
    """Await ``coro``, cancelling it if the client disconnects first (an LLM stops generating, a queued
    batch request is dropped).

    Raises:
        _ClientGone: the client left.
    """
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise _ClientGone()
    finally:
        if not task.done():  # the client left, or this handler was cancelled (a deadline)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # its clean-up (abort, accounting) first


def _decompress(body: bytes, encoding: str, limit: int) -> bytes:
    """Undo ``Content-Encoding: gzip`` or ``deflate`` (tritonclient's ``request_compression_algorithm``), reading
    at most ``limit`` + 1 bytes out. A body can expand a thousandfold: with a fixed 1 GiB bound, 1 MB of gzip took
    ~3 GB of memory and 13 s of the event loop, every stream stalled meanwhile.

    A gzip body may hold several members, decompressed one after the other (RFC 1952 section 2.2); bytes after a
    deflate stream, or after a gzip member that do not start another, are a 400 rather than dropped.

    Raises:
        KServeError: 400 for a corrupt or truncated stream, data after its end, or an unknown encoding; 413 for
            more than ``limit`` bytes once decompressed.
    """
    if encoding not in ("gzip", "deflate"):
        raise KServeError(400, f"Content-Encoding {encoding!r} is not supported (gzip, deflate)")
    try:
        out, rest = [], body
        size = 0
        while True:
            d = zlib.decompressobj(16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS)
            out.append(d.decompress(rest, limit + 1 - size))
            size += len(out[-1])
            if size > limit:
                raise KServeError(413, f"the request body, decompressed ({encoding}), is larger than the server's "
                                       f"limit of {limit} bytes")
            if not d.eof:
                raise KServeError(400, f"the {encoding} stream is truncated")
            rest = d.unused_data
            if not rest:
                return b"".join(out)  # one member: the same object, not a copy
            if encoding != "gzip":
                raise KServeError(400, "the request body has data after the end of its deflate stream")
    except (zlib.error, gzip.BadGzipFile):
        raise KServeError(400, f"the request body is not valid {encoding} data") from None
