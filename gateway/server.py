"""Run the gateway under uvicorn; SIGTERM first marks it draining (new requests get 503),
then uvicorn lets open streams finish within the grace period before exiting."""

from __future__ import annotations

from types import FrameType
from typing import Any

import uvicorn

from gateway.app import create_app
from shared.settings import Settings


class DrainingServer(uvicorn.Server):
    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        app: Any = self.config.app
        state = getattr(app.state, "gateway", None)
        if state is not None:
            state.draining = True
        super().handle_exit(sig, frame)


def uvicorn_config(settings: Settings) -> uvicorn.Config:
    return uvicorn.Config(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        access_log=settings.access_log,
        timeout_graceful_shutdown=int(settings.shutdown_grace_s),
    )


def serve(settings: Settings) -> int:
    DrainingServer(uvicorn_config(settings)).run()
    return 0
