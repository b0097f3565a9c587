"""The client library of the ZeroMQ protocol (frontends/server/PROTOCOL.md): `core` holds a client's
requests in flight and turns protocol messages into results without a socket; `client` puts it on a socket,
blocking (`Client`) or asyncio (`AsyncClient`). Public import path: `from rawinfer.server import Client`.
The server side is frontends/server; the two share only the protocol module."""
