"""Who sent a request, for fair shares: its address, then its API key within that address.

Behind a proxy every request has the proxy's address, and the key (a gateway's per-tenant key
passed through) tells clients apart; a client that sends many keys from one address still gets
one address's share. The key is kept only as a hash.
"""

from __future__ import annotations

import hashlib

from starlette.requests import HTTPConnection


def client_of(request: HTTPConnection) -> tuple[str, str]:
    """(address, key): the peer's address and a short hash of its bearer token ('' without)."""
    address = request.client.host if request.client is not None else ""
    authorization = request.headers.get("authorization", "")
    scheme, _, token = authorization.partition(" ")
    key = ""
    if scheme.lower() == "bearer" and token:
        key = hashlib.sha256(token.encode("utf-8", "replace")).hexdigest()[:16]
    return address, key


def fair_share_key(client: tuple[str, str]) -> str:
    """The engine's name of a client, for its share of each step's prefill budget: its API key
    (hashed), else its address. The gate has already given each address its share of
    admission; in the engine, tenants behind one proxy still count apart."""
    address, key = client
    return f"key:{key}" if key else f"address:{address}"
