"""`rawinfer serve`, `rawinfer client` and `rawinfer keygen`: the command-line face of the ZeroMQ server."""

from __future__ import annotations

import dataclasses
import json
import logging
import os

from rawinfer.frontends.cli.connect import PING_TIMEOUT_S, ping_server, probe_endpoint
from rawinfer.frontends.cli.generate import parse_token_ids
from rawinfer.frontends.cli.models import open_engine
from rawinfer.frontends.cli.serve_replicas import add_replica_args, check_replica_args, cmd_scale, run_replicas
from rawinfer.frontends.cli.serve_roles import add_role_args, check_role_args, decode_connector, run_prefill_role
from rawinfer.frontends.cli.stream import client_events, print_stream
from rawinfer.frontends.options import (CLIError, add_command, add_engine_args, add_sampling_args,
                                        check_system_flag, is_quiet, plain_text_prompt, positive_float,
                                        positive_int, read_prompt, sampling_params_from_args)
from rawinfer.frontends.server.protocol import DEFAULT_ADDR
from rawinfer.settings import add_options, options_from_args

log = logging.getLogger("rawinfer")
DEFAULT_HTTP_PORT = 8000


def add_parsers(sub) -> None:
    p = add_command(sub, "serve", "serve a model over ZeroMQ (`rawinfer client`, `rawinfer chat --addr`, the client "
                                  "library) and over HTTP with OpenAI's API")
    p.add_argument("model_positional", nargs="?", default=None, metavar="MODEL",
                   help="the model, as --model (vLLM's `vllm serve MODEL`); give it one way or the other")
    from rawinfer.frontends.server.config import ServerConfig
    add_options(p, ServerConfig)
    h = p.add_argument_group("HTTP (OpenAI-compatible API)")
    h.add_argument("--http-host", "--host", default="127.0.0.1", metavar="HOST",
                   help="address of the HTTP API; any but a loopback one needs --api-key or --insecure "
                        "(default: 127.0.0.1)")
    h.add_argument("--http-port", "--port", type=_port, default=DEFAULT_HTTP_PORT, metavar="PORT",
                   help=f"port of the HTTP API; one in use stops the start with exit status 2, as a busy --bind "
                        f"does (default: {DEFAULT_HTTP_PORT})")
    h.add_argument("--no-http", dest="http", action="store_false", help="serve ZeroMQ only (default: both)")
    h.add_argument("--api-workers", type=_workers, default=1, metavar="N",
                   help="HTTP worker processes, each one more client of the engine (default: 1)")
    from rawinfer.frontends.http.config import HTTPConfig
    add_options(h, HTTPConfig)
    add_engine_args(p)
    add_role_args(p)
    add_replica_args(p)
    p.set_defaults(func=cmd_serve)

    c = add_command(sub, "client", "send one prompt to a running `rawinfer serve` and stream the answer")
    c.add_argument("prompt", nargs="?", help="the prompt (read from stdin when absent)")
    add_server_args(c)
    c.add_argument("--json", action="store_true",
                   help="print one JSON object at the end (the keys of `rawinfer generate --json`)")
    c.add_argument("--raw", action="store_true",
                   help="send the prompt as it is (default: as chat messages when the model has a chat template)")
    c.add_argument("--system", default=None, metavar="TEXT",
                   help="system message for the chat template (default: the template's own, if any)")
    c.add_argument("--token-ids", action="store_true",
                   help="the prompt is token ids separated by commas or spaces (models without a tokenizer)")
    add_sampling_args(c)
    c.set_defaults(func=cmd_client)

    k = add_command(sub, "keygen", "write a CurveZMQ key pair: DIR/NAME.key (public), DIR/NAME.key_secret")
    k.add_argument("dir", help="folder for the key files")
    k.add_argument("--name", default="server", help="file name stem (default: server)")
    k.add_argument("--force", action="store_true", help="replace existing key files (default: refuse)")
    k.set_defaults(func=cmd_keygen)

    s = add_command(sub, "scale", "set the number of replicas of a running `rawinfer serve --replicas`")
    s.add_argument("replicas", type=positive_int, help="the number of replicas to run")
    add_server_args(s)
    s.set_defaults(func=cmd_scale)


def _port(text: str) -> int:
    import argparse
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise argparse.ArgumentTypeError(f"must be a port number from 1 to 65535, got {text}")
    return int(text)


def _workers(text: str) -> int:
    import argparse
    if not text.isdigit() or not 1 <= int(text) <= 64:
        raise argparse.ArgumentTypeError(f"must be a number of processes from 1 to 64, got {text}")
    return int(text)


def add_server_args(c, local_by_default: bool = False) -> None:
    """--addr, the Curve keys and --timeout of a command that talks to a running server (or, with
    local_by_default, runs a local engine unless --addr is given)."""
    g = c.add_argument_group("server")
    if local_by_default:
        g.add_argument("--addr", default=None, metavar="ENDPOINT",
                       help=f"talk to the `rawinfer serve` at ENDPOINT, e.g. {DEFAULT_ADDR} (default: none, run the "
                            "model here; the engine flags below apply then)")
    else:
        g.add_argument("--addr", default=DEFAULT_ADDR, metavar="ENDPOINT",
                       help=f"the server's endpoint (default: {DEFAULT_ADDR})")
    g.add_argument("--server-key", metavar="FILE", default=None,
                   help="the server's public key (server.key, or its Z85 text) when it uses CurveZMQ (default: none)")
    g.add_argument("--client-key", metavar="FILE", default=None,
                   help="this client's .key_secret, for a server started with --curve-client-keys (default: none)")
    g.add_argument("--timeout", type=positive_float, default=60.0, metavar="SECONDS",
                   help="give up when the server stays silent this long during a request (default: 60; whether "
                        f"a server answers at all is checked first, within {PING_TIMEOUT_S:g} s)")


def cmd_serve(args) -> int:
    from rawinfer.frontends.server.activity import log_with_time
    log_with_time()
    _take_positional_model(args)
    check_role_args(args)
    check_replica_args(args)
    if args.replicas is not None:
        return run_replicas(args, open_front)
    if args.role == "prefill":         # reached by decode instances only: no client socket, no HTTP
        return run_prefill_role(args, open_engine(args))
    from rawinfer.frontends.server.server import SecurityError, Server
    cfg, workers = open_front(args)
    try:
        engine = open_engine(args)
        try:
            server = Server(engine, cfg, kv_connector=decode_connector(args, engine))
        except SecurityError as e:
            raise CLIError(str(e)) from None
        if workers is not None:
            log.info("OpenAI-compatible API on http://%s:%d/v1 (%d worker process%s)", _url_host(args.http_host),
                     args.http_port, len(workers.procs), "es" if len(workers.procs) > 1 else "")
        return server.run()
    finally:
        if workers is not None:
            workers.stop()


def _take_positional_model(args) -> None:
    """`rawinfer serve MODEL` as `--model MODEL`; both, naming different models, is refused."""
    given = args.model_positional
    if given is None:
        return
    if args.model is not None and os.path.normpath(os.path.expanduser(args.model)) != \
            os.path.normpath(os.path.expanduser(given)):
        raise CLIError(f"two models given, {given!r} and --model {args.model!r}: give one of them")
    args.model = given


def served_model_names(args) -> list[str] | None:
    """--served-model-name, else the name of the model's folder or GGUF file as the user gave it (a folder
    of the conversion cache given directly: its source's name, never the cache's digest); the default
    model by its name, whichever of its copies this device runs (models.py: default_model)."""
    if args.served_names:
        return list(args.served_names)
    if args.model is None:
        from rawinfer.config import DEFAULT_MODEL
        return [os.path.basename(DEFAULT_MODEL)]
    path = os.path.normpath(os.path.expanduser(args.model))
    from rawinfer.convert.cache import SOURCE_FILE
    try:
        with open(os.path.join(path, SOURCE_FILE), encoding="utf-8") as f:
            path = os.path.normpath(json.load(f)["source"])
    except (OSError, ValueError, KeyError, TypeError):
        pass                             # not a cached conversion
    name = os.path.basename(path)
    return [name[:-5] if name.lower().endswith(".gguf") else name]


def open_front(args):
    """What faces clients, checked before any model loads: the ServerConfig of --bind and its keys, and the
    HTTP workers (None with --no-http). CLIError for an unsafe or busy address."""
    from rawinfer.frontends.server.server import (SecurityError, ServerConfig, check_bind_security,
                                                  is_loopback_endpoint, load_secret_key)
    try:
        cfg = options_from_args(ServerConfig, args, "server option")
    except ValueError as e:
        raise CLIError(str(e)) from None
    try:
        check_bind_security(cfg)
        if cfg.curve_secret_key_file:
            load_secret_key(cfg.curve_secret_key_file)
    except SecurityError as e:
        raise CLIError(str(e)) from None
    probe_endpoint(args.bind)
    if args.insecure and not is_loopback_endpoint(args.bind) and not args.curve_secret_key_file:
        log.warning("serving %s unencrypted (--insecure): anyone who can reach it can use the engine", args.bind)
    return cfg, _start_http(args)        # before the model loads: /health answers 503 meanwhile


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _start_http(args):
    """The HTTP workers of --http-* (None with --no-http); CLIError for an unsafe host or a busy port."""
    if not args.http:
        return None
    from rawinfer.frontends.http.config import HTTPConfig
    from rawinfer.frontends.http.launcher import LaunchError, Workers, bind_http, check_http_security, connect_addr
    if args.curve_client_keys_dir:
        log.warning("no HTTP API: --curve-client-keys admits only listed ZeroMQ clients, and the HTTP front end "
                    "would be one more client without a listed key (--no-http silences this)")
        return None
    try:
        check_http_security(args.http_host, args.api_key, args.insecure)
        sock = bind_http(args.http_host, args.http_port)
    except LaunchError as e:
        raise CLIError(str(e)) from None
    if args.insecure and not args.api_key and not _loopback(args.http_host):
        log.warning("serving HTTP on %s without an API key (--insecure): anyone who can reach it can use the "
                    "engine", args.http_host)
    try:
        cfg = options_from_args(HTTPConfig, args, "HTTP option", engine_addr=connect_addr(args.bind),
                                server_key=args.curve_secret_key_file, served_names=served_model_names(args),
                                max_in_flight=_http_max_in_flight(args))
    except ValueError as e:
        raise CLIError(str(e)) from None
    return Workers(sock, args.api_workers, dataclasses.asdict(cfg), level=logging.getLogger().getEffectiveLevel())


def _http_max_in_flight(args) -> int:
    """--http-max-in-flight, else enough to keep every engine's batch full with as many waiting."""
    if args.max_in_flight is not None:
        return args.max_in_flight
    engines = max(getattr(args, "replicas", None) or 1, getattr(args, "autoscale_max_replicas", None) or 1)
    return max(2 * args.max_num_seqs * engines, args.max_prompts_per_request)


def _loopback(host: str) -> bool:
    from rawinfer.frontends.http.launcher import is_loopback_host
    return is_loopback_host(host)


def cmd_client(args) -> int:
    from rawinfer.engine.tokenizer import chat_messages
    from rawinfer.frontends.client.client import Client
    params = sampling_params_from_args(args)
    check_system_flag(args)
    prompt = read_prompt(args)
    ping_server(args.addr, args.server_key, args.client_key)
    with Client(args.addr, server_key=args.server_key, client_key_file=args.client_key,
                timeout_s=args.timeout) as client:
        info = client.model_info()
        if args.token_ids:
            request = {"prompt": parse_token_ids(prompt)}
        elif not info.get("has_tokenizer", True):
            raise CLIError(f"the model served at {args.addr} has no tokenizer, so it cannot read text: give the "
                           "prompt as token ids with --token-ids")
        elif args.raw or not info.get("has_chat_template"):
            plain_text_prompt(args, f"the model served at {args.addr}")
            request = {"prompt": prompt}
        else:                            # the server applies the template, as `rawinfer generate` would
            request = {"messages": chat_messages(prompt, args.system)}
        print_stream(client_events(client.generate(**request, params=params, stream=not args.json)), args.json,
                     quiet=is_quiet(args), show_ids=args.token_ids or not info.get("has_tokenizer", True))
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
