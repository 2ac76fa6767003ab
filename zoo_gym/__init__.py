"""zoo-gym: federated community learning for open language models."""

__version__ = "0.1.0"
