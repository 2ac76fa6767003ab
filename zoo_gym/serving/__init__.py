"""Serving published versions and BitDelta variants over an OpenAI-compatible API."""
