"""The operators' REST API (FastAPI): `create_app` builds it, `RestServer` serves it.

One router per area under `routes/`; authentication and roles in `deps` (API keys for operators,
challenge-signed short-lived tokens for contributors, `auth`); request and response models in
`schemas`.
"""
