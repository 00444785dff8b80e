"""The stand-in parses SGLang 0.5.23's own launch_server flags (sim/data/launch_server_flags.json)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdctl.sim import flags

# shared/ lies beside the checkout (developers and CI alike).
REF = Path(__file__).resolve().parents[3] / "shared" / "reference" / "sglang-0.5.23" / "launch_server-flags.json"


def run_sim(*args: str, timeout: float = 20) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdctl.sim", *args], capture_output=True, text=True,
                          timeout=timeout, env={"PDCTL_SIM_LOAD_SECONDS": "30", "PATH": "/usr/bin:/bin"})


def test_table_is_sglang_0_5_23_parser_dump():
    table = flags.load_flag_table()
    assert table["sglang_version"] == "0.5.23"
    assert len(table["arguments"]) == 531
    if REF.exists():
        assert table == json.loads(REF.read_text())


def test_parser_matches_the_dump_option_for_option():
    parser = flags.build_parser()
    by_opt = {o: a for a in parser._actions for o in a.option_strings}
    for arg in flags.load_flag_table()["arguments"]:
        action = by_opt[arg["flags"][0]]
        assert action.dest == arg["dest"]
        for opt in arg["flags"]:
            assert by_opt[opt] is action, opt
        if arg["action"] == "_StoreAction":
            assert action.choices == arg["choices"]
            assert action.nargs == arg["nargs"]
            assert action.default == arg["default"]


def test_defaults_and_prefix_abbreviation():
    args, resolved = flags.parse(["--model-path", "m", "--tp", "4", "--disaggregation-mode", "decode"])
    assert args.tp_size == 4
    assert resolved["disaggregation_bootstrap_port"] == 8998
    assert resolved["disaggregation_transfer_backend"] == "mooncake"
    assert resolved["host"] == "127.0.0.1" and resolved["port"] == 30000
    assert resolved["served_model_name"] == "m"
    assert resolved["launch_command"] == "--model-path m --tp 4 --disaggregation-mode decode"


def test_human_readable_int_and_deprecated_dp_attention():
    args, resolved = flags.parse(["--model-path", "m", "--context-length", "128k", "--dp-size", "8",
                                  "--enable-dp-attention"])
    assert resolved["context_length"] == 128000
    assert resolved["attn_dp_size"] == 8 and resolved["dp_size"] == 1
    assert resolved["enable_dp_attention"] is True
    _, resolved = flags.parse(["--model-path", "m", "--attn-dp-size", "4", "--tp", "4"])
    assert resolved["enable_dp_attention"] is True and resolved["attn_dp_size"] == 4


@pytest.mark.parametrize("bad", [
    ["--no-such-flag"],
    ["--disaggregation-decode-tp", "4"],      # removed by 0.5.12
    ["--disaggregation-decode-dp", "2"],
    ["--disaggregation-prefill-pp", "2"],
    ["--nsa-prefill-backend", "flashmla_sparse"],  # removed by 0.5.20
])
def test_unknown_and_removed_flags_exit_2(bad):
    proc = run_sim("--model-path", "m", *bad)
    assert proc.returncode == 2
    assert "unrecognized arguments" in proc.stderr


@pytest.mark.parametrize("bad", [
    ["--disaggregation-mode", "prefil"],
    ["--disaggregation-transfer-backend", "foo"],
    ["--reasoning-parser", "deepseek-v9"],
    ["--tool-call-parser", "deepseek"],  # the router's name, not SGLang's
    ["--tp-size", "two"],
])
def test_invalid_values_exit_2(bad):
    proc = run_sim("--model-path", "m", *bad)
    assert proc.returncode == 2
    assert "invalid" in proc.stderr


def test_missing_model_path_exits_2():
    proc = run_sim("--port", "1")
    assert proc.returncode == 2
    assert "--model-path" in proc.stderr


def test_fake_backend_refused_on_prefill():
    proc = run_sim("--model-path", "m", "--disaggregation-mode", "prefill",
                   "--disaggregation-transfer-backend", "fake")
    assert proc.returncode != 0
    assert "Prefill server does not support 'fake' as the transfer backend" in proc.stderr


def test_fake_backend_accepted_on_decode():
    args, _ = flags.parse(["--model-path", "m", "--disaggregation-mode", "decode",
                           "--disaggregation-transfer-backend", "fake"])
    assert args.disaggregation_transfer_backend == "fake"


def test_help_exits_0():
    proc = run_sim("--help")
    assert proc.returncode == 0
    assert "--disaggregation-bootstrap-port" in proc.stdout


def test_dsa_kv_cache_dtype_resolution():
    from harness.sim import start_sim
    import json as _json
    from harness.sim import http_get
    with start_sim([]) as p:  # DeepSeek-V3.2: auto -> bfloat16 on an SM90 device
        assert _json.loads(http_get(p.url + "/server_info")[1])["kv_cache_dtype"] == "bfloat16"
    proc = run_sim("--model-path", "deepseek-ai/DeepSeek-V3.2", "--kv-cache-dtype", "fp8_e5m2")
    assert proc.returncode != 0
    assert "DeepSeek DSA only supports bf16/bfloat16 or fp8_e4m3 kv_cache_dtype" in proc.stderr


def test_deprecated_tool_call_parsers_are_served_under_their_new_names():
    for old, new in (("qwen25", "qwen"), ("glm45", "glm"), ("deepseekv32", "deepseekv32")):
        argv = ["--model-path", "m", "--tool-call-parser", old]
        assert flags.resolve(flags.parse(argv)[0], argv)["tool_call_parser"] == new


def test_mooncake_tcp_is_served_as_mooncake():
    # arg_groups/pd_disaggregation_hook.handle_pd_disaggregation: MC_FORCE_TCP=1, backend "mooncake", no ib devices
    argv = ["--model-path", "m", "--disaggregation-mode", "prefill", "--disaggregation-transfer-backend",
            "mooncake_tcp", "--disaggregation-ib-device", "mlx5_0"]
    args, _ = flags.parse(argv)
    resolved = flags.resolve(args, argv)
    assert resolved["disaggregation_transfer_backend"] == "mooncake"
    assert resolved["disaggregation_ib_device"] is None
    argv[5] = "nixl"
    args, _ = flags.parse(argv)
    resolved = flags.resolve(args, argv)
    assert resolved["disaggregation_transfer_backend"] == "nixl" and resolved["disaggregation_ib_device"] == "mlx5_0"
