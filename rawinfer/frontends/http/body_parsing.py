"""Request bodies into their request models: small ones on the event loop, large ones in a process of the
HTTP worker's own, so that a body of millions of token ids never holds the worker's event loop (and every
stream on it) while it is parsed and validated.

A thread would not do: json.loads and pydantic's validation are single C and Rust calls that keep the GIL
from start to end, so the loop waits for the whole parse either way (docs/reliability.md has the
measurement). The process parses and validates the body into its request model and sends it back pickled,
with its long lists (token ids, prompts) taken out and sent as marshal chunks that the worker rebuilds a
chunk at a time, letting the loop run in between.

Frames on the pipes: to the process, a byte naming the model, the body's length (8 bytes, little endian)
and the body; back, the length and a pickle of ("ok", model pickle, {field: [chunks]}) or
("error", status, message, param, code). The process ends when its input closes (the worker ended).
"""

from __future__ import annotations

import asyncio
import json
import marshal
import pickle
import struct
import sys

from pydantic import BaseModel, ValidationError

from rawinfer.frontends.http.errors import APIError, from_validation
from rawinfer.frontends.http.schemas import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                             TokenizeRequest)

MODELS = (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest)
PARSE_INLINE_BYTES = 64 * 1024      # bodies up to this size are parsed on the event loop (the process costs more)
CHUNK_ITEMS = 65536                 # values rebuilt at a time in the worker (a few milliseconds of its loop)

_HEAD = struct.Struct("<BQ")
_LEN = struct.Struct("<Q")


def parse_body(raw: bytes, model: type[BaseModel]) -> BaseModel:
    """The body as `model`; APIError 400 naming what is wrong (not UTF-8, not JSON, not an object, a field)."""
    try:
        data = json.loads(raw.decode("utf-8")) if raw.strip() else None
    except UnicodeDecodeError:
        raise APIError(400, "the request body cannot be read (it is not UTF-8): send a JSON object in UTF-8",
                       code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "the request body cannot be read (it is nested too deep): send a JSON object in UTF-8",
                       code="invalid_json") from None
    except ValueError:
        raise APIError(400, "the request body is not valid JSON", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object (content-type application/json)",
                       code="invalid_request")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation(list(e.errors(include_url=False))) from None


class BodyParser:
    """One per event loop: parse(request, model) reads the request's body and returns it as `model`."""

    def __init__(self):
        self.process = BodyProcess()

    async def parse(self, request, model: type[BaseModel]) -> BaseModel:
        raw = await request.body()
        if len(raw) <= PARSE_INLINE_BYTES:
            return parse_body(raw, model)
        return await self.process.parse(raw, model)

    def close(self) -> None:
        self.process.close()


def _chunks(values: list) -> list[bytes]:
    """A list of plain values (numbers, strings, lists of them) as marshal chunks of about CHUNK_ITEMS values."""
    out, start, items = [], 0, 0
    for i, v in enumerate(values):
        items += len(v) if isinstance(v, list) else 1
        if items >= CHUNK_ITEMS:
            out.append(marshal.dumps(values[start:i + 1]))
            start, items = i + 1, 0
    if start < len(values):
        out.append(marshal.dumps(values[start:]))
    return out


def _split(model: BaseModel) -> tuple[bytes, dict[str, list[bytes]]]:
    """The model pickled without its long lists of plain values, and those lists as chunks."""
    lists = {}
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, list) and len(value) > 1 and not isinstance(value[0], BaseModel):
            lists[name] = _chunks(value)
            setattr(model, name, [])
    return pickle.dumps(model, protocol=pickle.HIGHEST_PROTOCOL), lists


def _answer(raw: bytes, model: type[BaseModel]) -> bytes:
    try:
        parsed = parse_body(raw, model)
    except APIError as e:
        return pickle.dumps(("error", e.status, e.message, e.param, e.code))
    return pickle.dumps(("ok", *_split(parsed)), protocol=pickle.HIGHEST_PROTOCOL)


def main() -> int:
    given, back = sys.stdin.buffer, sys.stdout.buffer
    while True:
        head = given.read(_HEAD.size)
        if len(head) < _HEAD.size:
            return 0                    # the worker closed the pipe: it is gone
        index, size = _HEAD.unpack(head)
        out = _answer(given.read(size), MODELS[index])
        back.write(_LEN.pack(len(out)) + out)
        back.flush()


class BodyProcess:
    """The worker's side of the parsing process: started on first use (and again if it died), one body at a
    time (a large body waits for the one before it)."""

    def __init__(self):
        self.proc: asyncio.subprocess.Process | None = None
        self.lock = asyncio.Lock()

    async def parse(self, raw: bytes, model: type[BaseModel]) -> BaseModel:
        async with self.lock:
            try:
                if self.proc is None or self.proc.returncode is not None:
                    self.proc = await asyncio.create_subprocess_exec(
                        sys.executable, "-m", "rawinfer.frontends.http.body_parsing", stdin=asyncio.subprocess.PIPE,
                        stdout=asyncio.subprocess.PIPE)
                self.proc.stdin.write(_HEAD.pack(MODELS.index(model), len(raw)))
                self.proc.stdin.write(raw)
                await self.proc.stdin.drain()
                size = _LEN.unpack(await self.proc.stdout.readexactly(_LEN.size))[0]
                answer = pickle.loads(await self.proc.stdout.readexactly(size))
            except (OSError, asyncio.IncompleteReadError) as e:
                self.close()
                raise APIError(500, f"the body parser of this HTTP worker failed ({type(e).__name__}); retry",
                               code="internal_error") from None
        if answer[0] == "error":
            raise APIError(*answer[1:3], param=answer[3], code=answer[4])
        parsed = pickle.loads(answer[1])
        for name, chunks in answer[2].items():
            values: list = []
            for chunk in chunks:
                values.extend(marshal.loads(chunk))
                await asyncio.sleep(0)          # let the loop send other clients' tokens
            setattr(parsed, name, values)
        return parsed

    def close(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.stdin.close()             # it ends at the end of its input
        self.proc = None


if __name__ == "__main__":
    sys.exit(main())
