"""The throughput panel: per role and for the router, what it serves now, from each server's
``/metrics`` and the router's prometheus port (see :mod:`pdctl.console.metrics` for the math).

Two lines per source so it fits 80 columns: the headline (tok/s or req/s, running/queued, KV
pool, a sparkline of the last minutes), then latencies (TTFT, ITL percentiles from merged
histogram buckets; KV transfer latency and failures; router errors). A ``down`` or ``stale``
source keeps its last numbers, dimmed, with the reason.

Below them, the newest saved ``pdctl bench`` result of the deployment (read from its state directory by the
collector; :mod:`pdctl.console.bench_view` renders it): the console shows it, and starts no load.
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from pdctl.console.bench_view import bench_summary
from pdctl.console.metrics import ThroughputSample, sparkline

__all__ = ["ThroughputPanel", "render_throughput"]


def _f(v: float | None, fmt: str = "{:.1f}") -> str:
    return "—" if v is None else fmt.format(v)


def _ms(v: float | None) -> str:
    if v is None:
        return "—"
    return f"{v * 1000:.0f}" if v * 1000 >= 10 else f"{v * 1000:.1f}"


def _pct(vals: tuple[float | None, ...], unit_ms: bool = True, first: float | None = None) -> str:
    """Percentiles joined by "/"; with *first* (the histogram's first bucket bound), one inside it reads "≤bound" (its
    interpolated value says nothing), and all of them inside it read "≤bound" once."""
    if all(v is None for v in vals):
        return "—"
    inside = [first is not None and v is not None and v <= first for v in vals]
    if all(inside):
        return f"≤{_ms(first)}"
    return "/".join(f"≤{_ms(first)}" if ins else _ms(v) if unit_ms else _f(v) for v, ins in zip(vals, inside))


def render_throughput(samples: tuple[ThroughputSample, ...], width: int = 78) -> RenderableType:
    """The panel's content (*width*: columns available, for the sparkline)."""
    if not samples:
        return Text("waiting for the first scrape…", style="dim")
    lines: list[RenderableType] = []
    # (a role's name is up to 32 characters: the column fits the longest, one space after it)
    name_w = max(9, *(len(s.source) + 1 for s in samples))
    spark_w = max(8, min(60, width - 54 - (name_w - 9)))
    for s in samples:
        dim = s.state != "ok"
        st_style = {"ok": "green", "stale": "yellow", "down": "bold red", "waiting": "dim"}.get(s.state, "")
        l1 = Text(no_wrap=True, overflow="ellipsis")
        l1.append(f"{s.source:<{name_w}}", style="bold")
        l1.append(f"{s.state:<6}", style=st_style)
        if s.kind == "router":
            l1.append(f"{_f(s.req_s):>7} req/s ")
            l1.append(f"5xx {_f(s.err_s, '{:.1f}')}/s ", style="red" if (s.err_s or 0) > 0 else "")
            if s.workers_total is not None:
                ok = s.workers_healthy == s.workers_total
                l1.append(f"wk {_f(s.workers_healthy, '{:.0f}')}/{_f(s.workers_total, '{:.0f}')} ", style="" if ok else "bold red")
        else:
            if s.kind == "prefill":
                l1.append(f"in {_f(s.input_tok_s, '{:.0f}'):>6} tok/s ")
            else:
                l1.append(f"gen {_f(s.gen_tok_s, '{:.0f}'):>5} tok/s ")
            l1.append(f"run {_f(s.running, '{:.0f}')} q {_f(s.queued, '{:.0f}')} ")
            kv = "—" if s.kv_usage is None else f"{s.kv_usage * 100:.0f}%"
            l1.append(f"KV {kv:>4} ")
        pad = name_w + 6 + 38 - l1.cell_len
        if pad > 0:
            l1.append(" " * pad)
        l1.append(sparkline(s.history, spark_w), style="cyan" if not dim else "dim")
        if dim:
            l1.stylize("dim", name_w + 6)
        lines.append(l1)

        l2 = Text(no_wrap=True, overflow="ellipsis", style="dim" if dim else "")
        l2.append(" " * name_w)
        if s.state in ("down", "stale"):
            age = "" if s.age_s is None else f", last good {s.age_s:.0f}s ago"
            l2.append(f"{s.error or 'no recent scrape'}{age}", style="red")
        elif s.kind == "router":
            probes = " incl. probes (no path labels)" if s.errors_include_probes else ""
            l2.append(f"5xx {_f(s.errors, '{:.0f}')}  4xx {_f(s.client_errors, '{:.0f}')} (since start{probes})  {s.url}",
                      style="dim")
        else:
            star = "*" if s.pct_all_time else ""
            l2.append(f"TTFT {_pct(s.ttft_s, first=s.ttft_first_bound_s)}ms ")
            if s.kind != "prefill":
                l2.append(f"ITL {_pct(s.itl_s, first=s.itl_first_bound_s)}ms ")
            if s.kv_xfer_ms != (None, None) or s.kind == "prefill":
                l2.append(f"KVxfer {_pct(s.kv_xfer_ms, unit_ms=False)}ms ")
            fails = s.kv_xfer_failed
            l2.append(f"fail {_f(fails, '{:.0f}')}", style="bold red" if (s.kv_xfer_failed_s or 0) > 0 else "")
            if star:
                l2.append(" *", style="dim")
        lines.append(l2)
    lines.append(Text("p50/p90/p99 (KVxfer p50/p99) over 60 s; * = whole run (none in 60 s)", style="dim"))
    return Group(*lines)


class ThroughputPanel(Widget):
    """Tokens per second, queues, KV pool, latencies and router traffic."""

    DEFAULT_CSS = """
    ThroughputPanel {
        height: auto;
        padding: 0 1;
    }
    """

    samples: reactive[tuple[ThroughputSample, ...]] = reactive((), layout=True)
    """One sample per source (servers, then the router)."""
    bench: reactive[dict | None] = reactive(None, layout=True)
    """The newest saved ``pdctl bench`` result (``bench.latest``), None when there is none."""
    plan_id: reactive[str | None] = reactive(None)
    """The deployment's plan id now: a saved result of another plan is flagged."""

    def render(self) -> RenderableType:
        return Group(render_throughput(self.samples, self.content_size.width or 78), Text(" "),
                     bench_summary(self.bench, current_plan=self.plan_id))
