"""`rawinfer generate`: one prompt through a local engine, streamed to the terminal.

A one-shot: the engine is warmed for this prompt's steps alone (engine/warmup.py: warm_up_like), not for
every step a server meets, so it answers sooner; a kernel compiled after that is said.
"""

from __future__ import annotations

import logging
import re
import time

from rawinfer.frontends.cli.models import conversation_lacks, open_engine, resolve_model
from rawinfer.frontends.cli.stream import engine_events, print_stream
from rawinfer.frontends.options import (CLIError, add_command, add_engine_args, add_sampling_args,
                                        check_system_flag, is_quiet, plain_text_prompt, read_prompt,
                                        sampling_params_from_args)

log = logging.getLogger("rawinfer")


def add_parser(sub) -> None:
    p = add_command(sub, "generate", "generate text for one prompt, streaming")
    p.add_argument("prompt", nargs="?", help="the prompt (read from stdin when absent)")
    p.add_argument("--raw", action="store_true",
                   help="send the prompt as it is (default: wrapped in the model's chat template when it has one)")
    p.add_argument("--system", default=None, metavar="TEXT",
                   help="system message for the chat template (default: the template's own, if any)")
    p.add_argument("--token-ids", action="store_true",
                   help="the prompt is token ids separated by commas or spaces, and the output is printed as ids "
                        "too (for models without a tokenizer)")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end instead of streaming")
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=cmd_generate)


def parse_token_ids(text: str) -> list[int]:
    parts = [p for p in re.split(r"[\s,]+", text.strip()) if p]
    if not parts or not all(p.isdigit() for p in parts):
        raise CLIError("--token-ids: the prompt must be non-negative integers separated by commas or spaces")
    return [int(p) for p in parts]


def refuse_what_the_model_cannot_read(args) -> None:
    """Text for a model without a tokenizer, or --system for one without a chat template (and no
    --chat-template), refused from the model's files before it loads."""
    path = resolve_model(args.model, progress=not is_quiet(args), device=args.device)
    missing = conversation_lacks(path, getattr(args, "chat_template", None))
    if missing == "tokenizer":
        raise CLIError(f"the model in {path} has no tokenizer, so it cannot read text: give the prompt as token ids "
                       "with --token-ids, or convert it from a source that has tokenizer files")
    if missing is not None and args.system is not None and not args.raw:
        plain_text_prompt(args, path)                  # raises: --system needs a chat template


def cmd_generate(args) -> int:
    from rawinfer.engine.tokenizer import chat_messages, has_chat_template, render_chat
    from rawinfer.engine.warmup import say_when_compiling, warm_up_like
    params = sampling_params_from_args(args)
    check_system_flag(args)
    prompt = read_prompt(args)
    ids = parse_token_ids(prompt) if args.token_ids else None
    if ids is None:
        refuse_what_the_model_cannot_read(args)
    engine = open_engine(args, one_shot=params.n)     # warmed below for this prompt's steps alone
    if ids is not None:
        prompt = ids
    elif not args.raw and has_chat_template(engine.tokenizer):   # rendered as the server renders `messages`
        prompt = render_chat(engine.tokenizer, chat_messages(prompt, args.system))
    else:
        plain_text_prompt(args, engine.model_dir)
    prompt_ids = engine.encode_prompt(prompt)
    warm_up_like(engine, len(prompt_ids), params)
    engine.add_request("generate", prompt_ids, params)
    t0 = time.monotonic()
    with say_when_compiling():
        print_stream(engine_events(engine, prompt_ids), args.json, quiet=is_quiet(args),
                     show_ids=args.token_ids or engine.tokenizer is None)
    log.debug("total %.2f s", time.monotonic() - t0)
    return 0
