"""The Flower ClientApp every contributor runs (in `join`, in the loopback Grid, under Ray)."""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from zoo_gym.client.runtime import ClientRuntime


def make_client_app(runtime: ClientRuntime) -> ClientApp:
    app = ClientApp()

    @app.train()
    def train(message: Message, context: Context) -> Message:
        return runtime.train(message)

    return app
