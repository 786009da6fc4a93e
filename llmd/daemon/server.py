"""Run the daemon: uvicorn on the configured address, a pid file, graceful shutdown."""

from __future__ import annotations

import logging
import os
import socket

import uvicorn

from llmd.config import Settings
from llmd.daemon.app import create_app
from llmd.errors import LlmdError

log = logging.getLogger("llmd.server")


class AddressInUse(LlmdError):
    code = "address_in_use"


def _check_port(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise AddressInUse(
                f"cannot listen on {host}:{port} ({e.strerror}); is llmd already running? "
                "Try `llmd status`, or pick another port with --port / LLMD_PORT"
            ) from None


def serve(settings: Settings) -> None:
    """Serve until SIGINT/SIGTERM; uvicorn runs the lifespan, which stops the workers."""
    settings.paths.ensure()
    _check_port(settings.host, settings.port)
    from llmd.models.registry import Registry

    Registry(settings.paths.registry_db, settings.paths.models_dir)  # a damaged registry stops here, named
    pid_file = settings.paths.pid_file
    pid_file.write_text(f"{os.getpid()}\n{settings.base_url}\n")
    log.info("llmd listening on %s (data in %s)", settings.base_url, settings.paths.data)
    config = uvicorn.Config(
        create_app(settings), host=settings.host, port=settings.port, log_level="warning",
        access_log=False, timeout_graceful_shutdown=5, lifespan="on",
    )
    try:
        uvicorn.Server(config).run()
    finally:
        try:
            if pid_file.read_text().split("\n", 1)[0] == str(os.getpid()):
                pid_file.unlink()
        except OSError:
            pass
