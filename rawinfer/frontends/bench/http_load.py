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


def headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def model_card(client: httpx.AsyncClient) -> dict:
    """The first model of GET /v1/models (its id, max_model_len, vocab_size where the server gives them)."""
    r = await client.get("/v1/models")
    r.raise_for_status()
    return r.json()["data"][0]


async def one_request(client: httpx.AsyncClient, model: str, rec, prompt: list[int], delay: float, t0: float,
                      bar) -> None:
    await asyncio.sleep(max(0.0, t0 + delay - time.monotonic()))
    rec.sent = time.monotonic() - t0
    body = {"model": model, "prompt": [int(t) for t in prompt], "max_tokens": rec.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                rec.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
            else:
                await _read(r, rec, t0)
    except httpx.HTTPError as e:
        rec.error = f"{type(e).__name__}: {e}"
    if rec.finished is None:
        rec.finished = time.monotonic() - t0
    bar.update(1)


async def _read(r: httpx.Response, rec, t0: float) -> None:
    async for line in r.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        now = time.monotonic() - t0
        msg = json.loads(line[6:])
        if "error" in msg:
            rec.error = msg["error"].get("message", "error")
            continue
        for c in msg.get("choices") or ():
            if c.get("text"):
                rec.token_times.append(now)
                rec.message_times.append(now)
            if c.get("finish_reason"):
                rec.finished, rec.finish_reason = now, c["finish_reason"]
        if msg.get("usage"):
            rec.output_tokens = msg["usage"]["completion_tokens"]


def _gauges(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = s.value
    return out


async def poll_metrics(client: httpx.AsyncClient, t0: float, interval: float, samples: list[dict],
                       stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            r = await client.get("/metrics")
            if r.status_code == 200:
                g = _gauges(r.text)
                samples.append({"t": time.monotonic() - t0, "kv_usage": g.get("rawinfer:kv_cache_usage_perc"),
                                "running": g.get("rawinfer:num_requests_running"),
                                "waiting": g.get("rawinfer:num_requests_waiting"), "server_tokens_per_s": None})
        except (httpx.HTTPError, ValueError):
            pass
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except asyncio.TimeoutError:
            pass
