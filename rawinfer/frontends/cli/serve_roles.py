"""`rawinfer serve --role prefill | decode`: the options of prefill/decode disaggregation and the prefill
role's loop (frontends/disagg/). Colocated, the default, changes nothing.

    rawinfer serve --role prefill --prefill-bind tcp://127.0.0.1:5560       (reached by decode instances only)
    rawinfer serve --role decode --prefill tcp://127.0.0.1:5560 [ADDR ...]  (faces clients as `serve` does)
"""

from __future__ import annotations

import argparse
import logging
import signal

from rawinfer.frontends.options import CLIError
from rawinfer.settings import add_options, options_from_args

log = logging.getLogger("rawinfer")
ROLES = ("colocated", "prefill", "decode")


def add_role_args(p: argparse.ArgumentParser) -> None:
    """The role and its options: the decode role's from DecodeConfig's fields (under their names), the prefill
    role's from PrefillConfig's (under prefill_<field>: the server's own --bind is `bind`)."""
    from rawinfer.frontends.disagg.connector import DecodeConfig
    from rawinfer.frontends.disagg.prefill import PrefillConfig
    g = p.add_argument_group("prefill/decode disaggregation")
    g.add_argument("--role", choices=ROLES, default="colocated",
                   help="colocated: one engine does both phases; prefill: compute prompts' K/V for decode instances "
                        "on --prefill-bind; decode: serve clients, prompts prefilled on --prefill "
                        "(default: colocated)")
    add_options(g, DecodeConfig)
    add_options(g, PrefillConfig, dest_prefix="prefill_")
    g.add_argument("--prefill-key", default=None, metavar="FILE",
                   help="--role decode: the prefill instances' public key (their server.key, or its Z85 text) when "
                        "they run with --curve-secret-key (default: the public half of this instance's "
                        "--curve-secret-key, if given; else unencrypted)")


def check_role_args(args) -> None:
    """CLIError for options that do not go with the role (before the model loads)."""
    if args.role == "decode" and not args.prefill:
        raise CLIError("--role decode needs --prefill ADDR (a prefill instance's --prefill-bind endpoint)")
    if args.role != "decode" and args.prefill:
        raise CLIError("--prefill names prefill instances for --role decode; add --role decode")


def decode_connector(args, engine):
    """The prefill link of --role decode (for Server(kv_connector=...)), None for any other role."""
    if args.role != "decode":
        return None
    from rawinfer.frontends.disagg.connector import DecodeConfig, DecodeConnector
    try:
        cfg = options_from_args(DecodeConfig, args, "decode option", server_key=prefill_public_key(args))
        return DecodeConnector(engine, cfg)
    except ValueError as e:
        raise CLIError(str(e)) from None


def prefill_public_key(args) -> bytes | None:
    """The Curve public key decode instances expect of the prefill instances (--prefill-key, else the public
    half of --curve-secret-key), or None for an unencrypted link."""
    from rawinfer.frontends.client.client import ClientError, load_public_key
    from rawinfer.frontends.server.security import SecurityError, load_secret_key
    try:
        if getattr(args, "prefill_key", None):
            return load_public_key(args.prefill_key)
        if args.curve_secret_key_file:
            return load_secret_key(args.curve_secret_key_file)[0]
    except (ClientError, SecurityError) as e:
        raise CLIError(str(e)) from None
    return None


def run_prefill_role(args, engine) -> int:
    """Serve `engine` as a prefill instance until SIGINT/SIGTERM."""
    from rawinfer.frontends.disagg.prefill import PrefillConfig, PrefillServer
    from rawinfer.frontends.server.security import SecurityError
    try:
        cfg = options_from_args(PrefillConfig, args, "prefill option", dest_prefix="prefill_",
                                insecure=args.insecure, curve_secret_key_file=args.curve_secret_key_file)
        server = PrefillServer(engine, cfg)
    except SecurityError as e:
        raise CLIError(str(e)) from None
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: server.stop())
    log.info("prefill instance on %s (reached by decode instances only%s)", server.endpoint,
             ", CurveZMQ" if args.curve_secret_key_file else "")
    server.run()
    log.info("prefill instance stopped: %s", server.counters)
    return 0
