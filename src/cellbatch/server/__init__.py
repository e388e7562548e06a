"""`cellbatch serve`: the engine behind an OpenAI-compatible HTTP API.

Modules: `protocol` (the OpenAI request shapes), `reply_bodies` (the OpenAI reply
shapes), `service` (requests onto the engine and back), `observability` (Prometheus
metrics), `app` (the FastAPI app, its limits and its life under uvicorn). Needs the
`serve` extra (`pip install 'cellbatch[serve]'`).
"""
