"""View models the panels render: pure functions from engine values to rows. No I/O, no Textual.

Keeping them here (not in the widgets) lets tests check what an operator will read without
running an app, and lets :mod:`pdctl.console.collect` build them off the UI thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pdctl.statemachine.journal import INTERRUPTED_SUMMARY, JournalState
from pdctl.statemachine.machine import PD_STATES, SINGLE_STATES
from pdctl.statemachine.topology import Topology
from pdctl.units._manager import new_lines  # (the console's log view; re-exported)

__all__ = ["StepView", "expected_states", "fmt_duration", "loading_summary", "new_lines", "state_word", "step_views",
           "unit_names", "with_progress"]


@dataclass(frozen=True)
class StepView:
    """One row of the steps panel."""

    name: str
    status: str
    """pending, running, done, skipped or failed."""
    summary: str = ""
    elapsed_s: float | None = None
    """How long the step took (running: so far)."""
    age_s: float | None = field(default=None, compare=False)
    """Seconds since it finished (not compared: a row that only aged is not redrawn)."""
    proof: Mapping[str, Any] | None = None
    error: str | None = None
    hint: str | None = None
    started_at: float | None = None
    finished_at: float | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)


def expected_states(topology: Topology | None) -> tuple[str, ...]:
    """The steps of *topology*'s state machine (PD: six; single server: four)."""
    if topology is not None and topology.mode == "single":
        states = SINGLE_STATES
        if topology.router is None:
            states = tuple(s for s in states if s != "router_exposed")
        return states
    return PD_STATES


def step_views(states: tuple[str, ...], journal: JournalState | None, now: float, hints: Mapping[str, str] | None = None) -> tuple[StepView, ...]:
    """Rows for *states* from the journal's step records (absent: pending)."""
    out = []
    recs = journal.steps if journal is not None else {}
    for name in states:
        rec = recs.get(name)
        if rec is None:
            out.append(StepView(name=name, status="pending"))
            continue
        proof = rec.proof or None
        summary = (proof or {}).get("summary") or rec.error or (INTERRUPTED_SUMMARY if rec.status == "interrupted" else "")
        if rec.started_at is not None:
            end = rec.finished_at if rec.finished_at is not None else (now if rec.status == "running" else None)
            elapsed = (end - rec.started_at) if end is not None else None
        else:
            elapsed = None
        age = (now - rec.finished_at) if rec.finished_at is not None else None
        out.append(
            StepView(
                name=name,
                status=rec.status,
                summary=summary if rec.status != "running" else "running…",
                elapsed_s=max(0.0, elapsed) if elapsed is not None else None,
                age_s=max(0.0, age) if age is not None else None,
                proof=proof,
                error=rec.error,
                hint=(hints or {}).get(name),
                started_at=rec.started_at,
                finished_at=rec.finished_at,
            )
        )
    return tuple(out)


def loading_summary(data: Mapping[str, Any]) -> str:
    """A ``progress`` event's *data* as the steps panel says it: ``prefill loading 12s of ~10m00s · <last log line>``
    (without ``expected_cold_start_s``: ``… loading 12s · …``)."""
    expected = data.get("expected_cold_start_s")
    line = data.get("log_line") or "(no log line yet)"
    return (f"{data.get('role', '?')} loading {fmt_duration(data.get('elapsed_s'))}"
            + (f" of ~{fmt_duration(expected)}" if expected else "") + f" · {line}")


def with_progress(steps: tuple[StepView, ...], loading: Mapping[str, str]) -> tuple[StepView, ...]:
    """*steps* with each running step's summary replaced by *loading*'s text for it (step name → text, from its last
    ``progress`` event: :func:`loading_summary`); any other row as it is."""
    from dataclasses import replace

    return tuple(replace(s, summary=loading[s.name]) if s.status == "running" and s.name in loading else s
                 for s in steps)


def fmt_duration(s: float | None) -> str:
    """``0.4s``, ``12s``, ``3m05s``, ``2h04m``; ``-`` for None."""
    if s is None:
        return "-"
    if s < 10:
        return f"{s:.1f}s"
    if s < 60:
        return f"{s:.0f}s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


def state_word(state: str, sub_state: str | None) -> str:
    """A unit's state as an operator reads it: ``failed (why)`` for a failed one (systemd's ``Result=``, the
    process supervisor's sub-state: ``exit-code``, ``signal``, ``start-limit-hit``…), ``activating (auto-restart)``
    while it waits to be restarted after a crash (systemd's ``SubState=auto-restart``, the supervisor's own), else the
    state alone (``active``, ``inactive``, ``activating`` while it starts)."""
    why = sub_state or ""
    if state == "failed" and why not in ("", "failed", "dead"):
        return f"{state} ({why})"
    if state == "activating" and why == "auto-restart":
        return f"{state} ({why})"
    return state


def unit_names(topo: Topology) -> dict[str, str]:
    """Role name (and ``router``) → unit name, as the engine names units."""
    from pdctl.statemachine.service import unit_names as _u

    return _u(topo)
