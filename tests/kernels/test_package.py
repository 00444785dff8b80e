"""Import hygiene, the build entry point on a machine without a GPU, and the SGLang plugin's refusals and hooks."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch", reason="the kernel tests need torch (pdctl[kernels])")

from pdctl.kernels import sglang_plugin  # noqa: E402
from pdctl.kernels._reference import quantize_kv656, reference_sparse_mla_decode

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
try:
    import numpy  # noqa: F401  (Triton's interpreter needs it)

    HAVE_NUMPY = True
except ImportError:
    HAVE_NUMPY = False


@no_gpu
def test_build_cli_says_cannot_build_here_and_exits_2(tmp_path):
    cache = tmp_path / "cache"
    r = subprocess.run([sys.executable, "-m", "pdctl.kernels", "build", "--cache-dir", str(cache)],
                       capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "TRITON_INTERPRET": "0"})
    assert r.returncode == 2, r.stderr
    assert "cannot build here: no CUDA GPU" in r.stderr
    assert r.stdout == ""
    assert not cache.exists(), "a refused build must not create the cache directory"


@no_gpu
def test_build_and_verify_raises_the_typed_error(tmp_path, monkeypatch):
    from pdctl.kernels import KernelsBuildError, build_and_verify

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(KernelsBuildError, match="cannot build here: no CUDA GPU"):
        build_and_verify(tmp_path)


def test_plugin_refuses_an_unknown_sglang_version(monkeypatch):
    monkeypatch.setattr(sglang_plugin, "_sglang_version", lambda: "0.5.22")
    with pytest.raises(sglang_plugin.PluginRefusedError, match="0.5.22 is not a version"):
        sglang_plugin.register()
    monkeypatch.setattr(sglang_plugin, "_sglang_version", lambda: None)
    with pytest.raises(sglang_plugin.PluginRefusedError, match="not installed"):
        sglang_plugin.register()


def test_plugin_refusal_is_fatal_when_required(monkeypatch):
    monkeypatch.setattr(sglang_plugin, "_sglang_version", lambda: "9.9.9")
    monkeypatch.setenv("PDCTL_KERNELS_REQUIRED", "1")
    with pytest.raises(SystemExit, match="9.9.9"):
        sglang_plugin.register()


def test_plugin_plans_the_documented_hooks_for_0_5_23():
    v32 = sglang_plugin.planned_hooks("0.5.23")
    v4 = sglang_plugin.planned_hooks("0.5.23", model="deepseek-v4")
    assert not set(v32) & set(v4)
    assert set(v32) | set(v4) == set(sglang_plugin.KNOWN_VERSIONS["0.5.23"])
    only_indexer = sglang_plugin.planned_hooks("0.5.23", ("indexer",))
    assert list(only_indexer) == ["sglang.srt.layers.attention.dsa.dsa_indexer.Indexer._get_topk_paged"]
    assert set(sglang_plugin.planned_hooks("0.5.23", ("decode",), model="deepseek-v4")) == {
        "sglang.srt.layers.attention.deepseek_v4_backend.DeepseekV4AttnBackend._forward_attention",
        "sglang.kernels.ops.attention.flash_mla_interface.flash_mla_with_kvcache",
        "sglang.kernels.ops.attention.flash_mla_sm120.flash_mla_with_kvcache_sm120"}  # (sm_120's V4 decode)
    with pytest.raises(sglang_plugin.PluginRefusedError, match="no hooks for model"):
        sglang_plugin.planned_hooks("0.5.23", model="deepseek-v5")


def test_entry_point_table_names_the_register_function():
    import tomllib
    from pathlib import Path

    data = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert data["project"]["entry-points"]["sglang.srt.plugins"] == {
        "pdctl_kernels": "pdctl.kernels.sglang_plugin:register"}


@pytest.mark.skipif(not HAVE_NUMPY and not torch.cuda.is_available(), reason="Triton's interpreter needs numpy")
def test_flashmla_kv_hook_computes_sparse_mla_on_the_fp8_cache():
    # The hook binds SGLang's arguments by name, calls our kernel and returns flash_mla's [T, 1, h, 512] shape.
    g = torch.Generator().manual_seed(3)
    t, h, slots = 2, 16, 256
    q = torch.randn(t, h, 576, generator=g) * 0.5  # fp32 under the interpreter (bf16 dot is broken there)
    kv = quantize_kv656(torch.randn(slots, 576, generator=g)).view(-1, 64, 1, 656)
    idx = torch.randint(0, slots, (t, 64), generator=g, dtype=torch.int32)
    idx[1, 40:] = -1
    lens = torch.tensor([64, 40], dtype=torch.int32)

    def original(self, q_all, kv_cache, v_head_dim, sm_scale, layer, metadata, page_table_1):
        raise AssertionError("must not fall back")

    def decode(self, *a, **k):  # DeepseekSparseAttnBackend.forward_decode, which calls the impl
        return sglang_plugin._flashmla_kv_hook(
            original, None, q_all=q.view(t, 1, h, 576), kv_cache=kv, v_head_dim=512, sm_scale=0.1,
            layer=SimpleNamespace(tp_q_head_num=h, head_dim=576),
            metadata=SimpleNamespace(dsa_cache_seqlens_int32=lens), page_table_1=idx,
        )

    o = sglang_plugin._forward_decode_hook(decode, None)
    ro, _ = reference_sparse_mla_decode(q, kv.view(-1, 656), idx, 0.1, lens)
    assert o.shape == (t, 1, h, 512)
    assert (o[:, 0].double() - ro).abs().max() < 1e-4


def test_flashmla_kv_hook_leaves_extend_calls_to_sglang(caplog):
    # forward_extend calls _forward_flashmla_kv too (prefill chunks with the FP8 default prefill backend, MTP
    # verify): shapes the kernels_built step never verified. Only forward_decode's calls are routed.
    calls = []

    def original(self, q_all, kv_cache, v_head_dim, sm_scale, layer, metadata, page_table_1):
        calls.append(q_all.shape)
        return "original"

    kv = torch.zeros(64, 1, 656, dtype=torch.uint8)
    args = dict(q_all=torch.zeros(3, 1, 16, 576), kv_cache=kv, v_head_dim=512, sm_scale=0.1,
                layer=SimpleNamespace(tp_q_head_num=16, head_dim=576), metadata=SimpleNamespace(),
                page_table_1=torch.zeros(3, 64, dtype=torch.int32))
    assert sglang_plugin._flashmla_kv_hook(original, None, **args) == "original"
    # in decode, a layout it does not take (a 512-wide V for another head_dim) falls back and says so, once
    sglang_plugin._SAID.clear()
    bad = dict(args, layer=SimpleNamespace(tp_q_head_num=16, head_dim=512))
    with caplog.at_level("WARNING", logger=sglang_plugin.__name__):
        for _ in range(2):
            assert sglang_plugin._forward_decode_hook(
                lambda *a: sglang_plugin._flashmla_kv_hook(original, None, **bad), None) == "original"
    said = [r.getMessage() for r in caplog.records if "went to SGLang's own kernel" in r.getMessage()]
    assert len(said) == 1 and "_forward_flashmla_kv" in said[0] and "head_dim 512" in said[0], said
    assert len(calls) == 3


def test_flashmla_sparse_hook_only_routes_decode_calls():
    calls = []

    def original(self, q_all, kv_cache, v_head_dim, page_table_1, sm_scale, topk_length=None, attn_sink=None):
        calls.append("original")
        return "original"

    args = dict(q_all=torch.zeros(1, 16, 576), kv_cache=torch.zeros(64, 1, 576, dtype=torch.bfloat16),
                v_head_dim=512, page_table_1=torch.zeros(1, 64, dtype=torch.int32), sm_scale=0.1)
    assert sglang_plugin._flashmla_sparse_hook(original, None, **args) == "original"  # extend/prefill: untouched
    token = sglang_plugin._IN_DECODE.set(True)
    try:  # in decode but with an attention sink: unsupported, so the original runs
        assert sglang_plugin._flashmla_sparse_hook(original, None, **args, attn_sink=torch.zeros(16)) == "original"
    finally:
        sglang_plugin._IN_DECODE.reset(token)
    assert calls == ["original", "original"]


@pytest.fixture
def clean_tuned_tables():
    from pdctl.kernels import _indexer, _sparse_mla

    saved = dict(_sparse_mla._TUNED), dict(_indexer._TUNED)
    _sparse_mla._TUNED.clear()
    _indexer._TUNED.clear()
    yield
    _sparse_mla._TUNED.clear()
    _sparse_mla._TUNED.update(saved[0])
    _indexer._TUNED.clear()
    _indexer._TUNED.update(saved[1])


@no_gpu
def test_load_manifest_installs_the_h200_builds_configs_old_and_new(clean_tuned_tables):
    # The manifests the H200 builds wrote: before programmatic dependent launch (no `pdl` field), after it, and after
    # the in-kernel merge (`merge`).
    from pathlib import Path

    from pdctl.kernels._build import load_manifest
    from pdctl.kernels._indexer import _TUNED as INDEXER_TUNED
    from pdctl.kernels._sparse_mla import default_decode_config

    results = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    load_manifest(results / "h200_kernels_manifest_2026-11-30_ws.json")
    old = default_decode_config(16, 1, "fp8")
    assert (old.gluon, old.splits, old.pdl) == (5, 32, 0)
    load_manifest(results / "h200_kernels_manifest_2026-11-30_pdl.json")
    new = default_decode_config(16, 1, "fp8")
    assert (new.gluon, new.splits, new.pdl) == (5, 32, 1)
    assert default_decode_config(16, 8, "fp8").pdl == 0 and default_decode_config(16, 64, "fp8").pdl == 2
    load_manifest(results / "h200_kernels_manifest_2026-11-30_merge.json")  # and after the in-kernel merge
    merged = default_decode_config(16, 8, "fp8")
    assert (merged.gluon, merged.splits, merged.pdl, merged.merge) == (5, 16, 1, 1)
    assert default_decode_config(16, 1, "fp8").merge == 0
    assert INDEXER_TUNED["default"].programs_per_sm == 4


_GOOD_ENTRY = {"heads": 16, "kv": "fp8", "rows": 1, "config": {"block_h": 16, "splits": 8, "pdl": 1}}


@pytest.mark.parametrize(
    ("manifest", "match"),
    [
        ({"ok": True, "gpu": {"name": "x"}, "decode": [{**_GOOD_ENTRY, "config": {"block_h": 16, "warp_groups": 3}}]},
         r"decode\.0\.config\.warp_groups: Extra inputs are not permitted"),
        ({"ok": True, "gpu": {"name": "x"}, "decode": [{**_GOOD_ENTRY, "config": {"pdl": 5}}]},
         r"decode\.0\.config\.pdl: Input should be less than or equal to 2"),
        ({"ok": True, "gpu": {"name": "x"}, "decode": [{**_GOOD_ENTRY, "config": {"merge": 2}}]},
         r"decode\.0\.config\.merge: Input should be less than or equal to 1"),
        ({"ok": True, "gpu": {"name": "x"}, "decode": [{**_GOOD_ENTRY, "config": {"splits": 8, "merge": 1}}]},
         r"decode\.0\.config: merge=1 is a setting of the warp-specialised Gluon kernels"),
        ({"ok": True, "gpu": {"name": "x", "sm_count": 4},
          "decode": [{**_GOOD_ENTRY, "config": {"splits": 8, "gluon": 5, "merge": 1}}]},
         r"decode\.0\.config: merge=1 needs .* = 8 here, 4 SMs"),
        ({"ok": True, "gpu": {"name": "x"}, "decode": [{**_GOOD_ENTRY, "kv": "bf16", "config": {"gluon": 4}}]},
         r"decode\.0\.config: the warp-specialised Gluon kernel needs the FP8 cache"),
        ({"ok": True, "gpu": {"name": "x"}, "decode": [_GOOD_ENTRY, {**_GOOD_ENTRY, "config": {"splits": 200}}]},
         r"decode\.1\.config: splits must be in \[1, 64\]"),
        ({"ok": True, "gpu": {"name": "x"}, "decode": [{**_GOOD_ENTRY, "config": {"block_h": "16"}}]},
         r"decode\.0\.config\.block_h: Input should be a valid integer"),
        ({"ok": True, "gpu": {"name": "x"}, "decode": {"heads": 16}}, r"decode: Input should be a valid list"),
        ({"ok": True, "decode": [_GOOD_ENTRY]}, r"gpu: Field required"),
        ([_GOOD_ENTRY], r"Input should be a valid dictionary"),
        ({"ok": True, "gpu": {"name": "x"}, "indexer": {"config": {"programs_per_sm": -1}}},
         r"indexer\.config\.programs_per_sm: Input should be greater than or equal to 0"),
    ],
)
def test_a_manifest_this_pdctl_cannot_read_is_refused_with_the_fix(tmp_path, clean_tuned_tables, manifest, match):
    # Written by another pdctl version or edited by hand: the first offending field is named with the fix, before
    # any GPU check and before anything is installed.
    import json

    from pdctl.kernels._build import KernelsBuildError, load_manifest
    from pdctl.kernels._indexer import _TUNED as INDEXER_TUNED
    from pdctl.kernels._sparse_mla import _TUNED

    (tmp_path / "pdctl-kernels-manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(KernelsBuildError, match=match + r".*python -m pdctl.kernels build"):
        load_manifest(tmp_path)
    assert not _TUNED and not INDEXER_TUNED, "nothing is installed from a refused manifest"


def test_the_build_tries_launch_settings_on_the_fastest_plain_configs():
    # PDL (both trigger points) on the three fastest; the in-kernel merge (with each PDL mode) only on the two fastest
    # warp-specialised configs whose grid fits one program per SM (132 here: 1 row × 1 head block × 32 splits fits,
    # 9 rows × 1 × 16 = 144 does not). Then each of those and the three fastest with bf16 partials, where they split.
    import dataclasses

    from pdctl.kernels._build import _launch_setting_candidates
    from pdctl.kernels._sparse_mla import DecodeConfig

    ranked = [DecodeConfig(splits=32, gluon=3), DecodeConfig(splits=32, gluon=5), DecodeConfig(splits=16, gluon=4),
              DecodeConfig(splits=32, gluon=4)]
    got = _launch_setting_candidates(ranked, 16, 1, 132, pdl=True)
    fp32 = [c for c in got if not c.bf16_partials]
    assert [(c.gluon, c.splits, c.pdl, c.merge) for c in fp32] == [
        (3, 32, 1, 0), (3, 32, 2, 0), (5, 32, 1, 0), (5, 32, 2, 0), (4, 16, 1, 0), (4, 16, 2, 0),
        (5, 32, 0, 1), (5, 32, 1, 1), (5, 32, 2, 1), (4, 16, 0, 1), (4, 16, 1, 1), (4, 16, 2, 1)]
    assert got[len(fp32):] == [dataclasses.replace(c, bf16_partials=1) for c in [*ranked[:3], *fp32]]
    got = _launch_setting_candidates(ranked, 16, 1, 132, pdl=False)
    assert [(c.pdl, c.merge, c.bf16_partials) for c in got] == [(0, 1, 0), (0, 1, 0)] + [(0, 0, 1)] * 3 + [(0, 1, 1)] * 2
    assert all(c.merge == 0 for c in _launch_setting_candidates(ranked, 16, 9, 132, pdl=True))
    assert any(c.merge for c in _launch_setting_candidates(ranked, 16, 8, 132, pdl=True))  # 8 × 16 = 128 fits
    unsplit = [DecodeConfig(splits=1, gluon=5), DecodeConfig(splits=1, gluon=4)]
    assert not [c for c in _launch_setting_candidates(unsplit, 16, 64, 132, pdl=True) if c.bf16_partials]



def test_launch_settings_reach_plain_configs_near_the_fastest_and_count_qk_chains_twins_once():
    # Plain times within 5 % of the fastest do not predict which config PDL helps most: up to two more such configs
    # get launch settings beyond the three fastest; a config's qk_chains twin is not one of the three.
    from pdctl.kernels._build import _launch_setting_candidates
    from pdctl.kernels._sparse_mla import DecodeConfig

    fold = DecodeConfig(16, 32, 4, 2, splits=64, prefetch=1, fold=1)
    twin = DecodeConfig(16, 32, 4, 2, splits=64, prefetch=1, fold=1, qk_chains=1)
    g5, g4 = DecodeConfig(splits=32, gluon=5), DecodeConfig(splits=32, gluon=4)
    wide = DecodeConfig(16, 32, 8, 2, splits=64, prefetch=1, fold=1)
    far = DecodeConfig(16, 64, 4, 2, splits=32)
    ranked, us = [twin, fold, g5, g4, wide, far], [8.33, 8.33, 8.35, 8.39, 8.51, 9.0]

    def pdl_targets(got):
        return [c for c in got if c.pdl == 1 and not c.merge and not c.bf16_partials]

    assert pdl_targets(_launch_setting_candidates(ranked, 32, 1, 132, pdl=True, plain_us=us)) == [
        dataclasses.replace(c, pdl=1) for c in (twin, g5, g4, wide)]
    # without times: the three fastest families only
    assert pdl_targets(_launch_setting_candidates(ranked, 32, 1, 132, pdl=True)) == [
        dataclasses.replace(c, pdl=1) for c in (twin, g5, g4)]
    # at most two beyond the three, however many are near
    near = [DecodeConfig(16, 64, 4, 2, splits=s) for s in (4, 8, 16, 32, 64, 2)]
    got = pdl_targets(_launch_setting_candidates(near, 32, 1, 132, pdl=True, plain_us=[10.0] * 6))
    assert [c.splits for c in got] == [4, 8, 16, 32, 64]

_RUNNERS = '''
import os, time

def hang(group):
    time.sleep(120)
    return len(group)

def die_on_indexer(group):
    if group[0][0] == "indexer":
        os._exit(3)
    return len(group)
'''


def _decode_job(splits: int, rows: int = 8, **cfg):
    from pdctl.kernels._build import decode_job
    from pdctl.kernels._sparse_mla import DecodeConfig

    return decode_job(16, rows, "fp8", 2048, 0.135, DecodeConfig(splits=splits, gluon=5, **cfg))


def test_a_precompile_job_runs_on_inputs_made_as_the_timing_loop_makes_them(monkeypatch):
    # (the benchmark times the kernels without a topk_length, a constexpr of theirs: its compiling processes made
    # inputs with one, so they compiled binaries it never loaded)
    from pdctl.kernels import _build, _sparse_mla
    from pdctl.kernels._sparse_mla import DecodeConfig

    seen = {}

    def case(h, rows, fmt, *, topk, device, **kw):  # noqa: ANN001, ANN202
        seen["case"] = (h, rows, fmt, topk, kw)
        return "q", "kv", "idx", (None if kw.get("with_length") is False else "lengths")

    monkeypatch.setattr(_build, "make_decode_case", case)
    monkeypatch.setattr(_sparse_mla, "sparse_mla_decode", lambda *a, config: seen.setdefault("decode", (a, config)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    cfg = DecodeConfig(splits=32, gluon=5)
    job = _build.decode_job(16, 1, "fp8", 2048, 0.1, cfg, slots=262144, ragged=False, with_length=False)
    assert _build._precompile_group([job]) == 1
    assert seen["case"] == (16, 1, "fp8", 2048, {"ragged": False, "slots": 262144, "with_length": False})
    assert seen["decode"] == (("q", "kv", "idx", 0.1, None), cfg)
    # the same config on the build's inputs (with lengths) is another group: another binary
    assert _build._compile_key(job) != _build._compile_key(_build.decode_job(16, 1, "fp8", 2048, 0.1, cfg))


def test_precompile_groups_jobs_that_may_share_a_binary_and_runs_each_once():
    # Splits 16 and 32 specialise alike (both divisible by 16), so one process compiles both in turn; splits 1, a
    # PDL mode or another batch-size specialisation may be another binary.
    from pdctl.kernels._build import _precompile

    jobs = [_decode_job(16), _decode_job(32), _decode_job(1), _decode_job(16, pdl=1), _decode_job(16, rows=64),
            ("indexer", (8192,) * 4, 32768, 2048, {"pdl": 2})]
    info = _precompile(jobs, 3, 0, run=len, timeout_s=120)
    assert info["groups"] == 5 and info["jobs"] == 6
    assert info["workers"] == 3
    assert info["ran"] == 6, info
    assert not info["timed_out"]


def test_precompile_is_skipped_with_one_worker_or_one_group():
    from pdctl.kernels._build import _precompile

    assert _precompile([_decode_job(16), _decode_job(32)], 8, 0, run=len)["workers"] == 0
    assert _precompile([_decode_job(16), _decode_job(1)], 1, 0, run=len)["workers"] == 0


def test_precompile_outlives_a_process_that_dies_and_kills_one_that_hangs(tmp_path, monkeypatch):
    import multiprocessing
    import time

    from pdctl.kernels._build import _precompile

    (tmp_path / "pdctl_test_runners.py").write_text(_RUNNERS)
    monkeypatch.syspath_prepend(str(tmp_path))  # spawned processes get this process's sys.path
    import pdctl_test_runners as runners

    jobs = [_decode_job(16), _decode_job(1), ("indexer", (8192,), 8192, 2048, {})]
    t0 = time.monotonic()
    info = _precompile(jobs, 2, 0, run=runners.die_on_indexer, timeout_s=100)
    assert time.monotonic() - t0 < 90, "a dead process's group must not be waited for until the deadline"
    assert info["ran"] == 2 and info["died"] == 1 and not info["timed_out"], info

    t0 = time.monotonic()
    info = _precompile(jobs, 2, 0, run=runners.hang, timeout_s=4)
    assert info["timed_out"] and info["ran"] == 0, info
    assert time.monotonic() - t0 < 60
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("pdctl-kernels-compile")]


def test_compile_workers_come_from_the_environment(monkeypatch):
    from pdctl.kernels._build import COMPILE_WORKERS_ENV, KernelsBuildError, _compile_workers

    monkeypatch.setenv(COMPILE_WORKERS_ENV, "0")
    assert _compile_workers() == 0
    monkeypatch.setenv(COMPILE_WORKERS_ENV, "6")
    assert _compile_workers() == 6
    monkeypatch.delenv(COMPILE_WORKERS_ENV)
    assert 1 <= _compile_workers() <= 16
    for bad in ("many", "-2", "1.5"):
        monkeypatch.setenv(COMPILE_WORKERS_ENV, bad)
        with pytest.raises(KernelsBuildError, match="cannot build here: " + COMPILE_WORKERS_ENV + ".*whole number"):
            _compile_workers()


def test_a_build_after_a_passing_build_of_the_same_kernels_skips_the_compile_rounds(tmp_path):
    # (a re-apply on a host whose servers run: the cache holds the binaries, and 16 compiling processes would only
    # take GPU memory beside the servers)
    import json

    from pdctl.kernels._build import _kernels_source_digest, _same_build_before

    now = {"kernels_source": _kernels_source_digest(), "versions": {"torch": "2.11", "triton": "3.6.0"},
           "gpu": {"name": "NVIDIA H200", "capability": "sm_90"}, "triton_cache_dir": "/c/triton",
           "shapes": {"heads": [32]}}
    path = tmp_path / "pdctl-kernels-manifest.json"
    assert _same_build_before(path, now) is None  # no earlier build
    path.write_text(json.dumps({**now, "ok": True, "elapsed_s": 47.9}))
    assert "same kernels, versions, GPU and shapes, 47.9 s" in _same_build_before(path, now)
    for key, other in (("ok", False), ("kernels_source", "0" * 64), ("shapes", {"heads": [16]}),
                       ("versions", {"torch": "2.11", "triton": "3.7.0"}), ("triton_cache_dir", "/elsewhere")):
        path.write_text(json.dumps({**now, "ok": True, key: other}))
        assert _same_build_before(path, now) is None, key
    path.write_text("{not json")
    assert _same_build_before(path, now) is None
