"""The ZeroMQ service face. The wire protocol (protocol: message dataclasses, one encoder/decoder); the
serving loop (server, with config: ServerConfig, security: loopback rule and CurveZMQ keys, inflight:
the requests in flight per client); the client library (client_core: the socket-free request and
routing logic, client: blocking Client and asyncio AsyncClient over it). See PROTOCOL.md beside this
file for the message contract; `rawinfer.server` re-exports the client library under its public name."""
