"""The OpenAI-compatible HTTP front end: FastAPI worker processes that reach the engine as ZeroMQ clients.

`rawinfer serve` binds the HTTP socket and starts `--api-workers` processes (launcher.py) that share it;
each runs the app (app.py) under uvicorn and holds one connection to the engine's ZeroMQ endpoint
(engine_link.py), exactly like any other client of the protocol in frontends/server/PROTOCOL.md.
"""
