"""The ZeroMQ service face: the serving loop (server), the wire protocol (protocol), the client library
(client). See PROTOCOL.md beside this file for the message contract; `rawinfer.server` re-exports the
client library under its public name."""
