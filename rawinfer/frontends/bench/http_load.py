"""`rawinfer bench serve --backend openai`: the same open-loop load as the ZeroMQ benchmark, sent to an
OpenAI-compatible HTTP server (`rawinfer serve`'s, or any other) as streamed /v1/completions requests.

Each request sends its prompt as token ids with `max_tokens`, greedy, end-of-sequence ignored, and asks for
the usage chunk; each SSE chunk with text counts as one token message (the server sends one per engine
chunk), and the usage chunk gives the true number of output tokens. /metrics is polled for the figure's
running / waiting / KV lines.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx


_timeout = getattr(asyncio, "timeout", None)


def headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def model_card(client: httpx.AsyncClient) -> dict:
    """The first model of GET /v1/models (its id, max_model_len, vocab_size where the server gives them)."""
    r = await client.get("/v1/models")
    r.raise_for_status()
    return r.json()["data"][0]


async def one_request(base_url: httpx.URL, api_key: str | None, model: str, rec, prompt: list[int], delay: float,
                      t0: float, bar, timeout: float) -> None:
    await asyncio.sleep(max(0.0, t0 + delay - time.monotonic()))
    rec.sent = time.monotonic() - t0
    body = {"model": model, "prompt": [int(t) for t in prompt], "max_tokens": rec.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    post = StreamedPost(base_url, "/v1/completions", headers(api_key), timeout)
    try:
        status = await post.send(body)
        if status != 200:
            rec.error = f"HTTP {status}: {b''.join([b async for b in post.body()]).decode(errors='replace')[:200]}"
        else:
            await _read(post, rec, t0)
    except (OSError, EOFError, ValueError, IndexError, asyncio.LimitOverrunError, asyncio.TimeoutError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    finally:
        post.close()
    if rec.finished is None:
        rec.finished = time.monotonic() - t0
    bar.update(1)


class StreamedPost:
    """One streamed POST on a connection of its own (HTTP/1.1, `Connection: close`), its response body read
    as it arrives with the chunked transfer coding undone. The load generator shares the machine with the
    server it measures: httpx reads each event through h11 and several decoding layers in Python, which cost
    the server a share of the cores it did not cost over ZeroMQ; this reads a whole socket buffer at once.
    Each read waits at most `timeout` seconds."""

    def __init__(self, base: httpx.URL, path: str, headers: dict, timeout: float):
        self.base, self.path, self.headers, self.timeout = base, path, headers, timeout
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self._chunked, self._left, self._buf = False, None, b""

    async def send(self, body: dict) -> int:
        """Connect, send `body` as JSON, read the response's head; returns its status."""
        tls = self.base.scheme == "https"
        self.reader, self.writer = await asyncio.wait_for(asyncio.open_connection(
            self.base.host, self.base.port or (443 if tls else 80), ssl=tls or None), min(self.timeout, 10.0))
        payload = json.dumps(body).encode()
        target = self.base.raw_path.rstrip(b"/") + self.path.encode()
        head = [b"POST " + target + b" HTTP/1.1", b"Host: " + self.base.netloc, b"Content-Type: application/json",
                b"Content-Length: %d" % len(payload), b"Connection: close",
                *(f"{k}: {v}".encode("latin-1") for k, v in self.headers.items())]
        self.writer.write(b"\r\n".join(head) + b"\r\n\r\n" + payload)
        status, *lines = (await self._within(self.reader.readuntil(b"\r\n\r\n"))).decode("latin-1").split("\r\n")
        fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines if line)}
        self._chunked = "chunked" in fields.get("transfer-encoding", "").lower()
        self._left = None if self._chunked or "content-length" not in fields else int(fields["content-length"])
        return int(status.split()[1])

    async def body(self):
        """The body's bytes as they arrive (the chunks' data, without their framing)."""
        while True:
            if self._left == 0:
                return
            data = await self._within(self.reader.read(1 << 16))
            if not data:
                if self._chunked or self._left:
                    raise EOFError("the server closed the connection inside the response body")
                return
            if not self._chunked:
                self._left = None if self._left is None else self._left - len(data)
                yield data
                continue
            self._buf += data
            out = []
            while (end := self._buf.find(b"\r\n")) >= 0:
                size = int(self._buf[:end].split(b";")[0], 16)
                if size == 0:
                    self._left = 0
                    break
                if len(self._buf) < end + 2 + size + 2:
                    break
                out.append(self._buf[end + 2:end + 2 + size])
                self._buf = self._buf[end + 2 + size + 2:]
            if out:
                yield b"".join(out)

    async def _within(self, awaitable):
        if _timeout is None:                          # Python 3.10
            return await asyncio.wait_for(awaitable, self.timeout)
        async with _timeout(self.timeout):            # no task per read, as wait_for makes one
            return await awaitable

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def _read(post: StreamedPost, rec, t0: float) -> None:
    """Each event's `data:` lines, as they arrive (events end with a blank line, lines in LF or CRLF)."""
    pending = b""
    async for data in post.body():
        now = time.monotonic() - t0
        events = (pending + data).replace(b"\r\n", b"\n").split(b"\n\n")
        pending = events.pop()
        for ev in events:
            for line in ev.split(b"\n"):
                if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                    _event(json.loads(line[5:]), rec, now)


def _event(msg: dict, rec, now: float) -> None:
    if "error" in msg:
        rec.error = msg["error"].get("message", "error")
        return
    for c in msg.get("choices") or ():
        if c.get("text"):
            rec.token_times.append(now)
            rec.message_times.append(now)
        if c.get("finish_reason"):
            rec.finished, rec.finish_reason = now, c["finish_reason"]
    if msg.get("usage"):
        rec.output_tokens = msg["usage"]["completion_tokens"]


KV_USAGE = "rawinfer:kv_cache_usage_perc"          # a fraction per replica: averaged, where the rest add up
GAUGES = (KV_USAGE, "rawinfer:num_requests_running", "rawinfer:num_requests_waiting",
          "rawinfer:generation_tokens_total")


def _gauges(text: str) -> dict:
    """The figure's series from a /metrics page: the requests and generated tokens added up over the
    samples (one per replica behind a router), the KV usage their mean. Read line by line rather than
    through a Prometheus parser, which spends more of the shared cores on the whole page's histograms
    than the load does."""
    values: dict[str, list[float]] = {}
    for line in text.splitlines():
        if line.startswith(GAUGES):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in GAUGES:
                values.setdefault(name, []).append(float(line.rsplit(" ", 1)[1]))
    return {name: (sum(v) / len(v) if name == KV_USAGE else sum(v)) for name, v in values.items()}


def metrics_sample(g: dict, t: float, previous: dict | None) -> dict:
    """One point of the figure's server lines; the server's output rate from the generated-token counter's
    growth since the previous point (None for the first, or for a server without the counter)."""
    total, rate = g.get("rawinfer:generation_tokens_total"), None
    if total is not None and previous is not None and previous["tokens"] is not None and t > previous["t"]:
        rate = max(0.0, total - previous["tokens"]) / (t - previous["t"])
    return {"t": t, "kv_usage": g.get(KV_USAGE),
            "running": g.get("rawinfer:num_requests_running"), "waiting": g.get("rawinfer:num_requests_waiting"),
            "server_tokens_per_s": rate, "tokens": total}


async def spec_totals(client: httpx.AsyncClient) -> dict | None:
    """The server's spec_decode counters from one /metrics page (speculative.totals_from_metrics); None when
    it does not speculate or the page cannot be read."""
    from rawinfer.frontends.bench.speculative import totals_from_metrics
    try:
        r = await client.get("/metrics")
    except httpx.HTTPError:
        return None
    return totals_from_metrics(r.text) if r.status_code == 200 else None


async def poll_metrics(client: httpx.AsyncClient, t0: float, interval: float, samples: list[dict],
                       stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            r = await client.get("/metrics")
            if r.status_code == 200:
                samples.append(metrics_sample(_gauges(r.text), time.monotonic() - t0, samples[-1] if samples else None))
        except (httpx.HTTPError, ValueError):
            pass
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except asyncio.TimeoutError:
            pass
