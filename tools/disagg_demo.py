"""One prefill and one decode instance on this machine, each pinned to its own cores (os.sched_setaffinity),
for demos and benchmarks of prefill/decode disaggregation:

    python tools/disagg_demo.py weights/smollm2-135m-instruct --prefill-cores 0 --decode-cores 1
    rawinfer client --addr tcp://127.0.0.1:5555 "Hello"        (in another shell)

The prefill instance is a subprocess (python -m rawinfer.frontends.disagg.prefill); the decode instance
serves the ZeroMQ client protocol in this process until Ctrl-C, then the prefill instance is stopped.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def cores(text: str) -> set[int]:
    return {int(c) for c in text.split(",") if c.strip()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--bind", default="tcp://127.0.0.1:5555", help="the decode instance's client endpoint")
    p.add_argument("--prefill-bind", default="tcp://127.0.0.1:5560")
    p.add_argument("--prefill-cores", type=cores, default={0})
    p.add_argument("--decode-cores", type=cores, default={1})
    p.add_argument("--kv-cache-memory", default="512MiB")
    p.add_argument("--min-remote-tokens", type=int, default=64)
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s decode %(message)s")
    opts = dict(device="cpu", kv_cache_memory=a.kv_cache_memory)
    prefill = subprocess.Popen(
        [sys.executable, "-m", "rawinfer.frontends.disagg.prefill", a.model, "--bind", a.prefill_bind,
         "--engine", json.dumps({**opts, "num_threads": len(a.prefill_cores)})],
        preexec_fn=lambda: os.sched_setaffinity(0, a.prefill_cores), cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT})
    try:
        os.sched_setaffinity(0, a.decode_cores)
        from rawinfer.engine.engine import LLMEngine
        from rawinfer.frontends.disagg.connector import DecodeConfig, DecodeConnector
        from rawinfer.frontends.server.server import Server, ServerConfig
        engine = LLMEngine(a.model, num_threads=len(a.decode_cores), **opts)
        conn = DecodeConnector(engine, DecodeConfig(prefill=[a.prefill_bind], min_remote_tokens=a.min_remote_tokens))
        logging.info("decode instance on %s (cores %s), prefill instance on %s (cores %s)", a.bind,
                     sorted(a.decode_cores), a.prefill_bind, sorted(a.prefill_cores))
        code = Server(engine, ServerConfig(bind=a.bind), kv_connector=conn).run()
        logging.info("transfers: %s", conn.counters)
        return code
    finally:
        prefill.terminate()
        try:
            prefill.wait(10)
        except subprocess.TimeoutExpired:
            prefill.kill()


if __name__ == "__main__":
    sys.exit(main())
