"""Capacity: each role's KV pool in tokens and what it holds, checked by hand against the model configs' arithmetic
and SGLang 0.5.23's sizing (the sources are cited beside each number); the CLI's exit codes and JSON; capacity in
the plan."""

from __future__ import annotations

import json
import math
import subprocess
import sys

from pdctl.statemachine.capacity import capacity_report, plan_capacity
from pdctl.statemachine.hosts import CommandResult
from pdctl.statemachine.journal import Journal, JournalState
from pdctl.statemachine.plan import make_plan, render_text
from pdctl.statemachine.spec import load_spec, parse_spec
from pdctl.statemachine.topology import topology_of

from .specs import SEED, dump_toml, seed_dict

GIB = 2**30
RTX_PRO_6000_MIB = 97887  # nvidia-smi memory.total of an RTX PRO 6000 Blackwell (the seed's declared gpu_name)
B200_MIB = 183359  # nvidia-smi memory.total of a B200
OVERHEAD_MIB = 1024  # pdctl's assumption for the CUDA context and NCCL (capacity.RUNTIME_OVERHEAD_MIB)
V4_FLASH_WEIGHTS = 155e9  # the table's estimate: 277.0 B FP4 expert parameters × 0.53125 B + FP8 rest + BF16 embeddings
V32_WEIGHTS = 675e9  # the table's estimate: 671 B FP8 parameters + BF16 embeddings + indexer


def _available(gpu_mib: float, frac: float, weights_per_gpu: float) -> float:
    # kv_cache_configurator._profile_available_bytes: free after the weights − pre_load × (1 − mem_fraction)
    pre_gib = (gpu_mib - OVERHEAD_MIB) / 1024
    return (pre_gib * frac - weights_per_gpu / GIB) * GIB


def _v4_flash_pool(gpu_mib: float, frac: float, tp: int) -> int:
    """DeepSeek-V4-Flash's max_total_num_tokens by hand (pool_configurator.py DSV4PoolConfigurator, ratio mode)."""
    head, index, layers, csa, hca, page = 512, 128, 43, 21, 20, 256  # config.json: head_dim, index_head_dim, ratios
    row = lambda tokens: math.ceil(tokens * 584 / 576) * 576 / tokens  # noqa: E731 - V4 layout rows, 576-B pages
    per_swa = row(page) * layers + 8 / page * (2 * 2 * head * 4 + 2 * 2 * index * 4) * csa  # + ratio-4 fp32 state
    per_full = 0.1 * per_swa + csa * (row(page // 4) / 4 + (index + 4) / 4) + hca * row(page // 128) / 128
    slots = 256 + 1  # max_running_requests 256 (deepseek_v4_hook.py) + 1
    fixed = math.ceil((slots * 128 + 128 + 1) / 128) * 128 * 2 * head * 4 * hca  # ratio-128 fp32 compress state
    return int((_available(gpu_mib, frac, V4_FLASH_WEIGHTS / tp) - fixed) / per_full) // page * page


def _pdctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdctl", *args], capture_output=True, text=True, timeout=60)


def test_seed_capacity_by_hand_and_a_512k_context(tmp_path):
    pool = _v4_flash_pool(RTX_PRO_6000_MIB, 0.85, 4)
    assert 6_000_000 < pool < 7_000_000  # (the hand figure itself is sane: ~7 KB a token, ~44 GiB per GPU)
    r = _pdctl("capacity", str(SEED), "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["fits"] is True and data["context"] == 131072
    for role in data["roles"]:
        assert role["gpu_memory_mib"] == RTX_PRO_6000_MIB and role["mem_fraction"] == 0.85
        assert role["weights_per_gpu_bytes"] == V4_FLASH_WEIGHTS / 4
        assert role["kv_pool_tokens"] == pool
        assert role["requests_at_context"] == pool // 131072
        assert role["max_running_requests"] == 256
        assert role["concurrent_requests"] == min(pool // 131072, 256)
    # 512k: the pools hold it, but the seed's context_length (131072) makes the servers refuse it: exit 2
    r = _pdctl("capacity", str(SEED), "--context", "524288", "--json")
    assert r.returncode == 2, r.stderr
    data = json.loads(r.stdout)
    assert (data["fits"], data["fits_kv_pool"], data["context_allowed"]) == (False, True, False)
    assert [role["requests_of_context"] for role in data["roles"]] == [pool // 524288] * 2
    d = seed_dict()
    d["model"]["context_length"] = 524288
    spec = tmp_path / "long.toml"
    spec.write_text(dump_toml(d))
    r = _pdctl("capacity", str(spec), "--context", "524288")
    assert r.returncode == 0, r.stdout
    assert f"({pool // 524288} at once" in r.stdout


def test_dsv32_on_b200s_by_hand_prefill_cannot_start_and_twice_the_gpus_would_do():
    rep = capacity_report(load_spec(SEED.parent / "dsv32.toml"), gpu_memory_mib=B200_MIB)
    pre, dec = rep.roles
    # mem_fraction unset: handle_gpu_memory_settings on a 179 GiB GPU (chunked prefill 16384, decode max_bs 512)
    # prefill (MLA): 512 + 16384 × 1.5 + TP4/8 × 1024 + 1.5 GiB MLA prefill graph = 27136 MiB reserved
    assert pre.mem_fraction == round((B200_MIB - 27136) / B200_MIB, 3) == 0.852
    # decode: 512 + 2048 × 1.5 + 512 + 512 × 2 (decode graph) = 5120, raised to the 10 GiB floor
    assert dec.mem_fraction == round((B200_MIB - 10240) / B200_MIB, 3) == 0.944
    assert _available(B200_MIB, 0.852, V32_WEIGHTS / 4) < 0 and pre.kv_pool_tokens == 0 and pre.problem
    per_token = (656 + 132) * 61  # fp8 latent + indexer K, 61 layers (kv_layer_bytes' derivation in test_models)
    assert dec.bytes_per_token == per_token
    assert dec.kv_pool_tokens == int(_available(B200_MIB, 0.944, V32_WEIGHTS / 4) // per_token) // 64 * 64
    assert rep.fits is False
    tp8 = [s for s in rep.suggestions if s.role == "prefill" and s.change.startswith("8 GPUs")]
    assert len(tp8) == 1 and tp8[0].fits


def test_undeclared_gpu_memory_is_read_with_nvidia_smi_on_the_host_and_missing_facts_say_so():
    class Smi:
        name = "gpu-host"

        def run(self, argv, *, timeout=60.0, check=True, **kw):  # noqa: ANN001, ANN003, ANN202
            assert argv[0] == "nvidia-smi" and "memory.total" in argv[1]
            text = "".join(f"{i}, {97887 if i != 6 else 81559}\n" for i in range(8))  # GPU 6 is smaller
            return CommandResult(tuple(argv), 0, text)

        def read_text(self, path):  # noqa: ANN001, ANN202
            raise FileNotFoundError(path)

    d = seed_dict()
    del d["hosts"]["local"]["gpu_name"]
    rep = capacity_report(parse_spec(d), hosts={"local": Smi()})
    assert [r.gpu_memory_mib for r in rep.roles] == [97887, 81559]  # decode runs on GPUs 4-7: the smallest
    assert rep.roles[1].kv_pool_tokens == _v4_flash_pool(81559, 0.85, 4)
    assert capacity_report(parse_spec(d)).fits is None  # nothing declared, no host asked: no estimate
    d["model"]["path"] = "someone/unknown-model"
    r = capacity_report(parse_spec(d), gpu_memory_mib=RTX_PRO_6000_MIB)
    assert r.fits is None and all(x.problem for x in r.roles)


def _topo(d: dict):
    return topology_of(parse_spec(d))


def test_a_plan_that_lowers_mem_fraction_or_tp_shows_the_capacity_it_moves():
    seed = seed_dict()
    before = _v4_flash_pool(RTX_PRO_6000_MIB, 0.85, 4)
    lower = seed_dict()
    lower["decode"][0]["mem_fraction"] = 0.6
    p = make_plan(_topo(seed), _topo(lower))
    caps = plan_capacity(p, parse_spec(lower))
    assert [c["role"] for c in caps] == ["decode"]  # prefill's pool does not move
    after = _v4_flash_pool(RTX_PRO_6000_MIB, 0.6, 4)
    assert caps[0]["before"]["kv_pool_tokens"] == before and caps[0]["after"]["kv_pool_tokens"] == after
    assert caps[0]["after"]["requests_at_context"] == after // 131072 < before // 131072
    text = render_text(p.model_copy(update={"capacity": caps}))
    assert f"requests of 131072 tokens at once {before // 131072} → {after // 131072}" in text
    # TP4 → TP2 on decode: twice the weights per GPU
    half = seed_dict()
    half["decode"][0].update(gpus=[4, 5], tp=2)
    caps = plan_capacity(make_plan(_topo(seed), _topo(half)), parse_spec(half))
    assert caps[0]["after"]["kv_pool_tokens"] == _v4_flash_pool(RTX_PRO_6000_MIB, 0.85, 2)
    # a parser change moves no pool: nothing to show; a first deployment: nothing to compare
    parsers = seed_dict()
    parsers["parsers"]["reasoning_parser"] = "deepseek-v3"
    assert plan_capacity(make_plan(_topo(seed), _topo(parsers)), parse_spec(parsers)) == ()
    assert plan_capacity(make_plan(None, _topo(seed)), parse_spec(seed)) is None


def test_cli_plan_carries_the_capacity_change_in_json_and_text(tmp_path):
    sd = tmp_path / "state"
    d = seed_dict()
    d["name"] = f"cap-{tmp_path.name}"[:60]
    d["service_manager"] = "process"  # (a manager this machine has: plan asks it what runs)
    Journal(sd, d["name"]).write(JournalState(name=d["name"], deployed=_topo(d)))
    d["decode"][0]["mem_fraction"] = 0.6
    spec = tmp_path / "lower.toml"
    spec.write_text(dump_toml(d))
    r = subprocess.run([sys.executable, "-m", "pdctl", "plan", str(spec), "--state-dir", str(sd), "--json"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    caps = json.loads(r.stdout)["capacity"]
    assert caps[0]["role"] == "decode"
    assert caps[0]["after"]["kv_pool_tokens"] == _v4_flash_pool(RTX_PRO_6000_MIB, 0.6, 4)
