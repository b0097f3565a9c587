"""The OpenAI response bodies of completions and chat completions, whole or as a stream of chunks, built
from a Job's engine messages (generation.py)."""

from __future__ import annotations

from typing import AsyncIterator

from rawinfer.frontends.http.engine_link import EngineLink
from rawinfer.frontends.http.errors import APIError
from rawinfer.frontends.http.generation import Totals, job_messages
from rawinfer.frontends.http.params import Job
from rawinfer.frontends.http.sse import DONE, event
from rawinfer.frontends.server import protocol as P

_FINISH = {"stop": "stop", "length": "length"}


def _head(job: Job, chunk: bool) -> dict:
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if job.chat else "text_completion"
    return {"id": job.id, "object": kind, "created": job.created, "model": job.model}


async def whole_response(link: EngineLink, job: Job) -> dict:
    """The non-streaming response: every choice's text, finish reason and the usage."""
    totals = Totals(job)
    async for index, msg in job_messages(link, job, stream=False):
        totals.add(index, msg)
    failure = totals.failure()
    if failure is not None:
        raise failure
    choices = []
    for i, text in enumerate(totals.texts):
        reason = _FINISH[totals.finish[i]]
        if job.chat:
            choices.append({"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None,
                            "finish_reason": reason})
        else:
            if job.echo is not None:
                text = job.echo[i // job.n] + text
            choices.append({"index": i, "text": text, "logprobs": None, "finish_reason": reason})
    return {**_head(job, False), "choices": choices, "usage": totals.usage()}


class ChunkStream:
    """The streaming response of a job as SSE bytes. start() waits for the first engine message, so a
    refused request is an HTTP error rather than a stream holding one."""

    def __init__(self, link: EngineLink, job: Job):
        self.link, self.job = link, job
        self.totals = Totals(job)
        self.messages = job_messages(link, job, stream=True)
        self.first: tuple[int, P.Chunk | P.Final] | None = None
        self.started = [False] * len(self.totals.texts)     # a choice's first chunk carries the role / echo

    async def start(self) -> None:
        try:
            self.first = await self.messages.__anext__()
        except StopAsyncIteration:
            pass
        except BaseException:
            await self.messages.aclose()
            raise

    async def abort(self) -> None:
        await self.link.abort(self.job.engine_ids())

    def _chunk(self, index: int, msg: P.Chunk | P.Final) -> dict:
        job, text = self.job, msg.text
        reason = _FINISH.get(msg.finish_reason) if isinstance(msg, P.Final) else None
        if job.chat:
            delta = {"content": text} if text or not isinstance(msg, P.Final) else {}
            if not self.started[index]:
                delta = {"role": "assistant", **({"content": ""} if not delta else delta)}
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            if not self.started[index] and job.echo is not None:
                text = job.echo[index // job.n] + text
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": reason}
        self.started[index] = True
        body = {**_head(job, True), "choices": [choice]}
        if job.include_usage:
            body["usage"] = None
        return body

    async def events(self) -> AsyncIterator[bytes]:
        try:
            pending = [] if self.first is None else [self.first]
            try:
                async def all_messages():
                    for item in pending:
                        yield item
                    async for item in self.messages:
                        yield item
                async for index, msg in all_messages():
                    self.totals.add(index, msg)
                    if isinstance(msg, P.Final) and msg.finish_reason not in _FINISH:
                        continue                        # reported once, below
                    yield event(self._chunk(index, msg))
            except APIError as e:
                yield event(e.body())
                yield DONE
                return
            failure = self.totals.failure()
            if failure is not None:
                yield event(failure.body())
            elif self.job.include_usage:
                yield event({**_head(self.job, True), "choices": [], "usage": self.totals.usage()})
            yield DONE
        finally:
            await self.messages.aclose()
