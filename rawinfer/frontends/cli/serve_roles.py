"""`rawinfer serve --role prefill | decode`: the options of prefill/decode disaggregation and the prefill
role's loop (frontends/disagg/). Colocated, the default, changes nothing.

    rawinfer serve --role prefill --prefill-bind tcp://127.0.0.1:5560       (reached by decode instances only)
    rawinfer serve --role decode --prefill tcp://127.0.0.1:5560 [ADDR ...]  (faces clients as `serve` does)
"""

from __future__ import annotations

import argparse
import logging
import signal

from rawinfer.frontends.options import CLIError, positive_float

log = logging.getLogger("rawinfer")
ROLES = ("colocated", "prefill", "decode")


def add_role_args(p: argparse.ArgumentParser) -> None:
    from rawinfer.frontends.disagg.connector import POLICIES, DecodeConfig
    from rawinfer.frontends.disagg.prefill import PrefillConfig
    g = p.add_argument_group("prefill/decode disaggregation")
    g.add_argument("--role", choices=ROLES, default="colocated",
                   help="colocated: one engine does both phases; prefill: compute prompts' K/V for decode instances "
                        "on --prefill-bind; decode: serve clients, prompts prefilled on --prefill "
                        "(default: colocated)")
    g.add_argument("--prefill", nargs="+", default=[], metavar="ADDR",
                   help="--role decode: the prefill instances' --prefill-bind endpoints")
    g.add_argument("--prefill-bind", default=PrefillConfig.bind, metavar="ENDPOINT",
                   help=f"--role prefill: the endpoint decode instances connect to (default: {PrefillConfig.bind})")
    g.add_argument("--prefill-max-queued", type=int, default=PrefillConfig.max_queued, metavar="N",
                   help=f"--role prefill: prompts queued before it answers busy (default: {PrefillConfig.max_queued})")
    g.add_argument("--kv-transfer-policy", choices=POLICIES, default=DecodeConfig.policy,
                   help="--role decode: a transfer that fails is prefilled here (recompute) or fails its request "
                        f"(fail) (default: {DecodeConfig.policy})")
    g.add_argument("--kv-transfer-timeout", type=positive_float, default=DecodeConfig.transfer_timeout_s,
                   metavar="SECONDS", help=f"--role decode: deadline of one transfer "
                                           f"(default: {DecodeConfig.transfer_timeout_s:g})")
    g.add_argument("--prefill-key", default=None, metavar="FILE",
                   help="--role decode: the prefill instances' public key (their server.key, or its Z85 text) when "
                        "they run with --curve-secret-key (default: the public half of this instance's "
                        "--curve-secret-key, if given; else unencrypted)")
    g.add_argument("--min-remote-tokens", type=int, default=DecodeConfig.min_remote_tokens, metavar="N",
                   help="--role decode: prompts with fewer uncached tokens are prefilled here "
                        f"(default: {DecodeConfig.min_remote_tokens})")


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
        cfg = DecodeConfig(prefill=list(args.prefill), policy=args.kv_transfer_policy,
                           transfer_timeout_s=args.kv_transfer_timeout, min_remote_tokens=args.min_remote_tokens,
                           server_key=prefill_public_key(args))
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
        server = PrefillServer(engine, PrefillConfig(bind=args.prefill_bind, max_queued=args.prefill_max_queued,
                                                     insecure=args.insecure,
                                                     curve_secret_key_file=args.curve_secret_key_file))
    except SecurityError as e:
        raise CLIError(str(e)) from None
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: server.stop())
    log.info("prefill instance on %s (reached by decode instances only%s)", server.endpoint,
             ", CurveZMQ" if args.curve_secret_key_file else "")
    server.run()
    log.info("prefill instance stopped: %s", server.counters)
    return 0
