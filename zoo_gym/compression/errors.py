"""The one exception raised for untrusted compressed payloads."""


class EnvelopeError(ValueError):
    """A payload is not a valid envelope; the message is one line saying what was wrong."""
