"""Golden command lines for examples/seed.toml, and the argv rules.

The expected argv below was written by hand from the seed and SGLang 0.5.23's flag reference
(``launch_server --help``: ``--model-path``, ``--served-model-name``, ``--context-length``,
``--kv-cache-dtype``, ``--trust-remote-code``, ``--attention-backend``, ``--tp-size``, ``--base-gpu-id``, ``--host``, ``--port``,
``--nccl-port``, ``--disaggregation-mode``, ``--disaggregation-transfer-backend``,
``--disaggregation-bootstrap-port``, ``--mem-fraction-static``, ``--reasoning-parser``,
``--tool-call-parser``, ``--enable-metrics``) and smg 1.13.0's ``launch --help``; not from the code
under test; the DeepSeek-V3.2 variant with pdctl's kernels adds ``--page-size``, ``--dsa-prefill-backend``,
``--dsa-decode-backend`` and the plugin's environment. Each rendered argv is then also parsed by a parser built from SGLang 0.5.23's own
argparse dump (``statemachine/data/sglang-0.5.23-flags.json``) and by smg's real parser.
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib import resources
from pathlib import Path

import pytest

from pdctl.statemachine.launch import launch_for_role, router_executable, services_for
from pdctl.statemachine.spec import load_spec, parse_spec
from pdctl.units import RouterLaunch, ServerLaunch, router_argv, server_argv, server_env

from harness.deploy import dsv32_dict

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PY = "/opt/sglang/.venv/bin/python"

SEED_PREFILL_ARGV = [
    PY, "-m", "sglang.launch_server",
    "--model-path", "deepseek-ai/DeepSeek-V4-Flash",
    "--served-model-name", "deepseek-v4-flash",
    "--context-length", "131072",
    "--kv-cache-dtype", "fp8_e4m3",
    "--trust-remote-code",
    "--attention-backend", "dsv4",
    "--tp-size", "4",
    "--base-gpu-id", "0",
    "--host", "127.0.0.1",
    "--port", "30010",
    "--nccl-port", "30110",
    "--disaggregation-mode", "prefill",
    "--disaggregation-transfer-backend", "nixl",
    "--disaggregation-bootstrap-port", "8998",
    "--mem-fraction-static", "0.85",
    "--reasoning-parser", "deepseek-v4",
    "--tool-call-parser", "deepseekv4",
    "--enable-metrics",
]

SEED_DECODE_ARGV = [
    PY, "-m", "sglang.launch_server",
    "--model-path", "deepseek-ai/DeepSeek-V4-Flash",
    "--served-model-name", "deepseek-v4-flash",
    "--context-length", "131072",
    "--kv-cache-dtype", "fp8_e4m3",
    "--trust-remote-code",
    "--attention-backend", "dsv4",
    "--tp-size", "4",
    "--base-gpu-id", "0",
    "--host", "127.0.0.1",
    "--port", "30020",
    "--nccl-port", "30120",
    "--disaggregation-mode", "decode",
    "--disaggregation-transfer-backend", "nixl",
    # (no --disaggregation-bootstrap-port: on decode it is only the fallback for a request without one, and the
    # router names each prefill's)
    "--mem-fraction-static", "0.85",
    "--reasoning-parser", "deepseek-v4",
    "--tool-call-parser", "deepseekv4",
    "--enable-metrics",
]

SEED_ROUTER_ARGV = [
    "/opt/sglang/.venv/bin/smg", "launch",
    "--pd-disaggregation",
    "--prefill", "http://127.0.0.1:30010", "8998",
    "--decode", "http://127.0.0.1:30020",
    "--host", "0.0.0.0",
    "--port", "30001",
    "--policy", "cache_aware",
    "--prometheus-host", "127.0.0.1",
    "--prometheus-port", "29000",
    "--health-check-interval-secs", "10",
    "--health-check-timeout-secs", "5",
    "--health-failure-threshold", "3",
    "--health-success-threshold", "2",
    "--worker-startup-timeout-secs", "3600",
]


@pytest.fixture(scope="module")
def seed():
    return load_spec(EXAMPLES / "seed.toml")


def sglang_parser() -> argparse.ArgumentParser:
    """argparse rebuilt from SGLang 0.5.23's own parser dump (flags, nargs, choices, actions)."""
    dump = json.loads(resources.files("pdctl.statemachine").joinpath("data/sglang-0.5.23-flags.json").read_text())
    p = argparse.ArgumentParser(prog="sglang.launch_server", add_help=False, allow_abbrev=False)
    for a in dump["arguments"]:
        flags = [f for f in a["flags"] if f.startswith("-")]
        if not flags or flags == ["-h", "--help"] or "--help" in flags:
            continue
        kw: dict = {"dest": a["dest"]}
        action = a.get("action") or "_StoreAction"
        if action in ("_StoreTrueAction", "_StoreFalseAction"):
            kw["action"] = "store_true" if action == "_StoreTrueAction" else "store_false"
        elif action == "BooleanOptionalAction":
            kw["action"] = argparse.BooleanOptionalAction
        elif action in ("_AppendAction",):
            kw["action"] = "append"
        else:
            if a.get("nargs") is not None:
                kw["nargs"] = a["nargs"]
            if a.get("choices"):
                kw["choices"] = [str(c) for c in a["choices"]]
        try:
            p.add_argument(*flags, **kw)
        except (argparse.ArgumentError, ValueError, TypeError):
            p.add_argument(*flags, dest=a["dest"], nargs="?")
    return p


def parse_sglang(argv: list[str]) -> argparse.Namespace:
    assert argv[1:3] in (["-m", "sglang.launch_server"], ["-m", "pdctl.sim"]), argv[:3]
    ns, unknown = sglang_parser().parse_known_args(argv[3:])
    assert unknown == [], f"flags SGLang 0.5.23 does not know: {unknown}"
    return ns


# -- golden (seed) -------------------------------------------------------------------------------


def test_seed_prefill_argv_is_the_hand_derived_one(seed):
    assert server_argv(launch_for_role(seed, "prefill")) == SEED_PREFILL_ARGV


def test_seed_decode_argv_is_the_hand_derived_one(seed):
    assert server_argv(launch_for_role(seed, "decode")) == SEED_DECODE_ARGV


def test_seed_router_argv_is_the_hand_derived_one(seed):
    assert router_argv(launch_for_role(seed, "router")) == SEED_ROUTER_ARGV



# With pdctl's kernels enabled (a DeepSeek-V3.2 checkpoint): the SGLang plugin's switches (pdctl.kernels.sglang_plugin).
PLUGIN_ENV = {"SGLANG_PLUGINS": "pdctl_kernels", "PDCTL_KERNELS_DIR": "/var/cache/sglang",
              "PDCTL_KERNELS_ROUTE": "decode,indexer", "PDCTL_KERNELS_REQUIRED": "1",
              "TRITON_CACHE_DIR": "/var/cache/sglang/triton"}
# ... and the flags of V3.2's dsa backend, after --trust-remote-code (hand-derived from dsv32_dict's model table)
DSV32_MODEL_ARGV = ["--model-path", "deepseek-ai/DeepSeek-V3.2", "--served-model-name", "deepseek-v3.2",
                    "--context-length", "131072", "--page-size", "64", "--kv-cache-dtype", "fp8_e4m3",
                    "--trust-remote-code", "--dsa-prefill-backend", "triton_sparse_mla",
                    "--dsa-decode-backend", "flashmla_kv"]


# The seed's DeepSeek-V4 with pdctl's kernels on SGLang's dsv4 backend (issue 43): the plugin's switches, decode and
# indexer routed in (its sm_120 GPUs decode V4 with flash_mla_with_kvcache_sm120, which the plugin hooks).
SEED_PLUGIN_ENV = {**PLUGIN_ENV, "PDCTL_KERNELS_ROUTE": "decode,indexer"}


def test_seed_environment_pins_gpus_and_the_cache_dir_and_carries_the_plugins_switches(seed):
    # (the ids in nvidia-smi's PCI order, as the spec, the NUMA binding and the GPU checks read them: CUDA's own
    # default order is fastest first)
    assert server_env(launch_for_role(seed, "prefill")) == {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0,1,2,3", "SGLANG_CACHE_DIR": "/var/cache/sglang",
        **SEED_PLUGIN_ENV}
    assert server_env(launch_for_role(seed, "decode")) == {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "4,5,6,7", "SGLANG_CACHE_DIR": "/var/cache/sglang",
        **SEED_PLUGIN_ENV}


def test_dsv32_with_kernels_carries_the_plugins_switches_and_the_dsa_flags():
    dep = parse_spec(dsv32_dict())
    for role, gpus, argv in (("prefill", "0,1,2,3", SEED_PREFILL_ARGV), ("decode", "4,5,6,7", SEED_DECODE_ARGV)):
        launch = launch_for_role(dep, role)
        assert server_env(launch) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": gpus,
                                      "SGLANG_CACHE_DIR": "/var/cache/sglang",
                                      **PLUGIN_ENV}
        got = server_argv(launch)
        parsers = ["--reasoning-parser", "deepseek-v3", "--tool-call-parser", "deepseekv32"]
        assert got == argv[:3] + DSV32_MODEL_ARGV + argv[14:-5] + parsers + ["--enable-metrics"]
        ns = parse_sglang(got)
        assert ns.page_size == "64" and ns.dsa_decode_backend == "flashmla_kv"


def test_seed_services_carry_the_golden_argv_and_env(seed):
    svc = {s.role: s for s in services_for(seed)}
    assert list(svc) == ["prefill", "decode", "router"]
    assert list(svc["prefill"].argv) == SEED_PREFILL_ARGV
    assert list(svc["router"].argv) == SEED_ROUTER_ARGV
    assert dict(svc["decode"].env) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "4,5,6,7",
                                       "SGLANG_CACHE_DIR": "/var/cache/sglang", **SEED_PLUGIN_ENV}
    assert svc["prefill"].numa_node == 0 and svc["prefill"].cpu_affinity == "0-31,64-95"
    assert svc["decode"].numa_node == 1 and svc["decode"].cpu_affinity == "32-63,96-127"


def test_seed_server_argv_parses_with_sglang_0_5_23s_parser(seed):
    for role in ("prefill", "decode"):
        ns = parse_sglang(server_argv(launch_for_role(seed, role)))
        assert ns.disaggregation_mode == role
        assert ns.tp_size == "4" and ns.base_gpu_id == "0" and ns.enable_metrics is True
        assert ns.kv_cache_dtype == "fp8_e4m3" and ns.page_size is None  # SGLang picks V4's 256-token pages
        assert ns.attention_backend == "dsv4"  # (the backend the plugin's V4 hooks wrap)
        assert ns.reasoning_parser == "deepseek-v4" and ns.tool_call_parser == "deepseekv4"


def test_seed_router_argv_parses_with_smg_1_13s_parser(seed):
    smg = pytest.importorskip("smg.launch_router")
    args = smg.parse_router_args(router_argv(launch_for_role(seed, "router"))[2:])
    assert args.pd_disaggregation is True
    assert args.prefill_urls == [("http://127.0.0.1:30010", 8998)]
    assert args.decode_urls == ["http://127.0.0.1:30020"]
    assert (args.host, args.port, args.policy) == ("0.0.0.0", 30001, "cache_aware")
    assert (args.prometheus_host, args.prometheus_port) == ("127.0.0.1", 29000)
    assert args.worker_startup_timeout_secs == 3600 and args.health_check_interval_secs == 10


# -- rules ---------------------------------------------------------------------------------------


def _server(**kw) -> ServerLaunch:
    base = dict(kind="prefill", model_path="m", http_port=30000, python="/usr/bin/python3")
    return ServerLaunch(**{**base, **kw})


def test_metrics_flag_is_always_present_and_extra_args_come_last():
    a = server_argv(_server(kind="single", extra_args=("--max-running-requests", "8")))
    assert "--enable-metrics" in a
    assert a[-2:] == ["--max-running-requests", "8"]
    assert a.index("--enable-metrics") < a.index("--max-running-requests")


def test_single_server_has_no_disaggregation_flags():
    a = server_argv(_server(kind="single", transfer_backend="nixl", bootstrap_port=9000, ib_device="mlx5_0"))
    assert not [f for f in a if f.startswith("--disaggregation")]


def test_parallelism_flags_above_one_only_and_parse():
    a = server_argv(_server(tp=8, attn_dp=8, ep=8, gpu_ids=tuple(range(8))))
    assert a[a.index("--attn-dp-size") + 1] == "8" and a[a.index("--ep-size") + 1] == "8"
    assert "--attn-dp-size" not in server_argv(_server())
    assert "--ep-size" not in server_argv(_server())
    parse_sglang(a)


def test_an_older_target_gets_its_own_spelling():
    # SGLang 0.5.6 has no --attn-dp-size (≤ 0.5.20: --dp-size N --enable-dp-attention) and names the sparse
    # attention backends --nsa-* (--dsa-* from 0.5.15); the 0.5.23 spelling made it exit 2 ("unrecognized arguments")
    d = dsv32_dict()
    d["kernels"]["enabled"] = False  # (the plugin knows 0.5.23 only)
    d["sglang_version"] = "0.5.6"
    d["model"]["dsa_prefill_backend"] = "flashmla_sparse"
    d["decode"][0]["attn_dp"] = 4
    old = parse_spec(d)
    pre, dec = server_argv(launch_for_role(old, "prefill")), server_argv(launch_for_role(old, "decode"))
    assert pre[pre.index("--nsa-prefill-backend") + 1] == "flashmla_sparse"
    assert dec[dec.index("--nsa-decode-backend") + 1] == "flashmla_kv"
    assert dec[dec.index("--dp-size") + 1] == "4" and "--enable-dp-attention" in dec
    assert not any(a.startswith("--dsa-") or a == "--attn-dp-size" for a in pre + dec)
    d["sglang_version"] = "0.5.23"
    dec = server_argv(launch_for_role(parse_spec(d), "decode"))
    assert dec[dec.index("--attn-dp-size") + 1] == "4" and "--dp-size" not in dec and "--dsa-decode-backend" in dec
    parse_sglang(dec)


def test_no_gpu_ids_means_no_base_gpu_id_and_no_cuda_visible_devices():
    s = _server()
    assert "--base-gpu-id" not in server_argv(s)
    assert "CUDA_VISIBLE_DEVICES" not in server_env(s)


def test_ucx_net_devices_and_ib_device():
    s = _server(ucx_net_devices="mlx5_0:1", ib_device="mlx5_0", transfer_backend="nixl", cache_dir="/c")
    env = server_env(s)
    assert env["UCX_NET_DEVICES"] == "mlx5_0:1" and env["SGLANG_CACHE_DIR"] == "/c"
    a = server_argv(s)
    assert a[a.index("--disaggregation-ib-device") + 1] == "mlx5_0"
    assert "UCX_NET_DEVICES" not in server_env(_server())


def test_role_env_overrides_pdctl_env():
    env = server_env(_server(gpu_ids=(1,), env={"CUDA_VISIBLE_DEVICES": "7", "X": "y"}))
    assert env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "7", "X": "y"}


def test_auto_kv_cache_dtype_is_left_to_sglang():
    assert "--kv-cache-dtype" not in server_argv(_server(kv_cache_dtype="auto"))


def test_legacy_router_runs_the_python_module():
    r = RouterLaunch(executable="/usr/bin/python3", impl="sglang-router", prefill=(("http://p:1", 8998),),
                     decode=("http://d:2",), host="127.0.0.1", port=30001)
    assert router_argv(r) == ["/usr/bin/python3", "-m", "sglang_router.launch_router", "--pd-disaggregation",
                              "--prefill", "http://p:1", "8998", "--decode", "http://d:2",
                              "--host", "127.0.0.1", "--port", "30001"]


def test_non_pd_router_uses_worker_urls():
    r = RouterLaunch(executable="/x/smg", workers=("http://a:1", "http://b:2"), port=4)
    assert router_argv(r)[:5] == ["/x/smg", "launch", "--worker-urls", "http://a:1", "http://b:2"]


def test_every_prefill_of_several_gets_its_bootstrap_port_on_the_router():
    dep = parse_spec({
        "name": "two", "model": {"path": "m"},
        "prefill": [{"gpus": [0], "port": 1000, "bootstrap_port": 9001},
                    {"gpus": [1], "port": 1010}],
        "decode": [{"gpus": [2], "port": 1020}],
        "router": {"port": 1030},
    })
    r = launch_for_role(dep, "router")
    assert r.prefill == (("http://127.0.0.1:1000", 9001), ("http://127.0.0.1:1010", 8998))
    # two prefills: decode has no single fallback port to take
    assert "--disaggregation-bootstrap-port" not in server_argv(launch_for_role(dep, "decode"))
    assert [n for n, _, _ in dep.roles()] == ["prefill", "prefill-1", "decode"]


def test_wildcard_bind_is_reached_on_loopback():
    dep = parse_spec({"name": "w", "model": {"path": "m"},
                      "prefill": [{"gpus": [0], "port": 1000, "http_host": "0.0.0.0"}],
                      "decode": [{"gpus": [1], "port": 1010}], "router": {"port": 1030}})
    assert launch_for_role(dep, "router").prefill == (("http://127.0.0.1:1000", 8998),)
    svc = services_for(dep, scope="process")
    assert svc[0].readiness_url == "http://127.0.0.1:1000/health"
    assert svc[-1].readiness_url == "http://127.0.0.1:1030/readiness"


def test_demo_runs_the_sim_with_pdctls_python_and_smg_beside_it():
    dep = load_spec(EXAMPLES / "demo.toml")
    p = launch_for_role(dep, "prefill")
    assert p.python == sys.executable and p.module == "pdctl.sim"
    assert server_argv(p)[:3] == [sys.executable, "-m", "pdctl.sim"]
    exe = router_executable(dep)
    beside = Path(sys.executable).parent / "smg"
    assert exe == (str(beside) if beside.exists() else exe)
    parse_sglang(server_argv(p))


@pytest.mark.parametrize("text, canon", [("0-31,64-95", "0-31,64-95"), (" 0-31, 64-95 ", "0-31,64-95"),
                                         ("0-31 64-95", "0-31,64-95"), ("7", "7"), ("0-8191", "0-8191")])
def test_cpu_lists_render_in_sysfs_form_and_pin_the_same_cpus(text, canon):
    # one grammar for the spec check, CPUAffinity= and the supervisor's sched_setaffinity
    from pdctl.units import ServiceSpec, cpu_list, cpu_set, render_service

    unit = render_service(ServiceSpec(name="pdctl-x-p.service", description="x", argv=("/bin/true",), deployment="x",
                                      role="p", cpu_affinity=text))
    assert f"CPUAffinity={canon}\n" in unit
    assert cpu_list(text) == canon and cpu_set(text) == cpu_set(canon)
    assert min(cpu_set(text)) == int(canon.split(",")[0].split("-")[0])


@pytest.mark.parametrize("text", ["abc", "3-1", "0,,1", "0-31\t64", "٠-٣", "0-8192", "0-99999999999"])
def test_cpu_lists_systemd_would_ignore_are_refused_before_a_unit_is_written(text):
    from pdctl.units import ServiceSpec, render_service

    with pytest.raises(ValueError, match="is not a CPU list"):
        render_service(ServiceSpec(name="pdctl-x-p.service", description="x", argv=("/bin/true",), deployment="x",
                                   role="p", cpu_affinity=text))


def test_a_user_or_process_scope_server_gets_sglangs_own_cache_dir_not_this_machines_home(monkeypatch):
    # (SGLANG_CACHE_DIR was this machine's user's ~/.cache/sglang: over SSH another user's folder on the host, and a
    # different HOME here, sudo against sudo -i, rendered other units and restarted every server)
    import tomllib

    from pdctl.statemachine.launch import launch_for_role
    from pdctl.statemachine.spec import parse_spec

    d = tomllib.loads((EXAMPLES / "seed.toml").read_text())
    d["service_manager"] = "process"
    d["engine"].pop("cache_dir", None)
    d["kernels"]["enabled"] = False  # (kernels_built's cache dir is pdctl's to choose)
    seen = set()
    for home in ("/home/alice", "/root"):
        monkeypatch.setenv("HOME", home)
        s = launch_for_role(parse_spec(d), "prefill")
        assert s.cache_dir is None and "SGLANG_CACHE_DIR" not in server_env(s), s.cache_dir
        seen.add(repr(s))
    assert len(seen) == 1  # the same server whoever renders it
    d["engine"]["cache_dir"] = "/srv/cache"
    assert launch_for_role(parse_spec(d), "prefill").cache_dir == "/srv/cache"
    d["engine"].pop("cache_dir")
    d["service_manager"] = "systemd-system"
    assert launch_for_role(parse_spec(d), "prefill").cache_dir == "/var/cache/sglang"
