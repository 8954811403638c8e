"""Replicas of one model behind Ray Serve: `serve run aieng.ray:app model=PATH num_replicas=2`.

Each replica is a Ray Serve deployment replica holding one engine; the ingress serves the
OpenAI API of `aieng serve` over them, routes requests by prompt prefix to the replica that
likely holds it in its prefix cache, and retries a request on another replica when its own
fails before streaming. See docs/ray.md.
"""

from aieng.ray.app import app, build_app
from aieng.ray.options import RayServeOptions

__all__ = ["RayServeOptions", "app", "build_app"]
