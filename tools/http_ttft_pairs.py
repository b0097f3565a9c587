"""Paired TTFT of the two ways into one `rawinfer serve`: the same kind of request (64 prompt tokens, 1 output
token, greedy) sent one at a time, alternately over ZeroMQ and as a streamed HTTP /v1/completions, each with
a fresh last prompt token so no request is a full prefix-cache hit. Prints the medians and the median of the
per-pair difference (HTTP minus ZeroMQ), on the client's clock.

    python tools/http_ttft_pairs.py tcp://127.0.0.1:5555 http://127.0.0.1:8000 [pairs]
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import httpx

from rawinfer.server import Client


def main() -> None:
    zaddr, base = sys.argv[1], sys.argv[2]
    pairs = int(sys.argv[3]) if len(sys.argv) > 3 else 40
    prompt = list(range(1000, 1064))
    z, h = [], []
    with Client(zaddr) as c, httpx.Client(base_url=base, timeout=60) as hc:
        for i in range(pairs):
            t, first = time.monotonic(), None
            for _ in c.generate(prompt[:-1] + [2000 + i], params={"max_tokens": 1, "temperature": 0}):
                first = first or time.monotonic() - t
            z.append(first)
            body = {"prompt": prompt[:-1] + [3000 + i], "max_tokens": 1, "temperature": 0, "stream": True}
            t, first = time.monotonic(), None
            with hc.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        first = first or time.monotonic() - t
            h.append(first)
    diffs = [b - a for a, b in zip(z, h)]
    print(json.dumps({"zmq_ttft_p50_ms": statistics.median(z) * 1e3, "http_ttft_p50_ms": statistics.median(h) * 1e3,
                      "paired_diff_p50_ms": statistics.median(diffs) * 1e3, "pairs": len(diffs)}))


if __name__ == "__main__":
    main()
