"""Run the gateway under uvicorn; SIGTERM first marks it draining (new requests get 503),
then uvicorn lets open streams finish within the grace period before exiting."""

from __future__ import annotations

import logging
import socket
from types import FrameType
from typing import Any

import uvicorn

from gateway.app import create_app
from gateway.auth import AuthConfigError, check_auth_settings
from shared.settings import GatewaySettings

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        app: Any = self.config.app
        state = getattr(app.state, "gateway", None)
        if state is not None:
            state.draining = True
        super().handle_exit(sig, frame)


def uvicorn_config(settings: GatewaySettings) -> uvicorn.Config:
    return uvicorn.Config(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_config=None,  # its loggers propagate: shared.logs routes them (INFO to the file)
        log_level=settings.log_level.lower(),
        access_log=settings.access_log,
        timeout_graceful_shutdown=int(settings.shutdown_grace_s),
    )


def serve(settings: GatewaySettings) -> int:
    try:
        check_auth_settings(settings)  # the lifespan checks too; here it is a clean exit
    except AuthConfigError as exc:
        log.error("%s", exc)
        return 2
    sockets = [reuse_port_socket(settings.host, settings.port)] if settings.reuse_port else None
    DrainingServer(uvicorn_config(settings)).run(sockets=sockets)
    return 0


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A listening address several processes bind at once (SO_REUSEPORT): the kernel
    spreads new connections over them, and one that exits leaves the others serving."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock
