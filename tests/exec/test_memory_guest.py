"""A second model's pool inside the first one's arena (MemoryPool(guest=...) and MemoryPool(region=...)): the room
the host leaves is exactly what the guest carves, the shared KV region gives both models the same number of tokens,
nothing overlaps, and a GPU-sized pool takes the guest out of its budget before its own KV."""

from __future__ import annotations

import numpy as np
import pytest

from rawinfer.backend.cpu.backend import CPUBackend
from rawinfer.config import EngineConfig
from rawinfer.exec.memory import MemoryPool, kv_bytes_per_block
from tests.exec.test_model_runner import MIB, FakeGPU, tiny_config

# the draft: a smaller model of the same vocabulary (fewer layers, kv heads and a wider head than the host)
DRAFT = dict(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=24, hidden_size=48, intermediate_size=72)


def _pair(block_size: int, kv_bytes: int | None, host_graphs: bool, guest_graphs: bool, backend=None):
    backend = backend or CPUBackend()
    ecfg = EngineConfig(max_num_batched_tokens=40, max_num_seqs=6, block_size=block_size, kv_cache_memory=kv_bytes,
                        gpu_memory_utilization=0.5)
    host_cfg, guest_cfg = tiny_config(), tiny_config(**DRAFT)
    request = MemoryPool.guest_request(guest_cfg, ecfg, backend, padding_block=guest_graphs, owner="draft")
    host = MemoryPool(host_cfg, ecfg, backend, padding_block=host_graphs, guest=request)
    guest = MemoryPool(guest_cfg, ecfg, backend, padding_block=guest_graphs, kv_bytes=host.guest_kv_bytes,
                       region=host.guest_region)
    return host, guest


def _span(view) -> tuple[int, int]:
    start = view.__array_interface__["data"][0]
    return start, start + view.nbytes


@pytest.mark.parametrize("block_size,host_graphs,guest_graphs", [(16, False, False), (5, True, False),
                                                                 (7, False, True), (3, True, True)])
def test_the_guest_carves_exactly_the_room_its_host_left(block_size, host_graphs, guest_graphs):
    kv = 3 * MIB + 12345                                  # not a multiple of any block
    host, guest = _pair(block_size, kv, host_graphs, guest_graphs)
    assert host.guest.owner == "draft"
    assert host.kv.num_blocks == guest.kv.num_blocks >= 1           # the same tokens in both
    assert (host.kv.padding_block is not None) == host_graphs and (guest.kv.padding_block is not None) == guest_graphs
    own = kv_bytes_per_block(host.cfg, block_size, np.float32)
    theirs = kv_bytes_per_block(guest.cfg, block_size, np.float32)
    used = (host.kv.num_blocks + host_graphs) * own + (guest.kv.num_blocks + guest_graphs) * theirs
    assert used <= kv < used + own + theirs             # the region is shared, and one more block would not fit
    arena, offset, room = host.guest_region
    assert guest.arena is arena and offset == host.total_bytes - host.guest_bytes and room == host.guest_bytes
    assert guest.total_bytes <= room and arena.nbytes == host.total_bytes
    views = ([*host.weights.values(), *host.kv.k, *host.kv.v], [*guest.weights.values(), *guest.kv.k, *guest.kv.v])
    spans = sorted(_span(v) for side in views for v in side)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))      # no two regions overlap
    base = arena.__array_interface__["data"][0]
    assert min(s for s, _ in map(_span, views[1])) >= base + offset and spans[-1][1] <= base + arena.nbytes
    guest.kv.k[0][...] = 7                                  # the guest's KV is its own
    assert not any(np.any(k == 7) for k in host.kv.k + host.kv.v)
    assert "for the draft model" in host.describe()
    assert "KV" in guest.describe() and "sized by the host pool" in guest.describe()


def test_a_gpu_sized_pool_takes_the_guest_out_of_its_budget_first():
    host, guest = _pair(16, None, True, True, FakeGPU())      # half of 64 MiB free
    assert host.total_bytes <= 32 * MIB and host.kv.num_blocks == guest.kv.num_blocks
    own = kv_bytes_per_block(host.cfg, 16, np.float32)
    assert 32 * MIB - host.total_bytes < own + kv_bytes_per_block(guest.cfg, 16, np.float32) + 4096


def test_a_region_too_small_and_a_kv_region_with_no_block_are_refused():
    host, _ = _pair(16, 2 * MIB, False, False)
    guest_cfg = tiny_config(**DRAFT)
    ecfg = EngineConfig(max_num_batched_tokens=40, max_num_seqs=6, block_size=16)
    arena, offset, room = host.guest_region
    with pytest.raises(ValueError, match="does not fit the"):
        MemoryPool(guest_cfg, ecfg, CPUBackend(), kv_bytes=host.guest_kv_bytes * 2, region=(arena, offset, room))
    request = MemoryPool.guest_request(guest_cfg, ecfg, CPUBackend())
    with pytest.raises(ValueError, match="holds no KV block.*the draft model's"):
        MemoryPool(tiny_config(), EngineConfig(max_num_batched_tokens=40, max_num_seqs=6, kv_cache_memory=4096),
                   CPUBackend(), guest=request)
