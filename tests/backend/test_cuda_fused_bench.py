"""tools/gpu_fused_bench.py runs end to end on the host shim (--shim), so the script a GPU session times the
fused ops and the decode graphs with is known to work before a device is lent: every table row is there."""

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
def test_fused_bench_runs_on_the_shim(tmp_path):
    proc = subprocess.run([sys.executable, "tools/gpu_fused_bench.py", "--shim", "--batches", "1,3",
                           "--kv-cache-memory", "2MiB", "--out", str(tmp_path)], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = (tmp_path / "fused-table.txt").read_text()
    for row in ("fused_rope_kv_write, T=1", "fused_rope_kv_write + q/k norm, T=5", "norm_add_rmsnorm, T=5",
                "decode forward, batch 1", "decode engine step, batch 3", "decode graphs"):
        assert row in table, table
    assert "batch sizes 1, 2, 3 captured" in table
    results = json.loads((tmp_path / "fused.json").read_text())
    assert set(results["decode"]) == {"1", "3"} and all(v > 0 for v in results["decode"]["3"].values())
