"""Running a Job in the engine: its engine requests' messages as one sequence of (choice index, message),
the several prompts of a request interleaved as they arrive, and the running totals of its choices
(text, finish reasons, usage) that both the streaming and the whole response are built from."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from rawinfer.config import is_int
from rawinfer.frontends.http.engine_link import EngineLink
from rawinfer.frontends.http.errors import APIError
from rawinfer.frontends.http.logprobs import CompletionLogprobs, TokenTexts, chat_content, merge
from rawinfer.frontends.http.params import Job
from rawinfer.frontends.server import protocol as P

_DONE = object()
GRAMMAR_ERROR_PREFIX = "structured_outputs "     # how the engine's GrammarError sentences begin (structured.py)


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


async def _prompt_length(link: EngineLink, prompt: dict) -> int:
    """How many tokens the engine will count for a generate message's prompt part."""
    if "messages" in prompt:
        return len(await link.tokenize(messages=prompt["messages"], prompt_param="messages",
                                       chat_options=prompt.get("chat_options")))
    if isinstance(prompt["prompt"], str):
        return len(await link.tokenize(prompt["prompt"]))
    return len(prompt["prompt"])


async def prepare(link: EngineLink, job: Job) -> None:
    """What a job needs from the engine before it starts: a job without max_tokens gets what the context
    leaves after its (longest) prompt, OpenAI's default for chats, or the server's default if that is less;
    an echo gets each prompt's token ids (text prompts are then sent as those ids, so the echoed tokens are
    the ones computed) and each prompt's text; a stream with continuous usage each prompt's length, for the
    chunks before its final."""
    if job.echo is not None:
        await _echo(link, job)
    if job.continuous_usage:
        job.prompt_counts = [len(ids) for ids in job.prompt_ids] if job.prompt_ids is not None else \
            [await _prompt_length(link, p) for p in job.prompts]
    if "max_tokens" not in job.params:
        lengths = job.prompt_counts or [await _prompt_length(link, p) for p in job.prompts]
        info = await link.info()
        room = info.get("max_model_len") or 0
        blocks, bs = info.get("kv_blocks_total"), info.get("block_size")
        if is_int(blocks) and is_int(bs) and blocks > 0:     # nor more than the KV pool holds for n samples
            room = min(room, blocks // max(1, job.n) * bs)
        left = max(1, room - max(lengths))
        job.params["max_tokens"] = left if job.default_max_tokens is None else min(left, job.default_max_tokens)


async def _echo(link: EngineLink, job: Job) -> None:
    """Each prompt's token ids and text, for a completion that echoes its prompt."""
    job.prompt_ids = []
    texts = await link.token_texts()
    vocab = (await link.info()).get("vocab_size")
    for i, p in enumerate(job.prompts):
        ids = p["prompt"] if not isinstance(p["prompt"], str) else await link.tokenize(p["prompt"])
        bad = [t for t in ids if is_int(vocab) and not 0 <= t < vocab]
        if bad:                         # before decoding them for the echo
            raise APIError(400, f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})",
                           param="prompt", code="invalid_value")
        job.prompt_ids.append(list(ids))
        job.prompts[i] = {"prompt": list(ids)}
        if job.echo[i] is None:
            job.echo[i] = texts.decode(list(ids))


@dataclass
class Choice:
    """One choice so far: its text and finish reason, and its logprobs in the job's shape."""
    text: str = ""
    finish: str | None = None
    started: bool = False
    tokens: int = 0                     # generated so far
    logprobs: Any = None                # completions: a dict of parallel lists; chat: a list of entries
    builder: CompletionLogprobs | None = None


@dataclass
class Totals:
    """What a job's choices have produced so far; add() also returns what one message adds, for a stream."""
    job: Job
    texts: TokenTexts | None = None     # needed when the job asks for logprobs
    choices: list[Choice] = field(default_factory=list)
    prompt_tokens: dict[int, int] = field(default_factory=dict)     # prompt index -> its length
    cached_tokens: dict[int, int] = field(default_factory=dict)
    completion_tokens: int = 0
    error: str | None = None            # the first `error` finish's sentence

    def __post_init__(self):
        self.choices = [Choice() for _ in range(len(self.job.prompts) * self.job.n)]

    def add(self, index: int, msg: P.Chunk | P.Final) -> tuple[str, Any]:
        """Record a message; (the text it adds, the logprobs it adds or None)."""
        job, c, p = self.job, self.choices[index], index // self.job.n
        text, lp = msg.text, None
        if not c.started:
            c.started = True
            if job.echo is not None:
                text = job.echo[p] + text
            if job.logprobs is not None and not job.chat:
                c.builder = CompletionLogprobs(self.texts)
                if job.echo is not None:
                    lp = c.builder.prompt(job.prompt_ids[p], msg.prompt_logprobs)
        if msg.logprobs is not None and job.logprobs is not None:
            if job.chat:
                lp = chat_content(self.texts, msg.logprobs)
                c.logprobs = (c.logprobs or []) + lp
            else:
                lp = merge(lp, c.builder.add(msg.logprobs))
        if lp is not None and not job.chat:
            c.logprobs = merge(c.logprobs, lp)
        c.text += text
        c.tokens += len(msg.token_ids)
        if isinstance(msg, P.Final):
            c.tokens = msg.usage.completion_tokens
            c.finish = msg.finish_reason
            self.prompt_tokens[p] = msg.usage.prompt_tokens
            self.cached_tokens[p] = msg.usage.cached_prompt_tokens
            self.completion_tokens += msg.usage.completion_tokens
            if msg.finish_reason == "error" and self.error is None:
                self.error = msg.error or "the engine failed on this request"
        return text, lp

    def choice_usage(self, index: int) -> dict:
        """vLLM's continuous usage of one choice: its prompt and what it has generated so far."""
        p = index // self.job.n
        prompt = self.prompt_tokens.get(p, self.job.prompt_counts[p])
        done = self.choices[index].tokens
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

    def usage(self) -> dict:
        prompt = sum(self.prompt_tokens.values())
        return {"prompt_tokens": prompt, "completion_tokens": self.completion_tokens,
                "total_tokens": prompt + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens.values())}}

    def failure(self) -> APIError | None:
        """Why the job did not complete: a grammar that did not compile (400: the engine compiles it off its
        thread, so a request may be taken in before its grammar fails), an engine error (500), or an abort
        (the engine shutting down)."""
        if self.error is not None and self.error.startswith(GRAMMAR_ERROR_PREFIX):
            return APIError(400, self.error, param="structured_outputs", code="invalid_value")
        if self.error is not None:
            return APIError(500, f"the engine failed: {self.error}", code="engine_error")
        if any(c.finish == "abort" for c in self.choices):
            return APIError(503, "the request was aborted in the engine (it is shutting down); retry later",
                            code="aborted")
        return None
