"""Soak test of `rawinfer serve`: normal traffic mixed with every hostile behaviour of issue 16, for a bounded
time, then checks that the server stayed whole.

    .venv/bin/python tools/soak.py --minutes 10 [--model weights/smollm2-135m-instruct] [--json out.json]

Behaviours, each on its own thread until the time is up: streaming and non-streaming requests (some with
n > 1 and many stop strings), aborts mid-stream, clients SIGKILLed mid-stream, clients frozen (SIGSTOP)
until the server cuts them off, prompts far over the context (refused before tokenising), messages over
the size limit (the connection dropped), fuzzed bytes, and a stats poller timing every reply. Canary
prompts run greedily at the start and again every so often: their output must not change.

Checks at the end (exit status 1 if any fails): every request ended and is accounted for (received =
rejected + completed + aborted because the client went away, nothing in flight or unconfirmed), no KV
block left in use, the server's RSS after the run within --rss-growth of what it was after warm-up, every
canary identical, the server still answering and stopping cleanly on SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import msgpack
import zmq

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rawinfer.frontends.server import protocol as P  # noqa: E402
from rawinfer.frontends.client.client import Client, ClientError  # noqa: E402

CANARIES = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):",
            "List three primary colours:"]
GREEDY = {"temperature": 0.0, "max_tokens": 24}

CHILD = """
import sys, time
from rawinfer.frontends.client.client import Client
c = Client(sys.argv[1], timeout_s=120)
its = [c.generate("Tell me a long story about a lighthouse keeper.", params={"max_tokens": 200,
       "temperature": 0.8, "ignore_eos": True}, stream=i % 2 == 0) for i in range(3)]
next(its[0])
print("running", flush=True)
time.sleep(600)
"""


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class Soak:
    def __init__(self, addr: str, deadline: float, seed: int):
        self.addr, self.deadline = addr, deadline
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.counts: dict[str, int] = {}
        self.failures: list[str] = []
        self.stats_rtt: list[float] = []
        self.canary_ref: list[list[int]] = []

    def note(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + n

    def fail(self, what: str) -> None:
        with self.lock:
            self.failures.append(what)

    def running(self) -> bool:
        return time.monotonic() < self.deadline

    # ---- behaviours -------------------------------------------------------------------------------------
    def canaries(self) -> list[list[int]]:
        with Client(self.addr, timeout_s=120) as c:
            return [c.complete(messages=[{"role": "user", "content": p}], params=GREEDY).token_ids for p in CANARIES]

    def canary_loop(self) -> None:
        while self.running():
            got = self.canaries()
            self.note("canary_rounds")
            if got != self.canary_ref:
                self.fail(f"canary output changed: {got} vs {self.canary_ref}")
            self._sleep(20)

    def normal(self, k: int) -> None:
        rng = random.Random(k)
        with Client(self.addr, timeout_s=120) as c:
            while self.running():
                params = {"max_tokens": rng.randint(4, 96), "temperature": rng.choice([0.0, 0.7, 1.0]),
                          "seed": rng.randint(0, 999)}
                if rng.random() < 0.2:
                    params["n"] = rng.randint(2, 4)
                if rng.random() < 0.1:
                    params["stop"] = [f"zq{i}x" for i in range(2000)]
                prompt = f"Question {rng.randint(0, 10**6)}: say something about the number {rng.randint(0, 99)}."
                try:
                    msgs = list(c.generate(prompt, params=params, stream=rng.random() < 0.7))
                except ClientError as e:
                    self.fail(f"normal request failed: {e}")
                    continue
                finals = [m for m in msgs if isinstance(m, P.Final)]
                if len(finals) != params.get("n", 1):
                    self.fail(f"{len(finals)} finals for n={params.get('n', 1)}")
                self.note("normal_completed")

    def aborter(self) -> None:
        with Client(self.addr, timeout_s=120) as c:
            while self.running():
                it = c.generate("Count from one to a thousand.", params={"max_tokens": 300, "ignore_eos": True})
                for i, _ in enumerate(it):
                    if i >= self.rng.randint(1, 20):
                        break
                it.close()
                self.note("aborted_by_client")

    def killer(self, freeze: bool) -> None:
        while self.running():
            proc = subprocess.Popen([sys.executable, "-c", CHILD, self.addr], stdout=subprocess.PIPE, text=True,
                                    env={**os.environ, "PYTHONPATH": ROOT})
            try:
                proc.stdout.readline()
                proc.send_signal(signal.SIGSTOP if freeze else signal.SIGKILL)
                if freeze:
                    self._sleep(8)                  # long enough for the server to cut it off
                self.note("clients_frozen" if freeze else "clients_killed")
            finally:
                proc.kill()
                proc.wait(30)
            self._sleep(1)

    def hostile(self) -> None:
        ctx = zmq.Context.instance()
        huge = ("lorem ipsum dolor sit amet " * 40000)[:900_000]
        while self.running():
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.addr)
            try:
                kind = self.rng.choice(["huge", "oversized", "fuzz"])
                if kind == "huge":
                    sock.send(P.encode(P.Generate("huge", prompt=huge, params={"max_tokens": 4})))
                    if not sock.poll(30_000) or P.decode_reply(sock.recv()).code != "rejected":
                        self.fail("a huge prompt was not refused promptly")
                elif kind == "oversized":
                    sock.send(msgpack.packb({"v": 1, "type": "generate", "request_id": "big",
                                             "prompt": "x" * (2 << 20)}))
                    time.sleep(0.2)
                else:
                    for _ in range(20):
                        sock.send(self.rng.randbytes(self.rng.randrange(1, 300)))
                    got = 0
                    while got < 20 and sock.poll(10_000):
                        sock.recv()
                        got += 1
                    if got != 20:
                        self.fail(f"{got} replies to 20 fuzzed messages")
                self.note(f"hostile_{kind}")
            finally:
                sock.close()
            self._sleep(1)

    def poller(self) -> None:
        with Client(self.addr, timeout_s=120) as c:
            while self.running():
                t0 = time.monotonic()
                c.stats()
                with self.lock:
                    self.stats_rtt.append(time.monotonic() - t0)
                time.sleep(0.25)

    def _sleep(self, s: float) -> None:
        time.sleep(max(0.0, min(s, self.deadline - time.monotonic())))


def settled(addr: str, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    with Client(addr, timeout_s=60) as c:
        while True:
            s = c.stats()
            if (s["requests_in_flight"] == 0 and s["finals_unconfirmed"] == 0) or time.monotonic() > deadline:
                return s
            time.sleep(0.2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="how long the mixed load runs (default: 10)")
    ap.add_argument("--model", default=os.path.join(ROOT, "weights", "smollm2-135m-instruct"))
    ap.add_argument("--kv-cache-memory", default="128MiB")
    ap.add_argument("--normal-clients", type=int, default=4)
    ap.add_argument("--rss-growth", type=float, default=1.25, help="allowed RSS end / after warm-up (default 1.25)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the result here")
    args = ap.parse_args()

    folder = tempfile.mkdtemp(prefix="rawinfer-soak-")
    addr = f"ipc://{folder}/serve.sock"
    log_path = os.path.join(folder, "serve.log")
    server = subprocess.Popen([sys.executable, "-m", "rawinfer", "serve", "--model", args.model, "--bind", addr,
                               "--device", "cpu", "--kv-cache-memory", args.kv_cache_memory,
                               "--client-timeout", "2", "--heartbeat-interval", "0.5", "--no-http"],
                              stdout=open(log_path, "w"), stderr=subprocess.STDOUT, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": ROOT})
    try:
        with Client(addr, timeout_s=1.0) as c:
            for _ in range(300):
                try:
                    c.ping()
                    break
                except ClientError:
                    if server.poll() is not None:
                        raise SystemExit(f"the server exited:\n{open(log_path).read()}")
        t_start = time.monotonic()
        soak = Soak(addr, t_start + args.minutes * 60, args.seed)
        soak.canary_ref = soak.canaries()
        rss_warm = rss_kb(server.pid)
        jobs = [soak.canary_loop, soak.aborter, soak.hostile, soak.poller, lambda: soak.killer(False),
                lambda: soak.killer(True)] + [lambda k=k: soak.normal(k) for k in range(args.normal_clients)]
        threads = [threading.Thread(target=j, daemon=True) for j in jobs]
        for t in threads:
            t.start()
        rss_peak = rss_warm
        while soak.running():
            time.sleep(5)
            rss_peak = max(rss_peak, rss_kb(server.pid))
        for t in threads:
            t.join(180)
        s = settled(addr)
        final_canaries = soak.canaries()
        rss_end = rss_kb(server.pid)
        s = settled(addr)
        server.send_signal(signal.SIGTERM)
        code = server.wait(60)
        result = {
            "minutes": args.minutes, "model": os.path.basename(os.path.normpath(args.model)),
            "behaviours": soak.counts, "failures": soak.failures[:20], "num_failures": len(soak.failures),
            "server": {k: s[k] for k in ("requests_received", "requests_rejected", "requests_completed",
                                         "requests_aborted_by_client", "requests_aborted_vanished",
                                         "clients_vanished", "messages_invalid", "requests_in_flight",
                                         "finals_unconfirmed", "kv_blocks_used", "tokens_generated")},
            "rss_mb": {"after_warmup": rss_warm / 1024, "peak": rss_peak / 1024, "end": rss_end / 1024},
            "stats_reply_s": {"max": max(soak.stats_rtt, default=0.0),
                              "p50": sorted(soak.stats_rtt)[len(soak.stats_rtt) // 2] if soak.stats_rtt else 0.0},
            "exit_code": code,
        }
        checks = {
            "no failures during the run": not soak.failures,
            "every request accounted for": s["requests_in_flight"] == 0 and s["finals_unconfirmed"] == 0 and
            s["requests_received"] == s["requests_rejected"] + s["requests_completed"] + s["requests_aborted_vanished"],
            "no KV block leaked": s["kv_blocks_used"] == 0,
            "RSS bounded": rss_end <= rss_warm * args.rss_growth,
            "canaries unchanged": final_canaries == soak.canary_ref,
            "clean exit on SIGTERM": code == 0,
        }
        result["checks"] = checks
        print(json.dumps(result, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        return 0 if all(checks.values()) else 1
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(30)
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
