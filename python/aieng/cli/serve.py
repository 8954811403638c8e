"""`aieng serve`: the OpenAI-compatible HTTP server (options and the run live in aieng.server)."""

from __future__ import annotations


def add_serve(commands) -> None:
    p = commands.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server",
        description="Serve a model over an OpenAI-compatible HTTP API with streaming, admission "
        "control and Prometheus metrics.",
    )
    try:
        from aieng.server.cli import add_serve_arguments, run_serve
    except ImportError as err:  # the server package is missing from this install
        message = f"the server is unavailable in this install: {err}"

        def unavailable(_args) -> int:
            raise RuntimeError(message)

        p.set_defaults(run=unavailable)
        return
    add_serve_arguments(p)
    p.set_defaults(run=run_serve)
