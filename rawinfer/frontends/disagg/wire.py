"""The prefill link's messages: a JSON header frame, then for `kv` one raw frame per layer.

    decode -> prefill   [header]                      prefill {id, prompt, start_block, fingerprint}
                                                      abort {id} | ping {seq}
    prefill -> decode   [header, layer 0 .. L-1]      kv {id, start_block, num_blocks, num_tokens,
                                                          num_layers, layer_bytes, fingerprint}
                        [header]                      error {id, code, message} | pong {seq, queued, fingerprint, stats}

A layer frame is KVExport.layers[l]'s bytes as they lie in the cache ([2, n, Hkv, R, D], storage dtype):
nothing is encoded per element. Every header carries the link's version; a reader refuses another.
This link is not the client protocol (frontends/server/PROTOCOL.md): only decode instances speak it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

VERSION = 1
ERROR_CODES = ("fingerprint", "busy", "rejected", "internal")


class WireError(ValueError):
    """A message that breaks the link's format (the transfer it names fails; the link stays up)."""


@dataclass(frozen=True)
class Header:
    type: str
    fields: dict

    def get(self, name: str, kind: type | tuple = object):
        value = self.fields.get(name)
        if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
            raise WireError(f"`{self.type}` message: field {name!r} is missing or not a {getattr(kind, '__name__', kind)}")
        return value


def encode(type_: str, **fields) -> bytes:
    return json.dumps({"v": VERSION, "type": type_, **fields}, separators=(",", ":")).encode()


def decode(frame: bytes) -> Header:
    try:
        msg = json.loads(bytes(frame))
    except (ValueError, RecursionError) as e:     # not UTF-8 or JSON, an integer of 4,300+ digits, deep nesting
        raise WireError(f"a prefill-link header is not JSON this link can read ({type(e).__name__}: "
                        f"{str(e)[:200]})") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
        raise WireError("a prefill-link header must be a JSON object with a `type`")
    if msg.get("v") != VERSION:
        raise WireError(f"prefill-link version {msg.get('v')!r} is not {VERSION}; run the same rawinfer version "
                        "on the prefill and decode instances")
    return Header(msg.pop("type"), msg)


def kv_frames(export, transfer_id: str, fingerprint: dict) -> list:
    """The `kv` message of a KVExport: header, then each layer's bytes (zero-copy buffers)."""
    layer_bytes = export.layers[0].nbytes if export.layers else 0
    head = encode("kv", id=transfer_id, start_block=export.start_block, num_blocks=export.num_blocks,
                  num_tokens=export.num_tokens, num_layers=len(export.layers), layer_bytes=layer_bytes,
                  fingerprint=fingerprint)
    return [head] + [memoryview(a.reshape(-1).view("u1")) for a in export.layers]
