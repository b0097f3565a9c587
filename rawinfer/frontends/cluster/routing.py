"""Which replica gets a request: round-robin, least-loaded, or cache-aware.

Cache-aware routing sends a prompt to the replica most likely to hold its beginning in its prefix cache,
so a conversation that resends its growing history keeps landing where its earlier turns were computed.
The router does not tokenise, so it cannot know the replicas' block hashes; it keeps instead, per replica,
an approximate record of what it sent there (as SGLang's router does with a radix tree of text):

    prompt  ->  its key: the token ids, or the text, or each chat message as role + content
    key     ->  chained hashes of fixed-size pieces of it (piece i's hash covers pieces 0..i, as the
                engine's prefix cache hashes its blocks)
    replica ->  an LRU set of the piece hashes sent to it, capped at `capacity` pieces

The longest run of a prompt's leading pieces found in a replica's set is the prefix that replica has most
likely cached (it may have evicted it since: the record is approximate, never wrong about correctness).

Load comes first: when the busiest and the idlest candidates differ by more than `balance_abs` requests
and the busiest has `balance_rel` times the idlest's load, the idlest gets the request, so one hot prefix
cannot pile everything onto one replica. Otherwise the best-matching replica gets it when the match covers
at least `min_match` of the prompt; a prompt that matches nowhere goes to the least loaded replica (ties:
the one whose record is smallest, which spreads new prefixes out). Load is requests in flight plus
`kv_weight` x the replica's KV-pool usage (from its last stats), so a replica whose pool is nearly full
looks busier than its request count says.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from rawinfer.settings import check_options, is_int, is_number, option

POLICIES = ("cache_aware", "round_robin", "least_loaded")
TEXT_PIECE = 64          # characters per hashed piece of a text prompt
TOKEN_PIECE = 16         # token ids per hashed piece of a token-id prompt (the engine's default block size)


def prompt_pieces(prompt=None, messages=None) -> list[bytes]:
    """The chained piece hashes of a generate's prompt (a text, token ids, or a chat)."""
    if messages is not None:
        text = "".join(f"\x1e{m.get('role', '')}\x1f{m.get('content', '')}" for m in messages)
        return _chain([text[i:i + TEXT_PIECE].encode("utf-8", "surrogatepass")
                       for i in range(0, len(text) - len(text) % TEXT_PIECE, TEXT_PIECE)])
    if isinstance(prompt, str):
        n = len(prompt) - len(prompt) % TEXT_PIECE
        return _chain([prompt[i:i + TEXT_PIECE].encode("utf-8", "surrogatepass") for i in range(0, n, TEXT_PIECE)])
    ids = list(prompt or [])
    n = len(ids) - len(ids) % TOKEN_PIECE
    return _chain([b",".join(str(t).encode() for t in ids[i:i + TOKEN_PIECE]) for i in range(0, n, TOKEN_PIECE)])


def _chain(pieces: list[bytes]) -> list[bytes]:
    out, h = [], b""
    for p in pieces:
        h = hashlib.blake2b(h + p, digest_size=12).digest()
        out.append(h)
    return out


class PrefixRecord:
    """One replica's approximate record: an LRU set of piece hashes."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._seen: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def match(self, hashes: list[bytes]) -> int:
        """How many leading pieces of a prompt this replica was sent."""
        n = 0
        for h in hashes:
            if h not in self._seen:
                break
            n += 1
        return n

    def insert(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self._seen[h] = None
            self._seen.move_to_end(h)
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)

    def clear(self) -> None:
        self._seen.clear()


@dataclass
class Candidate:
    """What the router knows of a replica that may take a request."""
    slot: int
    in_flight: int
    kv_usage: float = 0.0
    record: PrefixRecord | None = None


@dataclass
class RoutingConfig:
    """How the router chooses a replica; `policy` is `rawinfer serve --routing`, the rest the Python API's."""

    policy: str = option(
        "cache_aware", flag="--routing", parse=str, choices=POLICIES, check=lambda v: v in POLICIES,
        what=f"one of {', '.join(POLICIES)}",
        help="cache_aware: to the replica most likely to hold the prompt's prefix, balanced against load; "
             "round_robin; least_loaded (default: cache_aware)")
    min_match: float = option(0.5, flag=None, check=lambda v: is_number(v) and 0 <= v <= 1,
                              what="a fraction from 0 to 1",
                              help="of the prompt's pieces, for a match to beat load")
    balance_abs: float = option(4.0, flag=None, check=lambda v: is_number(v) and v >= 0, what="a number >= 0",
                                help="load difference that counts as imbalance ...")
    balance_rel: float = option(1.5, flag=None, check=lambda v: is_number(v) and v > 0, what="a positive number",
                                help="... when the busiest also has this many times the idlest's load")
    kv_weight: float = option(4.0, flag=None, check=lambda v: is_number(v) and v >= 0, what="a number >= 0",
                              help="a full KV pool weighs as much as this many requests in flight")
    capacity: int = option(200_000, flag=None, check=lambda v: is_int(v) and v > 0, what="a positive integer",
                           help="piece hashes remembered per replica")


@dataclass
class Decision:
    slot: int
    matched: int                     # leading pieces the chosen replica was sent before
    pieces: int                      # pieces of the prompt
    reason: str                      # "prefix", "balance", "least_loaded", "round_robin"


class Router:
    """The routing decision alone (no sockets): choose() a replica for a prompt's pieces and remember it."""

    def __init__(self, cfg: RoutingConfig):
        if cfg.policy not in POLICIES:
            raise ValueError(f"unknown routing policy {cfg.policy!r}; choose one of {', '.join(POLICIES)}")
        check_options(cfg, "routing option")
        self.cfg = cfg
        self._next = 0

    def load(self, c: Candidate) -> float:
        return c.in_flight + self.cfg.kv_weight * c.kv_usage

    def choose(self, hashes: list[bytes], candidates: list[Candidate]) -> Decision:
        """The replica for a prompt (candidates: non-empty, the replicas taking requests now)."""
        cfg = self.cfg
        cands = sorted(candidates, key=lambda c: c.slot)
        if cfg.policy == "round_robin":
            pick = cands[self._next % len(cands)]
            self._next += 1
            return self._chosen(pick, hashes, "round_robin")
        idlest = min(cands, key=lambda c: (self.load(c), len(c.record or ()), c.slot))
        if cfg.policy == "least_loaded":
            return self._chosen(idlest, hashes, "least_loaded")
        loads = [self.load(c) for c in cands]
        if max(loads) - min(loads) > cfg.balance_abs and max(loads) > cfg.balance_rel * min(loads):
            return self._chosen(idlest, hashes, "balance")
        best = max(cands, key=lambda c: (c.record.match(hashes) if c.record else 0, -self.load(c), -c.slot))
        matched = best.record.match(hashes) if best.record else 0
        if hashes and matched >= cfg.min_match * len(hashes):
            return self._chosen(best, hashes, "prefix")
        return self._chosen(idlest, hashes, "least_loaded")

    @staticmethod
    def _chosen(c: Candidate, hashes: list[bytes], reason: str) -> Decision:
        matched = c.record.match(hashes) if c.record else 0
        if c.record is not None:
            c.record.insert(hashes)
        return Decision(c.slot, matched, len(hashes), reason)
