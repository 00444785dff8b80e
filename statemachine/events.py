"""Progress events: how the engine talks to its front ends without printing.

The engine calls ``sink.emit(Event(...))``; the headless reporter renders events as text or JSON
lines, the console turns them into messages. An event never edits the plan. A sink may raise to
halt a run (the console's cancel does), which the engine treats like any step failure.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol

__all__ = ["APPLY_NOT_STARTED", "Event", "EventKind", "EventSink", "ListSink", "NullSink"]

EventKind = Literal[
    "plan",
    "apply_started",
    "step_started",
    "step_skipped",
    "step_applied",
    "step_verified",
    "step_failed",
    "role_removed",
    "progress",
    "apply_done",
    "apply_failed",
    "apply_interrupted",
    "info",
]


APPLY_NOT_STARTED = "interrupted before the apply started: nothing was changed; apply again"
"""What an apply interrupted before it changed anything says, where nothing of it runs (:meth:`Event.apply_not_started`):
not "what already runs stays as it is", nor ``pdctl down``, which would have nothing to stop."""


@dataclass(frozen=True)
class Event:
    """One thing that happened. ``elapsed_s`` is the step's (or the run's) elapsed wall time; a ``progress`` event's,
    how long its role has been waited for (its ``data``: ``role``, ``unit``, ``elapsed_s``,
    ``expected_cold_start_s``, ``bound_s``, ``log_line``), emitted every ``Timeouts.progress`` seconds while a role
    loads."""

    kind: EventKind
    message: str
    step: str | None = None
    elapsed_s: float | None = None
    data: dict[str, Any] = field(default_factory=dict)
    ts: float = field(default_factory=time.time)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def apply_not_started(cls, plan_id: str | None = None) -> Event:
        """The ``apply_interrupted`` event of an apply stopped before it changed anything and with nothing of the
        deployment recorded as running: before its plan (*plan_id* None: the CLI emits it), or after its plan but
        before ``apply_started`` on a first deployment (the engine). Its message is :data:`APPLY_NOT_STARTED`; ``stopped``
        is empty, as in every ``apply_interrupted`` that left no unit stopped for a restart."""
        return cls("apply_interrupted", APPLY_NOT_STARTED, data={"plan_id": plan_id, "stopped": []})

    @classmethod
    def apply_failed(cls, exc: BaseException, *, started: bool) -> Event:
        """The ``apply_failed`` event for *exc*: its message, step and hint (pdctl errors carry them); in ``data``,
        ``error`` and ``hint`` as every ``--json`` error object has them (the message, the fix), ``error_type`` the
        exception's type (``SpecError``, ``LockHeld``, ``ApplyFailed``…), ``started`` whether the apply had begun
        (its ``apply_started`` event came first; False: refused before its first step, nothing changed, its ``step``
        the one it would have failed at), and for a spec error ``findings``
        (:meth:`~pdctl.statemachine.errors.SpecError.findings_json`)."""
        from pdctl.statemachine.errors import PdctlError, findings_fields, os_error_text

        message = getattr(exc, "message", None) or (
            os_error_text(exc) if isinstance(exc, OSError) and not isinstance(exc, PdctlError) else str(exc))
        return cls("apply_failed", message, step=getattr(exc, "step", None),
                   data={"error": message, "hint": getattr(exc, "hint", None), "error_type": type(exc).__name__,
                         "started": started, **findings_fields(exc)})


class EventSink(Protocol):
    """Where events go. A sink may also have ``checkpoint()``, which the engine calls every poll of a wait that can
    last minutes (a model loading, a port still held): raising there halts the run like raising in ``emit``."""

    def emit(self, event: Event) -> None: ...


class NullSink:
    """Discards events."""

    def emit(self, event: Event) -> None:  # noqa: D102
        return None


class ListSink:
    """Keeps events in memory (tests, the console's step panel)."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def emit(self, event: Event) -> None:  # noqa: D102
        self.events.append(event)

    def kinds(self) -> list[tuple[str, str | None]]:
        return [(e.kind, e.step) for e in self.events]
