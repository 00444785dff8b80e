"""Secrets from the spec reach processes only through the 0600 environment file."""

from __future__ import annotations

import json
import stat
import subprocess
import sys

import pytest

from pdctl.statemachine.launch import services_for, write_units
from pdctl.statemachine.spec import parse_spec

from .specs import dump_toml, seed_dict


def test_spec_secrets_go_to_the_environment_file_never_the_unit(tmp_path, monkeypatch):
    monkeypatch.setenv("PDCTL_TEST_HF", "hf_from_env")
    d = seed_dict()
    d["secrets"] = {"HF_TOKEN": "env:PDCTL_TEST_HF", "MODEL_HUB_AUTH": "literal-value"}
    dep = parse_spec(d)
    for svc in services_for(dep):
        assert "HF_TOKEN" not in dict(svc.env) and "MODEL_HUB_AUTH" not in dict(svc.env)
        assert dict(svc.secrets) == {"HF_TOKEN": "hf_from_env", "MODEL_HUB_AUTH": "literal-value"}
        assert svc.secrets_file == f"/etc/pdctl/dsv4-flash/{svc.role}.env"
    written = write_units(dep, tmp_path)
    units = [p for p in written if p.suffix == ".service"]
    envs = [p for p in written if p.suffix == ".env"]
    assert units and len(envs) == 3
    for p in units:
        text = p.read_text()
        assert "hf_from_env" not in text and "literal-value" not in text
        assert "EnvironmentFile=" in text
    for p in envs:
        assert stat.S_IMODE(p.stat().st_mode) == 0o600
        assert "hf_from_env" in p.read_text()


def test_units_into_a_directory_with_a_foreign_file_is_refused_cleanly(tmp_path):
    spec = tmp_path / "seed.toml"
    spec.write_text(dump_toml(seed_dict()))
    out = tmp_path / "units"
    out.mkdir()
    (out / "pdctl-dsv4-flash-prefill.service").write_text("[Service]\nExecStart=/bin/true\n")
    r = subprocess.run([sys.executable, "-m", "pdctl", "units", str(spec), "-o", str(out)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "not written by pdctl" in r.stderr and "Traceback" not in r.stderr
    # the fix is another folder or moving that file (it said "give -o/--out a path this user can write", which it was)
    assert (f"hint: give -o/--out another folder (e.g. -o ./units), or move {out / 'pdctl-dsv4-flash-prefill.service'} "
            "aside if it is an old copy of it") in r.stderr, r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["pdctl-dsv4-flash-prefill.service"]


def test_a_secret_whose_variable_is_unset_is_refused_by_name(monkeypatch):
    # (it went to the units as HF_TOKEN='', and the model download failed long after a "successful" apply)
    import pytest

    from pdctl.statemachine.errors import PdctlError

    monkeypatch.delenv("PDCTL_TEST_UNSET", raising=False)
    d = seed_dict()
    d["secrets"] = {"HF_TOKEN": "env:PDCTL_TEST_UNSET"}
    with pytest.raises(PdctlError, match=r"secrets.HF_TOKEN = 'env:PDCTL_TEST_UNSET': not set in pdctl's environment") as e:
        services_for(parse_spec(d))
    assert "export PDCTL_TEST_UNSET" in e.value.hint
    monkeypatch.setenv("PDCTL_TEST_UNSET", "")  # what a CI system makes of a missing secret: refused as well
    with pytest.raises(PdctlError, match=r"secrets.HF_TOKEN = 'env:PDCTL_TEST_UNSET': the value is empty"):
        services_for(parse_spec(d))
    d["secrets"] = {"HF_TOKEN": ""}
    with pytest.raises(PdctlError, match=r"secrets.HF_TOKEN = '': the value is empty"):
        services_for(parse_spec(d))
    monkeypatch.setenv("PDCTL_TEST_UNSET", "hf_x")
    d["secrets"] = {"HF_TOKEN": "env:PDCTL_TEST_UNSET"}
    assert all(dict(s.secrets) == {"HF_TOKEN": "hf_x"} for s in services_for(parse_spec(d)))


def test_a_secrets_fingerprint_is_salted_and_slow_not_its_sha256():
    # "sha256:" + the first 16 hex of SHA-256 let anyone reading a plan, a plan -o file or the journal look up or
    # brute-force a short token at hash speed
    import hashlib

    from pdctl.statemachine.topology import topology_of

    d = seed_dict()
    d["secrets"] = {"HF_TOKEN": "hunter2", "OTHER_TOKEN": "hunter2"}
    fp = topology_of(parse_spec(d)).deployment["secrets"]
    plain = hashlib.sha256(b"hunter2").hexdigest()
    assert all(plain[:16] not in v and v.startswith("scrypt:") for v in fp.values()), fp
    assert fp["HF_TOKEN"] != fp["OTHER_TOKEN"]  # salted per key (and per deployment)
    assert fp == topology_of(parse_spec(d)).deployment["secrets"]  # stable: a rotation is still seen as one
    d["secrets"]["HF_TOKEN"] = "hunter3"
    assert topology_of(parse_spec(d)).deployment["secrets"]["HF_TOKEN"] != fp["HF_TOKEN"]


def test_a_rotated_secret_is_a_change_that_restarts_the_roles(monkeypatch):
    from pdctl.statemachine.plan import make_plan
    from pdctl.statemachine.topology import topology_of

    d = seed_dict()
    d["secrets"] = {"HF_TOKEN": "env:PDCTL_TEST_HF"}
    monkeypatch.setenv("PDCTL_TEST_HF", "hf_old")
    before = topology_of(parse_spec(d))
    monkeypatch.setenv("PDCTL_TEST_HF", "hf_new")
    after = topology_of(parse_spec(d))
    p = make_plan(before, after)
    assert p.cls == "disruptive" and p.has_changes
    assert "hf_old" not in p.model_dump_json() and "hf_new" not in p.model_dump_json()
    monkeypatch.setenv("PDCTL_TEST_HF", "hf_old")
    assert not make_plan(before, topology_of(parse_spec(d))).has_changes



def test_an_upgrade_does_not_take_an_unchanged_secret_for_a_rotation(tmp_path, monkeypatch):
    # A journal an older pdctl wrote holds "sha256:<16 hex>" fingerprints; compared as they are with today's scrypt
    # ones, every deployment with a secret planned a rotation and restarted all its roles after the upgrade
    import hashlib

    from pdctl.statemachine.journal import JournalState
    from pdctl.statemachine.plan import make_plan
    from pdctl.statemachine.service import journal_for
    from pdctl.statemachine.topology import topology_of

    monkeypatch.setenv("PDCTL_TEST_HF", "hf_same")
    d = seed_dict()
    d["secrets"] = {"HF_TOKEN": "env:PDCTL_TEST_HF", "OTHER_TOKEN": "literal"}
    dep = parse_spec(d)
    now = topology_of(dep)
    legacy = {k: "sha256:" + hashlib.sha256(v.encode()).hexdigest()[:16]
              for k, v in (("HF_TOKEN", "hf_same"), ("OTHER_TOKEN", "literal"))}
    old = now.model_copy(update={"deployment": {**now.deployment, "secrets": legacy}})
    j = journal_for(dep, tmp_path)
    j.write(JournalState(name=dep.name, deployed=old))
    assert not make_plan(j.read().deployed, now).has_changes
    monkeypatch.setenv("PDCTL_TEST_HF", "hf_rotated")  # rotated since: still the rotation it is
    p = make_plan(j.read().deployed, topology_of(dep))
    assert [a.path for c in p.changes for a in c.changes] == ["deployment.secrets.HF_TOKEN"]


def _user_scope_with_a_secret(monkeypatch) -> dict:  # noqa: ANN001
    """The seed under a systemd user manager, with one secret from the environment (set here)."""
    monkeypatch.setenv("PDCTL_TEST_HF", "hf_from_env")
    d = seed_dict()
    d["service_manager"] = "systemd-user"
    d["secrets"] = {"HF_TOKEN": "env:PDCTL_TEST_HF"}
    return d


def _user_scope_spec_with_a_secret(tmp_path, monkeypatch):  # noqa: ANN001, ANN202
    spec = tmp_path / "user.toml"
    spec.write_text(dump_toml(_user_scope_with_a_secret(monkeypatch)))
    return spec


def test_units_names_the_secrets_file_apply_installs_for_a_user_scope_spec(tmp_path, monkeypatch):
    # `pdctl units` is the review of what apply installs: a user-scope spec's EnvironmentFile= is under the state
    # directory (the journal's), as apply writes it; it named ~/.config/pdctl/<name>/secrets instead.
    spec = _user_scope_spec_with_a_secret(tmp_path, monkeypatch)
    state = tmp_path / "state"
    r = subprocess.run([sys.executable, "-m", "pdctl", "units", str(spec), "-o", str(tmp_path / "u"),
                        "--state-dir", str(state)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    from pdctl.statemachine.service import load

    journal_dir = load(spec, state_dir=state).journal.dir
    text = (tmp_path / "u" / "pdctl-dsv4-flash-decode.service").read_text()
    assert f"EnvironmentFile={journal_dir}/secrets/decode.env" in text, text


def test_a_state_directory_systemd_cannot_name_refuses_the_apply_before_it_starts(tmp_path, monkeypatch):
    # The secrets' EnvironmentFile= under a state directory with a space: refused with the fix before the first step
    # (it was a ValueError traceback from prefill_up's install, the step then journalled as interrupted).
    from types import SimpleNamespace

    from pdctl.statemachine.errors import ApplyFailed
    from pdctl.statemachine.launch import unit_set_for
    from pdctl.statemachine.steps import unit_files_unrenderable
    from pdctl.statemachine.topology import topology_of

    dep = parse_spec(_user_scope_with_a_secret(monkeypatch))
    ok = SimpleNamespace(manager=SimpleNamespace(scope="user"), topology=topology_of(dep),
                         units=unit_set_for(dep, state_dir=str(tmp_path / "state")))
    unit_files_unrenderable(ok)
    bad = SimpleNamespace(**{**vars(ok), "units": unit_set_for(dep, state_dir=str(tmp_path / "my state"))})
    with pytest.raises(ApplyFailed, match="a unit file cannot be written: EnvironmentFile") as e:
        unit_files_unrenderable(bad)
    assert e.value.step == "prefill_up" and "--state-dir" in e.value.hint
    unit_files_unrenderable(SimpleNamespace(**{**vars(bad), "manager": SimpleNamespace()}))  # no unit files to write


def test_units_with_a_state_directory_systemd_cannot_name_is_an_error_not_a_traceback(tmp_path, monkeypatch):
    spec = _user_scope_spec_with_a_secret(tmp_path, monkeypatch)
    r = subprocess.run([sys.executable, "-m", "pdctl", "units", str(spec), "-o", str(tmp_path / "u"),
                        "--state-dir", str(tmp_path / "my state")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "error: the units cannot be written: EnvironmentFile" in r.stderr and "hint: give --state-dir" in r.stderr
    assert not (tmp_path / "u").exists()


def test_plan_warns_of_a_state_directory_systemd_cannot_name(tmp_path, monkeypatch):
    # (apply refused it before its first step, exit 3, while the plan of the same spec and state directory said
    # nothing: its host checks rendered the units without the secrets' EnvironmentFile=)
    spec = _user_scope_spec_with_a_secret(tmp_path, monkeypatch)
    for state, warned in ((tmp_path / "my state", True), (tmp_path / "state", False)):
        r = subprocess.run([sys.executable, "-m", "pdctl", "plan", str(spec), "--json", "--state-dir", str(state)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, r.stderr
        said = json.loads(r.stdout)["binds_unusable"] or ""
        assert ("a unit file cannot be written: EnvironmentFile" in said and "hint: give --state-dir" in said) is warned, said
    r = subprocess.run([sys.executable, "-m", "pdctl", "plan", str(spec), "--state-dir", str(tmp_path / "my state")],
                       capture_output=True, text=True, timeout=60)
    assert "Warning: `pdctl apply` stops before its first step (exit 3" in r.stdout, r.stdout
    assert "a unit file cannot be written" in r.stdout, r.stdout


def _scoped(monkeypatch) -> dict:  # noqa: ANN001
    """The seed with a model-hub token for the servers only and an API key for the router only."""
    monkeypatch.setenv("PDCTL_TEST_HF", "hf_servers_only")
    monkeypatch.setenv("PDCTL_TEST_KEY", "key_router_only")
    d = seed_dict()
    d["secrets"] = {"HF_TOKEN": {"value": "env:PDCTL_TEST_HF", "roles": ["prefill", "decode"]},
                    "ROUTER_API_KEY": {"value": "env:PDCTL_TEST_KEY", "roles": ["router"]},
                    "SHARED_TOKEN": "env:PDCTL_TEST_KEY"}
    return d


def test_a_secret_given_roles_reaches_only_those_roles(tmp_path, monkeypatch):
    # (every [secrets] entry went to every unit: the router, exposed on the deployment's one port, held the model
    # hub's token it never uses)
    dep = parse_spec(_scoped(monkeypatch))
    got = {s.role: dict(s.secrets) for s in services_for(dep)}
    assert got == {"prefill": {"HF_TOKEN": "hf_servers_only", "SHARED_TOKEN": "key_router_only"},
                   "decode": {"HF_TOKEN": "hf_servers_only", "SHARED_TOKEN": "key_router_only"},
                   "router": {"ROUTER_API_KEY": "key_router_only", "SHARED_TOKEN": "key_router_only"}}
    written = {p.name: p.read_text() for p in write_units(dep, tmp_path) if p.suffix == ".env"}
    assert "hf_servers_only" not in written["router.env"] and "hf_servers_only" in written["prefill.env"]
    assert "ROUTER_API_KEY" not in written["decode.env"] and "ROUTER_API_KEY" in written["router.env"]
    # a kind names every role of it: a second decode group gets the token too
    d = _scoped(monkeypatch)
    d["decode"].append({**d["decode"][0], "gpus": [0, 1, 2, 3], "port": 30021, "nccl_port": 30121})
    d["secrets"]["HF_TOKEN"]["roles"] = ["decode"]
    got = {s.role: dict(s.secrets) for s in services_for(parse_spec(d))}
    assert "HF_TOKEN" in got["decode"] and "HF_TOKEN" in got["decode-1"] and "HF_TOKEN" not in got["prefill"]


def test_a_scoped_secrets_rotation_restarts_only_the_roles_that_get_it(monkeypatch):
    from pdctl.statemachine.plan import make_plan
    from pdctl.statemachine.topology import topology_of

    d = _scoped(monkeypatch)
    d["secrets"].pop("SHARED_TOKEN")
    before = topology_of(parse_spec(d))
    monkeypatch.setenv("PDCTL_TEST_KEY", "key_rotated")
    p = make_plan(before, topology_of(parse_spec(d)))
    assert [(c.address, c.restarts) for c in p.changes] == [("router", ("router",))]
    assert [a.path for c in p.changes for a in c.changes] == ["settings.secrets.ROUTER_API_KEY"]
    assert "key_rotated" not in p.model_dump_json()
    monkeypatch.setenv("PDCTL_TEST_KEY", "key_router_only")
    monkeypatch.setenv("PDCTL_TEST_HF", "hf_rotated")
    p = make_plan(before, topology_of(parse_spec(d)))
    assert {c.address for c in p.changes} == {"role.prefill", "role.decode"}
    monkeypatch.setenv("PDCTL_TEST_HF", "hf_servers_only")
    assert not make_plan(before, topology_of(parse_spec(d))).has_changes


@pytest.mark.parametrize(("roles", "field", "words"), [
    (["prefil"], "secrets.HF_TOKEN.roles[0]", "'prefil' is neither a role of this spec nor a kind of role"),
    ([], "secrets.HF_TOKEN.roles", "must not be empty"),
    (None, "secrets.HF_TOKEN.roles", "required"),
])
def test_a_secrets_roles_that_name_no_role_are_a_finding_with_its_fix(roles, field, words):
    from pdctl.statemachine.errors import SpecError

    d = seed_dict()
    d["secrets"] = {"HF_TOKEN": {"value": "env:X"} if roles is None else {"value": "env:X", "roles": roles}}
    with pytest.raises(SpecError) as e:
        parse_spec(d)
    text = str(e.value)
    assert f"{field}: {words}" in text, text
    assert "secret-table" not in text and "secret-text" not in text and "Secret" not in text
    if roles == ["prefil"]:
        assert "name roles (prefill, decode, server, router), or remove 'prefil'" in text


def test_a_secret_for_a_kind_the_spec_lacks_is_taken_and_warned_of_when_no_role_gets_it(monkeypatch):
    # (one [secrets] table serves a spec before and after a change of shape: "server" in a PD spec, "router" in one
    # without [router], are kinds, not misspellings; a secret that reaches no role at all is worth a warning)
    from pdctl.statemachine.rules import validate

    d = _scoped(monkeypatch)
    del d["router"]  # (refused for a PD spec: validate lists that beside the warning)
    d["secrets"]["HF_TOKEN"]["roles"] = ["server", "prefill", "decode"]
    dep = parse_spec(d)
    got = {s.role: dict(s.secrets) for s in services_for(dep)}
    assert got == {"prefill": {"HF_TOKEN": "hf_servers_only", "SHARED_TOKEN": "key_router_only"},
                   "decode": {"HF_TOKEN": "hf_servers_only", "SHARED_TOKEN": "key_router_only"}}
    warned = {f.field: f for f in validate(dep) if f.level == "warning"}
    assert "secrets.HF_TOKEN.roles" not in warned
    assert warned["secrets.ROUTER_API_KEY.roles"].message == "no role of this spec gets it (roles = ['router'])"
    assert warned["secrets.ROUTER_API_KEY.roles"].fix == "name the roles that need it (prefill, decode), or remove it"


@pytest.mark.parametrize("ref", ["env:", "env:1X", "env:HF-TOKEN"])
def test_an_env_reference_that_names_no_variable_is_a_finding(ref):
    from pdctl.statemachine.errors import SpecError

    for entry, field in ((ref, "secrets.HF_TOKEN"), ({"value": ref, "roles": ["decode"]}, "secrets.HF_TOKEN.value")):
        d = seed_dict()
        d["secrets"] = {"HF_TOKEN": entry}
        with pytest.raises(SpecError) as e:
            parse_spec(d)
        assert f"{field}: {ref!r} names no environment variable" in str(e.value), str(e.value)
        assert str(e.value).endswith(': write "env:NAME" with the variable that holds it, e.g. "env:HF_TOKEN"')


@pytest.mark.parametrize(("entry", "field"), [
    ("", "secrets.HF_TOKEN"),
    ("  ", "secrets.HF_TOKEN"),
    ({"value": "", "roles": ["router"]}, "secrets.HF_TOKEN.value"),
])
def test_an_empty_secret_value_is_an_error_of_validate_not_only_of_apply(entry, field):
    # (validate said "valid" and apply refused it: the spec's check should find what apply will refuse)
    from pdctl.statemachine.rules import validate

    d = seed_dict()
    d["secrets"] = {"HF_TOKEN": entry}
    errors = {f.field: f for f in validate(parse_spec(d)) if f.level == "error"}
    assert errors[field].message == "the value is empty"
    assert 'write "env:HF_TOKEN" and export HF_TOKEN' in errors[field].fix


def test_a_role_listed_twice_in_a_secret_is_a_warning():
    from pdctl.statemachine.rules import validate

    d = seed_dict()
    d["secrets"] = {"HF_TOKEN": {"value": "env:X", "roles": ["decode", "prefill", "decode"]}}
    warned = {f.field: f for f in validate(parse_spec(d)) if f.level == "warning"}
    assert warned["secrets.HF_TOKEN.roles"].message == "decode listed more than once"
    d["secrets"]["HF_TOKEN"]["roles"] = ["decode", "prefill"]
    assert "secrets.HF_TOKEN.roles" not in {f.field for f in validate(parse_spec(d))}
