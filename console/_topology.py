"""The topology panel: hosts, roles, GPU sets, NUMA nodes, ports, the KV link and the router's
exposure, drawn compactly; a pending plan's changes are marked with Terraform's symbols and
coloured by class (topology red, disruptive yellow, in place blue)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from pdctl.console.telemetry import format_cpulist
from pdctl.console.views import state_word
from pdctl.statemachine.plan import Plan, ResourceChange, format_value
from pdctl.statemachine.topology import Topology, is_wildcard, url_host

__all__ = ["CLASS_STYLE", "TopologyPanel", "render_topology"]

CLASS_STYLE = {"topology": "bold red", "disruptive": "bold yellow", "in_place": "bold blue"}


def _svc(services: Mapping[str, Any], name: str) -> Text:
    sv = services.get(name)
    if sv is None:
        return Text("")
    style = {"active": "green", "failed": "bold red", "activating": "yellow"}.get(sv.state, "dim")
    t = Text(state_word(sv.state, getattr(sv, "sub_state", "")), style=style)
    if sv.main_pid:
        t.append(f" {sv.main_pid}", style="dim")
    if sv.restarts:
        t.append(f" ↻{sv.restarts}", style="yellow")
    if not getattr(sv, "supervised", True):
        t.append(" UNSUPERVISED", style="bold red")
    return t


def render_topology(topo: Topology, plan: Plan | None = None, services: Mapping[str, Any] | None = None, hosts: Mapping[str, Any] | None = None,
                    *, readonly: bool = False, applying: bool = False, locked_by: str | None = None) -> RenderableType:
    """The topology as a few aligned lines; with *plan*, what it would change, marked (and, unless *readonly*, the
    key that applies it; while *applying* it, that it is being applied and the key that cancels it; while another
    process holds the deployment's lock, *locked_by* (e.g. ``"PID 325 (apply)"``), that ``a`` waits for it)."""
    services = services or {}
    changes: dict[str, ResourceChange] = {c.address: c for c in (plan.changes if plan else ())}
    show = plan.to_topology if (plan is not None and plan.has_changes) else topo
    parts: list[RenderableType] = []

    head = Text(no_wrap=True, overflow="ellipsis")
    head.append(show.name, style="bold")
    head.append(f"  {'PD disaggregation' if show.mode == 'pd' else 'single server'}", style="cyan")
    dep = show.deployment
    head.append(f"  sglang {dep.get('sglang_version', '?')}  {dep.get('service_manager', '?')}", style="dim")
    hosts = dep.get("hosts") or {}
    if hosts:
        head.append("  hosts ", style="dim")
        head.append(", ".join(k if h.get("address") in (None, k) else f"{k}={h.get('address')}" for k, h in hosts.items()))
    parts.append(head)

    if plan is not None and plan.has_changes:
        add, change, destroy = plan.counts()
        style = CLASS_STYLE.get(plan.cls or "", "bold")
        banner = Text(no_wrap=False)
        banner.append(f"{'Applying' if applying else 'Pending'} {plan.cls} plan {plan.plan_id}: ", style=style)
        banner.append(f"+{add} ~{change} -{destroy}")
        hint = (" (read-only: `pdctl plan` shows it)" if readonly else " (x: cancel at its next step)" if applying
                else f" (another pdctl, {locked_by}, holds the lock: a waits until it ends)" if locked_by
                else " (a: review, apply)")
        banner.append(hint, style="dim")
        parts.append(banner)

    t = Table.grid(padding=(0, 1))
    for _ in range(9):
        t.add_column(no_wrap=True)
    t.add_row(*(Text(h, style="dim") for h in ("", "role", "host", "GPUs", "par", "NUMA", "listen", "boot", "unit")))
    roles = list(show.roles)
    gone = [r for r in (plan.from_topology.roles if plan is not None and plan.from_topology else ()) if r.name not in {x.name for x in roles}]
    details: list[Text] = []
    for r in [*roles, *gone]:
        c = changes.get(f"role.{r.name}")
        style = CLASS_STYLE.get(c.cls, "") if c else ""
        par = f"TP{r.tp}" + (f" DP{r.attn_dp}" if r.attn_dp > 1 else "") + (f" EP{r.ep}" if r.ep > 1 else "")
        t.add_row(
            Text(c.symbol if c else " ", style=style),
            Text(r.name, style=style or "bold"),
            Text(r.host),
            Text(format_cpulist(r.gpus)),
            Text(par),
            Text("-" if r.numa_node is None else str(r.numa_node)),
            Text(f"{url_host(r.http_host)}:{r.port}"),
            Text(str(r.bootstrap_port) if r.bootstrap_port else "-"),
            _svc(services, r.name),
        )
        if c is not None:
            for a in c.changes:
                details.append(Text(f"    ~ {r.name}.{a.path}: {format_value(a.before)} → {format_value(a.after)}", style=CLASS_STYLE.get(a.cls, "")))
            # (as `pdctl plan` says them: a role an unfinished apply already started is kept, not new; one it removed
            # already has nothing left to stop)
            if c.kept is not None:
                details.append(Text(f"    = {r.name}: kept ({c.kept})", style=style))
            elif c.gone:
                details.append(Text(f"    - {r.name}: removed already, nothing left to stop", style="dim"))
            elif c.action == "delete":
                details.append(Text(f"    - {r.name}: stopped and removed", style="bold red"))
            elif c.action == "create":
                details.append(Text(f"    + {r.name}: new {r.kind}", style=style))
            if c.restarts and c.action == "update" and c.kept is None:
                details.append(Text(f"    {r.name} restarts", style="yellow"))
    parts.append(t)
    parts.extend(details)

    kv = show.kv_link
    c = changes.get("kv_link")
    line = Text(no_wrap=True, overflow="ellipsis")
    line.append(f"{c.symbol if c else ' '} ", style=CLASS_STYLE.get(c.cls, "") if c else "")
    line.append("KV link ", style="bold")
    if kv is None:
        line.append("none (single server)", style="dim")
    else:
        decodes = ",".join(r.name for r in show.roles if r.kind == "decode") or "?"
        line.append(f"{kv.backend}: ")
        # (one pair per prefill group, apart: several ran together, "…:37098nixl: prefill-1 ⇢ …")
        line.append("; ".join(f"{pre} ⇢ {decodes} via bootstrap {host}:{port}" for pre, host, port in kv.bootstrap))
        if kv.ib_device:
            line.append(f"  ib {kv.ib_device}", style="dim")
    parts.append(line)

    rt = show.router
    c = changes.get("router")
    line = Text(no_wrap=True, overflow="ellipsis")
    line.append(f"{c.symbol if c else ' '} ", style=CLASS_STYLE.get(c.cls, "") if c else "")
    line.append("router ", style="bold")
    if rt is None:
        line.append("none", style="dim")
    else:
        public = is_wildcard(rt.host)
        line.append(rt.exposure, style="bold red" if public else "bold green")
        line.append(" (all interfaces)" if public else " (loopback)" if rt.host.startswith("127.") or rt.host == "localhost" else "")
        workers = f"{len(rt.prefill)}P+{len(rt.decode)}D" if rt.prefill or rt.decode else f"{len(rt.regular)} worker(s)"
        ph = str(rt.settings.get("prometheus_host"))
        line.append(f" {rt.impl} {workers}, metrics {'' if ph.startswith('127.') else ph}:{rt.settings.get('prometheus_port')}")
        line.append("  ")
        line.append_text(_svc(services, "router"))
    parts.append(line)
    if c is not None:
        for a in c.changes:
            parts.append(Text(f"    ~ {a.path}: {format_value(a.before)} → {format_value(a.after)}", style=CLASS_STYLE.get(a.cls, "")))
    for addr in ("deployment", "console"):
        c = changes.get(addr)
        if c is not None:
            parts.append(Text(f"{c.symbol} {addr}: {', '.join(a.path for a in c.changes)}" + (f" (restarts {', '.join(c.restarts)})" if c.restarts else ""), style=CLASS_STYLE.get(c.cls, "")))
    return Group(*parts)


class TopologyPanel(Widget):
    """Where every role runs, and what a pending plan would change."""

    DEFAULT_CSS = """
    TopologyPanel {
        height: auto;
        padding: 0 1;
    }
    """

    topology: reactive[Topology | None] = reactive(None, layout=True)
    """What is deployed (or being deployed), else what the spec asks."""
    plan: reactive[Plan | None] = reactive(None, layout=True)
    """The pending plan from the journal to the (re)loaded spec."""
    services: reactive[Mapping[str, Any]] = reactive(dict, layout=True)
    """Role → service state (from the manager)."""
    applying: reactive[bool] = reactive(False, layout=True)
    """The console's own apply runs (the plan shown is the one it applies): the banner offers x, not a."""
    locked_by: reactive[str | None] = reactive(None, layout=True)
    """Another process holds the deployment's lock (``"PID N (apply)"``): the banner does not offer a."""

    def __init__(self, topology: Topology | None = None, *, readonly: bool = False, name: str | None = None, id: str | None = None, classes: str | None = None, disabled: bool = False) -> None:
        super().__init__(name=name, id=id, classes=classes, disabled=disabled)
        self.set_reactive(TopologyPanel.topology, topology)
        self.readonly = readonly
        """The console's ``--readonly``: the pending-plan banner offers no key."""

    def render(self) -> RenderableType:
        if self.topology is None:
            return Text("no topology yet", style="dim")
        return render_topology(self.topology, self.plan, self.services, readonly=self.readonly, applying=self.applying,
                               locked_by=self.locked_by)
