"""The service layer both front ends call: load a spec, plan it, apply it, report status.

Functions here never print, prompt or exit. They take resolved inputs, return values, emit events
through an :class:`~pdctl.statemachine.events.EventSink`, and raise :class:`PdctlError` subclasses.
The headless CLI and the Textual console are thin shells over them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from pdctl.statemachine.journal import Journal, default_state_dir
from pdctl.statemachine.plan import Plan, make_plan
from pdctl.statemachine.rules import Finding, check
from pdctl.statemachine.spec import Deployment, load_spec
from pdctl.statemachine.topology import topology_of

__all__ = ["Loaded", "journal_for", "load", "plan_spec"]


@dataclass(frozen=True)
class Loaded:
    """A validated spec with its warnings and where its journal lives."""

    path: Path
    deployment: Deployment
    warnings: list[Finding]
    journal: Journal


def journal_for(dep: Deployment, state_dir: str | os.PathLike[str] | None = None) -> Journal:
    return Journal(default_state_dir(dep.name, dep.service_manager, override=state_dir), dep.name)


def load(spec_path: str | os.PathLike[str], *, state_dir: str | os.PathLike[str] | None = None) -> Loaded:
    """Read, validate and rule-check a spec. Raises SpecError; contacts no host."""
    dep = load_spec(spec_path)
    warnings = check(dep)
    return Loaded(Path(spec_path), dep, warnings, journal_for(dep, state_dir))


def plan_spec(loaded: Loaded) -> Plan:
    """The plan from what the journal says is deployed to what the spec asks."""
    state = loaded.journal.read()
    return make_plan(state.deployed, topology_of(loaded.deployment), from_serial=state.serial)
