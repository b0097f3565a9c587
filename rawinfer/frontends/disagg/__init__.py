"""Prefill/decode disaggregation: prefill instances compute prompts' K/V for decode instances over their
own ZeroMQ link. wire: the link's messages; prefill: the prefill role's server; connector: the decode
side (which requests go remote, deadlines, heartbeats, the failure policy). The engine half is
engine/kv_transfer.py."""
