"""Who may reach the server: the rule that only loopback endpoints go unencrypted, and CurveZMQ on its socket.

A bind to anything but a loopback address or a local socket file (ipc.py keeps that file private) needs the server's Curve secret key
(or an explicit --insecure); with a folder of client public keys, an authenticator thread admits only
those clients. The checks run before the model is loaded, so a refused bind costs nothing.
"""

from __future__ import annotations

import ipaddress
import os

import zmq
import zmq.auth

from rawinfer.frontends.server.config import ServerConfig
from rawinfer.frontends.server.ipc import ipc_path, is_abstract


class SecurityError(ValueError):
    """A bind that would expose the engine without encryption, or an unusable key file."""


def is_loopback_endpoint(endpoint: str) -> bool:
    """True for ipc://, inproc:// and tcp:// on a loopback address (127.0.0.0/8, ::1, localhost)."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        return False
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    host = rest.rpartition(":")[0]
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:          # "*", interface names and host names may reach other machines
        return False


def check_bind_security(cfg: ServerConfig) -> None:
    path = ipc_path(cfg.bind)
    if path is not None and is_abstract(path):
        raise SecurityError(f"{cfg.bind} is an abstract socket: it has no file permissions, so any user of this "
                            "machine could use the engine; bind ipc://PATH in a private folder instead")
    if not is_loopback_endpoint(cfg.bind) and cfg.curve_secret_key_file is None and not cfg.insecure:
        raise SecurityError(
            f"{cfg.bind} is not a loopback address: serving it unencrypted would let anyone on the network use "
            "the engine; give --curve-secret-key FILE (make one with `rawinfer keygen DIR`), or --insecure to "
            "accept the risk")
    if cfg.curve_client_keys_dir is not None and cfg.curve_secret_key_file is None:
        raise SecurityError("--curve-client-keys needs --curve-secret-key: client keys are only checked under CurveZMQ")


def load_secret_key(path: str) -> tuple[bytes, bytes]:
    """(public, secret) Z85 keys from a certificate written by `rawinfer keygen` (zmq.auth format)."""
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise SecurityError(f"cannot read the Curve key file {path!r} ({e}); make one with `rawinfer keygen DIR`") \
            from None
    if secret is None:
        raise SecurityError(f"{path!r} holds only a public key; the server needs the .key_secret file")
    return public, secret


def apply_curve(ctx: zmq.Context, sock: zmq.Socket, cfg: ServerConfig):
    """Make `sock` a CurveZMQ server when cfg has a secret key; the started authenticator when it also
    names a folder of client keys (the caller stops it), else None."""
    if cfg.curve_secret_key_file is None:
        return None
    public, secret = load_secret_key(cfg.curve_secret_key_file)
    auth = None
    if cfg.curve_client_keys_dir is not None:
        from zmq.auth.thread import ThreadAuthenticator
        if not os.path.isdir(cfg.curve_client_keys_dir):
            raise SecurityError(f"--curve-client-keys {cfg.curve_client_keys_dir!r} is not a folder of "
                                "client .key files")
        auth = ThreadAuthenticator(ctx)
        auth.start()
    try:
        if auth is not None:
            auth.configure_curve(domain="*", location=cfg.curve_client_keys_dir)
        sock.curve_secretkey, sock.curve_publickey, sock.curve_server = secret, public, True
    except BaseException:
        if auth is not None:
            auth.stop()
        raise
    return auth
