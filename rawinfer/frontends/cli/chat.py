"""`rawinfer chat`: an interactive conversation in the terminal, with a local engine or a running server.

Each line typed is a user message; the answer streams as it is generated and joins the history
(conversation.py). Lines starting with / are commands: /reset, /system TEXT, /help, /exit. Ctrl-C
while an answer streams stops that answer (what was said stays in the history) and returns to the
prompt; a second Ctrl-C before it has stopped, or Ctrl-C at an empty prompt twice, leaves. Ctrl-D
(or the end of piped input) leaves too. Notices (dropped turns, stopped answers) and the summary line
of each answer go to stderr, the answers to stdout.
"""

from __future__ import annotations

import signal
import sys

from rawinfer.frontends.cli.conversation import Conversation, LocalModel, Refused, RemoteModel, TooLong
from rawinfer.frontends.cli.serve import add_server_args
from rawinfer.frontends.cli.stream import summary_line
from rawinfer.frontends.options import (CLIError, add_command, add_engine_args, add_sampling_args, is_quiet,
                                        sampling_params_from_args)

HELP = ("commands: /reset forgets the conversation, /system TEXT sets the system message (/system alone "
        "clears it), /exit leaves (so does Ctrl-D); Ctrl-C stops an answer")


def add_parser(sub) -> None:
    p = add_command(sub, "chat", "talk with a model in the terminal, keeping the conversation "
                                 "(a local engine, or a running server with --addr)")
    p.add_argument("--system", default=None, metavar="TEXT",
                   help="system message of the conversation (default: the chat template's own, if any)")
    add_server_args(p, local_by_default=True)
    add_engine_args(p)
    add_sampling_args(p, max_tokens=512)
    p.set_defaults(func=cmd_chat)


def notice(text: str) -> None:
    print(f"[{text}]", file=sys.stderr, flush=True)


class StopOnInterrupt:
    """While active, the first Ctrl-C only sets `stopped` (the answer ends between steps); a second one
    raises KeyboardInterrupt as usual."""

    def __init__(self):
        self.stopped = False

    def __enter__(self) -> "StopOnInterrupt":
        self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def _on_sigint(self, signum, frame) -> None:
        if self.stopped:
            raise KeyboardInterrupt
        self.stopped = True

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self._previous)


def read_message(interactive: bool) -> str | None:
    """The next user message (lines ending in a backslash continue it); None at the end of input."""
    lines = []
    while True:
        if interactive:
            line = input("> " if not lines else ". ")
        else:
            line = sys.stdin.readline()
            if not line:
                raise EOFError
            line = line.rstrip("\n")
        if line.endswith("\\"):
            lines.append(line[:-1])
            continue
        lines.append(line)
        return "\n".join(lines)


def answer(model, conv: Conversation, user: str, params, quiet: bool) -> None:
    """Send one message with the history, print the streamed answer, record the turn."""
    dropped = 0
    with StopOnInterrupt() as interrupt:
        while True:
            try:
                events = model.answer(conv.messages(user), params, lambda: interrupt.stopped)
                break
            except TooLong as e:
                if not conv.drop_oldest():
                    notice(f"this message does not fit the context of {model.context_len} tokens with room for an "
                           f"answer of --max-tokens {params.max_tokens} ({e}); shorten it or lower --max-tokens")
                    return
                dropped += 1
            except Refused as e:
                notice(str(e))
                return
        if dropped:
            notice(f"the conversation outgrew the context of {model.context_len} tokens: dropped the oldest "
                   f"{dropped} turn{'s' if dropped > 1 else ''}; {len(conv.turns)} kept")
        text, n, final = [], 0, None
        for ev in events:
            text.append(ev.text)
            n += len(ev.token_ids)
            if ev.text:
                sys.stdout.write(ev.text)
                sys.stdout.flush()
            final = ev.final or final
    sys.stdout.write("\n")
    sys.stdout.flush()
    reply = "".join(text)
    if reply.strip():
        conv.turns.append((user, reply))
    if final is not None and final.finish_reason == "abort":
        notice(f"stopped after {n} tokens")
    elif final is not None and final.finish_reason == "error":
        notice(f"the answer failed: {final.error}")
    elif final is not None and not quiet:
        print(summary_line(len(final.prompt_token_ids), n, final.ttft_s, final.itl_s, final.tokens_per_s),
              file=sys.stderr, flush=True)


def command(line: str, conv: Conversation) -> bool:
    """Run a /command; False when it asks to leave."""
    name, _, rest = line.strip().partition(" ")
    if name in ("/exit", "/quit", "/bye"):
        return False
    if name == "/reset":
        conv.turns.clear()
        notice("conversation cleared")
    elif name == "/system":
        conv.system = rest.strip() or None
        notice(f"system message {'set' if conv.system else 'cleared'}; the conversation so far is kept")
    elif name == "/help":
        notice(HELP)
    else:
        notice(f"unknown command {name}; {HELP}")
    return True


def loop(model, conv: Conversation, params, quiet: bool) -> int:
    interactive = sys.stdin.isatty()
    if interactive:
        # Ctrl-C on the terminal is the user's: a process started where SIGINT is ignored (a shell's
        # background command) keeps it ignored, and the prompt would never see one
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
    if not quiet:
        notice(f"chatting with {model.name} (context {model.context_len} tokens); /help for commands, Ctrl-C "
               "stops an answer, Ctrl-D or /exit leaves")
    interrupted = False
    while True:
        try:
            line = read_message(interactive)
        except EOFError:
            if interactive:
                sys.stdout.write("\n")
            return 0
        except KeyboardInterrupt:
            if interrupted:
                sys.stdout.write("\n")
                return 0
            interrupted = True
            sys.stdout.write("\n")
            notice("Ctrl-C again, Ctrl-D or /exit leaves")
            continue
        interrupted = False
        if not line.strip():
            continue
        if line.lstrip().startswith("/") and line.strip().split()[0][1:].isalpha():
            if not command(line, conv):
                return 0
            continue
        answer(model, conv, line, params, quiet)


def refuse_a_model_without_chat(args) -> None:
    """A model that cannot hold a conversation (no tokenizer, no chat template and no --chat-template) is
    refused from its files, before it loads and warms up."""
    from rawinfer.frontends.cli.models import conversation_lacks, resolve_model
    path = resolve_model(args.model, progress=not is_quiet(args), device=args.device)
    missing = conversation_lacks(path, getattr(args, "chat_template", None))
    if missing == "tokenizer":
        raise CLIError(f"the model in {path} has no tokenizer, so it cannot hold a conversation; use `rawinfer "
                       "generate` (with --raw or --token-ids) instead")
    if missing is not None:
        raise CLIError(f"the model in {path} has no chat template, so it cannot hold a conversation; give one with "
                       "--chat-template FILE, or use `rawinfer generate --raw` instead")


def cmd_chat(args) -> int:
    params = sampling_params_from_args(args)
    conv = Conversation(system=args.system)
    if args.addr is None:
        from rawinfer.frontends.cli.models import open_engine
        refuse_a_model_without_chat(args)
        return loop(LocalModel(open_engine(args)), conv, params, is_quiet(args))
    from rawinfer.frontends.cli.connect import ping_server
    from rawinfer.frontends.client.client import Client
    ping_server(args.addr, args.server_key, args.client_key)
    with Client(args.addr, server_key=args.server_key, client_key_file=args.client_key,
                timeout_s=args.timeout) as client:
        return loop(RemoteModel(client, args.addr), conv, params, is_quiet(args))
