"""The Flower ClientApp every contributor runs (in `join`, in the loopback Grid, under Ray)."""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from zoo_gym.client.runtime import ClientRuntime
from zoo_gym.client.user_app import train_with_app


def make_client_app(runtime: ClientRuntime, user_app: ClientApp | None = None) -> ClientApp:
    """zoo-gym's ClientApp: each round trains with the runtime's own trainers, or with the
    contributor's own `user_app` (`zoo_gym.client.user_app`), and leaves signed and compressed."""
    app = ClientApp()

    @app.train()
    def train(message: Message, context: Context) -> Message:
        if user_app is None:
            return runtime.train(message)
        return train_with_app(runtime, user_app, message, context)

    return app
