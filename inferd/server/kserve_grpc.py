"""The KServe v2 protocol over gRPC: Triton's ``inference.GRPCInferenceService`` (service_pb2 as shipped
by ``tritonclient``), served by grpc.aio on the same event loop as the HTTP server.

Implemented: ServerLive, ServerReady, ModelReady, ServerMetadata, ModelMetadata, ModelConfig, ModelInfer,
ModelStreamInfer (one response per request, decoupled models are not supported), RepositoryIndex,
RepositoryModelLoad, RepositoryModelUnload. The shared-memory, trace, log and statistics RPCs answer
UNIMPLEMENTED. Errors map as HTTP 400 -> INVALID_ARGUMENT, 404 -> NOT_FOUND, 503 -> UNAVAILABLE,
500 -> INTERNAL.

Source: Triton's grpc_service.proto (https://github.com/triton-inference-server/common) and the KServe v2
gRPC spec.
"""

from __future__ import annotations

import logging

import grpc
from starlette.concurrency import run_in_threadpool
from tritonclient.grpc import service_pb2, service_pb2_grpc

from inferd.backends.base import BackendError
from inferd.repository.config import ModelConfigError
from inferd.repository.manager import ModelManager, ModelNotFoundError
from inferd.repository.repository import IntegrityError
from inferd.gateway.gateway import GatewayError
from inferd.gateway.grpc import CODES, GatewayInterceptor
from inferd.server.kserve import (KServeError, control_error, infer, model_metadata, model_ready, resolve,
                                  server_metadata)
from inferd.server.kserve_tensors import TensorError, decode_grpc_request, encode_grpc_response

logger = logging.getLogger("inferd.grpc")



class InferenceServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    """GRPCInferenceService over a :class:`ModelManager`."""

    def __init__(self, manager: ModelManager) -> None:
        self.manager = manager

    async def ServerLive(self, request, context):
        return service_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return service_pb2.ServerReadyResponse(ready=self.manager.is_ready())

    async def ModelReady(self, request, context):
        try:
            ready = model_ready(self.manager, request.name, request.version or None)
        except KServeError:
            ready = False
        return service_pb2.ModelReadyResponse(ready=ready)

    async def ServerMetadata(self, request, context):
        return service_pb2.ServerMetadataResponse(**server_metadata())

    async def ModelMetadata(self, request, context):
        try:
            md = model_metadata(self.manager, resolve(self.manager, request.name, request.version or None))
        except KServeError as e:
            await _abort(context, e)
        T = service_pb2.ModelMetadataResponse.TensorMetadata
        return service_pb2.ModelMetadataResponse(
            name=md["name"], versions=md["versions"], platform=md["platform"],
            inputs=[T(**t) for t in md["inputs"]], outputs=[T(**t) for t in md["outputs"]])

    async def ModelConfig(self, request, context):
        try:
            lv = resolve(self.manager, request.name, request.version or None)
        except KServeError as e:
            await _abort(context, e)
        return service_pb2.ModelConfigResponse(config=lv.config)

    async def ModelInfer(self, request, context):
        try:
            return await self._infer(request)
        except KServeError as e:
            await _abort(context, e)
        except GatewayError:  # the interceptor answers it
            raise
        except Exception:  # noqa: BLE001 - a bug: logged, INTERNAL to the client
            logger.exception("internal error in ModelInfer")
            await _abort(context, KServeError(500, "internal server error"))

    async def ModelStreamInfer(self, request_iterator, context):
        async for request in request_iterator:
            try:
                response = await self._infer(request)
            except (KServeError, GatewayError) as e:
                yield service_pb2.ModelStreamInferResponse(error_message=e.message)
                continue
            except Exception:  # noqa: BLE001 - this request fails; the stream goes on
                logger.exception("internal error in ModelStreamInfer")
                yield service_pb2.ModelStreamInferResponse(error_message="internal server error")
                continue
            yield service_pb2.ModelStreamInferResponse(infer_response=response)

    async def _infer(self, request):
        try:
            req = decode_grpc_request(request)
        except TensorError as e:
            raise KServeError(400, str(e)) from None
        lv, outputs = await infer(self.manager, request.model_name, request.model_version or None, req)
        try:
            return encode_grpc_response(lv.name, str(lv.version), req.id, outputs, req.outputs)
        except ValueError as e:
            raise KServeError(500, f"model {lv.name!r} returned an invalid output: {e}") from None

    async def RepositoryIndex(self, request, context):
        entries = await run_in_threadpool(self.manager.index) if self.manager.repository else []
        if request.ready:
            entries = [e for e in entries if e.get("state") == "READY"]
        return service_pb2.RepositoryIndexResponse(models=[
            service_pb2.RepositoryIndexResponse.ModelIndex(**e) for e in entries])

    async def RepositoryModelLoad(self, request, context):
        await self._control(context, request, self.manager.load)
        return service_pb2.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request, context):
        await self._control(context, request, self.manager.unload)
        return service_pb2.RepositoryModelUnloadResponse()

    async def _control(self, context, request, action) -> None:
        err = control_error(self.manager, request.parameters)
        if err is not None:
            await _abort(context, err)
        try:
            await run_in_threadpool(action, request.model_name)
        except ModelNotFoundError as e:
            await _abort(context, KServeError(404, str(e)))
        except (BackendError, ModelConfigError, IntegrityError) as e:
            await _abort(context, KServeError(400, str(e)))


async def _abort(context, err: KServeError):
    await context.abort(CODES.get(err.status, grpc.StatusCode.INTERNAL), err.message)


async def start_grpc_server(manager: ModelManager, host: str, port: int, gateway=None,
                            max_message_bytes: int = 256 * 1024 * 1024) -> grpc.aio.Server:
    """Start the gRPC server on the running event loop, behind ``gateway`` (an
    :class:`inferd.gateway.gateway.Gateway`; its TLS settings make it a TLS port, mutual with a client CA).

    Raises:
        RuntimeError: the port cannot be bound.
        OSError: a TLS file cannot be read.
    """
    interceptors = [GatewayInterceptor(gateway)] if gateway is not None else []
    server = grpc.aio.server(interceptors=interceptors,
                             options=[("grpc.max_receive_message_length", max_message_bytes),
                                      ("grpc.max_send_message_length", max_message_bytes)])
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceServicer(manager), server)
    tls = gateway.config.tls if gateway is not None else None
    if tls is not None and tls.certfile:
        def read(path):
            with open(path, "rb") as f:
                return f.read()

        creds = grpc.ssl_server_credentials([(read(tls.keyfile), read(tls.certfile))],
                                            root_certificates=read(tls.ca_certfile) if tls.ca_certfile else None,
                                            require_client_auth=bool(tls.ca_certfile))
        bound = server.add_secure_port(f"{host}:{port}", creds)
    else:
        bound = server.add_insecure_port(f"{host}:{port}")
    if not bound:
        raise RuntimeError(f"cannot bind the gRPC port {host}:{port}")
    await server.start()
    logger.info("gRPC (KServe v2) listening on %s:%d%s", host, bound, " (TLS)" if tls and tls.certfile else "")
    server.bound_port = bound
    return server
