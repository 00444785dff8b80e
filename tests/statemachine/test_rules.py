"""Every topology rule has a failing spec here, and its message names the field and the fix."""

from __future__ import annotations

import copy

import pytest

from pdctl.statemachine.errors import SpecError
from pdctl.statemachine.rules import Inventory, check, validate
from pdctl.statemachine.spec import load_spec, parse_spec

from .specs import DEMO, SEED, collapsed, dsv32_dict, seed_dict


def _with(path: tuple, value) -> dict:  # noqa: ANN001
    """The seed spec as a dict with *value* written at *path* (keys and list indices)."""
    d = seed_dict()
    node = d
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return d


def _refused(path: tuple, value):  # noqa: ANN001, ANN202
    """The SpecError (pytest's ExceptionInfo) that the seed with *value* at *path* must raise."""
    with pytest.raises(SpecError) as e:
        parse_spec(_with(path, value))
    return e



def test_every_example_validates_without_errors_and_one_is_a_single_server():
    # every file in examples/, not a fixed list: a new example is checked the day it is added
    paths = sorted(SEED.parent.glob("*.toml"))
    assert {SEED, DEMO, SEED.parent / "dsv32.toml"} <= set(paths)
    deps = {path.name: load_spec(path) for path in paths}
    for name, dep in deps.items():
        assert [f for f in validate(dep) if f.level != "info"] == [], name
    assert not deps["single.toml"].is_pd and deps["single.toml"].model == deps["demo.toml"].model


def test_the_dsv32_example_builds_the_kernels_for_its_decode_ranks():
    from pdctl.statemachine.service import kernels_build_command

    dep = load_spec(SEED.parent / "dsv32.toml")
    assert dep.kernels.enabled and dep.model.page_size == 64 and dep.model.dsa_decode_backend == "flashmla_kv"
    cmd, manifest = kernels_build_command(dep)
    assert cmd[1:] == ["-m", "pdctl.kernels", "build", "--cache-dir", "/var/cache/sglang", "--heads", "32",
                       "--kv-formats", "fp8", "--max-context", "131072"]
    assert manifest == "/var/cache/sglang/pdctl-kernels-manifest.json"


def test_the_seed_builds_the_v4_kernels_with_a_command_the_build_cli_accepts():
    # (issue 43) DeepSeek-V4-Flash: 64 heads over the decode group's TP4 = 16 local heads, the 584-byte v4 cache,
    # top-512; parsed by pdctl.kernels' own parser (no GPU: parse only), so a flag it does not take fails here
    from pdctl.kernels.__main__ import build_parser
    from pdctl.statemachine.service import kernels_build_command

    dep = load_spec(SEED)
    assert dep.kernels.enabled
    cmd, manifest = kernels_build_command(dep)
    assert cmd == ["/opt/sglang/.venv/bin/python", "-m", "pdctl.kernels", "build", "--cache-dir", "/var/cache/sglang",
                   "--model", "deepseek-v4", "--heads", "16", "--kv-formats", "v4", "--topk", "512",
                   "--max-context", "131072"]
    assert manifest == "/var/cache/sglang/pdctl-kernels-manifest.json"
    args = build_parser().parse_args(cmd[3:])
    assert (args.cmd, args.model, args.heads, args.kv_formats, args.topk, args.max_context) == (
        "build", "deepseek-v4", [16], ["v4"], 512, 131072)
    d = seed_dict()  # V4-Pro (128 heads, top-1024) at TP8 and TP4 decode groups: 16 and 32 local heads
    d["model"]["path"] = "deepseek-ai/DeepSeek-V4-Pro"
    d["decode"].append({**d["decode"][0], "gpus": [0, 1, 2, 3, 4, 5, 6, 7], "tp": 8, "port": 30021})
    cmd, _ = kernels_build_command(parse_spec(d))
    args = build_parser().parse_args(cmd[3:])
    assert (args.heads, args.topk) == ([16, 32], 1024)


def _errors(d: dict, **kw) -> list:
    return [f for f in validate(parse_spec(d), **kw) if f.level == "error"]


def _one(d: dict, field: str, *words: str, level: str = "error", **kw):
    findings = [f for f in validate(parse_spec(d), **kw) if f.level == level and f.field == field]
    assert findings, f"no {level} on {field}: {validate(parse_spec(d), **kw)}"
    text = f"{findings[0].message} {findings[0].fix}"
    for w in words:
        assert w in text, f"{w!r} not in {text!r}"
    return findings[0]


def test_overlapping_gpu_sets_on_one_host_are_refused():
    d = seed_dict()
    d["decode"][0]["gpus"] = [3, 4, 5, 6]
    _one(d, "decode[0].gpus", "GPU 3", "already used by prefill[0]")


def test_gpu_count_must_equal_tp():
    d = seed_dict()
    d["prefill"][0]["tp"] = 2
    _one(d, "prefill[0].gpus", "tp = 2", "list exactly 2 GPUs")


def test_attention_dp_must_divide_tp():
    d = seed_dict()
    d["decode"][0]["attn_dp"] = 3
    _one(d, "decode[0].attn_dp", "does not divide tp = 4")


def test_gpu_ids_must_exist_when_the_inventory_is_known():
    d = seed_dict()
    d["decode"][0]["gpus"] = [4, 5, 6, 9]
    _one(d, "decode[0].gpus", "GPU [9] not on host", "0-7")


def test_gpu_ids_checked_against_a_discovered_inventory_too():
    d = seed_dict()
    del d["hosts"]["local"]["gpu_numa"]
    f = _one(d, "decode[0].gpus", "not on host", inventories={"local": Inventory(gpu_numa=(0, 0, 0, 0))})
    assert "0-3" in f.message


def test_numa_node_away_from_all_the_gpus_is_an_error_and_across_nodes_a_warning():
    # numa_node = 0 for GPUs 4-7, all on node 1: the unit would bind the role to the other socket (it was a warning,
    # and `pdctl units` wrote NUMAMask=0 and node 0's CPUs for decode)
    d = seed_dict()
    d["decode"][0]["numa_node"] = 0
    f = _one(d, "decode[0].numa_node", "all sit on NUMA node 1", "set numa_node = 1")
    assert f.level == "error"
    with pytest.raises(SpecError, match=r"decode\[0\]\.numa_node"):
        check(parse_spec(d))
    d = seed_dict()
    d["decode"][0]["gpus"] = [3, 5, 6, 7]  # GPU 3 on node 0, the rest on node 1: a choice to question, not an error
    d["prefill"][0]["gpus"], d["prefill"][0]["tp"] = [0, 1, 2], 3
    f = _one(d, "decode[0].numa_node", "sit on NUMA nodes [0, 1]", "pick GPUs from one NUMA node", level="warning")
    assert f.level == "warning"


def test_numa_node_the_host_lacks_is_an_error():
    d = seed_dict()
    d["prefill"][0]["numa_node"] = 3
    _one(d, "prefill[0].numa_node", "NUMA node 3 does not exist")


def test_an_empty_declared_inventory_is_named_as_such_with_the_fields_to_fill():
    # numa_cpus = {} / gpu_numa = [] are declarations of nothing (leaving them out means "unknown"): the error says so
    # and points at the spec, not at a node or GPU range that reads as "nodes []" or "GPUs 0--1".
    d = seed_dict()
    d["hosts"]["local"]["numa_cpus"] = {}
    _one(d, "prefill[0].numa_node", "declares no NUMA nodes (numa_cpus = {})", "hosts.local.numa_cpus", "leave it out")
    d = seed_dict()
    d["hosts"]["local"]["gpu_numa"] = []
    _one(d, "decode[0].gpus", "declares no GPUs (gpu_numa = [])", "hosts.local.gpu_numa")
    d = seed_dict()
    del d["hosts"]["local"]["gpu_numa"]
    _one(d, "decode[0].gpus", "has no GPUs (nvidia-smi lists none)", inventories={"local": Inventory(gpu_numa=())})


def test_a_dotted_key_that_toml_made_a_nested_table_is_explained():
    # numa_cpus = { 1.0 = "32-63" } is { 1 = { 0 = "32-63" } } in TOML: "put it in quotes" was wrong (it was quoted)
    d = seed_dict()
    d["hosts"]["local"]["numa_cpus"] = {"0": "0-31,64-95", "1": {"0": "32-63,96-127"}}
    with pytest.raises(SpecError) as e:
        parse_spec(d)
    assert "hosts.local.numa_cpus.1: must be text, not the table" in str(e.value)
    assert "a dotted key (like 1.0 or a.b) makes a nested table in TOML; put the whole key in quotes" in str(e.value)


def test_a_cpu_declared_under_two_numa_nodes_is_refused():
    d = seed_dict()
    d["hosts"]["local"]["numa_cpus"] = {"0": "0-31,64-95", "1": "24-63,96-127"}  # (keys as TOML gives them: text)
    _one(d, "hosts.local.numa_cpus", "CPUs 24-31 are listed under NUMA nodes 0 and 1", "cpulist")
    d["hosts"]["local"]["numa_cpus"] = {"0": "0-31,64-95", "1": "32-63,96-127"}
    assert not [f for f in validate(parse_spec(d)) if f.field == "hosts.local.numa_cpus"]


def test_a_role_on_a_node_declared_without_cpus_is_warned_that_its_threads_stay_unpinned():
    d = seed_dict()
    d["hosts"]["local"]["numa_cpus"] = {"0": "", "1": "32-63,96-127"}
    f = _one(d, "prefill[0].numa_node", 'declared without CPUs (numa_cpus 0 = "")', "node0/cpulist", level="warning")
    assert not [x for x in validate(parse_spec(d)) if x.field == "decode[0].numa_node"]
    check(parse_spec(d))  # a warning: a memory-only node is legal
    assert f.level == "warning"


def test_gpu_numa_naming_a_node_numa_cpus_does_not_declare_is_refused():
    # (before: only a warning whose fix, "set numa_node = 2", then failed as "node 2 does not exist")
    d = seed_dict()
    d["hosts"]["local"]["gpu_numa"] = [0, 0, 0, 0, 2, 2, 2, 2]
    _one(d, "hosts.local.gpu_numa", "names NUMA node(s) [2], which numa_cpus does not declare (nodes [0, 1])")


def test_port_collision_between_http_and_nccl_on_one_host():
    d = seed_dict()
    d["decode"][0]["nccl_port"] = 30010
    f = _one(d, "decode[0].nccl_port", "port 30010", "HTTP of prefill")
    # (the fix said "space server ports >= 10 apart", which the rules never asked: ports 1 apart are valid)
    # (nor the attention-DP derived ports where no role uses attention-DP)
    assert f.fix == "choose a port nothing else on host 'local' uses", f.fix


def test_sglang_derived_ports_collide_with_attention_dp():
    d = seed_dict()
    d["prefill"][0]["attn_dp"] = 4
    d["decode"][0]["nccl_port"] = 30010 + 235
    errs = _errors(d)
    hit = [e for e in errs if "derived ZMQ port 30010+235" in e.message]
    assert hit and hit[0].fix.endswith("(a server with attention-DP also takes SGLang's derived ports, its port +233 "
                                       "to +239)"), errs


def test_two_prefill_servers_on_one_host_cannot_share_a_bootstrap_port():
    d = seed_dict()
    second = copy.deepcopy(d["prefill"][0])
    second.update(gpus=[4, 5], tp=2, port=30030, nccl_port=30130, numa_node=1)
    d["prefill"].append(second)
    d["decode"][0].update(gpus=[6, 7], tp=2)
    _one(d, "prefill[1].bootstrap_port", "bootstrap port 8998 is shared with prefill[0]")


def test_router_port_equal_to_a_server_port_is_refused():
    d = seed_dict()
    d["router"]["port"] = 30020
    _one(d, "router.port", "equals the HTTP port of decode")


def test_router_prometheus_port_collision():
    d = seed_dict()
    d["router"]["prometheus_port"] = 8998
    _one(d, "router.prometheus_port", "port 8998")


def test_page_size_differing_between_prefill_and_decode():
    d = seed_dict()
    d["decode"][0]["page_size"] = 32
    _one(d, "decode[0].page_size", "page_size differs", "Page size mismatch")


def test_kv_cache_dtype_differing_between_prefill_and_decode():
    d = seed_dict()
    d["prefill"][0]["kv_cache_dtype"] = "bf16"
    _one(d, "prefill[0].kv_cache_dtype", "kv_cache_dtype differs")


def test_parsers_differing_between_roles():
    d = seed_dict()
    d["decode"][0]["parsers"] = {"reasoning_parser": "deepseek-v3", "tool_call_parser": "deepseekv4"}
    _one(d, "decode[0].parsers.reasoning_parser", "'deepseek-v3'", "set [parsers].reasoning_parser once")


def test_chat_template_differing_between_roles():
    d = seed_dict()
    d["prefill"][0]["parsers"] = {**d["parsers"], "chat_template": "/etc/t.jinja"}
    _one(d, "prefill[0].parsers.chat_template", "identically")


def test_parsers_on_the_router_are_refused():
    d = seed_dict()
    d["router"]["tool_call_parser"] = "deepseekv4"
    _one(d, "router.tool_call_parser", "never on the router", "move it to [parsers]")


def test_parser_flags_in_router_extra_args_are_refused():
    d = seed_dict()
    d["router"]["extra_args"] = ["--reasoning-parser", "deepseek-v4"]
    _one(d, "router.extra_args", "--reasoning-parser on the router")


def test_ssh_fields_of_a_host_driven_directly_are_a_warning_naming_why():
    # (connect = "local", or a loopback address, with ssh_user etc. validated with no word: pdctl drove this machine)
    d = seed_dict()
    d["hosts"]["local"].update(ssh_user="ops", ssh_port=2222)
    f = _one(d, "hosts.local.ssh_user", "ssh_user, ssh_port are ignored: address 'localhost' is this machine's "
             "loopback", 'connect = "ssh"', "remove ssh_user, ssh_port", level="warning")
    d["hosts"]["local"].update(connect="local", address="gpu1.example.com")
    f = _one(d, "hosts.local.ssh_user", 'are ignored: connect = "local", so pdctl drives this machine directly',
             level="warning")
    d["hosts"]["local"]["connect"] = "ssh"
    assert not [x for x in validate(parse_spec(d)) if x.field.startswith("hosts.local.ssh")], f


def test_parser_names_must_exist_in_the_target_version():
    d = seed_dict()
    d["parsers"]["tool_call_parser"] = "deepseek-v4"
    f = _one(d, "parsers.tool_call_parser", "not a tool-call parser of SGLang 0.5.23")
    assert "deepseekv4" in f.fix
    # A name near nothing useful still gets the whole list, not only a far-fetched neighbour.
    d["parsers"]["tool_call_parser"] = "nonsense"
    f = _one(d, "parsers.tool_call_parser", "not a tool-call parser of SGLang 0.5.23")
    assert "use a tool-call parser the target version has:" in f.fix and "deepseekv4" in f.fix, f.fix
    assert "did you mean" not in f.fix, f.fix  # (it offered 'nanbeige')
    d["parsers"]["tool_call_parser"] = "deepsek-v4"
    assert "did you mean 'deepseekv4'" in _one(d, "parsers.tool_call_parser", "not a tool-call parser").fix


def test_reasoning_parser_valid_in_new_version_is_invalid_for_an_old_target():
    d = seed_dict()
    d["sglang_version"] = "0.5.6"
    _one(d, "parsers.reasoning_parser", "not a reasoning parser of SGLang 0.5.6")


def test_sparse_attention_backends_are_checked_against_the_target_release():
    d = dsv32_dict()
    d["model"]["dsa_decode_backend"] = "flashmla_kvv"
    f = _one(d, "model.dsa_decode_backend", "not a --dsa-decode-backend choice of SGLang 0.5.23", "'flashmla_kv'")
    d["model"]["dsa_decode_backend"] = "flashmla_kv"
    d["sglang_version"] = "0.5.6"  # triton_sparse_mla came after 0.5.6, whose flag is --nsa-prefill-backend
    f = _one(d, "model.dsa_prefill_backend", "not a --nsa-prefill-backend choice of SGLang 0.5.6")
    assert "flashmla_sparse" in f.fix
    d["model"]["dsa_prefill_backend"] = "flashmla_sparse"
    assert not [x for x in validate(parse_spec(d)) if x.field.startswith("model.dsa_")]


def test_auto_parsers_are_asked_to_be_named():
    d = seed_dict()  # DeepSeek-V4: the fix names its parsers
    d["parsers"]["reasoning_parser"] = "auto"
    d["parsers"]["tool_call_parser"] = "auto"
    f = _one(d, "parsers.tool_call_parser", '"auto" leaves the choice to SGLang', 'tool_call_parser = "deepseekv4"')
    assert "not a tool-call parser" not in f.message
    _one(d, "parsers.reasoning_parser", '"auto" leaves the choice', 'reasoning_parser = "deepseek-v4"')


def test_an_api_key_in_extra_args_is_refused():
    d = seed_dict()
    d["decode"][0]["extra_args"] = ["--api-key", "sk-1"]
    f = _one(d, "decode[0].extra_args", "--api-key", "401")
    assert "private address" in f.fix


def test_executables_must_be_absolute_paths():
    # A relative or bare engine.python passed validate and plan, then apply and units crashed with a traceback
    # ("argv[0] must be an absolute path")
    d = seed_dict()
    d["engine"]["python"] = "../venv/bin/python"
    _one(d, "engine.python", "not an absolute path", "absolute path on the host")
    d["engine"]["python"] = "python3"
    _one(d, "engine.python", "not an absolute path")
    d["engine"]["python"] = "/opt/sglang/.venv/bin/python"
    d["router"]["executable"] = "../venv/bin/smg"
    _one(d, "router.executable", "relative path")
    d["router"]["executable"] = "smg"  # a bare name: looked up on PATH where pdctl runs
    assert not [f for f in validate(parse_spec(d)) if f.field in ("engine.python", "router.executable")]


def test_a_relative_cache_dir_is_refused():
    # (it was written into the units as SGLANG_CACHE_DIR=rel/cache, which each process reads from its own cwd)
    d = seed_dict()
    d["engine"]["cache_dir"] = "rel/cache"
    _one(d, "engine.cache_dir", "'rel/cache' is not an absolute path", "/var/cache/sglang")
    d["engine"]["cache_dir"] = "/var/cache/sglang"
    assert not [f for f in validate(parse_spec(d)) if f.field == "engine.cache_dir"]


def test_an_unknown_or_missing_key_gives_its_fix_in_the_findings_fix_field():
    # (--json findings had "fix": null for them, the fix inside the message, which scripts had to parse out)
    d = seed_dict()
    d["router"]["polcy"] = "random"
    del d["model"]
    with pytest.raises(SpecError) as e:
        parse_spec(d)
    found = {f["field"]: f for f in e.value.findings_json()}
    assert found["model"] == {"field": "model", "message": "required", "fix": "add it"}, found
    assert found["router.polcy"]["message"] == "unknown key", found
    assert found["router.polcy"]["fix"].startswith("remove it or check its spelling"), found
    assert "did you mean 'policy'?" in found["router.polcy"]["fix"], found
    # the text says each as before: field, message, fix
    assert "  model: required: add it" in str(e.value) and "  router.polcy: unknown key: remove it" in str(e.value)


def test_a_nul_character_in_any_text_of_the_spec_is_refused_naming_the_field():
    # (it passed validate and plan; `units` died with a traceback and apply stopped a healthy server whose successor
    # could not be exec'd: "embedded null byte")
    d = seed_dict()
    d["model"]["served_name"] = "deep\x00seek"
    d["engine"]["env"] = {"FOO": "a\x00b", "B\x00AR": "x"}
    d["prefill"][0]["extra_args"] = ["--x", "\x00"]
    with pytest.raises(SpecError) as e:
        parse_spec(d)
    found = e.value.findings_json()
    assert sorted(f["field"] for f in found) == ["engine.env", "engine.env.FOO", "model.served_name",
                                                 "prefill[0].extra_args[1]"], found
    assert all("NUL character" in f["message"] and f["fix"] == "remove it" for f in found), found
    assert str(e.value).count("NUL character") == 4 and ": remove it" in str(e.value)


def test_a_bare_router_executable_not_on_path_is_a_clear_error(monkeypatch):
    from pdctl.statemachine.errors import PdctlError
    from pdctl.statemachine.launch import router_executable

    d = seed_dict()
    d["router"]["executable"] = "smg-nowhere"
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(PdctlError) as e:
        router_executable(parse_spec(d))
    assert "router.executable: 'smg-nowhere' is not on PATH" in str(e.value) and "absolute path" in str(e.value)


def test_removed_flags_in_extra_args():
    d = seed_dict()
    d["prefill"][0]["extra_args"] = ["--disaggregation-decode-tp", "4"]
    d["decode"][0]["extra_args"] = ["--nsa-decode-backend=fa3"]
    _one(d, "prefill[0].extra_args", "removed in SGLang 0.5.12", "remove --disaggregation-decode-tp")
    _one(d, "decode[0].extra_args", "removed in SGLang 0.5.20", "use --dsa-decode-backend")


def test_extra_args_that_fight_pdctl_owned_settings():
    d = seed_dict()
    d["prefill"][0]["extra_args"] = ["--port", "31000"]
    d["decode"][0]["extra_args"] = ["--tool-call-parser", "qwen"]
    _one(d, "prefill[0].extra_args", "--port is set by pdctl from port")
    _one(d, "decode[0].extra_args", "--tool-call-parser is set by pdctl")


def test_load_format_in_extra_args_fights_model_load_format():
    # (pdctl renders model.load_format as --load-format; the unit had both, the last won: prefill on dummy weights)
    d = seed_dict()
    d["model"]["load_format"] = "auto"
    d["prefill"][0]["extra_args"] = ["--load-format", "dummy"]
    d["decode"][0]["extra_args"] = ["--load-format=dummy"]
    for side in ("prefill", "decode"):
        _one(d, f"{side}[0].extra_args", "--load-format is set by pdctl from model.load_format",
             "set model.load_format instead")


def test_every_flag_pdctl_renders_for_a_server_is_refused_in_extra_args():
    # compared with what units.server_argv renders: a flag rendered from the spec and missing from the owned list
    # is taken twice, and the last one wins
    from pdctl.statemachine.launch import launch_for_role
    from pdctl.statemachine.rules import _OWNED_SERVER_FLAGS
    from pdctl.units import server_argv

    d = seed_dict()
    d["model"].update(load_format="auto", attention_backend="fa3", page_size=256,
                      dsa_prefill_backend="flashmla_sparse", dsa_decode_backend="flashmla_kv")
    d["kv_transfer"]["ib_device"] = "mlx5_0"
    d["decode"][0].update(attn_dp=2, ep=2, bootstrap_port=8998)
    dep = parse_spec(d)
    rendered = set()
    for name, _kind, _role in dep.roles():
        argv = server_argv(launch_for_role(dep, name))
        rendered |= {a for a in argv[3:] if a.startswith("--")}
    assert rendered - set(_OWNED_SERVER_FLAGS) == set(), rendered - set(_OWNED_SERVER_FLAGS)


def test_gpu_count_counts_pipeline_stages_given_in_extra_args():
    # SGLang runs tp x pp ranks, one per GPU: 4 GPUs with tp 4 and --pp-size 2 passed and failed at start
    d = seed_dict()
    d["prefill"][0]["extra_args"] = ["--pp-size", "2"]
    d["decode"][0]["extra_args"] = ["--pipeline-parallel-size=2"]
    for side in ("prefill", "decode"):
        f = _one(d, f"{side}[0].gpus", "tp = 4 × pp 2 = 8", "one rank per GPU", "list exactly 8 GPUs")
        assert "--pp-size" in f.fix, f
    d = seed_dict()
    d["prefill"][0].update(tp=2, extra_args=["--pp-size", "2"])
    assert not [f for f in _errors(d) if f.field == "prefill[0].gpus"], _errors(d)
    d["prefill"][0]["extra_args"] = ["--pp-size", "4"]
    _one(d, "prefill[0].gpus", "tp = 2 × pp 4 = 8")


def test_pd_role_switch_is_refused():
    # it lets SGLang switch a role at runtime and starts a bootstrap server on decode too, on a port nobody checks
    d = seed_dict()
    d["decode"][0]["extra_args"] = ["--enable-pd-role-switch"]
    f = _one(d, "decode[0].extra_args", "--enable-pd-role-switch", "/pd_role_switch", "bootstrap server",
             "remove --enable-pd-role-switch", "[[prefill]]")
    assert "8998" in f.message, f
    assert len(_extra_args_errors(["--enable-pd-role-switch"])) == 1


def test_skip_tokenizer_init_with_parsers_is_refused():
    d = seed_dict()  # (the seed sets a reasoning and a tool-call parser)
    d["decode"][0]["extra_args"] = ["--skip-tokenizer-init"]
    _one(d, "decode[0].extra_args", "--skip-tokenizer-init", "input_ids", "parsers.reasoning_parser",
         "remove --skip-tokenizer-init")
    d["parsers"] = {"chat_template": "/opt/t.jinja"}
    _one(d, "decode[0].extra_args", "--skip-tokenizer-init", "parsers.chat_template")
    d.pop("parsers")
    # without parsers, PD still needs text: kv_link_verified's paired /generate request and decode's answer
    _one(d, "decode[0].extra_args", "--skip-tokenizer-init", "kv_link_verified", "remove --skip-tokenizer-init")
    single = collapsed(seed_dict())
    single.pop("parsers", None)
    single["server"][0]["extra_args"] = ["--skip-tokenizer-init"]
    assert not [f for f in _errors(single) if "skip-tokenizer-init" in f.message], _errors(single)


def test_dp_size_in_extra_args_says_what_it_is():
    # 0.5.23: --dp-size is data-parallel replicas, attn_dp renders --attn-dp-size; the refusal said the opposite
    for flag in ("--dp-size", "--data-parallel-size"):
        (msg,) = _extra_args_errors([flag, "2"])
        assert "data-parallel replicas" in msg and "--attn-dp-size" in msg, msg
        assert "is set by pdctl from attn_dp" not in msg, msg
        assert "[[prefill]]" in msg and "attn_dp" in msg.split("|")[1], msg
    # ≤ 0.5.20 pdctl spells attention DP --dp-size N --enable-dp-attention: there it is pdctl's own
    d = seed_dict()
    d["sglang_version"] = "0.5.6"
    d["parsers"] = {"reasoning_parser": "deepseek-v3", "tool_call_parser": "deepseekv32"}
    d["decode"][0]["extra_args"] = ["--dp-size", "2"]
    _one(d, "decode[0].extra_args", "--dp-size is set by pdctl from attn_dp", "set attn_dp instead")


def test_settings_that_must_match_on_prefill_and_decode():
    d = seed_dict()
    d["prefill"][0]["extra_args"] = ["--tokenizer-path", "/opt/tok"]
    f = _one(d, "prefill[0].extra_args", "--tokenizer-path", "prefill[0]", "decode[0]", "/opt/tok")
    assert "decode[0].extra_args" in f.message or "decode[0].extra_args" in f.fix, f
    d["decode"][0]["extra_args"] = ["--tokenizer-path=/opt/tok"]
    assert not [f for f in _errors(d) if "--tokenizer-path" in f.message], _errors(d)
    # the model path written out is SGLang's default: the same tokenizer
    d["prefill"][0]["extra_args"] = ["--tokenizer-path", d["model"]["path"]]
    d["decode"][0]["extra_args"] = []
    assert not [f for f in _errors(d) if "--tokenizer-path" in f.message], _errors(d)

    d = seed_dict()
    d["decode"][0]["extra_args"] = ["--disaggregation-enable-kv-checksum"]
    _one(d, "decode[0].extra_args", "--disaggregation-enable-kv-checksum", "prefill[0]", "both")
    d["prefill"][0]["extra_args"] = ["--disaggregation-enable-kv-checksum"]
    assert not [f for f in _errors(d) if "checksum" in f.message], _errors(d)

    # the allocation policy: the same on both, and prefill_complete is Mooncake's only
    d = seed_dict()
    d["prefill"][0]["extra_args"] = ["--disaggregation-decode-allocation-policy", "prefill_complete"]
    _one(d, "prefill[0].extra_args", "--disaggregation-decode-allocation-policy", "decode[0]")
    d["decode"][0]["extra_args"] = ["--disaggregation-decode-allocation-policy", "prefill_complete"]
    f = _one(d, "prefill[0].extra_args", "prefill_complete", "Mooncake", "kv_transfer.backend = 'nixl'")
    assert not [x for x in _errors(d) if "differ" in x.message], _errors(d)
    assert "mooncake" in f.fix, f
    d["kv_transfer"]["backend"] = "mooncake"  # (attention TP 4 is refused too)
    _one(d, "prefill[0].extra_args", "prefill_complete", "attention TP 4", "set attn_dp = tp on prefill[0]")
    for side in ("prefill", "decode"):
        d[side][0]["attn_dp"] = 4
    assert not [f for f in _errors(d) if "allocation-policy" in f.message], _errors(d)
    # "early" written on one side is the default on the other: the same policy
    d["prefill"][0]["extra_args"] = ["--disaggregation-decode-allocation-policy", "early"]
    d["decode"][0]["extra_args"] = []
    assert not [f for f in _errors(d) if "allocation-policy" in f.message], _errors(d)


def test_ib_device_is_a_comma_separated_list():
    d = seed_dict()
    d["kv_transfer"]["ib_device"] = "mlx5_0 mlx5_1"
    _one(d, "kv_transfer.ib_device", "comma-separated", 'write "mlx5_0,mlx5_1"')
    d["kv_transfer"]["ib_device"] = "mlx5_0, mlx5_1"
    _one(d, "kv_transfer.ib_device", 'write "mlx5_0,mlx5_1"')
    for fine in ("mlx5_0", "mlx5_0,mlx5_1", '{"0": "mlx5_0,mlx5_1", "1": "mlx5_2"}', "/etc/sglang/ib.json"):
        d["kv_transfer"]["ib_device"] = fine
        assert not [f for f in validate(parse_spec(d)) if f.field == "kv_transfer.ib_device"], fine
    d["kv_transfer"]["ib_device"] = '{"0": "mlx5_0 mlx5_1"}'
    _one(d, "kv_transfer.ib_device", "GPU 0", 'write "mlx5_0,mlx5_1"')


def test_ucx_net_devices_with_a_backend_that_is_not_ucx_is_a_warning():
    d = seed_dict()
    d["kv_transfer"].update(backend="mooncake", ucx_net_devices="mlx5_0:1")
    _one(d, "kv_transfer.ucx_net_devices", "mooncake", "NIXL", "remove kv_transfer.ucx_net_devices",
         level="warning")
    d["kv_transfer"]["backend"] = "nixl"
    assert not [f for f in validate(parse_spec(d)) if f.field == "kv_transfer.ucx_net_devices"]


def test_unknown_flags_in_extra_args():
    d = seed_dict()
    d["decode"][0]["extra_args"] = ["--no-such-flag"]
    _one(d, "decode[0].extra_args", "not a launch_server flag of SGLang 0.5.23")


def _extra_args_errors(args: list[str]) -> list[str]:
    d = seed_dict()
    d["decode"][0]["extra_args"] = args
    return [f"{f.message} | {f.fix}" for f in validate(parse_spec(d)) if f.field == "decode[0].extra_args"]


def test_extra_args_are_read_as_sglangs_argparse_reads_them():
    # (only the flag names were checked: a value without its flag, a flag without its value or a value outside its
    # choices passed validate, and SGLang exited 2 at the role's start, after the units were installed)
    assert _extra_args_errors(["--max-running-requests", "64", "--disable-radix-cache", "--numa-node", "0", "1",
                               "--log-requests-level=2", "--enable-tf32-matmul", "--no-enable-tf32-matmul",
                               "--sampling-backend", "pytorch", "--schedule-conservativeness", "-0.5",
                               "--model-checksum", "--lora-paths"]) == []
    (stray,) = _extra_args_errors(["--disable-radix-cache", "true"])
    assert stray.startswith("'true': no flag takes it (SGLang 0.5.23 would exit 'unrecognized arguments')"), stray
    (stray,) = _extra_args_errors(["64", "--max-running-requests", "64"])
    assert stray.startswith("'64': no flag takes it"), stray
    # (a flag and its value in one string: the fix named --mem-fraction-static, which pdctl sets itself)
    (joined,) = _extra_args_errors(["--max-running-requests 64"])
    assert joined == ("'--max-running-requests 64': no flag takes it (SGLang 0.5.23 would exit 'unrecognized "
                      "arguments') | give the flag and its value as two items: [\"--max-running-requests\", \"64\"]"), joined
    assert "mem-fraction" not in _extra_args_errors(["--bogus-flag 1"])[0]
    (missing,) = _extra_args_errors(["--max-running-requests", "--disable-radix-cache"])
    assert missing.startswith("--max-running-requests needs a value after it"), missing
    assert '["--max-running-requests", "…"]' in missing, missing
    (missing,) = _extra_args_errors(["--numa-node"])
    assert missing.startswith("--numa-node needs one or more values after it") and "'expected at least one" in missing
    # a word starting with '-' is a value only as a negative number (or with a space in it), as argparse reads it
    (missing,) = _extra_args_errors(["--schedule-conservativeness", "-1e-3"])
    assert missing.startswith("--schedule-conservativeness needs a value after it"), missing
    assert '"--schedule-conservativeness=-…"' in missing, missing
    assert _extra_args_errors(["--schedule-conservativeness=-1e-3", "--revision", "-.5"]) == []
    (missing,) = _extra_args_errors(["--bucket-time-to-first-token", "-inf", "0.5"])  # (said once, as argparse does)
    assert missing.startswith("--bucket-time-to-first-token needs one or more values"), missing
    (dash,) = _extra_args_errors(["-foo"])
    assert dash.startswith("'-foo': argparse reads a word starting with '-' as an option"), dash
    assert _extra_args_errors(["-h"]) == ["-h makes SGLang print its help and exit: the server would not start | remove -h"]
    (helped,) = _extra_args_errors(["--help"])
    assert helped.startswith("--help makes SGLang print its help and exit"), helped
    (abbrev,) = _extra_args_errors(["--swa-full", "0.5"])
    assert "only an abbreviation of --swa-full-tokens-ratio" in abbrev and "write --swa-full-tokens-ratio in full" in abbrev
    (owned,) = _extra_args_errors(["--mem-frac", "0.8"])
    assert owned.startswith("--mem-frac (an abbreviation of --mem-fraction-static) is set by pdctl"), owned
    # a flag pdctl always passes: "is set by pdctl from (always on: pdctl passes it)", "and set (always on…) instead"
    assert _extra_args_errors(["--enable-metrics"]) == [
        "--enable-metrics is always passed by pdctl | remove --enable-metrics from extra_args"]
    # multi-node flags: --dist-init-addr replaced the NCCL port pdctl checks with one nothing checked
    for args in (["--dist-init-addr", "127.0.0.1:36110"], ["--nnodes", "2"], ["--node-rank=1"], ["--dist-init", "h:1"]):
        (multi,) = _extra_args_errors(args)
        assert "spreads a server over several nodes" in multi and f"remove {args[0].split('=')[0]}" in multi, multi
    # an abbreviation of a refused flag is refused as that flag ("write --api-key in full", which is refused too)
    (key,) = _extra_args_errors(["--api", "sk-1"])
    assert key.startswith("--api (an abbreviation of --api-key) makes the server answer 401"), key
    assert key.endswith("| remove --api; keep the servers on a private address and expose only the router"), key
    assert _extra_args_errors(["--revision", "--my rev"]) == []  # (a space in it: argparse takes it as the value)
    (js,) = _extra_args_errors(["--default-chat-template-kwargs", "{bad"])
    assert js.startswith("--default-chat-template-kwargs '{bad': not JSON"), js
    assert _extra_args_errors(["--default-chat-template-kwargs", '{"a": 1}']) == []
    # a str flag SGLang json.loads after argparse: the server would exit at its start, not at argparse
    for bad in ("{bad", "[1]"):
        (override,) = _extra_args_errors(["--json-model-override-args", bad])
        assert override.startswith(f"--json-model-override-args {bad!r}: not a JSON object"), override
        assert "| give --json-model-override-args a JSON object" in override, override
    assert _extra_args_errors(["--json-model-override-args", '{"max_position_embeddings": 163840}']) == []
    (valued,) = _extra_args_errors(["--disable-radix-cache=true"])
    assert valued.startswith("'--disable-radix-cache=true': --disable-radix-cache takes no value"), valued
    (typed,) = _extra_args_errors(["--chunked-prefill-size", "8k"])
    assert typed.startswith("--chunked-prefill-size '8k': not a whole number"), typed
    (typed,) = _extra_args_errors(["--schedule-conservativeness=most"])
    assert typed.startswith("--schedule-conservativeness 'most': not a number"), typed
    (choice,) = _extra_args_errors(["--log-requests-level", "5"])
    assert choice.startswith("--log-requests-level '5' is not one of SGLang 0.5.23's choices: 0, 1, 2, 3"), choice
    (choice,) = _extra_args_errors(["--sampling-backend", "torch"])
    assert "is not one of SGLang 0.5.23's choices" in choice and "pytorch" in choice, choice
    # a flag refused on its own (pdctl sets it, or SGLang has none of that name) is said once, its value passed over
    assert len(_extra_args_errors(["--port", "31000"])) == 1
    assert len(_extra_args_errors(["--no-such-flag", "3"])) == 1


def test_cuda_visible_devices_in_env_fights_the_gpu_list():
    d = seed_dict()
    d["decode"][0]["env"] = {"CUDA_VISIBLE_DEVICES": "0"}
    _one(d, "decode[0].env.CUDA_VISIBLE_DEVICES", "set by pdctl from gpus")


def test_fake_transfer_backend_is_refused_because_prefill_refuses_it():
    d = seed_dict()
    d["kv_transfer"]["backend"] = "fake"
    _one(d, "kv_transfer.backend", "Prefill server does not support 'fake'")


def test_transfer_backend_the_target_version_lacks():
    d = seed_dict()
    d["sglang_version"] = "0.5.6"
    d["parsers"] = {"reasoning_parser": "deepseek-v3", "tool_call_parser": "deepseekv32"}
    d["kv_transfer"]["backend"] = "mooncake_tcp"
    _one(d, "kv_transfer.backend", "not a transfer backend of SGLang 0.5.6")


def test_prefill_on_loopback_while_decode_is_on_another_host():
    d = seed_dict()
    d["hosts"]["gpu2"] = {"address": "10.0.0.2"}
    d["decode"][0]["host"] = "gpu2"
    _one(d, "prefill[0].http_host", "decode cannot reach the bootstrap")


def test_router_worker_startup_timeout_shorter_than_a_cold_start():
    d = seed_dict()
    d["router"]["worker_startup_timeout_s"] = 600
    _one(d, "router.worker_startup_timeout_s", "not longer than prefill's expected cold start", ">= 1501")
    d["router"]["worker_startup_timeout_s"] = 1500  # equal is refused too, as the fix says; 1501 passes
    _one(d, "router.worker_startup_timeout_s", "not longer than prefill's expected cold start (1500 s)", ">= 1501")
    d["router"]["worker_startup_timeout_s"] = 1501
    assert not [f for f in validate(parse_spec(d)) if f.field == "router.worker_startup_timeout_s"]


def test_prometheus_on_all_interfaces_is_a_warning_unless_opted_in():
    d = seed_dict()
    d["router"]["prometheus_host"] = "0.0.0.0"
    _one(d, "router.prometheus_host", "allow_public_prometheus", level="warning")
    d["router"]["allow_public_prometheus"] = True
    assert not [f for f in validate(parse_spec(d)) if f.field == "router.prometheus_host"]


def test_pd_without_router_or_kv_transfer():
    d = seed_dict()
    del d["router"]
    del d["kv_transfer"]
    fields = {f.field for f in _errors(d)}
    assert {"router", "kv_transfer"} <= fields


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_unknown_host_reference(role):
    d = seed_dict()
    d[role][0]["host"] = "gpu9"
    _one(d, f"{role}[0].host", "host 'gpu9' is not declared", "[hosts.gpu9]")
    # one error for a typo, not also "roles run on 2 hosts" or "decode cannot reach the bootstrap", whose fixes
    # (one host; bind prefill to every interface) point elsewhere (a prefill typo gave that second one)
    assert [f.field for f in _errors(d)] == [f"{role}[0].host"], _errors(d)


def test_unknown_target_version():
    d = seed_dict()
    d["sglang_version"] = "0.9.1"
    _one(d, "sglang_version", "no facts for SGLang 0.9.1")


def test_kernels_enabled_with_none_named_is_refused():
    d = dsv32_dict()
    d["kernels"] = {"enabled": True, "which": []}
    _one(d, "kernels.which", "none is named", "set kernels.enabled = false")


@pytest.mark.parametrize("name", ["bad name", "-lead", "a/b", "x" * 70, "ünï", "seed\n"])
def test_a_name_that_cannot_become_a_systemd_unit_name(name):
    # ("seed\n", a TOML escape, passed: the pattern's $ matches before a final newline, and every unit name broke)
    d = seed_dict()
    d["name"] = name
    with pytest.raises(SpecError) as e:
        parse_spec(d)
    assert "name:" in str(e.value) and "systemd unit name" in str(e.value)


@pytest.mark.parametrize("user", ["1000", "svc.user", "bad name", "", "x" * 33, "root\n"])
def test_a_service_user_that_is_not_an_account_name_is_refused_by_name(user):
    d = seed_dict()
    d["service_user"] = user
    with pytest.raises(SpecError) as e:
        parse_spec(d)
    assert "service_user:" in str(e.value) and "account name" in str(e.value), str(e.value)


def test_a_service_user_is_refused_under_a_user_manager_and_taken_by_the_others():
    d = seed_dict()
    d.update(service_user="sglang", service_manager="systemd-user")
    _one(d, "service_user", "systemd-user", "runs every unit as its own user", 'service_manager = "systemd-system"')
    for manager in ("systemd-system", "process"):
        d["service_manager"] = manager
        assert not [f for f in _errors(d) if f.field == "service_user"], manager


def test_unknown_keys_are_refused_with_the_field_named():
    d = seed_dict()
    d["router"]["prot"] = 1
    with pytest.raises(SpecError) as e:
        parse_spec(d)
    assert "router.prot: unknown key" in str(e.value)


@pytest.mark.parametrize(("path", "typo", "meant"), [
    (("model",), "contex_length", "context_length"),
    (("parsers",), "tool_call_parsr", "tool_call_parser"),
    (("model",), "servd_name", "served_name"),
    (("prefill", 0), "bootstrap_prt", "bootstrap_port"),
    (("router",), "prot", "port"),
    (("hosts", "local"), "adress", "address"),
    ((), "sglang_verison", "sglang_version"),
])
def test_an_unknown_key_names_the_valid_key_spelled_closest_at_its_place(path, typo, meant):
    d = seed_dict()
    node = d
    for k in path:
        node = node[k]
    node[typo] = 1
    with pytest.raises(SpecError) as e:
        parse_spec(d)
    field = ".".join(str(k) for k in path).replace(".0", "[0]")
    field = f"{field}.{typo}" if field else typo
    assert (f"{field}: unknown key: remove it or check its spelling: "
            f"did you mean {meant!r}?") in str(e.value)


def test_an_unknown_key_with_no_close_valid_key_gets_no_guess():
    d = seed_dict()
    d["prefill"][0]["parsers"] = {"zzzzzz": "x"}
    with pytest.raises(SpecError) as e:
        parse_spec(d)
    assert "prefill[0].parsers.zzzzzz: unknown key" in str(e.value)
    assert "did you mean" not in str(e.value)
    # what the table does take, instead (it named examples/seed.toml, a path in pdctl's repository, not an install)
    assert "; prefill[0].parsers takes reasoning_parser, tool_call_parser, chat_template" in str(e.value), str(e.value)
    d = seed_dict()
    d["bananas"] = 1
    with pytest.raises(SpecError) as e:
        parse_spec(d)
    assert "bananas: unknown key: remove it or check its spelling; the top level takes name, sglang_version, " \
        in str(e.value) and "seed.toml" not in str(e.value), str(e.value)


def test_an_unknown_key_is_matched_against_the_keys_of_its_own_table():
    # 'port' is a key of [router] and of [[prefill]], never of [model]: no guess there from another table
    d = seed_dict()
    d["model"]["prot"] = 1
    with pytest.raises(SpecError) as e:
        parse_spec(d)
    assert "model.prot: unknown key" in str(e.value) and "'port'" not in str(e.value)


def test_missing_required_field_is_named():
    d = seed_dict()
    del d["prefill"][0]["port"]
    with pytest.raises(SpecError) as e:
        parse_spec(d)
    assert "prefill[0].port: required" in str(e.value)


@pytest.mark.parametrize("path,value,words", [
    (("prefill", 0, "port"), "30010", "must be a whole number, not '30010': remove the quotes"),
    (("prefill", 0, "port"), True, "must be a whole number, not true"),  # lax parsing took it as port 1
    (("router", "port"), 30001.0, "must be a whole number, not 30001.0: write 30001"),
    (("decode", 0, "tp"), "four", "must be a whole number, not 'four': write a whole number, without quotes"),
    (("decode", 0, "gpus"), [4, 5, "6", 7], "must be a whole number, not '6': remove the quotes"),
    (("model", "trust_remote_code"), "yes", "must be true or false, not 'yes': write true or false, without quotes"),
    (("model", "trust_remote_code"), 1, "must be true or false, not 1"),
    (("prefill", 0, "mem_fraction"), True, "must be a number, not true"),  # lax parsing wrote --mem-fraction-static 1.0
    (("prefill", 0, "mem_fraction"), "0.8", "must be a number, not '0.8': remove the quotes"),
    (("prefill", 0, "port"), "３００１０", "must be a whole number, not '３００１０': write a whole number, without quotes"),
    (("prefill", 0, "gpus"), 4, "must be a list: write it in brackets, e.g. [0, 1, 2, 3]"),
    (("prefill", 0, "gpus"), [], "must not be empty: give at least one"),
    (("router", "extra_args"), "--x", 'must be a list: write it in brackets, e.g. ["--flag", "value"]'),
    (("model", "served_name"), 123, "must be text: put it in quotes"),
    (("engine", "env"), 5, "must be a table: write it as [section] or { key = value }"),
    (("model", "trust_remote_code"), "True", "must be true or false, not 'True': write true, without quotes"),
    (("prefill",), {"gpus": [0], "port": 1}, "must be a list of tables: write each one as [[prefill]] (double brackets)"),
    (("kernels", "which"), "sparse_mla_decode", 'must be a list: write it in brackets, e.g. ["sparse_mla_decode"]'),
    (("router", "worker_startup_timeout_s"), 10**20,
     "must be at most 2147483647, not 100000000000000000000: write a value in range"),
    # (it passed validate and apply: SGLang sizes int32 token-slot tensors by it)
    (("model", "context_length"), 10**20, "must be at most 2147483647, not 100000000000000000000"),
    (("model", "page_size"), 2**31, "must be at most 2147483647, not 2147483648"),
    # out of range: the bound, and for a fraction written as a percentage the fraction meant
    (("prefill", 0, "mem_fraction"), 90, "must be at most 1, not 90: it is a fraction; for 90 %, write 0.9"),
    (("prefill", 0, "mem_fraction"), 1.5, "must be at most 1, not 1.5: write a value in range"),  # not a percentage
    (("decode", 0, "mem_fraction"), 0, "must be more than 0, not 0: write a value in range"),
    (("router", "port"), 70000, "must be at most 65535, not 70000: write a value in range"),
    (("decode", 0, "tp"), 0, "must be at least 1, not 0: write a value in range"),
    (("prefill", 0, "expected_cold_start_s"), float("inf"), "must be a finite number"),  # crashed the rules
    (("decode", 0, "mem_fraction"), float("nan"), "must be a finite number"),
    # so that the router's timeout (at most 2**31 - 1 s) can always exceed it, as the rule's fix asks
    (("prefill", 0, "expected_cold_start_s"), 3e9, "must be at most 2147483646, not 3000000000.0"),
    (("prefill", 0, "numa_node"), 1024, "must be at most 1023, not 1024"),  # Linux's MAX_NUMNODES
    # a proposed fix that the field's range would refuse next names the range instead
    (("prefill", 0, "port"), 1e10, "must be a whole number at most 65535, not 10000000000.0: write a value in range"),
    (("router", "port"), "70000", "must be a whole number at most 65535, not '70000': write a value in range"),
    (("prefill", 0, "mem_fraction"), "9", "must be a number at most 1, not '9': it is a fraction; for 9 %, write 0.09"),
    # a percentage in quotes, for a fraction
    (("prefill", 0, "mem_fraction"), "90%", "must be a number, not '90%': for 90 %, write 0.9"),
    (("prefill", 0, "mem_fraction"), "150%", "must be a number at most 1, not '150%': write a value in range"),
    (("prefill", 0, "expected_cold_start_s"), "90%", "must be a number, not '90%': write a number, without quotes"),
    # unquoted, these would be refused as not finite: not "remove the quotes"
    (("prefill", 0, "mem_fraction"), "inf", "must be a number, not 'inf': write a finite number, not inf or nan"),
    (("prefill", 0, "expected_cold_start_s"), "1e400", "must be a number, not '1e400': write a finite number, not inf or nan"),
])
def test_values_of_another_toml_type_or_out_of_range_are_refused_with_a_fix(path, value, words):
    e = _refused(path, value)
    field = ".".join(f"[{k}]" if isinstance(k, int) else k for k in path).replace(".[", "[")
    if path[-1] == "gpus" and isinstance(value, list) and value:
        field += "[2]"
    assert f"{field}: {words}" in str(e.value), str(e.value)


@pytest.mark.parametrize("cpus, words", [
    ({"zero": "0-31"}, "hosts.local.numa_cpus: key 'zero' must be a NUMA node number"),
    ({"-1": "0-31"}, "hosts.local.numa_cpus: key '-1' must be a NUMA node number"),
    ({"01": "0-31"}, "hosts.local.numa_cpus: key '01' must be a NUMA node number"),  # would collide with "1"
    ({"1.0": "0-31"}, "hosts.local.numa_cpus: key '1.0' must be a NUMA node number"),
    ({"+1": "0-31"}, "hosts.local.numa_cpus: key '+1' must be a NUMA node number"),
    ({"0": "abc"}, "hosts.local.numa_cpus.0: 'abc' is not a CPU list: write CPU numbers and ranges, e.g. \"0-31,64-95\""),
    ({"0": "9-3"}, "hosts.local.numa_cpus.0: '9-3' is not a CPU list"),
    ({"0": "0-31;64-95"}, "hosts.local.numa_cpus.0: '0-31;64-95' is not a CPU list"),
    ({"0": "0-31,,64"}, "hosts.local.numa_cpus.0: '0-31,,64' is not a CPU list"),
    ({"0": "０-３"}, "hosts.local.numa_cpus.0: '０-３' is not a CPU list"),  # non-ASCII digits
    ({"0": "0-8192"}, "hosts.local.numa_cpus.0: '0-8192' is not a CPU list: CPU numbers stop at 8191"),
    ({"1024": "0-3"}, "hosts.local.numa_cpus: key '1024' must be at most 1023, not 1024"),
    ({"0": 5}, "hosts.local.numa_cpus.0: must be text: put it in quotes"),
])
def test_numa_cpu_lists_are_checked_before_they_reach_cpu_affinity(cpus, words):
    # systemd ignores a CPUAffinity= it cannot parse and starts the unit unpinned, so the spec refuses it
    d = seed_dict()
    d["hosts"]["local"]["numa_cpus"] = cpus
    with pytest.raises(SpecError) as e:
        parse_spec(d)
    assert words in str(e.value), str(e.value)


def test_numa_cpu_lists_are_kept_in_the_form_the_units_are_rendered_from(tmp_path):
    # spaces (systemd reads them as separators) become sysfs's commas; "" is a node without CPUs (no pinning); and
    # whatever the spec accepts, the unit renderer writes
    from pdctl.statemachine.launch import write_units

    d = seed_dict()
    d["hosts"]["local"]["numa_cpus"] = {"0": " 0-31, 64-95 ", "1": "96-127 32-63", "2": ""}
    dep = parse_spec(d)
    assert dep.hosts["local"].numa_cpus == {0: "0-31,64-95", 1: "32-63,96-127", 2: ""}
    units = "".join(p.read_text() for p in write_units(dep, tmp_path) if p.suffix == ".service")
    assert "CPUAffinity=0-31,64-95" in units and "CPUAffinity=32-63,96-127" in units


def test_a_negative_gpu_id_is_refused_with_the_ids_to_use():
    d = seed_dict()
    d["decode"][0]["gpus"] = [-1, 5, 6, 7]
    with pytest.raises(SpecError) as e:
        parse_spec(d)
    assert "decode[0].gpus: GPU ids are >= 0, not -1: use the ids nvidia-smi lists (0, 1, …)" in str(e.value)


def test_gpu_numa_entries_are_node_numbers_or_minus_one_and_minus_one_binds_nothing(tmp_path):
    from pdctl.statemachine.launch import write_units

    d = seed_dict()
    d["hosts"]["local"]["gpu_numa"] = [0, 0, 0, 1024, 1, 1, 1, 1]
    with pytest.raises(SpecError) as e:
        parse_spec(d)
    assert "hosts.local.gpu_numa[3]: must be at most 1023, not 1024" in str(e.value)
    d["hosts"]["local"]["gpu_numa"] = [-1, -1, -1, -1, 1, 1, 1, 1]  # sysfs says -1 for "no NUMA node reported"
    del d["prefill"][0]["numa_node"]
    units = {p.name: p.read_text() for p in write_units(parse_spec(d), tmp_path) if p.suffix == ".service"}
    [prefill] = [u for n, u in units.items() if n.endswith("-prefill.service")]
    assert "NUMAMask=" not in prefill and "CPUAffinity=" not in prefill


def test_a_console_refresh_past_an_hour_is_refused():
    # the console's telemetry wait overflowed time_t at 1e10 s and stopped
    d = seed_dict()
    d["console"] = {"refresh_s": 1e10}
    with pytest.raises(SpecError) as e:
        parse_spec(d)
    assert "console.refresh_s: must be at most 3600, not 10000000000.0" in str(e.value)


def test_an_integer_is_still_a_number_for_a_fraction():
    d = seed_dict()
    d["prefill"][0]["mem_fraction"] = 1
    assert parse_spec(d).prefill[0].mem_fraction == 1.0


def test_a_toml_syntax_error_reports_the_line(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text('name = "x"\n[model]\npath = "m"\n[[prefill]\nport = 1\n')
    with pytest.raises(SpecError) as e:
        load_spec(p)
    assert "TOML syntax error" in str(e.value) and "line 4" in str(e.value)
    assert e.value.message.endswith(": [[prefill]") and "fix that line" in e.value.hint, e.value  # (the line quoted)


def test_control_characters_of_a_quoted_line_reach_no_terminal(tmp_path):
    # (helper-109: a spec line with an OSC title sequence and a colour was echoed raw by the TOML error, and retitled
    # and recoloured the operator's terminal; the CLI writes no control character of any message either)
    import subprocess
    import sys

    p = tmp_path / "bad.toml"
    p.write_bytes(b'name = "x"\nfoo = \x1b]0;PWNED\x07\x1b[31m\n')
    with pytest.raises(SpecError) as e:
        load_spec(p)
    assert e.value.message.endswith(r": foo = \x1b]0;PWNED\x07\x1b[31m"), e.value.message
    r = subprocess.run([sys.executable, "-m", "pdctl", "validate", str(p)], capture_output=True, timeout=60)
    assert r.returncode == 1 and b"\x1b" not in r.stderr and b"\x07" not in r.stderr, r.stderr
    assert rb"\x1b]0;PWNED\x07" in r.stderr, r.stderr


@pytest.mark.parametrize("toml, line, hint", [
    ('name = "a"\nname = "b"\n', 'name = "b"', "'name' is given twice in the same table"),
    ('[router]\nport = 1\n\n[router]\n', "[router]", "table [router] is declared twice: merge the two into one"),
])
def test_a_key_or_table_given_twice_is_named_with_its_fix(tmp_path, toml, line, hint):
    # (it said "Cannot overwrite a value (at line 2, column 11)", naming no key, and --json's hint was null)
    p = tmp_path / "twice.toml"
    p.write_text(toml)
    with pytest.raises(SpecError) as e:
        load_spec(p)
    assert e.value.message.endswith(f": {line}") and e.value.hint.startswith(hint), (e.value.message, e.value.hint)


@pytest.mark.parametrize("raw, words", [
    ("# caf\xe9\n".encode("latin-1"), "not UTF-8 text (byte 0xe9 at offset 5): save the spec as UTF-8"),
    ("\ufeff".encode(), "starts with a byte-order mark (U+FEFF)"),
    ("name = 1".encode("utf-16"), "not UTF-8 text (byte 0xff at offset 0)"),
])
def test_a_spec_that_is_not_utf8_text_is_refused_with_the_fix(tmp_path, raw, words):
    # (a traceback from `validate`, `plan` and `apply` before; TOML files are UTF-8)
    p = tmp_path / "enc.toml"
    p.write_bytes(raw if raw.startswith(b"\xff") else raw + SEED.read_bytes())
    with pytest.raises(SpecError) as e:
        load_spec(p)
    assert words in str(e.value), str(e.value)


@pytest.mark.parametrize("make, words", [
    (lambda d: d / "missing.toml", "cannot read spec: No such file or directory: check the path"),
    (lambda d: d, "cannot read spec: Is a directory: give the spec's file"),
])
def test_a_spec_path_that_is_no_readable_file_says_what_to_give(tmp_path, make, words):
    with pytest.raises(SpecError) as e:
        load_spec(make(tmp_path))
    assert words in str(e.value), str(e.value)


@pytest.mark.parametrize("path", [("engine", "env"), ("prefill", 0, "env"), ("router", "env"), ("secrets",)])
def test_an_environment_variable_name_units_cannot_carry_is_refused(path):
    # (validate and plan passed it; `pdctl units` then crashed and the supervisor passed it on)
    d = seed_dict()
    node = d
    for k in path:
        node = node.setdefault(k, {}) if isinstance(node, dict) else node[k]
    node["BAD KEY"] = "x"
    with pytest.raises(SpecError) as e:
        parse_spec(d)
    field = ".".join(f"[{k}]" if isinstance(k, int) else k for k in path).replace(".[", "[")
    assert f"{field}: key 'BAD KEY': 'BAD KEY' is not an environment variable name" in str(e.value), str(e.value)


def test_check_raises_one_error_listing_every_broken_rule():
    d = seed_dict()
    d["decode"][0]["gpus"] = [0, 1, 2, 3]
    d["router"]["port"] = 30010
    with pytest.raises(SpecError) as e:
        check(parse_spec(d))
    msg = str(e.value)
    assert "decode[0].gpus" in msg and "router.port" in msg and "fix:" in msg


def test_pd_and_single_server_cannot_mix():
    d = seed_dict()
    d["server"] = [{"gpus": [0], "port": 31000}]
    with pytest.raises(SpecError, match="either PD"):
        parse_spec(d)


def test_validation_contacts_nothing_and_changes_nothing(tmp_path, monkeypatch):
    import socket
    import subprocess

    def refuse(*a, **k):
        raise AssertionError("validation must not touch the network or run commands")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)
    monkeypatch.chdir(tmp_path)
    dep = load_spec(SEED)
    validate(dep)
    assert list(tmp_path.iterdir()) == []


def test_kernels_need_a_decode_backend_the_plugin_hooks():
    d = dsv32_dict()
    d["model"]["dsa_decode_backend"] = "fa3"
    _one(d, "model.dsa_decode_backend", "would never run", "flashmla_kv")


def test_kernels_need_a_target_version_the_plugin_knows():
    d = dsv32_dict()
    d["sglang_version"] = "0.5.6"
    _one(d, "kernels.enabled", "refuses 0.5.6")


@pytest.mark.parametrize("impl, policy, near", [
    ("smg", "cache-aware", "'cache_aware'"),
    ("smg", "round-robin", "'round_robin'"),
    # smg 1.13.0 has these; sglang-router 0.3.2's CLI does not
    ("sglang-router", "least_load", "use a policy sglang-router 0.3.2 has: cache_aware, manual, power_of_two, random"),
    ("sglang-router", "prefix_hash", "use a policy sglang-router 0.3.2 has:"),
    ("smg", "bucket", "use a policy smg 1.13.0 has: cache_aware, consistent_hashing, least_load,"),  # prefill only
])
def test_a_router_policy_the_router_refuses_is_an_error_with_the_nearest(impl, policy, near):
    # (validate and plan accepted it; the router then exited 2 at apply)
    d = seed_dict()
    d["router_impl"] = impl
    d["router"]["policy"] = policy
    f = _one(d, "router.policy", f"{policy!r} is not a --policy of", near)
    assert "sglang-router 0.3.2" in f.message if impl == "sglang-router" else "smg 1.13.0" in f.message


@pytest.mark.parametrize("impl, policy", [("smg", "least_load"), ("smg", "prefix_hash"), ("smg", "passthrough"),
                                          ("sglang-router", "power_of_two"), ("sglang-router", "cache_aware")])
def test_a_router_policy_the_router_has_passes(impl, policy):
    d = seed_dict()
    d["router_impl"] = impl
    d["router"]["policy"] = policy
    assert not [f for f in validate(parse_spec(d)) if f.field == "router.policy"]


@pytest.mark.parametrize("path, value", [
    (("router", "host"), "::1"),
    (("router", "host"), "::"),
    (("router", "host"), "0.0.0.0"),
    (("hosts", "local", "address"), "fe80::1%eth0"),  # ssh takes a link-local address with its zone
    (("prefill", 0, "http_host"), "10.1.2.3"),
    (("prefill", 0, "http_host"), "gpu-1.example.com"),
    (("hosts", "local", "address"), "gpu1.example.com."),
    (("hosts", "local", "address"), "::1"),
    (("hosts", "local", "address"), "gpu_box"),  # an ~/.ssh/config alias or a container name
])
def test_ip_literals_and_host_names_are_addresses(path, value):
    dep = parse_spec(_with(path, value))
    node = dep
    for k in path:
        node = node[k] if isinstance(k, int) else (node[k] if isinstance(node, dict) else getattr(node, k))
    assert node == value


@pytest.mark.parametrize("path, written, canonical", [
    (("router", "prometheus_host"), "::0", "::"),
    (("hosts", "local", "address"), "0:0:0:0:0:0:0:1", "::1"),
])
def test_ip_literals_are_kept_in_the_form_the_loopback_and_wildcard_checks_compare(path, written, canonical):
    d = _with(path, written)
    dep = parse_spec(d)
    assert (dep.router.prometheus_host if path[0] == "router" else dep.hosts["local"].address) == canonical
    if path[0] == "router":  # a wildcard however written: the public-metrics warning
        assert any(f.field == "router.prometheus_host" for f in validate(dep))
    else:  # the loopback however written: driven directly, not over SSH
        assert dep.hosts["local"].is_local


@pytest.mark.parametrize("path, value, words", [
    (("router", "host"), "localhost:30001",
     "router.host: 'localhost:30001' includes a port: host and port are separate fields: write host = \"localhost\" "
     "and port = 30001"),
    (("router", "prometheus_host"), "127.0.0.1:29000",
     'write prometheus_host = "127.0.0.1" and prometheus_port = 29000'),
    (("hosts", "local", "address"), "gpu1:2222", 'write address = "gpu1" and ssh_port = 2222'),
    (("router", "host"), "[::1]:30001", 'write host = "::1" and port = 30001'),
    (("prefill", 0, "http_host"), "http://10.0.0.2",
     "prefill[0].http_host: 'http://10.0.0.2' is a URL, not an address: write http_host = \"10.0.0.2\""),
    (("router", "host"), "http://localhost:30001", 'write host = "localhost" and port = 30001'),
    (("hosts", "local", "address"), "root@gpu1",
     "hosts.local.address: 'root@gpu1' includes a user: write address = \"gpu1\" and ssh_user = \"root\""),
    (("router", "host"), "[::1]", "router.host: '[::1]' is in brackets: write an IPv6 address without brackets, host = \"::1\""),
    (("decode", 0, "http_host"), "local host", "decode[0].http_host: 'local host' contains whitespace"),
    (("router", "host"), " 0.0.0.0", "contains whitespace, which no address has: write host = \"0.0.0.0\""),
    (("prefill", 0, "http_host"), "300.1.1.1",
     "prefill[0].http_host: '300.1.1.1' is not an IPv4 address (Octet 300 (> 255) not permitted"),
    (("router", "prometheus_host"), "127.0.0.256", "'127.0.0.256' is not an IPv4 address"),
    (("router", "host"), "1.2.3", "'1.2.3' is not an IPv4 address"),
    (("router", "host"), "gpu!1", "'gpu!1' is neither an IP address nor a host name"),
    (("router", "host"), "*", 'for every interface write host = "0.0.0.0" (IPv4) or "::" (IPv6)'),
    (("prefill", 0, "http_host"), "10.0.0.1/24", 'carries a prefix length, which an address has not: write http_host = "10.0.0.1"'),
    (("router", "host"), "fe80::1/64", 'write host = "fe80::1"'),
    (("prefill", 0, "http_host"), "::1%lo", 'a zone (%lo) belongs to a link-local address (fe80::/10) only: write '
                                           'http_host = "::1"'),
    (("router", "prometheus_host"), "fe80::1%eth0", "a link-local address with a zone cannot be dialled through the "
                                                    'URLs built from prometheus_host: bind a loopback, global or '
                                                    'wildcard address instead, e.g. prometheus_host = "::"'),
    (("prefill", 0, "http_host"), "::ffff:0.0.0.0", 'an IPv4 address written as IPv6: write http_host = "0.0.0.0"'),
    (("hosts", "local", "address"), "::ffff:10.0.0.5", 'write address = "10.0.0.5"'),
    (("hosts", "local", "address"), "http://gpu1:30001/",  # a server's URL: its port is no ssh port
     'is a URL, not an address: write address = "gpu1" (the servers\' ports are each role\'s port)'),
    (("hosts", "local", "address"), "ssh://gpu1:2222", 'write address = "gpu1" and ssh_port = 2222'),
    (("prefill", 0, "http_host"), "127.0.0.l", "'127.0.0.l' looks like an IPv4 address with a typo in it"),
    (("router", "host"), "10.O.0.1", "write four numbers 0-255"),
    (("prefill", 0, "http_host"), "0x7f000001", "hexadecimal shorthand (inet_aton reads it as 127.0.0.1)"),
    (("hosts", "local", "address"), "0x7f.1", "(inet_aton reads it as 127.0.0.1), which not every resolver"),
    (("router", "host"), "-gpu1", "'-gpu1' is neither an IP address nor a host name"),
    (("router", "host"), "::g", "'::g' is not an IPv6 address"),
    (("router", "host"), "", "router.host: must not be empty"),
])
def test_an_address_with_a_port_scheme_user_brackets_or_a_typo_is_refused_with_what_to_write(path, value, words):
    # (validate and plan accepted these; the server, router or ssh then failed at apply)
    e = _refused(path, value)
    assert words in str(e.value), str(e.value)


def test_ipv6_addresses_are_bracketed_in_every_url_pdctl_builds():
    from pdctl.statemachine.launch import router_launch
    from pdctl.statemachine.topology import topology_of

    d = seed_dict()
    d["prefill"][0]["http_host"] = "::1"
    d["decode"][0]["http_host"] = "::"
    d["router"]["host"] = "::1"
    dep = parse_spec(d)
    topo = topology_of(dep)
    # "::" is dialled as [::1]: SGLang's uvicorn binds it IPv6-only, so 127.0.0.1 would not reach it
    assert [r.url for r in topo.roles] == ["http://[::1]:30010", "http://[::1]:30020"]
    assert topo.router.url == "http://[::1]:30001"
    assert topo.kv_link.bootstrap == (("prefill", "[::1]", 8998),)
    r = router_launch(dep)
    assert r.prefill == (("http://[::1]:30010", 8998),) and r.host == "::1"  # --host takes it bare
    # the router is given exactly the URLs its proof compares /workers with (one derivation: RoleTopology.url)
    assert (r.prefill, r.decode) == (topo.router.prefill, topo.router.decode)
    d["decode"][0]["http_host"] = "0.0.0.0"
    topo = topology_of(parse_spec(d))
    assert topo.roles[1].url == "http://127.0.0.1:30020" and router_launch(parse_spec(d)).decode == topo.router.decode
    # on a host known by its name (driven directly or over SSH) the router beside the servers still dials loopback:
    # gpu1.internal may resolve to an IPv4 address, which a :: bind (IPv6 only) does not answer on
    for connect in ("local", "ssh"):
        d["hosts"]["local"].update(address="gpu1.internal", connect=connect)
        d["prefill"][0]["http_host"] = "::"
        topo = topology_of(parse_spec(d))
        assert [r.url for r in topo.roles] == ["http://[::1]:30010", "http://127.0.0.1:30020"], connect
        assert topo.kv_link.bootstrap == (("prefill", "[::1]", 8998),)


def _page_size_at(d: dict, where: str, size: int) -> str:
    """Set *size* as model.page_size, or on both roles (equal: no prefill/decode mismatch); the field reported."""
    if where == "model":
        d["model"]["page_size"] = size
        return "model.page_size"
    d["prefill"][0]["page_size"] = d["decode"][0]["page_size"] = size
    return "decode[0].page_size"


@pytest.mark.parametrize("where", ["model", "decode"])
def test_a_page_size_other_than_64_with_kernels_enabled_is_refused(where):
    # pdctl's kernels read 64-token pages; a 32-token page size passed validate and failed only in the kernels
    d = dsv32_dict()
    field = _page_size_at(d, where, 32 if where == "model" else 128)
    f = _one(d, field, "page_size = ", "with kernels enabled", "64-token pages", f"set {field} = 64",
             "kernels.enabled = false")
    assert len([x for x in _errors(d) if x.field == field]) == 1  # model.page_size once, not once per role
    d["kernels"]["enabled"] = False
    assert f not in validate(parse_spec(d))


def test_a_page_size_of_64_or_unset_with_kernels_passes():
    d = dsv32_dict()
    del d["model"]["page_size"]
    assert not [f for f in validate(parse_spec(d)) if "page_size" in f.field]
    d["model"]["page_size"] = 32  # overridden to 64 on every role: the kernels read 64-token pages
    d["prefill"][0]["page_size"] = d["decode"][0]["page_size"] = 64
    assert not [f for f in validate(parse_spec(d)) if "page_size" in f.field]


@pytest.mark.parametrize("fraction", [1.0, 0.95, 1])
def test_a_mem_fraction_near_one_is_warned(fraction):
    d = seed_dict()
    d["decode"][0]["mem_fraction"] = fraction
    f = _one(d, "decode[0].mem_fraction", f"mem_fraction = {fraction:g}", "activations, CUDA graphs and NCCL buffers",
             "leave mem_fraction unset", level="warning")
    check(parse_spec(d))  # a warning
    assert f.level == "warning"
    assert not [x for x in validate(parse_spec(d)) if x.field == "prefill[0].mem_fraction"]  # (0.85 in the seed)


def test_a_plaintext_secret_is_warned_and_an_env_reference_is_not():
    d = seed_dict()
    d["secrets"] = {"HF_TOKEN": "hf_abc123", "API_KEY": "env:ROUTER_API_KEY"}
    f = _one(d, "secrets.HF_TOKEN", "plain text", 'write "env:HF_TOKEN" and export HF_TOKEN where pdctl runs',
             level="warning")
    assert "hf_abc123" not in str(f)  # the warning never repeats the secret
    assert not [x for x in validate(parse_spec(d)) if x.field == "secrets.API_KEY"]


@pytest.mark.parametrize("path, value, words", [
    (("kv_transfer", "backend"), "nixl2",
     "kv_transfer.backend: must be one of 'nixl', 'mooncake', 'mooncake_tcp', 'fake', 'mori', 'ascend', not 'nixl2': "
     "did you mean 'nixl'?"),
    (("kv_transfer", "backend"), "NIXL", "not 'NIXL': did you mean 'nixl'?"),
    (("service_manager",), "systemd",
     "service_manager: must be one of 'systemd-system', 'systemd-user', 'process', not 'systemd': did you mean "
     "'systemd-user' or 'systemd-system'?"),
    (("router_impl",), "sglang_router", "not 'sglang_router': did you mean 'sglang-router'?"),
    (("kernels", "which"), ["sparse_mla"], "kernels.which[0]: must be one of 'sparse_mla_decode', 'lightning_indexer', "
     "not 'sparse_mla': did you mean 'sparse_mla_decode'?"),
    (("hosts", "local", "connect"), "telnet", "hosts.local.connect: must be one of 'auto', 'local', 'ssh', not 'telnet': write one of them, e.g. 'auto'\n"),
    (("hosts", "local", "inventory"), 5, "hosts.local.inventory: must be one of 'declared', 'discover', not 5"),
])
def test_a_value_outside_a_fields_choices_names_them_and_the_nearest(path, value, words):
    e = _refused(path, value)
    assert words in str(e.value) + "\n", str(e.value)
    assert "Input should be" not in str(e.value)


def test_an_engine_bound_to_every_interface_behind_a_router_is_warned():
    d = seed_dict()
    d["prefill"][0]["http_host"] = "0.0.0.0"
    _one(d, "prefill[0].http_host", "binds every interface", "around the router", "127.0.0.1", level="warning")
    assert not [f for f in validate(parse_spec(seed_dict())) if f.field.endswith(".http_host")]


@pytest.mark.parametrize("where, key", [(("engine", "env"), "HF_TOKEN"), (("prefill", 0, "env"), "OPENAI_API_KEY"),
                                        (("router", "env"), "db_password"), (("engine", "env"), "SECRET_KEY"),
                                        (("engine", "env"), "AZURE_OPENAI_KEY"), (("engine", "env"), "HF_TOKEN_READONLY"),
                                        (("engine", "env"), "GITHUB_PAT"), (("router", "env"), "WANDB_APIKEY")])
def test_a_secret_looking_env_value_is_warned_toward_secrets(where, key):
    d = seed_dict()
    node = d
    for k in where:
        node = node.setdefault(k, {}) if isinstance(node, dict) else node[k]
    node[key] = "hf_abcdefgh"
    field = ".".join(f"[{k}]" if isinstance(k, int) else k for k in where).replace(".[", "[") + f".{key}"
    _one(d, field, "looks like a secret", f'{key} = "env:{key}"', level="warning")
    del node[key]  # moved as the fix says: no warning left
    d.setdefault("secrets", {})[key] = f"env:{key}"
    assert not [f for f in validate(parse_spec(d)) if key in f.field]


@pytest.mark.parametrize("key, value", [("TOKENIZERS_PARALLELISM", "false"), ("SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION", "4096"),
                                        ("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1"), ("GOOGLE_CREDENTIALS_FILE", "/etc/gcp.json"),
                                        ("PASSTHROUGH", "yes-please"), ("SSL_KEY_PATH", "/etc/tls/key.pem"),
                                        ("KEYBOARD", "us"), ("PATH_PREFIX", "/opt/x"), ("SGLANG_PATCH", "x1")])
def test_settings_that_only_mention_a_secret_word_are_not_warned(key, value):
    d = seed_dict()
    d.setdefault("engine", {}).setdefault("env", {})[key] = value
    assert not [f for f in validate(parse_spec(d)) if key in f.field]


def test_an_undeclared_host_is_reported_once_where_it_is_written():
    # (the router, defaulting to the first role's host, also reported router.on, which the spec did not set)
    d = seed_dict()
    d["prefill"][0]["host"] = d["decode"][0]["host"] = "gpu1"
    errs = [f for f in _errors(d) if "gpu1" in f.message]
    assert [(f.field, f.message) for f in errs] == [
        ("prefill[0].host", "host 'gpu1' is not declared (also named by decode[0].host)")], errs
    assert "add [hosts.gpu1]" in errs[0].fix
    d["router"]["on"] = "gpu2"  # written: reported where it is written
    _one(d, "router.on", "host 'gpu2' is not declared", "[hosts.gpu2]")


_TOOL_MISFIT = "would leave its tool-call markup in the content"
_THINK_MISFIT = "would leave its reasoning in the content"


@pytest.mark.parametrize("path, field, parser, words, fix", [
    ("deepseek-ai/DeepSeek-V4-Flash", "tool_call_parser", "deepseekv3", _TOOL_MISFIT, 'tool_call_parser = "deepseekv4"'),
    # V4.1's markup, not V4's
    ("deepseek-ai/DeepSeek-V4-Flash", "tool_call_parser", "deepseekv41", _TOOL_MISFIT, 'tool_call_parser = "deepseekv4"'),
    ("deepseek-ai/DeepSeek-V4.1", "tool_call_parser", "deepseekv4", _TOOL_MISFIT, 'tool_call_parser = "deepseekv41"'),
    ("deepseek-ai/DeepSeek-V3.2", "tool_call_parser", "deepseekv31", _TOOL_MISFIT, 'tool_call_parser = "deepseekv32"'),
    ("/models/DeepSeek-V3.2-Exp/", "tool_call_parser", "deepseekv32", _TOOL_MISFIT, 'tool_call_parser = "deepseekv31"'),
    ("deepseek-ai/DeepSeek-V4-Flash", "reasoning_parser", "qwen3", _THINK_MISFIT, 'reasoning_parser = "deepseek-v4"'),
    ("deepseek-ai/DeepSeek-V4-Flash", "reasoning_parser", "deepseek-r1", _THINK_MISFIT, 'reasoning_parser = "deepseek-v4"'),
    ("deepseek-ai/DeepSeek-V3.2", "reasoning_parser", "kimi", _THINK_MISFIT, 'reasoning_parser = "deepseek-v3"'),
    ("deepseek-ai/DeepSeek-R1-0528", "reasoning_parser", "deepseek-v3", _THINK_MISFIT, 'reasoning_parser = "deepseek-r1"'),
])
def test_a_parser_that_does_not_fit_the_deepseek_model_is_warned(path, field, parser, words, fix):
    # (validate and plan were clean; apply restarted both servers, then parsers_configured found raw markup, or no
    # reasoning_content)
    d = seed_dict()
    d["model"]["path"] = path
    d["parsers"][field] = parser
    f = _one(d, f"parsers.{field}", words, fix, level="warning")
    assert path in f.message


@pytest.mark.parametrize("path, field, parser", [
    ("deepseek-ai/DeepSeek-V4.1-Flash", "tool_call_parser", "deepseekv41"),
    ("deepseek-ai/DeepSeek-V3.2-Speciale", "tool_call_parser", "deepseekv32"),
    ("Qwen/Qwen3-8B", "tool_call_parser", "deepseekv3"), ("/models/my-finetune", "tool_call_parser", "qwen"),
    ("deepseek-ai/DeepSeek-R1-Distill-Qwen-32B", "tool_call_parser", "qwen"),
    ("deepseek-ai/DeepSeek-V4-Flash", "reasoning_parser", "deepseek-v3"),
    ("deepseek-ai/DeepSeek-V4-Flash", "reasoning_parser", "deepseek-v41"),
    ("deepseek-ai/DeepSeek-V3.1-Terminus", "reasoning_parser", "deepseek-v3"),
    ("deepseek-ai/DeepSeek-V3-0324", "reasoning_parser", "qwen3"),
    ("deepseek-ai/DeepSeek-R1-Distill-Qwen-32B", "reasoning_parser", "qwen3"),
    ("Qwen/Qwen3-8B", "reasoning_parser", "qwen3"),
])
def test_a_fitting_or_unknown_model_parser_pair_is_not_warned(path, field, parser):
    d = seed_dict()
    d["model"]["path"] = path
    d["parsers"][field] = parser
    assert not [f for f in validate(parse_spec(d)) if f.field == f"parsers.{field}"]


def test_a_deepseek_model_without_parsers_is_warned_for_each_missing_one():
    # (plan and validate were clean; apply restarted both servers, then parsers_configured found raw markup)
    d = seed_dict()
    del d["parsers"]
    found = {f.field: f for f in validate(parse_spec(d)) if f.field.startswith("parsers.")}
    assert set(found) == {"parsers.tool_call_parser", "parsers.reasoning_parser"}, found
    assert found["parsers.tool_call_parser"].level == "warning"
    assert "no tool-call parser is set" in found["parsers.tool_call_parser"].message
    assert found["parsers.tool_call_parser"].fix == 'write [parsers] tool_call_parser = "deepseekv4"'
    assert found["parsers.reasoning_parser"].fix == 'write [parsers] reasoning_parser = "deepseek-v4"'
    d["model"]["path"] = "/models/my-finetune"  # not a checkpoint name pdctl knows: nothing said
    assert not [f for f in validate(parse_spec(d)) if f.field.startswith("parsers.")]


def test_the_model_parser_warning_suggests_only_parsers_the_sglang_version_has():
    # SGLang 0.5.6 has no deepseekv4: no warning to write one
    d = seed_dict()
    d["sglang_version"] = "0.5.6"
    d["parsers"] = {"reasoning_parser": "deepseek-v3", "tool_call_parser": "deepseekv3"}
    assert not [f for f in validate(parse_spec(d)) if f.field == "parsers.tool_call_parser"]
    d["model"]["path"] = "deepseek-ai/DeepSeek-V3.2"  # which 0.5.6 does parse: deepseekv32
    _one(d, "parsers.tool_call_parser", "DeepSeek-V3.2 model", 'tool_call_parser = "deepseekv32"', level="warning")
    d["parsers"]["reasoning_parser"] = "qwen3"  # 0.5.6 has no deepseek-v4: only deepseek-v3 is suggested
    f = _one(d, "parsers.reasoning_parser", "separates with deepseek-v3:", 'reasoning_parser = "deepseek-v3"',
             level="warning")
    assert "deepseek-v4" not in f.message + f.fix


def test_kernels_for_a_deepseek_v4_checkpoint_run_on_the_dsv4_backend():
    # (issue 43) the plugin hooks SGLang 0.5.23's dsv4 decode and C4 indexer: the seed ships with them on; until then
    # validate refused kernels for every V4 checkpoint
    d = seed_dict()
    assert d["kernels"] == {"enabled": True, "which": ["sparse_mla_decode", "lightning_indexer"]}
    assert not _errors(d) and not [x for x in validate(parse_spec(d)) if x.field.startswith("kernels")]
    d["hosts"]["local"]["gpu_name"] = "NVIDIA H200"
    assert not _errors(d) and not [x for x in validate(parse_spec(d)) if x.field.startswith("kernels")]
    d["model"]["path"] = "deepseek-ai/DeepSeek-V4-Pro"  # (its weights do not fit the seed's 4-GPU groups)
    assert not [x for x in validate(parse_spec(d)) if x.field.startswith(("kernels", "model.", "sglang_version"))]


def test_kernels_for_a_deepseek_v4_1_checkpoint_are_refused():
    # the V4 kernels are built for V4-Flash / V4-Pro; SGLang runs V4.1 on its own paths where the GPU has them
    d = seed_dict()
    d["model"]["path"] = "deepseek-ai/DeepSeek-V4.1-Pro"
    d["parsers"] = {"reasoning_parser": "deepseek-v41", "tool_call_parser": "deepseekv41"}
    _one(d, "kernels.enabled", "DeepSeek-V4.1 checkpoint", "set kernels.enabled = false for this model")
    assert [x.field for x in _errors(d)] == ["kernels.enabled"], _errors(d)  # no advice about dsa flags V4 ignores
    d["model"]["path"] = "deepseek-ai/DeepSeek-V3.2-Speciale"  # V3.2's attention: the kernels apply
    assert "kernels.enabled" not in [x.field for x in _errors(d)]


def test_kernels_for_a_deepseek_v4_checkpoint_pdctl_knows_no_heads_of_are_refused():
    # kernels_built builds at the local heads (num_attention_heads / attention TP) and the index top-k
    d = seed_dict()
    d["model"]["path"] = "/models/DeepSeek-V4-Lite"
    _one(d, "model.path", "no head count and index top-k", "DeepSeek-V4-Flash or DeepSeek-V4-Pro")
    d["kernels"]["enabled"] = False
    assert not _errors(d)


def test_kernels_for_deepseek_v4_need_the_version_the_plugin_hooks():
    d = seed_dict()
    d["sglang_version"] = "0.5.6"
    d["parsers"] = {"reasoning_parser": "deepseek-v3", "tool_call_parser": "deepseekv3"}
    _one(d, "sglang_version", "refuses 0.5.6", "dsv4 backend", 'sglang_version = "0.5.23"', "kernels.enabled = false")


@pytest.mark.parametrize("backend, ok", [("flashmla", True), ("auto", True), ("flashmla_mega", False),
                                          ("trtllm", False)])
def test_kernels_for_deepseek_v4_need_the_dsv4_attention_backend_the_plugin_hooks(backend, ok):
    # flashmla_mega and trtllm run other kernels than flash_mla_with_kvcache, the one the V4 decode hook wraps
    d = seed_dict()
    d["decode"][0]["extra_args"] = ["--dsv4-attn-backend", backend]
    found = [x for x in _errors(d) if x.field == "decode[0].extra_args"]
    assert bool(found) != ok, found
    if not ok:
        _one(d, "decode[0].extra_args", f"--dsv4-attn-backend {backend}", "built and never run",
             "remove --dsv4-attn-backend")
        d["kernels"]["enabled"] = False
        assert not [x for x in _errors(d) if x.field == "decode[0].extra_args"]


def test_kernels_for_deepseek_v4_with_a_bfloat16_cache_are_warned():
    # SGLang 0.5.23 keeps V4's cache in the 584-byte FP8 rows on CUDA whatever the dtype: the kernels read those
    d = seed_dict()
    d["model"]["kv_cache_dtype"] = "bfloat16"
    _one(d, "model.kv_cache_dtype", "584-byte FP8 V4 rows", 'write model.kv_cache_dtype = "fp8_e4m3"',
         level="warning")
    assert not _errors(d)
    d["kernels"]["enabled"] = False
    assert not [x for x in validate(parse_spec(d)) if x.field == "model.kv_cache_dtype"]


def test_kernels_for_deepseek_v4_with_the_fp4_indexer_are_warned():
    # the plugin's indexer hook reads the FP8 index keys and falls back on the FP4 indexer
    d = seed_dict()
    d["decode"][0]["extra_args"] = ["--enable-deepseek-v4-fp4-indexer"]
    _one(d, "decode[0].extra_args", "FP4 index keys", "SGLang's own FP4 indexer",
         "remove --enable-deepseek-v4-fp4-indexer", level="warning")
    d["kernels"]["which"] = ["sparse_mla_decode"]
    d["hosts"]["local"]["gpu_name"] = "NVIDIA H200"
    assert not [x for x in validate(parse_spec(d)) if x.field == "decode[0].extra_args"]


def test_the_v4_decode_kernel_on_an_sm120_gpu_is_accepted():
    # there SGLang 0.5.23 decodes V4 with flash_mla_with_kvcache_sm120, which the plugin hooks (it once warned that
    # sparse_mla_decode would never be routed in on the seed's RTX PRO 6000 Blackwell)
    d = seed_dict()
    assert "RTX PRO 6000 Blackwell" in d["hosts"]["local"]["gpu_name"]
    assert "sparse_mla_decode" in d["kernels"]["which"]
    assert not [x for x in validate(parse_spec(d)) if x.field == "kernels.which"]


@pytest.mark.parametrize("where", ["model", "decode"])
def test_a_deepseek_v4_page_size_other_than_256_is_refused(where):
    # SGLang 0.5.23 declares 256-token pages for DeepseekV4ForCausalLM over --page-size; /server_info shows 256 and
    # prefill_up, which compares it with the spec's, would fail on the real server (the seed once said 64)
    d = seed_dict()
    field = _page_size_at(d, where, 64)
    _one(d, field, "page_size = 64 for deepseek-ai/DeepSeek-V4-Flash", "256-token pages whatever --page-size says",
         f"leave {field} out, or set it to 256")
    for size in (256, None):
        for role in ("prefill", "decode"):
            d[role][0].pop("page_size", None)
        d["model"].pop("page_size", None)
        if size:
            d["model"]["page_size"] = size
        assert not [x for x in _errors(d) if "page_size" in x.field]


def test_dsa_backends_for_a_deepseek_v4_checkpoint_are_warned_as_ignored():
    d = seed_dict()
    d["model"]["dsa_decode_backend"] = "flashmla_kv"
    _one(d, "model.dsa_decode_backend", "dsv4 attention backend, which never reads --dsa-decode-backend",
         "--dsv4-attn-backend", level="warning")
    d = dsv32_dict()
    assert not [x for x in validate(parse_spec(d)) if x.field.startswith("model.dsa_")]


@pytest.mark.parametrize("dtype,ok", [("fp8_e4m3", True), ("bfloat16", True), ("auto", True), ("bf16", False),
                                      ("fp8_e5m2", False), ("nvfp4", False)])
def test_a_deepseek_v4_kv_cache_dtype_sglang_refuses_at_start_is_refused(dtype, ok):
    # 0.5.23 _deepseek_v4_kv_cache_dtype asserts fp8_e4m3 or bfloat16 (after auto -> fp8_e4m3): anything else passed
    # validate and plan, and the server exited at start
    _refused_or_not(("model", "kv_cache_dtype"), dtype, ok, "fp8_e4m3 or bfloat16")


def test_an_api_key_on_the_router_is_refused_as_on_the_servers():
    # (it passed validate; apply restarted the router, and router_exposed failed 2 minutes later on HTTP 401)
    d = seed_dict()
    d["router"]["extra_args"] = ["--api-key", "sk-router-123"]
    _one(d, "router.extra_args", "--api-key makes the router answer 401", "remove --api-key")
    d["router"]["extra_args"] = ["--api-key=sk-router-123"]
    _one(d, "router.extra_args", "--api-key makes the router answer 401")


@pytest.mark.parametrize("table,key", [("model", "served_name"), ("engine", "python"), ("router", "executable")])
def test_an_empty_name_or_path_is_refused_not_planned_as_a_change(table, key):
    # (served_name = "" served the model path, as unset does, yet planned restarts of every role and the router)
    d = seed_dict()
    d[table][key] = ""
    with pytest.raises(SpecError) as e:
        parse_spec(d)
    assert f"{table}.{key}: empty: leave the key out" in str(e.value)


@pytest.mark.parametrize("path,ok", [("./models/x", False), ("../x", False), ("~/models/x", False),
                                     ("deepseek-ai/DeepSeek-V4-Flash", True), ("/models/DeepSeek-V4-Flash", True)])
def test_a_model_path_that_is_plainly_relative_is_refused(path, ok):
    _refused_or_not(("model", "path"), path, ok, "relative path")


def _refused_or_not(where: tuple[str, str], value: str, ok: bool, words: str) -> None:
    """The seed with ``[table] key = value``: no error on that field when *ok*, else one that says *words*."""
    d = seed_dict()
    d[where[0]][where[1]] = value
    errors = [f for f in _errors(d) if f.field == ".".join(where)]
    assert not errors if ok else errors and words in errors[0].message, errors


@pytest.mark.parametrize("index,name,field,said", [
    (0, "prefill-1", "prefill[1].name", "unset, so the role is named 'prefill-1' by its position, which repeats the "
                                        "name of prefill[0].name = 'prefill-1'"),
    (1, "prefill", "prefill[1].name", "'prefill' repeats the name of prefill[0] (named 'prefill' by its position)"),
    (0, "decode", "decode[0].name", "unset, so the role is named 'decode' by its position, which repeats the name of "
                                    "prefill[0].name = 'decode'"),
    (1, "router", "prefill[1].name", "'router' is the router's unit name"),
])
def test_role_names_that_collide_are_refused_naming_both_fields(index, name, field, said):
    # (validate said valid, then plan, apply and units died with a traceback: "unit names repeat")
    d = seed_dict()
    extra = copy.deepcopy(d["prefill"][0])
    extra.update(gpus=[8, 9, 10, 11], port=30011, bootstrap_port=8999, nccl_port=30111)
    d["prefill"].append(extra)
    d["prefill"][index]["name"] = name
    with pytest.raises(SpecError) as e:
        parse_spec(d)
    assert said in str(e.value), str(e.value)
    assert "Traceback" not in str(e.value)
    # the field is the one to change, with the fix apart (it was "(root)", its fix inside the message: helper-99)
    [(where, message, fix)] = e.value.findings
    assert where == field and message.startswith(said) and fix in ("set `name` on one of them to another",
                                                                   "give the role another name"), e.value.findings
    d["prefill"][index]["name"] = "p-extra"  # (a name of its own is fine)
    parse_spec(d)


@pytest.mark.parametrize("name", ["", "a b", "PREFILL", "p\n"])
def test_a_role_name_that_cannot_be_a_unit_name_is_a_finding_with_its_fix_apart(name):
    d = seed_dict()
    d["prefill"][0]["name"] = name
    with pytest.raises(SpecError) as e:
        parse_spec(d)
    [(where, message, fix)] = e.value.findings
    assert (where, fix) == ("prefill[0].name", "use lower-case letters, digits and '-', at most 32"), e.value.findings
    assert repr(name) in message


@pytest.mark.parametrize("drop,field,fix", [
    (("decode",), "decode", "add [[decode]]"),
    (("prefill",), "prefill", "add [[prefill]]"),
    (("prefill", "decode"), "server", "add [[prefill]] and [[decode]] groups, or a [[server]]"),
])
def test_a_spec_missing_its_serving_groups_names_the_group_to_add(drop, field, fix):
    d = seed_dict()
    for k in drop:
        d.pop(k)
    with pytest.raises(SpecError) as e:
        parse_spec(d)
    [(where, _message, said_fix)] = e.value.findings
    assert (where, said_fix) == (field, fix), e.value.findings


@pytest.mark.parametrize("where,field,value,near", [
    ("model", "attention_backend", "flashmla_kv2", "flashmla"),
    ("model", "load_format", "dumy", "dummy"),
    ("decode", "kv_cache_dtype", "fp8", None),  # (difflib offers mxfp8; the whole list follows)
])
def test_free_text_fields_rendered_as_choice_flags_are_checked_against_sglangs_choices(where, field, value, near):
    # SGLang 0.5.23's argparse refuses them (exit 2) at prefill_up, after install; validate passed them
    d = seed_dict()
    if where == "model":
        d["model"][field] = value
        name = f"model.{field}"
    else:
        d["prefill"][0][field] = d["decode"][0][field] = value
        name = f"{where}[0].{field}"
    f = _one(d, name, f"{value!r} is not a", "choice of SGLang 0.5.23", *([f"did you mean {near!r}"] if near else []),
             "fp8_e4m3" if field == "kv_cache_dtype" else "")
    assert f.level == "error"
    d = seed_dict()
    d["model"].update(attention_backend="flashmla", load_format="dummy")
    d["prefill"][0]["kv_cache_dtype"] = d["decode"][0]["kv_cache_dtype"] = "fp8_e4m3"
    assert not [x for x in _errors(d) if x.field.endswith(("attention_backend", "load_format", "kv_cache_dtype"))]


def test_router_extra_args_are_checked_against_smgs_flags():
    # (a typo such as --polcy passed validate; smg exited 2 at router_exposed, after both servers' cold starts)
    d = seed_dict()
    d["router"]["extra_args"] = ["--polcy", "random"]
    f = _one(d, "router.extra_args", "--polcy is not a flag of smg 1.13.0", "did you mean '--policy'")
    assert f.level == "error"
    d["router"]["extra_args"] = ["--request-timeout-secs=600", "--max-concurrent-requests", "64"]
    assert not [x for x in _errors(d) if x.field == "router.extra_args"]
    for args in (["random"], ["--disable-retries", "random"], ["--request-timeout-secs=600", "random"]):
        d["router"]["extra_args"] = args  # a word no flag takes: smg exits 2 as for a misspelt flag
        _one(d, "router.extra_args", "'random': no flag takes it", '["--policy", "random"]')


def test_the_recorded_smg_flags_are_the_installed_smgs():
    # statemachine/data/smg-<version>-flags.json against the smg this checkout pins and installs (the `router` extra)
    import argparse
    import json
    from importlib.metadata import version
    from pathlib import Path

    from pdctl.statemachine.rules import SMG_VERSION

    pytest.importorskip("smg")
    from smg.router_args import RouterArgs

    assert version("smg") == SMG_VERSION
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert f'"smg=={SMG_VERSION}"' in pyproject
    p = argparse.ArgumentParser()
    RouterArgs.add_cli_args(p, use_router_prefix=False)
    installed = sorted({s for a in p._actions for s in a.option_strings if s.startswith("--")})
    recorded = json.loads((Path(__file__).resolve().parents[2] / "statemachine" / "data" /
                           f"smg-{SMG_VERSION}-flags.json").read_text())
    assert recorded["smg"] == SMG_VERSION and recorded["flags"] == installed
    assert recorded["flags_without_value"] == sorted({s for a in p._actions for s in a.option_strings
                                                      if s.startswith("--") and a.nargs == 0})
    values = {s: {**({"choices": list(a.choices)} if a.choices is not None else {}),
                  **({"type": a.type.__name__} if a.type in (int, float) else {})}
              for a in p._actions for s in a.option_strings if s.startswith("--") and a.nargs != 0}
    assert recorded["values"] == {s: v for s, v in sorted(values.items()) if v}


def test_sglang_0_5_6_needs_prefill_and_decode_in_one_layout():
    # 0.5.6's prefill assumed decode ran its own tp/dp unless --disaggregation-decode-tp/-dp said otherwise, which pdctl
    # does not render: prefill TP2 with decode TP4 was valid and its KV went to the wrong ranks
    d = seed_dict()
    d["sglang_version"] = "0.5.6"
    d["prefill"][0].update(gpus=[0, 1], tp=2)
    f = _one(d, "decode[0].tp", "prefill[0] tp 2 attn_dp 1, decode[0] tp 4 attn_dp 1", "--disaggregation-decode-tp",
             'sglang_version = "0.5.23"')
    assert f.level == "error"
    d["sglang_version"] = "0.5.23"  # decode learns the layout from the bootstrap server
    assert not [x for x in _errors(d) if x.field == "decode[0].tp"]
    d = seed_dict()
    d["sglang_version"] = "0.5.6"
    assert not [x for x in _errors(d) if x.field == "decode[0].tp"]  # the seed's TP4 / TP4


def test_prefill_and_decode_on_one_host_without_nccl_ports_is_a_warning():
    # SGLang picks a random --nccl-port on each side: both can pick the same one (its own PD fixture pins them)
    d = seed_dict()
    d["decode"][0].pop("nccl_port", None)
    f = _one(d, "decode[0].nccl_port", "share host 'local'", "decode[0] leave --nccl-port to SGLang",
             "nccl_port = 30120", level="warning")
    assert f.level == "warning"
    assert not [x for x in validate(parse_spec(seed_dict())) if x.field.endswith("nccl_port")]  # both pinned


def test_an_rdma_backend_under_a_user_manager_warns_of_the_memlock_limit():
    d = seed_dict()
    d["service_manager"] = "systemd-user"
    f = _one(d, "service_manager", "LimitMEMLOCK=infinity", "ulimit -Hl", "limits.conf", level="warning")
    assert f.level == "warning"
    d["kv_transfer"]["backend"] = "mooncake_tcp"  # no RDMA registration
    assert not [x for x in validate(parse_spec(d)) if x.field == "service_manager"]
    assert not [x for x in validate(parse_spec(seed_dict())) if x.field == "service_manager"]  # system scope


def test_a_sparse_attention_backend_given_as_attention_backend_points_to_its_field():
    d = seed_dict()
    d["model"]["attention_backend"] = "flashmla_sparse"
    _one(d, "model.attention_backend", "model.dsa_prefill_backend or model.dsa_decode_backend = 'flashmla_sparse'")


def test_a_role_whose_gpus_span_numa_nodes_is_warned_of_the_binding_it_loses():
    # (a typo in gpu_numa left prefill with no NUMAMask= / CPUAffinity= while decode kept its own, in silence)
    d = seed_dict()
    d["prefill"][0].pop("numa_node", None)  # (the node its GPUs sit on, as the demo leaves it)
    d["hosts"]["local"]["gpu_numa"] = [0, 0, 0, 1, 1, 1, 1, 1]
    f = _one(d, "prefill[0].gpus", "sit on NUMA nodes [0, 1] (hosts.local.gpu_numa): the role's unit gets no NUMA "
                                   "binding", "pick GPUs from one NUMA node", level="warning")
    assert "set prefill[0].numa_node" in f.fix
    d["hosts"]["local"]["gpu_numa"] = [0, 0, 0, 0, 1, 1, 1, 1]
    assert not [x for x in validate(parse_spec(d)) if x.field == "prefill[0].gpus"]
    d["hosts"]["local"]["gpu_numa"] = [0, 0, 0, 1, 1, 1, 1, 1]
    d["prefill"][0]["numa_node"] = 0  # (bound by hand: the existing numa_node warning, not this one)
    assert not [x for x in validate(parse_spec(d)) if x.field == "prefill[0].gpus"]
    # a group no one node's GPUs can hold (TP8 over a two-socket host's eight) spans nodes as it must: no warning
    s = seed_dict()
    s.pop("prefill"), s.pop("decode"), s.pop("kv_transfer", None)
    s["server"] = [{"gpus": list(range(8)), "tp": 8, "port": 30010}]
    s["hosts"]["local"]["gpu_numa"] = [0, 0, 0, 0, 1, 1, 1, 1]
    assert not [x for x in validate(parse_spec(s)) if x.field == "server[0].gpus"], validate(parse_spec(s))


def test_a_short_choice_suggests_the_choices_it_begins():
    # (kv_cache_dtype = "fp8" suggested only 'mxfp8', the closest by spelling, not fp8_e4m3 / fp8_e5m2)
    d = seed_dict()
    d["model"]["kv_cache_dtype"] = "fp8"
    with pytest.raises(SpecError) as e:
        parse_spec(d)
    said = str(e.value)
    assert "model.kv_cache_dtype: must be one of" in said and "not 'fp8': did you mean 'fp8_e5m2' or 'fp8_e4m3'" in said


def test_an_empty_ssh_user_is_refused_naming_the_field():
    # (ssh_user = "" validated and was read as unset: pdctl logged in as this machine's user, in silence)
    d = seed_dict()
    d["hosts"]["local"]["ssh_user"] = " "
    with pytest.raises(SpecError, match=r"hosts\.local\.ssh_user: empty: leave the key out to leave it unset, or "
                                        r"write a value"):
        parse_spec(d)


@pytest.mark.parametrize(("field", "value", "fix"), [
    ("host", "localhost", 'write host = "127.0.0.1"'),
    ("prometheus_host", "gpu1.example.com",
     'write the address the name stands for (`getent hosts gpu1.example.com` on the host), or prometheus_host = '
     '"0.0.0.0" for every interface'),
])
def test_a_host_name_as_an_smg_bind_address_is_refused_with_the_address_to_write(field, value, fix):
    # (it passed validate and plan; apply stopped the serving router and smg then refused to start: "invalid bind
    # host 'localhost': expected an IP address such as 0.0.0.0, ::, [::] or [fd00::1]")
    d = seed_dict()
    d["router"][field] = value
    got = [f for f in _errors(d) if f.field == f"router.{field}"]
    assert [(f.message, f.fix) for f in got] == [
        (f"{value!r} is a host name, and smg binds only an IP address (it refuses to start with a name)", fix)]
    d["router"][field] = "::1"
    assert not [f for f in _errors(d) if f.field == f"router.{field}"]


def test_secrets_and_env_tables_cannot_set_what_pdctl_sets():
    # (a secret named CUDA_VISIBLE_DEVICES put decode on prefill's GPU: env tables were checked, [secrets] not; and
    # PDCTL_UNIT in any of them would hide a role's process from status and down)
    d = seed_dict()
    d["secrets"] = {"CUDA_VISIBLE_DEVICES": {"value": "0", "roles": ["decode"]}, "PDCTL_UNIT_DIR": "x"}
    d["decode"][0]["env"] = {"PDCTL_UNIT": "pdctl-other.service"}
    got = {f.field: (f.message, f.fix) for f in _errors(d)}
    assert got["secrets.CUDA_VISIBLE_DEVICES"] == ("CUDA_VISIBLE_DEVICES is set by pdctl from gpus",
                                                   "remove it and set gpus")
    said = "is set by pdctl's process supervisor on every role's process: status and down find the role by it"
    assert got["secrets.PDCTL_UNIT_DIR"] == (f"PDCTL_UNIT_DIR {said}", "remove it")
    assert got["decode[0].env.PDCTL_UNIT"] == (f"PDCTL_UNIT {said}", "remove it")


@pytest.mark.parametrize(("path", "value", "field", "message", "fix"), [
    (("router", "host"), "*", "router.host", "'*' is no address",
     'for every interface write host = "0.0.0.0" (IPv4) or "::" (IPv6)'),
    (("prefill", 0, "http_host"), "10.0.0.1:30010", "prefill[0].http_host", "'10.0.0.1:30010' includes a port",
     'host and port are separate fields: write http_host = "10.0.0.1" and port = 30010'),
    (("decode", 0, "gpus"), [4, 4, 5, 6], "decode[0].gpus", "GPU ids repeat in [4, 4, 5, 6]", "list each GPU once"),
    (("name",), "demo deployment", "name",
     "'demo deployment' cannot become a systemd unit name (pdctl-demo deployment-prefill.service)",
     "use letters, digits, '_', '.' and '-', starting with a letter or digit, at most 64 characters"),
])
def test_a_fields_own_check_gives_its_fix_apart_from_its_message_in_json(path, value, field, message, fix):
    # (--json gave these as one message with the fix inside and "fix": null, unlike every other finding)
    e = _refused(path, value)
    assert {"field": field, "message": message, "fix": fix} in e.value.findings_json(), e.value.findings_json()


def test_env_that_overrides_what_kernels_or_kv_transfer_set_is_found():
    # (TRITON_CACHE_DIR in a role's env moved the servers off the binaries kernels_built verified; an env
    # UCX_NET_DEVICES silently overrode kv_transfer.ucx_net_devices for that role)
    from pdctl.statemachine.rules import validate

    d = seed_dict()
    d["kernels"]["enabled"] = False
    d["decode"][0]["env"] = {"TRITON_CACHE_DIR": "/tmp/t", "UCX_NET_DEVICES": "mlx5_1:1"}
    d["kv_transfer"]["ucx_net_devices"] = "mlx5_0:1"
    found = {(f.level, f.field): f for f in validate(parse_spec(d))}
    assert ("error", "decode[0].env.TRITON_CACHE_DIR") not in found  # (kernels off: the operator's own)
    w = found[("warning", "decode[0].env.UCX_NET_DEVICES")]
    assert w.message == "overrides kv_transfer.ucx_net_devices = 'mlx5_0:1' for decode[0]", w.message
    d["kernels"] = {"enabled": True}
    found = {(f.level, f.field): f for f in validate(parse_spec(d))}
    assert found[("error", "decode[0].env.TRITON_CACHE_DIR")].message.startswith(
        "TRITON_CACHE_DIR is set by pdctl while [kernels] is enabled")
    del d["kv_transfer"]["ucx_net_devices"]  # (per role, with none deployment-wide: the role's own choice)
    assert ("warning", "decode[0].env.UCX_NET_DEVICES") not in {(f.level, f.field) for f in validate(parse_spec(d))}


@pytest.mark.parametrize(("path", "value"), [
    (("model", "path"), "deepseek-ai/DeepSeek-V3.2\n"),
    (("model", "served_name"), "dsv32\tprod"),
    (("parsers", "chat_template"), "/etc/t.jinja\r"),
])
def test_a_name_or_path_with_a_control_character_is_refused(path, value):
    # (model.path = "org/name\n" passed validate and reached SGLang's loader)
    e = _refused(path, value)
    assert f"{'.'.join(path)}: {value!r} holds a control character" in str(e.value), str(e.value)
    [finding] = e.value.findings_json()
    assert finding["field"] == ".".join(path) and finding["fix"] == "remove it", finding  # (fix was null)
    e = _refused(("model", "path"), "")
    assert e.value.findings_json() == [{"field": "model.path", "message": "empty",
                                        "fix": "leave the key out to leave it unset, or write a value"}]


@pytest.mark.parametrize(("extra", "said"), [
    (["--log-level", "loud"], "--log-level 'loud' is not one of smg 1.13.0's choices (debug, info, warn, error)"),
    (["--decode-policy=bucket"], "--decode-policy 'bucket' is not one of smg 1.13.0's choices"),
    (["--max-concurrent-requests", "abc"], "--max-concurrent-requests 'abc' is not a whole number"),
    (["--cache-threshold", "half"], "--cache-threshold 'half' is not a number"),
])
def test_a_router_flags_value_smg_would_refuse_is_a_finding(extra, said):
    # (only the flag names were checked: smg exited 2, "invalid choice", at router_exposed after both cold starts)
    d = seed_dict()
    d["router"]["extra_args"] = extra
    found = [f for f in _errors(d) if f.field == "router.extra_args"]
    assert any(said in f.message for f in found), found
    d["router"]["extra_args"] = ["--log-level", "debug", "--max-concurrent-requests", "-1", "--cache-threshold=0.5"]
    assert not [f for f in _errors(d) if f.field == "router.extra_args"]
