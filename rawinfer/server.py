"""The client library's public import path, `from rawinfer.server import Client`: a re-export of
rawinfer/frontends/client (the ZeroMQ server and its protocol are rawinfer/frontends/server)."""

from rawinfer.frontends.client.client import AsyncClient, Client, ClientError, Completion, RequestError, ServerTimeout
from rawinfer.frontends.server.protocol import PROTOCOL_VERSION

__all__ = ["AsyncClient", "Client", "ClientError", "Completion", "PROTOCOL_VERSION", "RequestError", "ServerTimeout"]
