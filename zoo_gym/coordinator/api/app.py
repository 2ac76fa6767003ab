"""REST app for operators (FastAPI)."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import FastAPI

if TYPE_CHECKING:
    from zoo_gym.coordinator.service import Coordinator


def create_app(co: Coordinator) -> FastAPI:
    app = FastAPI(title="zoo-gym coordinator", version="1")

    @app.get("/health", operation_id="health")
    def health() -> dict[str, Any]:
        current = co.backend.open_round
        return {
            "status": "ok",
            "model_version": co.backend.current_version(),
            "open_round": current.number if current else None,
        }

    return app


class RestServer:
    """Uvicorn in a background thread."""

    def __init__(self, co: Coordinator, listen: str) -> None:
        host, port = listen.rsplit(":", 1)
        config = uvicorn.Config(create_app(co), host=host, port=int(port), log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="rest", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)
