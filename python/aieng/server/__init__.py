"""`aieng serve`: an OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn).

`build_app(config, load_engine)` makes the ASGI app; `cli.run_serve` runs it with graceful
shutdown. Nothing here is imported by the library itself.
"""
