"""Why a client stops instead of training a round."""


class RoundRefusal(ValueError):
    """The client will not train this round (its own settings forbid it); `join` stops with the reason."""
