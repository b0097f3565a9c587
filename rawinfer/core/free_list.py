"""KV block records and the LRU free list threaded through them (an intrusive doubly linked list).

The block manager keeps every free block (reference count 0) in one FreeBlockQueue. Blocks that still
carry a prefix-cache digest stay reusable until they are popped from the head for new data, so the
queue must support taking a block out of the middle on a cache hit. The links live on the blocks
themselves, which makes every operation O(1):

    head                                                     tail
    [b7] <-> [b2] <-> [b9] <-> ... <-> [b4]
    popped (evicted) first                 freed most recently

A block is in the queue exactly when it is the head or has a predecessor; links are cleared on removal.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator


class KVBlock:
    """One physical KV block: its id, reference count, prefix-cache digest and free-list links."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0                            # number of block-table entries that hold this block
        self.block_hash: bytes | None = None        # prefix-cache key while registered, else None
        self.prev_free: KVBlock | None = None       # free-list links; both None when not in the list
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        digest = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={digest})"


class FreeBlockQueue:
    """The LRU list of free blocks: pop from the head, free to the tail, remove from anywhere in O(1)."""

    def __init__(self, blocks: Iterable[KVBlock] = ()):
        self._head: KVBlock | None = None
        self._tail: KVBlock | None = None
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block: KVBlock) -> bool:
        return block.prev_free is not None or self._head is block

    def __iter__(self) -> Iterator[KVBlock]:
        """Head (next to be popped) to tail (most recently freed)."""
        node = self._head
        while node is not None:
            yield node
            node = node.next_free

    def append(self, block: KVBlock) -> None:
        """Put block at the tail: it will be popped after every block already in the queue."""
        self._check_absent(block)
        block.prev_free = self._tail
        if self._tail is None:
            self._head = block
        else:
            self._tail.next_free = block
        self._tail = block
        self._len += 1

    def appendleft(self, block: KVBlock) -> None:
        """Put block at the head: it will be popped next."""
        self._check_absent(block)
        block.next_free = self._head
        if self._head is None:
            self._tail = block
        else:
            self._head.prev_free = block
        self._head = block
        self._len += 1

    def popleft(self) -> KVBlock:
        """Take the head block (the least recently freed one)."""
        if self._head is None:
            raise IndexError("popleft from an empty free-block queue")
        block = self._head
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        """Unlink block from wherever it sits in the queue."""
        if block not in self:
            raise ValueError(f"{block!r} is not in the free-block queue")
        prev, nxt = block.prev_free, block.next_free
        if prev is None:
            self._head = nxt
        else:
            prev.next_free = nxt
        if nxt is None:
            self._tail = prev
        else:
            nxt.prev_free = prev
        block.prev_free = None
        block.next_free = None
        self._len -= 1

    def check_links(self, limit: int) -> list[KVBlock]:
        """Walk the queue (at most limit nodes), assert that the links and the length agree, return the nodes."""
        nodes: list[KVBlock] = []
        seen: set[int] = set()
        prev: KVBlock | None = None
        node = self._head
        while node is not None:
            assert id(node) not in seen, f"free list has a cycle at {node!r}"
            assert len(nodes) < limit, f"free list is longer than {limit} blocks"
            assert node.prev_free is prev, f"free list: {node!r}.prev_free is {node.prev_free!r}, expected {prev!r}"
            seen.add(id(node))
            nodes.append(node)
            prev, node = node, node.next_free
        assert self._tail is prev, f"free list tail is {self._tail!r}, but the walk ends at {prev!r}"
        assert len(nodes) == self._len, f"free list holds {len(nodes)} blocks but its length says {self._len}"
        return nodes

    def _check_absent(self, block: KVBlock) -> None:
        if block in self or block.next_free is not None:
            raise ValueError(f"{block!r} is already in the free-block queue")
