"""The GPU/NUMA panel: per GPU its owner and live numbers, per NUMA node its CPUs and free memory,
per role whether its actual CPU affinity matches what the spec asked (flagged when not).

Renders :class:`~pdctl.console.telemetry.GpuNumaSample` values and never calls NVML itself. With
no GPU or no NVML it says so, and still shows NUMA nodes and affinity.
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from pdctl.console.telemetry import NA, GpuNumaSample, format_cpulist
from pdctl.statemachine.topology import Topology

__all__ = ["GpuPanel", "render_gpu_panel"]

_GIB = 1024**3


def _gib(v: object) -> str:
    return f"{v / _GIB:.1f}" if isinstance(v, int | float) and v is not NA else "N/A"


def _num(v: object, fmt: str = "{:.0f}") -> str:
    return fmt.format(v) if isinstance(v, int | float) else "N/A"


def _short_name(name: object) -> str:
    s = str(name)
    for p in ("NVIDIA ", "GeForce "):
        s = s.replace(p, "")
    return s


def render_gpu_panel(sample: GpuNumaSample | None, topology: Topology | None = None) -> RenderableType:
    """The panel's content for *sample* (None: no sample yet)."""
    if sample is None:
        return Text("waiting for the first GPU/NUMA sample…", style="dim")
    parts: list[RenderableType] = []
    owners = dict(sample.owners)
    if not sample.nvml_ok:
        t = Text()
        t.append("No GPU telemetry: ", style="bold yellow")
        t.append(sample.nvml_error or "NVML not available")
        t.append(" — the rest of the console works without it.", style="dim")
        if owners:
            by_role: dict[str, list[int]] = {}
            for g, r in sorted(owners.items()):
                by_role.setdefault(r, []).append(g)
            t.append("\nGPUs by role (deployed, else the spec): " + ", ".join(f"{r} {format_cpulist(gs)}" for r, gs in by_role.items()), style="dim")
        parts.append(t)
    else:
        head = Text(f"{len(sample.gpus)} GPU(s), driver {sample.driver_version}", style="bold")
        if sample.source != "NVML":
            head.append(f"  ({sample.source})", style="dim")
        parts.append(head)
        t = Table(box=None, padding=(0, 1), show_edge=False, header_style="dim")
        for col, just in (("#", "right"), ("name", "left"), ("role", "left"), ("util%", "right"), ("mem GiB", "right"), ("°C", "right"), ("W", "right"), ("PCIe bus", "left"), ("NUMA", "right")):
            t.add_column(col, justify=just, no_wrap=True)  # type: ignore[arg-type]
        for g in sample.gpus:
            role = owners.get(g.index)
            numa = "N/A" if g.numa_node is NA else str(g.numa_node)
            t.add_row(
                str(g.index),
                Text(_short_name(g.name)[:22], overflow="ellipsis"),
                Text(role or "-", style="bold cyan" if role else "dim"),
                _num(g.util_pct),
                f"{_gib(g.mem_used_bytes)}/{_gib(g.mem_total_bytes)}",
                _num(g.temperature_c),
                _num(g.power_w),
                str(g.pcie_bus_id),
                numa,
            )
        parts.append(t)
        # A role whose GPUs straddle NUMA nodes is worth a line.
        for role in sorted(set(owners.values())):
            nodes = {g.numa_node for g in sample.gpus if owners.get(g.index) == role and g.numa_node is not NA}
            if len(nodes) > 1:
                parts.append(Text(f"! {role}'s GPUs span NUMA nodes {sorted(nodes)}", style="bold yellow"))

    nt = Table(box=None, padding=(0, 1), show_edge=False, header_style="dim", title_justify="left")
    for col, just in (("NUMA", "right"), ("CPUs", "left"), ("n", "right"), ("free/total GiB", "right"), ("GPUs", "left")):
        nt.add_column(col, justify=just, no_wrap=True)  # type: ignore[arg-type]
    for n in sample.nodes:
        gpus_here = [g.index for g in sample.gpus if g.numa_node == n.node]
        nt.add_row(str(n.node), Text(n.cpus, overflow="ellipsis"), str(n.cpu_count), f"{_gib(n.mem_free_bytes)}/{_gib(n.mem_total_bytes)}", format_cpulist(gpus_here) or "-")
    if not sample.nodes:
        parts.append(Text("no NUMA information (/sys/devices/system/node unreadable)", style="dim"))
    else:
        parts.append(nt)

    at = Table(box=None, padding=(0, 1), show_edge=False, header_style="dim")
    for col in ("role", "pid", "NUMA", "asked CPUs", "actual CPUs", "affinity"):
        at.add_column(col, no_wrap=True)
    for a in sample.affinity:
        style = {"ok": "green", "mismatch": "bold red", "not-asked": "dim", "no-process": "dim", "unknown": "yellow"}.get(a.status, "")
        mark = {"ok": "✓ ok", "mismatch": "✗ MISMATCH", "not-asked": "not pinned", "no-process": "not running", "unknown": "? unknown"}.get(a.status, a.status)
        verdict = Text(mark, style=style)
        if a.status == "mismatch":
            verdict.append(f" ({a.detail})", style="red")
        at.add_row(
            a.role,
            str(a.pid or "-"),
            "-" if a.expected_node is None else str(a.expected_node),
            Text(a.expected_cpus or "-", overflow="ellipsis"),
            Text(a.actual_cpus or "-", overflow="ellipsis"),
            verdict,
        )
    if sample.affinity:
        parts.append(at)
    return Group(*parts)


class GpuPanel(Widget):
    """GPUs, NUMA nodes and each role's CPU affinity."""

    DEFAULT_CSS = """
    GpuPanel {
        height: auto;
        padding: 0 1;
    }
    """

    sample: reactive[GpuNumaSample | None] = reactive(None, layout=True)
    """The latest telemetry sample (None until the first arrives)."""
    topology: reactive[Topology | None] = reactive(None)
    """The topology the owners come from."""

    def render(self) -> RenderableType:
        return render_gpu_panel(self.sample, self.topology)
