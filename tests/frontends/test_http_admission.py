"""The HTTP workers' Gate (admission.py) on its own event loop: capacity kept, the waiting client holding the
fewest generations admitted first, a client's waiting room bounded with 429, and a job that leaves while
waiting (its client gone, its task cancelled) taking nothing with it."""

from __future__ import annotations

import asyncio

import pytest

from rawinfer.frontends.http.admission import Gate
from rawinfer.frontends.http.errors import APIError


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


async def _settle():
    for _ in range(5):
        await asyncio.sleep(0)


def test_capacity_is_kept_and_the_client_holding_least_goes_first():
    async def main():
        gate = Gate(capacity=20)
        order: list[str] = []

        async def job(client, size, name):
            t = await gate.enter(client, size)
            order.append(name)
            return t

        a1 = await job("a", 16, "a1")
        flood = [asyncio.create_task(job("a", 16, f"a{i}")) for i in range(2, 5)]
        await _settle()
        assert gate.used == 16 and order == ["a1"]          # a2.. wait: 16 + 16 > 20
        b1 = await job("b", 2, "b1")                         # b holds less than a and fits: ahead of a's queue
        assert order == ["a1", "b1"] and gate.used == 18
        b2 = asyncio.create_task(job("b", 3, "b2"))         # 18 + 3 > 20: waits, first in line (b holds 2 < 16)
        await _settle()
        a1.release()                                        # a holds 0 < b's 2 now: a2 goes first
        await _settle()
        assert order == ["a1", "b1", "a2"] and gate.used == 18
        b1.release()                                        # b holds 0 < a's 16: b2, though a3 waited longer
        await _settle()
        assert order == ["a1", "b1", "a2", "b2"] and gate.used == 19
        (await b2).release()
        (await flood[0]).release()                          # a2
        (await flood[1]).release()
        (await flood[2]).release()
        assert order[4:] == ["a3", "a4"]
        assert gate.used == 0 and not gate.queues and not gate.held and not gate.waiting
    _run(main())


def test_a_job_larger_than_the_capacity_runs_alone():
    async def main():
        gate = Gate(capacity=4)
        big = await gate.enter("a", 10)
        small = asyncio.create_task(gate.enter("b", 1))
        await _settle()
        assert not small.done()
        big.release()
        (await small).release()
        assert gate.used == 0
    _run(main())


def test_a_clients_waiting_room_is_bounded():
    async def main():
        gate = Gate(capacity=2, max_waiting_per_client=3)
        held = await gate.enter("a", 2)
        waiting = asyncio.create_task(gate.enter("a", 2))
        await _settle()
        with pytest.raises(APIError) as e:
            await gate.enter("a", 2)                         # 2 waiting + 2 > 3
        assert e.value.status == 429 and "waiting" in e.value.message
        other = asyncio.create_task(gate.enter("b", 2))      # another client has a waiting room of its own
        await _settle()
        held.release()                                       # a and b hold nothing: the older job first
        (await waiting).release()
        (await other).release()
        assert gate.used == 0 and not gate.queues
    _run(main())


def test_a_job_that_leaves_while_waiting_takes_nothing_with_it():
    async def main():
        gate = Gate(capacity=1)
        held = await gate.enter("a", 1)
        gone = asyncio.Event()

        async def client_gone() -> bool:
            return gone.is_set()

        left = asyncio.create_task(gate.enter("b", 1, client_gone))
        cancelled = asyncio.create_task(gate.enter("c", 1))
        await _settle()
        assert gate.waiting == {"b": 1, "c": 1}
        gone.set()
        assert await left is None                            # noticed within a poll
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        assert not gate.queues and not gate.waiting
        held.release()
        assert gate.used == 0 and not gate.held
        again = await gate.enter("d", 1)                     # at once: nobody waits
        again.release()
    _run(main())
