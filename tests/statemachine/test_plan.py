"""The plan: classes, actions, words, ids; the CLI's exit codes."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import tomllib

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from pdctl.statemachine.journal import Journal, JournalState
from pdctl.statemachine.plan import Plan, make_plan, plan_id_of, render_text
from pdctl.statemachine.spec import parse_spec
from pdctl.statemachine.topology import topology_of

from .specs import SEED, collapsed, seed_dict


def topo(d: dict):
    return topology_of(parse_spec(d))


def test_collapse_into_one_server_is_a_topology_change_said_in_words():
    seed = seed_dict()
    p = make_plan(topo(seed), topo(collapsed(seed)))
    assert p.cls == "topology" and p.requires_confirmation
    actions = {c.address: c.action for c in p.changes}
    assert actions["role.prefill"] == "delete"
    assert actions["role.decode"] == "delete"
    assert actions["router"] == "delete"
    assert actions["role.server"] == "create"
    assert "PD disaggregation → single server" in p.topology_changes
    text = render_text(p)
    assert "PD disaggregation → single server" in text
    assert "Plan: 1 to add, 0 to change, 4 to destroy." in text  # prefill, decode, kv link, router
    assert f"--confirm-topology {p.plan_id}" in text and "no --confirm-topology needed" not in text


def test_a_collapse_names_where_clients_now_connect():
    seed = seed_dict()
    seed["router"]["host"] = "127.0.0.1"
    p = make_plan(topo(seed), topo(collapsed(seed)))
    assert ("exposure router on 127.0.0.1:30001 → server 'server' on 0.0.0.0:30001 (every interface)"
            in p.topology_changes)
    assert "server 'server' on 0.0.0.0:30001 (every interface)" in render_text(p)


def _single(http_host: str, port: int = 30001, router: bool = False) -> dict:
    d = collapsed(seed_dict())
    d["server"][0].update(http_host=http_host, port=port)
    if router:
        d["router"] = {"host": "127.0.0.1", "port": 30002, "prometheus_port": 29000}
    return d


def test_opening_a_single_server_to_every_interface_needs_confirmation():
    # With no router, the single server's bind address and port are the deployment's exposure.
    p = make_plan(topo(_single("127.0.0.1")), topo(_single("0.0.0.0")))
    assert p.cls == "topology" and p.requires_confirmation
    assert p.topology_changes == (
        "exposure server 'server' on 127.0.0.1:30001 → server 'server' on 0.0.0.0:30001 (every interface)",)
    [change] = p.changes
    assert change.action == "replace" and [(a.path, a.cls) for a in change.changes] == [("http_host", "topology")]
    moved = make_plan(topo(_single("127.0.0.1")), topo(_single("127.0.0.1", port=30005)))
    assert moved.requires_confirmation
    assert moved.topology_changes == ("exposure server 'server' on 127.0.0.1:30001 → server 'server' on 127.0.0.1:30005",)


def test_every_interface_is_named_however_the_wildcard_is_written():
    for bind in ("::", "::0", "0:0:0:0:0:0:0:0"):
        p = make_plan(topo(_single("127.0.0.1")), topo(_single(bind)))
        assert p.requires_confirmation and p.topology_changes[0].endswith("(every interface)"), (bind, p.topology_changes)
    p = make_plan(topo(_single("127.0.0.1")), topo(_single("::1")))
    assert "every interface" not in p.topology_changes[0] and "[::1]:30001" in p.topology_changes[0]


def test_an_address_a_journal_recorded_as_typed_is_no_change_once_specs_read_it_canonical():
    # specs read IP literals canonical (::0 -> ::) since 2026-12-01; a journal from before holds them as typed
    d = seed_dict()
    d["prefill"][0]["http_host"] = "::"
    d["router"]["host"] = "::1"
    new = topo(d)
    typed = {"::": "0:0:0:0:0:0:0:0", "::1": "0:0::1"}
    old = new.model_copy(update={
        "roles": tuple(r.model_copy(update={"http_host": typed.get(r.http_host, r.http_host)}) for r in new.roles),
        "router": new.router.model_copy(update={"host": typed["::1"]}),
    })
    assert make_plan(old, new).changes == ()
    single = topo(_single("::"))
    assert make_plan(single.model_copy(update={"roles": (single.roles[0].model_copy(update={"http_host": "::0"}),)}),
                     single).changes == ()
    d["router"]["host"] = "::2"  # another address all the same
    assert make_plan(old, topo(d)).topology_changes == ("router exposure [0:0::1]:30001 → [::2]:30001",)


def test_a_server_behind_a_router_narrows_its_bind_address_without_confirmation_and_widens_it_with_one():
    # (widening was "disruptive" too: the engine then answered on every interface around the router, unconfirmed)
    p = make_plan(topo(_single("0.0.0.0", router=True)), topo(_single("127.0.0.1", router=True)))
    assert p.cls == "disruptive" and not p.requires_confirmation and p.topology_changes == ()
    p = make_plan(topo(_single("127.0.0.1", router=True)), topo(_single("0.0.0.0", router=True)))
    assert p.requires_confirmation and p.topology_changes == (
        "server 'server' reachable around the router: 127.0.0.1:30001 → 0.0.0.0:30001 (every interface)",)


def test_a_first_deployment_is_a_topology_plan_that_says_it_needs_no_confirmation():
    p = make_plan(None, topo(seed_dict()))
    assert p.cls == "topology" and not p.requires_confirmation
    text = render_text(p)
    assert "a first deployment" in text and "no --confirm-topology needed" in text
    assert "Topology changes (confirm" not in text


def test_router_host_only_change_is_topology_exposure():
    seed = seed_dict()
    local = copy.deepcopy(seed)
    local["router"]["host"] = "127.0.0.1"
    p = make_plan(topo(local), topo(seed))
    assert p.cls == "topology"
    assert [c.address for c in p.changes] == ["router"]
    assert p.topology_changes == ("router exposure 127.0.0.1:30001 → 0.0.0.0:30001 (every interface)",)
    assert p.changes[0].restarts == ("router",)


def test_parser_only_change_is_disruptive_and_restarts_prefill_and_decode():
    seed = seed_dict()
    other = copy.deepcopy(seed)
    other["parsers"]["tool_call_parser"] = "deepseekv32"
    p = make_plan(topo(seed), topo(other))
    assert p.cls == "disruptive" and not p.requires_confirmation
    # the router keeps running under either manager (its unit Wants= the servers): it sees the workers come back
    assert sorted(p.restarts()) == ["decode", "prefill"]
    assert all(c.action == "update" for c in p.changes)
    paths = {a.path for c in p.changes for a in c.changes}
    assert paths == {"settings.parsers.tool_call_parser"}
    assert "restarts: prefill\n" in render_text(p) and "router" not in p.restarts()
    seed["service_manager"] = other["service_manager"] = "process"
    assert sorted(make_plan(topo(seed), topo(other)).restarts()) == ["decode", "prefill"]


def test_a_numa_cpu_list_change_is_planned_as_the_restart_it_causes():
    # the unit's CPUAffinity= follows hosts.<h>.numa_cpus: apply restarts the role, so the plan must say so
    seed = seed_dict()
    other = copy.deepcopy(seed)
    other["hosts"]["local"]["numa_cpus"]["1"] = "32-63"
    p = make_plan(topo(seed), topo(other))
    assert p.cls == "disruptive" and not p.requires_confirmation
    assert p.restarts() == ["decode"]  # (the router keeps running: its unit Wants= decode, not Requires=)
    [change] = p.changes
    assert [(a.path, a.before, a.after) for a in change.changes] == [
        ("settings.numa_binding.cpus", "32-63,96-127", "32-63")]


def test_the_same_cpus_written_another_way_plan_nothing():
    seed = seed_dict()
    other = copy.deepcopy(seed)
    other["hosts"]["local"]["numa_cpus"]["0"] = "64-95, 0-15 16-31"  # the same CPUs as "0-31,64-95"
    assert not make_plan(topo(seed), topo(other)).has_changes


def test_a_gpu_numa_change_that_moves_a_role_to_another_node_is_planned():
    seed = seed_dict()
    for kind in ("prefill", "decode"):
        del seed[kind][0]["numa_node"]  # roles without numa_node follow their GPUs' node
    other = copy.deepcopy(seed)
    other["hosts"]["local"]["gpu_numa"] = [1, 1, 1, 1, 0, 0, 0, 0]
    p = make_plan(topo(seed), topo(other))
    assert sorted(p.restarts()) == ["decode", "prefill"]
    paths = {a.path for c in p.changes for a in c.changes}
    assert paths == {"settings.numa_binding.node", "settings.numa_binding.cpus"}


def test_a_journal_from_before_numa_binding_was_recorded_plans_no_restart_for_it():
    seed = seed_dict()
    old = topo(seed)
    legacy = old.model_copy(update={"roles": tuple(
        r.model_copy(update={"settings": {k: v for k, v in r.settings.items() if k != "numa_binding"}})
        for r in old.roles)})
    assert not make_plan(legacy, topo(copy.deepcopy(seed))).has_changes


def test_identical_spec_plans_nothing():
    seed = seed_dict()
    p = make_plan(topo(seed), topo(copy.deepcopy(seed)))
    assert not p.has_changes and p.cls is None
    assert "No changes" in render_text(p)


def test_gpu_set_change_replaces_the_role():
    seed = seed_dict()
    other = copy.deepcopy(seed)
    other["prefill"][0]["gpus"] = [0, 1]
    other["prefill"][0]["tp"] = 2
    p = make_plan(topo(seed), topo(other))
    (c,) = [c for c in p.changes if c.address == "role.prefill"]
    assert c.action == "replace" and c.cls == "topology"
    assert p.counts() == (1, 0, 1)


def test_transfer_backend_change_is_topology():
    seed = seed_dict()
    other = copy.deepcopy(seed)
    other["kv_transfer"]["backend"] = "mooncake"
    p = make_plan(topo(seed), topo(other))
    assert "KV transfer backend nixl → mooncake" in p.topology_changes


def test_console_setting_is_in_place():
    seed = seed_dict()
    other = copy.deepcopy(seed)
    other["console"] = {"refresh_s": 2.0}
    p = make_plan(topo(seed), topo(other))
    assert p.cls == "in_place" and p.restarts() == []


def test_first_deployment_needs_no_confirmation():
    p = make_plan(None, topo(seed_dict()))
    assert p.cls == "topology" and not p.requires_confirmation


def test_plan_round_trips_through_json():
    seed = seed_dict()
    p = make_plan(topo(seed), topo(collapsed(seed)), from_serial=7)
    again = Plan.model_validate_json(p.model_dump_json())
    assert again == p and again.plan_id == p.plan_id


def test_secrets_never_appear_in_the_plan():
    seed = seed_dict()
    seed["secrets"] = {"HF_TOKEN": "hf_supersecret"}
    other = copy.deepcopy(seed)
    other["secrets"] = {"HF_TOKEN": "hf_othersecret"}
    p = make_plan(topo(seed), topo(other))
    dumped = p.model_dump_json()
    assert p.has_changes and "supersecret" not in dumped and "othersecret" not in dumped


# --- property tests ------------------------------------------------------------------------------

_mutations = st.sampled_from(
    [
        ("parsers", "tool_call_parser", "deepseekv32"),
        ("router", "port", 30002),
        ("router", "policy", "round_robin"),
        ("model", "context_length", 65536),
        ("console", "refresh_s", 5.0),
        ("kv_transfer", "backend", "mooncake"),
    ]
)


def _mutate(d: dict, m) -> dict:
    d = copy.deepcopy(d)
    d.setdefault(m[0], {})[m[1]] = m[2]
    return d


@settings(max_examples=30, deadline=None)
@given(_mutations, st.booleans())
def test_plan_id_changes_whenever_either_side_changes(m, which_side):
    seed = seed_dict()
    base = plan_id_of(topo(seed), topo(seed))
    changed = _mutate(seed, m)
    other = plan_id_of(topo(changed), topo(seed)) if which_side else plan_id_of(topo(seed), topo(changed))
    assert other != base
    assert plan_id_of(None, topo(seed)) != base


def _toml_dump(d: dict, order: list[int]) -> str:
    """A minimal TOML writer that emits keys in a permuted order (tables after scalars)."""

    def val(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, list):
            return "[" + ", ".join(val(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{json.dumps(str(k))} = {val(x)}" for k, x in v.items()) + "}"
        return str(v)

    def perm(keys):
        keys = list(keys)
        return [keys[i % len(keys)] for i in order[: len(keys)]] if keys else keys

    lines: list[str] = []
    scalars = [k for k, v in d.items() if not isinstance(v, dict) and not (isinstance(v, list) and v and isinstance(v[0], dict))]
    keys = list(dict.fromkeys(perm(scalars) + scalars))
    for k in keys:
        lines.append(f"{k} = {val(d[k])}")
    for k, v in reversed(list(d.items())):
        if isinstance(v, dict):
            if k == "hosts":
                for hk, hv in v.items():
                    lines.append(f"[hosts.{hk}]")
                    for kk in reversed(list(hv)):
                        lines.append(f"{kk} = {val(hv[kk])}")
            else:
                lines.append(f"[{k}]")
                for kk in reversed(list(v)):
                    lines.append(f"{kk} = {val(v[kk])}")
        elif isinstance(v, list) and v and isinstance(v[0], dict):
            for item in v:
                lines.append(f"[[{k}]]")
                for kk in reversed(list(item)):
                    lines.append(f"{kk} = {val(item[kk])}")
    return "\n".join(lines) + "\n"


@settings(max_examples=25, deadline=None)
@given(st.permutations(list(range(8))))
def test_a_plan_is_unaffected_by_toml_key_order(order):
    seed = seed_dict()
    shuffled = tomllib.loads(_toml_dump(seed, order))
    assert shuffled == seed  # same content, different text
    deployed = topo(collapsed(seed))
    assert make_plan(deployed, topo(shuffled)) == make_plan(deployed, topo(seed))


# --- CLI -----------------------------------------------------------------------------------------


def _pdctl(*args, env=None, cwd=None):
    return subprocess.run([sys.executable, "-m", "pdctl", *args], capture_output=True, text=True, timeout=60, env=env,
                          cwd=cwd)


def test_cli_plan_exit_codes_and_json(tmp_path):
    sd = tmp_path / "state"
    d = seed_dict()
    d["service_manager"] = "process"  # a manager this machine has, so that plan can ask what runs
    seed = tmp_path / "seed.toml"
    seed.write_text(_toml_dump(d, list(range(8))))
    r = _pdctl("plan", str(seed), "--state-dir", str(sd))
    assert r.returncode == 2, r.stderr
    assert "Plan: 4 to add, 0 to change, 0 to destroy." in r.stdout
    # Record the seed as deployed, then plan the same spec: no changes, but nothing of it runs here, so apply has
    # work all the same: exit 2, said on stdout (and as a note on stderr)
    j = Journal(sd, "dsv4-flash")
    j.write(JournalState(name="dsv4-flash", deployed=topo(d)))
    r = _pdctl("plan", str(seed), "--state-dir", str(sd), "--json")
    assert r.returncode == 2 and "no longer serves as proven: prefill inactive" in r.stderr, r.stderr
    data = json.loads(r.stdout)
    assert data["changes"] == [] and data["from_serial"] == 1
    assert "no longer serves as proven: prefill inactive" in data["unsettled"]  # why exit 2, for scripts too
    # the journal's side and the spec's print alike (the journal sorts keys; so does the topology now)
    assert json.dumps(data["from_topology"]) == json.dumps(data["to_topology"])
    r = _pdctl("plan", str(seed), "--state-dir", str(sd))
    assert r.returncode == 2 and "No changes to what was recorded as deployed" in r.stdout
    assert "router inactive" in r.stdout and "matches the spec" not in r.stdout
    # the seed's systemd system manager, which this machine lacks: plan cannot tell what runs, and says so (exit 1)
    sd2 = tmp_path / "state2"
    Journal(sd2, "dsv4-flash").write(JournalState(name="dsv4-flash", deployed=topo(seed_dict())))
    r = _pdctl("plan", str(SEED), "--state-dir", str(sd2))
    assert r.returncode in (1, 2), r.stderr
    if r.returncode == 1:  # (a machine with a system manager answers instead: its units are inactive, exit 2)
        assert "cannot tell whether what was deployed still runs" in r.stderr and "systemd system manager" in r.stderr
    # The collapse, saved with -o.
    spec = tmp_path / "collapse.toml"
    spec.write_text(_toml_dump(collapsed(d), list(range(8))))
    out = tmp_path / "plan.json"
    r = _pdctl("plan", str(spec), "--state-dir", str(sd), "-o", str(out))
    assert r.returncode == 2
    assert "PD disaggregation → single server" in r.stdout
    saved = Plan.model_validate_json(out.read_text())
    assert saved.plan_id in r.stdout
    raw = json.loads(out.read_text())  # the derived class and counts too, as apply's plan event says them
    assert raw["class"] == "topology" == saved.cls and raw["counts"] == list(saved.counts())
    r = _pdctl("plan", str(spec), "--state-dir", str(sd), "--json")
    assert Plan.model_validate_json(r.stdout) == saved  # spec_path too: `plan --json > f; apply f` found no spec


def test_cli_plan_out_dash_is_stdout_and_a_plan_during_an_apply_says_one_runs(tmp_path):
    sd = tmp_path / "state"
    r = _pdctl("plan", str(SEED), "--state-dir", str(sd), "-o", "-", cwd=tmp_path)
    assert r.returncode == 2 and not (tmp_path / "-").exists()
    assert json.loads(r.stdout)["to_topology"]["name"] == "dsv4-flash" and json.loads(r.stdout)["unsettled"] is None
    assert json.loads(r.stdout)["spec_path"] == str(SEED.resolve())  # `apply` of what -o - printed finds its spec
    j = Journal(sd, "dsv4-flash")
    state = JournalState(name="dsv4-flash", deployed=topo(seed_dict()))
    state.target = topo(seed_dict())
    j.write(state)
    with j.lock("apply"):  # this process is the running apply
        r = _pdctl("plan", str(SEED), "--state-dir", str(sd))
        assert r.returncode == 2 and "a `pdctl apply` is running now" in r.stdout, r.stdout
        assert "did not finish" not in r.stdout + r.stderr
    r = _pdctl("plan", str(SEED), "--state-dir", str(sd), "--json")
    assert r.returncode == 2 and "did not finish" in json.loads(r.stdout)["unsettled"]


def test_a_full_disk_on_stdout_is_a_named_error_with_exit_1(tmp_path):
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "pdctl", "validate", str(SEED)], stdout=full, stderr=subprocess.PIPE,
                           text=True, timeout=60)
    assert r.returncode == 1
    assert r.stderr.startswith("error: <stdout>: No space left on device\n"), r.stderr
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr


def test_a_plan_without_an_env_secrets_variable_says_it_cannot_compare_it(tmp_path, monkeypatch):
    import os

    d = seed_dict()
    d["secrets"] = {"HF_TOKEN": "env:PDCTL_TEST_HF_TOKEN"}
    d["service_manager"] = "process"  # (status asks the manager: no systemd here)
    spec = tmp_path / "s.toml"
    spec.write_text(_toml_dump(d, list(range(8))))
    sd = tmp_path / "state"
    with_it = {**os.environ, "PDCTL_TEST_HF_TOKEN": "hf_abc"}
    monkeypatch.setenv("PDCTL_TEST_HF_TOKEN", "hf_abc")  # deployed with the secret set
    Journal(sd, "dsv4-flash").write(JournalState(name="dsv4-flash", deployed=topology_of(parse_spec(d))))
    monkeypatch.delenv("PDCTL_TEST_HF_TOKEN")
    without = {k: v for k, v in with_it.items() if k != "PDCTL_TEST_HF_TOKEN"}
    r = _pdctl("plan", str(spec), "--state-dir", str(sd), env=without)
    assert "secrets.HF_TOKEN = 'env:PDCTL_TEST_HF_TOKEN': PDCTL_TEST_HF_TOKEN is not set here" in r.stderr, r.stderr
    assert "shows it as changed" in r.stderr and "hf_abc" not in r.stdout + r.stderr
    # that apply refuses it is a warning after the plan, in apply's words (it was only the stderr note's last clause)
    assert ("Warning: `pdctl apply` refuses the spec in this environment (exit 1): secrets.HF_TOKEN = "
            "'env:PDCTL_TEST_HF_TOKEN': not set in pdctl's environment; nothing was changed\n  hint: export "
            "PDCTL_TEST_HF_TOKEN where pdctl runs") in r.stdout, r.stdout
    # ...and still checks the ports and GPUs apply would refuse (it said it could not, for the secret)
    assert "could not check whether the deployment's ports" not in r.stderr, r.stderr
    planned = json.loads(_pdctl("plan", str(spec), "--state-dir", str(sd), "--json", env=without).stdout)
    assert planned["ports_held"] is not None and "not set in pdctl's environment" in planned["secrets_refused"]
    # status finds the deployment differs from the spec (and says so while units run): the same note says why
    r = _pdctl("status", str(spec), "--state-dir", str(sd), "--json", env=without)
    assert json.loads(r.stdout)["matches_spec"] is False, r.stdout
    assert "PDCTL_TEST_HF_TOKEN is not set here" in r.stderr, r.stderr
    r = _pdctl("status", str(spec), "--state-dir", str(sd), "--json", env=with_it)
    assert json.loads(r.stdout)["matches_spec"] is True and "not set here" not in r.stderr, r.stdout + r.stderr
    r = _pdctl("plan", str(spec), "--state-dir", str(sd), env=with_it)
    assert "is not set here" not in r.stderr and "is empty here" not in r.stderr and "refuses the spec" not in r.stdout
    assert json.loads(_pdctl("plan", str(spec), "--state-dir", str(sd), "--json", env=with_it).stdout)[
        "secrets_refused"] is None
    r = _pdctl("plan", str(spec), "--state-dir", str(sd), env={**with_it, "PDCTL_TEST_HF_TOKEN": ""})
    assert "secrets.HF_TOKEN = 'env:PDCTL_TEST_HF_TOKEN' is empty here" in r.stderr, r.stderr
    assert ("refuses the spec in this environment (exit 1): secrets.HF_TOKEN = 'env:PDCTL_TEST_HF_TOKEN': the value "
            "is empty") in r.stdout, r.stdout


def test_plan_of_a_deployment_on_a_host_it_cannot_reach_is_an_error_not_no_changes(tmp_path):
    # (sshd stopped, or a typo'd ssh_port: "No changes. Deployment matches the spec", exit 0)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    d = seed_dict()
    d["hosts"]["local"].update(address="127.0.0.1", connect="ssh", ssh_port=closed)
    spec = tmp_path / "s.toml"
    spec.write_text(_toml_dump(d, list(range(8))))
    sd = tmp_path / "state"
    r = _pdctl("plan", str(spec), "--state-dir", str(sd))
    assert r.returncode == 2, r.stderr  # nothing deployed: planning needs no host
    Journal(sd, "dsv4-flash").write(JournalState(name="dsv4-flash", deployed=topo(d)))
    r = _pdctl("plan", str(spec), "--state-dir", str(sd))
    assert r.returncode == 1 and "No changes" not in r.stdout, r.stdout
    assert "cannot tell whether what was deployed still runs" in r.stderr and f":{closed}" in r.stderr, r.stderr


def test_ports_held_are_a_warning_after_the_plan_and_read_back_from_its_json():
    from pdctl.statemachine.plan import PortHeld

    p = make_plan(None, topo(seed_dict()))
    assert p.ports_held is None and "Warning" not in render_text(p)  # not looked at: nothing said
    assert "Warning" not in render_text(p.model_copy(update={"ports_held": ()}))
    held = (PortHeld(port=30001, role="router", step="router_exposed", pid=4242, command="nc -l 30001"),
            PortHeld(port=30010, role="prefill", step="prefill_up", pid=None))
    text = render_text(p.model_copy(update={"ports_held": held}))
    assert text.startswith(render_text(p) + "\n\nWarning: ports this deployment will listen on are held outside it: "
                           "while they are, `pdctl apply` stops before its first step (exit 3, once any "
                           "confirmation it needs is given), starting nothing:\n"), text
    assert text.endswith("\n  ! router needs port 30001 at router_exposed, held by PID 4242 (nc -l 30001)"
                         "\n  ! prefill needs port 30010 at prefill_up, held by PID ? (unknown)"
                         "\n  hint: stop those processes (another deployment?) or give the roles other ports in the spec")
    own = (PortHeld(port=30001, role="router", step="router_exposed", pid=7, command="smg::router",
                    applied_elsewhere="state directory /srv/other (process supervisor)"),)
    text = render_text(p.model_copy(update={"ports_held": own}))
    assert ("held by PID 7 (smg::router); this deployment's own process, applied another way: it runs under state "
            "directory /srv/other (process supervisor)\n  hint: manage it the way it was applied") in text, text
    back = Plan.model_validate_json(p.model_copy(update={"ports_held": held}).to_json())
    assert back.ports_held == held and back.plan_id == p.plan_id  # not part of the id
    assert json.loads(p.to_json())["ports_held"] is None


def test_gpus_held_are_a_warning_after_the_ports_and_read_back_from_its_json():
    from pdctl.statemachine.plan import GpuHeld, PortHeld

    p = make_plan(None, topo(seed_dict()))
    assert p.gpus_held is None and json.loads(p.to_json())["gpus_held"] is None  # not looked at (no nvidia-smi)
    assert "Warning" not in render_text(p.model_copy(update={"gpus_held": ()}))
    gpus = (GpuHeld(gpu=2, role="prefill", step="prefill_up", pid=4242, used_mib=70000, command="python train.py"),
            GpuHeld(gpu=6, role="decode", step="decode_up", pid=99, used_mib=None, command=""))
    ports = (PortHeld(port=30001, role="router", step="router_exposed", pid=4242, command="python train.py"),)
    text = render_text(p.model_copy(update={"gpus_held": gpus, "ports_held": ports}))
    assert text.index("Warning: ports") < text.index("Warning: GPUs"), text
    assert text.endswith(
        "\n\nWarning: GPUs this deployment's roles will run on are in use outside it: while they are, `pdctl apply` "
        "stops before its first step (exit 3, once any confirmation it needs is given), starting nothing:"
        "\n  ! prefill needs GPU 2 at prefill_up, used by PID 4242 (python train.py, 70000 MiB)"
        "\n  ! decode needs GPU 6 at decode_up, used by PID 99 (not in the host's /proc); apply only warns: nvidia-smi "
        "may name PIDs of another PID namespace (a container's), this deployment's own servers included"
        "\n  hint: stop those processes (nvidia-smi lists them) or give the roles other GPUs in the spec"), text
    back = Plan.model_validate_json(p.model_copy(update={"gpus_held": gpus}).to_json())
    assert back.gpus_held == gpus and back.plan_id == p.plan_id  # not part of the id


def test_cli_validate_prints_its_verdict_on_stdout(tmp_path):
    spec = tmp_path / "ok.toml"
    spec.write_text(_toml_dump(seed_dict(), list(range(8))))
    r = _pdctl("validate", str(spec))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"{spec}: valid (0 warning(s))"


def test_cli_invalid_spec_exits_1_naming_the_field(tmp_path):
    d = seed_dict()
    d["decode"][0]["gpus"] = [0, 1, 2, 3]
    spec = tmp_path / "bad.toml"
    spec.write_text(_toml_dump(d, list(range(8))))
    r = _pdctl("validate", str(spec))
    assert r.returncode == 1
    assert "decode[0].gpus" in r.stderr and "fix:" in r.stderr
    assert r.stdout == ""


def test_cli_plan_out_to_a_directory_or_a_missing_folder_is_refused_and_writes_nothing(tmp_path):
    # (-o /tmp wrote /.tmp.PID.tmp and failed on the rename; -o /missing/x.json created /missing as root)
    sd = tmp_path / "state"
    (tmp_path / "dir").mkdir()
    # a folder is a path the plan cannot be written to, as one the OS refuses: exit 1 with the error and hint of any
    # unwritable -o and, with --json, the {error, hint} object (it was a usage error, exit 64, with an older hint)
    unwritable = {"error": f"-o {tmp_path / 'dir'}: cannot write the plan there: Is a directory; nothing on any host "
                           "changed",
                  "hint": "give -o/--out a path this user can write: a file path, e.g. -o plan.json (or -o - for "
                          "stdout)"}
    r = _pdctl("plan", str(SEED), "--state-dir", str(sd), "-o", str(tmp_path / "dir"))
    assert r.returncode == 1 and r.stdout == "", r.stderr
    assert r.stderr == f"error: {unwritable['error']}\n  hint: {unwritable['hint']}\n", r.stderr
    r = _pdctl("plan", str(SEED), "--state-dir", str(sd), "--json", "-o", str(tmp_path / "dir"))
    assert r.returncode == 1 and json.loads(r.stdout) == unwritable, r.stdout
    missing = tmp_path / "missing" / "p.json"
    r = _pdctl("plan", str(SEED), "--state-dir", str(sd), "-o", str(missing))
    assert r.returncode == 1 and r.stdout == "", r.stderr
    assert (f"error: -o {missing}: cannot write the plan there: folder {missing.parent} does not exist; nothing on any "
            "host changed") in r.stderr and "\n  hint: give -o/--out a file path in an existing folder" in r.stderr, \
        r.stderr
    r = _pdctl("plan", str(SEED), "--state-dir", str(sd), "--json", "-o", str(missing))
    assert r.returncode == 1 and json.loads(r.stdout) == {
        "error": f"-o {missing}: cannot write the plan there: folder {missing.parent} does not exist; nothing on any "
                 "host changed",
        "hint": "give -o/--out a file path in an existing folder: e.g. -o plan.json (or -o - for stdout)"}, r.stdout
    # a file where the folder should be (FILE/sub) is named as such, not as a folder that does not exist
    (tmp_path / "afile").write_text("keep\n")
    r = _pdctl("plan", str(SEED), "--state-dir", str(sd), "-o", str(tmp_path / "afile" / "p.json"))
    assert r.returncode == 1 and (f"there: {tmp_path / 'afile'} is not a folder; nothing on any host changed"
                                  in r.stderr), r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "dir"] and not any((tmp_path / "dir").iterdir())


def test_cli_plan_out_never_replaces_its_spec_or_a_file_of_the_state_directory(tmp_path):
    # (-o SPEC replaced the spec with a plan that named itself as its spec; -o STATE/journal.json made every later
    # plan, apply, status and down fail on "not a readable pdctl journal")
    sd = tmp_path / "state"
    spec = tmp_path / "seed.toml"
    spec.write_bytes(SEED.read_bytes())
    assert _pdctl("plan", str(spec), "--state-dir", str(sd), "-o", str(tmp_path / "p.json")).returncode == 2
    journal = sd / "journal.json"
    sd.mkdir(exist_ok=True)
    journal.write_text("{}")  # (what is there is not looked at: the path alone is refused)
    (sd / "supervisor").mkdir()
    link = tmp_path / "alias.toml"
    link.hardlink_to(spec)
    for target, said in [(spec, f"is the spec the plan is made from ({spec})"),
                         (link, f"is the spec the plan is made from ({spec})"),
                         (journal, f"is one of the files pdctl keeps for the deployment in {sd.resolve()}"),
                         (sd / "audit.log", f"is one of the files pdctl keeps for the deployment in {sd.resolve()}"),
                         (sd / "supervisor" / "x.json", "is one of the files pdctl keeps for the deployment in")]:
        for extra in ([], ["--json"]):
            r = _pdctl("plan", str(spec), "--state-dir", str(sd), "-o", str(target), *extra)
            assert r.returncode == 1, (target, r.stdout, r.stderr)
            text = json.loads(r.stdout)["error"] if extra else r.stderr
            assert f"-o {target} {said}" in text and "nothing was written" in text, text
    assert spec.read_bytes() == SEED.read_bytes() and journal.read_text() == "{}" and not (sd / "audit.log").exists()
    journal.unlink()  # (another file in the state directory is the operator's: --state-dir . with -o plan.json)
    assert _pdctl("plan", str(spec), "--state-dir", str(sd), "-o", str(sd / "plan.json")).returncode == 2
    assert json.loads((sd / "plan.json").read_text())["spec_path"] == str(spec)


def test_cli_plan_out_never_replaces_another_deployments_journal(tmp_path):
    # (plan c2.toml -o STATE/c2/../base/journal.json replaced base's journal: base could then be neither planned,
    # applied nor taken down, its roles running on)
    base = tmp_path / "pdctl" / "base"
    (base / "secrets").mkdir(parents=True)
    (base / "journal.json").write_text('{"name": "base"}')
    (tmp_path / "pdctl" / "fresh").mkdir()  # one whose first apply was refused: an audit log and a lock
    (tmp_path / "pdctl" / "fresh" / "audit.log").write_text("")
    (tmp_path / "pdctl" / "fresh" / "lock").write_text("")
    sd = tmp_path / "pdctl" / "seed"
    sd.mkdir()
    for target in (sd / ".." / "base" / "journal.json", base / "audit.log", base / "secrets" / "prefill.env",
                   tmp_path / "pdctl" / "fresh" / "lock"):
        r = _pdctl("plan", str(SEED), "--state-dir", str(sd), "-o", str(target))
        assert r.returncode == 1, (target, r.stdout, r.stderr)
        home = tmp_path / "pdctl" / ("fresh" if "fresh" in str(target) else "base")
        assert f"-o {target} is one of the files pdctl keeps for another deployment in {home}" in r.stderr, r.stderr
        assert "nothing was written" in r.stderr
    assert (base / "journal.json").read_text() == '{"name": "base"}' and not (base / "audit.log").exists()
    assert _pdctl("plan", str(SEED), "--state-dir", str(sd), "-o", str(base / "plan.json")).returncode == 2


def test_a_usage_error_under_json_answers_on_stdout_and_json_may_come_before_apply(tmp_path):
    # (stdout was empty, click's usage text on stderr only; `pdctl --json --apply SPEC` was "No such option: --json")
    r = _pdctl("plan", str(SEED), "--json", "--bogus")
    assert r.returncode == 64 and "No such option: --bogus" in r.stderr, r.stderr
    assert json.loads(r.stdout) == {"error": "usage: No such option: --bogus (Possible options: --out)",
                                    "hint": "`pdctl plan -h` lists the options"}, r.stdout
    r = _pdctl("apply", "--json")  # (apply's stream ends with its apply_failed event: nothing started)
    event = json.loads(r.stdout.splitlines()[-1])
    assert r.returncode == 64 and event["kind"] == "apply_failed" and event["data"]["started"] is False, r.stdout
    assert event["data"]["error"] == "usage: Missing argument 'SPEC'.", event
    assert _pdctl("plan", str(SEED), "--bogus").stdout == ""  # (no --json: the usage text alone, on stderr)
    bad = tmp_path / "bad.toml"
    bad.write_text("bogus = 1\n" + SEED.read_text())  # (a top-level key: before the spec's first table)
    r = _pdctl("--json", "--apply", str(bad), "--state-dir", str(tmp_path / "state"))
    event = json.loads(r.stdout.splitlines()[-1])
    assert r.returncode == 1 and event["kind"] == "apply_failed", (r.stdout, r.stderr)
    (finding,) = event["data"]["findings"]
    assert finding["field"] == "bogus" and finding["message"] == "unknown key", event
    assert finding["fix"].startswith("remove it or check its spelling; the top level takes name, "), event


def test_cli_plan_out_refuses_a_link_or_a_fifo_and_discards_the_plan_at_dev_null(tmp_path):
    # A plan is saved by renaming a new file over the path: a link would be replaced (not written through), a FIFO or
    # device replaced by a file (as root, /dev/null itself). They were usage errors (exit 64); now unwritable paths
    # (exit 1, the same error and hint as one the OS refuses), left as they were. /dev/null discards the plan, as it
    # does any output: the plan is shown and its exit code kept (2: changes).
    sd = tmp_path / "state"
    (tmp_path / "target.json").write_text("kept")
    (tmp_path / "link").symlink_to(tmp_path / "target.json")
    os.mkfifo(tmp_path / "fifo")
    for odd, why in ((tmp_path / "link", "a symbolic link, which saving would replace"),
                     (tmp_path / "fifo", "not a regular file (a device, FIFO or socket), which saving would replace")):
        r = _pdctl("plan", str(SEED), "--state-dir", str(sd), "-o", str(odd))
        assert r.returncode == 1 and r.stdout == "", r.stderr
        assert r.stderr.startswith(f"error: -o {odd}: cannot write the plan there: {why}"), r.stderr
        assert r.stderr.endswith("; nothing on any host changed\n  hint: give -o/--out a path this user can write: a "
                                 "file path, e.g. -o plan.json (or -o - for stdout)\n"), r.stderr
        r = _pdctl("plan", str(SEED), "--state-dir", str(sd), "--json", "-o", str(odd))
        assert r.returncode == 1 and set(json.loads(r.stdout)) == {"error", "hint"}, r.stdout
    assert (tmp_path / "link").is_symlink() and (tmp_path / "target.json").read_text() == "kept"
    import stat

    assert stat.S_ISFIFO(os.lstat(tmp_path / "fifo").st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "link", "target.json"]
    r = _pdctl("plan", str(SEED), "--state-dir", str(sd), "-o", "/dev/null")
    assert r.returncode == 2 and "Plan: 4 to add, 0 to change, 0 to destroy." in r.stdout, r.stderr
    assert "plan not saved: -o /dev/null discards it" in r.stderr, r.stderr
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_cli_plan_out_empty_is_named_as_given_and_refused(tmp_path):
    # (`-o ''` became Path("") == ".": the error said "-o .: cannot write the plan there: Is a directory", a path the
    # user never gave)
    sd, cwd = tmp_path / "state", tmp_path / "cwd"
    cwd.mkdir()
    refused = {"error": "-o '': an empty path names no file to save the plan to; nothing on any host changed",
               "hint": "give -o/--out a file path, e.g. -o plan.json (or -o - for stdout)"}
    r = _pdctl("plan", str(SEED), "--state-dir", str(sd), "-o", "", cwd=cwd)
    assert r.returncode == 1 and r.stdout == "", r.stderr
    assert r.stderr == f"error: {refused['error']}\n  hint: {refused['hint']}\n", r.stderr
    r = _pdctl("plan", str(SEED), "--state-dir", str(sd), "--json", "--out=", cwd=cwd)
    assert r.returncode == 1 and json.loads(r.stdout) == refused, r.stdout
    assert not any(cwd.iterdir()) and not sd.exists()  # nothing written, here or in the state directory


def test_status_json_on_a_spec_that_does_not_load_still_prints_an_object(tmp_path):
    # (plan --json printed {error, hint}; status --json printed nothing on stdout, so a script parsing it failed on
    # empty input instead of reading the error)
    bad = tmp_path / "bad.toml"
    for text, says in (("name = 'x'\n[prefill\n", "TOML syntax error"),
                       ("name = 'x'\n[[prefill]]\nport = '1'\n", "prefill[0].port: must be a whole number")):
        bad.write_text(text)
        r = _pdctl("status", str(bad), "--state-dir", str(tmp_path / "state"), "--json")
        assert r.returncode == 1, r.stderr
        got = json.loads(r.stdout)
        assert got["deployment"] is None and got["healthy"] is False and says in got["error"], got
        assert says in r.stderr  # (and said for a person too)


def test_an_empty_state_dir_option_is_refused_before_anything_is_written(tmp_path):
    # (`--state-dir ''` was Path("") == the current folder: a fresh user's `down --yes` wrote its audit log and lock
    # there, and status said "not deployed"; an empty PDCTL_STATE_DIR was already no value)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    for args in (["down", str(SEED), "--yes"], ["status", str(SEED)], ["plan", str(SEED)], ["apply", str(SEED)]):
        r = _pdctl(*args, "--state-dir", "", cwd=cwd)
        assert r.returncode == 64, (args, r.returncode, r.stderr)
        assert "Invalid value for '--state-dir'" in r.stderr and "'' names no folder" in r.stderr, r.stderr
        assert not any(cwd.iterdir()), (args, list(cwd.iterdir()))


def test_cli_plan_out_to_a_link_names_only_paths_that_work(tmp_path):
    # `-o /dev/stdout` was refused as a link, "give the path it points to": /proc/self/fd/1, itself a link refused
    # the same way (and from there a pipe or terminal). The hint now names what works, and a link to a file names
    # the file, which then takes the plan.
    sd = tmp_path / "state"
    (tmp_path / "out").symlink_to("/dev/stdout")
    descriptor_links = ["/dev/stdout", "/proc/self/fd/1", "/dev/stderr", str(tmp_path / "out")]
    descriptor_links += ["/dev/fd/1"] if os.path.exists("/dev/fd") else []
    hint = "-o - prints the plan (JSON) on stdout; to save it, give -o/--out a file path, e.g. -o plan.json"
    for odd in descriptor_links:
        r = _pdctl("plan", str(SEED), "--state-dir", str(sd), "-o", odd)
        assert r.returncode == 1 and r.stdout == "", (odd, r.stderr)
        assert r.stderr == (f"error: -o {odd}: cannot write the plan there: a symbolic link to one of pdctl's own open "
                            "files (its stdout, stderr…), not a file the plan can be saved as; nothing on any host "
                            f"changed\n  hint: {hint}\n"), r.stderr
        r = _pdctl("plan", str(SEED), "--state-dir", str(sd), "--json", "-o", odd)
        assert r.returncode == 1 and json.loads(r.stdout)["hint"] == hint, r.stdout
    assert os.path.islink(tmp_path / "out")
    # what the hint names works: -o - prints the plan, -o plan.json saves it
    r = _pdctl("plan", str(SEED), "--state-dir", str(sd), "-o", "-")
    assert r.returncode == 2 and json.loads(r.stdout)["plan_id"], r.stderr
    r = _pdctl("plan", str(SEED), "--state-dir", str(sd), "-o", "plan.json", cwd=tmp_path)
    assert r.returncode == 2 and json.loads((tmp_path / "plan.json").read_text())["plan_id"], r.stderr
    # a link to a file (or to a new file in an existing folder) names that file, as given back by the kernel
    (tmp_path / "sub").mkdir()
    for name, target in (("to-file", tmp_path / "plan.json"), ("to-new", tmp_path / "sub" / "new.json")):
        (tmp_path / name).symlink_to(target)
        r = _pdctl("plan", str(SEED), "--state-dir", str(sd), "-o", str(tmp_path / name))
        assert r.returncode == 1, r.stderr
        assert f"a symbolic link, which saving would replace (a plan is saved by renaming a new file over the path): " \
               f"give the path it points to, {target}; nothing" in r.stderr, r.stderr
        r = _pdctl("plan", str(SEED), "--state-dir", str(sd), "-o", str(target))
        assert r.returncode == 2 and json.loads(target.read_text())["plan_id"], r.stderr
    # a link to a folder names no path to give instead
    (tmp_path / "to-dir").symlink_to(tmp_path / "sub")
    r = _pdctl("plan", str(SEED), "--state-dir", str(sd), "-o", str(tmp_path / "to-dir"))
    assert r.returncode == 1 and "give the path it points to" not in r.stderr, r.stderr
    assert f"and what it points to, {tmp_path / 'sub'}, is not a file the plan can be saved as either" in r.stderr


def test_an_unwritable_out_path_is_named_with_its_fix_not_the_state_dir(tmp_path):
    # (`plan -o /proc/x` said "error: /proc/.x.PID.tmp: No such file or directory", hint: "the journal lives in
    # --state-dir", and `units -o /proc/x` the same: the output path was the fault, not the state directory)
    sd = tmp_path / "state"
    for args, what in ((("plan", str(SEED), "--state-dir", str(sd), "-o", "/proc/x"), "the plan"),
                       (("units", str(SEED), "-o", "/proc/x"), "the units")):
        r = _pdctl(*args)  # /proc takes no new file, even as root
        assert r.returncode == 1 and r.stdout == "", (args, r.stderr)
        assert f"error: -o /proc/x: cannot write {what} there: No such file or directory" in r.stderr, r.stderr
        assert "hint: give -o/--out a path this user can write" in r.stderr, r.stderr
        assert "--state-dir" not in r.stderr and ".tmp" not in r.stderr, r.stderr
    r = _pdctl("plan", str(SEED), "--state-dir", str(sd), "--json", "-o", "/proc/x")  # scripts get an object
    assert r.returncode == 1 and json.loads(r.stdout) == {
        "error": "-o /proc/x: cannot write the plan there: No such file or directory; nothing on any host changed",
        "hint": "give -o/--out a path this user can write: a file path, e.g. -o plan.json (or -o - for stdout)"}
    assert not sd.exists()  # nothing written anywhere


def test_atomic_write_leaves_no_temp_file_when_it_fails(tmp_path):
    from pdctl.statemachine.journal import atomic_write

    (tmp_path / "taken").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "taken")
    for target in ("taken", "link"):
        try:
            atomic_write(tmp_path / target, b"{}")
        except OSError:
            pass
        else:
            raise AssertionError(f"{target} was replaced by a file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "taken"] and (tmp_path / "link").is_symlink()


def test_atomic_write_completes_short_writes_and_names_the_file_on_a_full_disk(tmp_path, monkeypatch):
    import errno
    import os

    import pytest

    from pdctl.statemachine import journal

    real = os.write
    calls = []

    def short(fd, data):  # noqa: ANN001, ANN202 - what a nearly full disk may do: fewer bytes than asked
        calls.append(len(data))
        return real(fd, bytes(data[:3]))

    monkeypatch.setattr(journal.os, "write", short)
    journal.atomic_write(tmp_path / "j.json", b'{"serial": 12345}')
    assert (tmp_path / "j.json").read_bytes() == b'{"serial": 12345}' and len(calls) > 1

    def full(fd, data):  # noqa: ANN001, ANN202
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(journal.os, "write", full)
    with pytest.raises(OSError) as e:
        journal.atomic_write(tmp_path / "j.json", b"{}")
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / "j.json")
    assert (tmp_path / "j.json").read_bytes() == b'{"serial": 12345}'  # the last good state stays
    assert sorted(p.name for p in tmp_path.iterdir()) == ["j.json"]


def test_a_damaged_journal_is_a_clear_error_not_a_traceback(tmp_path):
    sd = tmp_path / "state"
    sd.mkdir()
    (sd / "journal.json").write_text('{"format": 1, "name": "dsv4-fl')  # cut short
    for cmd in ("plan", "status"):
        r = _pdctl(cmd, str(SEED), "--state-dir", str(sd))
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert "is not a readable pdctl journal (JSONDecodeError" in r.stderr and "move it aside" in r.stderr
    # steps of the wrong shape ('str' object has no attribute 'items' was a traceback)
    (sd / "journal.json").write_text('{"format": 1, "name": "dsv4-flash", "steps": "oops"}')
    r = _pdctl("plan", str(SEED), "--state-dir", str(sd))
    assert r.returncode == 1 and "Traceback" not in r.stderr and "not a readable pdctl journal" in r.stderr, r.stderr
    # shapes pdctl never writes, which were read as if it had: an empty steps array, a step status it does not know
    from pdctl.statemachine.errors import PdctlError

    for body, said in (('"steps": []', "'steps' is a JSON list, not an object"),
                       ('"steps": {"prefill_up": {"status": "bogus"}}', "step 'prefill_up' has status 'bogus', not one of"),
                       ('"removing": "pdctl-x.service"', "'removing' is a JSON str, not an array")):
        (sd / "journal.json").write_text('{"format": 1, "name": "dsv4-flash", %s}' % body)
        with pytest.raises(PdctlError, match="not a readable pdctl journal") as e:
            Journal(sd, "dsv4-flash").read()
        assert said in str(e.value), e.value
    # a newer pdctl's journal, whose fields this one cannot parse: not "damaged, move it aside"
    (sd / "journal.json").write_text('{"format": 2, "name": "dsv4-flash", "steps": {"x": {"attempt": 1}}}')
    r = _pdctl("plan", str(SEED), "--state-dir", str(sd))
    assert r.returncode == 1 and "has format 2, which this pdctl does not know" in r.stderr, r.stderr
    assert "move it aside" not in r.stderr and "keep the file as it is" in r.stderr


def test_another_deployments_journal_in_the_state_dir_is_refused_by_every_command(tmp_path):
    # (a renamed deployment, or one PDCTL_STATE_DIR for two specs: "No changes", then apply removed the other
    # deployment's units as gone roles without a confirmation)
    sd = tmp_path / "state"
    Journal(sd, "other").write(JournalState(name="other", deployed=topo(seed_dict())))
    for cmd in (("plan",), ("status",), ("apply",), ("down", "--yes")):
        r = _pdctl(*cmd[:1], str(SEED), "--state-dir", str(sd), *cmd[1:])
        assert r.returncode == 1, (cmd, r.stderr)
        assert f"state directory {sd} holds the journal of deployment 'other', not 'dsv4-flash'" in r.stderr, r.stderr
        assert "PDCTL_STATE_DIR names one deployment's directory" in r.stderr
    r = _pdctl("plan", str(SEED), "--state-dir", str(sd), "--json")  # refused after the spec loaded: an object too
    assert r.returncode == 1 and "holds the journal of deployment 'other'" in json.loads(r.stdout)["error"]
    assert Journal(sd, "other").read().deployed is not None  # left as it was
    # once 'other' is taken down (nothing deployed, nothing proven), the directory is free for this spec
    Journal(sd, "other").write(JournalState(name="other"))
    r = _pdctl("plan", str(SEED), "--state-dir", str(sd))
    assert r.returncode == 2 and "holds the journal" not in r.stderr, r.stderr


def test_a_base_of_other_deployments_state_directories_is_refused_and_nothing_is_written_there(tmp_path):
    # `--state-dir ~/.local/state/pdctl` (the base) instead of `…/pdctl/<name>`: plan said every role would be created,
    # and a refused down left its lock and audit log beside the deployments' directories
    base = tmp_path / "pdctl"
    Journal(base / "other", "other").write(JournalState(name="other", deployed=topo(seed_dict())))
    for cmd in (("plan",), ("status",), ("apply",), ("down", "--yes")):
        r = _pdctl(*cmd[:1], str(SEED), "--state-dir", str(base), *cmd[1:])
        assert r.returncode == 1 and "Traceback" not in r.stderr, (cmd, r.stderr)
        assert (f"state directory {base} has no journal of its own but holds the state directories of 'other': it is "
                "their base") in r.stderr, r.stderr
        assert f"give --state-dir {base / 'dsv4-flash'} or the directory this deployment was applied with" in r.stderr
    assert sorted(p.name for p in base.iterdir()) == ["other"]  # no lock, no audit log, no journal
    # the deployment's own directory beside 'other' is used as before; a directory with its own journal is not a base
    r = _pdctl("plan", str(SEED), "--state-dir", str(base / "dsv4-flash"))
    assert r.returncode == 2, r.stderr
    Journal(base, "dsv4-flash").write(JournalState(name="dsv4-flash"))
    r = _pdctl("plan", str(SEED), "--state-dir", str(base))
    assert r.returncode == 2 and "their base" not in r.stderr, r.stderr


def test_plan_json_on_a_bad_spec_still_prints_an_object_and_os_errors_get_a_fitting_hint(tmp_path):
    import errno

    from pdctl.console.cli import os_error_hint

    d = seed_dict()
    d["decode"][0]["gpus"] = [3, 4, 5, 6]  # overlaps prefill at GPU 3, and spans NUMA nodes 0 and 1 (a warning)
    spec = tmp_path / "bad.toml"
    spec.write_text(_toml_dump(d, list(range(8))))
    r = _pdctl("plan", str(spec), "--json")
    assert r.returncode == 1
    out = json.loads(r.stdout)  # (it printed nothing, while status --json and apply --json give an object)
    assert "decode[0].gpus" in out["error"] and set(out) == {"error", "hint", "findings"}
    # each finding apart, for scripts (the field and fix were only inside the multi-line message)
    assert out["findings"][0] == {"field": "decode[0].gpus", "message": "GPU 3 on host 'local' is already used by "
                                  "prefill[0] (prefill)", "fix": "give each role its own GPUs"}, out["findings"]
    assert {f["field"] for f in out["findings"]} == {"decode[0].gpus"}, out["findings"]  # (errors: not the warning)
    r = _pdctl("validate", str(spec), "--json")
    v = json.loads(r.stdout)
    assert r.returncode == 1 and v["valid"] is False and v["findings"] == out["findings"], v
    assert [w["field"] for w in v["warnings"]] == ["decode[0].numa_node"], v["warnings"]
    r = _pdctl("validate", str(SEED), "--json")
    assert r.returncode == 0 and json.loads(r.stdout) == {"spec": str(SEED), "valid": True, "findings": [],
                                                         "warnings": [], "error": None, "hint": None}, r.stdout
    d["decode"][0]["port"] = "30020"  # a parse error: field, message and fix apart (the fix was inside the message)
    spec.write_text(_toml_dump(d, list(range(8))))
    for cmd in (("plan", "--json"), ("status", "--json")):
        out = json.loads(_pdctl(cmd[0], str(spec), *cmd[1:]).stdout)
        assert out["findings"] == [{"field": "decode[0].port", "message": "must be a whole number, not '30020'",
                                    "fix": "remove the quotes"}], (cmd, out)
        assert "decode[0].port: must be a whole number, not '30020': remove the quotes" in out["error"], out
    events = [json.loads(x) for x in _pdctl("apply", str(spec), "--json").stdout.splitlines()]
    assert events[-1]["kind"] == "apply_failed" and events[-1]["data"]["findings"][0]["field"] == "decode[0].port"
    # a read-only state directory (a ro mount, another user's): "check the path" did not help
    assert "not writable here" in os_error_hint(OSError(errno.EROFS, "Read-only file system", "/srv/state/journal.json"))
    assert "not writable here" in os_error_hint(PermissionError(errno.EACCES, "Permission denied", "/srv/state"))
    assert "check the path" in os_error_hint(FileNotFoundError(errno.ENOENT, "No such file", "/srv/x.toml"))


def test_a_state_directory_the_os_refuses_is_a_json_error_object_in_pdctls_words(tmp_path):
    # A file where the state directory's parent should be: plan --json and status --json printed nothing on stdout
    # (the OSError went past their handlers), and apply --json said Python's "[Errno 2] No such file or directory: …"
    d = seed_dict()
    d["service_manager"] = "process"
    spec = tmp_path / "seed.toml"
    spec.write_text(_toml_dump(d, list(range(8))))
    (tmp_path / "afile").write_text("x")
    sd = tmp_path / "afile" / "state"
    journal = f"{sd}/journal.json: Not a directory"
    r = _pdctl("plan", str(spec), "--state-dir", str(sd), "--json")
    hint = "a file is in that path where a folder should be: give --state-dir / PDCTL_STATE_DIR a folder's path"
    assert r.returncode == 1 and json.loads(r.stdout) == {"error": journal, "hint": hint}, (r.stdout, r.stderr)
    assert f"error: {journal}" in r.stderr, r.stderr
    r = _pdctl("status", str(spec), "--state-dir", str(sd), "--json")
    out = json.loads(r.stdout)
    assert r.returncode == 1 and (out["deployment"], out["healthy"], out["error"]) == (d["name"], False, journal), out
    r = _pdctl("apply", str(spec), "--state-dir", str(sd), "--json")
    last = json.loads(r.stdout.splitlines()[-1])
    assert r.returncode == 1 and last["kind"] == "apply_failed", r.stdout
    assert last["data"]["error"] == f"state directory {sd}: a file is in the way", last
    assert (tmp_path / "afile").read_text() == "x"  # nothing written
    # a folder the OS will not create (procfs): apply's event said "[Errno 2] No such file or directory: '/proc/…'"
    r = _pdctl("apply", str(spec), "--state-dir", "/proc/pdctl-test/state", "--json")
    last = json.loads(r.stdout.splitlines()[-1])
    assert r.returncode == 1 and last["kind"] == "apply_failed", r.stdout
    assert last["data"]["error"].startswith("/proc/pdctl-test") and "Errno" not in last["data"]["error"], last
    assert last["data"]["error"] in r.stderr, r.stderr  # the same words as on stderr


def test_a_folder_where_the_lock_or_journal_belongs_is_named_with_the_fix(tmp_path):
    # "lock: Is a directory" came with "check the path; the journal lives in --state-dir", which a folder there fits
    d = seed_dict()
    d["service_manager"] = "process"
    spec = tmp_path / "seed.toml"
    spec.write_text(_toml_dump(d, list(range(8))))
    sd = tmp_path / "state"
    for name in ("lock", "journal.json"):
        (sd / name).mkdir(parents=True)
        for cmd in (("plan",), ("down", "--yes")):
            r = _pdctl(*cmd, str(spec), "--state-dir", str(sd))
            assert r.returncode == 1 and f"{sd / name}: Is a directory" in r.stderr, (cmd, r.stderr)
            assert f"move {sd / name} aside" in r.stderr, (cmd, r.stderr)
        (sd / name).rmdir()
        assert sorted(p.name for p in sd.iterdir()) == [], list(sd.iterdir())  # nothing written beside it
    assert _pdctl("plan", str(spec), "--state-dir", str(sd)).returncode == 2  # the fix followed: plans again


def test_a_terminal_gone_mutes_the_cli_streams_like_a_closed_pipe_and_other_errors_name_them():
    # After SIGHUP the SSH terminal answers writes with EIO: it raised and turned the exit code 129 into 1
    import errno

    import pytest

    from pdctl.console.cli import _PipeSafe

    class Gone:
        def __init__(self, err: int) -> None:
            self.err = err

        def write(self, text: str) -> int:
            raise OSError(self.err, os.strerror(self.err))

        flush = write

        def fileno(self) -> int:
            raise ValueError("no descriptor")

    s = _PipeSafe(Gone(errno.EIO), "<stderr>")
    assert s.write("interrupted\n") == len("interrupted\n") and s.gone
    s.flush()
    full = _PipeSafe(Gone(errno.ENOSPC), "<stdout>")
    with pytest.raises(OSError) as e:
        full.write("x")
    assert e.value.errno == errno.ENOSPC and e.value.filename == "<stdout>" and not full.gone



def test_going_back_from_an_interrupted_reshape_is_planned_from_what_it_started():
    # A confirmed change of a role's shape (TP 4 -> 8 on other GPUs) interrupted after it restarted that role, then
    # the old spec applied again: that rebuilds the role, a topology change to confirm, not "no changes"
    from pdctl.statemachine.service import plan_base, unit_names

    seed = seed_dict()
    deployed, target = topo(seed), topo(collapsed(seed))
    state = JournalState(name=deployed.name, deployed=deployed, target=target)
    assert plan_base(state, deployed) is deployed  # nothing of the target was started: back is no change
    server = unit_names(target)["server"]
    state.units[server] = "started:0123456789abcdef"
    assert plan_base(state, deployed) is target
    assert make_plan(plan_base(state, deployed), deployed).requires_confirmation
    # a same-named role restarted for a target of another shape
    reshaped = seed_dict()
    reshaped["prefill"][0]["tp"] = 2
    reshaped["prefill"][0]["gpus"] = [0, 1]
    t2 = topo(reshaped)
    assert make_plan(t2, deployed).requires_confirmation  # (a role's TP and GPUs are its topology)
    state = JournalState(name=deployed.name, deployed=deployed, target=t2)
    assert plan_base(state, deployed) is deployed
    state.units[unit_names(t2)["prefill"]] = "started:0123456789abcdef"
    assert plan_base(state, deployed) is t2


def test_going_back_from_a_reshape_whose_role_was_proven_is_planned_from_what_it_started():
    # A reshape (prefill TP4 -> TP2) interrupted once prefill_up had proven the TP2 prefill: its unit's record is a
    # plain fingerprint again (no longer "started:"), and the plan of the recorded spec said no changes, so apply
    # rebuilt the TP2 prefill as TP4 without the confirmation a reshape needs
    from pdctl.statemachine.journal import StepRecord
    from pdctl.statemachine.service import plan_base, unit_names

    deployed = topo(seed_dict())
    reshaped = seed_dict()
    reshaped["prefill"][0].update(tp=2, gpus=[0, 1])
    target = topo(reshaped)
    state = JournalState(name=deployed.name, deployed=deployed, target=target,
                         units=dict.fromkeys(unit_names(deployed).values(), "0123456789abcdef"),
                         steps={"kernels_built": StepRecord("skipped"), "prefill_up": StepRecord("running")})
    assert plan_base(state, deployed) is deployed  # prefill not restarted yet: what runs is what was recorded
    state.steps["prefill_up"] = StepRecord("done")
    assert plan_base(state, deployed) is target
    p = make_plan(plan_base(state, deployed), deployed)
    assert p.requires_confirmation and "prefill tp 2 → 4" in p.topology_changes
    # A role the target leaves as recorded, proven by it (observed satisfied): nothing of the reshape runs yet
    moved = seed_dict()
    moved["router"]["port"] = 30002
    state = JournalState(name=deployed.name, deployed=deployed, target=topo(moved),
                         steps={"prefill_up": StepRecord("skipped"), "decode_up": StepRecord("skipped")})
    assert plan_base(state, deployed) is deployed
    state.steps["router_exposed"] = StepRecord("done")  # the router proven on its new port: going back moves it
    assert plan_base(state, deployed) == topo(moved)


def _pd_removed() -> dict[str, str]:
    from pdctl.statemachine.plan import NOT_INSTALLED

    return dict.fromkeys(("prefill", "decode", "router"), NOT_INSTALLED)


def test_what_an_unfinished_collapse_removed_is_planned_as_started_again_without_a_confirmation():
    # (PD collapsed into one server, interrupted once the PD roles were removed and before the server started: the plan
    # of the PD spec said "No changes to what was recorded", while apply started all of PD again)
    seed = seed_dict()
    recorded = topo(seed)
    p = make_plan(recorded, recorded, not_running=_pd_removed())
    assert p.has_changes and p.counts() == (4, 0, 0)
    assert {c.address: (c.action, c.cls) for c in p.changes} == {
        "role.prefill": ("create", "disruptive"), "role.decode": ("create", "disruptive"),
        "kv_link": ("create", "disruptive"), "router": ("create", "disruptive")}
    assert all(not c.restarts for c in p.changes)  # started, nothing restarted
    # restoring what was recorded changes no topology: no confirmation, and the id of the plan with nothing to do
    assert not p.requires_confirmation and not p.topology_changes
    assert p.plan_id == make_plan(recorded, recorded).plan_id
    text = render_text(p)
    assert "No changes" not in text and "# role.prefill will be started again (disruptive)" in text, text
    assert "      does not run now: not installed" in text and "# kv_link will be set up again" in text, text
    assert "Plan: 4 to add, 0 to change, 0 to destroy." in text
    assert Plan.model_validate_json(p.to_json()) == p
    # a third spec, whose prefill differs from the recorded one: started as the spec asks, not "recorded → new"
    ctx = copy.deepcopy(seed)
    ctx["model"]["context_length"] = 8192
    (c,) = [c for c in make_plan(recorded, topo(ctx), not_running=_pd_removed()).changes if c.address == "role.prefill"]
    assert (c.action, c.cls, c.changes, c.restarts) == ("create", "disruptive", (), ())
    # a role that stopped (installed, inactive) is started again too; one that runs is left to the comparison
    p = make_plan(recorded, topo(ctx), not_running={"decode": "inactive"})
    assert {c.address: c.action for c in p.changes} == {"role.prefill": "update", "role.decode": "create",
                                                         "kv_link": "create"}
    assert p.restarts() == ["prefill"]  # (the router keeps running: its unit Wants= the servers)


def test_resuming_a_collapse_whose_pd_roles_are_gone_keeps_its_confirmation():
    # (the resume must take the id the operator confirmed; what it already removed is not destroyed again)
    seed = seed_dict()
    recorded, single = topo(seed), topo(collapsed(seed))
    confirmed = make_plan(recorded, single)
    p = make_plan(recorded, single, not_running=_pd_removed())
    assert p.requires_confirmation and p.plan_id == confirmed.plan_id
    assert p.topology_changes == confirmed.topology_changes
    gone = {c.address for c in p.changes if c.gone}
    assert gone == {"role.prefill", "role.decode", "kv_link", "router"}
    assert p.counts() == (1, 0, 0)  # the server, and nothing left to destroy
    text = render_text(p)
    assert "# role.prefill is gone already (topology): nothing left to destroy" in text, text
    assert f"--confirm-topology {confirmed.plan_id}" in text


@pytest.mark.parametrize("manager", ["process", "systemd-system"])
def test_a_new_served_name_restarts_the_router_in_front_of_a_single_server_too(manager):
    # (only prefill and decode counted: smg kept a single server's worker under its old model id)
    from .specs import demo_dict

    d = collapsed(demo_dict())
    d["server"][0].update(port=30010, http_host="127.0.0.1")
    d["router"] = demo_dict()["router"]
    d["service_manager"] = manager
    renamed = copy.deepcopy(d)
    renamed["model"]["served_name"] = "another-name"
    assert sorted(make_plan(topo(d), topo(renamed)).restarts()) == ["router", "server"]
    env_only = copy.deepcopy(d)
    env_only["engine"]["env"] = {"X": "1"}
    # the same name: under either manager the router sees its worker come back
    assert sorted(make_plan(topo(d), topo(env_only)).restarts()) == ["server"]


@pytest.mark.parametrize("change", ["secret", "python", "service_user"])
def test_a_change_to_what_the_routers_unit_carries_lists_the_router_among_the_restarts(change, monkeypatch):
    # (a [secrets] value or engine.python changed the router's unit too, and apply restarted it, which the plan
    # and the console's y/N did not say)
    from .specs import demo_dict

    monkeypatch.setenv("PDCTL_T_TOKEN", "one")
    d = demo_dict()
    d["secrets"] = {"HF_TOKEN": "env:PDCTL_T_TOKEN"}
    other = copy.deepcopy(d)
    if change == "secret":
        before = topo(d)
        monkeypatch.setenv("PDCTL_T_TOKEN", "two")
        after = topo(other)
    elif change == "python":
        other["engine"]["python"] = "/opt/other/bin/python3"
        before, after = topo(d), topo(other)
    else:  # (every unit runs as that account: User=)
        other["service_user"] = "sglang"
        before, after = topo(d), topo(other)
    assert sorted(make_plan(before, after).restarts()) == ["decode", "prefill", "router"]
    env_only = copy.deepcopy(d)
    env_only["engine"]["env"] = {"X": "1"}
    assert "router" not in make_plan(topo(d), topo(env_only)).restarts()  # (the router's env is its own)


def test_what_an_unfinished_apply_left_running_as_asked_is_kept_not_created_nor_restarted():
    # (a first deployment interrupted once prefill_up had proven prefill: `pdctl status` showed prefill done and
    # active while the plan said "+ role.prefill will be created"; a collapse resumed after its server started said
    # "+ role.server will be created" while it ran)
    from pdctl.statemachine.plan import Runs

    seed = seed_dict()
    desired = topo(seed)
    proven = Runs(kept="the unfinished apply started it with this spec's definition and proved it")
    first = make_plan(None, desired)
    p = make_plan(None, desired, runs={"prefill": proven})
    assert p.plan_id == first.plan_id and p.cls == first.cls == "topology" and not p.requires_confirmation
    assert p.kept() == ["role.prefill"] and p.counts() == (3, 0, 0)
    text = render_text(p)
    assert "role.prefill will be created" not in text and "+ role.prefill" not in text, text
    assert "  # role.prefill runs already as specified (topology): apply keeps it\n  = role.prefill: " in text, text
    assert "      kept: the unfinished apply started it with this spec's definition and proved it" in text, text
    assert "Plan: 3 to add, 0 to change, 0 to destroy, 1 kept as the unfinished apply left it." in text, text
    assert Plan.model_validate_json(p.to_json()) == p
    # both ends of the KV link kept: the link is only proven again
    p = make_plan(None, desired, runs={"prefill": proven, "decode": proven})
    assert p.kept() == ["role.prefill", "role.decode", "kv_link"] and p.counts() == (1, 0, 0)

    # the collapse resumed: still the topology change confirmed under its id, nothing left to add
    single = topo(collapsed(seed))
    confirmed = make_plan(desired, single)
    p = make_plan(desired, single, not_running=_pd_removed(), runs={"server": proven})
    assert p.requires_confirmation and p.plan_id == confirmed.plan_id
    assert p.topology_changes == confirmed.topology_changes
    assert p.kept() == ["role.server"] and p.counts() == (0, 0, 0) and p.restarts() == []

    # a change kept as it runs restarts nothing
    ctx = copy.deepcopy(seed)
    ctx["model"]["context_length"] = 8192
    assert make_plan(desired, topo(ctx)).restarts() == ["prefill", "decode"]
    p = make_plan(desired, topo(ctx), runs={"prefill": proven})
    assert sorted(p.restarts()) == ["decode"] and p.counts() == (0, 1, 0)
    (c,) = [c for c in p.changes if c.address == "role.prefill"]
    assert (c.action, c.cls, c.restarts) == ("update", "disruptive", ())
    # ...and the router, kept as it runs, stays so while a server restarts (its unit Wants= them, not Requires=)
    p = make_plan(desired, topo(ctx), runs={"prefill": proven, "router": proven})
    assert "router" not in p.restarts()
    # a change made to both servers that the unfinished apply already made restarts nothing
    before = topo({**seed, "service_manager": "process"})
    p = make_plan(desired, topo(ctx), runs={"prefill": proven, "decode": proven})
    assert p.restarts() == [] and p.counts() == (0, 0, 0) and p.kept() == ["role.prefill", "role.decode"]
    # a deployment-wide change the unfinished apply made to every role already restarts nothing either
    env = copy.deepcopy(seed)
    env["service_manager"] = "process"
    env["engine"]["env"] = {"X": "1"}
    assert make_plan(before, topo(env)).restarts() == ["decode", "prefill"]
    p = make_plan(before, topo(env), runs={"prefill": proven})
    assert p.restarts() == ["decode"] and p.kept() == []
    p = make_plan(before, topo(env), runs={"prefill": proven, "decode": proven})
    assert p.restarts() == [] and p.kept() == ["deployment"] and p.counts() == (0, 0, 0)
    # servers the unfinished apply restarted under a new model name: the process supervisor's router still
    # registers the old one and is restarted, unless that apply restarted it too
    renamed = copy.deepcopy(seed)
    renamed["service_manager"] = "process"
    renamed["model"]["served_name"] = "another-name"
    p = make_plan(before, topo(renamed), runs={"prefill": proven, "decode": proven})
    assert p.restarts() == ["router"] and p.kept() == ["role.prefill", "role.decode"]
    assert "      restarts: router" in render_text(p)
    p = make_plan(before, topo(renamed), runs={"prefill": proven, "decode": proven, "router": proven})
    assert p.restarts() == []
    # a reshape kept as it runs still needs its confirmation
    reshaped = copy.deepcopy(seed)
    reshaped["prefill"][0].update(tp=2, gpus=[0, 1])
    p = make_plan(desired, topo(reshaped), runs={"prefill": proven})
    assert p.requires_confirmation and p.plan_id == make_plan(desired, topo(reshaped)).plan_id
    assert p.kept() == ["role.prefill"] and p.restarts() == []


def test_a_role_an_unfinished_apply_left_running_otherwise_is_restarted_and_compared_with_what_runs():
    # (a context_length change interrupted after prefill_up: a third spec's plan said "131072 → 8192" while 65536 ran,
    # and the recorded spec's plan said no changes, then apply restarted prefill and decode)
    from pdctl.statemachine.plan import Runs

    seed = seed_dict()
    seed["service_manager"] = "process"  # (no router restarted with its servers)
    recorded = topo(seed)
    half = copy.deepcopy(seed)
    half["model"]["context_length"] = 65536
    target = topo(half)
    runs = {"prefill": Runs(restart="its unit file differs from the running process, which the unfinished apply "
                                    "started for its own spec", was=target.roles_of("prefill")[0]),
            "decode": Runs(restart="its unit file differs from the running process (rewritten)")}
    p = make_plan(recorded, recorded, runs=runs)
    assert p.plan_id == make_plan(recorded, recorded).plan_id and not p.requires_confirmation
    assert p.cls == "disruptive" and p.restarts() == ["prefill", "decode"] and p.counts() == (0, 2, 0)
    pre, dec = p.changes
    assert (pre.address, pre.action, pre.runs) == ("role.prefill", "update", runs["prefill"].restart)
    assert [(a.path, a.before, a.after) for a in pre.changes] == [("settings.model.context_length", 65536, 131072)]
    assert (dec.address, dec.action, dec.changes, dec.runs) == ("role.decode", "update", (), runs["decode"].restart)
    text = render_text(p)
    assert "No changes" not in text and "  # role.decode will be restarted (disruptive)" in text, text
    assert "      runs now: its unit file differs from the running process, which the unfinished apply" in text, text
    assert "      ~ settings.model.context_length: 65536 → 131072" in text, text
    # a third spec: each role compared with what it runs
    third = copy.deepcopy(seed)
    third["model"]["context_length"] = 8192
    p = make_plan(recorded, topo(third), runs=runs)
    assert p.restarts() == ["prefill", "decode"]
    assert {c.address: [(a.before, a.after) for a in c.changes] for c in p.changes} == {
        "role.prefill": [(65536, 8192)], "role.decode": [(131072, 8192)]}
    # a first deployment interrupted, then another first spec: its create of a running role restarts it
    p = make_plan(None, topo(third), runs={"prefill": runs["prefill"]})
    (c,) = [c for c in p.changes if c.address == "role.prefill"]
    assert (c.action, c.restarts, [(a.before, a.after) for a in c.changes]) == ("create", ("prefill",), [(65536, 8192)])
    assert p.restarts() == ["prefill"] and "  # role.prefill will be restarted (topology)" in render_text(p)


def _runs_fixture(tmp_path, monkeypatch, states: dict[str, str]):  # noqa: ANN202
    """The seed under the process supervisor, its context_length change (the target) interrupted once prefill_up had
    proven prefill, the decode unit rewritten and not restarted, the router started not proven: (loaded spec of
    the change, its journal state, the recorded deployment's spec dict). *states*: role → its unit's state, served by
    a stand-in service manager."""
    from pdctl.statemachine import launch, service
    from pdctl.statemachine.journal import StepRecord
    from pdctl.statemachine.steps import RESTARTING, STARTED, fingerprint_of
    from pdctl.units import ServiceStatus

    d = seed_dict()
    d["service_manager"] = "process"
    recorded = copy.deepcopy(d)
    d["model"]["context_length"] = 8192
    spec = tmp_path / "s.toml"
    spec.write_text(_toml_dump(d, list(range(8))))
    loaded = service.load(spec, state_dir=tmp_path / "state")
    units = launch.unit_set_for(loaded.deployment, state_dir=str(loaded.journal.dir))
    names = service.unit_names(topology_of(loaded.deployment))
    state = JournalState(
        name="dsv4-flash", deployed=topology_of(parse_spec(recorded)), target=topology_of(loaded.deployment),
        units={names["prefill"]: fingerprint_of(units, names["prefill"]), names["decode"]: RESTARTING,
               names["router"]: STARTED + fingerprint_of(units, names["router"])},
        steps={"kernels_built": StepRecord("skipped"), "prefill_up": StepRecord("done"),
               "decode_up": StepRecord("interrupted")})
    loaded.journal.write(state)

    class Manager:
        def status(self, unit: str) -> ServiceStatus:
            role = next(n for n, u in names.items() if u == unit)
            return ServiceStatus(name=unit, state=states.get(role, "inactive"), main_pid=4242)

        def installed_text(self, unit: str) -> str:
            return "[Service]"

        def installed_deployment(self, unit: str) -> str | None:
            return None  # (as a unit file pdctl did not write: no deployment of its own)

        def unit_file_not_pdctls(self, unit: str) -> str | None:
            return None

        def installed_units_of(self, deployment: str) -> list[str]:
            return []

        def running_elsewhere(self, deployment: str) -> list[tuple[str, str, int]]:
            return []

    monkeypatch.setattr(launch, "manager_for", lambda *a, **k: Manager())
    return loaded, loaded.journal.read(), recorded


def test_how_an_unfinished_apply_left_each_role_is_read_as_its_steps_will_judge_it(tmp_path, monkeypatch):
    from pdctl.statemachine import service

    states = {"prefill": "active", "decode": "active", "router": "activating"}
    loaded, state, recorded = _runs_fixture(tmp_path, monkeypatch, states)
    runs = service.runs_now(loaded, state)
    assert set(runs) == {"prefill", "decode", "router"}
    assert runs["prefill"].kept == "the unfinished apply started it with this spec's definition and proved it"
    assert runs["router"].kept.startswith("the unfinished apply started it with this spec's definition; apply waits")
    assert runs["decode"].restart.startswith("its unit file differs from the running process (the unfinished apply "
                                             "rewrote the file") and runs["decode"].was is None
    # a third spec: what prefill and the router run is the unfinished apply's spec, not this one's
    third = copy.deepcopy(recorded)
    third["model"]["context_length"] = 4096
    third["router"]["policy"] = "round_robin"
    spec = tmp_path / "third.toml"
    spec.write_text(_toml_dump(third, list(range(8))))
    runs = service.runs_now(service.load(spec, state_dir=loaded.journal.dir), state)
    assert runs["prefill"].kept is None and runs["prefill"].was == state.target.roles_of("prefill")[0]
    assert runs["prefill"].restart == "it runs what the unfinished apply started for its own spec, not this spec's " \
        "definition"
    assert runs["router"].was == state.target.router and runs["decode"].was is None
    # a unit that does not run is left to not_running (apply starts it); with no apply unfinished there is nothing
    states["decode"] = "inactive"
    assert set(service.runs_now(loaded, state)) == {"prefill", "router"}
    state.target = None
    assert service.runs_now(loaded, state) == {}


def test_plan_after_an_interrupted_change_says_which_restarts_apply_keeps(tmp_path, monkeypatch, capsys):
    # (the plan listed prefill among the restarts although the resumed apply keeps the prefill its interrupted run
    # already restarted and proved with these settings; it only said so in a note)
    from pdctl.console import cli

    loaded, _state, _recorded = _runs_fixture(tmp_path, monkeypatch, {"prefill": "active", "decode": "active",
                                                                      "router": "active"})
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", str(loaded.path), "--state-dir", str(loaded.journal.dir), "--json"])
    out = capsys.readouterr().out
    assert e.value.code == 2, out
    data = json.loads(out)
    by = {c["address"]: c for c in data["changes"]}
    assert by["role.prefill"]["kept"].endswith("and proved it") and by["role.prefill"]["restarts"] == []
    assert by["role.decode"]["kept"] is None and by["role.decode"]["restarts"] == ["decode"]
    assert by["role.decode"]["runs"].startswith("its unit file differs from the running process")
    assert set(by) == {"role.prefill", "role.decode"}  # (the router's unit is the same: no change, none kept)


def test_an_empty_list_is_shown_as_one_in_the_plan():
    # (a list emptied by the spec read "~ prefill: [[…]] → " with nothing after the arrow)
    from pdctl.statemachine.plan import format_value

    assert format_value([]) == "[]" and format_value(()) == "[]"
    assert format_value([0, 1, 2, 3]) == "0,1,2,3" and format_value([[0, 1]]) == "[[0, 1]]"


@pytest.mark.parametrize("argv", [["apply", "s.toml", "--json"], ["--apply", "s.toml"], ["plan", "s.toml"],
                                  ["status", "s.toml"], ["chat", "s.toml"], ["down", "s.toml"], ["validate", "s.toml"],
                                  ["units", "s.toml", "-o", "u"], ["logs", "s.toml", "-f"]])
def test_an_interrupt_while_the_command_line_is_parsed_says_what_the_command_would(argv, monkeypatch, capsys):
    # Ctrl-C after pdctl's modules loaded but before the command's own code ran (typer building and parsing the
    # command line, a fraction of a second): plan printed apply's "what already runs stays as it is … converge", and
    # `apply --json` ended with an empty stream
    from pdctl.console import cli

    def interrupted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise KeyboardInterrupt

    monkeypatch.setattr(type(cli.app), "__call__", interrupted)  # (typer's app, called by main to parse and run)
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    out, err = capsys.readouterr()
    assert exit_.value.code == 130
    command = "apply" if "apply" in argv[0] else argv[0]
    if command == "apply":
        assert err.strip() == "interrupted before the apply started: nothing was changed; run the same command again"
    elif command == "plan":
        assert err.strip() == "interrupted: a plan changes nothing; run it again"
    elif command == "status":  # (it said apply's "what already runs stays as it is … converge")
        assert err.strip() == "interrupted: status only reads, it changes nothing; run it again"
    elif command == "chat":
        assert err.strip() == ("interrupted: the chat was abandoned unanswered (it changes nothing of the deployment); "
                               "run it again")
    elif command == "down":  # (down, validate and units said apply's "what already runs stays as it is … converge")
        assert err.strip() == "interrupted before down started: nothing was stopped; run it again"
    elif command == "validate":
        assert err.strip() == "interrupted: validate only reads the spec, it changes nothing; run it again"
    elif command == "logs":
        assert err.strip() == "interrupted: logs only reads, it changes nothing"
    else:
        assert err.strip() == "interrupted before the unit files were written: nothing was written; run it again"
    if "--json" in argv:
        event = json.loads(out)
        assert (event["kind"], event["data"]["plan_id"]) == ("apply_interrupted", None), event
        assert "nothing was changed" in event["message"]
    else:
        assert out == ""


@pytest.mark.parametrize("sig,code", [("SIGTERM", 143), ("SIGHUP", 129)])
def test_a_sigterm_or_sighup_while_the_command_line_is_parsed_says_what_the_command_would(sig, code, tmp_path):
    # Ctrl-C there said plan's line; SIGTERM / SIGHUP (before plan installs its handler) ended pdctl at once, exit
    # 143 / 129 with nothing said (a fresh user, `timeout -s TERM 0.4 pdctl plan SPEC`).
    import subprocess
    import sys

    script = tmp_path / "parse.py"
    script.write_text(
        "import os, signal, sys\n"
        "from pdctl.console import cli\n"
        "parse = type(cli.app).__call__\n"
        "def parsing(self, *a, **k):\n"
        f"    os.kill(os.getpid(), signal.{sig})\n"
        "    return parse(self, *a, **k)\n"
        "type(cli.app).__call__ = parsing\n"
        "cli.main(['plan', 'absent.toml'])\n")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == code, (r.returncode, r.stderr)
    said = {"SIGTERM": "terminated (SIGTERM); ", "SIGHUP": "hung up (SIGHUP); "}[sig]
    assert r.stderr == f"{said}interrupted: a plan changes nothing; run it again\n" and r.stdout == "", r.stderr


def test_plan_json_carries_the_specs_warnings_as_validate_lists_them(tmp_path):
    # A warning was only on stderr: a script reading `plan --json` missed e.g. a parser that will fail
    # parsers_configured after both servers restarted.
    d = seed_dict()
    d["service_manager"] = "process"
    d["prefill"][0]["gpus"], d["prefill"][0]["tp"] = [0, 1, 2], 3
    d["decode"][0]["gpus"] = [3, 5, 6, 7]  # spans NUMA nodes 0 and 1: a warning
    spec = tmp_path / "warn.toml"
    spec.write_text(_toml_dump(d, list(range(8))))
    env = {**os.environ, "PDCTL_STATE_DIR": str(tmp_path / "state")}
    r = _pdctl("plan", str(spec), "--json", env=env)
    assert r.returncode == 2, r.stderr
    warnings = json.loads(r.stdout)["warnings"]
    assert [w["field"] for w in warnings] == ["decode[0].numa_node"], warnings
    assert warnings == json.loads(_pdctl("validate", str(spec), "--json", env=env).stdout)["warnings"]
    assert Plan.model_validate_json(r.stdout).warnings == tuple(warnings)  # a plan file reads back with them
    assert "warning: decode[0].numa_node" in r.stderr  # (and stderr still says it)


def test_apply_option_is_read_with_a_space_or_an_equals_sign():
    from pdctl.console.cli import _rewrite

    assert _rewrite(["--apply", "x.toml"]) == ["apply", "x.toml"]
    assert _rewrite(["--apply=x.toml"]) == ["apply", "x.toml"]
    assert _rewrite(["--json", "--apply=x.toml", "--confirm-topology", "ab"]) == ["apply", "--json", "x.toml",
                                                                                  "--confirm-topology", "ab"]
    assert _rewrite(["chat", "x.toml", "--", "--apply=y"]) == ["chat", "x.toml", "--", "--apply=y"]  # (after --)


def test_dropping_an_explicit_numa_node_that_gpu_numa_gives_anyway_plans_nothing():
    # (it was planned as a topology change, needing a confirmation, for a unit that binds exactly as before)
    seed = seed_dict()
    other = copy.deepcopy(seed)
    for kind in ("prefill", "decode"):
        del other[kind][0]["numa_node"]
    assert not make_plan(topo(seed), topo(other)).has_changes
    assert not make_plan(topo(other), topo(seed)).has_changes  # and writing it out
    moved = copy.deepcopy(seed)
    moved["decode"][0]["numa_node"] = 0  # a node its GPUs are not on: a change as before
    p = make_plan(topo(seed), topo(moved))
    assert [(a.path, a.before, a.after, a.cls) for c in p.changes for a in c.changes if a.path == "numa_node"] == [
        ("numa_node", 1, 0, "topology")]


@pytest.mark.parametrize(("kind", "host", "port", "said"), [
    ("prefill", "0.0.0.0", None, "prefill 'prefill' reachable around the router: 127.0.0.1:30010 → 0.0.0.0:30010 "
                                 "(every interface)"),
    ("decode", "10.0.0.5", None, "decode 'decode' reachable around the router: 127.0.0.1:30020 → 10.0.0.5:30020"),
    ("decode", "::", 30001, "decode 'decode' reachable around the router: 127.0.0.1:30020 → [::]:30001 "
                            "(every interface), the port clients reached the router on"),
    ("decode", None, 30001, "decode 'decode' reachable around the router: 127.0.0.1:30020 → 127.0.0.1:30001, "
                            "the port clients reached the router on"),
])
def test_a_server_behind_the_router_exposed_around_it_is_a_topology_change_said_in_words(kind, host, port, said):
    # (an engine put on 0.0.0.0, or moved onto the port the router left, was "disruptive": applied with no
    # confirmation, clients reaching the bare engine around the router)
    seed = seed_dict()
    seed["router"]["host"] = "127.0.0.1"
    other = copy.deepcopy(seed)
    if host is not None:
        other[kind][0]["http_host"] = host
    if port is not None:
        other[kind][0]["port"] = port
        other["router"]["port"] = 30002
    p = make_plan(topo(seed), topo(other))
    assert p.cls == "topology" and said in p.topology_changes, p.topology_changes
    narrowed = make_plan(topo(other), topo(seed)) if port is None else None  # back to loopback: no confirmation
    assert narrowed is None or narrowed.cls == "disruptive", narrowed and narrowed.topology_changes


def test_a_server_moved_between_loopback_addresses_is_no_exposure_change():
    seed = seed_dict()
    other = copy.deepcopy(seed)
    other["prefill"][0]["http_host"] = "127.0.0.2"
    assert make_plan(topo(seed), topo(other)).cls == "disruptive"


def test_the_same_change_planned_again_after_the_deployment_went_elsewhere_gets_another_id():
    # (PD → single server confirmed with id X; back to PD; `apply single.toml --confirm-topology X` replayed from
    # history collapsed PD again, nobody having seen a fresh plan)
    pd, single = topo(seed_dict()), topo(collapsed(seed_dict()))
    first = make_plan(pd, single, generation=3)
    assert make_plan(pd, single, generation=3).plan_id == first.plan_id  # (re-planned, nothing applied: the same)
    assert make_plan(pd, single, from_serial=9, generation=3).plan_id == first.plan_id  # (an unfinished apply's writes)
    assert make_plan(pd, single, generation=5).plan_id != first.plan_id


def test_pd_turned_into_two_regular_servers_is_not_called_a_single_server():
    seed = seed_dict()
    two = collapsed(seed_dict())
    two["server"] = [{**two["server"][0], "gpus": [0, 1, 2, 3], "tp": 4, "port": 30010, "name": "a"},
                     {**two["server"][0], "gpus": [4, 5, 6, 7], "tp": 4, "port": 30020, "name": "b"}]
    two["router"] = {"host": "127.0.0.1", "port": 30001, "prometheus_port": 29000}
    p = make_plan(topo(seed), topo(two))
    assert "PD disaggregation → 2 regular servers (no PD)" in p.topology_changes, p.topology_changes


def test_a_saved_plan_given_to_validate_or_plan_is_named_for_what_it_is(tmp_path):
    # (it read "TOML syntax error … line 1": the plan is a spec's product, applied with `pdctl apply PLANFILE`)
    out = tmp_path / "p.json"
    assert _pdctl("plan", str(SEED), "--state-dir", str(tmp_path / "s"), "-o", str(out)).returncode == 2
    for cmd in (("validate",), ("plan", "--state-dir", str(tmp_path / "s"))):
        r = _pdctl(cmd[0], str(out), *cmd[1:])
        assert r.returncode == 1, r.stderr
        assert f"{out} is a plan saved by `pdctl plan -o`, not a spec" in r.stderr, r.stderr
        assert f"`pdctl apply {out}` applies it" in r.stderr and "TOML syntax error" not in r.stderr


def test_apply_with_the_spec_taken_for_the_confirmation_id_says_so():
    # (`apply --confirm-topology spec.toml`: "Missing argument 'SPEC'" alone, the spec read as the plan id)
    r = _pdctl("apply", "--confirm-topology", str(SEED))
    assert r.returncode == 64 and "Missing argument 'SPEC'" in r.stderr, r.stderr
    assert f"hint: --confirm-topology took {str(SEED)!r} as its plan id" in r.stderr, r.stderr
    r = _pdctl("apply", "--confirm-topology", "0123456789abcdef")  # (a real id, the spec left out: no such hint)
    assert r.returncode == 64 and "took" not in r.stderr, r.stderr
    r = _pdctl("apply", "--json", f"--confirm-topology={SEED}")  # (the = form; --json's event carries the hint)
    assert r.returncode == 64 and f"hint: --confirm-topology took {str(SEED)!r}" in r.stderr, r.stderr
    event = json.loads(r.stdout.splitlines()[-1])
    assert event["data"]["hint"].startswith(f"--confirm-topology took {str(SEED)!r} as its plan id"), event


@pytest.mark.parametrize(("before", "after", "confirmed"), [
    ("0.0.0.0", "::", True),  # (every IPv4 interface to every IPv6 one: networks it was not on)
    ("gpu1", "192.0.2.2", True),  # (127.0.0.1 → a name, confirmed, then → an address: not a free second step)
    ("10.0.0.5", "10.0.0.6", True),
    ("::", "::1", False),
    ("10.0.0.5", "localhost", False),
])
def test_any_move_of_a_server_behind_the_router_off_loopback_is_confirmed(before, after, confirmed):
    seed = seed_dict()
    seed["prefill"][0]["http_host"] = before
    other = copy.deepcopy(seed)
    other["prefill"][0]["http_host"] = after
    assert make_plan(topo(seed), topo(other)).requires_confirmation is confirmed


def test_a_deployment_recorded_before_service_user_existed_plans_no_change_without_it():
    # (a journal's topology has no service_user key: one left unset must not read as a change, which would restart
    # every role of a deployment after an upgrade of pdctl)
    from .specs import demo_dict

    before = topo(demo_dict())
    recorded = before.model_copy(update={"deployment": {k: v for k, v in before.deployment.items()
                                                        if k != "service_user"}})
    assert "service_user" not in before.deployment
    assert make_plan(recorded, topo(demo_dict())).changes == ()


def test_units_no_journal_records_make_a_first_deployment_a_topology_change_to_confirm():
    from .specs import demo_dict

    desired = topo(demo_dict())
    first = make_plan(None, desired)
    assert not first.requires_confirmation and first.unrecorded == ()
    units = (f"pdctl-{desired.name}-old.service", f"pdctl-{desired.name}-router.service")
    taken = make_plan(None, desired, unrecorded=units)
    assert taken.requires_confirmation and taken.plan_id != first.plan_id  # (the id binds what it takes over)
    assert make_plan(None, desired, unrecorded=units[:1]).plan_id != taken.plan_id
    deleted = [c for c in taken.changes if c.action == "delete"]
    assert [(c.address, c.cls) for c in deleted] == [("role.old", "topology")], taken.changes
    router = next(c for c in taken.changes if c.address == "router")
    assert router.runs and "apply rewrites and restarts it" in router.runs
    assert taken.counts() == (first.counts()[0], 0, 1)
    # (with a deployment recorded, what the journal says stands: no takeover)
    assert make_plan(desired, desired, unrecorded=units).unrecorded == ()


@pytest.mark.parametrize("given", ["", "  "])
def test_an_empty_confirmation_is_named_as_empty_not_as_another_plan(given):
    # (helper-109: `--confirm-topology ''` said "--confirm-topology  names another plan", double space and all)
    from pdctl.statemachine.errors import TopologyNotConfirmed
    from pdctl.statemachine.service import _resolve_confirmation

    from .specs import collapsed, seed_dict

    plan = make_plan(topo(seed_dict()), topo(collapsed(seed_dict())))
    assert plan.requires_confirmation
    with pytest.raises(TopologyNotConfirmed) as e:
        _resolve_confirmation(plan, given)
    assert e.value.message == "--confirm-topology was given an empty plan id; nothing was changed"
    assert plan.plan_id in e.value.hint
    _resolve_confirmation(plan, plan.plan_id)  # (its own id: confirmed)


@pytest.mark.parametrize("address", ["127.0.0.1", "::1", "LOCALHOST", "127.0.0.2"])
def test_another_name_for_this_machine_moves_no_role(address):
    # (helper-109: address = "localhost" written as "127.0.0.1" replaced prefill and decode, a topology change to
    # confirm, for the same machine; a deployment-wide change restarted every role besides)
    from .specs import demo_dict

    d = demo_dict()
    other = copy.deepcopy(d)
    other["hosts"]["local"]["address"] = address
    assert make_plan(topo(d), topo(other)).changes == ()
    away = copy.deepcopy(d)
    away["hosts"]["local"]["address"] = "10.0.0.5"  # (another machine: its roles are replaced, confirmed)
    assert make_plan(topo(d), topo(away)).requires_confirmation


def test_a_restart_asked_for_restarts_that_role_alone_and_keeps_the_plan_id():
    # (new weights at the same path, an engine upgraded in place: nothing of the spec changed, so no plan restarted it;
    # under the process supervisor only kill -9 of its main process did)
    demo = copy.deepcopy(seed_dict())
    demo["service_manager"] = "process"
    t = topo(demo)
    p = make_plan(t, t, restart=["decode"])
    assert [(c.address, c.action, c.cls, c.restarts) for c in p.changes] == [
        ("role.decode", "update", "disruptive", ("decode",))]
    assert p.changes[0].asked == "asked on the command line (--restart decode)" and p.changes[0].changes == ()
    assert p.restarts() == ["decode"] and not p.requires_confirmation and p.has_changes
    assert p.plan_id == make_plan(t, t).plan_id  # (what is deployed and what is asked are the same two topologies)
    text = render_text(p)
    assert "# role.decode will be restarted (disruptive)" in text and "asked: asked on the command line" in text, text
    both = make_plan(t, t, restart=["router", "prefill", "router"])
    assert [c.address for c in both.changes] == ["role.prefill", "router"] and both.restarts() == ["prefill", "router"]
    # under systemd too the router keeps running while a server restarts (Wants=, not Requires=)
    systemd = topo(seed_dict())
    assert make_plan(systemd, systemd, restart=["decode"]).restarts() == ["decode"]
    # a role the change restarts anyway gets no second entry; one the spec lacks is refused
    wider = copy.deepcopy(demo)
    wider["decode"][0]["env"] = {"SGLANG_X": "1"}
    changed = make_plan(t, topo(wider), restart=["decode"])
    assert changed.changes == make_plan(t, topo(wider)).changes
    with pytest.raises(ValueError, match="cannot restart 'decoder'"):
        make_plan(t, t, restart=["decoder"])


def test_the_plan_says_how_clients_fare_while_it_restarts_roles():
    one = seed_dict()
    t = topo(one)
    assert make_plan(None, t).client_impact() == []  # (a first deployment serves nobody yet)
    p = make_plan(t, t, restart=["prefill"])
    assert p.client_impact() == ["clients get 503 while prefill restarts: one prefill"]
    assert "clients get 503 while prefill restarts: one prefill" in render_text(p)
    assert json.loads(p.to_json())["client_impact"] == p.client_impact()
    # a second prefill serves while the first restarts (taken out of the router, put back once proven)
    two = copy.deepcopy(one)
    two["prefill"].append({**one["prefill"][0], "gpus": [8, 9, 10, 11], "port": 30310, "bootstrap_port": 8999,
                           "nccl_port": 30320})
    t2 = topo(two)
    assert make_plan(t2, t2, restart=["prefill"]).client_impact() == []
    assert "Clients while it applies" not in render_text(make_plan(t2, t2, restart=["prefill"]))
    # the router restarting cuts every client off, and the replicas it restarts with it restart in place
    both = make_plan(t2, t2, restart=["router", "prefill", "prefill-1"]).client_impact()
    assert len(both) == 2 and "router" in both[0] and "prefill, prefill-1" in both[1], both
