"""The multi-turn conversation workload of `rawinfer bench serve` (--conversations) and its report.

Each of C conversations sends T turns. Turn 1 is --input-len random ids of its own; turn k > 1 resends the
whole history: the prompt of turn k-1, the ids turn k-1 generated, then --turn-input-len new random ids.

    turn 1   [ prompt 1 ]
    turn 2   [ prompt 1 ][ output 1 ][ new 2 ]
    turn 3   [ prompt 1 ][ output 1 ][ new 2 ][ output 2 ][ new 3 ]

A server (or the replica a router picks) that still holds the earlier turns' KV blocks finds them in its
prefix cache, so the run reports the server's prefix-cache hit rate over the run and TTFT of turn 1 apart
from the later turns: what cache-aware routing across replicas buys shows in both.

The load stays open loop: the C*T arrivals of the usual Poisson schedule go round-robin over the
conversations (arrival i is turn i // C of conversation i % C), and a turn leaves at its arrival or when
its conversation's previous turn finished, whichever is later. A failed turn ends its conversation.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from rawinfer.frontends.bench.mixed import percentiles
from rawinfer.frontends.bench.throughput import make_workload
from rawinfer.frontends.options import CLIError

PREVIOUS_FAILED = "previous turn failed"


@dataclass
class Conversation:
    """One conversation's plan: its first prompt, the new user ids of turns 2..T, every turn's arrival
    (seconds after the start) and the records its turns fill in (duck-typed serve.RequestRecord)."""
    first_prompt: list[int]
    new_turns: list[list[int]]
    arrivals: list[float]
    records: list = field(default_factory=list)


def enabled(args) -> bool:
    return getattr(args, "conversations", 0) > 0


def check_options(args) -> None:
    """CLIError when --conversations is combined with an option it cannot honour."""
    if not enabled(args):
        return
    if getattr(args, "backend", "zmq") != "zmq":
        raise CLIError("--conversations needs --backend zmq (the prefix-cache hit rate comes from the ZeroMQ "
                       "`stats`); drop --backend openai")
    if getattr(args, "long_fraction", 0.0) > 0:
        raise CLIError("--conversations and --long-fraction are two different workloads; drop one of them")
    if getattr(args, "range_ratio", 0.0) > 0:
        raise CLIError("--conversations sends fixed lengths (--input-len, --turn-input-len, --output-len); "
                       "drop --range-ratio")


def prompt_len(args, turn: int) -> int:
    """Tokens of turn `turn`'s prompt (from 1) when every earlier turn generated --output-len tokens."""
    return args.input_len + (turn - 1) * (args.output_len + args.turn_input_len)


def check_fits(args, limit: int) -> None:
    """CLIError when the last turn's prompt and output cannot fit a context of `limit` tokens."""
    longest = prompt_len(args, args.turns) + args.output_len
    if longest > limit:
        raise CLIError(f"turn {args.turns} of a conversation needs {longest} tokens (its prompt of "
                       f"{prompt_len(args, args.turns)} plus --output-len {args.output_len}), more than the "
                       f"server's context of {limit}; lower --turns or --input-len (or --turn-input-len, "
                       "--output-len)")


def assign_arrivals(times: list[float], conversations: int, turns: int) -> list[list[float]]:
    """Per conversation, its turns' arrivals: arrival i goes to conversation i % C, turn i // C."""
    if len(times) != conversations * turns:
        raise ValueError(f"{len(times)} arrivals for {conversations} conversations of {turns} turns")
    return [[times[k * conversations + c] for k in range(turns)] for c in range(conversations)]


def plan(args, vocab_size: int, times: list[float], new_record) -> list[Conversation]:
    """The seeded conversations of the options. times: the C*T arrivals (serve.arrival_times); new_record:
    makes a turn's record from (prompt_tokens, max_tokens, conversation=, turn=), turn counted from 1."""
    C, T = args.conversations, args.turns
    first = make_workload(C, args.input_len, args.output_len, 0.0, vocab_size, args.seed).prompts
    new = make_workload(C * (T - 1), args.turn_input_len, 1, 0.0, vocab_size, args.seed + 4).prompts
    out = []
    for c, arrivals in enumerate(assign_arrivals(times, C, T)):
        conv = Conversation(first[c], new[c * (T - 1):(c + 1) * (T - 1)], arrivals)
        conv.records = [new_record(prompt_len(args, k), args.output_len, conversation=c, turn=k)
                        for k in range(1, T + 1)]
        out.append(conv)
    return out


def next_prompt(prompt: list[int], generated: list[int], new_turn: list[int]) -> list[int]:
    """The next turn's prompt: the history so far, what the model answered, the user's new turn."""
    return prompt + generated + new_turn


async def converse(conv: Conversation, send, bar) -> None:
    """Send the conversation's turns one after another. send(record, prompt, arrival): awaits the arrival,
    streams the request into the record and returns the ids it generated (serve._one)."""
    prompt, generated = conv.first_prompt, []
    for k, rec in enumerate(conv.records):
        if k:
            previous = conv.records[k - 1]
            if not previous.ok:
                for later in conv.records[k:]:
                    later.error = PREVIOUS_FAILED
                    bar.update(1)
                return
            prompt = next_prompt(prompt, generated, conv.new_turns[k - 1])
        generated = await send(rec, prompt, conv.arrivals[k])


def cache_snapshot(stats: dict | None) -> dict:
    """The prefix-cache counters and the routing report of one `stats` answer (None where absent)."""
    counters = ((stats or {}).get("metrics") or {}).get("counters") or {}
    return {"queries": counters.get("prefix_cache_queries_total"), "hits": counters.get("prefix_cache_hits_total"),
            "routing": (stats or {}).get("routing")}


def report(records, conversations: int, turns: int, before: dict, after: dict) -> dict:
    """The "multi_turn" section: TTFT overall / turn 1 / later turns, the server's prefix-cache hit rate
    between the snapshots (cache_snapshot) taken just before the first request and after the last."""
    ok = [r for r in records if r.ok]
    queries = hits = rate = None
    if None not in (before["queries"], before["hits"], after["queries"], after["hits"]):
        queries, hits = after["queries"] - before["queries"], after["hits"] - before["hits"]
        rate = hits / queries if queries > 0 else None
    done = sum(all(r.ok for r in records if r.conversation == c) for c in range(conversations))
    return {
        "conversations": conversations, "turns": turns, "completed_conversations": done,
        "ttft_ms": {"all": percentiles([r.ttft for r in ok]),
                    "first_turn": percentiles([r.ttft for r in ok if r.turn == 1]),
                    "later_turns": percentiles([r.ttft for r in ok if r.turn > 1])},
        "prefix_cache_queries": queries, "prefix_cache_hits": hits, "prefix_cache_hit_rate": rate,
        "routing": after["routing"] if after["routing"] is not None else before["routing"],
    }


def _row(d: dict) -> str:
    return "n/a" if d.get("p50") is None else f"p50 {d['p50']:8.1f} | p99 {d['p99']:8.1f}"


def print_report(m: dict, file=sys.stdout) -> None:
    print(f"conversations:           {m['completed_conversations']} of {m['conversations']} completed, "
          f"{m['turns']} turns each", file=file)
    for key, name in (("all", "all turns"), ("first_turn", "turn 1"), ("later_turns", "turns > 1")):
        print(f"  TTFT {name + ' (ms):':<18}{_row(m['ttft_ms'][key])}", file=file)
    rate = m["prefix_cache_hit_rate"]
    print("prefix-cache hit rate:   " + ("n/a (the server's stats have no prefix-cache counters)" if rate is None
          else f"{100 * rate:.1f} % ({m['prefix_cache_hits']} of {m['prefix_cache_queries']} prompt tokens)"),
          file=file)
    routing = m["routing"]
    print("routing:                 " + ("none reported (one engine)" if routing is None else
                                         ", ".join(f"{k} {v}" for k, v in routing.items()) if isinstance(routing, dict)
                                         else str(routing)), file=file)
