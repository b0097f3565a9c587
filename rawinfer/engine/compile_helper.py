"""A second process that compiles part of the warm-up's kernels while the engine compiles the rest.

Numba compiles on one thread, so a cold warm-up (an empty kernel cache: a new version, a new machine)
leaves every other core idle for about a minute. When the engine's own process starts compiling, it
starts this helper: a fresh interpreter that loads the same model with the same engine options. Once
the engine's first step (a short prefill) has built the kernels every prefill shares, the engine copies
its kernel cache into the helper's folder and lets it run the prefills of the warm-up's second wave (a
long prompt, a middling one, beside a sequence decoding), while the engine runs the rest of the first
wave (one and two sequences decoding: the fused decode kernel, the largest build). Before its second
wave the engine waits for the helper, copies the builds it made into the user's kernel cache
(backend/cpu/cache.py `merge`) and goes on: the second wave loads them instead of compiling them.
Whatever the helper missed, the engine compiles as before, so a helper that fails, is slow or is killed
costs time, never a result.

The helper writes only its own private folder: Numba's cache index is read, changed and written back
by whichever process saves a build, so two processes filling one folder at once could lose entries.
It is used only where it can help: the CPU backend with its kernel cache, a model folder to load again,
two or more cores and threads (`--threads 1` keeps the engine to one core, the helper included), and
the memory for a second copy of the weights.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time

log = logging.getLogger("rawinfer")

HELPER_KV_BLOCKS = 32           # the helper's KV pool: enough for its requests (warmup.helper_wave)
MEMORY_MARGIN = 512 << 20       # bytes the helper's interpreter, Numba and the page cache need beyond its pool
FOLDER_PREFIX = "rawinfer-compile-"   # the helper's private folder: <tmp>/rawinfer-compile-<engine pid>-<random>
WAIT_S = 600.0                  # longest wait for the helper before the engine compiles its part itself


def why_not(engine, cores: int | None = None, memory: int | None = None) -> str | None:
    """Why no helper would help this engine's warm-up, or None where one would. cores / memory: the
    machine's (None: read them)."""
    from rawinfer.backend.cpu.threads import available_cores
    from rawinfer.exec.memory import available_host_memory
    backend = engine.backend
    if backend.name != "cpu" or backend.kernel_cache is None:
        return "no CPU kernel cache to share"
    if not engine.model_dir or not os.path.isdir(engine.model_dir):
        return "no model folder to load again"
    cores = available_cores() if cores is None else cores
    if cores < 2 or backend.max_threads < 2:
        return "one core or thread"
    pool = engine.pool
    need = pool.weight_bytes + pool.workspace_bytes + HELPER_KV_BLOCKS * _block_bytes(engine) + MEMORY_MARGIN
    memory = available_host_memory() if memory is None else memory
    if memory is None or memory < need:
        return f"not enough free memory for a second copy of the model ({need >> 20} MiB)"
    return None


def _block_bytes(engine) -> int:
    """Bytes of one KV block of this engine's pool (every layer's K and V)."""
    from rawinfer.exec.memory import kv_bytes_per_block
    return kv_bytes_per_block(engine.model_config, engine.config.block_size, engine.pool.kv.k[0].dtype)


class CompileHelper:
    """The engine's side: start the helper process, wait for it, take its builds."""

    def __init__(self, engine):
        self.engine = engine
        self.proc: subprocess.Popen | None = None
        self.root: str | None = None        # the helper's cache root
        self.folder: str | None = None      # its kernel folder (backend/cpu/cache.py kernel_dir)
        self.t0 = 0.0
        self.released = False       # release() came before start(): start releases it at once

    def start(self) -> None:
        """Start the helper (once): it loads the model, then waits for `release`."""
        if self.proc is not None:
            return
        from rawinfer.backend.cpu import cache as cpu_cache
        e = self.engine
        remove_orphans()
        self.root = tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-")
        self.folder = cpu_cache.kernel_dir(self.root)
        config = dataclasses.replace(e.config, cache_dir=self.root, warmup=False,
                                     kv_cache_memory=HELPER_KV_BLOCKS * _block_bytes(e))
        payload = pickle.dumps((os.getpid(), os.path.abspath(e.model_dir), config))
        out = open(os.path.join(self.root, "helper.log"), "wb")
        try:
            # cwd: its own folder, so an engine whose working folder was deleted can still start it
            self.proc = subprocess.Popen(helper_command(), stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                                         cwd=self.root)
            self.proc.stdin.write(len(payload).to_bytes(8, "little") + payload)
            self.proc.stdin.flush()
        except OSError as err:
            log.warning("compile helper did not start (%s): the warm-up compiles everything itself", err)
            self.close()
            return
        finally:
            out.close()
        self.t0 = time.monotonic()
        log.info("compiling in two processes: a helper (pid %d) builds the long prompts' kernels", self.proc.pid)
        if self.released:
            self.released = False
            self.release()

    def release(self) -> None:
        """Let the helper compile: first copy into its folder what the engine's kernel cache holds now
        (the builds every prefill shares, which the engine's first step made), so it builds only the
        rest. Called between steps, while nothing writes the cache; before `start`, start does it."""
        if self.proc is None:
            self.released = True
            return
        try:
            shutil.copytree(self.engine.backend.kernel_cache, self.folder, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("*.tmp.*"))
        except OSError as err:
            log.warning("compile helper gets no copy of the kernel cache (%s): it compiles those kernels too", err)
        self._close_stdin(b"go")

    def _close_stdin(self, last: bytes = b"") -> None:
        """Write `last` to the helper and end its input; where it has ended already, finish() says how."""
        try:
            if not self.proc.stdin.closed:
                self.proc.stdin.write(last)
                self.proc.stdin.close()
        except OSError:                         # a broken pipe: the helper is gone
            pass

    def finish(self, wait_s: float = WAIT_S) -> int:
        """Wait for the helper, copy its builds into the engine's kernel cache; returns how many."""
        if self.proc is None:
            return 0
        from rawinfer.backend.cpu import cache as cpu_cache
        merged = 0
        try:
            self._close_stdin()                     # never released: it reads the end of its input and exits
            rc = self.proc.wait(timeout=wait_s)
            if rc == 0:
                try:
                    merged = cpu_cache.merge(self.folder, self.engine.backend.kernel_cache)
                except (AttributeError, TypeError) as err:      # a Numba whose cache internals merge misses
                    raise OSError(f"cannot read this Numba's kernel cache: {err}") from err
                log.info("compile helper done in %.1f s: %d builds taken into the kernel cache",
                         time.monotonic() - self.t0, merged)
            else:
                log.warning("compile helper failed (exit status %s; its log ends: %s): the warm-up compiles its "
                            "part itself", rc, self._log_tail())
        except subprocess.TimeoutExpired:
            log.warning("compile helper still running after %.0f s: stopped; the warm-up compiles its part itself",
                        wait_s)
        except OSError as err:
            log.warning("compile helper's builds not taken (%s): the warm-up compiles its part itself", err)
        finally:
            self.close()
        return merged

    def close(self) -> None:
        """Stop the helper if it still runs and delete its folder."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = self.folder = None

    def _log_tail(self) -> str:
        try:
            with open(os.path.join(self.root, "helper.log"), "rb") as f:
                lines = f.read().decode(errors="replace").strip().splitlines()
            return lines[-1] if lines else "(empty)"
        except OSError:
            return "(no log)"


def remove_orphans(parent: str | None = None) -> None:
    """Delete the helper folders (FOLDER_PREFIX<engine pid>-*, in `parent` or the temporary folder) whose
    engine process is gone: an engine killed outright has no chance to delete its own."""
    import glob
    for path in glob.glob(os.path.join(parent or tempfile.gettempdir(), FOLDER_PREFIX + "*")):
        pid = os.path.basename(path)[len(FOLDER_PREFIX):].split("-")[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:                         # alive, another user's: not ours to delete
            pass


def helper_command() -> list[str]:
    """The helper's command line: this interpreter, importing rawinfer from where this process did (a
    checkout run in place, an installed package), ahead of anything in the working folder."""
    home = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # above rawinfer/
    return [sys.executable, "-c", f"import sys; sys.path.insert(0, {home!r}); "
            "from rawinfer.engine.compile_child import main; main()"]
