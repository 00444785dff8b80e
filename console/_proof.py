"""The proof panel: one step's full proof — summary, the checks that held, the commands it ran,
the raw evidence — or its error and what to do about it."""

from __future__ import annotations

import json

from rich.console import Group, RenderableType
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from pdctl.console.views import StepView, fmt_duration

__all__ = ["ProofPanel", "render_proof"]

_EVIDENCE_LINES = 60
"""Evidence is cut after this many lines of JSON (the journal holds it whole)."""


def render_proof(step: StepView | None, now: float | None = None) -> RenderableType:
    """*step*'s proof; its age counted to *now* (epoch seconds) from when it finished, else the view's ``age_s``."""
    if step is None:
        return Text("select a step (↑/↓ then Enter in the state-machine panel) to see its proof", style="dim")
    parts: list[RenderableType] = []
    head = Text()
    head.append(step.name, style="bold")
    head.append(f"  {step.status}", style={"done": "green", "skipped": "green", "failed": "bold red", "running": "yellow",
                                       "interrupted": "yellow"}.get(step.status, "dim"))
    head.append(f"  took {fmt_duration(step.elapsed_s)}")
    age = now - step.finished_at if now is not None and step.finished_at is not None else step.age_s
    if age is not None:
        head.append(f", {fmt_duration(max(0.0, age))} ago", style="dim")
    parts.append(head)
    proof = step.proof or {}
    if step.status == "failed" or step.error:
        parts.append(Text(f"error: {step.error}", style="bold red"))
        if step.hint:
            parts.append(Text(f"hint: {step.hint}", style="yellow"))
    if proof:
        parts.append(Text(f"proof: {proof.get('summary', '')}", style="bold"))
        for c in proof.get("checks") or ():
            parts.append(Text(f"  ✓ {c}", style="green"))
        cmds = proof.get("commands") or ()
        if cmds:
            parts.append(Text("commands:", style="bold"))
            for c in cmds:
                parts.append(Text(f"  $ {c}", style="cyan"))
        ev = proof.get("evidence")
        if ev:
            parts.append(Text("evidence:", style="bold"))
            lines = json.dumps(ev, indent=1, default=str, sort_keys=True).splitlines()
            more = len(lines) - _EVIDENCE_LINES
            parts.append(Text("\n".join(lines[:_EVIDENCE_LINES]), style="dim"))
            if more > 0:
                parts.append(Text(f"… {more} more lines in the journal", style="dim"))
    elif step.status == "pending":
        parts.append(Text("not run yet", style="dim"))
    elif step.status == "interrupted" and step.summary and not step.error:  # (an error is said above)
        parts.append(Text(step.summary, style="yellow"))
    return Group(*parts)


class ProofPanel(Widget):
    """A step's full proof and commands."""

    DEFAULT_CSS = """
    ProofPanel {
        height: auto;
        padding: 0 1;
    }
    """

    step: reactive[StepView | None] = reactive(None, layout=True)
    """The step shown."""

    def on_mount(self) -> None:
        # the age goes on counting between snapshots: a StepView that only aged compares equal, so setting it again
        # redraws nothing (the tab showed the age at selection, for good)
        self.set_interval(1.0, self._tick)

    def _tick(self) -> None:
        if self.step is not None and self.step.finished_at is not None:
            self.refresh()

    def render(self) -> RenderableType:
        clock = getattr(self.app, "clock", None)
        return render_proof(self.step, clock() if callable(clock) else None)
