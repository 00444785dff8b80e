"""A saved ``pdctl bench`` result (:func:`pdctl.statemachine.bench.latest`'s dict) as rich renderables: the table
``pdctl bench`` prints and the console's throughput tab shows below its live figures. Rich only, no Textual: the
headless CLI imports it.
"""

from __future__ import annotations

from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

__all__ = ["bench_summary", "bench_table"]


def _num(v: Any, places: int = 1) -> str:
    return f"{v:,.{places}f}" if isinstance(v, (int, float)) else "—"


def _ms(v: Any) -> str:
    """Milliseconds with as many places as the value needs to say something (the stand-in's ITL is µs)."""
    if not isinstance(v, (int, float)):
        return "—"
    return f"{v:,.0f}" if v >= 100 else f"{v:.1f}" if v >= 1 else f"{v:.3f}"


def _when(stamp: Any) -> str:
    """``20261205T135450.272409Z`` → ``2026-12-05 13:54:50 UTC`` (anything else as it is)."""
    import datetime as dt

    try:
        return dt.datetime.strptime(str(stamp).split(".")[0].rstrip("Z"), "%Y%m%dT%H%M%S").strftime("%Y-%m-%d %H:%M:%S UTC")
    except ValueError:
        return str(stamp)


def bench_table(result: dict, *, title: str | None = None) -> Table:
    """One row per concurrency level: requests, errors, output tok/s, req/s, TTFT and ITL p50/p90/p99 (ms)."""
    # (no box, one space between columns: eleven columns fit the console's 80)
    t = Table(title=title, title_justify="left", box=None, padding=(0, 1), collapse_padding=True, pad_edge=False,
              header_style="bold")
    for name in ("conc", "reqs", "err", "out tok/s", "req/s", "TTFT p50", "p90", "p99", "ITL p50", "p90", "p99"):
        t.add_column(name, justify="right", no_wrap=True)
    for r in result.get("levels") or []:
        err = int(r.get("errors") or 0)
        t.add_row(str(r.get("concurrency")), str(r.get("requests")), Text(str(err), style="bold red" if err else ""),
                  _num(r.get("output_tok_s")), _num(r.get("requests_s")),
                  *(_ms(r.get(f"ttft_ms_{p}")) for p in ("p50", "p90", "p99")),
                  *(_ms(r.get(f"itl_ms_{p}")) for p in ("p50", "p90", "p99")))
    return t


def bench_summary(result: dict | None, *, current_plan: str | None = None) -> RenderableType:
    """The console's block: when, against which plan (flagged when the deployment has moved on since), the
    stand-in's note, the table and where the files are; a line saying how to make one when there is none."""
    if not result:
        return Text("no saved benchmark: `pdctl bench SPEC` runs one (the console starts no load)", style="dim")
    head = Text(no_wrap=False)
    head.append("last bench ", style="bold")
    head.append(f"{_when(result.get('when', '?'))}  ISL {result.get('isl')} / OSL {result.get('osl')}  "
                f"plan {result.get('plan_id')}")
    if current_plan is not None and result.get("plan_id") != current_plan:
        head.append(f"  (now plan {current_plan})", style="yellow")
    parts: list[RenderableType] = [head]
    if result.get("stand_in"):
        parts.append(Text("the SGLang stand-in behind the real router: the HTTP path's figures, not a GPU's",
                          style="yellow"))
    parts.append(bench_table(result))
    versions = result.get("versions") or {}
    foot = ", ".join(f"{k} {v}" for k, v in versions.items() if k in ("aiperf", "smg", "sglang (spec)", "pdctl"))
    parts.append(Text(f"ms; {foot}; {result.get('dir', '')}", style="dim"))
    return Group(*parts)
