"""The PNG of `rawinfer bench serve`: six panels drawn from the result dict of serve.summarize_run.

    TTFT histogram (p50 / p99 marked)          inter-token latency histogram (p50 / p99 marked)
    output tokens/s over time                  KV-cache utilisation over time
    running / waiting requests over time       TTFT of each request against its send time

Histograms count whole requests (or gaps): their y axes carry integer ticks only. Against a
disaggregated server a line under the title says what the KV-transfer link did (serve.py's kv_transfer).
matplotlib comes with the `bench` extra (`pip install 'rawinfer[bench]'`); without it, available() says
so once and the run writes its JSON alone.
"""

from __future__ import annotations

import logging

log = logging.getLogger("rawinfer")


def available() -> bool:
    """Whether matplotlib imports; where it does not, one warning that says how to get the figure."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        log.warning("no PNG figure for this run: matplotlib is not installed (pip install 'rawinfer[bench]'); "
                    "the JSON results are written as usual")
        return False
    return True


def _percentile_lines(ax, summary: dict) -> None:
    for key, style in (("p50", "--"), ("p99", ":")):
        if summary.get(key) is not None:
            ax.axvline(summary[key], color="black", linestyle=style, linewidth=1,
                       label=f"{key} {summary[key]:.1f} ms")
    ax.legend(loc="upper right", fontsize=8)


def plot(r: dict, path: str) -> None:
    """Draw the figure of result `r` and write it to `path` as a PNG."""
    import matplotlib.pyplot as plt
    fig = draw(r)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _title(r: dict) -> str:
    """What ran: the model, the requests sent (a multi-turn run's conversations x turns), the rate, the lengths."""
    c = r["config"]
    rate = c["request_rate"]
    rate = "all at once" if rate in ("inf", float("inf")) else f"{rate:g} req/s"
    if c.get("conversations"):     # --num-requests does not apply: every turn of every conversation is a request
        sent = f"{c['conversations']} conversations x {c['turns']} turns = {len(r['requests'])} requests"
        lengths = f"turn 1 in {c['input_len']} (+ {c['turn_input_len']} a turn) / out {c['output_len']} tokens"
    else:
        sent, lengths = f"{len(r['requests'])} requests", f"in {c['input_len']} / out {c['output_len']} tokens"
    return f"rawinfer bench serve: {c.get('model')}, {sent}, {rate}, {lengths}"


def draw(r: dict):
    """The matplotlib Figure of result `r` (its six panels, as above)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    ok = [x for x in r["requests"] if x["ttft"] is not None and x["error"] is None]
    ttft = [x["ttft"] * 1000 for x in ok]
    itl = [(b - a) * 1000 for x in ok for a, b in zip(x["message_times"], x["message_times"][1:])]
    tl, stats = r["timeline"], r["timeline"]["stats"]
    ts = [s["t"] for s in stats]
    fig, ax = plt.subplots(3, 2, figsize=(11, 10.5))

    ax[0, 0].hist(ttft or [0], bins=min(30, max(1, len(ttft))), color="tab:blue")
    ax[0, 0].set(title="TTFT", xlabel="ms", ylabel="requests")
    _percentile_lines(ax[0, 0], r["ttft_ms"])
    ax[0, 1].hist(itl or [0], bins=50, color="tab:orange")
    ax[0, 1].set(title="inter-token latency", xlabel="ms", ylabel="gaps")
    _percentile_lines(ax[0, 1], r["itl_ms"])
    for a in ax[0]:
        a.yaxis.set_major_locator(MaxNLocator(integer=True))

    ax[1, 0].plot(tl["t"], tl["output_tokens_per_s"], drawstyle="steps-post", label="client (binned)")
    if any(s["server_tokens_per_s"] is not None for s in stats):      # not from a server that does not say
        ax[1, 0].plot(ts, [s["server_tokens_per_s"] or 0 for s in stats], label="server (recent)")
    ax[1, 0].set(title="output tokens/s", xlabel="s since start", ylabel="tokens/s")
    ax[1, 0].legend(fontsize=8)
    kv = [100 * (s["kv_usage"] or 0) for s in stats]
    ax[1, 1].plot(ts, kv, color="tab:green")
    ax[1, 1].set(title="KV-cache utilisation", xlabel="s since start", ylabel="% of blocks",
                 ylim=(0, min(100, max(1.0, 1.2 * max(kv or [0])))))

    ax[2, 0].plot(ts, [s["running"] or 0 for s in stats], drawstyle="steps-post", label="running")
    ax[2, 0].plot(ts, [s["waiting"] or 0 for s in stats], drawstyle="steps-post", label="waiting")
    ax[2, 0].set(title="requests in the server", xlabel="s since start", ylabel="requests")
    ax[2, 0].yaxis.set_major_locator(MaxNLocator(integer=True))
    ax[2, 0].legend(fontsize=8)
    ax[2, 1].scatter([x["sent"] for x in ok], ttft, s=8, color="tab:blue")
    ax[2, 1].set(title="TTFT by send time", xlabel="s since start (sent)", ylabel="TTFT ms")

    fig.suptitle(_title(r))
    t = r.get("kv_transfer")
    if t:        # a disaggregated server: what its prefill link moved, under the title
        mean = "-" if t["mean_transfer_ms"] is None else f"{t['mean_transfer_ms']:.0f} ms"
        fig.text(0.5, 0.955, f"KV transfer: {t['remote']} prompts remote, {t['local']} local, {t['fallbacks']} "
                             f"fallbacks, {t['failed']} failed; {t['bytes'] / 1e6:.1f} MB, {mean} per transfer",
                 ha="center", fontsize=9)
        fig.tight_layout(rect=(0, 0, 1, 0.95))
    else:
        fig.tight_layout()
    return fig
