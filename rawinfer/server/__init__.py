"""The ZeroMQ service face: the serving loop (server), the wire protocol (protocol), the client library (client).

See PROTOCOL.md beside this file for the message contract."""

from .client import AsyncClient, Client, ClientError, Completion, RequestError, ServerTimeout
from .protocol import PROTOCOL_VERSION

__all__ = ["AsyncClient", "Client", "ClientError", "Completion", "PROTOCOL_VERSION", "RequestError", "ServerTimeout"]
