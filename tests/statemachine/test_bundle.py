"""`pdctl support-bundle` (issue 40 item 6): one .tar.gz of what pdctl knows about a deployment, every part read
within a bound, failures written into its MANIFEST, and no secret value anywhere in it. Real processes: the SGLang
stand-in under the process supervisor and the real smg router."""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import tarfile
import uuid
from pathlib import Path

import pytest

from pdctl.statemachine.bundle import REDACTED, redact
from pdctl.statemachine.journal import Journal
from pdctl.units._manager import clean_log_lines

pytestmark = [pytest.mark.smg, pytest.mark.slow]


def _members(path: Path) -> dict[str, bytes]:
    """Every member of the bundle at *path*, name (under its one top folder) → bytes."""
    with tarfile.open(path, "r:gz") as tar:
        infos = tar.getmembers()
        tops = {i.name.split("/", 1)[0] for i in infos}
        assert len(tops) == 1 and next(iter(tops)).startswith("pdctl-support-"), tops
        assert all(i.isfile() and i.mode == 0o600 for i in infos)
        return {i.name.split("/", 1)[1]: tar.extractfile(i).read() for i in infos}


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def test_redact_replaces_a_value_raw_and_as_json_escapes_it():
    value = 'p"a\\ss'
    data = json.dumps({"k": value}).encode() + b" " + value.encode()
    out, n = redact(data, [value])
    assert n == 2 and value.encode() not in out and json.dumps(value)[1:-1].encode() not in out
    assert out == json.dumps({"k": REDACTED}).encode() + b" " + REDACTED.encode()


def test_a_bundle_of_a_deployment_with_secrets_holds_every_part_and_no_secret(make_demo, monkeypatch, tmp_path):
    from_env = "hf_" + uuid.uuid4().hex  # [secrets] HF_TOKEN = "env:…": read from pdctl's environment at apply
    literal = "hub-" + uuid.uuid4().hex  # [secrets] as written in the spec
    api_key = "sk-" + uuid.uuid4().hex  # an API key in an env table (the rules warn; the units move it to secrets)
    monkeypatch.setenv("PDCTL_BUNDLE_TEST_HF", from_env)

    def with_secrets(d: dict) -> None:
        d["secrets"] = {"HF_TOKEN": "env:PDCTL_BUNDLE_TEST_HF", "MODEL_HUB_AUTH": literal}
        d["engine"]["env"]["OPENAI_API_KEY"] = api_key

    demo = make_demo(with_secrets)
    secrets = [from_env, literal, api_key]
    assert literal in demo.spec.read_text() and api_key in demo.spec.read_text()  # (unredacted, they would leak)
    demo.apply()
    # the running processes got them: the installed secrets file holds them
    installed = b"".join(p.read_bytes() for p in demo.state.rglob("*.env"))
    assert all(s.encode() in installed for s in secrets)

    out = tmp_path / "bundle.tar.gz"
    r = demo.cli("support-bundle", str(demo.spec), "-o", str(out), "-n", "20")
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"{out}\n" and "written:" in r.stderr, r.stderr
    assert not list(tmp_path.glob(".bundle.tar.gz.*"))  # (the temporary file was renamed over FILE)
    m = _members(out)

    # no secret value in any member, read whole
    for name, data in m.items():
        for s in secrets:
            assert s.encode() not in data, (name, s)
    assert REDACTED.encode() in m[f"spec/{demo.spec.name}"]
    assert b"env:PDCTL_BUNDLE_TEST_HF" in m[f"spec/{demo.spec.name}"]  # (a reference, not a value: kept)

    # every part, with real content
    status = json.loads(m["status.json"])
    assert status["deployment"] == demo.name and status["healthy"] is True, status.get("error")
    journal = Journal(demo.state, demo.name).path.read_bytes()
    assert api_key.encode() in journal  # (an env value the journal records as written: the bundle must not)
    assert json.loads(m["journal.json"]) == json.loads(redact(journal, secrets)[0])
    assert [json.loads(line)["event"] for line in m["audit.log"].splitlines()].count("apply-done") == 1
    plan = json.loads(m["plan.json"])  # (applied just now: the plan from it to the spec has nothing to do)
    assert plan["deployment"] == demo.name and plan["plan_id"] and plan["from_topology"] is not None
    assert plan["changes"] == [], plan["changes"]
    assert plan["plan_id"] in m["plan.txt"].decode() or demo.name in m["plan.txt"].decode(), m["plan.txt"]
    services = demo.state / "supervisor" / "services"
    for role in ("prefill", "decode", "router"):
        got = m[f"logs/{role}.log"].decode().splitlines()
        assert 0 < len(got) <= 20, (role, got)
        text = (services / f"pdctl-{demo.name}-{role}.service" / "output.log").read_text(errors="replace")
        log = set(clean_log_lines(text, text.count("\n") + 1))  # (smg's colour codes out, as logs shows them)
        assert all(line in log for line in got), (role, got)  # (its own lines; the router writes on meanwhile)
        unit = m[f"units/pdctl-{demo.name}-{role}.service"]
        assert demo.name.encode() in unit, role
    assert json.loads(m["server_info/prefill.json"])["disaggregation_mode"] == "prefill"
    assert json.loads(m["server_info/decode.json"])["disaggregation_mode"] == "decode"
    workers = json.loads(m["router/workers.json"])
    assert str(demo.ports["prefill"]) in json.dumps(workers) and str(demo.ports["decode"]) in json.dumps(workers)
    assert b"smg_" in m["router/metrics.txt"]
    if shutil.which("nvidia-smi") is None:
        assert m["nvidia-smi-q.txt"].startswith(b"absent: nvidia-smi is not on"), m["nvidia-smi-q.txt"]
    assert m["kernels-manifest.json"].startswith(b"absent: "), m["kernels-manifest.json"]
    versions = json.loads(m["versions.json"])
    assert versions["pdctl (writing this bundle)"] == _version("pdctl")
    host = versions["host"]
    assert (host["pdctl"], host["smg"], host["sglang"]) == (_version("pdctl"), _version("smg"), _version("sglang"))
    assert host["nixl"] in ("absent", _version("nixl"))
    assert versions["smg --version"] == f"smg {_version('smg')}"
    # the MANIFEST lists every member with its status, and names what it redacted (by name, never by value)
    manifest = json.loads(m["MANIFEST.json"])
    assert {e["name"] for e in manifest["members"]} == set(m) - {"MANIFEST", "MANIFEST.json"}
    assert [e["name"] for e in manifest["members"] if e["status"] == "error"] == [], manifest
    assert {"secrets.HF_TOKEN", "secrets.MODEL_HUB_AUTH", "engine.env.OPENAI_API_KEY"} <= set(manifest["redacted"])
    table = m["MANIFEST"].decode()
    assert all(e["name"] in table for e in manifest["members"])
    assert "secrets redacted as ***REDACTED***: " in table

    # the key changed in the spec, not applied yet, the installed secrets files unreadable (gone here): the journal
    # still records the old value as written, and the bundle redacts it from there
    import copy

    d = copy.deepcopy(demo.dict)
    d["engine"]["env"]["OPENAI_API_KEY"] = "sk-" + uuid.uuid4().hex
    for f in demo.state.rglob("*.env"):
        f.unlink()
    r = demo.cli("support-bundle", str(demo.write(d, "rotated.toml")), "-o", str(out), "-n", "5")
    assert r.returncode == 0, r.stderr
    for name, data in _members(out).items():
        assert api_key.encode() not in data and d["engine"]["env"]["OPENAI_API_KEY"].encode() not in data, name


def test_a_bundle_of_a_deployment_not_up_records_what_failed_and_is_written_all_the_same(make_demo, tmp_path):
    demo = make_demo()  # (never applied: no unit, no server, no router)
    out = tmp_path / "down.tar.gz"
    r = demo.cli("support-bundle", str(demo.spec), "-o", str(out), "--timeout", "2")
    assert r.returncode == 0, r.stderr
    m = _members(out)
    manifest = {e["name"]: e for e in json.loads(m["MANIFEST.json"])["members"]}
    assert manifest["server_info/prefill.json"]["status"] == "error"
    assert manifest["server_info/prefill.json"]["error"] in m["MANIFEST"].decode()
    assert f"note: server_info/prefill.json: {manifest['server_info/prefill.json']['error']}" in r.stderr
    assert manifest["router/workers.json"]["status"] == "error"
    assert manifest["journal.json"]["status"] == "absent" and m["journal.json"].startswith(b"absent: ")
    assert manifest[f"units/pdctl-{demo.name}-prefill.service"]["status"] == "absent"
    assert json.loads(m["status.json"])["healthy"] is False
    assert m[f"spec/{demo.spec.name}"] == demo.spec.read_bytes()  # (no secrets in it: nothing replaced)
