"""`rawinfer serve`, `rawinfer client` and `rawinfer keygen`: the command-line face of the ZeroMQ server."""

from __future__ import annotations

import argparse
import logging
import os
import re

from rawinfer.config import parse_size
from rawinfer.frontends.cli.stream import client_events, print_stream
from rawinfer.frontends.options import (CLIError, add_engine_args, add_sampling_args, engine_config_from_args,
                                        read_prompt, sampling_params_from_args)
from rawinfer.frontends.server.protocol import DEFAULT_ADDR

log = logging.getLogger("rawinfer")


def add_parsers(sub) -> None:
    p = sub.add_parser("serve", help="serve a model to `rawinfer client` and the client library over ZeroMQ",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--bind", default=DEFAULT_ADDR, help="endpoint: tcp://HOST:PORT or ipc://PATH")
    p.add_argument("--curve-secret-key", metavar="FILE", default=None,
                   help="encrypt with CurveZMQ using this server.key_secret (from `rawinfer keygen`); "
                        "required for a non-loopback --bind")
    p.add_argument("--curve-client-keys", metavar="DIR", default=None,
                   help="with --curve-secret-key: admit only clients whose public .key files are in DIR")
    p.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback --bind without CurveZMQ (anyone who can reach it can use it)")
    p.add_argument("--max-message-size", default="1MiB", help="larger incoming messages drop the sender")
    p.add_argument("--heartbeat-interval", type=float, default=1.0,
                   help="seconds between heartbeats to clients with requests in flight")
    p.add_argument("--client-timeout", type=float, default=10.0,
                   help="seconds a connected client may fail to answer ZMTP heartbeats before it counts as gone")
    add_engine_args(p)
    p.set_defaults(func=cmd_serve)

    c = sub.add_parser("client", help="send one prompt to a running `rawinfer serve` and stream the answer")
    c.add_argument("prompt", nargs="?", help="the prompt (read from stdin when absent)")
    c.add_argument("--addr", default=DEFAULT_ADDR, help="server endpoint (default: %(default)s)")
    c.add_argument("--json", action="store_true", help="print one JSON object (the keys of `rawinfer generate --json`)")
    c.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    c.add_argument("--system", default=None, help="system message for the chat template")
    c.add_argument("--token-ids", action="store_true",
                   help="the prompt is token ids separated by commas or spaces (models without a tokenizer)")
    c.add_argument("--server-key", metavar="FILE", default=None,
                   help="the server's public key (server.key, or its Z85 text) when it uses CurveZMQ")
    c.add_argument("--client-key", metavar="FILE", default=None,
                   help="this client's .key_secret, for a server started with --curve-client-keys")
    c.add_argument("--timeout", type=float, default=60.0, help="give up after this many seconds of silence")
    add_sampling_args(c)
    c.set_defaults(func=cmd_client)

    k = sub.add_parser("keygen", help="write a CurveZMQ key pair: DIR/NAME.key (public), DIR/NAME.key_secret")
    k.add_argument("dir", help="folder for the key files")
    k.add_argument("--name", default="server", help="file name stem (default: %(default)s)")
    k.add_argument("--force", action="store_true", help="replace existing key files")
    k.set_defaults(func=cmd_keygen)


def cmd_serve(args) -> int:
    from rawinfer.engine.engine import LLMEngine
    from rawinfer.frontends.server.server import (SecurityError, Server, ServerConfig, check_bind_security,
                                                  is_loopback_endpoint, load_secret_key)
    try:
        max_bytes = parse_size(args.max_message_size)
    except ValueError as e:
        raise CLIError(f"--max-message-size: {e}") from None
    if not args.heartbeat_interval > 0 or not args.client_timeout > 0:
        raise CLIError("--heartbeat-interval and --client-timeout must be positive numbers of seconds")
    cfg = ServerConfig(bind=args.bind, curve_secret_key_file=args.curve_secret_key,
                       curve_client_keys_dir=args.curve_client_keys, insecure=args.insecure,
                       max_message_bytes=max_bytes, heartbeat_interval_s=args.heartbeat_interval,
                       zmtp_heartbeat_timeout_s=args.client_timeout)
    try:                                 # refuse before spending time on loading the model
        check_bind_security(cfg)
        if cfg.curve_secret_key_file:
            load_secret_key(cfg.curve_secret_key_file)
    except SecurityError as e:
        raise CLIError(str(e)) from None
    if args.insecure and not is_loopback_endpoint(args.bind) and not args.curve_secret_key:
        log.warning("serving %s unencrypted (--insecure): anyone who can reach it can use the engine", args.bind)
    engine = LLMEngine(args.model, engine_config_from_args(args))
    try:
        server = Server(engine, cfg)
    except SecurityError as e:
        raise CLIError(str(e)) from None
    return server.run()


def _parse_ids(text: str) -> list[int]:
    parts = [p for p in re.split(r"[\s,]+", text.strip()) if p]
    if not parts or not all(p.isdigit() for p in parts):
        raise CLIError("--token-ids: the prompt must be non-negative integers separated by commas or spaces")
    return [int(p) for p in parts]


def cmd_client(args) -> int:
    from rawinfer.engine.tokenizer import chat_messages
    from rawinfer.frontends.server.client import Client
    params = sampling_params_from_args(args)
    prompt = read_prompt(args)
    with Client(args.addr, server_key=args.server_key, client_key_file=args.client_key,
                timeout_s=args.timeout) as client:
        if args.token_ids:
            request = {"prompt": _parse_ids(prompt)}
        elif args.raw or not client.model_info().get("has_chat_template"):
            request = {"prompt": prompt}
        else:                            # the server applies the template, as `rawinfer generate` would
            request = {"messages": chat_messages(prompt, args.system)}
        print_stream(client_events(client.generate(**request, params=params, stream=not args.json)), args.json)
    return 0


def cmd_keygen(args) -> int:
    import zmq.auth

    public = os.path.join(args.dir, f"{args.name}.key")
    secret = public + "_secret"
    if not args.force and (os.path.exists(public) or os.path.exists(secret)):
        raise CLIError(f"{public} or {secret} exists already; pass --force to replace the pair")
    os.makedirs(args.dir, exist_ok=True)
    public, secret = zmq.auth.create_certificates(args.dir, args.name)
    os.chmod(secret, 0o600)
    print(f"wrote {public} (public: give it to clients, --server-key) and {secret} (secret: keep it on the "
          "server, --curve-secret-key)")
    return 0
