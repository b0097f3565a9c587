"""The CPU backend's thread count: the governor's rule on synthetic machine readings, and outputs that do
not depend on how many threads ran them."""

from __future__ import annotations

import pytest

from conftest import _convert_tiny
from rawinfer import LLMEngine, SamplingParams
from rawinfer.backend.cpu.threads import ThreadGovernor, read_machine_busy_seconds


class FakeMachine:
    """A 2-core machine on which this process and others use given shares of the cores."""

    def __init__(self):
        self.t, self.machine_busy, self.own = 0.0, 0.0, 0.0

    def advance(self, seconds: float, own_cores: float, other_cores: float) -> None:
        self.t += seconds
        self.own += own_cores * seconds
        self.machine_busy += (own_cores + other_cores) * seconds

    def governor(self, **kw) -> ThreadGovernor:
        return ThreadGovernor(2, cores=2, interval_s=0.5, machine=lambda: self.machine_busy,
                              process=lambda: self.own, clock=lambda: self.t, **kw)


def test_a_busy_core_takes_a_thread_and_gives_it_back():
    m = FakeMachine()
    g = m.governor()
    m.advance(0.2, own_cores=2.0, other_cores=0.0)
    assert g.update() == 2                          # no reading before the interval has passed
    m.advance(0.4, own_cores=2.0, other_cores=0.0)
    assert g.update() == 2 and g.others == 0.0
    m.advance(0.5, own_cores=1.33, other_cores=0.67)  # a busy process shares a core with a worker
    assert g.update() == 1 and g.others == pytest.approx(0.67)
    for _ in range(3):                              # it keeps its core: stay at one thread
        m.advance(0.5, own_cores=1.0, other_cores=1.0)
        assert g.update() == 1
    m.advance(0.5, own_cores=1.0, other_cores=0.4)  # partly gone: between the thresholds, no change
    assert g.update() == 1
    m.advance(0.5, own_cores=1.0, other_cores=0.1)  # gone
    assert g.update() == 2


def test_short_blips_do_not_flap_and_unreadable_machines_keep_every_thread():
    m = FakeMachine()
    g = m.governor()
    for other in (0.2, 0.5, 0.1, 0.55, 0.0):        # below the 0.6 of a core that costs a thread
        m.advance(0.5, own_cores=2.0 - other, other_cores=other)
        assert g.update() == 2
    blind = ThreadGovernor(2, cores=2, machine=lambda: None)
    assert blind.update() == 2 and blind.threads == 2
    assert read_machine_busy_seconds() is None or read_machine_busy_seconds() > 0


def test_a_thread_goes_after_one_short_interval_and_comes_back_after_a_calm_half_second():
    """The defaults: a request of a hundred decode steps can end within half a second, so a busy core
    costs the thread at the first 0.1 s reading; it comes back only after 0.5 s of readings that all
    allow it, so a single quiet reading between busy ones does not make the pool flap."""
    m = FakeMachine()
    g = ThreadGovernor(2, cores=2, machine=lambda: m.machine_busy, process=lambda: m.own, clock=lambda: m.t)
    m.advance(0.05, own_cores=1.33, other_cores=0.67)
    assert g.update() == 2                          # within the first interval: no reading yet
    m.advance(0.06, own_cores=1.33, other_cores=0.67)
    assert g.update() == 1
    for other in (1.0, 0.1, 1.0, 0.0, 0.2, 0.9):    # calm readings broken by busy ones: stay narrow
        m.advance(0.1, own_cores=1.0, other_cores=other)
        assert g.update() == 1
    for _ in range(4):                              # 0.4 s of calm: not yet
        m.advance(0.1, own_cores=1.0, other_cores=0.05)
        assert g.update() == 1
    m.advance(0.1, own_cores=1.0, other_cores=0.05)
    assert g.update() == 2
    m.advance(0.1, own_cores=1.0, other_cores=1.0)  # and the next busy reading takes it again
    assert g.update() == 1


def test_reset_gives_every_thread_back_and_forgets_the_load_seen_so_far():
    """The warm-up's compile helper is this engine's own process at work: once the warm-up is done the
    governor starts over (every thread, readings from now on), else the first requests after a cold
    start, and a benchmark's ceiling measured right after it, ran on one thread."""
    m = FakeMachine()
    g = m.governor()
    m.advance(0.5, own_cores=1.0, other_cores=1.0)  # the helper compiling beside the engine
    assert g.update() == 1
    assert g.reset() == 2 and g.threads == 2 and g.others == 0.0
    m.advance(0.5, own_cores=2.0, other_cores=0.0)
    assert g.update() == 2


def test_the_cpu_backend_takes_every_thread_back_after_the_warm_up():
    import numba
    from rawinfer.backend.cpu.backend import CPUBackend
    be = CPUBackend()
    if be.max_threads < 2 or be._governor is None:
        pytest.skip("one core: nothing to narrow")
    numba.set_num_threads(1)                        # as the governor leaves it while the helper compiles
    be.threads = be._governor.threads = 1
    be.after_warm_up()
    assert numba.get_num_threads() == be.threads == be.max_threads == be._governor.threads


@pytest.mark.parametrize("quant", [None, "int8", "q4"])
def test_outputs_do_not_depend_on_the_thread_count(tmp_path_factory, quant):
    """The same greedy tokens and the same scored logits with one thread running and with two, for every
    weight format: the governor may narrow the pool at any step, and work is split the same way
    whatever the current count (into parts of the pool's full size)."""
    import numba
    model = _convert_tiny(tmp_path_factory, "tiny-llama", quant=quant)
    prompts = [[5, 6, 7], list(range(3, 60)), [9, 9, 4, 2, 7], list(range(100, 110))]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    engine = LLMEngine(model, device="cpu", kv_cache_memory="8MiB", max_num_batched_tokens=256)
    be = engine.backend
    if be.max_threads < 2:
        pytest.skip("one core: nothing to narrow")
    be._governor = None
    results = []
    for threads in (2, 1, 2):
        numba.set_num_threads(threads)
        be.threads = threads
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        tokens = {f"r{i}": [] for i in range(len(prompts))}
        while engine.has_unfinished():
            for o in engine.step():
                tokens[o.request_id] += o.new_token_ids
        engine.block_manager.reset_prefix_cache()
        results.append((tokens, engine.score(list(range(3, 40)), [30, 1, 1, 1, 1, 1, 1, 1])))
    numba.set_num_threads(be.max_threads)
    for tokens, logits in results[1:]:
        assert tokens == results[0][0]
        assert (logits == results[0][1]).all()


def test_a_default_engine_takes_every_core_whatever_an_earlier_one_set():
    """The pool's size (and with it how work is split) is the machine's, not what an earlier backend of
    this process (a --threads 1 engine, or a narrowed governor) left in Numba's setting."""
    import numba

    from rawinfer.backend.cpu.backend import CPUBackend
    CPUBackend(num_threads=1)
    assert numba.get_num_threads() == 1
    again = CPUBackend()
    assert again.max_threads == numba.config.NUMBA_NUM_THREADS == numba.get_num_threads()
