"""The service layer both front ends call: load a spec, plan it, apply it, report status.

Functions here never print, prompt or exit. They take resolved inputs, return values, emit events
through an :class:`~pdctl.statemachine.events.EventSink`, and raise :class:`PdctlError` subclasses.
The headless CLI and the Textual console are thin shells over them.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import os
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdctl.statemachine.errors import HostError, RunCancelled, StateDirUnwritable
from pdctl.statemachine.journal import INTERRUPTED_SUMMARY, Journal, default_state_dir
from pdctl.statemachine.plan import Plan, make_plan, not_restartable
from pdctl.statemachine.rules import Finding, check
from pdctl.statemachine.spec import Deployment, load_spec
from pdctl.statemachine.topology import Topology, topology_of, with_legacy_secrets_bridged
from pdctl.units import process_stopped, unsupervised_reason

__all__ = ["Loaded", "journal_for", "load", "plan_spec"]


@dataclass(frozen=True)
class Loaded:
    """A validated spec with its warnings and where its journal lives."""

    path: Path
    deployment: Deployment
    warnings: list[Finding]
    journal: Journal


def journal_for(dep: Deployment, state_dir: str | os.PathLike[str] | None = None) -> Journal:
    j = Journal(default_state_dir(dep.name, dep.service_manager, override=state_dir), dep.name)
    j.recorded_as = functools.partial(with_legacy_secrets_bridged, dep=dep)
    return j


def load(spec_path: str | os.PathLike[str], *, state_dir: str | os.PathLike[str] | None = None,
         discover: bool | str = False, rules: bool = True) -> Loaded:
    """Read, validate and rule-check a spec. Raises SpecError. Contacts no host, unless *discover*: then the
    hosts with ``inventory = "discover"`` that run roles are read (``pdctl.statemachine.inventory``; HostError
    when one cannot be) and the placement rules use what they report, as the units' NUMA binding does; with
    *discover* ``"try"`` (``status``, ``chat``, ``units``: they compare with or render what apply installs) or with
    *rules* False, a host that cannot be read keeps the facts the spec declares. With *rules* False (``down``,
    ``status``: they act on what the journal records, and a spec half-edited during an incident must not block them)
    a broken rule is returned among the warnings instead of raised; a spec that does not parse still raises."""
    dep = load_spec(spec_path)
    inventories = _discovered(dep, strict=rules and discover is True) if discover else None
    if not rules:
        from pdctl.statemachine.rules import validate

        found = [f for f in validate(dep, inventories=inventories) if f.level in ("error", "warning")]
        dep = _with_inventories(dep, inventories)
        return Loaded(Path(spec_path), dep, found, journal_for(dep, state_dir))
    warnings = check(dep, inventories=inventories)
    dep = _with_inventories(dep, inventories)
    return Loaded(Path(spec_path), dep, warnings, journal_for(dep, state_dir))


def _discovered(dep: Deployment, *, strict: bool) -> dict:
    """The inventories of *dep*'s hosts with ``inventory = "discover"`` that run roles (HostError where one cannot be
    read; with *strict* False that host is left out instead)."""
    from pdctl.statemachine.hosts import host_for
    from pdctl.statemachine.inventory import discover as _discover

    used = {r.host for _n, _k, r in dep.roles()}
    inventories = {}
    for key, h in sorted(dep.hosts.items()):
        if h.inventory == "discover" and key in used:
            try:
                host = host_for(h, name=key)
                try:
                    inventories[key] = _discover(host)
                finally:
                    host.close()
            except HostError:
                if strict:
                    raise
    return inventories


def _with_inventories(dep: Deployment, inventories: dict | None) -> Deployment:
    """*dep* with its hosts' ``gpu_numa`` / ``numa_cpus`` as discovered: what the units bind to
    (``topology.numa_binding`` reads them), as the rules checked it; a discovering host otherwise ran its roles
    unpinned, and its recorded topology (the binding) differed from a spec read without discovery."""
    if not inventories:
        return dep
    return dep.model_copy(update={"hosts": {
        key: h.model_copy(update={"gpu_numa": list(inventories[key].gpu_numa)
                                  if inventories[key].gpu_numa is not None else h.gpu_numa,
                                  "numa_cpus": inventories[key].numa_cpus
                                  if inventories[key].numa_cpus is not None else h.numa_cpus})
        if key in inventories else h
        for key, h in dep.hosts.items()}})


def plan_base(state, desired: Topology, running: Collection[str] | None = None) -> Topology | None:  # noqa: ANN001
    """What a plan toward *desired* starts from: what the journal records as deployed, unless an interrupted apply
    toward another topology (``state.target``) had begun and going from there to *desired* changes the topology
    while going from the recorded deployment does not (PD half collapsed into one server, then the PD spec applied
    again; or a role's TP or GPUs changed): once one of the target's roles was started for it (its unit journalled),
    or proven as the target shapes it where that differs from the recorded role (its step done since the target was
    journalled: its unit's record is a plain fingerprint again, no longer ``started:``), that return changes what
    runs, so it is planned, named and confirmed from the interrupted target; so is any *desired* that lacks a role the
    target started (apply stops and removes it), whatever going from the recorded deployment needs. With nothing
    recorded as deployed (a first deployment interrupted), the plan starts from that target once one of its units was
    started for it.
    *running*: the target's units that run now (:func:`running_units`), where the caller asked the service manager:
    a unit journalled as started that does not run (the apply was interrupted as it started it, or it stopped since)
    changed nothing that going back would undo, so it does not count as begun. None: every record counts."""
    deployed, target = state.deployed, state.target
    if target is None or target == desired:
        return deployed

    def runs(unit: str) -> bool:
        return running is None or unit in running

    if deployed is None:
        # an interrupted first deployment toward another topology: once it started a unit, apply stops and removes
        # what *desired* lacks of it, so the plan starts from it (it read "a first deployment", every role added)
        return target if any(n in state.units and runs(n) for n in unit_names(target).values()) else None
    from pdctl.statemachine.steps import STARTED

    names, wanted = unit_names(target), {x.name for x in desired.roles}
    was = {r.name: r for r in deployed.roles} | {"router": deployed.router}
    now = {r.name: r for r in target.roles} | {"router": target.router}
    proven = proven_by_unfinished(state, target)
    # a role of the target that desired lacks and that has a unit record, or one that was (re)started for the target,
    # or a role (or the router) the target reshapes that it proved so; each only while its unit runs
    dropping = any(r.name not in wanted and names[r.name] in state.units and runs(names[r.name]) for r in target.roles)
    began = dropping or any(str(state.units.get(names[r.name], "")).startswith(STARTED) and runs(names[r.name])
                            for r in target.roles) \
        or any(n in proven and now[n] != was.get(n) and runs(names[n]) for n in names)
    # (a role the target started that *desired* lacks is stopped and removed by apply: planned from the recorded
    # deployment, which never had it, the plan would not list it, nor the topology change its removal is, even where
    # that plan needs a confirmation of its own: a reshape, whose id was the one confirmed before the interruption)
    if began and make_plan(target, desired).requires_confirmation \
            and (dropping or not make_plan(deployed, desired).requires_confirmation):
        return target
    return deployed


def running_units(loaded: Loaded, state, *, host=None) -> set[str] | None:  # noqa: ANN001
    """While an apply toward another topology than the spec's is unfinished, the units of its target that the journal
    records (:func:`plan_base` reads no other) and that run now (active, activating, deactivating or reloading); None
    otherwise (:func:`plan_base` then needs none). Asks the service manager on *host* (else the spec's) and raises
    what that raises."""
    if state.target is None or state.target == topology_of(loaded.deployment):
        return None
    from pdctl.statemachine import launch

    dep = loaded.deployment
    manager = launch.manager_for(as_recorded_manager(dep, state), host or deployment_host(dep),
                                 state_dir=str(loaded.journal.dir))
    # (a unit not installed runs nothing: its manager is not asked, as not_running does not ask it)
    return {u for u in unit_names(state.target).values() if u in state.units and manager.installed_text(u) is not None
            and manager.status(u).state in ("active", "activating", "deactivating", "reloading")}


def proven_by_unfinished(state, desired: Topology) -> set[str]:  # noqa: ANN001
    """Roles (and ``router``) that an unfinished apply toward *desired* itself proved: their step journalled done or
    skipped since that apply journalled *desired* as its target (it cleared the steps then); :func:`plan_base` reads
    it (a reshaped role proven so makes going back a topology change). What the plan keeps of them as they run is
    :func:`runs_now`'s. Empty without an unfinished apply, or for one toward another topology."""
    if state.target is None or state.target != desired:
        return set()
    from pdctl.statemachine.machine import role_steps

    return {name for name, step in role_steps(desired).items()
            if (rec := state.steps.get(step)) is not None and rec.status in ("done", "skipped")}


def not_running(loaded: Loaded, state, base: Topology | None, *, host=None) -> dict[str, str]:  # noqa: ANN001
    """While an apply is unfinished (the journal holds its target), what of *base* (the plan's from side,
    :func:`plan_base`) does not run: role names and ``router``, each with :data:`~pdctl.statemachine.plan.NOT_INSTALLED`
    (its unit is gone: an apply that dropped it removed it, whether or not its journalled drop list caught up) or its
    unit's state (``inactive``, ``failed``, ``deactivating``), as :func:`make_plan` takes them. Empty with no apply
    unfinished (a recorded role that does not run is then the drift :func:`plan_unsettled` tells) or nothing to base
    on. Asks the service manager on *host* (else the spec's): HostError, ManagerUnavailable… when it cannot be
    asked."""
    if state.target is None or base is None:
        return {}
    from pdctl.statemachine import launch
    from pdctl.statemachine.plan import NOT_INSTALLED

    dep = loaded.deployment
    manager = launch.manager_for(dep, host or deployment_host(dep), state_dir=str(loaded.journal.dir))
    out: dict[str, str] = {}
    for name, unit in unit_names(base).items():
        if manager.installed_text(unit) is None:
            out[name] = NOT_INSTALLED
        elif (now := manager.status(unit).state) not in ("active", "activating"):
            out[name] = now
    return out


def runs_now(loaded: Loaded, state, *, host=None) -> dict:  # noqa: ANN001
    """While an apply is unfinished (the journal holds its target), how it left the spec's roles (and ``router``) that
    run now, where the plan's from side (:func:`plan_base`) does not say it: each a
    :class:`~pdctl.statemachine.plan.Runs`, as :func:`make_plan` takes them, and as apply's steps will judge them from
    the same journal records:

    * kept: the unit runs, supervised, and its journal record is this spec's definition started (``steps.STARTED``:
      apply waits for it while it loads and proves it) or proven by that apply (its step done since that apply
      journalled its target);
    * kept too: that apply rewrote its unit file for its own spec without restarting it, and the record tells that the
      process (the same main PID) runs this spec's definition (``steps.running_definition``); or that apply left it
      alone, its record still the proven fingerprint of this spec's definition (the router of a prefill group added
      and then taken back before the router's step);
    * restarted: the unit runs, and its record is another definition than this spec's while that apply started it
      (its own spec's: what runs is compared from there) or rewrote its unit file without restarting it
      (``steps.RESTARTING``; what runs is still the from side's).

    Empty with no apply unfinished, or when the spec's units cannot be rendered here (an unset secret, which apply
    refuses before any step). Asks the service manager on *host* (else the spec's), raising what that raises."""
    if state.target is None:
        return {}
    from pdctl.statemachine import launch
    from pdctl.statemachine.errors import PdctlError
    from pdctl.statemachine.machine import role_steps
    from pdctl.statemachine.plan import Runs
    from pdctl.statemachine.steps import RESTARTING, STARTED, fingerprint_of, running_definition

    dep = loaded.deployment
    desired = topology_of(dep)
    try:
        units = launch.unit_set_for(dep, state_dir=str(loaded.journal.dir))
    except PdctlError:
        return {}
    manager = launch.manager_for(dep, host or deployment_host(dep), state_dir=str(loaded.journal.dir))
    step_of = role_steps(desired)
    target = {r.name: r for r in state.target.roles} | ({"router": state.target.router} if state.target.router else {})
    out: dict = {}
    for name, unit in unit_names(desired).items():
        rec = state.units.get(unit)
        if rec is None:
            continue
        st = manager.status(unit)
        if st.state not in ("active", "activating"):
            continue
        fp = fingerprint_of(units, unit)
        proven = (step := state.steps.get(step_of[name])) is not None and step.status in ("done", "skipped")
        if not st.supervised:  # (never waited for nor proven: apply restarts it under a new supervisor)
            out[name] = Runs(restart=f"it runs unsupervised (its supervisor is {unsupervised_reason(st.sub_state)})")
        elif rec == STARTED + fp:
            out[name] = Runs(kept="the unfinished apply started it with this spec's definition" + (
                " and proved it" if proven else "; apply waits until it serves, then proves it"))
        elif rec == fp and proven:
            out[name] = Runs(kept="the unfinished apply started it with this spec's definition and proved it")
        elif rec == fp:  # (proven running with it before that apply, which never rewrote nor restarted it)
            out[name] = Runs(kept="it runs this spec's definition, as proven before the unfinished apply, which left it "
                                  "alone")
        elif rec.startswith(RESTARTING) and running_definition(rec, st.main_pid) == fp:
            out[name] = Runs(kept="it runs this spec's definition (the unfinished apply rewrote its unit file for its "
                                  "own spec and had not restarted it; apply writes the file back)")
        elif rec.startswith(RESTARTING):
            out[name] = Runs(restart="its unit file differs from the running process (the unfinished apply rewrote "
                                     "the file for its own spec and had not restarted the process)")
        elif rec != fp and (rec.startswith(STARTED) or proven):
            out[name] = Runs(restart="it runs what the unfinished apply started for its own spec, not this spec's "
                                     "definition", was=target.get(name))
    return out


def plan_spec(loaded: Loaded, state=None, *, restart: Collection[str] = (), host=None) -> Plan:  # noqa: ANN001
    """The plan from what the journal says is deployed (:func:`plan_base`) to what the spec asks, told against what
    runs while an apply is unfinished and none runs now (:func:`not_running`, :func:`runs_now`: they ask the service
    manager, and raise what that raises); *state*: the journal's, when the caller has read it already; *restart*: as
    :func:`apply`'s; *host*: the deployment's, where the caller holds it open (else connected to here)."""
    state = loaded.journal.read() if state is None else state
    desired = topology_of(loaded.deployment)
    base = plan_base(state, desired)
    # (not while an apply or down holds the lock: what runs is changing under it, and plan_unsettled says so)
    down: dict = {}
    runs: dict = {}
    if state.target is not None and _lock_holder(loaded) is None:
        the_host = host or deployment_host(loaded.deployment)  # (one connection for every question)
        try:
            base = plan_base(state, desired, running_units(loaded, state, host=the_host))
            down = not_running(loaded, state, base, host=the_host)
            runs = runs_now(loaded, state, host=the_host)
        finally:
            if host is None:
                the_host.close()
    elif state.target is None and state.deployed is not None:
        runs = rendered_otherwise(loaded, state, make_plan(base, desired, from_serial=state.serial,
                                                           generation=state.generation, restart=restart))
    unrecorded = unrecorded_units(loaded, state, host=host) if state.deployed is None and state.target is None else ()
    plan = make_plan(base, desired, from_serial=state.serial, generation=state.generation, not_running=down, runs=runs,
                     unrecorded=unrecorded, restart=restart)
    from pdctl.statemachine.capacity import plan_capacity  # (what the change does to the KV pools; no host asked)

    plan = plan.model_copy(update={"capacity": plan_capacity(plan, loaded.deployment)})
    return plan.model_copy(update={"since_down": since_down(state, desired)}) if base is None else plan


def since_down(state, desired: Topology) -> str | None:  # noqa: ANN001
    """:attr:`~pdctl.statemachine.plan.Plan.since_down` for a first deployment of *desired*: the topology changes
    from what ``pdctl down`` last took down (``state.taken_down``) in words, or None where there is no such record or
    none differs. (helper-109: after `down --yes`, a PD deployment's name was applied as one server on every interface
    with nothing said.)"""
    if state.deployed is not None or state.target is not None or state.taken_down is None:
        return None
    words = make_plan(state.taken_down, desired).topology_changes
    if not words:
        return None
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(state.taken_down_at)) if state.taken_down_at else "?"
    return (f"{desired.name!r} was deployed otherwise until `pdctl down` took it down at {when}; against that, this "
            f"spec changes the topology: {'; '.join(words)}")


def unrecorded_units(loaded: Loaded, state, *, host=None) -> tuple[str, ...]:  # noqa: ANN001
    """With nothing recorded as deployed and no apply unfinished: the deployment's services installed all the same
    under its service manager here (its state directory's supervisor, or systemd's unit folder), which no journal
    records (:attr:`~pdctl.statemachine.plan.Plan.unrecorded`); ``()`` otherwise, or where the host or its manager
    cannot be asked (apply then fails on that itself). Asks *host* (else the spec's: connects)."""
    if state.deployed is not None or state.target is not None:
        return ()
    from pdctl.statemachine import launch
    from pdctl.statemachine.errors import PdctlError

    dep = loaded.deployment
    try:
        the_host = host or deployment_host(dep)
    except OSError:
        return ()
    try:
        manager = launch.manager_for(dep, the_host, state_dir=str(loaded.journal.dir))
        return tuple(manager.installed_units_of(dep.name))
    except (OSError, PdctlError):
        return ()
    finally:
        if host is None:
            the_host.close()


def rendered_otherwise(loaded: Loaded, state, plan: Plan) -> dict:  # noqa: ANN001
    """With no apply unfinished: the spec's roles (and ``router``) that *plan* (the comparison of the recorded
    topology with the spec's) does not restart, yet whose unit definition (command line, environment, limits: its
    fingerprint, ``steps.fingerprint_of``) differs from the one apply proved running (the journal's record), each a
    :class:`~pdctl.statemachine.plan.Runs` that restarts it: apply restarts such a unit (its step never skips it), so
    the plan says so. That is what a pdctl that renders a unit otherwise (an upgrade) or an ``engine.python`` or
    router executable resolved otherwise gives. Empty where the units cannot be rendered here (an unset secret, which
    apply refuses first). Contacts no host."""
    from pdctl.statemachine import launch
    from pdctl.statemachine.errors import PdctlError
    from pdctl.statemachine.plan import Runs
    from pdctl.statemachine.steps import fingerprint_of

    try:
        units = launch.unit_set_for(loaded.deployment, state_dir=str(loaded.journal.dir))
    except PdctlError:
        return {}
    restarted = set(plan.restarts()) | {c.address.removeprefix("role.") for c in plan.changes
                                        if c.action in ("create", "replace", "delete")}
    out: dict = {}
    roles_changed = [c.address.removeprefix("role.") for c in plan.changes
                     if c.address.startswith("role.") and c.action in ("create", "delete")]
    for name, unit in unit_names(topology_of(loaded.deployment)).items():
        rec = state.units.get(unit)
        if name in restarted or rec is None or rec == fingerprint_of(units, unit):
            continue
        if name == "router" and roles_changed:  # (a role renamed is one removed and one added)
            out[name] = Runs(restart="its unit names the role units it starts after (Wants=, After=), and this "
                                     f"plan adds or removes roles ({', '.join(roles_changed)}); apply restarts it")
            continue
        out[name] = Runs(restart="its unit's definition (command line, environment, limits) differs from the one apply "
                                 "proved running, though the settings compared above do not: pdctl renders it "
                                 "otherwise now (after an upgrade), or a path it resolves changed; apply restarts it")
    return out


def runtime_drift(loaded: Loaded, recorded=None, *, host=None) -> tuple[list[str], list[str]]:  # noqa: ANN001
    """What of a deployed topology does not serve now (from :func:`status`), one phrase per role, as ``(lasting,
    answers)``: *lasting* a unit not running, unsupervised, or its port answered by another process (apply has work);
    *answers* only a failed ``/health`` or ``/readiness`` probe of a running unit, which a busy server can give for a
    while (SGLang's ``/health`` runs a one-token generation: ``shared/reference/sglang-pd.md``). Both empty when all
    serve or nothing is deployed. Raises what :func:`status` raises (a host or service manager that cannot be
    asked: HostError, ManagerUnavailable…), never "all serve" for it. *recorded*: the journal's state, when the caller
    has read it already; *host*: as :func:`status`'s."""
    if (loaded.journal.read() if recorded is None else recorded).deployed is None:
        return [], []
    st = status(loaded, host=host)
    lasting: list[str] = []
    answers: list[str] = []
    for r in st["roles"]:
        foreign = bool(r["health"]) and not r.get("port_owned", True)
        if not r.get("supervised", True):
            lasting.append(f"{r['name']} UNSUPERVISED (its supervisor is {unsupervised_reason(r.get('sub_state'))})")
        elif r.get("main_stopped"):  # (no probe would answer while it is stopped, and apply restarts it)
            lasting.append(f"{r['name']}'s main process (PID {r['main_pid']}) is stopped (kill -STOP?): apply restarts "
                           "it")
        elif r["state"] != "active" or foreign:
            lasting.append(f"{r['name']} {r['state']}, health {r['health'] or 'down'}" + (
                " (from its own process, whose supervisor's files are gone)" if foreign and r.get("port_orphaned")
                else " (from another process on its port)" if foreign else ""))
        elif not r["healthy"]:
            answers.append(f"{r['name']} active, health {r['health'] or 'down'}")
    if (st.get("target") or {}).get("enabled") is False:  # installed, not enabled: a reboot would not start it
        lasting.append(f"{st['target']['unit']} is not enabled, so a reboot would not start the deployment")
    elif (st.get("target") or {}).get("state") not in (None, "active"):  # (apply starts it once every step is proven)
        lasting.append(f"{st['target']['unit']} is {st['target']['state']} (the units it groups run without it; "
                       "`systemctl stop` of it would not stop them): apply starts it")
    for path in st.get("unit_files_not_pdctls") or ():
        lasting.append(f"{path} is not a unit file pdctl wrote (damaged?): apply refuses it until it is restored or "
                       "moved aside")
    for unit in st.get("missing_units") or ():
        lasting.append(f"{unit}'s files are gone (removed outside pdctl?): apply stops what it still runs and installs it "
                       "again")
    for unit in st.get("edited_units") or ():  # (a crash or reboot would start what the edit says)
        lasting.append(f"{unit}'s unit file differs from what pdctl writes for the definition it proved (edited "
                       "outside pdctl?): apply writes it back, and restarts the unit if it does not serve as specified")
    rt = st.get("router")
    if rt and not rt.get("supervised", True):
        lasting.append(f"router UNSUPERVISED (its supervisor is {unsupervised_reason(rt.get('sub_state'))})")
    elif rt and rt.get("main_stopped"):
        lasting.append(f"the router's main process (PID {rt['main_pid']}) is stopped (kill -STOP?): apply restarts it")
    elif rt and rt["state"] != "active":
        lasting.append(f"router {rt['state']}, readiness {rt.get('readiness') or 'down'}")
    elif rt and rt.get("mismatches_lasting"):
        # (registered otherwise than the deployment: started for other workers, or one removed from it since. Before
        # the readiness: a PD router missing a worker also answers 503, which alone reads as a busy probe)
        lasting.append(f"router active, readiness {rt.get('readiness') or 'down'}, its workers differ from the "
                       "deployment: " + "; ".join(rt["mismatches_lasting"]))
    elif rt and rt.get("readiness") != 200:
        answers.append(f"router active, readiness {rt.get('readiness') or 'down'}")
    elif rt and rt.get("mismatches"):  # (a worker its health checks call unhealthy, until its server answers)
        answers.append("router: " + "; ".join(rt["mismatches"]))
    return lasting, answers


@dataclass(frozen=True)
class Unsettled:
    """Why ``apply`` has work (or what it would meet) beyond *plan*'s changes: ``kind`` None (what runs is what was
    recorded), ``"running"`` (an apply or down holds the lock now), ``"unfinished"`` (an earlier apply did not finish:
    apply resumes it) or ``"drift"`` (a recorded role does not serve as proven: apply restarts it); ``text`` the reason
    in words (what ``Plan.unsettled`` holds); ``notes`` lines for the operator, without the ``note:`` prefix; ``kept``
    the roles (and ``router``) whose update or replacement the plan keeps as an unfinished apply left them
    (:attr:`~pdctl.statemachine.plan.ResourceChange.kept`): the comparison restarts them, apply does not."""

    kind: str | None = None
    text: str = ""
    notes: tuple[str, ...] = ()
    kept: tuple[str, ...] = ()


def plan_unsettled(loaded: Loaded, recorded, plan: Plan, *, host=None) -> Unsettled:  # noqa: ANN001
    """What ``pdctl plan`` and the console say beside *plan* (made from *recorded*, the journal's state): see
    :class:`Unsettled`. Reads the lock, and for a settled journal what runs (:func:`runtime_drift`, whose errors it
    raises, on *host* as :func:`status` does)."""
    holder = loaded.journal.held_by()
    if holder is not None:  # an apply or down runs now: its journal target is work in progress, not a failure
        what = f"`pdctl {holder.get('purpose') or 'apply'}`"
        return Unsettled("running", f"a {what} is running now (pid {holder.get('pid', '?')}, {holder.get('user', '?')}@"
                                    f"{holder.get('host', '?')}, since {holder.get('since', '?')}), so what runs is changing",
                         (f"a {what} of this deployment is running now; plan again when it has finished",))
    pending = recorded.target
    if pending is not None:
        other = pending != plan.to_topology
        notes = ["an earlier apply did not finish; `pdctl apply` re-proves every step and restarts what it left "
                 "half-changed"]
        if plan.from_topology == pending and recorded.deployed is None:
            notes.append("that apply (a first deployment) had started roles of its spec, so this plan starts from "
                         "what it was applying: apply stops and removes what this spec lacks of it")
        elif plan.from_topology == pending != recorded.deployed:
            notes.append("that apply had begun to change the topology (roles of its spec were started), so this plan "
                         "starts from what it was applying: going back is a topology change too")
        # (the roles the comparison restarts that the plan keeps as that apply left them: it says so itself)
        kept = tuple(c.address.removeprefix("role.") for c in plan.changes
                     if c.kept is not None and c.action in ("update", "replace"))
        return Unsettled("unfinished", "an earlier apply" + (" toward another spec" if other else "") + " did not "
                         "finish, so what runs may be partly what it was applying", tuple(notes), kept)
    drift, answers = runtime_drift(loaded, recorded, host=host)
    notes = ()
    if drift or answers:
        notes = (f"the plan compares the spec with what was deployed, but what runs no longer serves as proven: "
                 f"{'; '.join(drift + answers)}. `pdctl apply` re-proves every step and restarts what does not serve as "
                 "specified" + ("; a running server failing a probe may only be busy: `pdctl status` again shows "
                                "whether it lasts" if answers else ""),)
    if drift:
        return Unsettled("drift", f"what runs no longer serves as proven: {'; '.join(drift)}", notes)
    return Unsettled(None, "", notes)


def own_units(state, desired: Topology) -> set[str]:  # noqa: ANN001
    """The units whose processes may hold the deployment's ports: those of *desired*, of what the journal *state*
    records as deployed and as an unfinished apply's target, and an earlier apply's dropped roles not yet removed."""
    own = {u for t in (desired, state.deployed, state.target) if t is not None for u in unit_names(t).values()}
    return own | set(state.removing)


def host_warnings(loaded: Loaded, recorded, *, host=None) -> dict[str, Any]:  # noqa: ANN001
    """What apply's checks before its first step would refuse on the host now, as :class:`~pdctl.statemachine.plan.Plan`
    fields for the warnings after a plan: ``ports_held``, the ports of the spec's deployment that a process outside it
    holds (:func:`~pdctl.statemachine.steps.ports_held_elsewhere`, without its wait for this deployment's own previous
    processes); ``gpus_held``, its roles' GPUs that a compute process outside it uses
    (:func:`~pdctl.statemachine.steps.gpus_held_elsewhere`; None on a host without nvidia-smi); ``binds_unusable``,
    why apply would refuse the spec's bind addresses or engine Python (:func:`~pdctl.statemachine.steps.
    bind_addresses_unusable`'s refusal and hint, in words), a router executable that is not one there
    (:func:`~pdctl.statemachine.steps.router_executable_unusable`), a NUMA node the host lacks
    (:func:`~pdctl.statemachine.steps.numa_nodes_missing`) or a ``service_user`` it cannot run the roles as
    (:func:`~pdctl.statemachine.steps.service_user_unusable`), one refusal a line; None: it would not. *recorded*: the
    journal's state.
    Reads ``/proc``, runs nvidia-smi and one probe on the deployment's host (*host*, else the spec's: one connection
    for all) and asks its service manager; raises what they raise (HostError, ManagerUnavailable…). Changes
    nothing."""
    from pdctl.statemachine.errors import ApplyFailed
    from pdctl.statemachine.steps import (
        bind_addresses_unusable,
        gpus_held_elsewhere,
        numa_nodes_missing,
        ports_held_elsewhere,
        ports_in_ephemeral_range,
        router_executable_unusable,
        running_from_another_state_dir,
        service_manager_changed,
        service_user_unusable,
        unit_files_not_pdctls,
        units_of_another_deployment,
    )

    desired = topology_of(loaded.deployment)
    the_host = host or deployment_host(loaded.deployment)
    # (what the checks read never depends on a secret's value: a spec whose env: secret is unset here, which apply
    # refuses by name, still has its ports and GPUs checked)
    if loaded.deployment.secrets:
        import dataclasses

        loaded = dataclasses.replace(loaded, deployment=loaded.deployment.model_copy(update={"secrets": {}}))
    try:
        _can_run_commands(loaded.deployment, the_host)  # (a nologin account answers every check with garbage)
        ctx = build_context(loaded, host=the_host)
        try:
            try:  # (its units run under the recorded manager: the spec's has nothing to compare, and may be absent)
                service_manager_changed(ctx)
            except ApplyFailed as exc:
                return {"ports_held": (), "gpus_held": None, "gpus_unchecked": "not checked: " + exc.message,
                        "binds_unusable": exc.message + (f"\n  hint: {exc.hint}" if exc.hint else "")}
            own = own_units(recorded, desired) | set(unrecorded_units(loaded, recorded, host=the_host))
            held = tuple(ports_held_elsewhere(ctx, own))
            try:
                gpus, gpus_unchecked = gpus_held_elsewhere(ctx, own), None
            except HostError as exc:  # (nvidia-smi failed, hung or answered garbage: the ports stand on their own)
                gpus, gpus_unchecked = None, exc.message
            refusals = []
            # (each a refusal of its own before apply's first step, exit 3; a NUMA node the host lacks was found
            # only by apply, after the operator had confirmed the plan)
            for refuse in (units_of_another_deployment, unit_files_not_pdctls, bind_addresses_unusable,
                           router_executable_unusable, numa_nodes_missing, service_user_unusable,
                           running_from_another_state_dir):
                try:
                    refuse(ctx)
                except ApplyFailed as exc:
                    refusals.append(exc.message + (f"\n  hint: {exc.hint}" if exc.hint else ""))
            return {"ports_held": held, "gpus_held": None if gpus is None else tuple(gpus),
                    "gpus_unchecked": gpus_unchecked, "binds_unusable": "\n".join(refusals) or None,
                    "ports_ephemeral": ports_in_ephemeral_range(ctx)}
        finally:
            ctx.client.close()
    finally:
        if host is None:
            the_host.close()


def plan_host_checks(loaded: Loaded, recorded, *,  # noqa: ANN001
                     catch: tuple[type[Exception], ...] | None = None, host=None,  # noqa: ANN001
                     ) -> tuple[dict[str, Any], str | None]:
    """:func:`host_warnings` for the warnings after a plan (``pdctl plan``, the console's plan tab), and
    ``secrets_refused`` (:func:`~pdctl.statemachine.launch.resolve_secrets`'s refusal, in words) where apply would
    refuse the spec's secrets here, and in ``binds_unusable`` also a state directory that systemd cannot name
    (:func:`_unit_files_refusal`): ``(fields, None)``, or (only those two fields, *why*) where the host or its
    service manager cannot be asked (*catch*: the errors that say so, by
    default PdctlError, UnitsError and OSError): a warning is not worth failing the plan over, and apply checks again
    before its first step. *why* is a sentence for people. Asks *host* (else the spec's: connects)."""
    from pdctl.statemachine.errors import PdctlError
    from pdctl.units import UnitsError

    from pdctl.statemachine.launch import resolve_secrets

    expected = (PdctlError, UnitsError, OSError)
    refused = {}
    try:  # (no host involved: said whether or not the host can be asked)
        resolve_secrets(loaded.deployment)
    except PdctlError as exc:
        refused = {"secrets_refused": exc.message + (f"\n  hint: {exc.hint}" if exc.hint else "")}
    unrenderable = _unit_files_refusal(loaded)  # (no host involved either: the state directory's path)
    try:
        fields = host_warnings(loaded, recorded, host=host)
    except catch or expected as exc:
        said = getattr(exc, "message", None) or (str(exc) if isinstance(exc, expected) else f"{type(exc).__name__}: {exc}")
        return {**refused, **({"binds_unusable": unrenderable} if unrenderable else {})}, (
            "the plan could not check whether the deployment's ports and GPUs are free (apply checks them before its "
            f"first step): {said}")
    # (each a refusal of its own before apply's first step, exit 3: both said)
    fields["binds_unusable"] = "\n".join(x for x in (fields.get("binds_unusable"), unrenderable) if x) or None
    return {**fields, **refused}, None


def _unit_files_refusal(loaded: Loaded) -> str | None:
    """Why apply would refuse, before its first step, to write the spec's unit files under its state directory
    (:func:`~pdctl.statemachine.steps.unit_files_refusal`: a path systemd cannot name), with the fix; None where it
    would not. Each secret stands in as a placeholder: its value is not in the file, its EnvironmentFile= path is."""
    from pdctl.statemachine.launch import scope_for, unit_set_for
    from pdctl.statemachine.steps import unit_files_refusal

    dep = loaded.deployment
    if dep.secrets:
        dep = dep.model_copy(update={"secrets": {k: "placeholder" if isinstance(v, str) else
                                                 v.model_copy(update={"value": "placeholder"})
                                                 for k, v in dep.secrets.items()}})
    refusal = unit_files_refusal(unit_set_for(dep, state_dir=str(loaded.journal.dir)), scope_for(dep),
                                 topology_of(dep).roles[0].kind + "_up")
    return None if refusal is None else refusal.message + (f"\n  hint: {refusal.hint}" if refusal.hint else "")


# --- apply ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ApplyResult:
    """What an apply did: the plan, the final state reached, each step's outcome."""

    plan: Plan
    state: str
    steps: dict[str, dict]


def _stale(saved: Plan, why: str, *, hint: str = "make a new plan with `pdctl plan SPEC -o FILE` and review it"):  # noqa: ANN202
    """Apply's refusal of the saved plan *saved*: ``saved plan <id> <why>; nothing was changed``."""
    from pdctl.statemachine.errors import StalePlanError

    return StalePlanError(f"saved plan {saved.plan_id} {why}; nothing was changed", plan_id=saved.plan_id, hint=hint)


def _resolve_confirmation(plan: Plan, confirm: str | None) -> None:
    from pdctl.statemachine.errors import TopologyNotConfirmed

    if confirm is not None and not confirm.strip():  # (`--confirm-topology ""`: an unset variable in a script)
        raise TopologyNotConfirmed(
            "--confirm-topology was given an empty plan id; nothing was changed",
            plan_id=plan.plan_id,
            hint=(f"give the id `pdctl plan` prints (this plan's: {plan.plan_id})" if plan.requires_confirmation
                  else "drop --confirm-topology: this plan changes no topology"),
        )
    if not plan.requires_confirmation:
        if confirm is not None and confirm != plan.plan_id and plan.has_changes:
            # the operator confirmed a topology change this spec no longer asks (or a typo): what they reviewed is
            # not what would run. (With no changes at all, the same command run again after it succeeded, nothing
            # would run: accepted.)
            raise TopologyNotConfirmed(
                f"--confirm-topology {confirm} names another plan; this plan is {plan.plan_id} and changes no "
                "topology; nothing was changed",
                plan_id=plan.plan_id,
                hint="review `pdctl plan SPEC`: drop --confirm-topology, or give this plan's id",
            )
        return
    if confirm is None:
        raise TopologyNotConfirmed(
            f"plan {plan.plan_id} changes the topology ({'; '.join(plan.topology_changes)}); nothing was changed",
            plan_id=plan.plan_id,
            hint=f"review `pdctl plan`, then re-run with --confirm-topology {plan.plan_id}",
        )
    if confirm != plan.plan_id:
        raise TopologyNotConfirmed(
            f"--confirm-topology {confirm} names another plan; this plan is {plan.plan_id} "
            f"({'; '.join(plan.topology_changes)}); nothing was changed",
            plan_id=plan.plan_id,
            hint="a confirmation applies to exactly one plan: review the new plan and confirm its id",
        )


def load_saved_plan(path: str | os.PathLike[str]) -> Plan:
    from pdctl.statemachine.errors import PdctlError

    from pydantic import ValidationError

    try:
        plan = Plan.model_validate_json(Path(path).read_text())
    except ValidationError as exc:  # JSON, but not a plan's: say which fields, not pydantic's whole report
        errs = exc.errors()
        if errs and errs[0]["type"] == "json_invalid":  # not JSON at all (cut short, another file)
            raise PdctlError(f"{path}: not a readable pdctl plan: not valid JSON ({errs[0]['msg']})",
                             hint="save one with `pdctl plan SPEC -o FILE`") from None
        where = ", ".join(".".join(map(str, e["loc"])) or "(root)" for e in errs[:4]) + (", …" if len(errs) > 4 else "")
        raise PdctlError(f"{path}: not a pdctl plan ({len(errs)} field(s) missing or wrong: {where})",
                         hint="save one with `pdctl plan SPEC -o FILE`, and apply the file unedited") from None
    except (OSError, ValueError) as exc:
        raise PdctlError(f"{path}: not a readable pdctl plan: {exc}",
                         hint="save one with `pdctl plan SPEC -o FILE`") from None
    if not plan.spec_path:
        raise PdctlError(f"{path}: the saved plan names no spec file",
                         hint="save it again with `pdctl plan SPEC -o FILE`")
    return plan


def _holder_words(listener) -> str:  # noqa: ANN001
    """``PID 123 (nc -l 44010)`` for a :class:`~pdctl.statemachine.ports.Listener` (``a process of another user``
    where its owner could not be read)."""
    if listener.pid is None:
        return "a process pdctl cannot see (another user's, or another namespace's)"
    return f"PID {listener.pid}" + (f" ({listener.command})" if listener.command else "")


def _port_holder(host, port: int, found, own: set[str],  # noqa: ANN001
                 state_dir: str) -> tuple[str | None, str | None, bool]:
    """Who a listener on *port* (among *found*, :func:`ports.listeners`) runs for, where the status's own unit does
    not: ``(another deployment's pdctl unit, None, False)`` (:func:`ports.pdctl_unit_of`); ``(None, how, False)`` for
    this deployment's own unit (one of *own*) applied another way (another ``--state-dir``, user or service manager:
    :func:`ports.applied_with`'s words, "" where they do not tell); ``(None, None, True)`` for its own unit under the
    process supervisor of *state_dir*, the one status reads, whose unit's files are gone (removed by hand while it ran:
    ``down`` and ``apply`` stop it, :meth:`~pdctl.units.ServiceManager.stop_orphans`); ``(None, None, False)``
    otherwise."""
    from pdctl.statemachine import ports

    for x in found:
        if x.port != port or x.pid is None:
            continue
        if unit := ports.pdctl_unit_of(host, x.pid, other_than=own):
            return unit[0], None, False
        if how := ports.started_by(host, x.pid, own):
            words = ports.applied_with(how)
            if words == ports.applied_with(f"{state_dir}/supervisor/services/pdctl-"):
                return None, None, True
            return None, words or "", False
    return None, None, False


def unit_names(topo) -> dict[str, str]:  # noqa: ANN001
    """Role name (and ``router``) → unit name, as :mod:`pdctl.statemachine.launch` names units."""
    out = {r.name: f"pdctl-{topo.name}-{r.name}.service" for r in topo.roles}
    if topo.router is not None:
        out["router"] = f"pdctl-{topo.name}-router.service"
    return out


class RoleLogs:
    """The log lines of a deployment's roles and router, read through the service manager its units run under (the
    journal's record, else the spec's), on its host, which stays open between reads (``pdctl logs --follow`` reads
    again every second). ``units``: role name (``router`` for the router) → unit name, in the deployment's order, of
    what the journal's target (an apply running or unfinished) or else its recorded deployment has, else of the spec;
    ``deployed``: whether the journal records either. Raises as :func:`status` does for a journal written on another
    machine (``PlanError``) and for a host that cannot be reached (``HostError``). Use as a context manager."""

    def __init__(self, loaded: Loaded) -> None:
        from pdctl.statemachine import launch

        self.host = deployment_host(loaded.deployment)
        try:
            _can_run_commands(loaded.deployment, self.host)  # (a nologin ssh_user: said once, by its field)
            state = loaded.journal.read()
            if state.machine:  # (another machine's units: nothing of them here, or some other deployment's)
                refuse_another_machine(loaded, state, machine_of(self.host), "reading its logs")
            self.deployed = state.target is not None or state.deployed is not None
            self.units = unit_names(state.target or state.deployed or topology_of(loaded.deployment))
            self.manager = launch.manager_for(as_recorded_manager(loaded.deployment, state), self.host,
                                              state_dir=str(loaded.journal.dir))
        except BaseException:
            self.host.close()
            raise

    def lines(self, role: str, n: int) -> list[str]:
        """The last *n* lines *role*'s unit wrote (stdout and stderr, under systemd its journal), oldest first; ``[]``
        where it wrote none (not started, or under the process supervisor taken down: its folder is gone). Raises
        ``KeyError`` for a role the deployment lacks and ``HostError`` where the host cannot be read."""
        return self.manager.logs(self.units[role], lines=n)

    def follow(self, role: str, mark: object, n: int) -> tuple[list[str], object, bool]:
        """One read of *role*'s log being followed (:meth:`~pdctl.units.ServiceManager.follow_logs`): ``(lines,
        mark, missed)``; *mark* None the first time, then the one the last read returned."""
        return self.manager.follow_logs(self.units[role], mark, lines=n)

    def installed(self, role: str) -> bool:
        """Whether *role*'s unit is installed on the host now."""
        return self.manager.installed_text(self.units[role]) is not None

    def close(self) -> None:
        self.host.close()

    def __enter__(self) -> RoleLogs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def kernels_build_command(dep: Deployment) -> tuple[list[str], str]:
    """The command that builds and verifies pdctl's kernels for *dep* on its GPU host, and the
    manifest it writes (``<SGLANG_CACHE_DIR>/pdctl-kernels-manifest.json``). Shapes follow the
    deployment: local MLA heads = 128 / the decode group's attention-TP size (TP / attention-DP: SGLang 0.5.23
    ``dsa_backend.py`` takes ``num_attention_heads // attn_tp_size``), the KV format from the kv-cache dtype, the max
    context from the model's context length. Prefill runs SGLang's own kernels (the plugin routes decode only).
    DeepSeek-V4 (``--model deepseek-v4``): local heads = the checkpoint's ``num_attention_heads`` / attention TP
    (0.5.23 ``models/deepseek_v4.py``: ``n_local_heads``), the 584-byte ``v4`` cache whatever the kv-cache dtype says
    (SGLang writes that layout on CUDA), ``--topk`` its ``index_topk`` (512 Flash, 1024 Pro), from
    :mod:`pdctl.statemachine.models`' facts (validate refuses kernels for a V4 checkpoint it has none for).
    With ``service_user`` it runs as that account (util-linux ``runuser -u``; pdctl runs as root then)."""
    from pdctl.statemachine import launch
    from pdctl.statemachine.models import builtin_facts

    cache = launch._cache_dir(dep)
    attn_tps = sorted({max(1, r.tp // r.attn_dp) for _n, k, r in dep.roles() if k in ("decode", "server")}) or [1]
    facts = builtin_facts(dep.model.path)
    if facts is not None and facts.attention == "dsv4" and facts.num_attention_heads and facts.index_topk:
        heads = sorted({max(1, facts.num_attention_heads // t) for t in attn_tps})
        model = ["--model", "deepseek-v4", "--heads", *map(str, heads), "--kv-formats", "v4",
                 "--topk", str(facts.index_topk)]
    else:
        heads = sorted({max(1, 128 // t) for t in attn_tps})
        fmt = "fp8" if str(dep.model.kv_cache_dtype).startswith("fp8") else "bf16"
        model = ["--heads", *map(str, heads), "--kv-formats", fmt]
    cmd = [launch.python_for(dep), "-m", "pdctl.kernels", "build", "--cache-dir", cache, *model]
    if dep.model.context_length:
        cmd += ["--max-context", str(dep.model.context_length)]
    if dep.service_user is not None:  # (as the servers that extend its Triton cache: their files, not root's)
        cmd = ["runuser", "-u", dep.service_user, "--", *cmd]
    return cmd, os.path.join(cache, "pdctl-kernels-manifest.json")


def deployment_host(dep: Deployment):  # noqa: ANN201
    """The one host every role of *dep* runs on: :class:`~pdctl.statemachine.hosts.LocalHost` or, for a remote
    ``[hosts.NAME]``, an :class:`~pdctl.statemachine.ssh.SshHost` (connected on first use).

    Raises HostError before anything changes when the roles span several hosts: one run of pdctl drives one
    host (the KV link and the router then cross machines, which the steps' proofs do not cover yet).
    """
    from pdctl.statemachine.hosts import host_for

    key = _host_key(dep)
    return host_for(dep.hosts.get(key) if key else None, name=key)


def _host_key(dep: Deployment) -> str | None:
    """The ``[hosts.NAME]`` every role of *dep* runs on (None: none named). Raises HostError when they span several."""
    used = sorted({r.host for _n, _k, r in dep.roles()} | ({dep.router.on} if dep.router and dep.router.on else set()))
    if len(used) > 1:
        raise HostError(
            f"roles run on {len(used)} hosts ({', '.join(used)}): pdctl drives one host per deployment for now",
            host=used[0],
            hint="put prefill, decode and the router on one [hosts.*] entry",
        )
    return used[0] if used else None


def _client_for(host, client):  # noqa: ANN001, ANN202
    """The injected client, else one that reaches *host*'s services (through SSH forwards for a remote host)."""
    import httpx

    if client is not None:
        return client
    return httpx.Client(trust_env=False, transport=host.http_transport())


def build_context(loaded: Loaded, *, sink=None, timeouts=None, client=None, restart: set[str] | None = None,  # noqa: ANN001, ANN201
                  host=None, asked: Collection[str] = ()):  # noqa: ANN001
    """Everything the steps need for *loaded* on its host (this machine, or one reached over SSH)."""
    from pdctl.statemachine import launch
    from pdctl.statemachine.steps import Context, Timeouts

    dep = loaded.deployment
    topo = topology_of(dep)
    host = host or deployment_host(dep)
    units = launch.unit_set_for(dep, state_dir=str(loaded.journal.dir))
    manager = launch.manager_for(dep, host, state_dir=str(loaded.journal.dir))
    unit_of = unit_names(topo)
    kcmd, kmanifest = kernels_build_command(dep)
    return Context(
        dep=dep,
        topology=topo,
        host=host,
        manager=manager,
        units=units,
        unit_of=unit_of,
        client=_client_for(host, client),
        journal=loaded.journal,
        journal_state=loaded.journal.read(),
        restart=set(restart or ()),
        asked=set(asked),
        timeouts=timeouts or Timeouts(),
        kernels_command=kcmd,
        kernels_manifest=kmanifest,
        sink=sink,
    )


def apply(
    loaded: Loaded,
    *,
    confirm: str | None = None,
    saved_plan: Plan | None = None,
    expect_plan: str | None = None,
    sink=None,  # noqa: ANN001
    timeouts=None,  # noqa: ANN001
    client=None,  # noqa: ANN001
    restart: Collection[str] = (),
) -> ApplyResult:
    """Plan, check the confirmation, then drive the state machine to the last state.

    *restart*: roles (and ``router``) to restart although nothing of them changed (``--restart``; ``ValueError`` for
    a name the spec lacks, or with a *saved_plan*, which restarts those it was made with), each proven again as any
    restarted role is.

    Holds the deployment's lock throughout (:class:`LockHeld` if taken). A topology change needs
    ``confirm == plan.plan_id`` (:class:`TopologyNotConfirmed` otherwise, before anything changes).
    With *expect_plan* (the id of the plan an operator was shown and answered, as the console does)
    it applies only while planning under the lock still gives that plan (:class:`StalePlanError`
    otherwise, before anything changes): another apply or down between the question and the answer
    changes the plan, and the answer was not given to the new one.
    A *saved_plan* applies only while the deployment still matches its "from" side and the spec
    still produces its "to" side (:class:`StalePlanError`). Roles no longer in the spec are
    stopped and removed (router first). Raises :class:`StepError` naming the failed step; the
    journal then records the failure and what already runs stays as it was. A KeyboardInterrupt
    (Ctrl-C; SIGTERM in the CLI) from the plan on is re-raised after the running step is marked
    ``interrupted``, ``apply-interrupted`` is audited and ``apply_interrupted`` emitted (before the target is
    journalled on a first deployment: :meth:`Event.apply_not_started`, nothing was changed).
    """
    from pdctl.statemachine.errors import StalePlanError, StepError
    from pdctl.statemachine.events import Event, NullSink
    from pdctl.statemachine.machine import run_steps
    from pdctl.statemachine.steps import (
        bind_addresses_unusable,
        gpus_taken_elsewhere,
        numa_nodes_missing,
        ports_taken_elsewhere,
        router_executable_unusable,
        running_from_another_state_dir,
        service_manager_changed,
        service_user_unusable,
        steps_for,
        unit_files_not_pdctls,
        unit_files_unrenderable,
        units_of_another_deployment,
    )

    sink = sink or NullSink()
    j = loaded.journal
    ctx = None
    if restart and saved_plan is not None:
        raise ValueError("a saved plan applies what it holds: --restart goes with a spec")
    if saved_plan is not None:  # (the restarts it was made with, which the plan made again here must hold too)
        restart = tuple("router" if c.address == "router" else c.address.removeprefix("role.")
                        for c in saved_plan.changes if c.asked is not None)
    if unknown := not_restartable(topology_of(loaded.deployment), restart):  # (before the lock: nothing created)
        if saved_plan is not None:
            raise _stale(saved_plan, f"restarts {', '.join(map(repr, unknown))}, which the spec no longer has")
        raise ValueError(f"cannot restart {', '.join(map(repr, unknown))}: the spec has no such role")
    if saved_plan is not None and saved_plan.to_topology.name != loaded.deployment.name:
        # (before the lock: the renamed spec's state directory is another deployment's, which this creates nothing in)
        raise StalePlanError(
            f"the spec was edited since saved plan {saved_plan.plan_id} was made from it: its name "
            f"{saved_plan.to_topology.name!r} → {loaded.deployment.name!r}, which is another deployment (its own "
            "state directory, units and journal); nothing was changed",
            plan_id=saved_plan.plan_id,
            hint="make a new plan from the current spec with `pdctl plan SPEC -o FILE` and review it (to move a "
                 "deployment to another name, `pdctl down` the old one first)",
        )
    # A state directory without room for the journal's writes fails now, naming it, before the lock and any host: one
    # that filled mid-apply left it waiting on a status no supervisor could write (Journal.check_room)
    j.check_room()
    # (what this call opens it closes: an SSH connection and its thread per apply, and kept-alive connections to
    # the router, which held it in smg's graceful shutdown when stopped, stayed open in the console until garbage
    # collection)
    with j.lock("apply"), contextlib.ExitStack() as opened:
        state = j.read()
        desired = topology_of(loaded.deployment)
        # (the host is needed this early only to see what an unfinished apply left running, or with nothing recorded
        # what units of the deployment are installed all the same, as `pdctl plan` does)
        host = opened.enter_context(contextlib.closing(deployment_host(loaded.deployment))) \
            if state.target is not None or state.deployed is None else None
        base = plan_base(state, desired, running_units(loaded, state, host=host))
        plan = make_plan(base, desired, from_serial=state.serial, generation=state.generation,
                         not_running=not_running(loaded, state, base, host=host),
                         runs=runs_now(loaded, state, host=host),
                         unrecorded=unrecorded_units(loaded, state, host=host) if host is not None else (),
                         restart=restart)
        if state.target is None and state.deployed is not None:  # (as `pdctl plan` lists them)
            plan = make_plan(base, desired, from_serial=state.serial, generation=state.generation,
                             runs=rendered_otherwise(loaded, state, plan), restart=restart)
        if saved_plan is not None:
            if saved_plan.from_topology != base:
                raise _stale(saved_plan, "changes a deployment other than the one recorded now (what it starts from "
                                         "is no longer what is deployed; made at journal serial "
                                         f"{saved_plan.from_serial}, now {state.serial})")
            if saved_plan.generation != state.generation:
                # (the same two topologies, yet applies changed what was deployed and back since: its id, which a
                # confirmation names, is of that earlier generation; the file was not edited)
                raise _stale(saved_plan, "was made before the deployment last changed (applies since changed what is "
                                         f"deployed and back; made at journal serial {saved_plan.from_serial}, now "
                                         f"{state.serial})")
            if saved_plan.to_topology != desired:
                # (what the spec now asks otherwise, by setting: "topology" read as a topology change for an edit of
                # context_length)
                edit = make_plan(saved_plan.to_topology, desired)
                edited = [f"{c.address}.{a.path}" for c in edit.changes for a in c.changes] \
                    or [c.address for c in edit.changes]
                shown = (", ".join(edited[:6]) + (", …" if len(edited) > 6 else "")) or "its settings"
                # (a topology the edit changes first, in words: it said "router.prefill, router.decode … differ" of a
                # PD spec swapped for a single server)
                words = "; ".join(edit.topology_changes)
                raise StalePlanError(
                    f"the spec was edited since saved plan {saved_plan.plan_id} was made from it ("
                    + (f"it changes the topology: {words}; " if words else "") + f"{shown} differ); nothing was changed",
                    plan_id=saved_plan.plan_id,
                    hint="make a new plan from the current spec with `pdctl plan SPEC -o FILE` and review it",
                )
            if saved_plan.unrecorded != plan.unrecorded:
                raise _stale(saved_plan, "was made when other units of the deployment that no journal records were "
                                         f"installed here ({', '.join(saved_plan.unrecorded) or 'none'}; now: "
                                         f"{', '.join(plan.unrecorded) or 'none'})")
            # the changes its two topologies make, as `plan -o` wrote them: with what an unfinished apply left
            # running noted on them (kept, not running, runs otherwise) when it was made while one was, without when
            # not. A plan saved before an apply that was then interrupted is what was reviewed: the notes are added
            # now, as they are to any plan of the deployment
            pure = make_plan(base, desired, from_serial=state.serial, generation=state.generation)
            held = (saved_plan.plan_id, saved_plan.changes, saved_plan.topology_changes)
            noted = any(c.kept or c.not_running or c.runs or c.kept_restarts for c in saved_plan.changes)
            if held in ((plan.plan_id, plan.changes, plan.topology_changes),
                        (pure.plan_id, pure.changes, pure.topology_changes)):
                pass
            elif noted and _without_notes(saved_plan) == _without_notes(plan):
                # made while an apply was unfinished, and what that one left running has changed since (another
                # apply went further, a unit stopped): the changes are the same, their notes no longer hold
                raise _stale(saved_plan, "was made while an apply was unfinished, and what runs has changed since "
                                         f"(made at journal serial {saved_plan.from_serial}, now {state.serial})")
            else:
                # the topologies are the recorded and the specified ones, yet the changes (their classes, and so
                # whether a confirmation is needed) are not those the two make: the file was edited after `plan -o`
                raise _stale(saved_plan, "does not hold the changes its two topologies make (the file was edited "
                                         "after `pdctl plan -o`?)",
                             hint="make the plan again with `pdctl plan SPEC -o FILE`, review it, and apply that "
                                  "file unedited")
            # what was reviewed, as computed here: whether it needs a confirmation is never read from the file
        if expect_plan is not None and expect_plan != plan.plan_id:
            reason = (f"the plan changed since it was shown: it was {expect_plan} and is now {plan.plan_id} (the "
                      f"deployment changed meanwhile, now at journal serial {state.serial}); nothing was changed")
            j.audit("apply-refused", plan_id=plan.plan_id, expected=expect_plan, reason=reason)
            raise StalePlanError(reason, plan_id=plan.plan_id, hint="review the new plan, then apply it")
        stale_steps = dict(state.steps)  # an earlier run's (a "running" one of a killed apply is not this run's)
        changing = False  # until the target is journalled, nothing was changed (the plan and checks only read)
        try:
            what = {None: "no changes", "in_place": "in-place changes only", "disruptive": "changes that restart roles",
                    "topology": "a topology change" if plan.requires_confirmation else "a first deployment"}[plan.cls]
            pending = [c for c in plan.changes if c.cls == "disruptive" and c.kept is None]
            if plan.cls == "disruptive" and all(c.not_running for c in pending):
                # (what an unfinished apply removed; or all it changed already, kept as it runs)
                what = ("roles that do not run now, to start again" if pending
                        else "changes an unfinished apply made already, kept as they run")
            impact = plan.client_impact()  # (as plan says it: apply --restart shows no plan before it starts)
            sink.emit(Event("plan", f"plan {plan.plan_id}: {what}" + "".join(f"; {w}" for w in impact),
                            data={"plan_id": plan.plan_id, "class": plan.cls, "counts": plan.counts(),
                                  "client_impact": impact,
                                  "warnings": [w.to_json() for w in loaded.warnings]}))
            j.audit("plan", plan_id=plan.plan_id, cls=plan.cls, changes=[c.address for c in plan.changes], spec=str(loaded.path),
                    **({"restart": list(restart)} if restart else {}))  # (asked for: the plan id does not say it)
            if base is None and (said := since_down(state, desired)):
                sink.emit(Event("info", f"note: {said}", data={"plan_id": plan.plan_id}))
            try:
                _resolve_confirmation(plan, confirm)
            except Exception as exc:
                j.audit("apply-refused", plan_id=plan.plan_id, confirmation=confirm, reason=str(exc))
                raise
            # Refuse a deployment spread over hosts, and prove the host answers, before anything changes.
            host = host or opened.enter_context(contextlib.closing(deployment_host(loaded.deployment)))
            _can_run_commands(loaded.deployment, host)
            here = machine_of(host)
            try:
                refuse_another_machine(loaded, state, here, "applying")
            except HostError as exc:
                j.audit("apply-refused", plan_id=plan.plan_id, reason=str(exc))
                raise
            # (what an unfinished apply left running as the spec asks is kept: the plan restarts none of it)
            restart = set(plan.restarts())
            ctx = build_context(loaded, sink=sink, timeouts=timeouts, client=client, restart=restart, host=host,
                                asked={"router" if c.address == "router" else c.address.removeprefix("role.")
                                       for c in plan.changes if c.asked is not None})
            if client is None:
                opened.callback(ctx.client.close)
            unfinished = state.target  # an interrupted apply's target: its roles may run too
            # ...and refuse ports held outside this deployment (its current, target and interrupted roles' units).
            own = own_units(state, desired) | set(plan.unrecorded)  # (their processes: stopped or restarted here)
            try:
                service_manager_changed(ctx)
                unit_files_unrenderable(ctx)
                units_of_another_deployment(ctx)
                unit_files_not_pdctls(ctx)
                bind_addresses_unusable(ctx)
                router_executable_unusable(ctx)
                numa_nodes_missing(ctx)
                service_user_unusable(ctx)
                _stop_orphaned(ctx.manager, state, sink)  # (the plan restarts them: its unit files are written back)
                ports_taken_elsewhere(ctx, own)
                gpus_taken_elsewhere(ctx, own)
                running_from_another_state_dir(ctx)  # (after the ports: a port it holds is named as such first)
            except StepError as exc:
                j.audit("apply-refused", plan_id=plan.plan_id, reason=str(exc))
                sink.emit(Event.apply_failed(exc, started=False))
                raise
            j.audit("apply-started", plan_id=plan.plan_id, confirmation=confirm, cls=plan.cls)
            sink.emit(Event("apply_started", f"applying plan {plan.plan_id}", data={"plan_id": plan.plan_id}))

            # Journal the target before touching anything: a kill from here on re-runs to the same end. With it, the
            # units of roles it drops: the interrupted target that names them is overwritten now
            changing = True
            keep = set(unit_names(desired).values())
            state.removing = sorted({u for u in state.removing if u not in keep}
                                    | {u for t in (state.deployed, unfinished) if t is not None
                                       for u in unit_names(t).values() if u not in keep}
                                    | {u for u in plan.unrecorded if u not in keep})  # (confirmed: taken over)
            state.target = desired
            state.plan_id = plan.plan_id
            state.machine = here or state.machine
            state.steps = {}  # this run re-proves every step of the new topology
            j.write(state)
            ctx.journal_state = state
            try:
                _remove_gone_roles(ctx, state, sink)
                machine = run_steps(ctx, steps_for(desired), sink)
            except RunCancelled:  # the console's cancel (or its SIGTERM): an interruption, handled as Ctrl-C below
                raise
            except Exception as exc:
                # A failed step is journalled already; anything else (a bug) leaves its step "running": it was
                # interrupted, not proven failed
                running = [name for name, rec in state.steps.items() if rec.status == "running"]
                for name in running:
                    state.steps[name].status = "interrupted"
                    state.steps[name].finished_at = time.time()
                try:
                    if running:
                        j.write(state)
                    j.audit("apply-failed", plan_id=plan.plan_id,
                            step=getattr(exc, "step", None) or next(iter(running), None), error=str(exc))
                except StateDirUnwritable as refused:  # (the record of the failure is refused too: that is the error)
                    if isinstance(exc, StateDirUnwritable):
                        raise _left_running(ctx, exc, sink) from None
                    raise _left_running(ctx, refused, sink) from exc
                if isinstance(exc, StateDirUnwritable):
                    raise _left_running(ctx, exc, sink) from None
                sink.emit(Event.apply_failed(exc, started=True))
                raise
            _enable_and_start_target(ctx, sink)
            if state.deployed is None or state.deployed.model_dump(mode="json") != desired.model_dump(mode="json"):
                state.generation += 1
            state.deployed = desired
            state.target = None
            j.write(state)
            j.audit("apply-done", plan_id=plan.plan_id, state=machine.state)
            sink.emit(Event("apply_done", f"deployment {desired.name!r} reached {machine.state}", data={"plan_id": plan.plan_id}))
            return ApplyResult(plan, machine.state, {k: v.to_json() for k, v in state.steps.items()})
        except (KeyboardInterrupt, RunCancelled):
            # Ctrl-C, or SIGTERM through the CLI, or the console's cancel (at any event or a preflight's wait), from
            # the plan on: the journal keeps any target (a re-run converges), the step that ran is marked
            # interrupted, and a --json stream ends with an event too
            _interrupted(j, state, plan, sink, stale=stale_steps, changing=changing,
                         down=_stopped_of(ctx.manager, ctx.restarting_now) if ctx is not None else (),
                         removed=sorted(ctx.removing_now) if ctx is not None else ())
            raise


def _left_running(ctx, exc, sink):  # noqa: ANN001, ANN202
    """*exc* (:class:`StateDirUnwritable`, which ended an apply that had begun) with what of the deployment runs now
    named in its message (the units this apply started or kept, their main PIDs), its ``apply_failed`` emitted: the
    journal could not record them, so the error says what a ``pdctl down`` or the next apply will find. Each unit's
    state is read once, bounded by the manager (a host that cannot be asked: left out)."""
    from pdctl.statemachine.errors import StepError
    from pdctl.statemachine.events import Event

    runs = []
    for role, unit in sorted(ctx.unit_of.items()):
        try:
            st = ctx.manager.status(unit)
        except Exception:  # noqa: BLE001  (said without it)
            continue
        if st.state in ("active", "activating", "deactivating"):  # (its recorded state may be stale: not said)
            runs.append(f"{role} ({unit}" + (f", PID {st.main_pid})" if st.main_pid else ")"))
    first = exc.__context__  # (a step that failed first, whose journal record the directory then refused)
    while first is not None and not isinstance(first, StepError):
        first = first.__context__
    if isinstance(first, StepError) and first.step:
        exc.step = first.step
        exc.message += f"; {first.step} had failed: {first.message}"
    exc.message += ("; running now: " + ", ".join(runs) + " (they run on: `pdctl status` shows them; once the "
                    "directory takes writes, apply again to converge or `pdctl down` to stop them)" if runs
                    else "; nothing of the deployment runs now")
    exc.args = (exc.message,)
    sink.emit(Event.apply_failed(exc, started=True))
    return exc


def _stopped_of(manager, units) -> list[str]:  # noqa: ANN001
    """Of *units* an interrupted apply had begun to restart, those that do not run now (or whose state cannot be read):
    the interruption can come before the manager's stop reached the old process (at the "restarting" event, say),
    which then runs on, and ``apply_interrupted`` said it "was stopped for the restart"."""
    out = []
    for unit in sorted(units):
        # (the stop may have begun: a supervisor that got its SIGTERM says so within its poll, systemd at once; a
        # moment is waited for that, bounded, before calling the unit still running)
        deadline = time.monotonic() + STOP_SETTLE_S
        while True:
            try:
                runs = manager.status(unit).state in ("active", "activating", "reloading")
            except Exception:  # noqa: BLE001  (a host that cannot be asked now: said as possibly stopped)
                runs = False
            if not runs or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        if not runs:
            out.append(unit)
    return out


STOP_SETTLE_S = 2.0
"""How long an interrupted apply waits for a unit it had begun restarting to show its stop (:func:`_stopped_of`)."""


def _enable_and_start_target(ctx, sink) -> None:  # noqa: ANN001
    """Under systemd, once every step is proven: enable the deployment's target where it is installed and not enabled
    (a deployment applied by a pdctl that did not enable it, or disabled by hand: its ``WantedBy=`` is what starts the
    deployment at boot; the units' installs enable it too, this catches the apply that installs nothing), and start it
    where it is not active. Apply starts each role's unit in the state machine's order, never the target, so
    ``systemctl status pdctl-NAME.target`` said "inactive (dead)" over a deployment that served. Every unit it
    ``Wants=`` is active by then, so starting it starts nothing else (systemd.unit(5): a target is active once its
    start job and those of the units it wants are done)."""
    from pdctl.statemachine.events import Event

    enabled = getattr(ctx.manager, "target_enabled", None)
    name = ctx.units.target.name
    if enabled is None:  # (the process supervisor: no target, no boot-time start)
        return
    if enabled(name) is False:
        sink.emit(Event("info", f"enabling {name}, so that the deployment starts at boot", data={"unit": name}))
        ctx.manager.enable(name)
    if ctx.manager.status(name).state != "active":
        sink.emit(Event("info", f"starting {name}, which groups the deployment's units", data={"unit": name}))
        ctx.manager.start(name, wait=True, timeout=60)


def _stop_order(unit: str) -> int:
    """Router first, then decode, then prefill and single servers: the reverse of bring-up."""
    return 0 if unit.endswith("-router.service") else 1 if "-decode" in unit else 2


def _remove_gone_roles(ctx, state, sink) -> None:  # noqa: ANN001
    """Stop and remove the units journalled in ``state.removing`` (roles the deployed topology, an interrupted
    apply's target or an earlier apply's drop list had, and the desired one has not), each crossed off the journal
    once it is gone."""
    from pdctl.statemachine.events import Event

    for name in sorted(state.removing, key=_stop_order):
        state.units.pop(name, None)
        if ctx.manager.installed_text(name) is not None and ctx.manager.installed_deployment(name) in (None,
                                                                                                       ctx.dep.name):
            ctx.removing_now.add(name)  # (an interruption from here on says it was stopped: apply_interrupted)
            ctx.manager.stop(name)
            ctx.manager.remove([name], deployment=ctx.dep.name)
            sink.emit(Event("role_removed", f"stopped and removed {name}", data={"unit": name}))
        state.removing.remove(name)
        ctx.journal.write(state)
        ctx.removing_now.discard(name)


# --- status and down -----------------------------------------------------------------------------


# The audit events that end or begin an apply or a down (a refused apply or a plan changes nothing)
_LIFECYCLE = ("apply-started", "apply-done", "apply-failed", "apply-interrupted",
              "down-started", "down-done", "down-failed", "down-interrupted")


def status(loaded: Loaded, *, client=None, host=None, canary: bool | None = None) -> dict:  # noqa: ANN001
    """Each role's unit state, health and last proof (with its age), and the router's view, of what the journal's
    target (an apply running or unfinished) or else its recorded deployment has: ``mode`` is that one's,
    ``recorded_mode`` the recorded deployment's (None: none); ``leftover``: the recorded deployment's units that an
    unfinished apply's target drops, while installed or running (name, unit, state, main_pid); ``removed``: those of
    them it removed already (name, unit), which ``pdctl plan`` of the recorded spec starts again;
    ``recorded_requires_confirmation``: while an apply is unfinished, whether going back to the recorded deployment is
    a topology change to confirm (planned from :func:`plan_base`: the interrupted target once that apply began the other
    shape), else None;
    the router's ``mismatches``: how what it registers (``/workers``) differs from the topology, in words, as
    ``router_exposed`` proves it (a router left in front of another topology, a worker missing, swapped or not
    healthy), and ``mismatches_lasting`` those of them that would stay with every worker healthy; its ``listening``:
    the ``host:port`` addresses its unit's processes listen on (``exposure`` is the topology's), and
    ``exposure_differs`` whether those are not the topology's (a router an interrupted apply has not restarted yet,
    still bound where the recorded deployment said: not healthy);
    ``unfinished_down``: where the audit log's last apply or down event is a down that did not finish (``event``
    down-interrupted, down-failed with its ``error``, or down-started when no lock is held: killed) while something
    of the deployment is still recorded or running, that record's event, ts, pid and error; else None;
    ``edited_units``: with no apply unfinished and the spec's topology deployed, the units whose installed file (or
    secrets file) differs from what pdctl writes for the definition apply proved (``steps.edited_units``: edited
    outside pdctl), which under systemd a crash or reboot would start as edited (the process supervisor keeps the
    unit file its watchdog read at the start, and reads a secrets file again at each restart); ``service_manager``:
    the one the units run under (the journal's record, else the spec's); ``unit_files_not_pdctls``: the paths of its
    unit files there that pdctl did not write as they stand (damaged, or written by hand), which apply refuses before
    anything; ``missing_units``: with no apply unfinished, the
    units apply proved running (``JournalState.units``) that are no longer installed (their files removed by hand),
    which ``down`` and ``apply`` still stop where they run;
    each role's and the router's ``port_orphaned``: whether its port is answered by this deployment's own process under
    this state directory's process supervisor whose unit's files are gone (``port_held_for`` /
    ``port_applied_elsewhere``: another deployment's unit / this deployment's, applied another way); each role's
    ``port_silent_holder``: where its port answers no HTTP yet a process outside its unit listens there, that process
    (``PID 123 (command)``), else None; each role's and the router's ``log_tail``: where its unit failed or waits to
    restart after a crash, the last lines of its log (:data:`FAILURE_LOG_LINES`), else ``[]``; the router's
    ``serving``: whether a client is served now (:class:`~pdctl.statemachine.serving.Serving` as a dict: each worker's
    circuit, the canary sent through the router unless *canary* is False or the spec's ``console.canary`` is off, and
    the problems in words), which ``healthy`` requires.

    Reads only: the journal, the service manager and the HTTP endpoints, on *host* where the caller holds the
    deployment's open (else connected to here). Never raises for a role that is down; that is what it reports.
    """
    the_host = host or deployment_host(loaded.deployment)
    own_client = client is None
    client = _client_for(the_host, client)
    try:
        return _status(loaded, the_host, client, canary=loaded.deployment.console.canary if canary is None else canary)
    finally:
        if own_client:
            client.close()
        if host is None:
            the_host.close()


def _status(loaded: Loaded, host, client, *, canary: bool = True) -> dict:  # noqa: ANN001
    """:func:`status` with the host and HTTP client it opened."""
    import dataclasses
    import time as _time

    from pdctl.statemachine import launch, ports, probes
    from pdctl.statemachine.errors import ProbeError
    from pdctl.statemachine.steps import router_mismatches

    locked_by = _lock_holder(loaded)  # before the journal: an apply that ends meanwhile leaves a converged journal
    state = loaded.journal.read()
    topo = state.target or state.deployed or topology_of(loaded.deployment)
    if state.machine:  # another machine's units would all read "inactive"
        refuse_another_machine(loaded, state, machine_of(host), "reading its status")
    # (a spec since edited to another service_manager: its units run under the recorded one)
    manager = launch.manager_for(as_recorded_manager(loaded.deployment, state), host, state_dir=str(loaded.journal.dir))
    names = unit_names(topo)
    now = _time.time()
    roles = []
    seen = [(r, manager.status(names[r.name]), probes.health(client, r.url, timeout=2.0)) for r in topo.roles]
    router = None
    if topo.router is not None:
        st = manager.status(names["router"])
        url = topo.router.url
        # (the same keys whether or not it answers: workers and stats null, error the reason, when it does not)
        router = {"unit": names["router"], "state": st.state, "main_pid": st.main_pid, "url": url, "exposure": topo.router.exposure,
                  "supervised": st.supervised, "restarts": st.restarts, "sub_state": st.sub_state,
                  "workers": None, "stats": None, "error": None, "mismatches": [], "mismatches_lasting": []}
        try:
            code, body = probes.router_readiness(client, url, timeout=2.0)
            router["readiness"] = code
            if code != 200:  # (up, not ready: smg answers 503 until it has healthy workers)
                router["error"] = f"GET {url}/readiness: HTTP {code}"
            workers, stats = probes.router_workers(client, url, timeout=2.0)
            router["workers"] = [w.__dict__ for w in workers]
            router["stats"] = stats
            # what router_exposed proves, against what the router registers now: a router left in front of another
            # topology (an interrupted single ↔ PD change), a worker missing, swapped or not healthy. "lasting": those
            # that stay with every worker healthy (the router was started with other workers), which waiting does not mend
            router["mismatches"] = router_mismatches(workers, stats, topo)
            router["mismatches_lasting"] = router_mismatches(
                [dataclasses.replace(w, is_healthy=True) for w in workers], stats, topo)
        except ProbeError as exc:
            router["readiness"] = 0
            router["error"] = str(exc)
        router["serving"] = _serving(loaded, topo, client, url, canary=canary and bool(router["readiness"])).as_dict()
    # one scan of the host's sockets for every role and the router, after the probes: a server that began listening
    # between a scan and its probe would answer while no listener was on record, and be called another process's
    found = ports.listeners(host, {r.port for r in topo.roles} | ({topo.router.port} if topo.router else set()))
    if router is not None:
        # as the roles': an answer counts as the router's only from its unit's process tree (a never-deployed spec's
        # router port answered by another deployment's router read as this one's)
        router["port_owned"] = bool(router["readiness"]) and router["main_pid"] is not None and ports.listener_belongs(
            host, topo.router.port, router["main_pid"], found, bind=ports.bind_address(topo.router.host))[0]
        router["port_held_for"], router["port_applied_elsewhere"], router["port_orphaned"] = (None, None, False) \
            if router["port_owned"] or not router["readiness"] else _port_holder(
                host, topo.router.port, found, set(names.values()), str(loaded.journal.dir))
        # where its own process tree listens: after an apply interrupted before it restarted the router, the one that
        # runs is the recorded deployment's, bound where that one said (e.g. every interface while the target says
        # loopback), and status says so rather than the target's address
        router["listening"], router["exposure_differs"] = _router_listening(host, topo.router, router["main_pid"], found)
        router["main_stopped"] = bool(router["main_pid"]) and process_stopped(host, router["main_pid"])
        router["log_tail"] = _failure_log(manager, names["router"], router["state"], router["sub_state"])
    for r, st, code in seen:
        # a 200 counts only from the unit's own process tree (after a failed apply the port may be another's); an
        # activating unit's server answering is its own too (it was shown as "from another process")
        owned = bool(code) and st.main_pid is not None and ports.listener_belongs(
            host, r.port, st.main_pid, found, bind=ports.bind_address(r.http_host))[0]
        # (the answer came from another pdctl deployment's server, e.g. this spec's before it was renamed, or from this
        # deployment's own, applied with another --state-dir, user or service manager)
        held_for, elsewhere, orphaned = (None, None, False) if owned or not code else _port_holder(
            host, r.port, found, set(names.values()), str(loaded.journal.dir))
        # nothing answered HTTP, yet a process outside the unit listens on the port (a foreign server of another
        # protocol, taken after a crash): the role cannot come back there; say whose it is, as plan and apply do
        silent = [] if code else [x for x in ports.listener_belongs(
            host, r.port, st.main_pid, found, bind=ports.bind_address(r.http_host))[1]
            if x.pid is None or st.main_pid is None or not ports.is_descendant(host, x.pid, st.main_pid)]
        roles.append(
            {
                "name": r.name,
                "kind": r.kind,
                "unit": names[r.name],
                "state": st.state,
                "main_pid": st.main_pid,
                "restarts": st.restarts,
                "sub_state": st.sub_state,
                "url": r.url,
                "health": code,
                "error": (None if owned else f"GET {r.url}/health was answered by this deployment's own process, "
                          "whose supervisor's files are gone, not by this role's unit" if orphaned else
                          f"GET {r.url}/health was answered by another process on its port, not this role's unit")
                if code == 200 else f"GET {r.url}/health: " + (
                    f"HTTP {code}" if code else "nothing answered (connection refused, reset or timed out)" + (
                        f"; port {r.port} is held by {_holder_words(silent[0])}, not this role's unit"
                        if silent else "")),
                "port_owned": owned,
                "port_held_for": held_for,
                "port_applied_elsewhere": elsewhere,
                "port_orphaned": orphaned,
                "port_silent_holder": _holder_words(silent[0]) if silent else None,
                "supervised": st.supervised,
                # (kill -STOP, a debugger: it answers nothing and no supervisor restarts it; status said only "down")
                "main_stopped": bool(st.main_pid) and process_stopped(host, st.main_pid),
                "healthy": code == 200 and st.is_active and owned and st.supervised,
                "log_tail": _failure_log(manager, names[r.name], st.state, st.sub_state),
            }
        )
    # An apply that did not finish toward another topology (PD collapsed to one server, or back) leaves the recorded
    # deployment's units that its target drops still running: shown, so that status never hides a running server
    leftover = []
    # ...and those of them it removed already (that apply, or `pdctl plan`, would start them again for the recorded
    # spec: said here too, so that status and plan tell the same story of what is deployed)
    removed = []
    recorded = unit_names(state.deployed) if state.target is not None and state.deployed is not None else {}
    dropped = dict(recorded)
    dropped |= {u.removeprefix(f"pdctl-{topo.name}-").removesuffix(".service"): u for u in state.removing}
    # (and any other service of the deployment installed here that neither the journal nor the spec names: one whose
    # journal was lost, after an apply of another spec of the name; status said "healthy" with it running beside)
    known = {*unit_names(topo).values(), *recorded.values(), *state.removing,
             *(unit_names(state.target).values() if state.target is not None else ())}
    unrecorded = {u.removeprefix(f"pdctl-{topo.name}-").removesuffix(".service"): u
                  for u in manager.installed_units_of(topo.name) if u not in known}
    dropped |= unrecorded
    for name, unit in dropped.items():
        if unit in names.values() or any(u["unit"] == unit for u in leftover):
            continue
        st = manager.status(unit)
        if st.state != "inactive" or manager.installed_text(unit) is not None:
            leftover.append({"name": name, "unit": unit, "state": st.state, "main_pid": st.main_pid,
                             "unrecorded": unrecorded.get(name) == unit})
        elif recorded.get(name) == unit:
            removed.append({"name": name, "unit": unit})
    # going back to the recorded spec: planned from what plan_base says (the interrupted target, once that apply began
    # the other shape), so that status says a confirmation is needed exactly when `pdctl plan` of that spec asks one
    back_confirm = None
    if state.target is not None and state.deployed is not None:
        running = {names[r.name] for r, st, _code in seen if st.state in ("active", "activating", "deactivating",
                                                                          "reloading")}
        if router is not None and router["state"] in ("active", "activating", "deactivating", "reloading"):
            running.add(router["unit"])
        back_confirm = make_plan(plan_base(state, state.deployed, running), state.deployed).requires_confirmation
    from pdctl.statemachine.machine import PD_STATES, SINGLE_STATES

    order = PD_STATES if topo.mode == "pd" else SINGLE_STATES
    ordered = sorted(state.steps.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order))
    steps = {}
    # no lock before the journal was read, nor after: a "running" step is a killed apply's (an apply that took the lock
    # in between journalled its own step as running)
    settled = locked_by is None and _lock_holder(loaded) is None
    # A proof describes the processes that ran when it was taken: a unit whose main process started after it (its
    # supervisor or systemd restarted it after a crash) is no longer what the step proved
    pids = {names[r.name]: st.main_pid for r, st, _code in seen}
    if router is not None:
        pids[router["unit"]] = router["main_pid"]
    boot = _boot_time(host) if any(pids.values()) else None
    started = {u: _process_started_at(host, pid, boot) for u, pid in pids.items() if pid}
    for name, rec in ordered:
        summary = (rec.proof or {}).get("summary") if rec.proof else rec.error
        killed = rec.status == "running" and settled  # journalled as running, and no apply holds the lock
        # (a step a later apply found proven is journalled skipped, with that proof: it ages the same way)
        since = [u for u in _units_of_step(name, topo, names) if rec.status in ("done", "skipped") and rec.finished_at
                 and (started.get(u) or 0) > rec.finished_at + 1.0]
        steps[name] = {
            "status": "interrupted" if killed else rec.status,
            "summary": "its apply was killed while it ran (the next apply resumes it)" if killed
            else summary or (INTERRUPTED_SUMMARY if rec.status == "interrupted" else None),
            "age_s": round(now - rec.finished_at, 1) if rec.finished_at else None,
            "restarted_since": since,
        }
    reached = None
    for name, rec in ordered:
        if rec.status in ("done", "skipped"):
            reached = name
        else:
            break
    all_healthy = (
        all(r["healthy"] for r in roles)
        and (router is None or (router.get("readiness") == 200 and router["state"] == "active" and router["supervised"]
                                and not router["mismatches"] and not router["exposure_differs"]
                                and router["serving"]["served"]))
        and state.target is None  # an apply in progress, or one that was interrupted, has not converged
        and state.deployed is not None  # what no journal records is not this deployment proven (a journal moved aside)
        and not leftover  # (units of it running outside what the journal records)
    )
    spec_topo = topology_of(loaded.deployment)
    unfinished_down = None
    if settled and (state.deployed is not None or state.target is not None
                    or any(r["state"] != "inactive" for r in roles)
                    or (router is not None and router["state"] != "inactive") or leftover):
        last = loaded.journal.last_audit(_LIFECYCLE)
        if (last is not None and last["event"] in ("down-started", "down-interrupted", "down-failed")
                and _lock_holder(loaded) is None):  # (a down that took the lock after the audit read is running)
            # down-started as the last word with no lock held: that down was killed (SIGKILL, a reboot)
            unfinished_down = {"event": last["event"], "ts": last.get("ts"), "pid": last.get("pid"),
                               "error": last.get("error")}
    if unfinished_down is not None:
        # A step whose units that down stopped proves nothing any more (its journal still says done: the record goes
        # only when down finishes); the steps before it may still hold, so reached stops short of it
        running = {r["unit"]: r["state"] for r in roles} | ({router["unit"]: router["state"]} if router else {})
        for name, step in steps.items():
            if step["status"] in ("done", "skipped") and any(
                    running.get(u) not in ("active", None) for u in _units_of_step(name, topo, names)):
                step.update(status="pending", summary=f"its units were stopped by {_DOWN_WORDS[unfinished_down['event']]}"
                            " (`pdctl apply` proves it again)")
        reached = None
        for name, step in steps.items():
            if step["status"] not in ("done", "skipped"):
                break
            reached = name
    enabled = getattr(manager, "target_enabled", None)  # (systemd: the process supervisor has no boot-time start)
    target = f"pdctl-{topo.name}.target"
    edited: list[str] = []
    if state.target is None and state.deployed is not None and spec_topo == state.deployed:
        from pdctl.statemachine.errors import PdctlError
        from pdctl.statemachine.steps import edited_units

        try:  # (the spec's units, as apply would write them: an unset secret leaves nothing to compare)
            units = launch.unit_set_for(loaded.deployment, state_dir=str(loaded.journal.dir))
        except PdctlError:
            units = None
        if units is not None:
            edited = edited_units(manager, units, state.units, [u for u in names.values() if u in units.names])
    # a unit apply proved whose files were removed by hand (its supervisor folder `rm -rf`'d): not "edited"
    missing = [u for u in names.values() if state.target is None and u in state.units
               and manager.installed_text(u) is None and manager.unit_file_not_pdctls(u) is None]
    damaged = [p for u in names.values() if (p := manager.unit_file_not_pdctls(u))]
    edited = [u for u in edited if u not in missing]
    return {
        "deployment": topo.name,
        "mode": topo.mode,
        "target": {"unit": target, "enabled": enabled(target), "state": manager.status(target).state}
        if enabled is not None else None,
        "recorded_mode": state.deployed.mode if state.deployed is not None else None,
        "serial": state.serial,
        "plan_id": state.plan_id,
        "deployed": state.deployed is not None,
        "applying": state.target is not None,
        "locked_by": locked_by,
        "unfinished_down": unfinished_down,
        "matches_spec": spec_topo == (state.target or state.deployed),
        "reached": reached,
        "healthy": all_healthy,
        "roles": roles,
        "router": router,
        "leftover": leftover,
        "removed": removed,
        "edited_units": edited,
        "missing_units": missing,
        "unit_files_not_pdctls": damaged,
        "service_manager": as_recorded_manager(loaded.deployment, state).service_manager,
        "recorded_requires_confirmation": back_confirm,
        "steps": steps,
    }


def _serving(loaded: Loaded, topo: Topology, client, router_url: str, *, canary: bool):  # noqa: ANN001, ANN202
    """The router's circuits now and (*canary*) one canary through it: :func:`pdctl.statemachine.serving.judge`."""
    from pdctl.statemachine import serving
    from pdctl.statemachine.errors import ProbeError

    try:
        states, error = serving.circuits(client, topo), None
    except ProbeError as exc:
        states, error = None, str(exc)
    sent = serving.run_canary(client, router_url, timeout=loaded.deployment.console.canary_timeout_s) if canary else None
    return serving.judge(topo, states, error, sent)


FAILURE_LOG_LINES = 5
"""Log lines :func:`status` quotes of a unit that failed or waits to restart after a crash (``systemctl status``
quotes ten of every unit)."""


def _failure_log(manager, unit: str, state: str, sub_state: str | None) -> list[str]:  # noqa: ANN001
    """The last :data:`FAILURE_LOG_LINES` lines of *unit*'s log where its state is ``failed`` or a crash's
    ``activating (auto-restart)``, else ``[]``: what says why, without a second command. A log that cannot be read
    gives one line that says so."""
    if not (state == "failed" or state == "activating" and sub_state == "auto-restart"):
        return []
    try:
        return manager.logs(unit, lines=FAILURE_LOG_LINES)
    except Exception as exc:  # noqa: BLE001 - the status is still worth showing
        return [f"(its log cannot be read: {exc})"]


def _without_notes(plan: Plan) -> tuple:
    """*plan*'s id, topology changes and changes, each change without what an unfinished apply left running noted on
    it (:attr:`~pdctl.statemachine.plan.ResourceChange.kept`, ``not_running``, ``runs``, ``kept_restarts``; its
    attribute changes and class, which ``runs`` makes against what runs, left out too): the resources the two
    topologies alone change, and how."""
    return plan.plan_id, plan.topology_changes, [(c.address, c.action) for c in plan.changes]


def _router_listening(host, rt, main_pid: int | None, found) -> tuple[list[str], bool]:  # noqa: ANN001
    """``(addresses, differs)``: the ``host:port`` addresses (sorted; ``0.0.0.0:30001`` = every interface) that the
    router unit's process tree (*main_pid* and its descendants) listens on at *rt*'s port, as *found*
    (:func:`ports.listeners`) read them, and whether they are not where *rt* says it binds: a wildcard spec host
    answered only on specific addresses, or an IP literal answered on a wildcard or another address. Empty and False
    where nothing of the unit listens or its addresses cannot be read; a host name in the spec (resolved by smg when
    it binds) is never called different."""
    from pdctl.statemachine import ports
    from pdctl.statemachine.topology import is_wildcard, url_host

    if main_pid is None:
        return [], False
    addrs = set()
    for lst in found:
        if lst.port == rt.port and lst.pid is not None and lst.addresses is not None \
                and ports.is_descendant(host, lst.pid, main_pid):
            addrs |= set(lst.addresses)
    if not addrs:
        return [], False
    bind = ports.bind_address(rt.host)
    if bind is not None:
        differs = addrs != {ipaddress.ip_address(bind)}
    else:
        differs = is_wildcard(rt.host) and not any(a.is_unspecified for a in addrs)
    return sorted(f"{url_host(str(a))}:{rt.port}" for a in addrs), differs


def _interrupted(j: Journal, state, plan: Plan, sink, *, stale: dict | None = None,  # noqa: ANN001
                 changing: bool = True, down: Sequence[str] = (), removed: Sequence[str] = ()) -> None:
    # *down*: units it had begun to restart (or stopped first for another role), not started again; *removed*: units
    # of dropped roles it had begun to stop and remove, not crossed off: neither may run now
    # *stale*: the steps as the run found them: before it journals its own target (the port checks), a "running"
    # step there is a killed earlier apply's, not where this one stopped. *changing*: the run had begun to journal its
    # target; before that it changed nothing, and where the journal records nothing deployed and no unfinished apply
    # (a first deployment), nothing of it runs either: "what already runs stays as it is … or `pdctl down`" would
    # describe what is not there
    from pdctl.statemachine.events import Event

    if not changing and state.deployed is None and state.target is None:
        j.audit("apply-interrupted", plan_id=plan.plan_id, step=None)
        sink.emit(Event.apply_not_started(plan.plan_id))
        return

    step = None if state.steps == stale else \
        next((name for name, rec in state.steps.items() if rec.status == "running"), None)
    if step is not None:
        state.steps[step].status = "interrupted"
        state.steps[step].finished_at = time.time()
        j.write(state)
    j.audit("apply-interrupted", plan_id=plan.plan_id, step=step, stopped=[*down, *removed])
    during = f" during {step}" if step else ""
    if removed and not down:
        # (each one's stop had begun: its processes may still be exiting when this is said, so not asked, as *down* is)
        said = (f"interrupted{during} while removing {', '.join(removed)} (the spec drops "
                f"{'its role' if len(removed) == 1 else 'their roles'}): {'it was' if len(removed) == 1 else 'they were'}"
                " being stopped and may not run now (`pdctl status` shows it); apply again to converge, or `pdctl down` "
                "to stop the rest")
    elif down:  # (*down*: units it had begun to restart, stopped and not started again: they may not run now)
        down = [*down, *removed]
        said = (f"interrupted{during} while restarting {', '.join(down)}: "
                f"{'it was' if len(down) == 1 else 'they were'} stopped for the restart and may not run now "
                "(`pdctl status` shows it); apply again to start it and converge, or `pdctl down` to stop the rest")
    else:
        said = f"interrupted{during}: what already runs stays as it is; apply again to converge, or `pdctl down` to stop it"
    sink.emit(Event("apply_interrupted", said, step=step, data={"plan_id": plan.plan_id,
                                                                "stopped": list(dict.fromkeys([*down, *removed]))}))


_DOWN_WORDS = {"down-started": "a `pdctl down` that was killed", "down-interrupted": "a `pdctl down` that was "
               "interrupted", "down-failed": "a `pdctl down` that failed"}


def _units_of_step(step: str, topo: Topology, names: dict[str, str]) -> list[str]:
    """The units whose processes *step*'s proof is about: a role kind's ``<kind>_up`` its roles, the KV link both
    ends, ``router_exposed`` the router, ``parsers_configured`` every server and the router (its chat goes through)."""
    roles = {r.name: r.kind for r in topo.roles}
    if step.endswith("_up"):
        return [names[n] for n, kind in roles.items() if f"{kind}_up" == step and n in names]
    if step == "kv_link_verified":
        return [names[n] for n, kind in roles.items() if kind in ("prefill", "decode") and n in names]
    if step in ("router_exposed", "parsers_configured"):
        every = [names[n] for n in roles if n in names] if step == "parsers_configured" else []
        return every + ([names["router"]] if "router" in names else [])
    return []


def _boot_time(host) -> int | None:  # noqa: ANN001
    """*host*'s boot time in epoch seconds (``/proc/stat``'s ``btime``, proc(5)); None where it cannot be read."""
    try:
        return next(int(line.split()[1]) for line in host.read_file("/proc/stat").decode().splitlines()
                    if line.startswith("btime "))
    except (OSError, HostError, ValueError, StopIteration):
        return None


def _process_started_at(host, pid: int, boot: int | None) -> float | None:  # noqa: ANN001
    """When process *pid* on *host* started, in epoch seconds: ``/proc/PID/stat``'s start time (field 22, clock ticks
    since boot, proc(5)) after *boot* (:func:`_boot_time`); None where either cannot be read."""
    from pdctl.units import proc_starttime

    if boot is None:
        return None
    try:
        ticks = proc_starttime(host.read_file(f"/proc/{pid}/stat"))
    except (OSError, HostError):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK") if ticks >= 0 else None


def _can_run_commands(dep: Deployment, host) -> None:  # noqa: ANN001
    """Prove *host* answers and runs a command (``true``). An SSH account that logs in but cannot run one (a
    nologin shell: "This account is currently not available") is named by its spec field; raises HostError."""
    from pdctl.statemachine.errors import CommandFailed

    try:
        host.run(["true"], timeout=30)
    except CommandFailed as exc:
        key = _host_key(dep) or "local"
        said = (exc.stderr or "").strip().splitlines()
        raise HostError(
            f"host {key!r} logs in but cannot run commands (`true` exited {exc.returncode}: "
            f"{' / '.join(said[-2:]) or 'no output'}); nothing was changed or read",
            host=key,
            hint=f"hosts.{key}.ssh_user must be an account with a login shell (nologin and false refuse every "
                 "command) that may run the engine and the service manager",
        ) from None


def machine_of(host) -> dict[str, str] | None:  # noqa: ANN001
    """The machine *host* reaches: ``machine_id`` (machine-id(5): ``/etc/machine-id``, else the D-Bus copy),
    ``hostname`` and ``reached_as`` (local, or ssh user@address:port); None where the host has no machine id."""
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            mid = host.read_file(path).decode(errors="replace").strip()
        except Exception:  # noqa: BLE001 - absent or unreadable: try the next
            continue
        if mid:
            break
    else:
        return None
    try:
        hostname = host.read_file("/proc/sys/kernel/hostname").decode(errors="replace").strip()
    except Exception:  # noqa: BLE001 - the hostname only names the machine in messages
        hostname = "?"
    over_ssh = hasattr(host, "address") and hasattr(host, "port")  # an SshHost (importing it would load asyncssh)
    reached = f"ssh {host.user + '@' if host.user else ''}{host.address}:{host.port}" if over_ssh else "local"
    return {"machine_id": mid, "hostname": hostname, "reached_as": reached}


_ON_ANOTHER_MACHINE = {
    "applying": "applying there would start a second copy and leave the first running",
    "stopping it": "stopping it there would record the running copy as stopped",
    "reading its status": "what is read there says nothing of the copy that runs",
    "chatting with it": "what answers there is not the copy that runs",
}


def refuse_another_machine(loaded: Loaded, state, here: dict[str, str] | None, action: str) -> None:  # noqa: ANN001
    """Raise HostError when the spec's host now reaches another machine than the one the recorded deployment runs on
    (an address, ``connect`` or ``ssh_port`` pointing elsewhere, an SSH tunnel): *action* (a key of
    ``_ON_ANOTHER_MACHINE``) there would start a second copy (apply) or record the running one as stopped (down).
    Nothing recorded, or no machine id on either side: nothing to compare. The same hostname reached the same way
    is taken for the same machine whose machine-id changed (regenerated at boot from an empty /etc/machine-id, or
    by systemd-machine-id-setup): not refused; apply records the new id."""
    was = state.machine
    if not was or not here or (state.deployed is None and state.target is None):
        return
    if was["machine_id"] == here["machine_id"]:
        return
    if (was.get("hostname"), was.get("reached_as")) == (here["hostname"], here["reached_as"]):
        return
    host = _host_key(loaded.deployment) or "local"
    raise HostError(
        f"the spec's host {host!r} now reaches machine {here['hostname']} ({here['reached_as']}, machine-id "
        f"{here['machine_id'][:12]}…), but deployment {loaded.deployment.name!r} runs on {was['hostname']} "
        f"({was.get('reached_as', '?')}, machine-id {was['machine_id'][:12]}…): {_ON_ANOTHER_MACHINE[action]}; "
        "nothing was changed",
        host=host,
        hint=f"restore hosts.{host} (address, connect, ssh_port) to reach {was['hostname']} again; to move the "
             "deployment, `pdctl down` it with those settings first, then apply with the new ones; if "
             f"{was['hostname']} is gone for good, move {loaded.journal.path} aside (nothing then counts as deployed)",
    )


def _lock_holder(loaded: Loaded) -> dict[str, Any] | None:
    # Who holds the deployment's lock now (an apply or down running in another process), as the lock file names it.
    try:
        return loaded.journal.held_by()
    except Exception:  # noqa: BLE001 - an unreadable or foreign lock file: the lock's state is a courtesy here
        return None


def down(loaded: Loaded, *, sink=None) -> list[str]:  # noqa: ANN001
    """Stop everything in reverse order (router, decode, prefill), remove the units, and record
    that nothing is deployed. Returns the units stopped. Holds the lock; where nothing was ever recorded (no state
    directory, nothing installed) it creates nothing. Raises HostError, stopping nothing, when nothing of the
    deployment is installed here yet its own processes hold its ports (applied another way)."""
    from pdctl.statemachine.events import NullSink

    from pdctl.statemachine import launch

    sink = sink or NullSink()
    j = loaded.journal
    # (a spec since edited to another service_manager: what runs was started under the recorded one, which stops it)
    dep = as_recorded_manager(loaded.deployment, j.read() if j.dir.exists() else None)
    with contextlib.closing(deployment_host(loaded.deployment)) as host:  # (an SSH connection: closed after)
        manager = launch.manager_for(dep, host, state_dir=str(j.dir))
        if not j.dir.exists() and not _installed_units(loaded, j.read(), manager):
            _refuse_if_held_elsewhere(loaded, j, manager.host, sink)  # nothing ever recorded here: create nothing (no lock, no audit)
            return []
        with j.lock("down"):
            state = j.read()
            # the host answers before anything is recorded: a down that could not reach it stopped nothing, and the audit
            # log then holds no "down-failed" that status would report as a down that may have stopped part of it
            _can_run_commands(loaded.deployment, manager.host)  # (a nologin ssh_user: named by its field, as apply does)
            refuse_another_machine(loaded, state, machine_of(manager.host), "stopping it")
            _journal_writable(j, state)  # (a journal it cannot write after the stops: "edited outside pdctl" units after)
            j.audit("down-started", serial=state.serial)
            try:
                return _down_locked(loaded, j, state, sink, manager)
            except KeyboardInterrupt:  # Ctrl-C, or SIGTERM through the CLI: what is stopped stays stopped; run down again
                j.audit("down-interrupted")
                raise
            except Exception as exc:
                j.audit("down-failed", error=str(exc))
                raise


def _journal_writable(j: Journal, state) -> None:  # noqa: ANN001
    """Write *state* back as it is (the next serial) before ``down`` stops anything: a state directory this user cannot
    write (permissions, an immutable flag, a read-only or full file system) then stops nothing, rather than every unit
    stopped and removed and the journal still recording them deployed. Raises :class:`PdctlError` naming the journal,
    the OS's reason and the fix."""
    from pdctl.statemachine.errors import PdctlError

    try:
        j.write(state)
    except StateDirUnwritable as exc:  # (full, read-only, over quota: named with its fix)
        exc.message += "; nothing was stopped"
        exc.args = (exc.message,)
        raise
    except OSError as exc:
        raise PdctlError(
            f"cannot write the journal {j.path}: {exc.strerror or exc}; nothing was stopped",
            hint=f"make {j.dir} writable by this user (its permissions; `lsattr -d {j.dir}` shows an immutable flag, "
                 "which `chattr -i` clears; free space on a full disk), then run down again",
        ) from exc


def as_recorded_manager(dep: Deployment, state) -> Deployment:  # noqa: ANN001
    """*dep* with the service manager the journal records it applied with (``steps.recorded_service_manager``) where the
    spec now names another: ``down`` (and ``status``) then reach the units that run, not an empty other manager."""
    from pdctl.statemachine.steps import recorded_service_manager

    was = recorded_service_manager(state)
    return dep if was in (None, dep.service_manager) else dep.model_copy(update={"service_manager": was})


def _refuse_if_held_elsewhere(loaded: Loaded, j: Journal, host, sink) -> None:  # noqa: ANN001
    """Nothing of the deployment is installed for this state directory and service manager: if its ports are held
    all the same by its own roles' processes (the role's unit, ``pdctl-<name>-<role>.service``, above the listener:
    applied with another ``--state-dir``, ``XDG_STATE_HOME``, user or service manager), say so rather than report a
    successful stop of nothing. Ports held by anything else are not this deployment's business here; ports held by
    processes this user cannot inspect (another user's) get an ``info`` event on *sink*. Raises HostError naming each
    holder; changes nothing."""
    from pdctl.statemachine import ports
    from pdctl.statemachine.errors import HostError
    from pdctl.statemachine.steps import deployment_ports

    dep = loaded.deployment
    topo = topology_of(dep)
    wanted = deployment_ports(topo)
    # The deployment's unit names: markers no other deployment's units hold (any of them, not only the port's role:
    # ports may have moved between roles since the apply)
    units = unit_names(topo).values()
    held = ports.listeners(host, set(wanted))
    started = {x: ports.started_by(host, x.pid, units) for x in held if x.pid is not None}
    ours = [x for x, how in started.items() if how]
    applied = {a for how in started.values() if how and (a := ports.applied_with(how))}  # where the holders tell
    unseen = sorted({x.port for x in held if x.pid is None})
    if unseen and not ours:
        from pdctl.statemachine.events import Event

        # /proc/<pid>/fd of another user's process is closed to us: whose these are cannot be told
        sink.emit(Event("info", f"note: port(s) {', '.join(map(str, unseen))} of {dep.name!r} are held by processes "
                                "this user cannot see; if the deployment was applied as another user, run down as "
                                "that user (or root)",
                        data={"ports": unseen}))
    if ours:
        who = "; ".join(f"{wanted[x.port]}'s port {x.port} by PID {x.pid} ({x.command or 'unknown'})" for x in ours)
        raise HostError(
            f"nothing of {dep.name!r} is installed here (service manager {dep.service_manager}, state directory "
            f"{j.dir}), yet its own processes hold its ports: {who}; nothing was stopped"
            + (f"; it was applied with {' and '.join(sorted(applied))}" if applied else ""),
            hint="run down the way the deployment was applied: the same user, service_manager and --state-dir (or "
                 "XDG_STATE_HOME)",
        )


def _installed_units(loaded: Loaded, state, manager) -> list[str]:  # noqa: ANN001
    """The deployment's units (of what the journal records, what the spec asks, and any other it installed under
    *manager*) that *manager* has installed, in stopping order: router, decode, the rest."""
    names: list[str] = list(dict.fromkeys(state.removing))  # an interrupted apply's dropped roles not yet removed
    for topo in (state.target, state.deployed, topology_of(loaded.deployment)):
        if topo is None:
            continue
        for n in unit_names(topo).values():
            if n not in names:
                names.append(n)
    # ...and every other service of the deployment installed here, which no journal records (one moved aside, or an
    # apply of another spec of the name that the journal lost): down left them running, out of every later view
    names += [n for n in manager.installed_units_of(loaded.deployment.name) if n not in names]
    names.sort(key=_stop_order)
    return [n for n in names if manager.installed_text(n) is not None]


def _recorded_units(state) -> set[str]:  # noqa: ANN001
    """The journal's units that may have processes to look for once their files are gone: those of the deployed
    topology and of an unfinished apply's target that it records as started, and its drop list."""
    return set(state.removing) | {n for t in (state.target, state.deployed) if t for n in unit_names(t).values()
                                  if n in state.units}


def _stop_orphaned(manager, state, sink) -> None:  # noqa: ANN001
    """Stop what still runs of the journal's units (deployed, an unfinished apply's target, its drop list) whose unit
    files are gone (a supervisor folder removed by hand while its role ran, or all its files but the unit's own:
    :meth:`ServiceManager.stop_orphans`), each said as an event. down and apply do it before their port checks, which would otherwise find the deployment's own
    processes on its ports with nothing to stop them (apply waited 225 s for them, then failed). Only units the journal
    records as started are looked for (each look is a scan of the host's ``/proc``): a target's unit never started has
    nothing to find."""
    from pdctl.statemachine.events import Event

    for n in sorted(_recorded_units(state), key=_stop_order):
        if pids := manager.stop_orphans(n):
            sink.emit(Event("info", f"stopped {n}'s processes (PIDs {', '.join(map(str, pids))}): its files were gone",
                            data={"unit": n, "was": "orphaned"}))


def _down_locked(loaded: Loaded, j: Journal, state, sink, manager) -> list[str]:  # noqa: ANN001
    # down's work under the lock: stop the units (router first), remove them, journal that nothing is deployed
    from pdctl.statemachine.events import Event

    names = _installed_units(loaded, state, manager)
    # (a unit name this deployment shares with another's, pdctl-NAME-ROLE, that the other installed: not this one's to
    # stop or remove)
    owners = {n: manager.installed_deployment(n) for n in names}
    for n, owner in owners.items():
        if owner not in (None, loaded.deployment.name):
            names.remove(n)
            sink.emit(Event("info", f"{n} belongs to deployment {owner!r}: left as it is", data={"unit": n}))
    # every unit in stop order (router first, then decode, then prefill: the router never routes to a role already
    # stopped), an orphaned one's processes (its files gone) stopped in its turn; they were stopped before all others
    orphans = set(_recorded_units(state))
    if not names and not orphans:
        _refuse_if_held_elsewhere(loaded, j, manager.host, sink)
    for n in sorted(set(names) | orphans, key=_stop_order):
        if n in orphans and (pids := manager.stop_orphans(n)):
            sink.emit(Event("info", f"stopped {n}'s processes (PIDs {', '.join(map(str, pids))}): its files were gone",
                            data={"unit": n, "was": "orphaned"}))
            if n in names:
                manager.stop(n)  # (what its folder still records, if anything)
            continue
        if n not in names:
            continue
        was = manager.status(n).state
        ran = was in ("active", "activating", "deactivating")
        if ran:  # (a server or router may take seconds to exit: said before, not only after)
            sink.emit(Event("info", f"stopping {n}", data={"unit": n, "was": was}))
        manager.stop(n)
        sink.emit(Event("info", f"stopped {n}" if ran else f"{n} was not running ({was})", data={"unit": n, "was": was}))
    if not names and orphans:
        _refuse_if_held_elsewhere(loaded, j, manager.host, sink)
    manager.remove(names + [f"pdctl-{loaded.deployment.name}.target"], deployment=loaded.deployment.name)
    if state.deployed is not None:  # (what the next first deployment's plan compares itself with)
        state.taken_down, state.taken_down_at = state.deployed, time.time()
    state.deployed = None
    state.target = None
    state.steps = {}
    state.units = {}  # nothing runs: no definition is proven any more
    state.removing = []
    state.machine = None  # nothing runs anywhere: the next apply may start it on any machine
    j.write(state)
    j.audit("down-done", units=names)
    return names
