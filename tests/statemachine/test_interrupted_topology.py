"""After an interrupted apply (a first deployment, a change, a topology change), `plan`, `status` and `apply` of either
spec tell the same story of what runs: what `plan` lists is what `apply` then does.

End to end on the demo (the SGLang stand-in under the process supervisor, the real smg router). The interruption is
the one the CLI makes of Ctrl-C, SIGTERM and SIGHUP (a KeyboardInterrupt out of the engine's event sink), raised at
an exact event so that the state it leaves is the one under test, not a race.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import time

import httpx
import pytest

from harness.sim import free_ports

from pdctl.statemachine import service
from pdctl.statemachine.hosts import LocalHost

pytestmark = [pytest.mark.smg, pytest.mark.slow]


class _InterruptAt:
    """An apply's sink that interrupts it, as Ctrl-C would, at the *nth* event of *kind* (and *step*, when given)."""

    def __init__(self, kind: str, *, nth: int = 1, step: str | None = None) -> None:
        self.kind, self.nth, self.step, self.seen = kind, nth, step, 0

    def emit(self, event) -> None:  # noqa: ANN001
        if event.kind == self.kind and (self.step is None or event.step == self.step):
            self.seen += 1
            if self.seen == self.nth:
                raise KeyboardInterrupt


def _collapse(d: dict, port: int) -> dict:
    c = copy.deepcopy(d)
    c.pop("prefill"), c.pop("decode"), c.pop("kv_transfer"), c.pop("router")
    c["server"] = [{"gpus": list(range(8)), "tp": 8, "http_host": "127.0.0.1", "port": port}]
    return c


def _collapse_interrupted(demo, sink: _InterruptAt):  # noqa: ANN001, ANN202
    """The demo applied, then its collapse into one server (confirmed) interrupted by *sink*: (the collapse spec's path,
    the confirmed plan)."""
    demo.apply()
    collapse = demo.write(_collapse(demo.dict, demo.ports["router"]), "collapse.toml")
    confirmed = service.plan_spec(demo.load(collapse))
    with pytest.raises(KeyboardInterrupt):
        demo.apply(collapse, confirm=confirmed.plan_id, sink=sink)
    return collapse, confirmed


def _server_info(port: int) -> dict:
    with httpx.Client(trust_env=False) as c:
        return c.get(f"http://127.0.0.1:{port}/server_info").json()


def test_a_collapse_interrupted_once_pd_was_removed_is_planned_and_shown_as_pd_to_start_again(demo):
    # (status of the PD spec said "(single)" while its plan said "No changes to what was recorded as deployed", and
    # apply then started all of PD again under a plan that had listed nothing)
    demo.apply()
    collapse = demo.write(_collapse(demo.dict, demo.ports["router"]), "collapse.toml")
    confirmed = service.plan_spec(demo.load(collapse))
    assert confirmed.requires_confirmation
    # Ctrl-C as the last PD role (prefill, after the router and decode) is removed, before the server starts
    with pytest.raises(KeyboardInterrupt):
        demo.apply(collapse, confirm=confirmed.plan_id, sink=_InterruptAt("role_removed", nth=3))
    assert demo.pids() == []  # nothing runs
    # the journal lags by the last removal (the interruption came before it crossed prefill off): what runs is asked
    assert demo.load().journal.read().removing == [f"pdctl-{demo.name}-prefill.service"]

    # plan of the PD spec: the work apply does (PD started again), exit 2; a restore of what was recorded, no
    # topology change to confirm
    plan = demo.cli("plan", str(demo.spec))
    assert plan.returncode == 2, plan.stderr
    assert "No changes" not in plan.stdout, plan.stdout
    for address in ("role.prefill", "role.decode", "router"):
        assert f"# {address} will be started again (disruptive)" in plan.stdout, plan.stdout
    assert "# kv_link will be set up again (disruptive)" in plan.stdout, plan.stdout
    assert "Plan: 4 to add, 0 to change, 0 to destroy." in plan.stdout and "Topology changes" not in plan.stdout
    data = json.loads(demo.cli("plan", str(demo.spec), "--json").stdout)
    assert {c["address"]: (c["action"], c["not_running"]) for c in data["changes"]} == {
        "role.prefill": ("create", "not installed"), "role.decode": ("create", "not installed"),
        "kv_link": ("create", "prefill, decode not running"), "router": ("create", "not installed")}
    assert data["class"] == "disruptive" and "did not finish" in data["unsettled"]

    # status says the same: PD recorded, the collapse unfinished, PD's roles removed
    st = json.loads(demo.cli("status", str(demo.spec), "--json").stdout)
    assert (st["recorded_mode"], st["mode"], st["applying"]) == ("pd", "single", True), st
    assert {u["name"] for u in st["removed"]} == {"prefill", "decode", "router"} and st["leftover"] == [], st
    text = demo.cli("status", str(demo.spec)).stdout
    assert text.splitlines()[0].startswith(f"deployment {demo.name} (pd → single): NOT healthy"), text
    removed = [line.split()[0] for line in text.splitlines()[1:] if line.split()[1:2] == ["removed"]]
    assert sorted(removed) == ["decode", "prefill", "router"], text

    # Resuming the collapse is still the change the operator confirmed, under its id; nothing of PD is left to destroy
    resume = demo.cli("plan", str(collapse))
    assert resume.returncode == 2 and f"--confirm-topology {confirmed.plan_id}" in resume.stdout, resume.stdout
    assert "# role.prefill is gone already (topology): nothing left to destroy" in resume.stdout, resume.stdout
    assert "Plan: 1 to add, 0 to change, 0 to destroy." in resume.stdout, resume.stdout

    # Back to PD, as its plan said: no confirmation, and apply's plan event says what it starts
    r = demo.cli("apply", str(demo.spec), "--json")
    assert r.returncode == 0, r.stderr
    first = json.loads(r.stdout.splitlines()[0])
    assert first["kind"] == "plan" and first["message"] == f"plan {data['plan_id']}: roles that do not run now, to " \
                                                           "start again", first
    st = demo.status()
    assert st["healthy"] and st["removed"] == [] and len(demo.pids()) == 3, st


def test_going_back_from_a_reshape_whose_role_was_proven_needs_the_confirmation(demo):
    # A reshape (prefill TP4 on GPUs 0-3 -> TP2 on 0-1) interrupted right after it proved the TP2 prefill: the plan of
    # the recorded spec said no changes, and apply rebuilt prefill as TP4 with no confirmation
    demo.apply()
    d = copy.deepcopy(demo.dict)
    d["prefill"][0].update(gpus=[0, 1], tp=2)
    reshape = demo.write(d, "reshape.toml")
    confirm = service.plan_spec(demo.load(reshape)).plan_id
    with pytest.raises(KeyboardInterrupt):
        demo.apply(reshape, confirm=confirm, sink=_InterruptAt("step_verified", step="prefill_up"))
    assert _server_info(demo.ports["prefill"])["tp_size"] == 2
    pids = demo.pids()
    plan = demo.cli("plan", str(demo.spec))
    assert plan.returncode == 2, plan.stderr
    assert "prefill tp 2 → 4" in plan.stdout and "prefill gpus 0,1 → 0,1,2,3" in plan.stdout, plan.stdout
    plan_id = next(line.split()[2] for line in plan.stdout.splitlines() if line.startswith("plan id:"))
    r = demo.cli("apply", str(demo.spec))
    assert r.returncode == 2 and "changes the topology" in r.stderr, r.stderr
    assert demo.pids() == pids  # refused before anything changed
    r = demo.cli("apply", str(demo.spec), "--confirm-topology", plan_id)
    assert r.returncode == 0, r.stderr
    assert _server_info(demo.ports["prefill"])["tp_size"] == 4
    assert demo.status()["healthy"]


def _role_line(text: str, name: str) -> str:
    return next(line for line in text.splitlines()[1:] if line.split()[:1] == [name])


def test_status_of_pd_roles_a_collapse_drops_but_that_still_run_says_what_each_choice_does(demo):
    # (status said of them "applying either spec again, or `pdctl down`, removes it", while applying the PD spec kept
    # both, same PIDs, and its plan only started the router again)
    demo.apply()
    collapse = demo.write(_collapse(demo.dict, demo.ports["router"]), "collapse.toml")
    confirmed = service.plan_spec(demo.load(collapse))
    # Ctrl-C right after the first removal: the router's; prefill and decode still run
    with pytest.raises(KeyboardInterrupt):
        demo.apply(collapse, confirm=confirmed.plan_id, sink=_InterruptAt("role_removed", nth=1))
    st = json.loads(demo.cli("status", str(demo.spec), "--json").stdout)
    assert {u["name"] for u in st["leftover"]} == {"prefill", "decode"}, st
    assert st["recorded_requires_confirmation"] is False, st
    pids = {u["name"]: u["main_pid"] for u in st["leftover"]}
    text = demo.cli("status", str(demo.spec)).stdout
    for name in ("prefill", "decode"):
        line = _role_line(text, name)
        assert "either spec" not in line, text
        assert ("[of the recorded deployment, which the unfinished apply drops: applying the recorded (pd) spec keeps "
                "it; applying the unfinished apply's (single) spec again, or `pdctl down`, removes it]") in line, text

    # what it says of the PD spec is what its plan and apply do: only the router started again, prefill and decode kept
    plan = demo.cli("plan", str(demo.spec), "--json")
    assert plan.returncode == 2, plan.stderr
    assert [c["address"] for c in json.loads(plan.stdout)["changes"]] == ["router"], plan.stdout
    r = demo.cli("apply", str(demo.spec))
    assert r.returncode == 0, r.stderr
    st = demo.status()
    assert st["healthy"] and {r["name"]: r["main_pid"] for r in st["roles"]} == pids, st


def test_status_of_pd_roles_removed_once_the_single_server_started_names_the_confirmation(demo):
    # (status said of the removed PD roles "applying the recorded spec starts it again", while going back is then a
    # topology change that apply refuses without --confirm-topology)
    _collapse_interrupted(demo, _InterruptAt("step_verified", step="server_up"))
    st = json.loads(demo.cli("status", str(demo.spec), "--json").stdout)
    assert {u["name"] for u in st["removed"]} == {"prefill", "decode", "router"} and st["leftover"] == [], st
    assert st["recorded_requires_confirmation"] is True, st
    text = demo.cli("status", str(demo.spec)).stdout
    for name in ("prefill", "decode", "router"):
        line = _role_line(text, name)
        assert ("[of the recorded deployment, removed already by the unfinished apply that drops it: applying the "
                "recorded (pd) spec is a topology change to confirm (`pdctl plan` shows its id) that starts it "
                "again]") in line, text
    # as its plan and apply say
    plan = json.loads(demo.cli("plan", str(demo.spec), "--json").stdout)
    assert plan["class"] == "topology" and plan["from_topology"]["mode"] == "single", plan
    r = demo.cli("apply", str(demo.spec))
    assert r.returncode == 2 and "changes the topology" in r.stderr, r.stderr


def test_going_back_once_the_started_server_no_longer_runs_is_no_topology_change(demo):
    # (helper-99: an apply interrupted as it started a role of the other shape left it not running, yet plan and status
    # of the recorded spec asked a topology confirmation and counted the stopped role as a destroy)
    from pdctl.statemachine import launch

    _collapse_interrupted(demo, _InterruptAt("step_verified", step="server_up"))
    loaded = demo.load()
    manager = launch.manager_for(loaded.deployment, LocalHost(), state_dir=str(loaded.journal.dir))
    manager.stop(f"pdctl-{demo.name}-server.service")
    st = json.loads(demo.cli("status", str(demo.spec), "--json").stdout)
    assert st["recorded_requires_confirmation"] is False, st
    plan = json.loads(demo.cli("plan", str(demo.spec), "--json").stdout)
    assert plan["class"] != "topology" and plan["from_topology"]["mode"] == "pd", plan
    r = demo.cli("apply", str(demo.spec))
    assert r.returncode == 0, r.stderr
    assert demo.status()["healthy"] and len(demo.pids()) == 3


def test_an_apply_interrupted_while_it_removes_a_dropped_role_says_that_role_was_stopped(demo, monkeypatch):
    # (helper-99: SIGTERM just after apply_started of a collapse: "what already runs stays as it is", stopped [], and
    # no role_removed, while the router it was removing had been stopped)
    from pdctl.statemachine.events import ListSink
    from pdctl.units import ProcessSupervisor

    demo.apply()
    router = demo.status()["router"]["main_pid"]
    collapse = demo.write(_collapse(demo.dict, demo.ports["router"]), "collapse.toml")
    confirmed = service.plan_spec(demo.load(collapse))
    real_stop = ProcessSupervisor.stop

    def stop_then_interrupted(self, name, **kw):  # (Ctrl-C as the first removal's stop returns)
        real_stop(self, name, **kw)
        raise KeyboardInterrupt

    def signalled_then_interrupted(self, name, **kw):  # (Ctrl-C a moment after its SIGTERM, the role still exiting)
        wpid = self._watchdog_pid(name)
        os.kill(wpid, signal.SIGTERM)
        raise KeyboardInterrupt

    monkeypatch.setattr(ProcessSupervisor, "stop", stop_then_interrupted)
    sink = ListSink()
    with pytest.raises(KeyboardInterrupt):
        demo.apply(collapse, confirm=confirmed.plan_id, sink=sink)
    monkeypatch.setattr(ProcessSupervisor, "stop", real_stop)
    end = sink.events[-1]
    unit = f"pdctl-{demo.name}-router.service"
    assert end.kind == "apply_interrupted" and end.data["stopped"] == [unit], end
    assert f"while removing {unit} (the spec drops its role): it was being stopped" in end.message, end.message
    assert not [e for e in sink.events if e.kind == "role_removed"]
    assert router not in demo.pids()
    # the same with the role still exiting when the interruption is said (helper-100: SIGTERM ~5 ms after
    # apply_started gave stopped [] and "what already runs stays as it is": the unit still read active)
    demo.apply()
    monkeypatch.setattr(ProcessSupervisor, "stop", signalled_then_interrupted)
    sink = ListSink()
    with pytest.raises(KeyboardInterrupt):
        demo.apply(collapse, confirm=service.plan_spec(demo.load(collapse)).plan_id, sink=sink)
    monkeypatch.setattr(ProcessSupervisor, "stop", real_stop)
    assert sink.events[-1].data["stopped"] == [unit], sink.events[-1]


def _pids(demo) -> dict[str, int | None]:  # noqa: ANN001
    st = demo.status()
    router = {"router": st["router"]["main_pid"]} if st["router"] else {}
    return {r["name"]: r["main_pid"] for r in st["roles"]} | router


def test_a_first_deployment_interrupted_once_prefill_was_proven_plans_prefill_as_kept(demo):
    # (status showed prefill_up done and prefill active while plan said "+ role.prefill will be created")
    with pytest.raises(KeyboardInterrupt):
        demo.apply(sink=_InterruptAt("step_verified", step="prefill_up"))
    st = json.loads(demo.cli("status", str(demo.spec), "--json").stdout)
    assert st["steps"]["prefill_up"]["status"] == "done", st["steps"]
    assert [(r["name"], r["state"]) for r in st["roles"]] == [("prefill", "active"), ("decode", "inactive")], st
    plan = demo.cli("plan", str(demo.spec))
    assert plan.returncode == 2, plan.stderr
    assert "role.prefill will be created" not in plan.stdout and "+ role.prefill" not in plan.stdout, plan.stdout
    assert "# role.prefill runs already as specified (topology): apply keeps it" in plan.stdout, plan.stdout
    assert "kept: the unfinished apply started it with this spec's definition and proved it" in plan.stdout
    assert "# role.decode will be created (topology)" in plan.stdout, plan.stdout
    assert "Plan: 3 to add, 0 to change, 0 to destroy, 1 kept as the unfinished apply left it." in plan.stdout
    prefill = _pids(demo)["prefill"]
    r = demo.cli("apply", str(demo.spec))
    assert r.returncode == 0, r.stderr
    assert "prefill_up: already satisfied" in r.stderr and f"{demo.name}-prefill.service" not in r.stderr, r.stderr
    assert _pids(demo)["prefill"] == prefill and demo.status()["healthy"]


def test_another_spec_after_an_interrupted_first_deployment_plans_the_roles_apply_removes(demo):
    # (a first PD deployment killed once prefill ran, then a single-server spec of the same name: plan said "2 to add,
    # 0 to destroy ... a first deployment, no --confirm-topology needed", and apply stopped and removed prefill and decode)
    with pytest.raises(KeyboardInterrupt):
        demo.apply(sink=_InterruptAt("step_verified", step="prefill_up"))
    prefill = _pids(demo)["prefill"]
    collapse = demo.write(_collapse(demo.dict, demo.ports["router"]), "collapse.toml")
    plan = demo.cli("plan", str(collapse))
    assert plan.returncode == 2, plan.stderr
    assert "- role.prefill" in plan.stdout and "- role.decode" in plan.stdout, plan.stdout
    assert "--confirm-topology" in plan.stdout and "PD disaggregation → single server" in plan.stdout, plan.stdout
    assert "apply stops and removes what this spec lacks of it" in plan.stderr, plan.stderr
    r = demo.cli("apply", str(collapse))  # (the collapse the plan names is refused unconfirmed: prefill still serves)
    assert r.returncode == 2 and _pids(demo)["prefill"] == prefill, r.stderr
    planned = service.plan_spec(demo.load(collapse))
    assert {c.address for c in planned.changes if c.action == "delete"} >= {"role.prefill", "role.decode"}
    r = demo.cli("apply", str(collapse), "--confirm-topology", planned.plan_id)
    assert r.returncode == 0, r.stderr
    assert f"stopped and removed pdctl-{demo.name}-prefill.service" in r.stderr, r.stderr
    assert demo.load(collapse).journal.read().deployed == planned.to_topology


def test_a_router_an_interrupted_first_deployment_started_is_kept_not_restarted(demo):
    # (the router's start, unlike a restart, was not journalled: the resume took the ready router for another
    # definition and restarted it, while its plan had said nothing of it but "+ router will be created")
    with pytest.raises(KeyboardInterrupt):
        demo.apply(sink=_InterruptAt("step_applied", step="router_exposed"))
    deadline = time.monotonic() + 20  # (its supervisor names the router's PID once it has started it)
    while not (before := _pids(demo))["router"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert before["router"], before
    plan = demo.cli("plan", str(demo.spec), "--json")
    assert plan.returncode == 2, plan.stderr
    data = json.loads(plan.stdout)
    assert {c["address"]: c["kept"] is not None for c in data["changes"]} == {
        "role.prefill": True, "role.decode": True, "kv_link": True, "router": True}, data["changes"]
    assert data["counts"] == [0, 0, 0]
    r = demo.cli("apply", str(demo.spec))
    assert r.returncode == 0, r.stderr
    assert "restarting" not in r.stderr and f"{demo.name}-router.service unchanged" in r.stderr, r.stderr
    assert _pids(demo) == before and demo.status()["healthy"]


def _context_change_interrupted_at(demo, step: str, kind: str = "step_verified"):  # noqa: ANN001, ANN202
    """The demo applied, then a context_length change (131072 -> 65536) interrupted at *step*'s first event of *kind*
    (default: as it is proven): (the changed spec as a dict, its path)."""
    demo.apply()
    d = copy.deepcopy(demo.dict)
    d["model"]["context_length"] = 65536
    changed = demo.write(d, "ctx65.toml")
    with pytest.raises(KeyboardInterrupt):
        demo.apply(changed, sink=_InterruptAt(kind, step=step))
    return d, changed


def _manager(demo):  # noqa: ANN001, ANN202
    """(the recorded spec's unit set, its service manager)."""
    from pdctl.statemachine import launch

    loaded = demo.load()
    return (launch.unit_set_for(loaded.deployment, state_dir=str(loaded.journal.dir)),
            launch.manager_for(loaded.deployment, LocalHost(), state_dir=str(loaded.journal.dir)))


def test_a_change_interrupted_at_prefill_leaves_decode_its_file_so_a_crash_restarts_it_as_it_ran(demo):
    # (the change's first step wrote every role's unit file: decode, which the apply never reached, kept serving
    # 131072 from a file asking 65536, and its supervisor restarted it with 65536 after a crash)
    _context_change_interrupted_at(demo, "prefill_up")
    units, manager = _manager(demo)
    prefill, decode = (f"pdctl-{demo.name}-{r}.service" for r in ("prefill", "decode"))
    assert "65536" in manager.installed_text(prefill), manager.installed_text(prefill)
    assert "131072" in manager.installed_text(decode) and "65536" not in manager.installed_text(decode)
    assert manager.pending_changes(units) == [prefill], manager.pending_changes(units)
    old = _pids(demo)["decode"]
    os.kill(old, signal.SIGKILL)  # (a server process pdctl's own apply started, by its PID)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        pid = _pids(demo)["decode"]
        if pid not in (None, old):
            try:
                if _server_info(demo.ports["decode"]).get("context_length"):
                    break
            except (httpx.HTTPError, ValueError):
                pass
        time.sleep(0.2)
    assert _pids(demo)["decode"] not in (None, old), "decode was not restarted after its crash"
    assert _server_info(demo.ports["decode"])["context_length"] == 131072


def test_after_an_interrupted_change_plan_lists_every_restart_apply_does_compared_with_what_runs(demo):
    # A context_length change (131072 -> 65536) interrupted as decode_up was about to restart decode: prefill runs
    # 65536, decode still 131072 though its unit file was rewritten. A third spec's plan said "131072 → 8192" for
    # prefill; the recorded spec's said no changes, then apply restarted prefill and decode. Decode runs what the
    # recorded spec asks (the same process, journalled as restarting:<its fingerprint>@<its PID>): kept, its file
    # written back, not restarted (a fresh user saw it restarted, a needless model reload on a GPU host)
    d, _half = _context_change_interrupted_at(demo, "decode_up", kind="info")
    decode_unit = f"pdctl-{demo.name}-decode.service"
    assert "65536" in _manager(demo)[1].installed_text(decode_unit)  # (rewritten, not restarted)
    assert _server_info(demo.ports["prefill"])["context_length"] == 65536
    assert _server_info(demo.ports["decode"])["context_length"] == 131072

    d["model"]["context_length"] = 8192
    third = json.loads(demo.cli("plan", str(demo.write(d, "ctx8.toml")), "--json").stdout)
    assert {c["address"]: [(a["before"], a["after"]) for a in c["changes"]] for c in third["changes"]} == {
        "role.prefill": [(65536, 8192)], "role.decode": [(131072, 8192)]}, third["changes"]

    plan = demo.cli("plan", str(demo.spec))
    assert plan.returncode == 2 and "No changes" not in plan.stdout, plan.stdout
    assert "      ~ settings.model.context_length: 65536 → 131072" in plan.stdout, plan.stdout
    assert "  # role.prefill will be restarted (disruptive)" in plan.stdout, plan.stdout
    assert "runs now: it runs what the unfinished apply started for its own spec" in plan.stdout, plan.stdout
    assert "role.decode" not in plan.stdout, plan.stdout  # what runs is what the recorded spec asks
    data = json.loads(demo.cli("plan", str(demo.spec), "--json").stdout)
    planned = {r for c in data["changes"] for r in c["restarts"]}
    assert planned == {"prefill"} and data["class"] == "disruptive", data["changes"]
    router, decode = _pids(demo)["router"], _pids(demo)["decode"]
    r = demo.cli("apply", str(demo.spec), "--json")
    assert r.returncode == 0, r.stderr
    events = [json.loads(x) for x in r.stdout.splitlines()]
    assert events[0]["message"].split("; ")[0] == f"plan {data['plan_id']}: changes that restart roles", events[0]
    restarted = {e["message"].split()[1].removeprefix(f"pdctl-{demo.name}-").removesuffix(".service")
                 for e in events if e["kind"] == "info" and e["message"].startswith("restarting ")}
    assert restarted == planned, events
    assert _pids(demo)["router"] == router and _pids(demo)["decode"] == decode
    assert {_server_info(demo.ports[k])["context_length"] for k in ("prefill", "decode")} == {131072}
    assert demo.status()["healthy"]
    # decode's unit file is the recorded spec's again (a later restart of decode, after a crash, runs 131072), its
    # record the proven fingerprint, and the next plan has nothing to do
    from pdctl.statemachine import launch
    from pdctl.statemachine.steps import fingerprint_of

    loaded = demo.load()
    unit = f"pdctl-{demo.name}-decode.service"
    units = launch.unit_set_for(loaded.deployment, state_dir=str(loaded.journal.dir))
    manager = launch.manager_for(loaded.deployment, LocalHost(), state_dir=str(loaded.journal.dir))
    assert manager.pending_changes(units) == [] and "131072" in manager.installed_text(unit)
    assert loaded.journal.read().units[unit] == fingerprint_of(units, unit)
    assert json.loads(demo.cli("plan", str(demo.spec), "--json").stdout)["changes"] == []


def test_resuming_a_collapse_whose_server_started_plans_the_server_as_kept(demo):
    # (the resumed collapse listed "+ role.server will be created" while the server it had started and proved ran)
    collapse, confirmed = _collapse_interrupted(demo, _InterruptAt("step_verified", step="server_up"))
    plan = demo.cli("plan", str(collapse))
    assert plan.returncode == 2, plan.stderr
    assert "role.server will be created" not in plan.stdout, plan.stdout
    assert "# role.server runs already as specified (topology): apply keeps it" in plan.stdout, plan.stdout
    assert f"--confirm-topology {confirmed.plan_id}" in plan.stdout, plan.stdout  # still the change confirmed
    assert "Plan: 0 to add, 0 to change, 0 to destroy, 1 kept as the unfinished apply left it." in plan.stdout
    server = _pids(demo)["server"]
    r = demo.cli("apply", str(collapse))
    assert r.returncode == 2 and "changes the topology" in r.stderr, r.stderr  # its confirmation is still needed
    r = demo.cli("apply", str(collapse), "--confirm-topology", confirmed.plan_id)
    assert r.returncode == 0, r.stderr
    assert "server_up: already satisfied" in r.stderr and _pids(demo)["server"] == server, r.stderr


def test_a_reshaped_pd_spec_after_a_collapse_that_started_its_server_plans_the_servers_removal(demo):
    # (helper-99: the plan of a PD spec whose prefill TP differs from the recorded one listed prefill's reshape only,
    # under the id confirmed before the collapse; apply then stopped and removed the server the collapse had started,
    # which the plan never showed)
    demo.apply()
    d = copy.deepcopy(demo.dict)
    d["prefill"][0].update(gpus=[0, 1], tp=2)
    reshape = demo.write(d, "reshape.toml")
    before = service.plan_spec(demo.load(reshape))  # (the reshape's confirmation, before the collapse)
    _collapse_interrupted(demo, _InterruptAt("step_verified", step="server_up"))
    plan = demo.cli("plan", str(reshape))
    assert plan.returncode == 2, plan.stderr
    assert "- role.server" in plan.stdout and "single server → PD disaggregation" in plan.stdout, plan.stdout
    data = json.loads(demo.cli("plan", str(reshape), "--json").stdout)
    assert ("role.server", "delete") in [(c["address"], c["action"]) for c in data["changes"]], data["changes"]
    assert data["counts"][2] >= 1 and data["plan_id"] != before.plan_id
    r = demo.cli("apply", str(reshape), "--confirm-topology", data["plan_id"])
    assert r.returncode == 0, r.stderr
    assert "stopped and removed" in r.stderr and _server_info(demo.ports["prefill"])["tp_size"] == 2, r.stderr
    assert demo.status()["healthy"]


def test_a_change_interrupted_once_both_servers_were_proven_is_planned_and_applied_as_kept(demo):
    # (the plan listed prefill and decode as updates that restart them, with a note that apply keeps one of them, and
    # apply's first event said "changes that restart roles" while it restarted nothing)
    _d, changed = _context_change_interrupted_at(demo, "decode_up")
    data = json.loads(demo.cli("plan", str(changed), "--json").stdout)
    assert [(c["address"], c["action"], c["restarts"], c["kept"] is not None) for c in data["changes"]] == [
        ("role.prefill", "update", [], True), ("role.decode", "update", [], True)], data["changes"]
    assert data["class"] == "disruptive" and data["counts"] == [0, 0, 0]
    before = _pids(demo)
    r = demo.cli("apply", str(changed), "--json")
    assert r.returncode == 0, r.stderr
    events = [json.loads(x) for x in r.stdout.splitlines()]
    assert events[0]["message"] == f"plan {data['plan_id']}: changes an unfinished apply made already, kept as " \
                                   "they run", events[0]
    assert not [e for e in events if e["message"].startswith("restarting ")], events
    assert _pids(demo) == before and demo.status()["healthy"]


def test_a_deployment_wide_change_interrupted_once_prefill_was_proven_lists_prefill_as_kept(demo):
    # (an engine.env change interrupted after prefill_up: its plan said only "restarts: decode", with no word of the
    # prefill that apply keeps, while the same change interrupted after decode_up said "= deployment … kept: …")
    demo.apply()
    d = copy.deepcopy(demo.dict)
    d["engine"]["env"]["PDCTL_TEST_SETTING"] = "1"
    changed = demo.write(d, "env.toml")
    with pytest.raises(KeyboardInterrupt):
        demo.apply(changed, sink=_InterruptAt("step_verified", step="prefill_up"))
    data = json.loads(demo.cli("plan", str(changed), "--json").stdout)
    assert [(c["address"], c["restarts"], c["kept_restarts"], c["kept"]) for c in data["changes"]] == [
        ("deployment", ["decode"], ["prefill"], None)], data["changes"]
    text = demo.cli("plan", str(changed)).stdout
    assert "      restarts: decode\n      kept: prefill, as the unfinished apply started it with this spec's " \
           "definition" in text, text
    prefill = _pids(demo)["prefill"]
    r = demo.cli("apply", str(changed))
    assert r.returncode == 0, r.stderr
    assert _pids(demo)["prefill"] == prefill and f"restarting pdctl-{demo.name}-decode.service" in r.stderr, r.stderr


def test_taking_back_a_prefill_group_added_by_an_interrupted_apply_keeps_the_router(demo):
    # (the router, never told of the new group and never rewritten, was restarted by the way back: seconds of refused
    # connections and 503s for clients)
    from harness.sim import free_ports

    demo.apply()
    port, boot, nccl = free_ports(3)
    grown = copy.deepcopy(demo.dict)
    grown["prefill"].append({"host": "local", "gpus": [8, 9, 10, 11], "tp": 4, "port": port, "bootstrap_port": boot,
                             "nccl_port": nccl})
    spec = demo.write(grown, "two-prefill.toml")
    with pytest.raises(KeyboardInterrupt):
        demo.apply(spec, confirm=service.plan_spec(demo.load(spec)).plan_id,
                   sink=_InterruptAt("step_verified", step="prefill_up"))
    router = _pids(demo)["router"]
    data = json.loads(demo.cli("plan", str(demo.spec), "--json").stdout)
    by = {c["address"]: c for c in data["changes"]}
    assert by["router"]["kept"] is not None and by["router"]["restarts"] == [], by["router"]
    assert by["role.prefill-1"]["action"] == "delete", by
    assert "router" not in {r for c in data["changes"] for r in c["restarts"]}, data["changes"]
    r = demo.cli("apply", str(demo.spec), "--confirm-topology", data["plan_id"])
    assert r.returncode == 0, r.stderr
    assert f"restarting pdctl-{demo.name}-router.service" not in r.stderr, r.stderr
    assert _pids(demo)["router"] == router and demo.status()["healthy"]


def test_status_names_the_single_servers_router_left_in_front_of_an_interrupted_change_to_pd(demo):
    # (status showed "workers: prefill 0, decode 0, regular 1" for the single spec's router still in front once a
    # single → PD change was interrupted after decode was proven, and called nothing wrong with it)
    (single_port,) = free_ports(1)
    single = copy.deepcopy(demo.dict)
    single.pop("prefill"), single.pop("decode"), single.pop("kv_transfer")
    single["server"] = [{"gpus": list(range(8)), "tp": 8, "http_host": "127.0.0.1", "port": single_port}]
    demo.apply(demo.write(single, "single.toml"))
    confirmed = service.plan_spec(demo.load())
    assert confirmed.requires_confirmation
    with pytest.raises(KeyboardInterrupt):
        demo.apply(confirm=confirmed.plan_id, sink=_InterruptAt("step_verified", step="decode_up"))
    st = json.loads(demo.cli("status", str(demo.spec), "--json").stdout)
    rt = st["router"]
    # (its single server was removed, so it is not ready either; that alone said nothing of why)
    assert rt["state"] == "active" and [w["worker_type"] for w in rt["workers"]] == ["regular"], rt
    assert f"unexpected worker http://127.0.0.1:{single_port} (regular)" in rt["mismatches"], rt
    assert f"worker http://127.0.0.1:{demo.ports['prefill']} (prefill) missing" in rt["mismatches_lasting"], rt
    text = demo.cli("status", str(demo.spec)).stdout
    assert ("its workers differ from the deployment: " in text
            and "which its health checks do not mend: applying the deployment's spec restarts the router with its "
                "workers]" in text), text
    # as it says: apply converges (the change confirmed again: the journal records the single server deployed), and
    # then the router's workers are the deployment's
    plan = json.loads(demo.cli("plan", str(demo.spec), "--json").stdout)
    r = demo.cli("apply", str(demo.spec), "--confirm-topology", plan["plan_id"])
    assert r.returncode == 0, r.stderr
    st = demo.status()
    assert st["healthy"] and st["router"]["mismatches"] == [] == st["router"]["mismatches_lasting"], st["router"]
    assert sorted(w["worker_type"] for w in st["router"]["workers"]) == ["decode", "prefill"], st["router"]


def test_status_says_where_the_router_listens_when_an_interrupted_apply_has_not_restarted_it(demo):
    # (a fresh user moved the router from every interface to loopback, the apply was killed before router_exposed: status
    # printed the target's loopback address while the recorded router still listened on every interface)
    demo.apply()
    moved = copy.deepcopy(demo.dict)
    moved["router"]["host"] = "127.0.0.2"  # (another loopback address: these tests bind no wildcard)
    spec = demo.write(moved, "moved.toml")
    confirmed = service.plan_spec(demo.load(spec))
    with pytest.raises(KeyboardInterrupt):
        demo.apply(spec, confirm=confirmed.plan_id, sink=_InterruptAt("step_started", step="router_exposed"))
    st = json.loads(demo.cli("status", str(spec), "--json").stdout)
    rt = st["router"]
    port = demo.ports["router"]
    assert rt["exposure"] == f"127.0.0.2:{port}", rt
    assert rt["listening"] == [f"127.0.0.1:{port}"] and rt["exposure_differs"], rt
    assert not st["healthy"]
    text = demo.cli("status", str(spec)).stdout
    assert (f"it listens on 127.0.0.1:{port}, not on 127.0.0.2:{port} as the deployment says: the unfinished apply has "
            "not restarted it yet" in text), text
    # (the router's line says where it listens; the target's address answers nothing)
    assert f"readiness down  restarts 0  127.0.0.1:{port}  workers: prefill ?, decode ?" in text, text
    # applying it again restarts the router where the spec says, and status says it listens there
    plan = json.loads(demo.cli("plan", str(spec), "--json").stdout)
    r = demo.cli("apply", str(spec), "--confirm-topology", plan["plan_id"])
    assert r.returncode == 0, r.stderr
    st = service.status(demo.load(spec))
    assert st["healthy"] and st["router"]["listening"] == [f"127.0.0.2:{port}"], st["router"]
    assert not st["router"]["exposure_differs"]


def test_a_saved_plan_whose_apply_was_interrupted_applies_again_and_one_saved_meanwhile_goes_stale(demo):
    # (a fresh user's `pdctl apply plan.json`, interrupted, then the same file again: refused as "the file was edited
    # after `pdctl plan -o`?", since the plan made now notes prefill as kept, which the file did not)
    demo.apply()
    d = copy.deepcopy(demo.dict)
    d["model"]["context_length"] = 65536
    changed = demo.write(d, "ctx65.toml")
    saved, meanwhile = demo.tmp / "ctx65.plan.json", demo.tmp / "meanwhile.plan.json"
    assert demo.cli("plan", str(changed), "-o", str(saved)).returncode == 2
    with pytest.raises(KeyboardInterrupt):
        demo.apply(changed, saved_plan=service.load_saved_plan(saved), sink=_InterruptAt("step_verified", step="prefill_up"))
    # saved while that apply is unfinished: prefill noted as kept
    assert demo.cli("plan", str(changed), "-o", str(meanwhile)).returncode == 2
    assert any(c["kept"] for c in json.loads(meanwhile.read_text())["changes"])
    with pytest.raises(KeyboardInterrupt):  # (the first file again, and again interrupted: once decode is proven)
        demo.apply(changed, saved_plan=service.load_saved_plan(saved), sink=_InterruptAt("step_verified", step="decode_up"))
    r = demo.cli("apply", str(meanwhile))  # (what runs changed since it was made: decode is kept now too)
    assert r.returncode == 2 and "was made while an apply was unfinished, and what runs has changed since" in r.stderr, \
        r.stderr
    r = demo.cli("apply", str(saved))
    assert r.returncode == 0, r.stderr
    st = demo.status()
    assert st["healthy"] and not st["applying"], st
    assert _server_info(demo.ports["prefill"])["context_length"] == 65536 == \
        _server_info(demo.ports["decode"])["context_length"]


def test_a_role_port_answered_by_the_recorded_deployments_own_leftover_is_not_called_another_deployments(demo):
    # (after an interrupted PD → single change, status said the server's port was answered by "pdctl unit
    # pdctl-X-prefill.service" and hinted at another deployment to take down: it was this deployment's own prefill)
    demo.apply()
    collapse = demo.write(_collapse(demo.dict, demo.ports["prefill"]), "collapse.toml")
    confirmed = service.plan_spec(demo.load(collapse))
    with pytest.raises(KeyboardInterrupt):  # (once the router is removed: prefill and decode still run)
        demo.apply(collapse, confirm=confirmed.plan_id, sink=_InterruptAt("role_removed", nth=1))
    st = json.loads(demo.cli("status", str(collapse), "--json").stdout)
    prefill = f"pdctl-{demo.name}-prefill.service"
    assert prefill in {u["unit"] for u in st["leftover"]}, st
    (server,) = st["roles"]
    assert server["health"] == 200 and server["port_held_for"] == prefill and not server["port_owned"], server
    text = demo.cli("status", str(collapse)).stdout
    assert (f"(from this deployment's {prefill}, of the recorded deployment the unfinished apply drops: see below)"
            in _role_line(text, server["name"])), text
    assert "another deployment" not in text and "hint:" not in text, text
