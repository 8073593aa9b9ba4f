"""Graceful shutdown: uvicorn's server, which on SIGTERM / SIGINT also starts draining the gRPC server
at once, so both protocols stop taking new requests together and in-flight ones get the drain timeout
(``timeout_graceful_shutdown``, seconds) to finish; what is still running after it is cancelled, which
aborts its engine requests and frees their KV blocks. It also shuts down when the model given on the command
line fails to load (``ServerState.fatal_error``; ``inferd serve`` then exits with status 1 and the reason)."""

from __future__ import annotations

import asyncio

import uvicorn


class DrainingServer(uvicorn.Server):
    """``uvicorn.Server`` for an app made by :func:`inferd.server.api_server.create_app`."""

    def __init__(self, config: uvicorn.Config, state) -> None:
        super().__init__(config)
        self.state = state  # the app's ServerState

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's check, every 0.1 s, of whether to exit; also True once a fatal error is recorded."""
        return await super().on_tick(counter) or self.state.fatal_error is not None

    async def shutdown(self, sockets=None):
        grace = self.config.timeout_graceful_shutdown or 0
        drain = asyncio.ensure_future(self.state.stop_grpc(grace))
        await super().shutdown(sockets)
        await drain
