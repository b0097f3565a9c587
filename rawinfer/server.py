"""The client library's public import path, `from rawinfer.server import Client`: a re-export of
rawinfer/frontends/server (the ZeroMQ server, its protocol and the clients live there)."""

from rawinfer.frontends.server.client import AsyncClient, Client, ClientError, Completion, RequestError, ServerTimeout
from rawinfer.frontends.server.protocol import PROTOCOL_VERSION

__all__ = ["AsyncClient", "Client", "ClientError", "Completion", "PROTOCOL_VERSION", "RequestError", "ServerTimeout"]
