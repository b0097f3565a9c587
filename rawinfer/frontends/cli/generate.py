"""`rawinfer generate`: one prompt through a local engine, streamed to the terminal."""

from __future__ import annotations

import logging
import time

from rawinfer.frontends.cli.stream import engine_events, print_stream
from rawinfer.frontends.options import (add_engine_args, add_sampling_args, engine_config_from_args, read_prompt,
                                        sampling_params_from_args)

log = logging.getLogger("rawinfer")


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt, streaming")
    p.add_argument("prompt", nargs="?", help="the prompt (read from stdin when absent)")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--system", default=None, help="system message for the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=cmd_generate)


def cmd_generate(args) -> int:
    from rawinfer.engine.engine import LLMEngine
    from rawinfer.engine.tokenizer import chat_messages, has_chat_template, render_chat
    params = sampling_params_from_args(args)
    prompt = read_prompt(args)
    engine = LLMEngine(args.model, engine_config_from_args(args))
    if not args.raw and has_chat_template(engine.tokenizer):   # rendered as the server renders `messages`
        prompt = render_chat(engine.tokenizer, chat_messages(prompt, args.system))
    ids = engine.add_request("generate", prompt, params)
    t0 = time.monotonic()
    print_stream(engine_events(engine, ids), args.json)
    log.debug("total %.2f s", time.monotonic() - t0)
    return 0
