"""The OpenAI response bodies of completions and chat completions, whole or as a stream of chunks, built
from a Job's engine messages (generation.py)."""

from __future__ import annotations

from typing import Any, AsyncIterator

from rawinfer.frontends.http.engine_link import EngineLink
from rawinfer.frontends.http.errors import APIError, log_failure
from rawinfer.frontends.http.generation import Totals, job_messages, prepare
from rawinfer.frontends.http.params import Job
from rawinfer.frontends.http.sse import DONE, event
from rawinfer.frontends.server import protocol as P

_FINISH = {"stop": "stop", "length": "length"}


def _head(job: Job, chunk: bool) -> dict:
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if job.chat else "text_completion"
    return {"id": job.id, "object": kind, "created": job.created, "model": job.model}


async def _totals(link: EngineLink, job: Job) -> Totals:
    await prepare(link, job)
    return Totals(job, await link.token_texts() if job.logprobs is not None else None)


def _with_calls(reason: str | None, calls: bool) -> str | None:
    """OpenAI's finish reason of an answer that ended by itself after making tool calls."""
    return "tool_calls" if calls and reason == "stop" else reason


def _chat_logprobs(value: Any) -> dict | None:
    return None if value is None else {"content": value}


async def whole_response(link: EngineLink, job: Job) -> dict:
    """The non-streaming response: every choice's text, finish reason and logprobs, and the usage."""
    totals = await _totals(link, job)
    async for index, msg in job_messages(link, job, stream=False):
        totals.add(index, msg)
    failure = totals.failure()
    if failure is not None:
        raise failure
    choices = []
    for i, c in enumerate(totals.choices):
        reason = _FINISH[c.finish]
        if job.chat:
            message, calls = job.shape.message(c.text) if job.shape else ({"role": "assistant", "content": c.text},
                                                                            False)
            choices.append({"index": i, "message": message, "logprobs": _chat_logprobs(c.logprobs),
                            "finish_reason": _with_calls(reason, calls)})
        else:
            choices.append({"index": i, "text": c.text, "logprobs": c.logprobs, "finish_reason": reason})
    return {**_head(job, False), "choices": choices, "usage": totals.usage()}


class ChunkStream:
    """The streaming response of a job as SSE bytes. start() waits for the first engine message, so a
    refused request is an HTTP error rather than a stream holding one."""

    def __init__(self, link: EngineLink, job: Job, route: str):
        self.link, self.job, self.route = link, job, route        # route: "METHOD PATH", for the log
        self.totals: Totals | None = None
        self.messages: AsyncIterator | None = None
        self.first: tuple[int, P.Chunk | P.Final] | None = None

    async def start(self) -> None:
        self.totals = await _totals(self.link, self.job)
        self.messages = job_messages(self.link, self.job, stream=True)
        try:
            self.first = await self.messages.__anext__()
        except StopAsyncIteration:
            pass
        except BaseException:
            await self.messages.aclose()
            raise

    def _chunk(self, index: int, msg: P.Chunk | P.Final) -> dict:
        text, lp = self.totals.add(index, msg)
        reason = _FINISH.get(msg.finish_reason) if isinstance(msg, P.Final) else None
        if self.job.chat and self.job.shape is not None:
            delta, calls = self.job.shape.delta(index, text, isinstance(msg, P.Final))
            choice = {"index": index, "delta": delta, "logprobs": _chat_logprobs(lp),
                      "finish_reason": _with_calls(reason, calls)}
        elif self.job.chat:
            delta = {"content": text} if text or not isinstance(msg, P.Final) else {}
            choice = {"index": index, "delta": delta, "logprobs": _chat_logprobs(lp), "finish_reason": reason}
        else:
            choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": reason}
        return self._body(index, choice)

    def _opening(self, index: int) -> dict:
        """A chat choice's first chunk, before any text: the role, as OpenAI and vLLM open a stream."""
        return self._body(index, {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None})

    def _body(self, index: int, choice: dict) -> dict:
        body = {**_head(self.job, True), "choices": [choice]}
        if self.job.continuous_usage:
            body["usage"] = self.totals.choice_usage(index)
        elif self.job.include_usage:
            body["usage"] = None
        return body

    async def _all(self) -> AsyncIterator:
        if self.first is not None:
            yield self.first
        async for item in self.messages:
            yield item

    async def events(self) -> AsyncIterator[bytes]:
        try:
            try:
                if self.job.chat:
                    for index in range(len(self.totals.choices)):
                        yield event(self._opening(index))
                async for index, msg in self._all():
                    if isinstance(msg, P.Final) and msg.finish_reason not in _FINISH:
                        self.totals.add(index, msg)         # reported once, below
                        continue
                    yield event(self._chunk(index, msg))
            except APIError as e:
                log_failure(e, self.route)
                yield event(e.body())
                yield DONE
                return
            failure = self.totals.failure()
            if failure is not None:
                log_failure(failure, self.route)
                yield event(failure.body())
            elif self.job.include_usage:
                yield event({**_head(self.job, True), "choices": [], "usage": self.totals.usage()})
            yield DONE
        finally:
            await self.messages.aclose()
