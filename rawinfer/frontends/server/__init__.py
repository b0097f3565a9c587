"""The ZeroMQ service face. The wire protocol (protocol: message dataclasses, one encoder/decoder); the
serving loop (server, with config: ServerConfig, security: loopback rule and CurveZMQ keys, inflight:
the requests in flight per client). The client library is frontends/client. See PROTOCOL.md beside this
file for the message contract."""
