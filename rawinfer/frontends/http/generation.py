"""Running a Job in the engine: its engine requests' messages as one sequence of (choice index, message),
the several prompts of a request interleaved as they arrive, and the running totals of its choices
(text, finish reasons, usage) that both the streaming and the whole response are built from."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import AsyncIterator

from rawinfer.frontends.http.engine_link import EngineLink
from rawinfer.frontends.http.errors import APIError
from rawinfer.frontends.http.params import Job
from rawinfer.frontends.server import protocol as P

_DONE = object()


async def job_messages(link: EngineLink, job: Job, stream: bool) -> AsyncIterator[tuple[int, P.Chunk | P.Final]]:
    """(choice index, message) of every engine request of the job, in arrival order. Closing it early
    aborts whatever is still running in the engine."""
    ids = job.engine_ids()
    if len(job.prompts) == 1:               # the common case: no tasks, no queue
        gen = link.generate(ids[0], job.prompts[0], job.params, stream, job.priority, job.prompt_param)
        try:
            async for msg in gen:
                yield msg.index, msg
        finally:
            await gen.aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async for msg in link.generate(ids[i], job.prompts[i], job.params, stream, job.priority,
                                           job.prompt_param):
                queue.put_nowait((i * job.n + msg.index, msg))
        except APIError as e:
            queue.put_nowait((i * job.n, e))
        queue.put_nowait((i, _DONE))

    tasks = [asyncio.create_task(pump(i)) for i in range(len(job.prompts))]
    try:
        running = len(tasks)
        while running:
            index, msg = await queue.get()
            if msg is _DONE:
                running -= 1
            elif isinstance(msg, APIError):
                raise msg
            else:
                yield index, msg
    finally:
        for t in tasks:
            t.cancel()                      # an unfinished engine request is aborted as its iterator closes
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass
class Totals:
    """What a job's choices have produced so far."""
    job: Job
    texts: list[str] = field(default_factory=list)
    finish: list[str | None] = field(default_factory=list)
    prompt_tokens: dict[int, int] = field(default_factory=dict)     # prompt index -> its length
    cached_tokens: dict[int, int] = field(default_factory=dict)
    completion_tokens: int = 0
    error: str | None = None            # the first `error` finish's sentence

    def __post_init__(self):
        size = len(self.job.prompts) * self.job.n
        self.texts, self.finish = [""] * size, [None] * size

    def add(self, index: int, msg: P.Chunk | P.Final) -> None:
        self.texts[index] += msg.text
        if isinstance(msg, P.Final):
            self.finish[index] = msg.finish_reason
            self.prompt_tokens[index // self.job.n] = msg.usage.prompt_tokens
            self.cached_tokens[index // self.job.n] = msg.usage.cached_prompt_tokens
            self.completion_tokens += msg.usage.completion_tokens
            if msg.finish_reason == "error" and self.error is None:
                self.error = msg.error or "the engine failed on this request"

    def usage(self) -> dict:
        prompt = sum(self.prompt_tokens.values())
        return {"prompt_tokens": prompt, "completion_tokens": self.completion_tokens,
                "total_tokens": prompt + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens.values())}}

    def failure(self) -> APIError | None:
        """Why the job did not complete: an engine error (500), or an abort (the engine shutting down)."""
        if self.error is not None:
            return APIError(500, f"the engine failed: {self.error}", code="engine_error")
        if "abort" in self.finish:
            return APIError(503, "the request was aborted in the engine (it is shutting down); retry later",
                            code="aborted")
        return None
