"""The compile helper's process (compile_helper.py starts it): load the model, wait for the engine's go,
run warmup.helper_wave into its private kernel cache, exit. A module of its own because it imports the
engine, which imports compile_helper.py: in one module the two would import each other."""

from __future__ import annotations

import os
import pickle
import sys


def _die_with(parent: int) -> None:
    """End this process when `parent` ends (Linux: the kernel's parent-death signal); exit now where the
    parent is already gone."""
    import ctypes
    import signal
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)          # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:
        sys.exit(3)


def main() -> None:
    """The helper. On stdin: the length of a pickle, the pickle of (parent pid, model folder, EngineConfig),
    later b"go" once the engine's builds are in this helper's folder (end of input: exit)."""
    stdin = sys.stdin.buffer
    parent, model_dir, config = pickle.loads(stdin.read(int.from_bytes(stdin.read(8), "little")))
    _die_with(parent)
    from rawinfer.engine.engine import LLMEngine
    from rawinfer.engine.warmup import helper_wave
    engine = LLMEngine(model_dir, config)
    if stdin.read(2) == b"go":
        helper_wave(engine)
