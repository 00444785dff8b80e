"""End to end: the demo topology from nothing to parsers_configured, the seed's failure replayed,
faults caught by the step that owns them, kills at any point. Real processes: the SGLang
stand-in under pdctl's process supervisor and the real smg router."""

from __future__ import annotations

import contextlib
import copy
import io
import socket as _socket
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from harness import skip_or_fail
from harness.deploy import process_gone, stop_process
from pdctl.console.exit_codes import ExitCode
from pdctl.statemachine import service
from pdctl.statemachine.errors import ApplyFailed, HostError, LockHeld, RunCancelled, StepTimeout, VerifyFailed
from pdctl.statemachine.events import ListSink
from pdctl.statemachine.journal import Journal
from pdctl.statemachine.machine import PD_STATES, run_steps
from pdctl.statemachine.steps import ParsersConfigured, RouterExposed, steps_for

pytestmark = [pytest.mark.smg, pytest.mark.slow]


def _chat(url: str, model: str) -> dict:
    from pdctl.statemachine.probes import chat_probe

    with httpx.Client(trust_env=False) as c:
        return chat_probe(c, url, model)


def test_demo_from_nothing_to_parsers_configured(demo):
    sink = ListSink()
    result = demo.apply(sink=sink)
    assert result.state == "parsers_configured"
    assert [s for k, s in sink.kinds() if k in ("step_verified", "step_skipped")] == list(PD_STATES)
    assert result.steps["kernels_built"]["status"] == "skipped"
    assert result.steps["kernels_built"]["proof"]["summary"] == "skipped: disabled in spec"
    assert "kernels_built: skipped: disabled in spec" in [e.message for e in sink.events if e.step == "kernels_built"]
    # A chat through the router's port returns reasoning_content and tool_calls.
    msg = _chat(f"http://127.0.0.1:{demo.ports['router']}", "deepseek-v4-flash")["choices"][0]["message"]
    assert msg["reasoning_content"]
    assert msg["tool_calls"][0]["function"]["name"] == "get_weather"
    # The proofs are real evidence, journaled.
    state = Journal(demo.state, demo.name).read()
    kv = state.steps["kv_link_verified"].proof
    assert kv["evidence"]["pairs"][0]["route"]["page_size"] == 256  # DeepSeek-V4: SGLang's dsv4 pages
    assert state.deployed is not None and state.target is None
    assert state.steps["router_exposed"].proof["summary"].endswith(": ready, 1 prefill + 1 decode workers healthy")
    # each worker as the router reported it: no "mode None" for what smg's /workers leaves out
    checks = state.steps["router_exposed"].proof["checks"]
    assert any(line.startswith(f"http://127.0.0.1:{demo.ports['prefill']}: prefill, healthy") for line in checks), checks
    assert not any("None" in line for line in checks), checks
    st = demo.status()
    assert st["healthy"] and st["reached"] == "parsers_configured"
    # Idempotent: a second apply changes nothing (same PIDs) and skips every serving step.
    pids = demo.pids()
    assert len(pids) == 3
    sink2 = ListSink()
    demo.apply(sink=sink2)
    assert demo.pids() == pids
    skipped = {s for k, s in sink2.kinds() if k == "step_skipped"}
    assert {"prefill_up", "decode_up", "router_exposed"} <= skipped
    audit = [r["event"] for r in Journal(demo.state, demo.name).audit_records()]
    assert audit.count("apply-done") == 2


def test_a_rotated_secret_restarts_the_roles_that_get_it_and_is_not_called_an_edit(demo, monkeypatch):
    # (every rotation said "unit file differs from what pdctl writes (edited outside pdctl?)": the secrets file
    # differs, the definition does not, and the plan restarts the role anyway)
    monkeypatch.setenv("PDCTL_TEST_HF", "hf_before")
    d = copy.deepcopy(demo.dict)
    d["secrets"] = {"HF_TOKEN": {"value": "env:PDCTL_TEST_HF", "roles": ["decode"]}}
    spec = demo.write(d, "secret.toml")
    demo.apply(spec)
    before = {r["name"]: r["main_pid"] for r in service.status(demo.load(spec))["roles"]}
    monkeypatch.setenv("PDCTL_TEST_HF", "hf_after")
    sink = ListSink()
    demo.apply(spec, sink=sink)
    said = [e.message for e in sink.events]
    assert not [m for m in said if "edited outside pdctl" in m], said
    st = service.status(demo.load(spec))
    after = {r["name"]: r["main_pid"] for r in st["roles"]}
    assert after["prefill"] == before["prefill"] and after["decode"] != before["decode"], (before, after)
    env = Path(f"/proc/{after['decode']}/environ").read_bytes().split(b"\0")
    assert b"HF_TOKEN=hf_after" in env and st["healthy"] and not st["edited_units"]
    assert not any(x.startswith(b"HF_TOKEN=") for x in Path(f"/proc/{after['prefill']}/environ").read_bytes().split(b"\0"))


def test_status_names_a_process_that_holds_a_roles_port_without_answering_http(demo):
    # (a foreign listener of another protocol on the port after a crash read only "health down", while plan and apply
    # named its PID)
    with _socket.socket() as s:
        s.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", demo.ports["decode"]))
        s.listen()  # (never accepts: the health probe connects, and nothing answers)
        st = service.status(demo.load())
    decode = next(r for r in st["roles"] if r["name"] == "decode")
    assert decode["health"] == 0 and not decode["healthy"]
    said = decode["error"]
    assert said.startswith(f"GET http://127.0.0.1:{demo.ports['decode']}/health: nothing answered (connection refused, "
                           f"reset or timed out); port {demo.ports['decode']} is held by PID {os.getpid()} ("), said
    assert said.endswith("), not this role's unit"), said
    assert decode["port_silent_holder"].startswith(f"PID {os.getpid()} (")
    prefill = next(r for r in st["roles"] if r["name"] == "prefill")
    assert prefill["error"].endswith("nothing answered (connection refused, reset or timed out)"), prefill["error"]


def test_a_role_between_restarts_is_restarted_not_waited_for(demo):
    # (a server that had exited, its unit "activating (auto-restart)" while its supervisor waits restart_sec, was
    # waited for as if it were loading: a crash loop ran on into its start limit and apply failed)
    demo.apply()
    st = demo.status()
    decode = next(r for r in st["roles"] if r["name"] == "decode")
    os.kill(decode["main_pid"], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        now = next(r for r in demo.status()["roles"] if r["name"] == "decode")
        if now["sub_state"] == "auto-restart":
            break
        time.sleep(0.05)
    assert now["sub_state"] == "auto-restart", now  # (the supervisor waits 10 s before it starts the server again)
    sink = ListSink()
    demo.apply(sink=sink)
    said = [e.message for e in sink.events if e.step == "decode_up"]
    assert not [m for m in said if "waiting for it, not restarting it" in m], said
    assert [m for m in said if "restarting pdctl-" in m and "-decode.service" in m], said
    assert demo.status()["healthy"]


def _collapse(d: dict, port: int) -> dict:
    c = copy.deepcopy(d)
    c.pop("prefill"), c.pop("decode"), c.pop("kv_transfer"), c.pop("router")
    c["server"] = [{"gpus": list(range(8)), "tp": 8, "http_host": "127.0.0.1", "port": port}]
    return c


def _single_beside(demo) -> dict:  # noqa: ANN001
    """The demo's name as one TP8 server behind a router on every interface, on ports of its own (helper-109's G3)."""
    from harness.sim import free_ports

    server, router, prom = free_ports(3)
    c = copy.deepcopy(demo.dict)
    c.pop("prefill"), c.pop("decode"), c.pop("kv_transfer")
    c["server"] = [{"gpus": list(range(8)), "tp": 8, "http_host": "127.0.0.1", "port": server}]
    c["router"].update(host="0.0.0.0", port=router, prometheus_port=prom)
    demo.ports.update(server=server, router2=router, prom2=prom)
    return c


def test_a_lost_journal_does_not_lift_the_topology_gate(demo):
    # (helper-109: with the journal moved aside, which a damaged journal's own hint advises, a single-server spec of
    # the same name applied with no confirmation: the PD router was rewritten onto 0.0.0.0 in front of the new server,
    # prefill and decode ran on unseen, status said healthy and `down` of that spec left them running)
    demo.apply()
    pids = demo.pids()
    (demo.state / "journal.json").rename(demo.tmp / "journal.moved")
    spec = demo.write(_single_beside(demo), "single.toml")
    r = demo.cli("plan", str(spec))
    assert r.returncode == 2, r.stderr
    assert "no --confirm-topology needed" not in r.stdout and "no journal records" in r.stdout, r.stdout
    units = [f"pdctl-{demo.name}-{n}.service" for n in ("decode", "prefill", "router")]
    assert f"units of {demo.name!r} that no journal records are installed here ({', '.join(units)})" in r.stdout
    plan_id = next(line.split()[2] for line in r.stdout.splitlines() if line.startswith("plan id:"))
    r = demo.cli("apply", str(spec))
    assert r.returncode == 2 and f"--confirm-topology {plan_id}" in r.stderr, r.stderr
    assert demo.pids() == pids  # refused: nothing changed
    r = demo.cli("status", str(spec))
    assert "not deployed, yet units of it run" in r.stdout, r.stdout
    assert r.stdout.count("neither the journal nor this spec names it") == 2, r.stdout  # prefill and decode
    r = demo.cli("apply", str(spec), "--confirm-topology", plan_id)
    assert r.returncode == 0, r.stderr
    for role in ("prefill", "decode"):
        assert f"stopped and removed pdctl-{demo.name}-{role}.service" in r.stderr, r.stderr
    from harness.deploy import listening_pids

    assert listening_pids([demo.ports[k] for k in ("prefill", "bootstrap", "decode", "router", "prom")]) == []
    assert service.status(demo.load(spec))["healthy"]
    assert demo.cli("down", str(spec), "--yes").returncode == 0
    assert demo.pids() == []


def test_down_of_any_spec_of_the_name_stops_every_unit_of_it_installed_here(demo):
    # (helper-109: with the journal lost, `down` of another spec of the name stopped only that spec's units, and the
    # others ran on out of every later view)
    demo.apply()
    (demo.state / "journal.json").rename(demo.tmp / "journal.moved")
    spec = demo.write(_single_beside(demo), "single.toml")
    r = demo.cli("down", str(spec), "--yes")
    assert r.returncode == 0, r.stderr
    assert f"removed 3 unit(s) of {demo.name!r}" in r.stderr, r.stderr
    assert demo.pids() == []
    assert not [n for n in os.listdir(demo.state / "supervisor" / "services") if n.endswith(".service")]


def test_the_same_deployment_from_another_state_directory_is_refused_not_run_twice(demo):
    # (helper-109: the same name applied with another PDCTL_STATE_DIR started a second copy beside the first, on the
    # same GPUs, exit 0; only ports shared by both were noticed)
    demo.apply()
    pids = demo.pids()
    other = demo.tmp / "other-state"
    spec = demo.write(_single_beside(demo), "single.toml")  # (ports of its own: the port check cannot catch it)
    env = {**os.environ, "PDCTL_STATE_DIR": str(other)}
    run = [sys.executable, "-m", "pdctl"]
    r = subprocess.run([*run, "apply", str(spec)], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == ExitCode.STEP_FAILED, r.stderr
    said = " ".join(r.stderr.split())
    assert f"deployment {demo.name!r} already runs from another state directory ({demo.state}):" in said, said
    assert f"pdctl-{demo.name}-prefill.service (watchdog PID" in said and "nothing was started or changed" in said
    assert f"--state-dir {demo.state}" in said
    assert demo.pids() == pids
    r = subprocess.run([*run, "plan", str(spec)], capture_output=True, text=True, timeout=120, env=env)
    assert "already runs from another state directory" in r.stdout, r.stdout  # (plan warns as apply refuses)


def test_a_first_deployment_after_a_down_says_how_it_differs_from_what_was_taken_down(demo):
    # (helper-109: `down --yes` then apply of a single server on every interface under the PD deployment's name read
    # "a first deployment … no --confirm-topology needed" with no word of the PD deployment just taken down)
    demo.apply()
    assert demo.cli("down", str(demo.spec), "--yes").returncode == 0
    spec = demo.write(_single_beside(demo), "single.toml")
    r = demo.cli("plan", str(spec), "--json")
    said = json.loads(r.stdout)["since_down"]
    assert said.startswith(f"{demo.name!r} was deployed otherwise until `pdctl down` took it down at "), said
    assert "PD disaggregation → single server" in said and "0.0.0.0" in said, said
    r = demo.cli("plan", str(spec))
    assert "\nnote: " + said in r.stdout, r.stdout
    assert "since_down" not in demo.cli("plan", str(demo.spec), "--json").stdout.replace('"since_down": null', "")


def test_a_plan_that_renames_roles_says_why_the_router_restarts(demo):
    # (it said the router's unit "differs … after an upgrade, or a path it resolves changed": the cause was this plan's
    # renamed roles, whose units the router's names)
    demo.apply()
    d = copy.deepcopy(demo.dict)
    d["prefill"][0]["name"], d["decode"][0]["name"] = "p0", "d0"
    r = demo.cli("plan", str(demo.write(d, "renamed.toml")))
    assert r.returncode == 2, r.stderr
    assert "after an upgrade" not in r.stdout, r.stdout
    assert ("its unit names the role units it starts after (Wants=, After=), and this plan adds or removes roles "
            "(prefill, decode, p0, d0)") in " ".join(r.stdout.split()), r.stdout


def test_the_seeds_failure_replayed_collapse_refused_then_confirmed(demo):
    demo.apply()
    pids = demo.pids()
    units_before = sorted(os.listdir(demo.state / "supervisor")) if (demo.state / "supervisor").exists() else []
    collapse = demo.write(_collapse(demo.dict, demo.ports["router"]), "collapse.toml")
    # Headless, no confirmation: exit 2, the plan names the collapse, nothing changes.
    r = demo.cli("apply", str(collapse))
    assert r.returncode == 2, r.stderr
    assert "PD disaggregation → single server" in r.stdout
    plan_id = next(line.split()[2] for line in r.stdout.splitlines() if line.startswith("plan id:"))
    early = demo.tmp / "collapse.plan"
    assert demo.cli("plan", str(collapse), "-o", str(early)).returncode == 2
    assert demo.pids() == pids
    assert (sorted(os.listdir(demo.state / "supervisor")) if (demo.state / "supervisor").exists() else []) == units_before
    # Another plan's id: refused too.
    r = demo.cli("apply", str(collapse), "--confirm-topology", "0123456789abcdef")
    assert r.returncode == 2 and "names another plan" in r.stderr
    assert demo.pids() == pids
    # This plan's id: it proceeds to the single server on the router's old port.
    r = demo.cli("apply", str(collapse), "--confirm-topology", plan_id)
    assert r.returncode == 0, r.stderr
    after = demo.pids()
    assert len(after) == 1 and not set(after) & set(pids)
    audit = Journal(demo.state, demo.name).audit_records()
    refused = [a for a in audit if a["event"] == "apply-refused"]
    assert len(refused) == 2
    started = [a for a in audit if a["event"] == "apply-started"]
    assert started[-1]["confirmation"] == plan_id
    # The same command again: nothing to change, the confirmation is moot (a retry by a script succeeds)
    assert demo.cli("apply", str(collapse), "--confirm-topology", plan_id).returncode == 0
    # A confirmation of that collapse given to a spec with other changes (no topology change) confirms nothing
    moved = demo.write({**_collapse(demo.dict, demo.ports["router"]), "engine": {**demo.dict["engine"],
                        "env": {**demo.dict["engine"]["env"], "PDCTL_SIM_LOAD_SECONDS": "0.2"}}}, "moved.toml")
    r = demo.cli("apply", str(moved), "--confirm-topology", plan_id)
    assert r.returncode == 2 and "names another plan" in r.stderr and "changes no topology" in r.stderr, r.stderr
    assert demo.pids() == after
    # Back to PD, confirmed with its own plan's id; then the collapse's old confirmation replayed (a shell's history):
    # the same change from the same topology, but the deployment went elsewhere since, so it confirms nothing
    r = demo.cli("plan", str(demo.spec))
    back = next(line.split()[2] for line in r.stdout.splitlines() if line.startswith("plan id:"))
    generation = Journal(demo.state, demo.name).read().generation
    assert demo.cli("apply", str(demo.spec), "--confirm-topology", back).returncode == 0
    assert Journal(demo.state, demo.name).read().generation == generation + 1
    pd_pids = demo.pids()
    r = demo.cli("apply", str(collapse), "--confirm-topology", plan_id)
    assert r.returncode == 2 and "names another plan" in r.stderr, r.stderr
    assert demo.pids() == pd_pids
    # and the collapse saved with `plan -o` before it was first applied is stale, said as such (the same two
    # topologies: it read "the file was edited after `pdctl plan -o`?" of a file nobody touched)
    r = demo.cli("apply", str(early), "--confirm-topology", plan_id)
    assert r.returncode == 2 and f"saved plan {plan_id} was made before the deployment last changed" in r.stderr, \
        r.stderr
    assert demo.pids() == pd_pids
    # down with the collapsed spec leaves nothing running.
    service.down(demo.load(collapse))
    assert demo.pids() == []


def test_a_single_server_behind_the_router_is_proven_as_the_router_sees_it(demo):
    # examples/single.toml's shape: one server, the router in front. router_exposed's proof said "0 prefill + 0 decode
    # workers healthy" of a router that routes to one regular worker.
    d = copy.deepcopy(demo.dict)
    d.pop("prefill"), d.pop("decode"), d.pop("kv_transfer")
    d["server"] = [{"gpus": list(range(8)), "tp": 8, "http_host": "127.0.0.1", "port": demo.ports["prefill"]}]
    result = demo.apply(demo.write(d, "single.toml"))
    assert result.state == "parsers_configured"
    proof = Journal(demo.state, demo.name).read().steps["router_exposed"].proof
    assert proof["summary"] == f"router on 127.0.0.1:{demo.ports['router']}: ready, 1 regular worker healthy", proof
    assert any(f"127.0.0.1:{demo.ports['prefill']}: regular, healthy" in line for line in proof["checks"]), proof


def test_a_saved_plan_applies_only_while_the_deployment_matches_it(demo):
    out = demo.tmp / "first.plan"  # any file name: it was read as TOML unless it ended in .json
    r = demo.cli("plan", str(demo.spec), "-o", str(out))
    assert r.returncode == 2
    stale_base = demo.tmp / "plan2.json"
    demo.cli("plan", str(demo.spec), "-o", str(stale_base))
    r = demo.cli("apply", str(out))
    assert r.returncode == 0, r.stderr
    # The same saved plan again: its "from" side (nothing deployed) no longer holds.
    r = demo.cli("apply", str(stale_base))
    assert r.returncode == 2 and "changes a deployment other than the one recorded now" in r.stderr, r.stderr
    # A plan whose spec moved away: said as such (it read "check the path (relative paths start where pdctl runs)")
    moved = demo.tmp / "moved.toml"
    moved.write_text(demo.spec.read_text())
    later = demo.tmp / "later.plan"
    demo.cli("plan", str(moved), "-o", str(later))
    moved.unlink()
    r = demo.cli("apply", str(later))
    assert r.returncode == 1 and f"the spec this plan was made from, {moved}, is not there any more" in r.stderr
    assert f"put the spec back at {moved}" in r.stderr and "relative paths" not in r.stderr, r.stderr
    # A plan whose spec was edited after it was saved: said as an edit, naming the setting (it read "the spec no longer
    # produces saved plan …'s topology" for a context_length edit, which changes no topology: helper-99)
    edited = demo.tmp / "edited.plan"
    assert demo.cli("plan", str(demo.spec), "-o", str(edited)).returncode == 0
    d = copy.deepcopy(demo.dict)
    d["model"]["context_length"] = 65536
    spec_before = demo.spec.read_text()
    demo.write(d, demo.spec.name)
    try:
        r = demo.cli("apply", str(edited))
    finally:
        demo.spec.write_text(spec_before)
    assert r.returncode == 2 and "the spec was edited since saved plan" in r.stderr, r.stderr
    assert "model.context_length" in r.stderr and "topology" not in r.stderr.split("hint:")[0], r.stderr
    # ...and a spec swapped for a collapse leads with that, in words (helper-109: it named router.prefill,
    # router.decode, router.regular)
    demo.write(_collapse(demo.dict, demo.ports["router"]), demo.spec.name)
    try:
        r = demo.cli("apply", str(edited))
    finally:
        demo.spec.write_text(spec_before)
    assert r.returncode == 2, r.stderr
    assert f"the spec was edited since saved plan" in r.stderr and "(it changes the topology: PD disaggregation → " \
        "single server" in r.stderr, r.stderr
    # The spec renamed since: said as that edit (it read "changes a deployment other than the one recorded now … made at
    # journal serial 45, now 0"), and the new name's state directory is not created
    d = copy.deepcopy(demo.dict)
    d["name"] = f"{demo.name}-renamed"
    demo.write(d, demo.spec.name)
    env = {k: v for k, v in os.environ.items() if k != "PDCTL_STATE_DIR"} | {"XDG_STATE_HOME": str(demo.tmp / "xdg")}
    try:
        r = subprocess.run([sys.executable, "-m", "pdctl", "apply", str(edited)], capture_output=True, text=True,
                           timeout=120, env=env)
    finally:
        demo.spec.write_text(spec_before)
    assert r.returncode == 2, r.stderr
    assert f"its name {demo.name!r} → '{demo.name}-renamed', which is another deployment" in r.stderr, r.stderr
    assert not (demo.tmp / "xdg" / "pdctl" / f"{demo.name}-renamed").exists()
    # A saved topology change edited to read as a mere restart: the confirmation it needs is not taken from the file
    # (a collapse of PD into one server applied with no --confirm-topology)
    collapse = demo.write(_collapse(demo.dict, demo.ports["router"]), "collapse.toml")
    saved = demo.tmp / "collapse.plan"
    assert demo.cli("plan", str(collapse), "-o", str(saved)).returncode == 2
    plan = json.loads(saved.read_text())
    assert plan["class"] == "topology" and plan["topology_changes"]
    plan["topology_changes"] = []
    for change in plan["changes"]:
        change["cls"] = "disruptive" if change["cls"] == "topology" else change["cls"]
    saved.write_text(json.dumps(plan))
    before = demo.pids()
    r = demo.cli("apply", str(saved))
    assert r.returncode == 2 and "does not hold the changes its two topologies make" in r.stderr, r.stderr
    assert demo.pids() == before and demo.status()["mode"] == "pd"


def test_an_apply_expecting_another_plan_than_it_makes_changes_nothing(demo):
    # (the console's y/N: the answer was given to the plan it showed; another apply between the question and the
    # answer changes the plan, and applying the new one restarted roles the dialog never named)
    from pdctl.statemachine.errors import StalePlanError

    loaded = demo.load()
    shown = service.plan_spec(loaded).plan_id
    j = Journal(demo.state, demo.name)
    serial = j.read().serial
    with pytest.raises(StalePlanError, match=f"the plan changed since it was shown: it was 0123456789ab and is now {shown}"):
        service.apply(loaded, expect_plan="0123456789ab")
    assert j.read().serial == serial and demo.pids() == []
    refused = [a for a in j.audit_records() if a["event"] == "apply-refused"]
    assert refused and refused[-1]["expected"] == "0123456789ab"


def test_a_second_concurrent_apply_is_refused_naming_the_holder(demo, monkeypatch):
    j = Journal(demo.state, demo.name)
    monkeypatch.setattr(sys, "argv", ["/opt/pdctl/.venv/bin/pdctl", "apply", "other.toml"])  # what the lock records
    with j.lock("test holder"):
        with pytest.raises(LockHeld) as e:
            demo.apply()
        assert f"PID {os.getpid()}" in str(e.value)
        # the directory and the holder's command line: two specs sharing a state directory lock each other, and the
        # message named only the refused one's deployment
        assert f"deployment {demo.name!r} (state directory {demo.state.absolute()}) is locked by" in str(e.value)
        assert f"is locked by PID {os.getpid()} (" in str(e.value)
        assert ": test holder, `pdctl apply other.toml`) since " in str(e.value), str(e.value)
        r = demo.cli("apply", str(demo.spec))
        assert r.returncode == 4 and f"PID {os.getpid()}" in r.stderr
    assert demo.pids() == []


# --- faults, each caught by the step that owns it ------------------------------------------------


def _ctx(demo, **kw):
    loaded = demo.load()
    return service.build_context(loaded, timeouts=demo.timeouts(), **kw)


def test_wrong_bootstrap_port_fails_kv_link_and_the_router_is_never_exposed(demo):
    ctx = _ctx(demo)
    kv = ctx.topology.kv_link
    wrong = kv.model_copy(update={"bootstrap": tuple((n, h, p + 1) for n, h, p in kv.bootstrap)})
    ctx.topology = ctx.topology.model_copy(update={"kv_link": wrong})
    ctx.timeouts = ctx.timeouts.__class__(bootstrap=3, role_start=60)
    t0 = time.monotonic()
    with pytest.raises(VerifyFailed) as e:
        run_steps(ctx, steps_for(ctx.topology), ListSink())
    assert e.value.step == "kv_link_verified"
    assert "cannot use the bootstrap" in e.value.message
    assert time.monotonic() - t0 < 60
    assert ctx.manager.status(ctx.unit_of["router"]).state == "inactive"
    assert ctx.journal.read().steps["kv_link_verified"].status == "failed"
    assert "router_exposed" not in ctx.journal.read().steps


def test_prefill_never_healthy_times_out_bounded(make_demo):
    def slow(d):
        d["prefill"][0]["env"] = {"PDCTL_SIM_LOAD_SECONDS": "600"}
        d["prefill"][0]["expected_cold_start_s"] = 3
        d["decode"][0]["expected_cold_start_s"] = 3

    demo = make_demo(slow)
    t0 = time.monotonic()
    with pytest.raises(StepTimeout) as e:
        demo.apply()
    elapsed = time.monotonic() - t0
    assert e.value.step == "prefill_up"
    assert "not reached within 3 s" in e.value.message and "Last log lines" in e.value.message
    assert elapsed < 30
    # What already runs stays as it was: the prefill process is still there, loading (SGLang starts
    # its HTTP server only after the weights load, then answers 503 until warm-up ends).
    role = demo.status()["roles"][0]
    assert role["state"] in ("activating", "active") and role["main_pid"]
    assert role["health"] in (0, 503)
    os.kill(role["main_pid"], 0)  # alive


class _Cancelled(RunCancelled):
    pass


class _CancelDuring:
    """A sink like the console's: once *step* has started, its checkpoint halts the run."""

    def __init__(self, step: str) -> None:
        self.step, self.armed, self.at = step, False, None

    def emit(self, event) -> None:  # noqa: ANN001
        self.armed = self.armed or (event.kind == "step_started" and event.step == self.step)

    def checkpoint(self) -> None:
        if self.armed:
            self.at = time.monotonic()
            raise _Cancelled("cancelled")


def test_a_cancel_halts_a_long_wait_for_a_loading_server_at_its_next_poll(make_demo):
    # (the console's cancel acted only at the next step event: minutes later, while a real model loads)
    def slow(d):
        d["prefill"][0]["env"] = {"PDCTL_SIM_LOAD_SECONDS": "600"}
        d["prefill"][0]["expected_cold_start_s"] = 100

    demo = make_demo(slow)
    sink = _CancelDuring("prefill_up")
    t0 = time.monotonic()
    with pytest.raises(_Cancelled):
        demo.apply(sink=sink)
    assert time.monotonic() - t0 < 60 and sink.at is not None
    state = demo.load().journal.read()
    assert state.steps["prefill_up"].status == "interrupted" and state.target is not None
    last = demo.load().journal.audit_records()[-1]
    assert (last["event"], last["step"]) == ("apply-interrupted", "prefill_up"), last
    deadline = time.monotonic() + 20  # what was started keeps starting
    while time.monotonic() < deadline and not (role := demo.status()["roles"][0])["main_pid"]:
        time.sleep(0.1)
    assert role["state"] in ("activating", "active") and role["main_pid"], role
    text = demo.cli("status", str(demo.spec)).stdout
    assert ["prefill_up", "interrupted"] in [line.split()[:2] for line in text.splitlines()], text
    assert "[an apply was interrupted: apply again to converge" in text.splitlines()[0]


def _interrupted_while_prefill_loads(make_demo) -> tuple:  # noqa: ANN001
    """A demo whose prefill loads for 6 s, and an apply interrupted (SIGINT) while it loads: (demo, prefill's status)."""
    demo = make_demo(lambda d: d["prefill"][0].update(env={"PDCTL_SIM_LOAD_SECONDS": "6"}))
    env = {**os.environ, "PDCTL_STATE_DIR": str(demo.state)}
    p = subprocess.Popen([sys.executable, "-m", "pdctl", "apply", str(demo.spec), "--json"], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        for line in p.stdout:
            ev = json.loads(line)
            if ev["kind"] == "step_started" and ev["step"] == "prefill_up":
                break
        deadline = time.monotonic() + 20  # the unit started, its server loading
        while time.monotonic() < deadline and not demo.status()["roles"][0]["main_pid"]:
            time.sleep(0.05)
        os.kill(p.pid, signal.SIGINT)
    finally:
        assert p.wait(30) == 130
    loading = demo.status()["roles"][0]
    assert loading["state"] == "activating" and loading["main_pid"], loading
    return demo, loading


def test_a_resumed_apply_waits_for_a_server_still_loading_instead_of_restarting_it(make_demo):
    # (each Ctrl-C and resume cost a whole weight load: the loading server was restarted)
    demo, loading = _interrupted_while_prefill_loads(make_demo)
    r = demo.cli("apply", str(demo.spec))
    assert r.returncode == 0, r.stderr
    assert "is still starting with the definition this apply wants: waiting for it" in r.stderr, r.stderr
    assert "restarting" not in r.stderr.replace("not restarting it", "")
    assert demo.status()["roles"][0]["main_pid"] == loading["main_pid"]  # the same process, loaded once


def test_a_resume_after_a_kill_between_install_and_restart_restarts_the_loading_process(make_demo, monkeypatch):
    # The spec changed (an env value /server_info does not show) while prefill still loads the old one; the apply
    # dies right after installing the new definition, before the restart. The resumed apply must restart it, not
    # wait for and prove the process running the old environment (it did: the journal had no record of the unit)
    from pdctl.statemachine import steps

    demo, loading = _interrupted_while_prefill_loads(make_demo)
    d = copy.deepcopy(demo.dict)
    d["prefill"][0]["env"] = {**d["prefill"][0]["env"], "PDCTL_TEST_MARK": "new"}
    changed = demo.write(d, "changed.toml")

    class Killed(BaseException):
        pass

    def killed(self, unit, *, step):  # noqa: ANN001, ANN202
        raise Killed  # as kill -9 between install and restart: nothing after it runs

    monkeypatch.setattr(steps.Context, "restart_unit", killed)
    with pytest.raises(Killed):
        demo.apply(changed)
    monkeypatch.undo()
    assert demo.status()["roles"][0]["main_pid"] == loading["main_pid"]  # still the old process, still loading
    r = demo.cli("apply", str(changed))
    assert r.returncode == 0, r.stderr
    assert "waiting for it" not in r.stderr and f"restarting pdctl-{demo.name}-prefill.service" in r.stderr, r.stderr
    pid = demo.status()["roles"][0]["main_pid"]
    assert pid != loading["main_pid"]
    assert b"PDCTL_TEST_MARK=new" in open(f"/proc/{pid}/environ", "rb").read()


def _change_stopped_after_its_restart(make_demo, load_s: str, started) -> tuple:  # noqa: ANN001
    """A deployed demo, then a change that restarts prefill (it now loads for *load_s* s), applied in a child process
    stopped with SIGTERM once it said it restarts prefill and ``started(demo)`` holds: (demo, changed spec, unit)."""
    demo = make_demo()
    demo.apply()
    d = copy.deepcopy(demo.dict)
    d["prefill"][0]["env"] = {**d["prefill"][0].get("env", {}), "PDCTL_SIM_LOAD_SECONDS": load_s}
    changed = demo.write(d, "changed.toml")
    env = {**os.environ, "PDCTL_STATE_DIR": str(demo.state)}
    p = subprocess.Popen([sys.executable, "-m", "pdctl", "apply", str(changed), "--json"], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True, env=env)
    unit = f"pdctl-{demo.name}-prefill.service"
    try:
        for line in p.stdout:
            ev = json.loads(line)
            if ev["kind"] == "info" and ev["message"].startswith(f"restarting {unit}"):
                break
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not started(demo):
            time.sleep(0.05)
        os.kill(p.pid, signal.SIGTERM)
    finally:
        assert p.wait(30) == 143
    return demo, changed, unit


def test_a_resumed_change_waits_for_the_server_its_restart_started(make_demo):
    # A change restarts prefill; the apply is stopped while the new process loads. The resume restarted it again (the
    # change still differs from what was deployed), costing a second weight load; it now waits for it
    demo, changed, unit = _change_stopped_after_its_restart(
        make_demo, "6", lambda demo: demo.status()["roles"][0]["state"] == "activating"
        and demo.status()["roles"][0]["main_pid"])  # the new process started, still loading
    loading = demo.status()["roles"][0]
    assert loading["state"] == "activating" and loading["main_pid"], loading
    r = demo.cli("apply", str(changed))
    assert r.returncode == 0, r.stderr
    assert f"{unit} is still starting with the definition this apply wants: waiting for it" in r.stderr, r.stderr
    assert f"restarting {unit}" not in r.stderr, r.stderr
    assert demo.status()["roles"][0]["main_pid"] == loading["main_pid"]  # the same process, loaded once


def test_a_resumed_change_proves_the_server_its_restart_started_once_it_loaded(make_demo):
    # Stopped while the restarted server loads, resumed after it finished loading (the usual case: loads take
    # minutes): it was restarted again; it is proven as it stands
    # (stopped once the new process runs: a blind 0.5 s could land before the restart's start on a loaded machine,
    # which leaves the unit stopped, as README says an interrupted restart does)
    demo, changed, unit = _change_stopped_after_its_restart(
        make_demo, "3", lambda demo: demo.status()["roles"][0]["state"] == "activating"
        and demo.status()["roles"][0]["main_pid"])
    deadline = time.monotonic() + 30  # loaded and serving before the resume
    while time.monotonic() < deadline and demo.status()["roles"][0]["state"] != "active":
        time.sleep(0.1)
    loaded = demo.status()["roles"][0]
    assert loaded["state"] == "active", loaded
    r = demo.cli("apply", str(changed))
    assert r.returncode == 0, r.stderr
    assert f"restarting {unit}" not in r.stderr, r.stderr
    assert demo.status()["roles"][0]["main_pid"] == loaded["main_pid"]


def test_a_cancel_before_the_first_step_is_audited_as_an_interruption(make_demo):
    # (a RunCancelled raised at the plan event, or in a preflight's wait, bypassed both handlers: no audit record)
    class CancelAtPlan:
        def emit(self, event) -> None:  # noqa: ANN001
            if event.kind == "plan":
                raise _Cancelled("cancelled")

    demo = make_demo()
    with pytest.raises(_Cancelled):
        demo.apply(sink=CancelAtPlan())
    last = demo.load().journal.audit_records()[-1]
    assert last["event"] == "apply-interrupted" and last["step"] is None and last["plan_id"]
    assert demo.pids() == []


def test_an_engine_python_the_host_lacks_is_refused_before_anything_starts(make_demo):
    # (validate passed it; apply failed at prefill_up with the GPU / model path hint)
    from pdctl.statemachine.errors import ApplyFailed

    demo = make_demo(lambda d: d["engine"].update(python="/opt/nowhere/.venv/bin/python"))
    with pytest.raises(ApplyFailed, match=r"engine.python = '/opt/nowhere/.venv/bin/python' does not exist on host "
                                          r"\S+ .*nothing was started or changed") as e:
        demo.apply()
    assert e.value.step == "prefill_up" and "SGLang environment" in e.value.hint
    assert demo.pids() == [] and demo.load().journal.read().target is None


def _python_script(path: Path, body: str) -> str:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


def test_the_process_supervisor_runs_its_watchdogs_with_engine_python(make_demo, tmp_path):
    # (they ran pdctl's own interpreter path, which a host reached over SSH need not have: every role then failed
    # "watchdog-gone", the cause only in the host's supervise.log)
    mark = tmp_path / "watchdogs"
    python = _python_script(tmp_path / "engine-python", f'[ "$1 $2" = "-m pdctl.units.supervise" ] && echo "$3" >> {mark}'
                                                        f'\nexec {sys.executable} "$@"')
    demo = make_demo(lambda d: d["engine"].update(python=python))
    assert demo.apply().state == "parsers_configured"
    started = sorted(line.split("/services/")[-1] for line in mark.read_text().splitlines())
    assert started == sorted(f"pdctl-{demo.name}-{r}.service" for r in ("prefill", "decode", "router")), started


def test_an_engine_python_without_pdctl_is_refused_before_anything_starts_under_the_process_supervisor(make_demo,
                                                                                                       tmp_path):
    # an interpreter that runs but lacks pdctl: Python's own, isolated from this checkout and the venv
    bare = _python_script(tmp_path / "bare-python", f'exec {Path(sys.base_prefix) / "bin" / "python3"} -I "$@"')
    demo = make_demo(lambda d: d["engine"].update(python=bare))
    with pytest.raises(ApplyFailed, match=rf"engine.python = '{bare}' cannot import pdctl on host \S+ "
                                          r"\(ModuleNotFoundError: No module named 'pdctl'\), and the process "
                                          r"supervisor's watchdogs run on it .*nothing was started or changed") as e:
        demo.apply()
    assert e.value.step == "prefill_up" and f"{bare} -m pip install pdctl" in e.value.hint
    assert demo.pids() == [] and demo.load().journal.read().target is None
    # plan says so beforehand, in apply's words
    loaded = demo.load()
    warned = service.host_warnings(loaded, loaded.journal.read())["binds_unusable"]
    assert warned and "cannot import pdctl" in warned and "pip install pdctl" in warned, warned


def test_a_supervisor_folder_that_cannot_be_written_on_the_host_is_refused_before_anything_starts(make_demo):
    # the process supervisor keeps its state under the state directory's path on the deployment's host (over SSH a
    # folder there too): one that cannot be written failed prefill_up with "choose a writable state directory"
    demo = make_demo()
    demo.state.mkdir(parents=True, exist_ok=True)
    (demo.state / "supervisor").write_text("not a folder")  # in the way, as a read-only or foreign folder would be
    with pytest.raises(ApplyFailed, match=rf"the process supervisor keeps its state in {demo.state}/supervisor on "
                                          r"host \S+ \(under the state directory's path, on that host too\), and "
                                          rf"{demo.state}/supervisor cannot be written there; nothing was started") as e:
        demo.apply()
    assert e.value.step == "prefill_up" and "a path this user can write both here and on host" in e.value.hint
    assert demo.pids() == [] and demo.load().journal.read().target is None


def test_a_role_that_cannot_start_is_reported_with_its_own_error_first(make_demo):
    def bad(d):
        # a real flag, a value SGLang's argparse rejects and validate does not judge (its type is a parser function,
        # human_readable_int: validate refuses a value not of a flag's int, float or JSON type itself)
        d["decode"][0]["extra_args"] = ["--max-total-tokens", "1.5Ki"]

    demo = make_demo(bad)
    with pytest.raises(ApplyFailed) as e:
        demo.apply()
    first = str(e.value).splitlines()[0]
    assert "decode" in first and "failed while starting" in first
    said = "error: argument --max-total-tokens: Decimals are not allowed with IEC suffixes like 'Ki'."
    assert first.endswith(said), first
    assert "a launch flag was refused" in e.value.hint and "extra_args" in e.value.hint
    # status's steps table gives the failure's first line, not the log excerpt (that stays in --json).
    text = demo.cli("status", str(demo.spec)).stdout
    step_line = next(ln for ln in text.splitlines() if ln.strip().startswith("decode_up"))
    assert said in step_line and "last log lines" not in text
    assert "last log lines:" in json.loads(demo.cli("status", str(demo.spec), "--json").stdout)["steps"]["decode_up"]["summary"]
    down = demo.cli("down", str(demo.spec), "--yes")  # says what it stopped, and what had never run
    assert down.returncode == 0
    assert f"stopped pdctl-{demo.name}-prefill.service" in down.stderr
    assert f"pdctl-{demo.name}-decode.service was not running (failed)" in down.stderr
    # a running unit is announced before its stop (the router's took 7 s with nothing on the screen)
    said = down.stderr.index(f"stopping pdctl-{demo.name}-prefill.service")
    assert said < down.stderr.index(f"stopped pdctl-{demo.name}-prefill.service"), down.stderr
    assert f"stopping pdctl-{demo.name}-decode.service" not in down.stderr


def test_parsers_missing_on_decode_fails_parsers_configured(demo):
    demo.apply()
    ctx = _ctx(demo)
    # Restart decode behind pdctl's back without its parsers (what a hand edit would do).
    from pdctl.units import UnitSet

    dec_unit = ctx.unit_of["decode"]
    svc = ctx.units.service(dec_unit)
    argv = list(svc.argv)
    for flag in ("--reasoning-parser", "--tool-call-parser"):
        i = argv.index(flag)
        del argv[i : i + 2]
    bad = svc.__class__(**{**svc.__dict__, "argv": tuple(argv)})
    units = UnitSet(target=ctx.units.target, services=tuple(bad if s.name == dec_unit else s for s in ctx.units.services))
    ctx.manager.install(units)
    ctx.manager.restart(dec_unit, wait=True, timeout=60)
    with pytest.raises(VerifyFailed) as e:
        ParsersConfigured().verify(ctx)
    assert e.value.step == "parsers_configured"
    assert "no tool_calls" in e.value.message and "no reasoning_content" in e.value.message
    # decode_up's own proof also sees it.
    from pdctl.statemachine.steps import ServersUp

    assert ServersUp("decode", "decode_up").observe(ctx) is None


def test_router_with_swapped_roles_fails_router_exposed(demo):
    demo.apply()
    ctx = _ctx(demo)
    from pdctl.units import RouterLaunch, UnitSet, router_argv

    r = ctx.topology.router
    swapped = RouterLaunch(
        executable=ctx.units.service(ctx.unit_of["router"]).argv[0],
        prefill=((r.decode[0], r.prefill[0][1]),),
        decode=(r.prefill[0][0],),
        host="127.0.0.1",
        port=r.port,
        prometheus_host="127.0.0.1",
        prometheus_port=demo.ports["prom"],
        health_check_interval_s=1,
    )
    svc = ctx.units.service(ctx.unit_of["router"])
    bad = svc.__class__(**{**svc.__dict__, "argv": tuple(router_argv(swapped))})
    units = UnitSet(target=ctx.units.target, services=tuple(bad if s.name == svc.name else s for s in ctx.units.services))
    ctx.manager.install(units)
    ctx.manager.restart(svc.name)
    # (verify waits out its bound for a router that may still mend: once this router lists both workers, swapped,
    # a short bound tells the same)
    from pdctl.statemachine import probes

    def swapped_listed() -> bool:
        try:
            workers, _ = probes.router_workers(ctx.client, f"http://127.0.0.1:{r.port}")
        except Exception:  # noqa: BLE001 - not up yet
            return False
        return {(w.url, w.worker_type) for w in workers} == {(r.decode[0], "prefill"), (r.prefill[0][0], "decode")}

    deadline = time.monotonic() + 60
    while not swapped_listed():
        assert time.monotonic() < deadline, "the restarted router never listed its swapped workers"
        time.sleep(0.1)
    ctx.timeouts = ctx.timeouts.__class__(router=2)
    with pytest.raises(VerifyFailed) as e:
        RouterExposed().verify(ctx)
    assert e.value.step == "router_exposed"
    assert "swapped roles" in e.value.message or "registered as prefill" in e.value.message


def test_decode_killed_while_up_status_shows_it_and_recovers(demo):
    demo.apply()
    st = demo.status()
    dec = next(r for r in st["roles"] if r["name"] == "decode")
    os.kill(dec["main_pid"], signal.SIGKILL)
    seen_down = False
    waiting_line = None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        st = demo.status()
        d = next(r for r in st["roles"] if r["name"] == "decode")
        if not d["healthy"]:
            seen_down = True
            assert not st["healthy"]
            if waiting_line is None and (d["state"], d["sub_state"]) == ("activating", "auto-restart"):
                # (its restart waits RestartSec=10 s: the status text says why it is not up, not only "activating")
                out = demo.cli("status", str(demo.spec)).stdout
                waiting_line = next(x for x in out.splitlines() if x.split()[:1] == ["decode"])
        elif seen_down and d["main_pid"] != dec["main_pid"]:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"decode did not come back: {st}")
    assert seen_down
    assert waiting_line is not None and waiting_line.split()[1:3] == ["activating", "(auto-restart)"], waiting_line
    assert d["restarts"] >= 1
    # The router sees it healthy again (bounded). Whether its circuit breaker still holds the workers out depends on how
    # many requests failed meanwhile (test_serving proves that case); apply re-admits any it holds out: then a client
    # is served, and status says healthy
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and demo.status()["router"].get("readiness") != 200:
        time.sleep(0.5)
    demo.apply()
    st = demo.status()
    assert st["healthy"] and st["router"]["serving"]["canary"]["ok"], st["router"]["serving"]
    # The router too: restarted by its supervisor, and counted as the roles are
    router = demo.status()["router"]
    assert router["restarts"] == 0
    os.kill(router["main_pid"], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        rt = demo.status()["router"]
        if rt["main_pid"] not in (None, router["main_pid"]) and rt.get("readiness") == 200:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"the router did not come back: {rt}")
    assert rt["restarts"] == 1
    assert "restarts 1" in demo.cli("status", str(demo.spec)).stdout.split("router", 1)[1]
    # A router that keeps dying stops at its start limit, and status says so rather than only "failed"
    killed = {rt["main_pid"]}
    os.kill(rt["main_pid"], signal.SIGKILL)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        rt = demo.status()["router"]
        if rt["state"] == "failed":
            break
        if rt["main_pid"] and rt["main_pid"] not in killed:
            killed.add(rt["main_pid"])
            os.kill(rt["main_pid"], signal.SIGKILL)
        time.sleep(0.1)
    assert (rt["state"], rt["sub_state"]) == ("failed", "start-limit-hit"), rt
    after = demo.cli("status", str(demo.spec)).stdout.split("router", 1)[1].splitlines()
    line = after[0]
    assert line.split()[0] == "failed" and "(start-limit-hit)" in line and "its log says why" in line, line
    # ...and quotes the end of its log, as `systemctl status` does: here the supervisor's own last words
    from pdctl.units._manager import clean_log_lines  # (smg colours its log)

    log = clean_log_lines((demo.state / "supervisor" / "services" / rt["unit"] / "output.log").read_text(), 5)
    assert rt["log_tail"] == log and "start limit hit" in " ".join(rt["log_tail"]), rt["log_tail"]
    assert [x.split("│ ", 1)[1].removesuffix("…") for x in after[1:6]] == [x[:200] for x in log], after
    assert all(r["log_tail"] == [] for r in demo.status()["roles"])  # (serving: nothing quoted)


# --- kill -9 at five points, then re-run ---------------------------------------------------------

_KILL_POINTS = [
    ("apply_started", None),
    ("step_started", "prefill_up"),
    ("step_applied", "decode_up"),
    ("step_started", "kv_link_verified"),
    ("step_applied", "router_exposed"),
]


@pytest.mark.parametrize("kind,step", _KILL_POINTS, ids=[f"{k}-{s}" for k, s in _KILL_POINTS])
def test_apply_killed_at_any_point_then_rerun_converges_without_orphans(demo, kind, step):
    env = {**os.environ, "PDCTL_STATE_DIR": str(demo.state)}
    p = subprocess.Popen(
        [sys.executable, "-m", "pdctl", "apply", str(demo.spec), "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    killed = False
    deadline = time.monotonic() + 120
    try:
        for line in p.stdout:
            ev = json.loads(line)
            if ev["kind"] == kind and (step is None or ev["step"] == step):
                os.kill(p.pid, signal.SIGKILL)
                killed = True
                break
            if time.monotonic() > deadline:
                break
    finally:
        p.wait(30)
    assert killed, "the kill point was never reached"
    # The journal survived and is readable; re-run converges.
    Journal(demo.state, demo.name).read()
    r = demo.cli("apply", str(demo.spec))
    assert r.returncode == 0, r.stderr
    # The audit says how the killed apply ended: the next lock holder found its record left behind.
    abandoned = [a for a in Journal(demo.state, demo.name).audit_records() if a["event"] == "lock-abandoned"]
    assert [(a["holder"]["pid"], a["holder"]["purpose"]) for a in abandoned] == [(p.pid, "apply")]
    st = demo.status()
    assert st["healthy"] and st["reached"] == "parsers_configured"
    # No orphans: exactly one engine per role and one router.
    assert len(demo.pids()) == 3
    service.down(demo.load())
    deadline = time.monotonic() + 20
    while demo.pids() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert demo.pids() == []


def test_down_under_another_state_dir_names_the_holders_and_stops_nothing(demo, tmp_path):
    from pdctl.statemachine.errors import HostError

    demo.apply()
    pids = demo.pids()
    elsewhere = service.load(demo.spec, state_dir=tmp_path / "typo")
    with pytest.raises(HostError, match=rf"nothing of .* is installed here \(service manager process, state directory "
                                        rf".*typo\), yet its own processes hold its ports: .*router's port "
                                        rf"{demo.ports['router']} by PID \d+") as e:
        service.down(elsewhere)
    assert "--state-dir" in e.value.hint
    assert f"it was applied with state directory {demo.state} (process supervisor)" in str(e.value), str(e.value)
    assert not (tmp_path / "typo").exists()  # nothing recorded there: a refused down creates nothing either
    (tmp_path / "kept").mkdir()  # a state directory that exists (another deployment's, say): the refusal is audited
    kept = service.load(demo.spec, state_dir=tmp_path / "kept")
    with pytest.raises(HostError):
        service.down(kept)
    assert kept.journal.audit_records()[-1]["event"] == "down-failed"
    assert demo.pids() == pids and demo.status()["healthy"]
    r = demo.cli("down", str(demo.spec), "--yes", "--state-dir", str(tmp_path / "typo2"))
    assert r.returncode == 1 and "nothing was stopped" in r.stderr, r.stderr
    assert demo.pids() == pids


def test_down_with_nothing_installed_leaves_a_stranger_on_its_ports_alone_and_succeeds(demo):
    import socket

    with socket.socket() as stranger:  # not this deployment's: no pdctl-<name>- unit above it
        stranger.bind(("127.0.0.1", demo.ports["router"]))
        stranger.listen()
        assert service.down(demo.load()) == []
        assert not demo.state.exists()  # never applied here: down creates no state directory
        demo.state.mkdir()
        assert service.down(demo.load()) == []  # with one: locked, journalled and audited as done
        assert demo.load().journal.audit_records()[-1]["event"] == "down-done"


def test_status_text_of_a_healthy_deployment_names_each_role_and_the_routers_workers(demo):
    # (a change to the router's line printed "workers: {_router_workers_text(...)}" as it stood, no test reading it)
    demo.apply()
    st = demo.status()
    text = demo.cli("status", str(demo.spec)).stdout
    lines = text.splitlines()
    assert lines[0] == f"deployment {demo.name} (pd): healthy, reached parsers_configured", text
    pids = {r["name"]: r["main_pid"] for r in st["roles"]}
    for role in ("prefill", "decode"):
        assert any(line.split()[:4] == [role, "active", "pid", str(pids[role])] and "health 200" in line
                   and line.endswith(f"http://127.0.0.1:{demo.ports[role]}") for line in lines), text
    router = next(line for line in lines if line.split()[:1] == ["router"])
    assert router.endswith(f"readiness 200  restarts 0  127.0.0.1:{demo.ports['router']}  workers: prefill 1, decode 1"), \
        router


def test_apply_json_events_have_the_shape_and_order_the_readme_gives(demo):
    from pdctl.statemachine.machine import PD_STATES

    r = demo.cli("apply", str(demo.spec), "--json")
    assert r.returncode == 0, r.stderr
    events = [json.loads(line) for line in r.stdout.splitlines()]
    assert all(set(e) == {"kind", "message", "step", "elapsed_s", "data", "ts"} for e in events), events
    kinds = [e["kind"] for e in events]
    assert kinds[:2] == ["plan", "apply_started"] and kinds[-1] == "apply_done", kinds
    plan = events[0]["data"]
    # (a first deployment: prefill, decode, the KV link and the router to add)
    assert plan["class"] == "topology" and plan["counts"] == [4, 0, 0] and plan["warnings"] == [], plan
    assert events[1]["data"]["plan_id"] == plan["plan_id"] == events[-1]["data"]["plan_id"]
    ends = [e for e in events if e["kind"] in ("step_verified", "step_skipped")]
    assert [e["step"] for e in ends] == list(PD_STATES)
    assert all(e["data"]["proof"]["summary"] and isinstance(e["elapsed_s"], float) for e in ends), ends
    for e in ends:  # (each step: started, then skipped, or applied and verified)
        mine = [x["kind"] for x in events if x["step"] == e["step"] and x["kind"].startswith("step_")]
        assert mine in (["step_started", "step_skipped"], ["step_started", "step_applied", "step_verified"]), mine


def test_down_says_which_units_it_stopped_and_which_were_not_running(demo):
    # (it said "stopped and removed 3 unit(s)" of a deployment whose decode was not running)
    from pdctl.statemachine import launch
    from pdctl.statemachine.service import deployment_host, unit_names
    from pdctl.statemachine.topology import topology_of

    demo.apply()
    loaded = demo.load()
    names = unit_names(topology_of(loaded.deployment))
    manager = launch.manager_for(loaded.deployment, deployment_host(loaded.deployment), state_dir=str(demo.state))
    manager.stop(names["decode"])
    r = demo.cli("down", str(demo.spec), "--yes")
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert f"· {names['decode']} was not running (inactive)" in lines
    assert f"· stopped {names['router']}" in lines and f"· stopped {names['prefill']}" in lines
    assert lines[-1] == f"removed 3 unit(s) of {loaded.deployment.name!r}", lines


def test_down_that_cannot_write_its_journal_stops_nothing(demo, monkeypatch):
    # (a state directory made immutable, chattr +i: down stopped and removed every unit, then failed to write the
    # journal, naming its temp file; status then called the units "edited outside pdctl")
    from pdctl.statemachine.errors import PdctlError

    demo.apply()
    before = sorted(demo.pids())

    def refused(self, state):  # noqa: ANN001, ANN202 (as atomic_write fails in a folder it cannot create files in)
        raise PermissionError(1, "Operation not permitted", str(self.dir / f".journal.json.{os.getpid()}.tmp"))

    monkeypatch.setattr(Journal, "write", refused)
    with pytest.raises(PdctlError) as e:
        service.down(demo.load())
    assert f"cannot write the journal {demo.load().journal.path}: Operation not permitted; nothing was stopped" \
        in str(e.value) and "chattr -i" in e.value.hint, (str(e.value), e.value.hint)
    monkeypatch.undo()
    assert sorted(demo.pids()) == before
    st = demo.status()
    assert st["healthy"] and st["deployed"], st


def test_apply_waits_for_its_own_previous_server_still_exiting_instead_of_calling_it_foreign(demo):
    # A server its unit is still stopping (slow to exit on SIGTERM, or an interrupted apply's restart) holds the port:
    # it was refused as "ports taken by processes outside this deployment ... (another deployment?)"
    from pdctl.statemachine.events import ListSink
    from pdctl.statemachine.service import unit_names
    from pdctl.statemachine.topology import topology_of

    unit = unit_names(topology_of(demo.load().deployment))["decode"]
    code = ("import socket, sys, time; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
            f"s.bind(('127.0.0.1', {demo.ports['decode']})); s.listen(); print('up', flush=True); time.sleep(3)")
    # the supervisor's command line names the unit (… pdctl.units.supervise <state>/services/<unit>): so does this one
    old = subprocess.Popen([sys.executable, "-c", code, f"{demo.state}/supervisor/services/{unit}"], stdout=subprocess.PIPE,
                           text=True)
    try:
        assert old.stdout.readline().strip() == "up"
        sink = ListSink()
        demo.apply(sink=sink)
    finally:
        old.kill()
        old.wait(10)
    waits = [e for e in sink.events if e.kind == "info" and "previous processes to exit" in e.message]
    assert len(waits) == 1 and f"port {demo.ports['decode']} held by PID {old.pid}" in waits[0].message, sink.events
    assert demo.status()["healthy"]
    # The same deployment applied with another state directory is not this one's to wait for: refused at once
    from pdctl.statemachine import service
    from pdctl.statemachine.errors import ApplyFailed

    other = service.load(demo.spec, state_dir=demo.tmp / "other-state")
    sink = ListSink()
    with pytest.raises(ApplyFailed, match="ports taken by this deployment's own processes, applied another way") as e:
        service.apply(other, sink=sink, timeouts=demo.timeouts())
    assert f"it runs under state directory {demo.state} (process supervisor)" in str(e.value), str(e.value)
    assert "--state-dir" in e.value.hint
    assert not [e for e in sink.events if "previous processes" in e.message]
    # ...and status with that state directory says whose the answers are, as plan and apply do (it said "from another
    # process on its port", with no hint, as for a stranger's)
    st = service.status(other)
    assert [(r["name"], r["port_applied_elsewhere"], r["port_held_for"]) for r in st["roles"]] == [
        ("prefill", f"state directory {demo.state} (process supervisor)", None),
        ("decode", f"state directory {demo.state} (process supervisor)", None)], st["roles"]
    r = demo.cli("status", str(demo.spec), "--state-dir", str(demo.tmp / "other-state"))
    assert (f"(from this deployment's own process, applied another way: it runs under state directory {demo.state} "
            "(process supervisor))") in r.stdout, r.stdout
    assert "hint: this deployment runs, applied another way" in r.stdout and "--state-dir" in r.stdout, r.stdout


def test_a_port_held_for_another_pdctl_deployment_names_its_unit_and_how_to_take_it_down(demo, tmp_path):
    # A fresh user renamed a deployed spec: plan warned and apply refused "held by PID … (smg::router) … hint: stop
    # those processes (another deployment?)", though the holder ran for pdctl's own unit of the old name.
    from pdctl.statemachine import steps
    from pdctl.statemachine.errors import ApplyFailed
    from pdctl.statemachine.plan import _render_ports_held

    old_state = tmp_path / "old-state"
    unit = "pdctl-olddemo-decode.service"
    code = ("import socket, time; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
            f"s.bind(('127.0.0.1', {demo.ports['decode']})); s.listen(); print('up', flush=True); time.sleep(30)")
    # (as pdctl's supervisor runs a server: … pdctl.units.supervise <state>/supervisor/services/<unit>)
    old = subprocess.Popen([sys.executable, "-c", code, f"{old_state}/supervisor/services/{unit}"],
                           stdout=subprocess.PIPE, text=True)
    try:
        assert old.stdout.readline().strip() == "up"
        ctx = _ctx(demo)
        held = steps.ports_held_elsewhere(ctx, set(ctx.unit_of.values()))
        assert [(x.port, x.pid, x.applied_elsewhere) for x in held] == [(demo.ports["decode"], old.pid, None)]
        assert held[0].other_deployment == f"pdctl unit {unit} (state directory {old_state} (process supervisor))"
        text = _render_ports_held(tuple(held))
        assert f"started for pdctl unit {unit}" in text and "put that name back, `pdctl down`" in text, text
        with pytest.raises(ApplyFailed) as e:
            steps.ports_taken_elsewhere(ctx, set(ctx.unit_of.values()))
    finally:
        old.kill()
        old.wait(10)
    assert f"held by PID {old.pid}" in str(e.value) and f"started for pdctl unit {unit}" in str(e.value), str(e.value)
    assert "another pdctl deployment holds these ports" in e.value.hint and "put that name back" in e.value.hint


def test_a_listener_no_process_owns_any_more_is_looked_at_again_not_refused(demo, monkeypatch):
    # The process waited for above exits; for a moment its socket is listed with no owning PID, and the apply was
    # refused as "held by PID ? (unknown)" (a clean-clone CI run failed the test above on it)
    from pdctl.statemachine import ports, steps

    real = ports.held_outside
    calls = []

    def tearing_down(host, wanted, main_pids):  # noqa: ANN001, ANN202
        calls.append(1)
        if len(calls) <= 2:
            return [ports.Listener(demo.ports["decode"], None)]
        return real(host, wanted, main_pids)

    monkeypatch.setattr(ports, "held_outside", tearing_down)
    ctx = _ctx(demo)
    steps.ports_taken_elsewhere(ctx, set(ctx.unit_of.values()))  # no refusal
    assert len(calls) >= 3
    monkeypatch.setattr(ports, "held_outside", lambda *a: [ports.Listener(demo.ports["decode"], None)])
    from pdctl.statemachine.errors import ApplyFailed

    t0 = time.monotonic()
    with pytest.raises(ApplyFailed, match=r"held by PID \? \(unknown\)"):  # one that stays: refused, after 2 s
        steps.ports_taken_elsewhere(ctx, set(ctx.unit_of.values()))
    assert 1.5 < time.monotonic() - t0 < 10


def test_a_bind_address_the_host_lacks_is_refused_before_anything_stops(demo):
    # 192.0.2.1 (TEST-NET-1) is on no interface; gpu-typo.invalid never resolves (RFC 6761): both pass the spec as an
    # address, and the server's own bind fails only after its predecessor was stopped
    from pdctl.statemachine.errors import ApplyFailed

    demo.apply()
    pids = demo.pids()
    d = copy.deepcopy(demo.dict)
    d["prefill"][0]["http_host"] = "gpu-typo.invalid"
    d["router"]["prometheus_host"] = "192.0.2.1"  # (a name here is refused by the spec's rules: smg binds IPs only)
    with pytest.raises(ApplyFailed, match=r"bind addresses unusable, nothing was started or changed: "
                                          r"prefill\[0\].http_host = 'gpu-typo.invalid' does not resolve on this "
                                          r"host[^;]*; router.prometheus_host = '192.0.2.1' cannot be bound on this "
                                          r"host \(") as e:
        typo = demo.write(d, "typo.toml")  # (a server bound off loopback: an exposure change, confirmed)
        demo.apply(typo, confirm=service.plan_spec(demo.load(typo)).plan_id)
    assert e.value.step == "prefill_up" and "ip addr" in e.value.hint
    assert demo.pids() == pids and demo.status()["healthy"]  # nothing stopped
    assert demo.load().journal.audit_records()[-1]["event"] == "apply-refused"
    # A NUMA node the host lacks: systemd fails the unit before exec (242) with an empty log, after the stop
    if os.path.isdir("/sys/devices/system/node") and not os.path.isdir("/sys/devices/system/node/node63"):
        d = copy.deepcopy(demo.dict)
        d["decode"][0]["numa_node"] = 63
        numa = demo.write(d, "numa.toml")
        # plan says so beforehand, in apply's words (it showed only "numa_node null → 63": the operator confirmed a
        # topology change to learn of the refusal)
        warned = json.loads(demo.cli("plan", str(numa), "--json").stdout)["binds_unusable"] or ""
        assert "NUMA node(s) the host" in warned and "decode[0].numa_node = 63" in warned, warned
        with pytest.raises(ApplyFailed, match=r"NUMA node\(s\) the host \S+ does not have \(its nodes: [0-9,-]+\), "
                                              r"nothing was started or changed: decode\[0\].numa_node = 63") as e:
            demo.apply(numa, confirm=service.plan_spec(demo.load(numa)).plan_id)  # moving a role's node is topology
        assert e.value.step == "decode_up" and "leave numa_node unset" in e.value.hint
        assert demo.pids() == pids and demo.status()["healthy"]


def test_plan_warns_of_a_bind_address_apply_would_refuse(demo):
    # (a fresh user: plan showed only the change, exit 2; `apply --confirm-topology …` then said "bind addresses
    # unusable" and exit 3: the operator confirmed a change to learn what plan could have said)
    d = copy.deepcopy(demo.dict)
    d["decode"][0]["http_host"] = "gpu-typo.invalid"  # never resolves (RFC 6761)
    spec = demo.write(d, "typo.toml")
    r = demo.cli("plan", str(spec))
    assert r.returncode == ExitCode.CHANGES, r.stderr
    said = ("Warning: `pdctl apply` stops before its first step (exit 3, once any confirmation it needs is given): "
            "bind addresses unusable, nothing was started or changed: decode[0].http_host = 'gpu-typo.invalid' "
            "does not resolve on this host")
    assert said in r.stdout and "hint: write an address this host has" in r.stdout, r.stdout
    got = json.loads(demo.cli("plan", str(spec), "--json").stdout)["binds_unusable"]
    assert got.startswith("bind addresses unusable") and "gpu-typo.invalid" in got, got
    assert json.loads(demo.cli("plan", str(demo.spec), "--json").stdout)["binds_unusable"] is None
    assert "stops before its first step" not in demo.cli("plan", str(demo.spec)).stdout


def test_down_with_nothing_installed_notes_ports_held_by_processes_it_cannot_see(demo, monkeypatch):
    # A non-root user cannot read another user's /proc/<pid>/fd: such a holder cannot be told from the deployment
    # applied as that user, so down stops nothing and says so instead of a bare "nothing to stop"
    import socket

    from pdctl.statemachine import hosts
    from pdctl.statemachine.events import ListSink

    real = hosts.Host.socket_links
    monkeypatch.setattr(hosts.Host, "socket_links", lambda self: [(p, i) for p, i in real(self) if p != os.getpid()])
    with socket.socket() as hidden:
        hidden.bind(("127.0.0.1", demo.ports["router"]))
        hidden.listen()
        sink = ListSink()
        assert service.down(demo.load(), sink=sink) == []
    notes = [e for e in sink.events if e.kind == "info"]
    assert len(notes) == 1 and notes[0].data["ports"] == [demo.ports["router"]], notes
    assert "run down as that user" in notes[0].message
    assert not demo.state.exists()


def test_a_pd_deployment_bound_to_the_ipv6_wildcard_is_dialled_over_ipv6_and_proven(make_demo):
    # prefill and decode on "::" (the stand-in binds it IPv6-only, as SGLang's uvicorn does), the router on ::1:
    # every URL pdctl gives the router or dials itself must reach them, and the router proof must match /workers
    if not os.path.exists("/proc/net/if_inet6") or "00000000000000000000000000000001" not in open("/proc/net/if_inet6").read():
        skip_or_fail("no IPv6 loopback (::1) on this machine")

    def v6(d):
        d["prefill"][0]["http_host"] = d["decode"][0]["http_host"] = "::"
        d["router"]["host"] = "::1"

    demo = make_demo(v6)
    demo.apply()
    st = demo.status()
    assert st["healthy"] and st["reached"] == "parsers_configured", st
    assert all(r["url"].startswith("http://[::1]:") for r in st["roles"]), st["roles"]


def test_roles_spread_over_two_hosts_are_refused_before_anything_changes(make_demo):
    def remote(d):
        d["hosts"]["gpu2"] = {"address": "10.0.0.2"}
        d["decode"][0]["host"] = "gpu2"
        d["prefill"][0]["http_host"] = "0.0.0.0"

    demo = make_demo(remote)
    from pdctl.statemachine.errors import SpecError

    with pytest.raises(SpecError, match="roles run on 2 hosts"):
        demo.apply()
    assert demo.pids() == []
    assert Journal(demo.state, demo.name).read().target is None


@pytest.mark.parametrize("role,step", [("decode", "decode_up"), ("router", "router_exposed")])
def test_a_port_held_by_another_process_stops_the_apply_before_anything_starts(demo, role, step):

    squatter = _socket.socket()
    squatter.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
    squatter.bind(("127.0.0.1", demo.ports[role]))
    squatter.listen()
    try:
        with pytest.raises(Exception) as e:
            demo.apply()
        # named at the step that would have failed, with the holder, before any role started
        assert getattr(e.value, "step", None) == step
        assert f"port {demo.ports[role]} at {step}, held by PID {os.getpid()}" in str(e.value)
        assert "nothing was started or changed" in str(e.value)
        st = demo.status()
        assert [r["state"] for r in st["roles"]] == ["inactive", "inactive"]
        assert not st["healthy"]
        assert Journal(demo.state, demo.name).read().target is None
    finally:
        squatter.close()
    demo.apply()  # the port freed, the same apply goes through
    assert demo.status()["healthy"]


def test_a_port_taken_by_a_connection_not_a_listener_stops_the_apply_before_anything_starts(demo):
    # (helper-99: an outbound connection given the router's metrics port as its ephemeral port passed the check; apply
    # started both servers, then smg failed: "failed to bind metrics server …: Address already in use")
    server = _socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    client = _socket.socket()
    client.bind(("127.0.0.1", demo.ports["prom"]))
    client.connect(server.getsockname())
    try:
        plan = demo.cli("plan", str(demo.spec))
        assert (f"router needs port {demo.ports['prom']} at router_exposed, held by PID {os.getpid()}"
                in plan.stdout and "a connection from that port, not a listener" in plan.stdout), plan.stdout
        assert "net.ipv4.ip_local_reserved_ports" in plan.stdout, plan.stdout
        with pytest.raises(Exception) as e:
            demo.apply()
        assert getattr(e.value, "step", None) == "router_exposed", e.value
        assert "a connection from that port, not a listener" in str(e.value) and "ip_local_port_range" in e.value.hint
        assert demo.pids() == [] and Journal(demo.state, demo.name).read().target is None
    finally:
        client.close()
        server.close()


def _ports_in_35k(demo) -> None:  # noqa: ANN001
    """Move *demo* onto free loopback ports in 35000-35999 (the range this suite's port tests keep to)."""
    import random

    from harness.deploy import dump_toml

    chosen: list[int] = []
    for port in random.sample(range(35000, 36000), 1000):
        with _socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        chosen.append(port)
        if len(chosen) == len(demo.ports):
            break
    demo.ports = dict(zip(demo.ports, chosen))
    d = demo.dict
    d["prefill"][0].update(port=demo.ports["prefill"], bootstrap_port=demo.ports["bootstrap"],
                           nccl_port=demo.ports["pnccl"])
    d["decode"][0].update(port=demo.ports["decode"], nccl_port=demo.ports["dnccl"])
    d["router"].update(port=demo.ports["router"], prometheus_port=demo.ports["prom"])
    demo.spec.write_text(dump_toml(d))


def test_plan_warns_of_a_port_held_outside_the_deployment_as_apply_refuses_it(make_demo):
    # `pdctl plan` said nothing of a port another process held; only apply refused it (exit 3). Plan shows the same
    # finding as a warning, on stdout with the plan and as `ports_held` in --json, keeping its exit code (2: changes).
    demo = make_demo()
    _ports_in_35k(demo)
    port = demo.ports["router"]
    from pdctl.statemachine.hosts import LocalHost
    from pdctl.statemachine.ports import command_line

    me = command_line(LocalHost(), os.getpid())  # (this pytest's: a long one is shortened, ending in …)
    squatter = _socket.socket()
    squatter.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
    squatter.bind(("127.0.0.1", port))
    squatter.listen()
    try:
        r = demo.cli("plan", str(demo.spec))
        rj = demo.cli("plan", str(demo.spec), "--json")
        ra = demo.cli("apply", str(demo.spec))
    finally:
        squatter.close()
    said = f"router needs port {port} at router_exposed, held by PID {os.getpid()}"
    assert r.returncode == ExitCode.CHANGES and "Plan: 4 to add" in r.stdout, r.stderr
    assert "Warning: ports this deployment will listen on are held outside it" in r.stdout, r.stdout
    assert f"  ! {said} ({me}" in r.stdout and "hint: stop those processes" in r.stdout, r.stdout
    assert rj.returncode == ExitCode.CHANGES, rj.stderr
    assert json.loads(rj.stdout)["ports_held"] == [{"port": port, "role": "router", "step": "router_exposed",
                                                    "pid": os.getpid(), "command": me, "applied_elsewhere": None,
                                                    "other_deployment": None, "listening": True}]
    assert ra.returncode == ExitCode.STEP_FAILED and said in ra.stderr, ra.stderr  # what apply refuses, the same
    demo.apply()
    # its own running roles hold every port now: no warning
    r = demo.cli("plan", str(demo.spec))
    rj = demo.cli("plan", str(demo.spec), "--json")
    assert r.returncode == ExitCode.OK and "held outside it" not in r.stdout, (r.stdout, r.stderr)
    assert "stops before its first step" not in r.stdout, r.stdout
    assert rj.returncode == ExitCode.OK and json.loads(rj.stdout)["ports_held"] == [], rj.stdout
    # a stranger on the router's port over IPv6 (the router listens on 127.0.0.1): on [::1] it takes nothing from the
    # router (Linux lets both listen), so no warning; on [::] it may take every address (whether it is IPv6-only does
    # not show in /proc/net/tcp6), so warned; no changes either way (exit 0)
    for address, warned in (("::1", False), ("::", True)):
        try:
            squatter = _socket.socket(_socket.AF_INET6)
            squatter.setsockopt(_socket.IPPROTO_IPV6, _socket.IPV6_V6ONLY, 1)
            squatter.bind((address, port))
        except OSError:
            squatter.close()
            return  # (no IPv6 loopback here)
        squatter.listen()
        try:
            r = demo.cli("plan", str(demo.spec))
        finally:
            squatter.close()
        assert r.returncode == ExitCode.OK and "No changes." in r.stdout, r.stderr
        assert (f"  ! {said} ({me}" in r.stdout) is warned, (address, r.stdout)


def _listening(address: str, port: int) -> _socket.socket:
    s = _socket.socket(_socket.AF_INET6 if ":" in address else _socket.AF_INET)
    s.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
    s.bind((address, port))
    s.listen()
    return s


def test_ports_one_process_holds_are_refused_in_one_clause_naming_it_once(demo):
    # (a renamed spec's old deployment held every port: the refusal repeated each holder's whole command line per
    # port, one line of several KB)
    from pdctl.statemachine import steps

    ctx = _ctx(demo)
    held = [_listening("127.0.0.1", demo.ports[k]) for k in ("prefill", "decode", "router")]
    try:
        with pytest.raises(ApplyFailed) as e:
            steps.ports_taken_elsewhere(ctx, set(ctx.unit_of.values()))
    finally:
        for h in held:
            h.close()
    p, d, r = demo.ports["prefill"], demo.ports["decode"], demo.ports["router"]
    assert (f"prefill needs port {p} at prefill_up, decode port {d} at decode_up, router port {r} at router_exposed, "
            f"held by PID {os.getpid()} (") in e.value.message, e.value.message
    with open(f"/proc/{os.getpid()}/cmdline") as f:
        me = f.read().replace("\0", " ").strip()[:40]
    assert e.value.message.count(me) == 1, e.value.message


def test_a_port_held_on_another_loopback_address_is_no_conflict_unlike_one_on_a_wildcard_or_the_same_address(make_demo):
    # A process on 127.0.0.2:P made apply refuse a role that binds 127.0.0.1:P (and plan warn of it), which Linux allows:
    # the ports check compared port numbers only. Plan's warning and apply's refusal share one scan
    # (steps._ports_wanted), which now also compares each port's bind address; NCCL's rendezvous store binds every
    # address whatever the role's http_host, so any holder of that port is in the way.
    from pdctl.statemachine import steps

    demo = make_demo()
    _ports_in_35k(demo)
    ctx = _ctx(demo)
    own = set(ctx.unit_of.values())
    router, pnccl = demo.ports["router"], demo.ports["pnccl"]
    for address, port, role, step in (("0.0.0.0", router, "router", "router_exposed"),
                                      ("127.0.0.1", router, "router", "router_exposed"),
                                      ("127.0.0.2", pnccl, "prefill", "prefill_up")):
        holder = _listening(address, port)
        try:
            held = steps.ports_held_elsewhere(ctx, own)
            with pytest.raises(ApplyFailed, match=f"{role} needs port {port} at {step}, held by PID {os.getpid()}"):
                steps.ports_taken_elsewhere(ctx, own)
            r = demo.cli("apply", str(demo.spec)) if address == "0.0.0.0" else None
        finally:
            holder.close()
        assert [(h.port, h.role, h.step, h.pid) for h in held] == [(port, role, step, os.getpid())], (address, held)
        if r is not None:  # the headless apply refuses it as the scan does: exit 3, nothing started
            assert r.returncode == ExitCode.STEP_FAILED and f"{role} needs port {port} at {step}" in r.stderr, r.stderr
    # On 127.0.0.2, every port the roles and router bind on 127.0.0.1 (HTTP, bootstrap, metrics): no warning, no
    # refusal, and the whole apply goes through with them held, each proof finding its own process on its address
    on_127_0_0_2 = [_listening("127.0.0.2", demo.ports[k]) for k in ("prefill", "bootstrap", "decode", "router", "prom")]
    try:
        rj = demo.cli("plan", str(demo.spec), "--json")
        assert rj.returncode == ExitCode.CHANGES and json.loads(rj.stdout)["ports_held"] == [], (rj.stdout, rj.stderr)
        assert demo.apply().state == "parsers_configured"
        st = demo.status()
        assert st["healthy"] and all(r["port_owned"] for r in st["roles"]), st
    finally:
        for s in on_127_0_0_2:
            s.close()


def test_a_server_change_keeps_the_process_supervisors_router(make_demo):
    # The plan says a server change restarts prefill and decode; apply then also restarted the router, whose check
    # failed while its workers came back: an outage of the front door that the plan never mentioned. The router here
    # marks a worker down at its first failed check and takes three good ones (1 s apart) to take it back, so it
    # still counts them down when router_exposed first looks.
    def strict(d):
        d["router"].update(health_check_interval_s=1, health_failure_threshold=1, health_success_threshold=3)

    demo = make_demo(strict)
    demo.apply()
    router = demo.status()["router"]
    changed = copy.deepcopy(demo.dict)
    changed["engine"]["env"]["PDCTL_SIM_LOAD_SECONDS"] = "3"  # a restart the router's checks cannot miss
    spec = demo.write(changed, "changed.toml")
    plan = demo.cli("plan", str(spec))
    assert "restarts: decode, prefill\n" in plan.stdout, plan.stdout
    r = demo.cli("apply", str(spec))
    assert r.returncode == 0, r.stderr
    assert f"restarting pdctl-{demo.name}-router.service" not in r.stderr, r.stderr
    # (each server is restarted out of the router's rotation and re-admitted once proven: the router serves them
    # again before its own step looks, which finds it as proven)
    assert "prefill is back in the router and served" in r.stderr and "decode is back in the router" in r.stderr, r.stderr
    assert "= router_exposed: already satisfied" in r.stderr, r.stderr
    st = service.status(demo.load(spec))
    assert st["router"]["main_pid"] == router["main_pid"] and st["healthy"], st


def test_two_roles_swapping_ports_apply_in_one_go(demo):
    demo.apply()
    swapped = copy.deepcopy(demo.dict)
    swapped["prefill"][0]["port"], swapped["decode"][0]["port"] = demo.ports["decode"], demo.ports["prefill"]
    spec = demo.write(swapped, "swapped.toml")
    res = demo.apply(spec)  # prefill's new port is decode's old one: decode is stopped first, then restarted
    assert res.state == "parsers_configured"
    st = service.status(demo.load(spec))
    assert st["healthy"], st
    info = httpx.get(f"http://127.0.0.1:{demo.ports['decode']}/server_info", timeout=5, trust_env=False).json()
    assert info["disaggregation_mode"] == "prefill"


def test_two_roles_swapping_gpus_apply_with_the_one_leaving_them_stopped_first(demo):
    # prefill moved onto decode's GPUs (and back the other way): restarted first, it loaded next to decode's running
    # server on GPUs 4-7, which SGLang does not survive on a real host (the memory it sizes its KV cache from is
    # taken); the stand-in never noticed
    demo.apply()
    decode_pid = demo.status()["roles"][1]["main_pid"]
    swapped = copy.deepcopy(demo.dict)
    swapped["prefill"][0]["gpus"], swapped["decode"][0]["gpus"] = [4, 5, 6, 7], [0, 1, 2, 3]
    spec = demo.write(swapped, "gpus-swapped.toml")
    plan = service.plan_spec(demo.load(spec))
    sink = ListSink()
    res = demo.apply(spec, sink=sink, confirm=plan.plan_id if plan.requires_confirmation else None)
    assert res.state == "parsers_configured"
    said = [e.message for e in sink.events if e.kind == "info"]
    decode_unit, prefill_unit = (f"pdctl-{demo.name}-{r}.service" for r in ("decode", "prefill"))
    stop = f"stopping {decode_unit} first: it runs on GPU 4,5,6,7, which prefill will use; its own step starts it again"
    assert stop in said, said
    assert said.index(stop) < next(i for i, m in enumerate(said) if m.startswith(f"restarting {prefill_unit}")), said
    assert f"starting {decode_unit}" in said, said  # (its own step starts it again, and says so: it said nothing)
    st = service.status(demo.load(spec))
    assert st["healthy"] and st["roles"][1]["main_pid"] != decode_pid, st
    environ = {r["name"]: Path(f"/proc/{r['main_pid']}/environ").read_bytes().split(b"\0") for r in st["roles"]}
    assert b"CUDA_VISIBLE_DEVICES=4,5,6,7" in environ["prefill"] and b"CUDA_VISIBLE_DEVICES=0,1,2,3" in environ["decode"]


def test_adding_then_removing_a_prefill_group_restarts_no_running_server(demo):
    # A fresh user added a second prefill group: the plan's KV link update listed prefill, decode (and the new group)
    # as restarts and apply restarted them all, and the first group, renamed prefill → prefill-0, was replaced by an
    # identical server. Decode learns each request's bootstrap address from the router, so only the router restarts.
    from harness.sim import free_ports

    demo.apply()
    before = {r["name"]: r["main_pid"] for r in demo.status()["roles"]}
    port, boot, nccl = free_ports(3)
    grown = copy.deepcopy(demo.dict)
    grown["prefill"].append({"host": "local", "gpus": [8, 9, 10, 11], "tp": 4, "port": port, "bootstrap_port": boot,
                             "nccl_port": nccl})
    spec = demo.write(grown, "two-prefill.toml")
    plan = service.plan_spec(demo.load(spec))
    by = {c.address: c for c in plan.changes}
    assert set(by) == {"role.prefill-1", "kv_link", "router"}, by
    assert by["role.prefill-1"].action == "create" and by["kv_link"].restarts == (), by["kv_link"]
    assert set(plan.restarts()) == {"router"}, plan.restarts()
    sink = ListSink()
    demo.apply(spec, sink=sink, confirm=plan.plan_id)
    restarted = [e.message.split()[1] for e in sink.events if e.kind == "info" and e.message.startswith("restarting ")]
    assert restarted == [f"pdctl-{demo.name}-router.service"], restarted
    st = service.status(demo.load(spec))
    assert st["healthy"], st
    assert {r["name"]: r["main_pid"] for r in st["roles"] if r["name"] in before} == before
    assert sorted(w["url"] for w in st["router"]["workers"] if w["worker_type"] == "prefill") == sorted(
        f"http://127.0.0.1:{p}" for p in (demo.ports["prefill"], port))

    plan = service.plan_spec(demo.load())  # and back to one group
    assert set(plan.restarts()) == {"router"} and {c.address for c in plan.changes} == {
        "role.prefill-1", "kv_link", "router"}, plan.changes
    demo.apply(confirm=plan.plan_id)
    st = demo.status()
    assert st["healthy"] and {r["name"]: r["main_pid"] for r in st["roles"]} == before, st


def test_a_unit_rendered_otherwise_with_the_same_settings_is_planned_as_the_restart_apply_does(demo):
    # (a pdctl that renders a unit otherwise, as this one dropped decode's fallback bootstrap port: plan said "No
    # changes" and exit 0, then apply restarted decode, its definition no longer the one proven)
    demo.apply()
    journal = demo.load().journal
    st = journal.read()
    decode = f"pdctl-{demo.name}-decode.service"
    st.units[decode] = "0123456789abcdef"  # (the fingerprint of the definition an older pdctl proved)
    journal.write(st)
    data = json.loads(demo.cli("plan", str(demo.spec), "--json").stdout)
    assert [(c["address"], c["action"], c["restarts"]) for c in data["changes"]] == [
        ("role.decode", "update", ["decode"])], data["changes"]
    assert "differs from the one apply proved running" in data["changes"][0]["runs"]
    before = {r["name"]: r["main_pid"] for r in demo.status()["roles"]}
    r = demo.cli("apply", str(demo.spec), "--json")
    assert r.returncode == 0, r.stderr
    events = [json.loads(x) for x in r.stdout.splitlines()]
    assert events[0]["message"].split("; ")[0].endswith("changes that restart roles"), events[0]
    after = {r["name"]: r["main_pid"] for r in demo.status()["roles"]}
    assert after["prefill"] == before["prefill"] and after["decode"] != before["decode"]
    assert json.loads(demo.cli("plan", str(demo.spec), "--json").stdout)["changes"] == []


def test_headless_apply_says_a_failure_once_then_that_nothing_started(demo):

    squatter = _socket.socket()
    squatter.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
    squatter.bind(("127.0.0.1", demo.ports["router"]))
    squatter.listen()
    try:
        r = demo.cli("apply", str(demo.spec))
        rj = demo.cli("apply", str(demo.spec), "--json")
    finally:
        squatter.close()
    failed = [e for e in map(json.loads, rj.stdout.splitlines()) if e["kind"] == "apply_failed"]
    assert [(e["step"], e["data"]["hint"][:20]) for e in failed] == [("router_exposed", "stop those processes")]
    assert failed[0]["data"]["started"] is False  # (refused before its first step: nothing changed)
    assert r.returncode == ExitCode.STEP_FAILED, r.stderr
    said = f"port {demo.ports['router']} at router_exposed, held by PID {os.getpid()}"
    assert r.stderr.count(said) == 1, r.stderr
    assert r.stderr.count("hint: stop those processes") == 1, r.stderr
    assert r.stderr.rstrip().splitlines()[-1].startswith("apply refused before its first step"), r.stderr


def test_status_during_an_apply_takes_a_loading_server_for_its_own(make_demo):
    # While its unit is activating the server answers 503 (loading): that is its own process, not "another process
    # on its port", as status said
    def slow(d):
        d["engine"]["env"]["PDCTL_SIM_LOAD_SECONDS"] = "4"
        # the window this test looks into: up and answering 503 while warming up, its unit still activating (0.1 s
        # by default here, which a status poll on a loaded 2-core machine could miss; a real warm-up takes seconds)
        d["engine"]["env"]["PDCTL_SIM_WARMUP_SECONDS"] = "3"

    demo = make_demo(slow)
    env = {**os.environ, "PDCTL_STATE_DIR": str(demo.state)}
    p = subprocess.Popen([sys.executable, "-m", "pdctl", "apply", str(demo.spec)], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, env=env)
    seen = None
    try:
        deadline = time.monotonic() + 60
        while seen is None and time.monotonic() < deadline and p.poll() is None:
            try:
                pre = next(r for r in demo.status()["roles"] if r["name"] == "prefill")
            except Exception:  # noqa: BLE001 - the journal or units mid-write: look again
                pre = {}
            if pre.get("state") == "activating" and pre.get("health"):
                seen = pre
            time.sleep(0.1)
        assert p.wait(120) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
    assert seen is not None, "prefill never seen activating and answering"
    assert seen["port_owned"] is True and seen["healthy"] is False, seen


def test_status_scans_listeners_after_its_probes(make_demo):
    # status read the host's listening sockets once, before probing: a server that began listening in between
    # answered its probe while no listener was on record, and was called another process's (port_owned False; a
    # clean-clone CI run failed the test above on it). Here the prefill probe waits until the server listens, which
    # is that interleaving made certain.
    def slow(d):
        d["engine"]["env"]["PDCTL_SIM_LOAD_SECONDS"] = "3"
        d["engine"]["env"]["PDCTL_SIM_WARMUP_SECONDS"] = "5"

    demo = make_demo(slow)
    url = f"http://127.0.0.1:{demo.ports['prefill']}"

    class WaitsForPrefill(httpx.Client):
        def get(self, u, **kw):  # noqa: ANN001, ANN003, ANN202
            deadline = time.monotonic() + 30
            while u.startswith(url) and time.monotonic() < deadline:
                with _socket.socket() as s:
                    if s.connect_ex(("127.0.0.1", demo.ports["prefill"])) == 0:
                        break
                time.sleep(0.05)
            return super().get(u, **kw)

    env = {**os.environ, "PDCTL_STATE_DIR": str(demo.state)}
    p = subprocess.Popen([sys.executable, "-m", "pdctl", "apply", str(demo.spec)], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + 60
        pre: dict = {}
        while time.monotonic() < deadline and p.poll() is None and not pre.get("main_pid"):
            try:  # the unit started, its server still loading (not listening)
                pre = next(r for r in demo.status()["roles"] if r["name"] == "prefill")
            except Exception:  # noqa: BLE001 - the journal or units mid-write: look again
                pre = {}
            time.sleep(0.1)
        assert pre.get("main_pid") and not pre["health"], pre
        with WaitsForPrefill(trust_env=False) as client:
            st = service.status(demo.load(), client=client)
        pre = next(r for r in st["roles"] if r["name"] == "prefill")
        assert pre["health"] == 503 and pre["port_owned"] is True and pre["healthy"] is False, pre
        assert p.wait(120) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def test_a_server_answering_for_another_unit_is_never_taken_as_proof(make_demo):
    first = make_demo()
    first.apply()

    def same_ports(d):
        d["prefill"][0].update(port=first.ports["prefill"], bootstrap_port=first.ports["bootstrap"], nccl_port=first.ports["pnccl"])
        d["router"].update(port=first.ports["router"])

    second = make_demo(same_ports)
    from pdctl.statemachine.steps import ServersUp

    ctx = service.build_context(second.load(), timeouts=second.timeouts())
    # Another deployment answers on this prefill's port: health 200 and a matching /server_info,
    # but the process is not this unit's.
    assert ServersUp("prefill", "prefill_up").observe(ctx) is None
    with pytest.raises(Exception, match="ports are taken"):
        ServersUp("prefill", "prefill_up").apply(ctx)
    assert first.status()["healthy"]
    # status reports the stranger's 200 as such, not as this deployment's health
    st2 = service.status(second.load())
    pre = st2["roles"][0]
    assert (pre["health"], pre["port_owned"], pre["healthy"]) == (200, False, False)
    from pdctl.console.cli import _status_text

    line = next(x for x in _status_text(st2).splitlines() if x.strip().startswith(pre["name"]))
    # ...and names the other deployment's unit it runs for (a fresh user's renamed spec read "not deployed" with no
    # word of the old name still running)
    assert pre["state"] != "active" and pre["port_held_for"] == f"pdctl-{first.name}-prefill.service", pre
    assert f"(from another process on its port: pdctl unit pdctl-{first.name}-prefill.service)" in line, line
    # the router's readiness too (it read as this deployment's router, ready)
    assert (st2["router"]["readiness"], st2["router"]["port_owned"]) == (200, False), st2["router"]
    line = next(x for x in _status_text(st2).splitlines() if x.strip().startswith("router"))
    assert f"readiness 200 (from another process on its port: pdctl unit pdctl-{first.name}-router.service)" in line, line
    assert _status_text(st2).splitlines()[-1].startswith("  hint: another pdctl deployment holds these ports")
    assert first.status()["roles"][0]["port_owned"] is True and first.status()["router"]["port_owned"] is True


def test_an_interrupted_change_is_never_mistaken_for_the_old_state(demo):
    demo.apply()
    changed = copy.deepcopy(demo.dict)
    changed["model"]["context_length"] = 65536
    spec2 = demo.write(changed, "ctx.toml")
    env = {**os.environ, "PDCTL_STATE_DIR": str(demo.state)}
    p = subprocess.Popen([sys.executable, "-m", "pdctl", "apply", str(spec2), "--json"], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        for line in p.stdout:
            ev = json.loads(line)
            if ev["kind"] == "step_applied" and ev["step"] == "prefill_up":
                os.kill(p.pid, signal.SIGKILL)  # prefill restarted with the new context length
                break
    finally:
        p.wait(30)
    with httpx.Client(trust_env=False) as c:
        info = c.get(f"http://127.0.0.1:{demo.ports['prefill']}/server_info").json()
    assert info["context_length"] == 65536
    assert not demo.status()["healthy"]  # interrupted: not converged
    # Back to the original spec: the plan shows no spec change, but the apply must restart prefill.
    r = demo.cli("apply", str(demo.spec))
    assert r.returncode == 0, r.stderr
    with httpx.Client(trust_env=False) as c:
        info = c.get(f"http://127.0.0.1:{demo.ports['prefill']}/server_info").json()
    assert info["context_length"] == 131072
    assert demo.status()["healthy"]


def test_status_tells_an_apply_that_runs_from_one_that_was_interrupted(demo):
    from pdctl.console.cli import _status_text

    demo.apply()
    journal = demo.load().journal
    state = journal.read()
    state.target = state.deployed  # as an apply journals it before its first step
    journal.write(state)
    st = demo.status()
    assert st["locked_by"] is None and not st["healthy"]
    assert "[an apply was interrupted: apply again to converge" in _status_text(st).splitlines()[0]
    # Columns stay aligned with words longer than they were sized for (they broke on each of these)
    odd = copy.deepcopy(st)
    odd["roles"][0]["state"] = "deactivating"
    odd["router"].update(state="failed", sub_state="watchdog-gone")
    first = next(iter(odd["steps"]))
    odd["steps"][first]["status"] = "interrupted"
    lines = _status_text(odd).splitlines()
    units = [x for x in lines if x.startswith("  ") and " pid " in x]
    assert len(units) == 3 and "failed (watchdog-gone) pid" in units[-1], lines
    assert len({x.index(" pid ") for x in units}) == 1, lines
    steps = lines[lines.index("  steps:") + 1:]
    rests = [x[25:].split(" ", 1)[1] for x in steps]  # after "    " + the step's 20 columns + " " + its status
    assert len({len(x) - len(r) + len(r) - len(r.lstrip(" ")) for x, r in zip(steps, rests)}) == 1, steps
    with journal.lock("apply"):  # another process would hold it; this one does, as the lock file says
        st = demo.status()
    assert st["locked_by"]["pid"] == os.getpid(), st["locked_by"]
    assert f"[apply in progress: PID {os.getpid()} (" in _status_text(st).splitlines()[0]
    assert demo.cli("apply", str(demo.spec)).returncode == 0
    assert demo.status()["healthy"]


def _json_apply_signalled(demo, sig, *, spec: Path | None = None, at: tuple[str, str | None] = ("step_started", "prefill_up"),
                          **popen) -> tuple:  # noqa: ANN001, ANN003
    """``pdctl apply SPEC --json`` (*spec*, else the demo's) in a child process, sent *sig* right after the event *at*
    (kind, step): (process, events, stderr)."""
    env = {**os.environ, "PDCTL_STATE_DIR": str(demo.state)}
    p = subprocess.Popen([sys.executable, "-m", "pdctl", "apply", str(spec or demo.spec), "--json"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, **popen)
    events = []
    try:
        for line in p.stdout:
            events.append(json.loads(line))
            if (events[-1]["kind"], events[-1]["step"]) == at:
                p.send_signal(sig)
                break
        rest, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
    return p, events + [json.loads(x) for x in rest.splitlines()], err


@pytest.mark.parametrize("sig,rc", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_an_interrupted_json_apply_ends_its_stream_with_an_event(demo, sig, rc):
    # Ctrl-C (SIGINT), SIGTERM (`timeout`, CI runners) or SIGHUP (a remote admin's SSH session dropped) during a --json
    # apply: the stream's last line says where it stopped (it ended on a step event; SIGTERM and SIGHUP killed the
    # process outright, leaving the step "running").
    p, events, err = _json_apply_signalled(demo, sig)
    assert p.returncode == rc, err
    last = events[-1]
    assert last["kind"] == "apply_interrupted" and last["step"] == "prefill_up", events[-3:]
    assert "apply again" in last["message"] and "pdctl down" in last["message"]
    audit = demo.load().journal.audit_records()[-1]
    assert audit["event"] == "apply-interrupted" and audit["step"] == "prefill_up", audit
    step = demo.status()["steps"]["prefill_up"]
    assert step["status"] == "interrupted"  # not left "running"
    assert step["summary"].startswith("stopped by Ctrl-C, a signal or the console while it ran"), step  # not blank
    said = {signal.SIGINT: "", signal.SIGTERM: "terminated (SIGTERM); ", signal.SIGHUP: "hung up (SIGHUP); "}[sig] + \
        "interrupted during prefill_up:"
    assert err.rstrip().splitlines()[-1].startswith(said), err


def test_a_resumed_change_keeps_the_server_its_interrupted_apply_already_proved(demo):
    # A change restarts prefill and decode; Ctrl-C right after prefill_up proved prefill with the new settings. The
    # resume restarted prefill again (its plan still compares with the recorded settings, so prefill still counted as
    # a change: a second weight load, while a server only started, not yet proven, was kept); it is proven as it stands
    demo.apply()
    d = copy.deepcopy(demo.dict)
    d["model"]["context_length"] = 8192
    changed = demo.write(d, "ctx.toml")
    p, events, err = _json_apply_signalled(demo, signal.SIGINT, spec=changed, at=("step_verified", "prefill_up"))
    assert p.returncode == 130, err
    assert events[-1]["kind"] == "apply_interrupted" and events[-1]["step"] != "prefill_up", events[-3:]
    st = demo.status()
    assert st["reached"] == "prefill_up", st["steps"]
    proven = st["roles"][0]["main_pid"]
    r = demo.cli("apply", str(changed))
    assert r.returncode == 0, r.stderr
    assert "prefill_up: already satisfied" in r.stderr, r.stderr
    assert f"restarting pdctl-{demo.name}-prefill.service" not in r.stderr, r.stderr
    assert demo.status()["roles"][0]["main_pid"] == proven  # the same process, loaded once
    with httpx.Client(trust_env=False) as c:
        for port in (demo.ports["prefill"], demo.ports["decode"]):
            assert c.get(f"http://127.0.0.1:{port}/server_info").json()["context_length"] == 8192
    assert demo.status()["healthy"]


def test_an_apply_under_nohup_runs_through_a_hangup(demo):
    # `nohup pdctl apply SPEC &`, then logging out: SIGHUP is ignored there, and stays so (pdctl's own handler had
    # replaced nohup's SIG_IGN, and stopped the apply half-way)
    p, _, err = _json_apply_signalled(demo, signal.SIGHUP,
                                      preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    assert p.returncode == 0, err
    assert demo.status()["healthy"]


def test_a_json_apply_stopped_right_after_its_plan_ends_with_an_event(demo):
    # SIGTERM as soon as the plan line arrives (before or around the first step): still one terminal event.
    env = {**os.environ, "PDCTL_STATE_DIR": str(demo.state)}
    p = subprocess.Popen([sys.executable, "-m", "pdctl", "apply", str(demo.spec), "--json"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
    try:
        first = json.loads(p.stdout.readline())
        p.send_signal(signal.SIGTERM)
        rest, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
    events = [first] + [json.loads(x) for x in rest.splitlines()]
    assert first["kind"] == "plan" and p.returncode == 143, (events, err)
    assert first["message"].endswith(": a first deployment"), first  # a topology plan that needs no confirmation
    assert events[-1]["kind"] == "apply_interrupted", events
    assert [e["kind"] for e in events].count("apply_interrupted") == 1
    assert demo.load().journal.audit_records()[-1]["event"] == "apply-interrupted"


@pytest.mark.parametrize("as_json", [True, False])
def test_an_apply_stopped_after_its_plan_before_it_started_says_truly_what_runs(demo, as_json):
    # Stopped after its plan was reported but before apply_started (the host proven with `true`, whose stand-in here
    # answers only after 30 s), a first deployment said "what already runs stays as it is … or `pdctl down`": nothing
    # runs, and nothing was changed. Where something of it runs, those words stay.
    from harness.deploy import interrupted_while_a_host_command_runs

    command = ["apply", "--json"] if as_json else ["apply"]

    def stopped() -> tuple[list[dict], str, str]:
        r, took, ended = interrupted_while_a_host_command_runs(demo.tmp, command, signal.SIGTERM, demo.spec,
                                                               executable="true")
        assert r.returncode == 143 and ended and took < 10, (r.returncode, ended, took, r.stderr)
        assert "Traceback" not in r.stderr, r.stderr
        events = [json.loads(x) for x in r.stdout.splitlines()] if as_json else []
        plan_id = events[0]["data"]["plan_id"] if as_json else r.stderr.split("plan ", 1)[1].split(":", 1)[0]
        if as_json:
            assert [e["kind"] for e in events] == ["plan", "apply_interrupted"], events
            assert events[1]["step"] is None and events[1]["data"] == {"plan_id": plan_id, "stopped": []}, events
        else:
            assert r.stderr.startswith(f"· plan {plan_id}: "), r.stderr  # the plan was reported first
        audited = demo.load().journal.audit_records()[-1]
        assert (audited["event"], audited["plan_id"]) == ("apply-interrupted", plan_id), audited
        return events, r.stderr.rstrip().splitlines()[-1], plan_id

    events, last, _ = stopped()  # a first deployment
    if as_json:
        assert events[0]["message"].endswith(": a first deployment"), events
        assert events[1]["message"] == "interrupted before the apply started: nothing was changed; apply again", events
    assert last == ("terminated (SIGTERM); interrupted before the apply started: nothing was changed; run the same "
                    "command again"), last
    state = demo.load().journal.read()
    assert state.deployed is None and state.target is None and demo.pids() == []  # nothing journalled, nothing runs
    demo.apply()  # deployed: what runs stays as it is, as the words say
    before = demo.pids()
    events, last, _ = stopped()
    if as_json:
        assert events[1]["message"] == ("interrupted: what already runs stays as it is; apply again to converge, or "
                                        "`pdctl down` to stop it"), events
    named = f"{demo.spec} --state-dir {demo.state}"  # (its own spec and state directory, PDCTL_STATE_DIR's: to paste)
    assert last == (f"terminated (SIGTERM); interrupted: what already runs stays as it is (`pdctl status {named}` "
                    f"shows it); run the same command again to converge, or `pdctl down {named} --yes` to stop it"), last
    assert demo.pids() == before and demo.status()["healthy"]


@pytest.mark.parametrize("sig,rc,said", [(signal.SIGINT, 130, ""), (signal.SIGTERM, 143, "terminated (SIGTERM); ")])
def test_a_json_apply_stopped_before_its_plan_ends_with_an_event_too(tmp_path, sig, rc, said):
    # Ctrl-C (or SIGTERM) while the spec's hosts are discovered, before the engine has a plan: the --json stream ended
    # with no event at all (the engine emits apply_interrupted from its plan on). The host's nvidia-smi here answers
    # only after 20 s, and says when it was started.
    from harness.deploy import interrupted_while_nvidia_smi_runs

    r, _took, ended = interrupted_while_nvidia_smi_runs(tmp_path, ["apply", "--json"], sig, smi_s=20)
    out, err = r.stdout, r.stderr
    assert r.returncode == rc, err
    assert ended, "the interrupted apply left its nvidia-smi running"  # (its own session: the signal never reached it)
    events = [json.loads(x) for x in out.splitlines()]
    assert [e["kind"] for e in events] == ["apply_interrupted"], (events, err)
    assert events[0]["step"] is None and events[0]["data"] == {"plan_id": None, "stopped": []}, events
    assert "before the apply started: nothing was changed" in events[0]["message"], events
    assert err.rstrip().splitlines()[-1] == said + ("interrupted before the apply started: nothing was changed; run the "
                                                    "same command again"), err
    assert not (tmp_path / "state" / "journal.json").exists()


def test_an_apply_whose_reader_goes_away_still_completes(demo):
    # `pdctl apply SPEC --json | head -1`: the pipe closes after the first event; the apply must not die of EPIPE
    # half-way (it was audited apply-failed, "[Errno 32] Broken pipe")
    env = {**os.environ, "PDCTL_STATE_DIR": str(demo.state)}
    p = subprocess.Popen([sys.executable, "-m", "pdctl", "apply", str(demo.spec), "--json"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env)
    try:
        assert json.loads(p.stdout.readline())["kind"] == "plan"
        p.stdout.close()  # the reader is gone
        p.stderr.close()
        rc = p.wait(180)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
    assert rc == 0
    assert demo.load().journal.audit_records()[-1]["event"] == "apply-done"
    assert demo.status()["healthy"]


def test_a_server_started_just_before_a_kill_is_waited_for_not_restarted(demo):
    # apply killed (SIGKILL) right after it started a unit and before it journalled that start: the next plan said the
    # running server "will be created", and its apply restarted it (on a GPU host, a model load thrown away)
    script = (
        "import os, signal, sys\n"
        "from pdctl.units import _process\n"
        "real = _process.ProcessSupervisor.start\n"
        "def start(self, name, **kw):\n"
        "    real(self, name, **kw)\n"
        "    if '-decode.' in name:\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "_process.ProcessSupervisor.start = start\n"
        "from pdctl.console.cli import main\n"
        "main(sys.argv[1:])\n")
    env = {**os.environ, "PDCTL_STATE_DIR": str(demo.state)}
    r = subprocess.run([sys.executable, "-c", script, "apply", str(demo.spec)], capture_output=True, text=True,
                       timeout=180, env=env)
    assert r.returncode == -signal.SIGKILL and f"starting pdctl-{demo.name}-decode.service" in r.stderr, r.stderr
    deadline = time.monotonic() + 30
    while not (decode := next(x for x in demo.status()["roles"] if x["name"] == "decode"))["main_pid"]:
        assert decode["state"] in ("activating", "active") and time.monotonic() < deadline, decode
        time.sleep(0.2)  # (its watchdog starts the server)
    plan = demo.cli("plan", str(demo.spec))
    rows = [x.strip() for x in plan.stdout.splitlines()]
    assert any(x.startswith("= role.decode:") for x in rows) and not any(x.startswith("+ role.decode") for x in rows), \
        plan.stdout
    r = demo.cli("apply", str(demo.spec))
    assert r.returncode == 0, r.stderr
    assert f"restarting pdctl-{demo.name}-decode.service" not in r.stderr, r.stderr
    after = next(x for x in demo.status()["roles"] if x["name"] == "decode")
    assert after["main_pid"] == decode["main_pid"] and after["healthy"], after


def _collapse_killed_at(demo, when) -> Path:  # noqa: ANN001
    """Apply the confirmed collapse of the demo into one server in a child process and SIGKILL it at the first event
    for which *when* is true; returns the collapse spec."""
    collapse = demo.write(_collapse(demo.dict, demo.ports["router"]), "collapse.toml")
    r = demo.cli("plan", str(collapse))
    plan_id = next(line.split()[2] for line in r.stdout.splitlines() if line.startswith("plan id:"))
    env = {**os.environ, "PDCTL_STATE_DIR": str(demo.state)}
    p = subprocess.Popen([sys.executable, "-m", "pdctl", "apply", str(collapse), "--confirm-topology", plan_id, "--json"],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        for line in p.stdout:
            if when(json.loads(line)):
                os.kill(p.pid, signal.SIGKILL)
                break
    finally:
        p.wait(30)
    return collapse


def test_an_interrupted_collapse_leaves_no_orphan_when_pd_is_applied_again(demo):
    demo.apply()
    # killed once the single server runs; the journal still says PD
    _collapse_killed_at(demo, lambda ev: ev["kind"] == "step_applied" and ev["step"] == "server_up")
    # The journal still records PD, which the spec asks; but the single server runs, so going back to PD changes what
    # runs: the plan is that topology change (it said "No changes", and apply went ahead unconfirmed)
    plan = demo.cli("plan", str(demo.spec))
    assert plan.returncode == 2 and "an earlier apply did not finish" in plan.stderr, plan.stderr
    assert "plan starts from what it was applying: going back is a topology change too" in plan.stderr, plan.stderr
    assert "single server → PD disaggregation" in plan.stdout, plan.stdout
    plan_id = next(line.split()[2] for line in plan.stdout.splitlines() if line.startswith("plan id:"))
    pids = demo.pids()
    r = demo.cli("apply", str(demo.spec))
    assert r.returncode == 2 and "changes the topology" in r.stderr, r.stderr
    assert demo.pids() == pids  # refused before anything changed
    # Back to PD, confirmed: the half-started single server must go, PD must come back.
    r = demo.cli("apply", str(demo.spec), "--confirm-topology", plan_id)
    assert r.returncode == 0, r.stderr
    assert "stopped and removed" in r.stderr and "-server.service" in r.stderr
    assert demo.status()["healthy"]
    assert len(demo.pids()) == 3


def test_a_dropped_role_survives_no_second_interruption_unnamed(demo, monkeypatch):
    # A collapse killed once its single server runs, then the PD apply killed before it removed that server: the
    # collapse target that named it was already overwritten, so status hid it, apply called it foreign and down said
    # nothing was installed. The drop list is journalled with the target now.
    demo.apply()
    _collapse_killed_at(demo, lambda ev: ev["kind"] == "step_applied" and ev["step"] == "server_up")
    server = f"pdctl-{demo.name}-server.service"

    class Killed(BaseException):
        pass

    def killed(ctx, state, sink):  # noqa: ANN001, ANN202
        raise Killed

    monkeypatch.setattr(service, "_remove_gone_roles", killed)
    confirm = service.plan_spec(demo.load()).plan_id  # back from the half-done collapse: a topology change
    with pytest.raises(Killed):
        demo.apply(confirm=confirm)
    monkeypatch.undo()
    assert demo.load().journal.read().removing == [server]
    left = {u["unit"]: u for u in demo.status()["leftover"]}
    assert left[server]["state"] == "active", left
    r = demo.cli("apply", str(demo.spec))  # (the PD apply had begun: its target is the spec now)
    assert r.returncode == 0, r.stderr
    assert f"stopped and removed {server}" in r.stderr
    assert demo.status()["healthy"] and demo.load().journal.read().removing == []


def test_status_shows_the_servers_an_interrupted_collapse_had_not_removed_yet(demo):
    demo.apply()
    collapse = _collapse_killed_at(demo, lambda ev: ev["kind"] == "role_removed")  # the router gone, the servers not
    left = {u["name"]: u for u in json.loads(demo.cli("status", str(demo.spec), "--json").stdout)["leftover"]}
    assert set(left) == {"prefill", "decode"}, left
    assert left["prefill"]["state"] == left["decode"]["state"] == "active"
    assert {left[n]["main_pid"] for n in left} <= set(demo.pids())
    text = demo.cli("status", str(collapse)).stdout
    assert sum("which the unfinished apply drops" in line for line in text.splitlines()) == 2, text
    assert demo.cli("apply", str(demo.spec)).returncode == 0
    assert json.loads(demo.cli("status", str(demo.spec), "--json").stdout)["leftover"] == []


def test_a_spec_whose_host_reaches_another_machine_is_refused_by_apply_down_plan_and_status(demo):
    # (connect, address or ssh_port changed, or an SSH tunnel: apply would start a second copy on the machine reached
    # and leave the first running, and down would record the running one as stopped)
    from pdctl.statemachine.errors import HostError

    demo.apply()
    j = demo.load().journal
    if not os.path.exists("/etc/machine-id") and not os.path.exists("/var/lib/dbus/machine-id"):
        # machines cannot be told apart here: nothing is recorded, so nothing is compared or refused
        assert j.read().machine is None and demo.status()["healthy"]
        service.down(demo.load())
        return
    state = j.read()
    assert state.machine["machine_id"] == open("/etc/machine-id").read().strip()
    assert state.machine["reached_as"] == "local"
    pids = demo.pids()
    state.machine = {**state.machine, "machine_id": "0" * 32, "hostname": "gpu-old"}  # recorded on another machine
    j.write(state)
    for said, call in (("applying there would start a second copy", lambda: demo.apply()),
                       ("stopping it there would record the running copy as stopped", lambda: service.down(demo.load())),
                       ("what is read there says nothing of the copy that runs", lambda: demo.status())):
        with pytest.raises(HostError, match=rf"now reaches machine .*, but deployment '{demo.name}' runs on gpu-old "
                                            rf".*: {said}") as e:
            call()
        assert "restore hosts.local" in e.value.hint and "journal.json aside" in e.value.hint
    r = demo.cli("plan", str(demo.spec))
    assert r.returncode == 1 and "runs on gpu-old" in r.stderr, r.stderr
    r = demo.cli("chat", str(demo.spec))  # (it chatted with whatever answered there, exit 0)
    assert r.returncode == 1 and "runs on gpu-old" in r.stderr and "is not the copy that runs" in r.stderr, r.stderr
    assert r.stdout == ""
    assert demo.pids() == pids and j.read().deployed is not None  # nothing stopped, nothing forgotten
    # the same hostname reached the same way with a new machine-id (regenerated at boot): the same machine
    state = j.read()
    state.machine = {**state.machine, "hostname": open("/proc/sys/kernel/hostname").read().strip()}
    j.write(state)
    assert demo.status()["healthy"]
    demo.apply()
    assert j.read().machine["machine_id"] == open("/etc/machine-id").read().strip()  # recorded anew
    state = j.read()
    state.machine = None  # a journal from before machines were recorded: nothing to compare, and apply records it
    j.write(state)
    demo.apply()
    assert j.read().machine["machine_id"] == open("/etc/machine-id").read().strip()
    service.down(demo.load())
    assert j.read().machine is None


def test_status_of_a_deployment_never_applied_says_not_deployed(demo):
    r = demo.cli("status", str(demo.spec))
    assert r.returncode == 1
    assert "not deployed" in r.stdout and "differs" not in r.stdout and "NOT healthy" not in r.stdout
    # its units running with no journal recording them (the journal moved aside, as a damaged one's hint says):
    # not healthy, exit 1, and said (it was "not deployed" with exit 0 and "healthy": true)
    demo.apply()
    (demo.state / "journal.json").rename(demo.state / "journal.aside")
    r = demo.cli("status", str(demo.spec))
    assert r.returncode == 1 and "not deployed, yet units of it run" in r.stdout, r.stdout
    assert json.loads(demo.cli("status", str(demo.spec), "--json").stdout)["healthy"] is False


def _kill_watchdog(demo, unit: str) -> int:
    wd = int((demo.state / "supervisor" / "services" / unit / "watchdog.pid").read_text())
    os.kill(wd, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not process_gone(wd):
        time.sleep(0.05)
    return wd


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_an_apply_whose_role_loses_its_supervisor_while_starting_fails_at_once(make_demo, sig):
    # The unit stayed "activating" with nothing left to mark it active, and the apply waited out role_start (30 min
    # by default) in silence; a full disk had killed the supervisor that way (a stopped one marks nothing active either)
    def slow(d):
        d["engine"]["env"]["PDCTL_SIM_LOAD_SECONDS"] = "10"

    demo = make_demo(slow)
    env = {**os.environ, "PDCTL_STATE_DIR": str(demo.state)}
    p = subprocess.Popen([sys.executable, "-m", "pdctl", "apply", str(demo.spec)], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, env=env)
    unit = f"pdctl-{demo.name}-prefill.service"
    try:
        pid_file = demo.state / "supervisor" / "services" / unit / "watchdog.pid"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and p.poll() is None and not pid_file.exists():
            time.sleep(0.1)
        time.sleep(1)
        t0 = time.monotonic()
        if sig == signal.SIGKILL:
            wd = _kill_watchdog(demo, unit)
        else:
            wd = int(pid_file.read_text())
            os.kill(wd, signal.SIGSTOP)
        _, err = p.communicate(timeout=60)
        took = time.monotonic() - t0
        if sig == signal.SIGKILL:
            assert f"the supervisor of {unit} is gone while it started" in err and "disk is not full" in err, err
        else:
            assert f"the supervisor of {unit} is stopped" in err and "kill -CONT" in err, err
        # The same apply again restarts the role under a new supervisor (it waited for the unsupervised unit, and
        # failed the same way every time)
        r = demo.cli("apply", str(demo.spec))
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
        if sig == signal.SIGSTOP and not process_gone(wd):
            os.kill(wd, signal.SIGCONT)
    assert p.returncode == ExitCode.STEP_FAILED, err
    assert took < 8, took  # before the server's 10 s load ends, let alone role_start
    assert r.returncode == 0, r.stderr
    assert f"restarting {unit}" in r.stderr, r.stderr
    assert demo.status()["healthy"] and process_gone(wd)
    demo.cli("down", str(demo.spec), "--yes")


def test_plan_notes_a_running_server_failing_its_probe_without_calling_it_changes(demo, monkeypatch):
    # A busy SGLang server can fail /health (a one-token generation) for a while: plan says so on stderr, but its exit
    # (what a script gates apply on) stays 0, or apply would restart a busy, healthy server
    # (its probe made to fail as a busy server's does, its process running; a process stopped with kill -STOP, which
    # this test used to stand for "busy", is apply's to restart and plan's exit 2 since status tells it apart)
    from pdctl.console import cli
    from pdctl.statemachine import probes

    demo.apply()
    decode_url = f"http://127.0.0.1:{demo.ports['decode']}"
    health = probes.health

    def busy(client, url, *a, **k):  # noqa: ANN001, ANN002, ANN003
        return 0 if url == decode_url else health(client, url, *a, **k)

    monkeypatch.setattr(probes, "health", busy)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
        cli.main(["plan", str(demo.spec), "--state-dir", str(demo.state)])
    monkeypatch.undo()
    assert e.value.code == 0 and "matches the spec" in out.getvalue(), (out.getvalue(), err.getvalue())
    assert "decode active, health down" in err.getvalue() and "may only be busy" in err.getvalue(), err.getvalue()


def test_a_role_whose_supervisor_was_killed_is_reported_and_taken_back_by_apply(demo):
    """kill -9 of a role's watchdog leaves its server serving but unwatched: status must say so (not
    "healthy"), and apply must restart it under a new supervisor instead of calling it already satisfied.
    The router too: smg rewrites its process title, which leaves /proc/PID/environ empty."""
    demo.apply()
    dec = next(r for r in demo.status()["roles"] if r["name"] == "decode")
    wd = _kill_watchdog(demo, dec["unit"])
    st = demo.status()
    d = next(r for r in st["roles"] if r["name"] == "decode")
    assert d["supervised"] is False and d["health"] == 200 and d["main_pid"] == dec["main_pid"]
    assert not d["healthy"] and not st["healthy"]
    text = demo.cli("status", str(demo.spec))
    assert text.returncode == 1 and "UNSUPERVISED" in text.stdout and "NOT healthy" in text.stdout
    plan = demo.cli("plan", str(demo.spec))  # the spec did not change, but plan must not hide what apply will do
    # (exit 2, as for changes: a script gating apply on plan must not skip it)
    assert plan.returncode == 2 and "No changes to what was recorded as deployed" in plan.stdout, plan.stdout
    assert "but what runs no longer serves as proven: decode UNSUPERVISED" in plan.stdout
    assert "matches the spec" not in plan.stdout
    assert "decode UNSUPERVISED" in plan.stderr and "pdctl apply" in plan.stderr
    sink = ListSink()
    demo.apply(sink=sink)
    assert ("step_verified", "decode_up") in sink.kinds()  # applied again, not skipped as satisfied
    assert process_gone(dec["main_pid"])
    st = demo.status()
    d = next(r for r in st["roles"] if r["name"] == "decode")
    assert st["healthy"] and d["supervised"] and d["main_pid"] != dec["main_pid"]
    assert int((demo.state / "supervisor" / "services" / dec["unit"] / "watchdog.pid").read_text()) != wd
    settled = demo.cli("plan", str(demo.spec))
    assert "note:" not in settled.stderr and settled.returncode == 0  # all serves as proven again
    assert "matches the spec" in settled.stdout
    # The router's supervisor: apply stops the unsupervised smg before starting a supervised one.
    router = st["router"]
    _kill_watchdog(demo, router["unit"])
    assert demo.status()["router"]["supervised"] is False
    sink = ListSink()
    demo.apply(sink=sink)
    assert ("step_verified", "router_exposed") in sink.kinds()
    st = demo.status()
    assert process_gone(router["main_pid"]) and st["healthy"] and st["router"]["main_pid"] != router["main_pid"]
    # And down ends an unsupervised role's server too (smg's included), leaving nothing on the demo's ports.
    router = st["router"]
    _kill_watchdog(demo, router["unit"])
    assert demo.cli("down", str(demo.spec), "--yes").returncode == 0
    assert process_gone(router["main_pid"]) and demo.pids() == []


def test_a_role_whose_supervisor_is_stopped_is_reported_and_taken_back_by_apply(demo):
    # kill -STOP of a watchdog leaves it alive but restarting nothing: status read healthy and supervised
    demo.apply()
    dec = next(r for r in demo.status()["roles"] if r["name"] == "decode")
    wd = int((demo.state / "supervisor" / "services" / dec["unit"] / "watchdog.pid").read_text())
    stop_process(wd)
    try:
        st = demo.status()
        d = next(r for r in st["roles"] if r["name"] == "decode")
        assert (d["supervised"], d["sub_state"], d["health"], d["main_pid"]) == (False, "supervisor-stopped", 200,
                                                                                 dec["main_pid"])
        assert not st["healthy"]
        text = demo.cli("status", str(demo.spec))
        assert text.returncode == 1 and "UNSUPERVISED: its supervisor is stopped" in text.stdout, text.stdout
        plan = demo.cli("plan", str(demo.spec))
        assert plan.returncode == 2 and "decode UNSUPERVISED (its supervisor is stopped" in plan.stdout, plan.stdout
        sink = ListSink()
        demo.apply(sink=sink)  # (stops the role through its stopped watchdog, which it continues, then starts it anew)
    finally:
        if not process_gone(wd):
            os.kill(wd, signal.SIGCONT)
    assert ("step_verified", "decode_up") in sink.kinds()
    st = demo.status()
    assert st["healthy"] and process_gone(dec["main_pid"]) and process_gone(wd)


def test_down_stops_roles_whose_supervisor_files_were_deleted_or_whose_folder_was_removed(demo):
    # (files deleted under a running role: status read inactive, "from another process on its port"; down said "was not
    # running", exited 0 and left the server and smg serving; apply then refused the deployment's own ports)
    import shutil

    demo.apply()
    st = demo.status()
    services = demo.state / "supervisor" / "services"
    dec = next(r for r in st["roles"] if r["name"] == "decode")
    _kill_watchdog(demo, dec["unit"])
    for f in ("status.json", "main.pid", "main.start", "watchdog.pid"):
        (services / dec["unit"] / f).unlink()
    router = st["router"]
    shutil.rmtree(services / router["unit"])  # (its watchdog alive; smg's environment reads empty)
    st = demo.status()
    d = next(r for r in st["roles"] if r["name"] == "decode")
    assert (d["state"], d["main_pid"], d["supervised"]) == ("active", dec["main_pid"], False), d
    r = demo.cli("down", str(demo.spec), "--yes")
    assert r.returncode == 0, r.stderr
    assert f"stopped {router['unit']}'s processes" in r.stderr and f"stopped {dec['unit']}" in r.stderr, r.stderr
    assert process_gone(dec["main_pid"]) and process_gone(router["main_pid"]) and demo.pids() == []


def test_down_stops_a_role_whose_folder_holds_only_its_unit_file(demo):
    # (every file but unit.json deleted, logs too: status read the role inactive, "another process on its port", and
    # down said "was not running" and left it serving)
    demo.apply()
    pre = next(r for r in demo.status()["roles"] if r["name"] == "prefill")
    folder = demo.state / "supervisor" / "services" / pre["unit"]
    for f in folder.iterdir():
        if f.name != "unit.json":
            f.unlink()
    st = demo.status()
    p = next(r for r in st["roles"] if r["name"] == "prefill")
    assert (p["state"], p["health"], p["port_orphaned"]) == ("inactive", 200, True), p
    r = demo.cli("down", str(demo.spec), "--yes")
    assert r.returncode == 0, r.stderr
    assert f"stopped {pre['unit']}'s processes" in r.stderr, r.stderr
    assert process_gone(pre["main_pid"]) and demo.pids() == []
    # in its turn, after the router and decode (helper-100: it was stopped first, the router still routing to it), and
    # not then said to have not been running
    router, dec = st["router"]["unit"], next(x["unit"] for x in st["roles"] if x["name"] == "decode")
    assert r.stderr.index(f"stopping {router}") < r.stderr.index(f"stopping {dec}") < r.stderr.index(
        f"stopped {pre['unit']}'s processes"), r.stderr
    assert f"{pre['unit']} was not running" not in r.stderr, r.stderr


def test_a_damaged_unit_file_is_refused_before_anything_and_apply_mends_it_once_moved_aside(demo):
    # (helper-100: a unit.json overwritten with garbage read as "files gone": apply stopped the serving decode, then
    # failed at decode_up, "not written by pdctl: refusing to overwrite it", and left it down)
    demo.apply()
    st = demo.status()
    dec = next(r for r in st["roles"] if r["name"] == "decode")
    path = demo.state / "supervisor" / "services" / dec["unit"] / "unit.json"
    path.write_text("{garbage")
    before = demo.pids()
    st = demo.status()
    assert st["unit_files_not_pdctls"] == [str(path)] and st["missing_units"] == [], st
    plan = demo.cli("plan", str(demo.spec), "--json")
    assert str(path) in (json.loads(plan.stdout)["binds_unusable"] or ""), plan.stdout
    r = demo.cli("apply", str(demo.spec))
    assert r.returncode == 3 and "unit files that pdctl did not write as they stand" in r.stderr, r.stderr
    assert "nothing was started or changed" in r.stderr and "mv FILE FILE.bad" in r.stderr, r.stderr
    assert demo.pids() == before  # the decode serving before it still serves
    path.rename(path.with_name("unit.json.bad"))
    r = demo.cli("apply", str(demo.spec))
    assert r.returncode == 0, r.stderr
    assert process_gone(dec["main_pid"]) and demo.status()["healthy"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_just_after_the_apply_finished_does_not_make_it_an_interruption(demo, sig):
    # (Ctrl-C as the apply printed its last line: exit 130 and no word, after apply_done and a journalled apply-done)
    p, events, err = _json_apply_signalled(demo, sig, at=("apply_done", None))
    assert events[-1]["kind"] == "apply_done" and "apply_interrupted" not in [e["kind"] for e in events], events
    assert p.returncode == 0, (p.returncode, err)
    assert demo.status()["healthy"]
    demo.cli("down", str(demo.spec), "--yes")


def test_apply_stops_a_role_whose_supervisor_folder_was_removed_and_starts_it_again(demo):
    # (apply waited 225 s for "this deployment's previous processes" to let go of decode's port, which nothing had asked
    # them to, then failed; down stopped them)
    import shutil

    demo.apply()
    dec = next(r for r in demo.status()["roles"] if r["name"] == "decode")
    shutil.rmtree(demo.state / "supervisor" / "services" / dec["unit"])
    # status and plan say whose the answers are and what is missing (they said "this deployment's own process, applied
    # another way: it runs under state directory <this one>", hinted at another --state-dir, and called the removed
    # unit file "edited")
    st = demo.status()
    d = next(r for r in st["roles"] if r["name"] == "decode")
    assert (d["port_orphaned"], d["port_applied_elsewhere"], d["port_held_for"]) == (True, None, None), d
    assert st["missing_units"] == [dec["unit"]] and st["edited_units"] == [], st
    r = demo.cli("status", str(demo.spec))
    assert "(from this deployment's own process, whose supervisor's files are gone)" in r.stdout, r.stdout
    assert f"{dec['unit']}: its files are gone" in r.stdout and "applied another way" not in r.stdout, r.stdout
    r = demo.cli("plan", str(demo.spec))
    assert r.returncode == 2 and f"{dec['unit']}'s files are gone" in r.stdout and "edited" not in r.stdout, r.stdout
    t0 = time.monotonic()
    r = demo.cli("apply", str(demo.spec))
    assert r.returncode == 0, r.stderr
    assert f"stopped {dec['unit']}'s processes" in r.stderr and "its files were gone" in r.stderr, r.stderr
    assert time.monotonic() - t0 < 120 and process_gone(dec["main_pid"])
    st = demo.status()
    assert st["healthy"] and next(x for x in st["roles"] if x["name"] == "decode")["main_pid"] != dec["main_pid"]


def test_chat_talks_to_the_router_that_runs_after_a_confirmed_move(demo):
    # The router was moved by a confirmed topology change applied from another spec: chat with the original spec
    # reaches the router that runs (as `pdctl status` reports it) and says the spec differs, instead of refusing.
    from harness.sim import free_ports

    demo.apply()
    moved = copy.deepcopy(demo.dict)
    moved["router"]["port"] = free_ports(1)[0]
    spec2 = demo.write(moved, "moved.toml")
    plan_id = service.plan_spec(demo.load(spec2)).plan_id
    demo.apply(spec2, confirm=plan_id)
    r = demo.cli("chat", str(demo.spec), "hello", timeout=120)
    assert r.returncode == ExitCode.OK, r.stderr
    assert "runs other settings than this spec's" in r.stderr
    assert json.loads(r.stdout)["choices"][0]["message"]["role"] == "assistant"
    # A served name in the spec not yet applied: chat asks for the name what runs serves (the router knows no other)
    renamed = copy.deepcopy(demo.dict)
    renamed["model"]["served_name"] = "not-applied"
    r = demo.cli("chat", str(demo.write(renamed, "renamed.toml")), "hello", "--timeout", "60", timeout=120)
    assert r.returncode == ExitCode.OK, r.stderr
    assert json.loads(r.stdout)["model"] == demo.dict["model"]["served_name"]


def test_chat_on_a_deployment_not_deployed_frozen_or_down_says_so(demo):
    # Nothing applied, and something else answers on the spec's router port (another deployment's router): chat
    # refuses, naming the state directory, instead of printing that other server's answer with exit 0.
    import http.server
    import threading

    class Answers(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"choices": []}')

        def log_message(self, *args) -> None:  # noqa: ANN002
            pass

    other = http.server.HTTPServer(("127.0.0.1", demo.ports["router"]), Answers)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        r = demo.cli("chat", str(demo.spec), timeout=60)
    finally:
        other.shutdown()
        other.server_close()
    assert r.returncode == ExitCode.ERROR and r.stdout == "", (r.stdout, r.stderr)
    assert f"deployment {demo.name!r} is not deployed (nothing recorded in {demo.state})" in r.stderr, r.stderr
    assert f"127.0.0.1:{demo.ports['router']}" in r.stderr and f"\n  hint: `pdctl apply {demo.spec}` first" in r.stderr
    # Applied, its router frozen: chat gives up after --timeout and says so (it waited 120 s, silent)
    demo.apply()
    router_pid = demo.status()["router"]["main_pid"]
    os.kill(router_pid, signal.SIGSTOP)  # accepts connections (the kernel does), answers nothing
    try:
        r = demo.cli("chat", str(demo.spec), "--timeout", "1", timeout=60)
    finally:
        os.kill(router_pid, signal.SIGCONT)
    assert r.returncode == ExitCode.ERROR and "no answer within 1 s (--timeout)" in r.stderr, r.stderr
    # Its router stopped: the connection error names the URL and points at `pdctl status`.
    unit = f"pdctl-{demo.name}-router.service"
    from pdctl.statemachine.service import build_context, deployment_host

    host = deployment_host(demo.load().deployment)
    try:
        build_context(demo.load(), host=host).manager.stop(unit)
    finally:
        host.close()
    r = demo.cli("chat", str(demo.spec), timeout=60)
    assert r.returncode == ExitCode.ERROR, r.stderr
    assert f"127.0.0.1:{demo.ports['router']}/v1/chat/completions" in r.stderr
    assert "is the deployment up? `pdctl status" in r.stderr
    assert r.stdout == ""


class _StopAfterFirstUnit:
    """A down's sink that interrupts it (as Ctrl-C would) once it has stopped its first unit (the router)."""

    def emit(self, event) -> None:  # noqa: ANN001
        if event.kind == "info" and event.message.startswith("stopped "):
            raise KeyboardInterrupt


def test_status_tells_a_down_that_did_not_finish_and_what_finishes_it(demo):
    # (status said only "NOT healthy" after an interrupted down: nothing said that a down had stopped half of it)
    from pdctl.console.cli import _status_text
    from pdctl.statemachine import service

    demo.apply()
    with pytest.raises(KeyboardInterrupt):
        service.down(demo.load(), sink=_StopAfterFirstUnit())
    st = demo.status()
    assert st["router"]["state"] == "inactive" and all(r["state"] == "active" for r in st["roles"]), st
    assert st["unfinished_down"]["event"] == "down-interrupted" and not st["healthy"]
    # the steps about the stopped router no longer say done (its journal still does until a down finishes)
    assert st["steps"]["kv_link_verified"]["status"] == "done", st["steps"]
    for step in ("router_exposed", "parsers_configured"):
        assert st["steps"][step]["status"] == "pending", st["steps"]
        assert st["steps"][step]["summary"].startswith("its units were stopped by a `pdctl down` that was interrupted")
    assert st["reached"] == "kv_link_verified", st["reached"]
    head = _status_text(st).splitlines()[0]
    assert "NOT healthy" in head and "[a `pdctl down` was interrupted at " in head, head
    assert "`pdctl down` again finishes it, `pdctl apply` brings the deployment back]" in head
    # An apply brings it back, and the note goes: the apply is the newer word
    assert demo.cli("apply", str(demo.spec)).returncode == 0
    st = demo.status()
    assert st["healthy"] and st["unfinished_down"] is None and "pdctl down" not in _status_text(st).splitlines()[0]
    # A down killed outright (SIGKILL, a reboot) leaves "down-started" last and no lock held
    demo.load().journal.audit("down-started", serial=st["serial"])
    head = _status_text(demo.status()).splitlines()[0]
    assert "[a `pdctl down` was killed before it finished at " in head, head
    # A down that failed says its error, not that down again finishes it (it may have been refused, stopping nothing)
    demo.load().journal.audit("down-failed", error="HostError: nothing of it is installed here")
    head = _status_text(demo.status()).splitlines()[0]
    assert "[the last `pdctl down` failed at " in head and ": HostError: nothing of it is installed here]" in head, head
    # ...on the header's one line, its hint left out (it was crammed inside the brackets, a line break and all)
    demo.load().journal.audit("down-failed", error="HostError: cannot connect\n  hint: is sshd running there?")
    head = _status_text(demo.status()).splitlines()[0]
    assert head.endswith(": HostError: cannot connect …]"), head
    # Finished by a second down: nothing recorded, nothing running, nothing to say about the first
    assert demo.cli("down", str(demo.spec), "--yes").returncode == 0
    st = demo.status()
    assert st["unfinished_down"] is None and not st["deployed"], st
    assert _status_text(st).splitlines()[0].endswith("not deployed (`pdctl plan` shows what apply would start)")


def test_the_last_audit_record_of_a_kind_is_read_from_the_logs_tail(tmp_path):
    from pdctl.statemachine.journal import Journal

    j = Journal(tmp_path, "d")
    assert j.last_audit({"down-started"}) is None  # no log yet
    j.audit("down-started")
    for i in range(100):  # ~40 KB: past a 4 KB tail, inside the default 64 KB
        j.audit("plan", n=i, pad="x" * 200)
    assert j.last_audit({"down-started"}, tail_bytes=4096) is None
    assert j.last_audit({"down-started"})["event"] == "down-started"
    assert j.last_audit({"plan"}, tail_bytes=4096)["n"] == 99
    with j.audit_path.open("a") as f:
        f.write('{"event": "down-do')  # torn by a kill mid-append
    assert j.last_audit({"plan", "down-done"})["n"] == 99


def test_an_apply_after_an_interrupted_down_waits_for_the_router_still_stopping(demo):
    # (the router's unit was still stopping it, "deactivating", when the next apply ran: its PID was called another
    # deployment's at router_exposed, "cannot start, its ports are taken", and the apply failed)
    demo.apply()
    router_pid = demo.status()["router"]["main_pid"]
    os.kill(router_pid, signal.SIGSTOP)  # it cannot act on the SIGTERM its unit sends: the stop lasts
    env = {**os.environ, "PDCTL_STATE_DIR": str(demo.state)}
    down = subprocess.Popen([sys.executable, "-m", "pdctl", "down", str(demo.spec), "--yes"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    apply = None
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and demo.status()["router"]["state"] != "deactivating":
            time.sleep(0.1)
        assert demo.status()["router"]["state"] == "deactivating"
        down.send_signal(signal.SIGTERM)
        assert down.wait(30) == 143
        apply = subprocess.Popen([sys.executable, "-m", "pdctl", "apply", str(demo.spec)], env=env,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        said = []
        for line in apply.stderr:  # bounded: the apply ends (or waits, saying so) well within the stop timeout
            said.append(line)
            if "waiting up to" in line and f"PID {router_pid}" in line:
                break
        assert any("waiting up to" in x for x in said), "".join(said)
        os.kill(router_pid, signal.SIGCONT)  # it exits on the SIGTERM it holds
        rest, _ = apply.communicate(timeout=120)
        assert apply.returncode == 0, "".join(said) + rest
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(router_pid, signal.SIGCONT)
        for p in (down, apply):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(10)
    st = demo.status()
    assert st["healthy"] and st["router"]["main_pid"] != router_pid, st


def test_a_router_whose_process_is_stopped_is_restarted_at_once_not_waited_for(demo):
    # (helper-108: a router under kill -STOP, left so by a down interrupted before it stopped the router: apply said
    # nothing for 126 s, waiting for the router to see its workers healthy, then restarted it)
    demo.apply()
    router_pid = demo.status()["router"]["main_pid"]
    stop_process(router_pid)
    sink = ListSink()
    try:
        demo.apply(sink=sink)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(router_pid, signal.SIGCONT)
    said = [e.message for e in sink.events]
    assert any(f"its main process (PID {router_pid}) is stopped" in m and "restarting it" in m for m in said), said
    assert not any("waiting up to" in m for m in said), said
    st = demo.status()
    assert st["healthy"] and st["router"]["main_pid"] not in (None, router_pid), st


def test_a_server_whose_process_is_stopped_is_named_by_status_and_restarted_without_probing_it(demo, monkeypatch):
    # (helper-109: status said only "health down" of a decode under kill -STOP; apply restarted it after its health
    # probes each waited out their timeout against the frozen server, 10 s, and the stand-in then ignored the SIGTERM
    # it took on another thread until the SIGKILL 120 s later)
    demo.apply()
    dec = next(r for r in demo.status()["roles"] if r["name"] == "decode")
    stop_process(dec["main_pid"])
    try:
        st = demo.status()
        d = next(r for r in st["roles"] if r["name"] == "decode")
        assert d["main_stopped"] and not st["healthy"], d
        r = demo.cli("status", str(demo.spec))
        assert f"its main process is stopped (kill -STOP? a debugger?)" in r.stdout, r.stdout
        assert f"`kill -CONT {dec['main_pid']}` resumes it, or `pdctl apply` restarts it" in r.stdout, r.stdout
        # (helper-110: plan said "No changes", exit 0, and apply then restarted it)
        r = demo.cli("plan", str(demo.spec))
        assert r.returncode == ExitCode.CHANGES, (r.stdout, r.stderr)
        assert f"decode's main process (PID {dec['main_pid']}) is stopped (kill -STOP?): apply restarts it" in r.stdout
        from pdctl.statemachine import probes

        health = probes.health

        def not_the_frozen_one(client, url, *a, **k):  # noqa: ANN001, ANN002, ANN003
            assert url != f"http://127.0.0.1:{demo.ports['decode']}" or not process_stopped_now(dec["main_pid"]), \
                "probed a server whose process is stopped"
            return health(client, url, *a, **k)

        monkeypatch.setattr(probes, "health", not_the_frozen_one)
        demo.apply()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(dec["main_pid"], signal.SIGCONT)
    monkeypatch.undo()
    st = demo.status()
    assert st["healthy"] and next(r for r in st["roles"] if r["name"] == "decode")["main_pid"] != dec["main_pid"], st
    assert process_gone(dec["main_pid"])  # (its SIGTERM ended it: no SIGKILL after the stop timeout was needed)


def test_a_port_taken_while_a_role_starts_fails_the_step_at_once_naming_the_holder(demo):
    # (helper-109: a process bound decode's new port just after apply checked it: decode_up failed only after 38 s,
    # three starts and "start limit hit", with a generic hint)
    from harness.sim import free_ports

    demo.apply()
    port = free_ports(1)[0]
    d = copy.deepcopy(demo.dict)
    d["decode"][0]["port"] = port
    moved = demo.write(d, "moved.toml")
    squatter = _socket.socket()
    squatter.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)

    class TakeThePort(ListSink):
        def emit(self, event) -> None:  # noqa: ANN001
            super().emit(event)
            if event.message.startswith(("restarting", "starting")) and "-decode." in event.message \
                    and squatter.getsockname()[1] == 0:  # (after the checks, before its server binds)
                squatter.bind(("127.0.0.1", port))
                squatter.listen()

    try:
        with pytest.raises(ApplyFailed) as e:
            demo.apply(moved, sink=TakeThePort())
    finally:
        squatter.close()
    assert e.value.step == "decode_up", e.value
    assert e.value.message.startswith("decode: its server could not bind its port while starting (address already in "
                                      f"use), taken meanwhile: port {port}"), e.value.message
    assert f"PID {os.getpid()}" in e.value.message, e.value.message
    demo.apply(moved)  # the port free again: it applies
    assert service.status(demo.load(moved))["healthy"]


def process_stopped_now(pid: int) -> bool:
    from pdctl.statemachine.hosts import LocalHost
    from pdctl.units import process_stopped

    return process_stopped(LocalHost(), pid)


def _connections_to(ports: set[int]) -> list[tuple[int, int]]:
    """This process's TCP connections (local port, remote port) to one of *ports* on loopback, from proc(5)."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith("socket:["):
                mine.add(link[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table) as f:
            for line in list(f)[1:]:
                cols = line.split()
                local, remote, inode = int(cols[1].rsplit(":", 1)[1], 16), int(cols[2].rsplit(":", 1)[1], 16), cols[9]
                if inode in mine and remote in ports and cols[3] != "0A":  # (0A: LISTEN)
                    out.append((local, remote))
    return out


def test_apply_and_status_in_process_close_the_connections_they_opened(demo):
    # (the console runs apply in-process: its HTTP client stayed open until garbage collection, its kept-alive
    # connections holding a router being stopped in smg's graceful shutdown, and each SSH apply left a connection)
    ports = set(demo.ports.values())
    demo.apply()
    assert _connections_to(ports) == []
    assert demo.status()["healthy"]
    assert _connections_to(ports) == []


def test_a_router_executable_missing_on_the_host_is_refused_before_anything_changes(demo):
    # (validate and plan passed it; apply stopped the running router, then failed to exec the new one: the
    # deployment's exposed port went down)
    demo.apply()
    before = demo.pids()
    router_pid = demo.status()["router"]["main_pid"]
    spec = demo.write({**demo.dict, "router": {**demo.dict["router"], "executable": "/nonexistent/smg"}}, "exe.toml")
    # plan warns of it in apply's words (it listed the setting's change only: helper-99)
    plan = demo.cli("plan", str(spec), "--json")
    assert "router.executable = '/nonexistent/smg' is not an executable file on host" in (
        json.loads(plan.stdout)["binds_unusable"] or ""), plan.stdout
    r = demo.cli("apply", str(spec))
    assert r.returncode == 3, r.stderr
    assert "router.executable = '/nonexistent/smg' is not an executable file on host" in r.stderr, r.stderr
    assert "nothing was started or changed" in r.stderr
    assert demo.pids() == before and demo.status()["router"]["main_pid"] == router_pid
    # a file that exists but cannot run, or a directory: refused the same way
    text = demo.tmp / "smg.txt"
    text.write_text("not a program")
    for path in (text, demo.tmp):
        spec = demo.write({**demo.dict, "router": {**demo.dict["router"], "executable": str(path)}}, "exe2.toml")
        r = demo.cli("apply", str(spec))
        assert r.returncode == 3 and f"router.executable = '{path}' is not an executable file" in r.stderr, r.stderr
        assert demo.pids() == before
    assert demo.load().journal.audit_records()[-1]["event"] == "apply-refused"


def test_a_new_served_model_name_restarts_the_router_which_registered_the_old_one(demo):
    # (under the process supervisor only the servers restarted: smg kept their workers under the old model id, the
    # apply failed at parsers_configured with "No prefill workers available", and no later apply could mend it)
    from pdctl.statemachine.plan import make_plan
    from pdctl.statemachine.topology import topology_of

    demo.apply()
    router_pid = demo.status()["router"]["main_pid"]
    renamed = copy.deepcopy(demo.dict)
    renamed["model"]["served_name"] = "dsv4-other"
    spec = demo.write(renamed, "renamed.toml")
    plan = make_plan(demo.load().journal.read().deployed, topology_of(demo.load(spec).deployment))
    assert sorted(plan.restarts()) == ["decode", "prefill", "router"]
    r = demo.cli("apply", str(spec))
    assert r.returncode == 0, r.stderr
    st = service.status(demo.load(spec))
    assert st["healthy"] and st["router"]["main_pid"] != router_pid
    assert {w["model_id"] for w in st["router"]["workers"]} == {"dsv4-other"}


@pytest.mark.parametrize("stopped", [True, False], ids=["after-the-stop", "before-the-stop"])
def test_an_apply_interrupted_inside_a_restart_names_the_unit_it_left_stopped(demo, monkeypatch, stopped):
    # Ctrl-C / SIGTERM while the router was being restarted (stopped, not yet started again): the event said "what
    # already runs stays as it is" while the deployment's only entry point was down. It names the unit instead, and
    # only where it does not run: interrupted before the stop reached it, the old router serves on and the event
    # had said it "was stopped for the restart"
    from pdctl.units import ProcessSupervisor

    demo.apply()
    d = copy.deepcopy(demo.dict)
    d["router"]["policy"] = "random" if d["router"].get("policy") != "random" else "round_robin"
    spec2 = demo.write(d, "policy.toml")
    real_restart = ProcessSupervisor.restart

    def interrupted_after_the_stop(self, name, **kw):  # noqa: ANN001, ANN202
        if not name.endswith("-router.service"):
            return real_restart(self, name, **kw)
        if stopped:
            self.stop(name)
        raise KeyboardInterrupt  # (as the CLI's signal handler raises it wherever the apply is)

    monkeypatch.setattr(ProcessSupervisor, "restart", interrupted_after_the_stop)
    events = []

    class Sink:
        def emit(self, event) -> None:  # noqa: ANN001
            events.append(event)

    with pytest.raises(KeyboardInterrupt):
        demo.apply(spec2, sink=Sink())
    router = service.unit_names(service.topology_of(demo.load().deployment))["router"]
    last = events[-1]
    assert last.kind == "apply_interrupted" and last.step == "router_exposed", last
    assert last.data["stopped"] == ([router] if stopped else [])
    assert (f"while restarting {router}: it was stopped for the restart and may not run now" in last.message) is stopped
    assert ("what already runs stays as it is" in last.message) is not stopped
    assert demo.load().journal.audit_records()[-1]["stopped"] == ([router] if stopped else [])
    assert (service.status(demo.load(spec2))["router"]["state"] == "active") is not stopped
    monkeypatch.setattr(ProcessSupervisor, "restart", real_restart)
    assert demo.apply(spec2).state == "parsers_configured"  # apply again starts it and converges


def test_apply_json_plan_event_carries_the_specs_warnings(make_demo):
    # (only stderr said them; a --json stream had no warning at all)
    class CancelAtPlan:
        def __init__(self) -> None:
            self.plan = None

        def emit(self, event) -> None:  # noqa: ANN001
            if event.kind == "plan":
                self.plan = event
                raise _Cancelled("cancelled")

    demo = make_demo(lambda d: d["parsers"].update(tool_call_parser="deepseekv31"))  # not V4's: a warning
    warned = [w.to_json() for w in demo.load().warnings]
    sink = CancelAtPlan()
    with pytest.raises(_Cancelled):
        demo.apply(sink=sink)
    assert warned and sink.plan.data["warnings"] == warned


def test_a_repair_that_starts_the_router_again_says_so(demo):
    # (a failed or stopped server's start was announced, "starting X (it was failed)"; the router's was silent)
    from pdctl.statemachine import launch
    from pdctl.statemachine.events import ListSink
    from pdctl.statemachine.service import deployment_host, unit_names
    from pdctl.statemachine.topology import topology_of

    demo.apply()
    loaded = demo.load()
    router = unit_names(topology_of(loaded.deployment))["router"]
    launch.manager_for(loaded.deployment, deployment_host(loaded.deployment), state_dir=str(demo.state)).stop(router)
    sink = ListSink()
    assert demo.apply(sink=sink).state == "parsers_configured"
    said = [e.message for e in sink.events if e.kind == "info" and e.step == "router_exposed"]
    assert f"starting {router}" in said, said


def test_status_json_keeps_its_shape_when_the_router_and_a_role_are_down(demo):
    # A router that does not answer lost its workers and stats keys and gained error; a role that does not answer had
    # no key saying why. Scripts read the same keys either way.
    from pdctl.statemachine import launch
    from pdctl.statemachine.service import deployment_host, unit_names
    from pdctl.statemachine.topology import topology_of

    demo.apply()
    up = json.loads(demo.cli("status", str(demo.spec), "--json").stdout)
    assert up["router"]["error"] is None and up["router"]["workers"] and all(r["error"] is None for r in up["roles"])
    loaded = demo.load()
    names = unit_names(topology_of(loaded.deployment))
    manager = launch.manager_for(loaded.deployment, deployment_host(loaded.deployment), state_dir=str(demo.state))
    manager.stop(names["router"])
    manager.stop(names["decode"])
    down = json.loads(demo.cli("status", str(demo.spec), "--json").stdout)
    assert set(down["router"]) == set(up["router"]), (set(down["router"]) ^ set(up["router"]))
    assert down["router"]["workers"] is None and down["router"]["error"], down["router"]
    decode = next(r for r in down["roles"] if r["name"] == "decode")
    assert set(decode) == set(up["roles"][1]) and decode["health"] == 0
    assert decode["error"] == f"GET {decode['url']}/health: nothing answered (connection refused, reset or timed out)"


def test_chat_that_the_router_answers_with_an_error_says_so_on_stderr(demo):
    # (exit 1 with the error body on stdout and nothing on stderr: a terminal showed a JSON body and no failure)
    from pdctl.statemachine import launch
    from pdctl.statemachine.service import deployment_host, unit_names
    from pdctl.statemachine.topology import topology_of

    demo.apply()
    loaded = demo.load()
    decode = unit_names(topology_of(loaded.deployment))["decode"]
    launch.manager_for(loaded.deployment, deployment_host(loaded.deployment), state_dir=str(demo.state)).stop(decode)
    r = demo.cli("chat", str(demo.spec), "hello", "--timeout", "60", timeout=120)
    assert r.returncode == ExitCode.ERROR, (r.stdout, r.stderr)
    assert r.stdout.strip() and "answered HTTP " in r.stderr and "(its body is on stdout)" in r.stderr, r.stderr


def test_status_says_what_a_role_whose_watchdog_and_server_died_needs(demo):
    # "failed (watchdog-gone)" stood alone: neither what it means nor what brings the role back
    demo.apply()
    unit = f"pdctl-{demo.name}-decode.service"
    folder = Path(demo.state) / "supervisor" / "services" / unit
    watchdog, main = (int((folder / f).read_text().split()[0]) for f in ("watchdog.pid", "main.pid"))
    os.kill(watchdog, signal.SIGKILL)
    os.kill(main, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while any(not process_gone(p) for p in (watchdog, main)):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    deadline = time.monotonic() + 20
    while True:  # (as soon as both are gone; polled, so that a slow /proc under load cannot make it flaky)
        r = demo.cli("status", str(demo.spec))
        line = next(x for x in r.stdout.splitlines() if x.strip().startswith("decode"))
        if "failed (watchdog-gone)" in line or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert "failed (watchdog-gone)" in line and "nothing runs or restarts it" in line, r.stdout + r.stderr
    assert "`pdctl apply` starts it" in line
    assert demo.apply().state == "parsers_configured"


def test_status_marks_the_proofs_taken_before_a_role_restarted_after_a_crash(demo):
    # kill -9 of the decode server: its supervisor restarts it and status said "healthy" with the old proofs (the KV
    # link proven on a process that is gone) and nothing but "restarts 1" to tell
    demo.apply()
    unit = f"pdctl-{demo.name}-decode.service"
    before = demo.status()
    old = next(r for r in before["roles"] if r["name"] == "decode")["main_pid"]
    assert all(not s["restarted_since"] for s in before["steps"].values()), before["steps"]
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while True:
        st = demo.status()
        dec = next(r for r in st["roles"] if r["name"] == "decode")
        if dec["main_pid"] not in (None, old) and dec["health"] == 200:
            break
        assert time.monotonic() < deadline, dec
        time.sleep(0.5)
    stale = {name for name, s in st["steps"].items() if unit in s["restarted_since"]}
    assert stale == {"decode_up", "kv_link_verified", "parsers_configured"}, st["steps"]
    r = demo.cli("status", str(demo.spec))
    line = next(x for x in r.stdout.splitlines() if x.strip().startswith("kv_link_verified"))
    assert f"[proven before {unit} restarted" in line and "`pdctl apply` proves it again" in line, r.stdout
    assert demo.apply().state == "parsers_configured"
    assert all(not s["restarted_since"] for s in demo.status()["steps"].values())


def test_apply_failed_says_whether_the_apply_had_begun(demo):
    # (an apply_failed event read the same whether nothing was changed, a refusal before the first step, or steps had
    # run: only a missing apply_started event told a script which)
    d = copy.deepcopy(demo.dict)
    d["router"]["executable"] = "/bin/false"  # (an executable file: the check before the first step passes it)
    r = demo.cli("apply", str(demo.write(d, "router-false.toml")), "--json")
    assert r.returncode == ExitCode.STEP_FAILED, r.stderr
    events = [json.loads(x) for x in r.stdout.splitlines()]
    kinds = [e["kind"] for e in events]
    assert "apply_started" in kinds and kinds[-1] == "apply_failed", kinds
    assert events[-1]["step"] == "router_exposed" and events[-1]["data"]["started"] is True, events[-1]


def test_a_role_left_spawning_without_a_supervisor_is_started_by_the_next_apply(demo):
    # (an apply cut right after it spawned decode's watchdog, its SSH connection lost, left the unit "activating
    # (spawning)" with no supervisor: the next apply waited for it, then failed at decode_up with empty log lines and
    # a hint about GPUs and model paths, until a later status called it failed (watchdog-gone))
    demo.apply()
    unit = f"pdctl-{demo.name}-decode.service"
    d = demo.load().journal.dir / "supervisor" / "services" / unit
    dec = next(r for r in demo.status()["roles"] if r["name"] == "decode")
    watchdog = int((d / "watchdog.pid").read_text())
    for pid in (watchdog, dec["main_pid"]):  # (both started by this test's apply)
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(not process_gone(p) for p in (watchdog, dec["main_pid"])) and time.monotonic() < deadline:
        time.sleep(0.1)
    (d / "status.json").write_text(json.dumps({"state": "activating", "sub": "spawning", "updated": time.time()}))
    events = []

    class Sink:
        def emit(self, event) -> None:  # noqa: ANN001
            events.append(event)

    result = demo.apply(sink=Sink())
    assert result.state == "parsers_configured"
    said = [e.message for e in events if e.step == "decode_up"]
    assert any("its supervisor never came up: starting it" in m for m in said), said
    st = demo.status()
    assert st["healthy"], st


def test_a_down_cut_short_says_it_did_not_finish(demo, monkeypatch, capsys):
    # (a down whose SSH connection dropped after it stopped the router printed only "cannot connect …": nothing said
    # that the router stayed stopped and the rest still ran)
    from pdctl.console import cli
    from pdctl.units._process import ProcessSupervisor

    demo.apply()
    real, calls = ProcessSupervisor.stop, []

    def stop(self, name, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls.append(name)
        if len(calls) == 2:
            raise HostError("ssh local: the session ended before the command did", host="local",
                            hint="is host local up and its sshd answering?")
        return real(self, name, *a, **k)

    monkeypatch.setattr(ProcessSupervisor, "stop", stop)
    with pytest.raises(SystemExit) as e:
        cli.main(["down", str(demo.spec), "--yes", "--state-dir", str(demo.state)])
    err = capsys.readouterr().err
    assert e.value.code == ExitCode.ERROR, err
    assert f"stopped pdctl-{demo.name}-router.service" in err, err
    assert (f"the down did not finish: what it stopped stays stopped; `pdctl down {demo.spec} --state-dir {demo.state}"
            " --yes` again finishes it") in err, err
    monkeypatch.setattr(ProcessSupervisor, "stop", real)
    r = demo.cli("down", str(demo.spec), "--yes")
    assert r.returncode == 0 and demo.pids() == [], r.stderr


def test_a_unit_file_edited_outside_pdctl_is_drift_that_apply_writes_back(demo):
    # (sed on a unit file, or `systemctl edit --full`: plan said "No changes", apply "already satisfied" and left it,
    # and a crash or reboot then started the edited definition while status said healthy)
    demo.apply()
    unit = service.unit_names(service.topology_of(demo.load().deployment))["prefill"]
    path = demo.state / "supervisor" / "services" / unit / "unit.json"
    written = path.read_text()
    assert "--context-length" in written
    data = json.loads(written)
    argv = data["service"]["argv"]
    argv[argv.index("--context-length") + 1] = "4096"
    path.write_text(json.dumps(data))
    pid = demo.status()["roles"][0]["main_pid"]
    st = demo.status()
    assert st["edited_units"] == [unit] and st["healthy"], st["edited_units"]
    loaded = demo.load()
    recorded = loaded.journal.read()
    why = service.plan_unsettled(loaded, recorded, service.plan_spec(loaded, recorded))
    assert why.kind == "drift" and f"{unit}'s unit file differs from what pdctl writes" in why.text, why
    r = demo.cli("status", str(demo.spec))
    assert f"{unit}: its unit file differs from what pdctl writes (edited outside pdctl?)" in r.stdout, r.stdout
    # (under the process supervisor a crash restart runs what its watchdog started with, not the edit: helper-99)
    assert "its supervisor keeps the unit file it started with" in r.stdout and "crash or reboot" not in r.stdout
    sink = ListSink()
    assert demo.apply(sink=sink).state == "parsers_configured"
    assert path.read_text() == written  # written back, and the process, which serves as specified, kept
    assert any(f"{unit}'s unit file differs from what pdctl writes (edited outside pdctl?): writing it back" == e.message
               for e in sink.events), [e.message for e in sink.events]
    st = demo.status()
    assert st["edited_units"] == [] and st["healthy"] and {r["main_pid"] for r in st["roles"]} >= {pid}
    recorded = loaded.journal.read()
    assert not service.plan_unsettled(loaded, recorded, service.plan_spec(loaded, recorded)).text


def test_a_service_manager_change_is_refused_before_anything_and_down_stops_what_runs_as_recorded(demo):
    # (plan offered it as a restart, apply refused it only at its port check, "this deployment's own processes,
    # applied another way", and `pdctl down` of the edited spec found "nothing installed here" and left a failure)
    demo.apply()
    pids = demo.pids()
    d = copy.deepcopy(demo.dict)
    d["service_manager"] = "systemd-user"
    spec = demo.write(d, "user.toml")
    with pytest.raises(ApplyFailed, match=r"service_manager: deployment '\S+' runs under process \(as recorded\) and "
                                          r"the spec asks systemd-user: pdctl does not move running units") as e:
        demo.apply(spec)
    assert "run `pdctl down` on this spec first (it stops them under process, as recorded)" in e.value.hint
    assert demo.pids() == pids
    loaded = demo.load(spec)
    refusal = service.host_warnings(loaded, loaded.journal.read())["binds_unusable"]
    assert refusal and "pdctl does not move running units between service managers" in refusal, refusal
    st = service.status(loaded)  # (read under the recorded manager: the roles run)
    assert st["healthy"] and {r["main_pid"] for r in st["roles"]} <= set(pids), st["roles"]
    r = demo.cli("down", str(spec), "--yes")
    assert r.returncode == 0, r.stderr
    assert demo.pids() == [] and loaded.journal.read().deployed is None
    assert loaded.journal.audit_records()[-1]["event"] == "down-done"  # (no failed down left on record)
