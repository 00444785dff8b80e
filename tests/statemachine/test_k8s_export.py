"""`pdctl export k8s`: RBG / LWS manifests from the spec, validated against the pinned CRD schemas and Kubernetes' own,
deterministic, with the units' argv; and `pdctl plan --target k8s --from DIR` across two exports.

No cluster runs here: what is checked is what a schema validator, the argv and the record can tell."""

from __future__ import annotations

import copy
import json
import os
import random
import string
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from harness.deploy import ROOT, demo_dict, dump_toml, seed_dict
from pdctl.statemachine import k8s, k8s_validate, launch
from pdctl.statemachine.errors import PdctlError, SpecError, TopologyNotConfirmed
from pdctl.statemachine.k8s_yaml import dump
from pdctl.statemachine.plan import make_plan
from pdctl.statemachine.spec import parse_spec
from pdctl.statemachine.topology import topology_of
from pdctl.units import READINESS_GATE

IMAGE = "registry.example.com/pdctl/sglang:0.5.23"
GOLDEN = Path(__file__).parent / "fixtures" / "k8s"
EXAMPLES = {name: ROOT / "examples" / (f"k8s/{name}.toml" if name == "two-host" else f"{name}.toml")
            for name in ("seed", "dsv32", "two-host", "demo", "single")}


def exported(spec: str | Path, fmt: str, **kw) -> k8s.Export:
    dep, _warnings = k8s.load(EXAMPLES.get(str(spec), spec))
    return k8s.export(dep, fmt=fmt, image=IMAGE, **kw)


def from_dict(d: dict, tmp_path: Path, name: str = "spec.toml") -> Path:
    p = tmp_path / name
    p.write_text(dump_toml(d))
    return p


def pods(exp: k8s.Export) -> dict[str, dict]:
    """Role (and ``router``) → its pod template, whichever the format."""
    out = {}
    for o in exp.objects.values():
        if o["kind"] == "RoleBasedGroup":
            out.update({r["name"]: r["standalonePattern"]["template"] for r in o["spec"]["roles"]})
        elif o["kind"] == "LeaderWorkerSet":
            tpl = o["spec"]["leaderWorkerTemplate"]["workerTemplate"]
            out[tpl["metadata"]["labels"]["app.kubernetes.io/component"]] = tpl
        elif o["kind"] == "Deployment":
            out["router"] = o["spec"]["template"]
    return out


def container(exp: k8s.Export, role: str) -> dict:
    return pods(exp)[role]["spec"]["containers"][0]


def bundle(exp: k8s.Export) -> str:
    """The export's manifests, one after the other (the record, pdctl's own, is checked by the plan tests)."""
    return "".join(f"# ===== {f}\n{t}" for f, t in exp.files.items() if f != k8s.RECORD_FILE)


# --- validation, determinism, golden files ---------------------------------------------------------------------


@pytest.mark.parametrize("fmt", k8s.FORMATS)
@pytest.mark.parametrize("spec", sorted(EXAMPLES))
def test_every_example_exports_valid_manifests_that_read_back_as_written(spec, fmt):
    exp = exported(spec, fmt)
    assert k8s_validate.validate(exp.objects) == []
    for f, text in exp.files.items():
        back = json.loads(text) if f.endswith(".json") else yaml.safe_load(text)
        assert back == exp.objects[f], f
        if f.endswith(".yaml"):
            assert text.startswith("# pdctl-managed:"), f


def test_the_validator_finds_what_a_cluster_would_refuse():
    exp = exported("seed", "rbg")
    objs = copy.deepcopy(exp.objects)
    rbg = objs["rolebasedgroup.yaml"]
    c = rbg["spec"]["roles"][0]["standalonePattern"]["template"]["spec"]["containers"][0]
    c["readinessProbe"]["httpGet"]["paht"] = "/health"  # an unknown field (strict, in both schemas)
    rbg["spec"]["roles"][1]["replicas"] = "1"  # a string for an integer (the CRD's schema)
    objs["service-router.yaml"]["spec"]["ports"][0]["port"] = "30001"  # Kubernetes' own schema
    objs["networkpolicy-servers.yaml"]["metadata"]["labels"]["app.kubernetes.io/component"] = "not a value!"
    problems = "\n".join(k8s_validate.validate(objs))
    assert "'paht' was unexpected" in problems and "(CRD schema)" in problems and "(Kubernetes 1.34)" in problems
    assert "spec.roles[1].replicas" in problems
    assert "service-router.yaml" in problems
    assert "label value 'not a value!'" in problems


@pytest.mark.parametrize("fmt", k8s.FORMATS)
@pytest.mark.parametrize("spec", ["seed", "dsv32", "two-host"])
def test_exports_match_the_reviewed_golden_files(spec, fmt):
    """The golden files were read by hand against RBG's examples/inference/pd-disagg-standalone.yaml (v0.7.0) and
    LWS's docs/examples/sglang/lws.yaml (v0.10.0). A change to the argv the units run changes them too:
    PDCTL_UPDATE_GOLDEN=1 rewrites them (then review the diff)."""
    got = bundle(exported(spec, fmt))
    path = GOLDEN / f"{spec}.{fmt}.yaml"
    if os.environ.get("PDCTL_UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(got)
    assert got == path.read_text()


def test_the_same_spec_gives_the_same_bytes_whoever_exports_it(tmp_path):
    # in another process, another HOME, another working folder, with the secret's variable set there: same bytes
    spec = EXAMPLES["two-host"]
    out = tmp_path / "out"
    env = {**os.environ, "HOME": str(tmp_path), "HF_TOKEN": "hf_secret_value_123"}
    r = subprocess.run([sys.executable, "-m", "pdctl", "export", "k8s", str(spec), "--format", "rbg", "--image", IMAGE,
                        "-o", str(out)], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    here = exported("two-host", "rbg")
    assert sorted(p.name for p in out.iterdir()) == sorted(here.files)
    for f, text in here.files.items():
        assert (out / f).read_text() == text, f
    assert not any("hf_secret_value_123" in (out / f).read_text() for f in here.files)
    assert r.stdout.split() == [str(out / f) for f in here.files]
    assert "two-host-secrets" in r.stderr and "HF_TOKEN" in r.stderr  # (the Secret it needs, named)


# --- what the pods run ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", k8s.FORMATS)
def test_containers_run_the_units_argv(fmt):
    """The container command is the argv the systemd units run, with only what a pod needs otherwise: servers bind
    every address of their pod, the router dials their pods' cluster names."""
    dep, _ = k8s.load(EXAMPLES["seed"])
    units = {s.role: s for s in launch.services_for(dep)}
    exp = k8s.export(dep, fmt=fmt, image=IMAGE)
    for role in ("prefill", "decode"):
        unit, cmd = list(units[role].argv), container(exp, role)["command"]
        assert len(cmd) == len(unit)
        differ = [(u, c) for u, c in zip(unit, cmd) if u != c]
        assert differ == [("127.0.0.1", "0.0.0.0")]
        assert unit[unit.index("127.0.0.1") - 1] == "--host"
    unit, cmd = list(units["router"].argv), container(exp, "router")["command"]
    assert len(cmd) == len(unit)
    differ = [(u, c) for u, c in zip(unit, cmd) if u != c]
    assert [u for u, _c in differ] == ["http://127.0.0.1:30010", "http://127.0.0.1:30020"]
    assert [c.split("//")[1].split(".")[0] for _u, c in differ] == ["dsv4-flash-prefill-0", "dsv4-flash-decode-0"]


@pytest.mark.parametrize("fmt", k8s.FORMATS)
def test_parsers_on_both_servers_and_never_on_the_router(fmt):
    exp = exported("seed", fmt)
    for role in ("prefill", "decode"):
        cmd = container(exp, role)["command"]
        assert cmd[cmd.index("--reasoning-parser") + 1] == "deepseek-v4"
        assert cmd[cmd.index("--tool-call-parser") + 1] == "deepseekv4"
    router = container(exp, "router")["command"]
    assert not any("parser" in w or "chat-template" in w for w in router)


@pytest.mark.parametrize("fmt", k8s.FORMATS)
def test_secrets_are_secret_references_never_values(tmp_path, monkeypatch, fmt):
    monkeypatch.setenv("HF_TOKEN", "hf_from_the_environment")
    d = seed_dict()
    d["secrets"] = {"HF_TOKEN": "env:HF_TOKEN", "ROUTER_API_KEY": {"value": "written-in-the-spec", "roles": ["router"]}}
    d["engine"]["env"] = {"WANDB_TOKEN": "literal-token-in-env", "NCCL_DEBUG": "WARN"}
    exp = exported(from_dict(d, tmp_path), fmt)
    text = "".join(exp.files.values())
    for value in ("hf_from_the_environment", "written-in-the-spec", "literal-token-in-env"):
        assert value not in text
    assert exp.secret == "dsv4-flash-secrets"
    assert exp.secret_keys == ("HF_TOKEN", "ROUTER_API_KEY", "WANDB_TOKEN")

    def env(role: str) -> dict:
        return {e["name"]: e for e in container(exp, role).get("env", [])}

    for role, keys in (("prefill", {"HF_TOKEN", "WANDB_TOKEN"}), ("router", {"HF_TOKEN", "ROUTER_API_KEY"})):
        refs = {k: e["valueFrom"]["secretKeyRef"] for k, e in env(role).items() if "valueFrom" in e}
        assert refs == {k: {"name": "dsv4-flash-secrets", "key": k} for k in keys}
    assert env("prefill")["NCCL_DEBUG"] == {"name": "NCCL_DEBUG", "value": "WARN"}
    assert "ROUTER_API_KEY" not in env("decode")  # (scoped to the router, as on hosts)


def test_kubernetes_expansion_cannot_change_an_argument(tmp_path):
    d = seed_dict()
    d["parsers"]["chat_template"] = "/templates/$(HOME)/chat.jinja"
    d["prefill"][0]["env"] = {"GREETING": "costs $5"}
    exp = exported(from_dict(d, tmp_path), "rbg")
    c = container(exp, "prefill")
    cmd = c["command"]
    assert cmd[cmd.index("--chat-template") + 1] == "/templates/$$(HOME)/chat.jinja"  # ($$ is read back as $)
    assert {"name": "GREETING", "value": "costs $$5"} in c["env"]


@pytest.mark.parametrize("fmt", k8s.FORMATS)
def test_readiness_probes_are_the_proofs_endpoints(fmt):
    seed = exported("seed", fmt)
    for role in ("prefill", "decode"):
        probe = container(seed, role)["readinessProbe"]["httpGet"]
        assert probe["path"] == "/health" and probe["port"] == {"prefill": 30010, "decode": 30020}[role]
    assert container(seed, "router")["readinessProbe"]["httpGet"] == {"path": "/readiness", "port": 30001}
    # a router the spec keeps on loopback is probed from inside its pod, by the units' readiness gate
    demo = exported("demo", fmt)
    router = container(demo, "router")
    cmd = router["command"]
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    gate = router["readinessProbe"]["exec"]["command"]
    assert gate[1:] == ["-c", READINESS_GATE, "http://127.0.0.1:30001/readiness", "1"]


@pytest.mark.parametrize("fmt", k8s.FORMATS)
def test_the_router_is_exposed_only_as_the_spec_exposes_it(tmp_path, fmt):
    seed = exported("seed", fmt)  # router on 0.0.0.0, servers on 127.0.0.1
    svc = seed.objects["service-router.yaml"]
    assert svc["spec"]["type"] == "ClusterIP" and svc["spec"]["ports"][0]["port"] == 30001
    assert svc["spec"]["selector"].items() <= pods(seed)["router"]["metadata"]["labels"].items()
    assert svc["spec"]["selector"]["app.kubernetes.io/component"] == "router"
    assert not any(o["kind"] == "Service" and o is not svc for o in seed.objects.values())
    # the servers on loopback: only the deployment's own pods reach them
    pol = seed.objects["networkpolicy-servers.yaml"]["spec"]
    assert pol["podSelector"]["matchExpressions"][0]["values"] == ["prefill", "decode"]
    assert pol["ingress"] == [{"from": [{"podSelector": {
        "matchLabels": {"app.kubernetes.io/instance": "dsv4-flash"}}}]}]
    demo = exported("demo", fmt)  # router on loopback: no Service at all
    assert not any(o["kind"] == "Service" for o in demo.objects.values())
    two = exported("two-host", fmt)  # servers on every interface: no policy keeps pods out, as on hosts
    assert not any(o["kind"] == "NetworkPolicy" for o in two.objects.values())
    # an address of a host's own has no meaning in a pod
    d = seed_dict()
    d["router"]["host"] = "10.0.0.5"
    with pytest.raises(SpecError) as e:
        exported(from_dict(d, tmp_path), fmt)
    assert e.value.findings_json()[0]["field"] == "router.host"


def test_rbg_starts_the_router_after_both_servers_one_pod_each():
    exp = exported("seed", "rbg")
    roles = {r["name"]: r for r in exp.objects["rolebasedgroup.yaml"]["spec"]["roles"]}
    assert list(roles) == ["prefill", "decode", "router"]
    assert roles["router"]["dependencies"] == ["prefill", "decode"]
    assert all("dependencies" not in roles[r] for r in ("prefill", "decode"))
    for r in roles.values():  # (the CRD's CEL rules, which the schema check cannot run)
        assert r["replicas"] == 1 and set(r) & {"standalonePattern", "leaderWorkerPattern"} == {"standalonePattern"}
        assert set(r["standalonePattern"]) == {"template"}


def test_lws_gates_the_router_on_every_servers_health():
    exp = exported("seed", "lws")
    sets = {o["metadata"]["name"]: o for o in exp.objects.values() if o["kind"] == "LeaderWorkerSet"}
    assert sorted(sets) == ["dsv4-flash-decode", "dsv4-flash-prefill"]
    assert all(o["spec"]["leaderWorkerTemplate"]["size"] == 1 for o in sets.values())
    gates = pods(exp)["router"]["spec"]["initContainers"]
    # each gate dials the headless name LWS gives its leader pod: <set>-0.<set>
    assert [g["command"][3] for g in gates] == [f"http://{n}-0.{n}:{p}/health" for n, p in
                                                (("dsv4-flash-prefill", 30010), ("dsv4-flash-decode", 30020))]
    assert all(g["command"][1:3] == ["-c", READINESS_GATE] and g["command"][4] == "3000" for g in gates)


@pytest.mark.parametrize("fmt", k8s.FORMATS)
def test_the_router_dials_the_names_the_format_gives_the_pods(fmt):
    exp = exported("two-host", fmt)
    cmd = container(exp, "router")["command"]
    hosts = [cmd[i + 1].split("//")[1].rsplit(":", 1)[0] for i, w in enumerate(cmd) if w in ("--prefill", "--decode")]
    if fmt == "rbg":  # RBG: pod <rbg>-<role>-0 under the headless Service s-<rbg>-<role>
        rbg = exp.objects["rolebasedgroup.yaml"]["metadata"]["name"]
        assert hosts == [f"{rbg}-{r}-0.s-{rbg}-{r}" for r in ("prefill", "decode")]
    else:
        names = [o["metadata"]["name"] for o in exp.objects.values() if o["kind"] == "LeaderWorkerSet"]
        assert hosts == [f"{n}-0.{n}" for n in names]
    assert cmd[cmd.index("--prefill") + 2] == "8998"  # (the bootstrap port always passed, as on hosts)
    record = exp.topology
    assert [h for _n, h, _p in record.kv_link.bootstrap] == hosts[:1]


@pytest.mark.parametrize("fmt", k8s.FORMATS)
def test_gpus_and_node_selectors_come_from_the_spec(fmt):
    two = exported("two-host", fmt)
    for role, node in (("prefill", "gpu-a"), ("decode", "gpu-b")):
        spec = pods(two)[role]["spec"]
        assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-RTX-PRO-6000-Blackwell-Workstation-Edition",
                                        "kubernetes.io/hostname": node}
        assert spec["containers"][0]["resources"] == {"limits": {"nvidia.com/gpu": 8}}
    assert "nodeSelector" not in pods(two)["router"]["spec"]
    assert "resources" not in container(two, "router")
    seed = exported("seed", fmt)  # decode on GPUs 4-7 of the host: four GPUs, seen as 0-3 in its pod
    env = {e["name"]: e.get("value") for e in container(seed, "decode")["env"]}
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert "kubernetes.io/hostname" not in pods(seed)["decode"]["spec"]["nodeSelector"]  # (localhost: no node)
    dsv32 = exported("dsv32", fmt)  # inventory discovered: no GPU model declared, no selector
    assert "nodeSelector" not in pods(dsv32)["prefill"]["spec"]


@pytest.mark.parametrize("fmt", k8s.FORMATS)
@pytest.mark.parametrize("example", ["dsv32", "seed"])
def test_kernels_are_built_in_the_pod_before_the_server_starts(fmt, example, tmp_path):
    from pdctl.statemachine.service import kernels_build_command

    exp = exported(example, fmt)
    dep, _ = k8s.load(EXAMPLES[example])
    cmd, _manifest = kernels_build_command(dep)
    for role in ("prefill", "decode"):
        spec = pods(exp)[role]["spec"]
        init = spec["initContainers"][0]
        assert init["name"] == "kernels-built" and init["command"] == cmd
        assert init["resources"] == spec["containers"][0]["resources"]  # (on the same kind of GPUs)
        mount = {"name": "kernels", "mountPath": "/var/cache/sglang"}
        assert mount in init["volumeMounts"] and mount in spec["containers"][0]["volumeMounts"]
    # (the seed's DeepSeek-V4 builds at its own shapes; kernels off, nothing is built)
    assert ("deepseek-v4" in cmd) == (example == "seed")
    off = seed_dict()
    off["kernels"]["enabled"] = False
    assert "initContainers" not in pods(exported(from_dict(off, tmp_path), fmt))["prefill"]["spec"]


def test_names_kubernetes_cannot_take_are_refused(tmp_path):
    d = demo_dict()
    d["name"] = "Demo_1"
    with pytest.raises(SpecError, match="cannot name Kubernetes objects"):
        exported(from_dict(d, tmp_path), "rbg")
    d["name"] = "d" * 60
    with pytest.raises(SpecError, match="longer than a DNS label"):
        exported(from_dict(d, tmp_path), "rbg")


def test_roles_on_two_hosts_are_refused_on_hosts_but_not_for_kubernetes():
    from pdctl.statemachine.rules import check

    dep, _ = k8s.load(EXAMPLES["two-host"])
    with pytest.raises(SpecError, match="roles run on 2 hosts"):
        check(dep)


# --- the folder, and plans across exports ---------------------------------------------------------------------


def test_write_plans_from_the_export_there_and_keeps_the_folder_exactly_this_export(tmp_path):
    out = tmp_path / "k8s"
    seed = exported("seed", "rbg")
    written, removed, plan = k8s.write(seed, out)
    assert sorted(p.name for p in written) == sorted(seed.files) and removed == [] and plan.from_topology is None
    (out / "notes.yaml").write_text("kind: ConfigMap\n")  # someone else's file: left alone
    # the router moved to loopback: a topology change (its exposure), refused until confirmed
    d = seed_dict()
    d["router"]["host"] = "127.0.0.1"
    dep = parse_spec(d)
    moved = k8s.export(dep, fmt="rbg", image=IMAGE)
    with pytest.raises(TopologyNotConfirmed) as e:
        k8s.write(moved, out)
    assert e.value.plan.topology_changes == ("router exposure 0.0.0.0:30001 → 127.0.0.1:30001",)
    assert (out / "service-router.yaml").exists()  # (nothing written)
    with pytest.raises(TopologyNotConfirmed):
        k8s.write(moved, out, confirm="0" * 16)
    _w, removed, plan = k8s.write(moved, out, confirm=e.value.plan_id)
    assert [p.name for p in removed] == ["service-router.yaml"]  # (kubectl apply -f DIR would still create it)
    assert sorted(p.name for p in out.iterdir()) == sorted([*moved.files, "notes.yaml"])
    # a file of the same name pdctl did not write is never overwritten
    (out / "rolebasedgroup.yaml").write_text("apiVersion: v1\n")
    with pytest.raises(PdctlError, match="was not written by pdctl"):
        k8s.write(moved, out)
    # nor is another deployment's export
    other = tmp_path / "other"
    k8s.write(exported("demo", "rbg"), other)
    with pytest.raises(PdctlError, match="holds the export of deployment 'demo'"):
        k8s.write(moved, other)


def _plan_across(tmp_path: Path, old: dict, new: dict, fmt: str = "rbg"):
    out = tmp_path / "old"
    k8s.write(k8s.export(parse_spec(old), fmt=fmt, image=IMAGE), out)
    plan, notes = k8s.plan_from(parse_spec(new), out)
    hosts = make_plan(topology_of(parse_spec(old)), topology_of(parse_spec(new)))
    return plan, hosts, notes


def _collapse(d: dict) -> dict:
    d = copy.deepcopy(d)
    pre = d.pop("prefill")[0]
    d.pop("decode")
    d.pop("kv_transfer")
    d["server"] = [{"host": pre["host"], "gpus": list(range(8)), "tp": 8, "port": pre["port"], "nccl_port": 30110}]
    return d


@pytest.mark.parametrize("change", ["parsers", "collapse", "tp", "exposure", "model", "nothing"])
def test_a_plan_across_exports_classifies_as_on_hosts(tmp_path, change):
    old = demo_dict()
    new = copy.deepcopy(old)
    if change == "parsers":
        new["parsers"]["tool_call_parser"] = "qwen25"
    elif change == "collapse":
        new = _collapse(old)
    elif change == "tp":
        new["decode"][0].update(gpus=[4, 5], tp=2)
    elif change == "exposure":
        new["router"]["host"] = "0.0.0.0"
    elif change == "model":
        new["model"]["served_name"] = "v4"
    plan, hosts, notes = _plan_across(tmp_path, old, new)
    assert notes == []
    words = hosts.topology_changes
    if change == "tp":  # (the pod sees its GPUs as 0..N-1: the same change, said with those ids)
        assert words == ("decode gpus 4,5,6,7 → 4,5", "decode tp 4 → 2")
        words = ("decode gpus 0,1,2,3 → 0,1", "decode tp 4 → 2")
    assert plan.cls == hosts.cls and plan.topology_changes == words
    assert plan.requires_confirmation == hosts.requires_confirmation
    assert [(c.address, c.action, c.cls) for c in plan.changes] == [(c.address, c.action, c.cls) for c in hosts.changes]
    if change == "collapse":
        assert plan.topology_changes == ("PD disaggregation → single server",)
    if change == "nothing":
        assert not plan.has_changes


def test_on_kubernetes_gpu_ids_are_a_count_and_the_image_restarts_what_runs_it(tmp_path):
    old = demo_dict()
    new = copy.deepcopy(old)
    new["decode"][0]["gpus"] = [0, 1, 2, 3]  # other GPUs of a host, the same count: the same pod
    plan, hosts, _notes = _plan_across(tmp_path, old, new)
    assert not plan.has_changes and hosts.cls == "topology"
    out = tmp_path / "old"
    plan, _ = k8s.plan_from(parse_spec(old), out, image="registry.example.com/pdctl/sglang:0.5.24")
    assert plan.cls == "disruptive" and set(plan.restarts()) == {"prefill", "decode", "router"}
    plan, _ = k8s.plan_from(parse_spec(old), out, fmt="lws")  # (another engine runs them: every pod anew)
    assert set(plan.restarts()) == {"prefill", "decode", "router"}


def test_a_plan_says_what_in_the_folder_differs_from_its_record(tmp_path):
    out = tmp_path / "old"
    k8s.write(exported("seed", "rbg"), out)
    text = (out / "rolebasedgroup.yaml").read_text()
    (out / "rolebasedgroup.yaml").write_text(text.replace("replicas: 1", "replicas: 2", 1))
    (out / "service-router.yaml").unlink()
    dep, _ = k8s.load(EXAMPLES["seed"])
    plan, notes = k8s.plan_from(dep, out)
    assert not plan.has_changes
    assert notes == ["rolebasedgroup.yaml was edited since pdctl exported it", f"service-router.yaml is not in {out}"]
    with pytest.raises(PdctlError, match="no pdctl export here"):
        k8s.plan_from(dep, tmp_path)


def test_plan_target_k8s_on_the_command_line(tmp_path):
    out = tmp_path / "old"
    k8s.write(exported("demo", "lws"), out)
    single = tmp_path / "single.toml"
    single.write_text((ROOT / "examples" / "single.toml").read_text())
    run = [sys.executable, "-m", "pdctl", "plan", str(single), "--target", "k8s", "--from", str(out)]
    r = subprocess.run([*run, "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    p = json.loads(r.stdout)
    assert p["class"] == "topology" and p["topology_changes"] == ["PD disaggregation → single server"]
    r = subprocess.run([*run, "-o", str(tmp_path / "p.json")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 64 and "not with --target k8s" in r.stderr


# --- the YAML writer --------------------------------------------------------------------------------------------


def test_the_yaml_writer_reads_back_as_written_for_any_text():
    rnd = random.Random(44)
    alphabet = string.printable + "é€😀\u2028\x85\x00"
    for _ in range(2000):
        s = "".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 14)))
        obj = {"k": s, s or "empty": [s, {"n": s}, [s]], "i": rnd.randint(-5, 5), "b": rnd.random() < 0.5}
        assert yaml.safe_load(dump(obj)) == obj, repr(s)
    for word in ("yes", "No", "on", "OFF", "null", "~", "1e3", "0.85", "-m", "#x", "a: b", ""):
        assert yaml.safe_load(dump({"v": word}))["v"] == word
