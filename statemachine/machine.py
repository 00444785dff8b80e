"""The deployment state machine: explicit states, explicit transitions, a proof per step.

States (a step's name is the state it reaches)::

    planned → kernels_built → prefill_up → decode_up → kv_link_verified → router_exposed → parsers_configured

A single-server (non-PD) deployment has no KV link and no separate decode::

    planned → kernels_built → server_up → router_exposed → parsers_configured

(``router_exposed`` only when it has a router.) :meth:`StateMachine.advance` moves to the next
state only; anything else raises :class:`InvalidTransition`.

Each :class:`Step` has four parts:

* ``observe(ctx)`` — is the state already reached? Returns a :class:`Proof` (then the step is
  *skipped, with proof*) or None;
* ``apply(ctx)`` — make it so (start units, build kernels…);
* ``verify(ctx)`` — prove it: returns a :class:`Proof` (what was checked, the evidence) or raises
  :class:`VerifyFailed`;
* ``undo(ctx)`` — take the step back (used by ``down``), never called on failure: a failed run
  leaves what already runs as it was and says what to do.

:func:`run_steps` drives the machine, journals every status and proof atomically, and emits
events. It never prints, prompts or exits.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from pdctl.statemachine.errors import ApplyFailed, InvalidTransition, PdctlError, ProbeError, StepError, VerifyFailed
from pdctl.statemachine.events import Event, EventSink
from pdctl.statemachine.journal import StepRecord
from pdctl.units.errors import UnitsError

if TYPE_CHECKING:
    from pdctl.statemachine.steps import Context

__all__ = ["PD_STATES", "SINGLE_STATES", "Proof", "StateMachine", "Step", "role_steps", "run_steps"]

PD_STATES = ("kernels_built", "prefill_up", "decode_up", "kv_link_verified", "router_exposed", "parsers_configured")
SINGLE_STATES = ("kernels_built", "server_up", "router_exposed", "parsers_configured")


def role_steps(topo: Any) -> dict[str, str]:
    """The step that brings up each role of *topo* (a ``Topology``): ``prefill_up``, ``decode_up`` or ``server_up``
    by its kind, and ``router_exposed`` for the router, whose role name is ``router``."""
    return {r.name: f"{r.kind}_up" for r in topo.roles} | ({"router": "router_exposed"} if topo.router else {})


@dataclass(frozen=True)
class Proof:
    """What a step checked and what it saw. ``checks`` are sentences that held; ``evidence`` is
    raw data (status codes, JSON excerpts, counters); ``commands`` what the step ran."""

    summary: str
    checks: tuple[str, ...] = ()
    evidence: dict[str, Any] = field(default_factory=dict)
    commands: tuple[str, ...] = ()
    at: float = field(default_factory=time.time)
    not_needed: bool = False
    """The spec leaves the step out (e.g. kernels disabled): it is skipped as not needed, not as already satisfied."""

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["checks"] = list(self.checks)
        d["commands"] = list(self.commands)
        return d


class Step(ABC):
    """One transition of the machine. ``name`` is the state it reaches."""

    name: str = ""
    hint: str = ""
    """What the operator should do when this step fails."""

    def observe(self, ctx: Context) -> Proof | None:
        """Already satisfied? Default: never (probe-only steps re-prove every run)."""
        return None

    @abstractmethod
    def apply(self, ctx: Context) -> None: ...

    @abstractmethod
    def verify(self, ctx: Context) -> Proof: ...

    def undo(self, ctx: Context) -> None:
        """Take the step back. Default: nothing to undo."""
        return None

    def owned_units(self, ctx: Context) -> list[str]:
        """Units whose definition this step proves running (their fingerprints are journaled)."""
        return []


class StateMachine:
    """The current state and the allowed transitions (a straight line)."""

    def __init__(self, states: tuple[str, ...]) -> None:
        self.states = states
        self.state = "planned"

    @property
    def next_state(self) -> str | None:
        if self.state == "planned":
            return self.states[0]
        i = self.states.index(self.state)
        return self.states[i + 1] if i + 1 < len(self.states) else None

    def advance(self, to: str) -> None:
        """Move to *to*, which must be the next state. Raises :class:`InvalidTransition`."""
        if to != self.next_state:
            raise InvalidTransition(
                f"cannot go from {self.state!r} to {to!r}; the next state is {self.next_state!r}"
            )
        self.state = to

    @property
    def done(self) -> bool:
        return self.state == self.states[-1]


def run_steps(ctx: Context, steps: list[Step], sink: EventSink) -> StateMachine:
    """Run *steps* in order through a :class:`StateMachine`; journal and emit as it goes.

    Raises :class:`StepError` (with ``.step``) on the first failure, after journaling it.
    """
    machine = StateMachine(tuple(s.name for s in steps))
    state = ctx.journal_state
    for step in steps:
        t0 = time.monotonic()
        rec = StepRecord(status="running", started_at=time.time())
        state.steps[step.name] = rec
        ctx.journal.write(state)
        sink.emit(Event("step_started", f"{step.name}: started", step=step.name))
        try:
            proof = step.observe(ctx)
            if proof is not None:
                rec.status = "skipped"
                kind = "step_skipped"
                msg = (f"{step.name}: {proof.summary}" if proof.not_needed
                       else f"{step.name}: already satisfied — {proof.summary}")
            else:
                step.apply(ctx)
                sink.emit(Event("step_applied", f"{step.name}: applied, verifying", step=step.name, elapsed_s=time.monotonic() - t0))
                proof = step.verify(ctx)
                rec.status = "done"
                kind = "step_verified"
                msg = f"{step.name}: verified — {proof.summary}"
        except (PdctlError, UnitsError) as exc:
            probe = getattr(ctx.host, "probe_connection", None)
            if probe is not None:  # (an HTTP probe through an SSH forward fails as refused when the connection died)
                probe()
            lost = getattr(ctx.host, "connection_error", None)
            if lost is not None:
                # the host stopped answering: say so, whatever operation tripped over it
                err = ApplyFailed(f"lost the connection to host {ctx.host.name}: {lost.message}", step=step.name,
                                  hint=(f"{lost.hint}; " if lost.hint else "") + "apply again to converge once it answers")
            elif isinstance(exc, StepError):
                err = exc
            elif isinstance(exc, UnitsError):
                err = ApplyFailed(exc.message, step=step.name, hint=getattr(exc, "hint", None) or step.hint)
            else:
                evidence = exc.evidence_hint() if isinstance(exc, ProbeError) else None
                err = VerifyFailed(getattr(exc, "message", None) or str(exc), step=step.name,
                                   hint=getattr(exc, "hint", None) or evidence or step.hint)
            if err.step is None:
                err.step = step.name
            if err.hint is None:
                err.hint = step.hint
            rec.status = "failed"
            rec.error = str(err.message)
            rec.finished_at = time.time()
            ctx.journal.write(state)
            sink.emit(
                Event("step_failed", f"{step.name}: FAILED — {err.message}", step=step.name, elapsed_s=time.monotonic() - t0, data={"hint": err.hint})
            )
            raise err from (exc if err is not exc else None)
        rec.proof = proof.to_json()
        rec.finished_at = time.time()
        for unit in step.owned_units(ctx):
            state.units[unit] = ctx.fingerprint(unit)
        ctx.journal.write(state)
        machine.advance(step.name)
        sink.emit(Event(kind, msg, step=step.name, elapsed_s=time.monotonic() - t0, data={"proof": proof.to_json()}))  # type: ignore[arg-type]
    return machine
