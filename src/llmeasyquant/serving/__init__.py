"""The OpenAI-compatible HTTP server over the serving engine (runtime/engine.py): `llmeasyquant serve`.

Nothing here is imported by `import llmeasyquant`: the server needs the `serve` extra (FastAPI, uvicorn,
sse-starlette, prometheus-client), and `serving.run.require_serve_extra()` says so when it is missing.

- protocol.py: the request models (pydantic) and the OpenAI response, chunk and error bodies
- errors.py: every failure as (status, OpenAI error body): request errors, queue full, engine stopped, bad JSON
- metrics.py: the Prometheus collectors of one app, in a registry of its own
- app.py: build_app(engine, served_model_name, api_key) -> FastAPI
- run.py: serve(engine, host, port, ...): uvicorn with a graceful SIGTERM
"""
