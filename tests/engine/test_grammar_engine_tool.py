"""tools/compare_grammar_engines.py stays runnable: a short run with llguidance alone (xgrammar is optional)
checks its own masks and answers and writes its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import ROOT


def test_compare_grammar_engines_short_run(smollm2_dir, tmp_path):
    out = tmp_path / "engines.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "compare_grammar_engines.py"), "--model",
                        smollm2_dir, "--engines", "llguidance", "--steps", "8", "--reps", "1", "--batch", "4",
                        "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "llguidance" in r.stdout
    data = json.loads(out.read_text())
    assert data, "no results written"
