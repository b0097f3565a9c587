"""The admission thread: renders chats and tokenises prompts off both the I/O and the engine thread (requests,
and the tokenize / detokenize calls), starts compiling their structured-output grammars, and the size limits
that let the I/O thread refuse an oversized prompt before anyone tokenises it.

A text prompt of C characters needs at least C / L tokens, L being the longest vocabulary entry, so one
longer than max_model_len x L characters can never fit the context: it is refused on arrival, in time
independent of its length. Everything this thread hands on (Admit, Cancel, Stop) goes to the engine thread
in the order it arrived.
"""

from __future__ import annotations

import logging
import queue
import threading

from rawinfer.engine.tokenizer import ChatTemplateError, has_chat_template, render_chat
from rawinfer.frontends.server import protocol as P
from rawinfer.frontends.server.handoff import Admit, Cancel, Convert, Outbound, Outgoing, Prepare, Stop
from rawinfer.frontends.server.worker import refusal

log = logging.getLogger("rawinfer")


def longest_token_chars(tokenizer) -> int:
    """Characters of the longest vocabulary entry: no token stands for more characters of input text."""
    return max((len(t) for i in range(tokenizer.vocab_size) if (t := tokenizer.token_text(i))), default=1)


class PromptLimits:
    """The checks that need no tokenising: run by the I/O thread on every generate as it arrives."""

    def __init__(self, engine):
        self.max_model_len = engine.max_model_len
        self.tokenizer = engine.tokenizer
        self.max_chars = self.max_model_len * longest_token_chars(self.tokenizer) if self.tokenizer else 0

    def refuse(self, msg: P.Generate) -> tuple[P.ErrorCode, str] | None:
        """(code, message) when the prompt can be refused already, else None."""
        if isinstance(msg.prompt, list):
            if len(msg.prompt) > self.max_model_len:
                return P.ErrorCode.REJECTED, (f"the prompt has {len(msg.prompt)} tokens but the context holds "
                                              f"{self.max_model_len}; shorten it")
            return None
        if msg.messages is not None:
            if not has_chat_template(self.tokenizer):
                return P.ErrorCode.INVALID_PROMPT, ("this model has no chat template: send the prompt as text "
                                                    "('prompt') or token ids instead of chat 'messages'")
            chars = sum(len(m["content"]) for m in msg.messages)
        elif self.tokenizer is None:
            return P.ErrorCode.REJECTED, "this model has no tokenizer: pass the prompt as a list of token ids"
        else:
            chars = len(msg.prompt)
        if chars > self.max_chars:
            return P.ErrorCode.REJECTED, (f"the prompt has {chars} characters, more than the {self.max_chars} that "
                                          f"could fit the context of {self.max_model_len} tokens; shorten it")
        return None


class Admission:
    """Prepares requests on its own thread: fed through `queue` (Prepare, Cancel, Stop), passing Admit, Cancel
    and Stop on to `engine_inbox` and refusals to `outbound`."""

    def __init__(self, engine, limits: PromptLimits, engine_inbox: queue.Queue, outbound: Outbound):
        self.engine, self.limits = engine, limits
        self.engine_inbox, self.outbound = engine_inbox, outbound
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="rawinfer-admission", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _warm(self) -> None:
        """Compile the chat template (tokenizer.py compiles it on first use), take the tokenizer's first call
        and build structured output's tokenizer, so that none of them is in the first request's TTFT. A
        template that refuses this conversation is left to refuse the first real one, with its message."""
        try:
            self.engine.structured.warm()
        except Exception as e:       # a tokenizer llguidance cannot read: structured requests will say so
            log.debug("structured output not warmed: %s", e)
        tokenizer = getattr(self.engine, "tokenizer", None)
        if not has_chat_template(tokenizer):
            return
        try:
            tokenizer.encode(render_chat(tokenizer, [{"role": "user", "content": "Hello"}]))
        except Exception as e:
            log.debug("chat template not warmed: %s", e)

    def _run(self) -> None:
        self._warm()
        while True:
            item = self.queue.get()
            if isinstance(item, Stop):
                self._refuse_the_rest()
                self.engine_inbox.put(item)
                return
            if isinstance(item, Cancel):
                self.engine_inbox.put(item)
                continue
            if isinstance(item, Convert):
                self.outbound.put([Outgoing(item.client, P.encode(self._convert(item.msg)))])
                continue
            try:
                self.engine_inbox.put(self._prepare(item))
            except ChatTemplateError as e:
                self._refuse(item, P.ErrorCode.INVALID_PROMPT, str(e))
            except ValueError as e:
                self._refuse(item, P.ErrorCode.REJECTED, str(e))
            except Exception:            # a bug in preparing one request must not stop the others
                log.exception("internal error while preparing a request")
                self._refuse(item, P.ErrorCode.INTERNAL, "the server failed on this request; see its log")

    def _prepare(self, p: Prepare) -> Admit:
        """Render and tokenise (ValueError naming the problem: a template that refuses the chat, a token id
        outside the vocabulary, a prompt longer than the context)."""
        msg = p.msg
        prompt = (render_chat(self.engine.tokenizer, msg.messages, **(msg.chat_options or {}))
                  if msg.messages is not None else msg.prompt)
        if isinstance(prompt, str) and len(prompt) > self.limits.max_chars:
            raise ValueError(f"the rendered chat has {len(prompt)} characters, more than the "
                             f"{self.limits.max_chars} that could fit the context; shorten it")
        ids = self.engine.encode_prompt(prompt)          # read-only: safe beside the engine thread
        if len(ids) > self.engine.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens but the context holds {self.engine.max_model_len}; "
                             "shorten it")
        self.engine.structured.prepare(p.params)    # the grammar compiles meanwhile (thread-safe); known bad: refused
        return Admit(p.engine_id, p.client, msg.request_id, msg.stream, ids, p.params, msg.priority)

    def _convert(self, msg: P.Tokenize | P.Detokenize):
        """The reply to a tokenize or detokenize call: its result, or an `error` naming the problem."""
        tok = self.engine.tokenizer
        try:
            if tok is None:
                raise ValueError("this model has no tokenizer: it takes and gives token ids only")
            if isinstance(msg, P.Detokenize):
                V = self.engine.model_config.vocab_size
                bad = [t for t in msg.token_ids if t >= V]
                if bad:
                    raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {V})")
                return P.DetokenizeReply(tok.decode(msg.token_ids, msg.skip_special_tokens), msg.tag)
            if msg.messages is not None:
                ids = tok.encode(render_chat(tok, msg.messages, **(msg.chat_options or {})))  # as a generate's
            else:
                ids = tok.encode(msg.prompt, add_special_tokens=msg.add_special_tokens)
            return P.TokenizeReply(ids, self.engine.max_model_len, msg.tag)
        except ChatTemplateError as e:
            return P.Error(str(P.ErrorCode.INVALID_PROMPT), str(e), tag=msg.tag)
        except ValueError as e:
            return P.Error(str(P.ErrorCode.REJECTED), str(e), tag=msg.tag)
        except Exception:            # a bug here must not stop the thread
            log.exception("internal error in a %s call", msg.TYPE)
            return P.Error(str(P.ErrorCode.INTERNAL), "the server failed on this call; see its log", tag=msg.tag)

    def _refuse(self, p: Prepare, code: P.ErrorCode, message: str) -> None:
        self.outbound.put([refusal(p.client, p.engine_id, P.Error(str(code), message, p.msg.request_id))])

    def _refuse_the_rest(self) -> None:
        while True:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, Prepare):
                self._refuse(item, P.ErrorCode.SHUTTING_DOWN, "the server is shutting down")
            elif isinstance(item, Cancel):
                self.engine_inbox.put(item)
            elif isinstance(item, Convert):
                self.outbound.put([Outgoing(item.client, P.encode(P.Error(
                    str(P.ErrorCode.SHUTTING_DOWN), "the server is shutting down", tag=item.msg.tag)))])
