"""tools/gpu_decode_bench.py runs end to end on the host shim (--shim), so the script a GPU session times the
decode attention kernel with is known to work before a device is lent: every setting agrees with the
former kernel and every (batch, context) row is in the table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

harness = pytest.importorskip("cuda_shim.harness")
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(harness.compiler() is None, reason="no host C++ compiler for the CUDA shim")
def test_decode_bench_runs_on_the_shim(tmp_path):
    proc = subprocess.run([sys.executable, "tools/gpu_decode_bench.py", "--shim", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = (tmp_path / "decode-table.txt").read_text()
    for row in ("batch 1, ctx 40", "batch 1, ctx 100", "batch 3, ctx 40", "batch 3, ctx 100", "today / former"):
        assert row in table, table
    results = json.loads((tmp_path / "decode.json").read_text())
    one = results["batch 1, ctx 100"]
    assert set(one) == {"former", "GC 8, fixed splits", "today", "32 splits"}
    assert one["today"]["splits"] > one["former"]["splits"]  # a long context takes more, shorter splits
    assert all(v["us"] > 0 and v["max_relative_difference"] <= 4e-5 for r in results.values() for v in r.values())
