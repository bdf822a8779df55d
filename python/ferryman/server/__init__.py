"""The OpenAI-compatible server: ``AsyncEngine`` (engine thread + per-request queues),
``build_app`` (FastAPI routes), ``Metrics`` (Prometheus) — see ``ferryman serve --help``."""
