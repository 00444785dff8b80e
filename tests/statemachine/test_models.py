"""Model facts: a checkpoint's attention and KV bytes read from its config.json (on the host) or the built-in table,
and the model-aware rules that follow from them. Expected numbers are worked out here from the configs and the
SGLang 0.5.23 sources the module cites, not taken from the module."""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path

import pytest

from pdctl.statemachine.hosts import LocalHost
from pdctl.statemachine.models import (
    ModelFactsError,
    builtin_facts,
    facts_for,
    facts_from_config,
    kv_layer_bytes,
    read_local,
)
from pdctl.statemachine.rules import validate
from pdctl.statemachine.spec import parse_spec

from .specs import collapsed, dsv32_dict, seed_dict

FIXTURES = Path(__file__).parent / "fixtures" / "models"
V4_CONFIG = json.loads((FIXTURES / "DeepSeek-V4-Flash" / "config.json").read_text())


def _v4_row_bytes(page_tokens: int) -> float:
    # FlashMLA "V4" rows: 448 fp8 + 64 bf16 (= 576 data bytes) + 8 scale bytes; a page is padded to a multiple of 576 B
    # (sglang/kernels/ops/attention/dsv4/kv_layout.py, KVLayout.V4)
    return math.ceil(page_tokens * (448 + 64 * 2 + 8) / 576) * 576 / page_tokens


def test_v4_flash_from_its_config_has_the_layer_kinds_and_row_bytes_of_sglangs_pool():
    f = facts_from_config(V4_CONFIG, name="v4", origin="test")
    assert f.attention == "dsv4" and f.num_layers == 43
    ratios = V4_CONFIG["compress_ratios"][:43]  # (the 44th entry is the MTP layer's)
    assert f.layers_by_ratio() == {0: ratios.count(0), 4: ratios.count(4), 128: ratios.count(128)} == {0: 2, 4: 21,
                                                                                                      128: 20}
    per = kv_layer_bytes(f, "fp8_e4m3")
    index = 128 + 128 // 128 * 4  # get_dsv4_indexer_bytes_per_token, fp8: d + d // 128 * 4
    assert per["swa"] == _v4_row_bytes(256) == 585.0  # 256-token pages: 149504 B padded to 149760
    assert per["c4"] == _v4_row_bytes(256 // 4) / 4 + index / 4 == 179.25
    assert per["c128"] == _v4_row_bytes(256 // 128) / 128 == 6.75  # 2-token pages: 1168 B padded to 1728
    # yarn scaling with original_max_position_embeddings: the context is max_position_embeddings, not 16 × it
    assert f.max_context == 1048576
    assert f.pd.hetero_tp == "yes" and f.pd.page_size == 256
    assert f.default_kv_dtype == "fp8_e4m3"


def test_v32_latent_is_the_scaled_fp8_layout_plus_the_indexer_on_every_layer():
    f = builtin_facts("deepseek-ai/DeepSeek-V3.2")
    assert f is not None and f.attention == "mla+dsa" and f.num_layers == 61 and f.indexer_layers == 61
    fp8 = kv_layer_bytes(f, "fp8_e4m3")
    assert fp8 == {"latent": 512 + 512 // 128 * 4 + 64 * 2, "index": 128 + 4}  # 656 and 132 B
    assert kv_layer_bytes(f, "auto") == {"latent": (512 + 64) * 2, "index": 132}  # auto = bf16 for V3.2
    assert f.pd.page_size == 64
    v3 = builtin_facts("/models/DeepSeek-R1-0528")
    assert v3 is not None and v3.attention == "mla" and kv_layer_bytes(v3, "fp8_e4m3") == {"latent": 512 + 64}


def test_gqa_heads_split_over_attention_tp_and_stay_whole_below_one_per_gpu():
    f = builtin_facts("Qwen/Qwen3-235B-A22B")
    assert f is not None and f.attention == "gqa" and f.num_kv_heads == 4
    # 2 (K and V) × heads per GPU × head_dim 128 × 2 B (bf16)
    assert kv_layer_bytes(f, "bf16", attn_tp=1)["full"] == 2 * 4 * 128 * 2
    assert kv_layer_bytes(f, "bf16", attn_tp=4)["full"] == 2 * 1 * 128 * 2
    assert kv_layer_bytes(f, "bf16", attn_tp=8)["full"] == 2 * 1 * 128 * 2  # max(1, 4 // 8): replicated
    assert kv_layer_bytes(f, "fp8_e4m3", attn_tp=4)["full"] == 2 * 1 * 128 * 1
    with pytest.raises(ModelFactsError):
        kv_layer_bytes(f, "nvfp4")


def test_a_local_checkpoint_is_read_through_the_host_and_wins_over_the_table(tmp_path):
    ckpt = tmp_path / "DeepSeek-V4-Flash"
    shutil.copytree(FIXTURES / "DeepSeek-V4-Flash", ckpt)
    cfg = copy.deepcopy(V4_CONFIG)
    cfg["num_hidden_layers"] = 7  # not the table's 43: the facts must come from this file
    (ckpt / "config.json").write_text(json.dumps(cfg))
    host = LocalHost()
    f = facts_for(str(ckpt), host)
    assert f is not None and f.num_layers == 7 and f.origin.startswith("config.json at")
    assert f.weights_bytes == json.loads((ckpt / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    (ckpt / "model.safetensors.index.json").unlink()
    assert read_local(host, str(ckpt)).weights_bytes is None  # a single-file checkpoint: pdctl reads no shard
    # no config there: the table answers for the name
    empty = tmp_path / "x" / "DeepSeek-V4-Flash"
    empty.mkdir(parents=True)
    assert facts_for(str(empty), host).num_layers == 43
    assert facts_for("someone/unknown-model", host) is None


def test_a_sliding_window_hybrid_and_an_unknown_architecture():
    g = read_local(LocalHost(), str(FIXTURES / "gqa-hybrid"))
    assert (g.attention, g.swa_layers, g.full_layers, g.num_kv_heads) == ("swa-hybrid", 2, 2, 4)
    assert g.pd.hetero_tp == "no"
    with pytest.raises(ModelFactsError):
        facts_from_config({"architectures": ["X"], "num_hidden_layers": 2}, name="x", origin="t")


# --- the model-aware rules -----------------------------------------------------------------------------------------
def _findings(d: dict, level: str | None = None) -> list:
    return [f for f in validate(parse_spec(d)) if level is None or f.level == level]


def test_deprecated_aliases_warn_with_the_name_to_use():
    d = seed_dict()
    d["parsers"]["tool_call_parser"] = "glm45"
    d["model"]["attention_backend"] = "compressed"
    d["decode"][0]["extra_args"] = ["--disable-cuda-graph"]
    d["prefill"][0]["env"] = {"SGL_ENABLE_JIT_DEEPGEMM": "1"}
    got = {f.field: f for f in _findings(d, "warning")}
    assert "glm" in got["parsers.tool_call_parser"].fix and "'glm'" in got["parsers.tool_call_parser"].message
    assert '"dsv4"' in got["model.attention_backend"].fix
    assert "--cuda-graph-backend-decode disabled" in got["decode[0].extra_args"].fix
    assert got["prefill[0].env.SGL_ENABLE_JIT_DEEPGEMM"].fix == "name it SGLANG_ENABLE_JIT_DEEPGEMM"
    assert not _findings(d, "error")


def test_different_tp_is_refused_for_a_sliding_window_hybrid_and_allowed_for_mla():
    d = seed_dict()
    d["model"]["path"] = "openai/gpt-oss-120b"
    d["parsers"] = {"reasoning_parser": "gpt-oss", "tool_call_parser": "gpt-oss"}
    d["model"]["kv_cache_dtype"] = "auto"
    d["kernels"]["enabled"] = False  # (the seed's V4 kernels: no model for gpt-oss)
    d["decode"][0].update(gpus=[4, 5], tp=2)
    assert [f.field for f in _findings(d, "error")] == ["decode[0].tp"]
    d["decode"][0].update(gpus=[4, 5, 6, 7], tp=4)
    assert not [f for f in _findings(d, "error") if f.field == "decode[0].tp"]
    v4 = seed_dict()
    v4["decode"][0].update(gpus=[4, 5], tp=2)
    assert not [f for f in _findings(v4) if f.field == "decode[0].tp"]


def test_weights_that_leave_no_kv_memory_on_declared_gpus_are_refused_before_any_host():
    d = dsv32_dict()
    d["hosts"]["local"] = {"address": "localhost", "inventory": "declared", "gpu_name": "NVIDIA H200"}
    errors = _findings(d, "error")
    # 675 GB / TP4 = 157 GiB per GPU, more than an H200's 140.4 GiB: both groups
    assert {f.field for f in errors} == {"prefill[0].gpus", "decode[0].gpus"}
    assert "more GPUs" in errors[0].fix


def test_a_context_longer_than_the_model_or_the_pool():
    d = seed_dict()
    d["model"]["context_length"] = 2_000_000  # V4-Flash: 1048576
    assert [f.field for f in _findings(d, "error")] == ["model.context_length"]
    d["prefill"][0]["env"] = {"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1"}
    assert not _findings(d, "error")
    s = collapsed(seed_dict())  # one TP8 server: weights 19.4 GB a GPU, a pool of millions of tokens
    s["model"]["context_length"] = 1048576
    s["server"][0]["mem_fraction"] = 0.25  # 94.6 GiB × 0.25 − 18 GiB of weights: ~5.6 GiB, under 1M tokens of 7 KB
    warned = [f for f in _findings(s, "warning") if f.field == "model.context_length"]
    assert len(warned) == 1 and "fewer than context_length 1048576" in warned[0].message
