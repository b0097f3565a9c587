"""The state of `rawinfer chat` and the two places its answers come from.

Conversation holds the system message and the turns (user message, answer) so far. Each new message is
sent with the whole history, rendered by the model's chat template; when the history no longer fits
the context with room for --max-tokens, the oldest turns are dropped (the caller says so).

LocalModel answers with an LLMEngine in this process, RemoteModel through a running `rawinfer serve`.
Both turn one chat into a stream of stream.Event (the events `rawinfer generate` prints), start the
request at once so that a chat that does not fit raises TooLong before anything is printed, and stop
between steps (or messages) once `stop()` says so: the request is aborted and its blocks freed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

from rawinfer.frontends.cli.stream import Event, Final, _decode_rate, client_events
from rawinfer.frontends.options import EXIT_FAILED, CLIError


class TooLong(Exception):
    """The chat does not fit the context (or the KV pool) with room for the answer."""


class Refused(Exception):
    """The model cannot answer this chat (its template refused it, the server refused the request)."""


@dataclass
class Conversation:
    system: str | None = None
    turns: list[tuple[str, str]] = field(default_factory=list)     # (user message, answer)

    def messages(self, user: str) -> list[dict[str, str]]:
        """The chat to send: the system message, every turn so far, then the new user message."""
        out = [{"role": "system", "content": self.system}] if self.system else []
        for question, answer in self.turns:
            out += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        return out + [{"role": "user", "content": user}]

    def drop_oldest(self) -> bool:
        if not self.turns:
            return False
        self.turns.pop(0)
        return True


class LocalModel:
    """Answers with a local LLMEngine (the chat rendered here, as the server would)."""

    def __init__(self, engine):
        from rawinfer.engine.tokenizer import has_chat_template
        if engine.tokenizer is None or not has_chat_template(engine.tokenizer):
            missing = "tokenizer" if engine.tokenizer is None else "chat template"
            raise CLIError(f"the model in {engine.model_dir} has no {missing}, so it cannot hold a conversation; "
                           "use `rawinfer generate` (with --raw or --token-ids) instead")
        self.engine = engine
        self.name = engine.model_dir
        # the longest chat + answer: the context, or the whole KV pool when that holds fewer tokens
        self.context_len = min(engine.max_model_len, engine.block_manager.num_blocks * engine.config.block_size)
        self._count = 0

    def answer(self, messages: list[dict], params, stop: Callable[[], bool]) -> Iterator[Event]:
        from rawinfer.engine.tokenizer import ChatTemplateError, render_chat
        try:
            prompt = render_chat(self.engine.tokenizer, messages)
        except ChatTemplateError as e:
            raise Refused(f"the model's chat template refused the conversation ({e})") from None
        self._count += 1
        rid = f"chat-{self._count}"
        try:
            ids = self.engine.add_request(rid, prompt, params)
        except ValueError as e:                 # RequestRejected: too long for the context or the KV pool
            raise TooLong(str(e)) from None
        return self._events(rid, ids, stop)

    def _events(self, rid: str, prompt_ids: list[int], stop: Callable[[], bool]) -> Iterator[Event]:
        engine = self.engine
        try:
            while engine.has_unfinished():
                outs = engine.abort(rid) if stop() else engine.step()
                for out in outs:
                    final = None
                    if out.finished:
                        m = out.metrics
                        gen_s = (m.finished_time - m.first_token_time) if m.first_token_time and m.finished_time \
                            else None
                        final = Final(prompt_ids, out.finish_reason, m.ttft_s, m.mean_itl_s,
                                      _decode_rate(m.generated_tokens, gen_s))
                    yield Event(out.new_token_ids, out.text_delta, final)
        finally:
            engine.abort(rid)                   # a no-op once finished; frees the blocks if left early


class RemoteModel:
    """Answers through a running `rawinfer serve` (the server renders the chat with the same template)."""

    def __init__(self, client, addr: str):
        info = client.model_info()
        if not info.get("has_tokenizer", True) or not info.get("has_chat_template"):
            raise CLIError(f"the model served at {addr} has no chat template, so it cannot hold a conversation; "
                           "use `rawinfer client` instead")
        self.client, self.addr = client, addr
        self.name = f"{info.get('model')} at {addr}"
        self.context_len = int(info["max_model_len"])
        if info.get("kv_blocks_total") and info.get("block_size"):
            self.context_len = min(self.context_len, int(info["kv_blocks_total"]) * int(info["block_size"]))

    def answer(self, messages: list[dict], params, stop: Callable[[], bool]) -> Iterator[Event]:
        from rawinfer.frontends.client.client import RequestError
        try:
            raw = self.client.generate(messages=messages, params=params, stream=True)
        except UnicodeError:                # lone surrogates: undecodable bytes read as text
            raise Refused("this message is not valid UTF-8 text (it holds undecodable bytes); it was not sent") \
                from None
        except ValueError as e:             # over the server's message size limit: older turns go first
            raise TooLong(str(e)) from None
        try:
            first = next(raw)               # a refusal arrives as the first answer
        except RequestError as e:
            raw.close()
            if e.code == "rejected":
                raise TooLong(e.message) from None
            raise Refused(f"the server refused the conversation: {e.message}") from None
        return self._events(first, raw, stop)

    def _events(self, first, raw, stop: Callable[[], bool]) -> Iterator[Event]:
        def messages():
            yield first
            yield from raw
        try:
            for ev in client_events(messages()):
                if ev.final is not None and ev.final.finish_reason == "abort":
                    raise CLIError(f"the server at {self.addr} stopped the answer (it is shutting down)", EXIT_FAILED)
                yield ev
                if stop() and ev.final is None:
                    yield Event([], "", Final([], "abort", None, None, None))
                    return
        finally:
            raw.close()                     # left early: the client library aborts the request on the server
