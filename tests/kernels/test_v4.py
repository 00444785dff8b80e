"""DeepSeek-V4 on the CPU: the 584-byte cache layout and quantiser, the float64 reference's conventions, the Triton
decode through Triton's interpreter (small shapes, fp32 q: the interpreter's bf16 dot is wrong), the indexer at a
V4 top-k over compressed rows, the V4 build's arguments and manifest, and the SGLang plugin's dsv4 hooks with
stand-in objects."""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import types
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch", reason="the kernel tests need torch (pdctl[kernels])")
pytest.importorskip("triton", reason="the kernel tests need Triton (pdctl[kernels])")
pytest.importorskip("numpy", reason="Triton's CPU interpreter needs numpy")

from pdctl.kernels import sglang_plugin  # noqa: E402
from pdctl.kernels._reference import (  # noqa: E402
    dequantize_kv584,
    gather_kv584_rows,
    quantize_kv584,
    reference_lightning_indexer,
    reference_sparse_decode_v4,
    v4_cache_view,
    v4_page_bytes,
)
from pdctl.kernels._sparse_mla import DecodeConfig, check_decode_config, sparse_decode_v4  # noqa: E402

SM = 512 ** -0.5


def _caches(seed=0, main_pages=3, main_ps=16, extra_pages=5, extra_ps=4):
    g = torch.Generator().manual_seed(seed)
    main = v4_cache_view(quantize_kv584(torch.randn(main_pages * main_ps, 512, generator=g) * 2, main_ps), main_ps)
    extra = v4_cache_view(quantize_kv584(torch.randn(extra_pages * extra_ps, 512, generator=g), extra_ps), extra_ps)
    return g, main, extra


def _case(heads=5, rows=3, k1=24, k2=12, seed=0):
    g, main, extra = _caches(seed)
    q = torch.randn(rows, heads, 512, generator=g) * 0.3
    idx = torch.stack([torch.randperm(48, generator=g)[:k1] for _ in range(rows)]).int()
    eidx = torch.stack([torch.randperm(20, generator=g)[:k2] for _ in range(rows)]).int()
    idx[0, 3::5] = -1  # scattered −1 inside a row
    length = torch.full((rows,), k1, dtype=torch.int32)
    elength = torch.full((rows,), k2, dtype=torch.int32)
    length[1], elength[1] = 7, 3  # a short row: later entries are valid slots that must be ignored
    length[rows - 1], elength[rows - 1] = 0, 0  # nothing to attend
    sink = torch.randn(heads, generator=g)
    sink[0], sink[1] = float("inf"), float("-inf")
    return {"q": q, "cache": main, "indices": idx, "topk_length": length, "attn_sink": sink, "extra_cache": extra,
            "extra_indices": eidx, "extra_topk_length": elength}


# --- layout and reference -------------------------------------------------------------------------------------

def test_v4_pages_are_block_split_and_padded_to_576_bytes():
    # FlashMLA tests/quant.py MODEL1: data rows of 448 e4m3 + 64 bf16, then 8-byte scale rows (7 ue8m0 + pad).
    assert (v4_page_bytes(64), v4_page_bytes(256), v4_page_bytes(2)) == (37440, 149760, 1728)
    kv = torch.randn(2 * 4, 512) * torch.linspace(0.01, 30, 512)
    buf = quantize_kv584(kv, 4)
    assert buf.shape == (2, v4_page_bytes(4)) and buf.dtype == torch.uint8
    page, row = 1, 2
    token = kv[page * 4 + row]
    data = buf[page, row * 576:(row + 1) * 576]
    scales = buf[page, 4 * 576 + row * 8: 4 * 576 + row * 8 + 8]
    for t in range(7):
        amax = token[t * 64:(t + 1) * 64].abs().max()
        scale = 2.0 ** torch.ceil(torch.log2(torch.clamp_min(amax / 448, 1e-4)))
        assert scales[t].item() == int(torch.log2(scale).item()) + 127  # e8m0: the biased exponent
        want = (token[t * 64:(t + 1) * 64] / scale).to(torch.float8_e4m3fn).view(torch.uint8)
        assert torch.equal(data[t * 64:(t + 1) * 64], want)
    assert scales[7] == 0 and not buf[:, 4 * 584:].any()  # the pad byte and the page padding
    assert torch.equal(data[448:].view(torch.bfloat16), token[448:].bfloat16())
    back = dequantize_kv584(gather_kv584_rows(v4_cache_view(buf, 4), torch.arange(8)))
    assert (back - kv).abs().max() <= kv.abs().max() / 16  # e4m3: 3 mantissa bits
    assert torch.equal(back[:, 448:], kv[:, 448:].bfloat16().float())


def test_reference_attends_to_the_union_of_both_sources_with_lengths():
    c = _case()
    o, lse = reference_sparse_decode_v4(sm_scale=SM, **{**c, "attn_sink": None})
    # the same rows as one list in one cache: the extra rows copied into a second cache view of the main cache
    rows = gather_kv584_rows(c["extra_cache"], c["extra_indices"].clamp_min(0).reshape(-1))
    vals = dequantize_kv584(rows).view(*c["extra_indices"].shape, 512)
    t = c["q"].shape[0]
    for r in range(t):
        n1, n2 = int(c["topk_length"][r]), int(c["extra_topk_length"][r])
        i1 = c["indices"][r, :n1]
        k = torch.cat([dequantize_kv584(gather_kv584_rows(c["cache"], i1[i1 >= 0])),
                       vals[r, :n2][c["extra_indices"][r, :n2] >= 0]]).double()
        if k.shape[0] == 0:
            assert (o[r] == 0).all() and torch.isinf(lse[r]).all() and (lse[r] > 0).all()
            continue
        s = c["q"][r].double() @ k.T * SM
        assert torch.allclose(lse[r], torch.logsumexp(s, -1))
        assert torch.allclose(o[r], torch.softmax(s, -1) @ k)


def test_reference_sink_scales_o_and_leaves_lse():
    c = _case()
    o0, l0 = reference_sparse_decode_v4(sm_scale=SM, **{**c, "attn_sink": None})
    o1, l1 = reference_sparse_decode_v4(sm_scale=SM, **c)
    assert torch.equal(l0, l1)
    live = torch.isfinite(l0)
    f = 1 / (1 + torch.exp(c["attn_sink"].double()[None, :] - l0))
    assert torch.allclose(o1[live], (o0 * f[..., None])[live])
    assert (o1[:, 0][live[:, 0]] == 0).all()  # sink +inf: o = 0
    assert torch.equal(o1[:, 1], o0[:, 1])  # sink −inf: no effect


# --- the Triton kernel through the interpreter -----------------------------------------------------------------

def _run(c, cfg):
    t, h = c["q"].shape[:2]
    out = torch.full((t, h, 512), float("nan"))
    lse = torch.full((t, h), float("nan"))
    sparse_decode_v4(sm_scale=SM, out=out, lse=lse, config=cfg, **c)
    return out, lse


def _check(out, lse, ro, rl, atol=2e-5):
    dead = torch.isinf(rl)
    assert torch.isfinite(out).all()
    assert (out.double() - ro).abs().max().item() <= atol
    assert (lse.double()[~dead] - rl[~dead]).abs().max().item() <= 1e-4
    assert torch.isinf(lse[dead]).all() and (lse[dead] > 0).all() and (out[dead] == 0).all()


@pytest.mark.parametrize("cfg", [DecodeConfig(16, 16, 4, 1, splits=1), DecodeConfig(16, 16, 4, 1, splits=3,
                                                                                     bf16_partials=0)],
                         ids=["single", "split3"])
def test_v4_decode_matches_the_reference_with_both_sources_lengths_sinks_and_empty_rows(cfg):
    c = _case()
    ro, rl = reference_sparse_decode_v4(sm_scale=SM, **c)
    _check(*_run(c, cfg), ro, rl)


def test_v4_decode_of_one_source_without_lengths_or_sink():
    c = {**_case(heads=3, rows=2, k1=20), "extra_cache": None, "extra_indices": None, "extra_topk_length": None,
         "topk_length": None, "attn_sink": None}
    ro, rl = reference_sparse_decode_v4(sm_scale=SM, **c)
    _check(*_run(c, DecodeConfig(16, 16, 4, 1, splits=2)), ro, rl)


def test_v4_decode_refuses_layouts_and_settings_it_does_not_take():
    c = _case()
    with pytest.raises(ValueError, match="V4 cache view"):
        sparse_decode_v4(sm_scale=SM, **{**c, "cache": c["cache"].view(torch.uint8).reshape(3, 16, 584)})
    bad = torch.as_strided(c["extra_cache"], c["extra_cache"].shape, (4 * 584 + 8, 584, 584, 1))
    with pytest.raises(ValueError, match="page stride"):
        sparse_decode_v4(sm_scale=SM, **{**c, "extra_cache": bad})
    with pytest.raises(ValueError, match="extra_cache needs extra_indices"):
        sparse_decode_v4(sm_scale=SM, **{**c, "extra_indices": None})
    with pytest.raises(ValueError, match="V4 decode kernel takes"):
        check_decode_config(DecodeConfig(16, 32, 4, 2, splits=2, gluon=5), 16, 1, "v4", 132)
    with pytest.raises(ValueError, match="V4 decode kernel takes"):
        check_decode_config(DecodeConfig(16, 32, 4, 2, splits=2, prefetch=1), 16, 1, "v4", 132)


def test_v4_indexer_is_exact_at_top_512_over_compressed_rows():
    # V4-Flash's top-512 (the top-k kernels' TOPK below their 1024-key block), rows around it, a wide page table.
    from pdctl.kernels._build import make_indexer_case
    from pdctl.kernels._indexer import IndexerConfig, lightning_indexer

    lens = [5, 512, 700]
    q8, w, cache, bt, sl = make_indexer_case(lens, max_context=64 * 64, device="cpu", seed=2)
    out = torch.full((3, 512), -7, dtype=torch.int32)
    lightning_indexer(q8, w, cache, bt, sl, 512, out=out,
                      config=IndexerConfig(programs_per_sm=2, topk_programs=3, topk_block=256))
    ref = reference_lightning_indexer(q8, w, cache, bt, sl, 512)
    for b, n in enumerate(lens):
        assert set(out[b].tolist()) == set(ref[b].tolist()), b
        assert (out[b, min(n, 512):] == -1).all()


# --- build and manifest ---------------------------------------------------------------------------------------

def test_the_v4_build_refuses_what_it_does_not_build(tmp_path):
    from pdctl.kernels._build import KernelsBuildError, build_and_verify

    with pytest.raises(KernelsBuildError, match="unknown model 'deepseek-v5'"):
        build_and_verify(tmp_path, model="deepseek-v5")
    with pytest.raises(KernelsBuildError, match="takes the kv formats v4"):
        build_and_verify(tmp_path, model="deepseek-v4", kv_formats=("fp8",))
    assert not any(tmp_path.iterdir())


def test_load_manifest_installs_a_v4_build_and_refuses_a_v4_gluon_config(tmp_path, monkeypatch):
    from pdctl.kernels import _build, _indexer, _sparse_mla

    monkeypatch.setattr(_sparse_mla, "_TUNED", {})
    monkeypatch.setattr(_indexer, "_TUNED", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = DecodeConfig(32, 32, 8, 2, splits=4, pdl=1).as_dict()
    m = {"ok": True, "model": "deepseek-v4", "gpu": {"name": "NVIDIA H200", "sm_count": 132},
         "decode": [{"heads": 16, "kv": "v4", "rows": 8, "config": cfg}], "indexer": {"config": None}}
    (tmp_path / _build.MANIFEST_NAME).write_text(json.dumps(m))
    assert _build.load_manifest(tmp_path)["model"] == "deepseek-v4"
    assert _sparse_mla.default_decode_config(16, 8, "v4") == DecodeConfig(**cfg)
    m["decode"][0]["config"] = dict(cfg, gluon=5)
    (tmp_path / _build.MANIFEST_NAME).write_text(json.dumps(m))
    with pytest.raises(_build.KernelsBuildError, match="decode.0.config: the V4 decode kernel takes"):
        _build.load_manifest(tmp_path)


# --- the SGLang plugin's dsv4 hooks ---------------------------------------------------------------------------

def _decode_batch():
    return SimpleNamespace(forward_mode=SimpleNamespace(is_decode=lambda: True))


def _extend_batch():
    return SimpleNamespace(forward_mode=SimpleNamespace(is_decode=lambda: False))


def _flash_mla_original(calls):
    def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                               num_splits=None, softmax_scale=None, causal=False, descale_q=None, descale_k=None,
                               is_fp8_kvcache=False, indices=None, attn_sink=None, extra_k_cache=None,
                               extra_indices_in_kvcache=None, topk_length=None, extra_topk_length=None,
                               kv_format=None, *, use_legacy=True):
        calls.append(q.shape)
        return "flashmla"
    return flash_mla_with_kvcache


def _in_forward_attention(fb, heads, fn):
    def _forward_attention(self, q, k, v, layer, forward_batch, compress_ratio, save_kv_cache=True, attn_sink=None,
                           cos_sin_cache=None, **_):
        return fn()
    return sglang_plugin._v4_forward_attention_hook(_forward_attention, None, None, None, None,
                                                    SimpleNamespace(tp_q_head_num=heads), fb, 4)


def test_v4_decode_hook_routes_decode_calls_with_the_layers_real_heads(monkeypatch):
    from pdctl.kernels import _sparse_mla

    c = _case(heads=16, rows=2)
    t = 2
    seen = {}

    def fake(q, cache, indices, sm_scale, topk_length, attn_sink, extra_cache, extra_indices, extra_topk_length,
             *, out, lse):
        seen.update(q=q, out=out, lse=lse, extra=extra_cache, eidx=extra_indices, sink=attn_sink, scale=sm_scale)
        out.fill_(1.0)
        lse.fill_(2.0)
        return out, lse

    monkeypatch.setattr(_sparse_mla, "sparse_decode_v4", fake)
    calls = []
    qp = torch.zeros(t, 1, 64, 512, dtype=torch.bfloat16)
    qp[:, 0, :10] = c["q"][:, :10].bfloat16()
    args = dict(q=qp, k_cache=c["cache"], block_table=None, cache_seqlens=None, head_dim_v=512,
                tile_scheduler_metadata=object(), softmax_scale=SM, is_fp8_kvcache=True,
                indices=c["indices"].view(t, 1, -1), attn_sink=torch.zeros(64), extra_k_cache=c["extra_cache"],
                extra_indices_in_kvcache=c["extra_indices"].view(t, 1, -1), topk_length=c["topk_length"],
                extra_topk_length=c["extra_topk_length"])
    hook = sglang_plugin._v4_flash_mla_hook
    orig = _flash_mla_original(calls)
    assert hook(orig, **args) == "flashmla"  # outside _forward_attention
    assert _in_forward_attention(_extend_batch(), 10, lambda: hook(orig, **args)) == "flashmla"  # extend
    out, lse = _in_forward_attention(_decode_batch(), 10, lambda: hook(orig, **args))
    assert out.shape == (t, 1, 64, 512) and lse.shape == (t, 64, 1)
    assert seen["q"].shape == (t, 10, 512) and seen["q"].data_ptr() == qp.data_ptr()  # a view: no copy
    assert (out[:, 0, :10] == 1).all() and (lse[:, :10] == 2).all()
    assert seen["eidx"].shape == (t, 12) and seen["extra"] is c["extra_cache"] and seen["scale"] == SM
    assert len(calls) == 2


def test_v4_decode_hook_leaves_other_formats_to_flashmla_and_says_so_once(caplog):
    calls = []
    v41 = torch.zeros(4, 64, 1, 528, dtype=torch.uint8)  # V4.1's fp8 cache: not ours
    args = dict(q=torch.zeros(2, 1, 64, 512, dtype=torch.bfloat16), k_cache=v41, block_table=None,
                cache_seqlens=None, head_dim_v=512, tile_scheduler_metadata=None, is_fp8_kvcache=True,
                indices=torch.zeros(2, 1, 64, dtype=torch.int32))
    sglang_plugin._SAID.clear()
    with caplog.at_level(logging.WARNING, logger=sglang_plugin.__name__):
        for _ in range(2):
            r = _in_forward_attention(_decode_batch(), 16, lambda: sglang_plugin._v4_flash_mla_hook(
                _flash_mla_original(calls), **args))
            assert r == "flashmla"
    said = [r.getMessage() for r in caplog.records if "went to SGLang's own kernel" in r.getMessage()]
    assert len(said) == 1 and "584-byte V4" in said[0], said
    assert len(calls) == 2


# --- the same decode hook on sm_120 (RTX PRO 6000 Blackwell): flash_mla_sm120.flash_mla_with_kvcache_sm120 ----------

def _sm120_original(calls):
    def flash_mla_with_kvcache_sm120(**kwargs):  # sglang 0.5.23's signature: keywords only
        calls.append(kwargs)
        return "sglang sm120", None
    return flash_mla_with_kvcache_sm120


def _sm120_call(c, t, h_pad, real):
    # the keywords deepseek_v4_backend.py _forward_attention passes on sm_120, shaped as it shapes them: q padded to
    # h_pad heads with garbage beyond the real ones, indices [T, 1, K], the sink [h_pad]
    g = torch.Generator().manual_seed(7)
    qp = torch.randn(t, 1, h_pad, 512, generator=g).bfloat16() * 3
    qp[:, 0, :real] = c["q"][:, :real].bfloat16()
    sink = torch.randn(h_pad, generator=g)
    sink[:real] = c["attn_sink"][:real]
    return dict(q=qp, k_cache=c["cache"], head_dim_v=512, softmax_scale=SM, indices=c["indices"].view(t, 1, -1),
                topk_length=c["topk_length"], attn_sink=sink, extra_k_cache=c["extra_cache"],
                extra_indices_in_kvcache=c["extra_indices"].view(t, 1, -1), extra_topk_length=c["extra_topk_length"])


@pytest.mark.parametrize("h_pad", [12, 64], ids=["real-heads", "padded-to-64"])
def test_v4_decode_on_sm120_routes_to_our_kernel_and_matches_the_reference(monkeypatch, h_pad):
    # The real kernel through the interpreter: the hook hands it bf16 (SGLang's dtype), which the interpreter's dot
    # gets wrong (conftest), so the kernel runs on the same values in fp32 and its output is rounded back to bf16.
    from pdctl.kernels import _sparse_mla

    real_kernel = _sparse_mla.sparse_decode_v4

    def in_fp32(q, *args, out, lse):
        o32 = torch.empty(out.shape, dtype=torch.float32)
        real_kernel(q.float(), *args, out=o32, lse=lse, config=DecodeConfig(16, 16, 4, 1, splits=2))
        out.copy_(o32)
        return out, lse

    monkeypatch.setattr(_sparse_mla, "sparse_decode_v4", in_fp32)
    t, real = 3, 12
    c = _case(heads=real, rows=t)
    args = _sm120_call(c, t, h_pad, real)
    calls = []
    orig = _sm120_original(calls)
    hook = sglang_plugin._v4_flash_mla_sm120_hook
    assert hook(orig, **args)[0] == "sglang sm120"  # outside _forward_attention
    assert _in_forward_attention(_extend_batch(), real, lambda: hook(orig, **args))[0] == "sglang sm120"
    assert len(calls) == 2
    out, lse = _in_forward_attention(_decode_batch(), real, lambda: hook(orig, **args))
    assert len(calls) == 2 and out.shape == (t, 1, h_pad, 512) and out.dtype == torch.bfloat16
    assert lse.shape == (t, h_pad, 1)
    ro, rl = reference_sparse_decode_v4(args["q"][:, 0, :real].double(), c["cache"], c["indices"], SM,
                                        c["topk_length"], c["attn_sink"], c["extra_cache"], c["extra_indices"],
                                        c["extra_topk_length"])
    o = out[:, 0, :real].double()
    assert torch.isfinite(o).all() and (o - ro).abs().max().item() <= 2e-2  # bf16 output
    dead = torch.isinf(rl)
    assert (lse[:, :real, 0].double() - rl)[~dead].abs().max().item() <= 1e-4
    assert (o[dead] == 0).all() and torch.isinf(lse[:, :real, 0][dead]).all()
    # softmax_scale None is q.shape[-1] ** -0.5 there, as in FlashMLA: 512 ** -0.5 for V4
    out2, _ = _in_forward_attention(_decode_batch(), real, lambda: hook(orig, **{**args, "softmax_scale": None}))
    assert torch.equal(out2[:, 0, :real], out[:, 0, :real])


def test_v4_decode_on_sm120_falls_back_to_sglang_and_says_why_once(caplog, monkeypatch):
    from pdctl.kernels import _sparse_mla

    monkeypatch.setattr(_sparse_mla, "sparse_decode_v4", lambda *a, **k: pytest.fail("must not be routed"))
    t = 2
    c = _case(heads=8, rows=t)
    good = _sm120_call(c, t, 64, 8)
    v41 = torch.zeros(4, 64, 1, 528, dtype=torch.uint8)  # V4.1's fp8 cache: not ours
    cases = {
        "584-byte V4": {**good, "k_cache": v41},
        "need int32 [T, 1, K]": {**good, "indices": good["indices"].long()},
        "need int32 [T]": {**good, "extra_topk_length": good["extra_topk_length"].long()},
        "need bf16 [T, 1, h >= 8, 512]": {**good, "q": good["q"].float()},
        "unknown ['causal']": {**good, "causal": True},
    }
    calls = []
    sglang_plugin._SAID.clear()
    with caplog.at_level(logging.WARNING, logger=sglang_plugin.__name__):
        for _ in range(2):
            for args in cases.values():
                r = _in_forward_attention(_decode_batch(), 8, lambda args=args: sglang_plugin._v4_flash_mla_sm120_hook(
                    _sm120_original(calls), **args))
                assert r[0] == "sglang sm120"
    said = [r.getMessage() for r in caplog.records if "went to SGLang's own kernel" in r.getMessage()]
    assert len(said) == len(cases), said  # once per reason, not per call
    for why, line in zip(cases, said):
        assert "flash_mla_with_kvcache_sm120" in line and why in line, (why, line)
    assert len(calls) == 2 * len(cases) and calls[0]["k_cache"] is v41  # SGLang got the call as it was made


def _fake_sglang_0_5_23(monkeypatch, *, with_sm120=True):
    """Stand-in sglang 0.5.23 modules holding every hooked V4 target with its real parameter names, and a
    HookRegistry that records what register() hooks."""
    targets = sglang_plugin.KNOWN_VERSIONS["0.5.23"]
    v4 = sglang_plugin.planned_hooks("0.5.23", model="deepseek-v4")
    modules: dict[str, types.ModuleType] = {}

    def module(name):
        for i in range(1, name.count(".") + 2):
            part = ".".join(name.split(".")[:i])
            if part not in modules:
                modules[part] = types.ModuleType(part)
                monkeypatch.setitem(sys.modules, part, modules[part])
        return modules[name]

    for target in v4:
        if target == sglang_plugin._FLASH_MLA_SM120 and not with_sm120:
            continue
        params = targets[target]
        sig = ", ".join("**kwargs" if p == "kwargs" else "**_" if p == "_" else p for p in params)
        ns: dict = {}
        exec(f"def fn({sig}): pass", ns)  # noqa: S102 - a stub with the target's parameter names
        path, attr = target.rsplit(".", 1)
        owner, cls = path.rsplit(".", 1)
        if cls[0].isupper():  # a method: module.Class.method
            klass = getattr(module(owner), cls, None) or type(cls, (), {})
            setattr(module(owner), cls, klass)
            setattr(klass, attr, ns["fn"])
        else:
            setattr(module(path), attr, ns["fn"])
    registered = {}
    hr = module("sglang.srt.plugins.hook_registry")
    hr.HookType = SimpleNamespace(AROUND="around")
    hr.HookRegistry = SimpleNamespace(register=lambda target, fn, kind: registered.update({target: (fn, kind)}))
    return registered


def test_register_hooks_the_sm120_decode_entry_point_beside_flashmla(monkeypatch, tmp_path):
    from pdctl.kernels import _build

    monkeypatch.setattr(sglang_plugin, "_sglang_version", lambda: "0.5.23")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_build, "load_manifest", lambda d: {"model": "deepseek-v4", "elapsed_s": 1.0,
                                                            "gpu": {"name": "NVIDIA RTX PRO 6000 Blackwell"}})
    monkeypatch.setenv("PDCTL_KERNELS_DIR", str(tmp_path))
    monkeypatch.setenv("PDCTL_KERNELS_ROUTE", "decode")
    monkeypatch.delenv("PDCTL_KERNELS_REQUIRED", raising=False)
    registered = _fake_sglang_0_5_23(monkeypatch)
    sglang_plugin.register()
    assert registered[sglang_plugin._FLASH_MLA_SM120] == (sglang_plugin._v4_flash_mla_sm120_hook, "around")
    assert registered[sglang_plugin._FLASH_MLA] == (sglang_plugin._v4_flash_mla_hook, "around")
    assert len(registered) == 3  # with _forward_attention; the indexer route is off
    # an sglang without the sm_120 module is not the 0.5.23 the plugin knows: nothing is hooked
    monkeypatch.delitem(sys.modules, "sglang.kernels.ops.attention.flash_mla_sm120")
    registered = _fake_sglang_0_5_23(monkeypatch, with_sm120=False)
    with pytest.raises(sglang_plugin.PluginRefusedError, match="cannot resolve .*flash_mla_with_kvcache_sm120"):
        sglang_plugin.register()
    assert not registered


def _indexer_module(capturer=None):
    # forward_c4_indexer's module as the hook reads it (inspect.getmodule of the hooked function)
    mod = types.ModuleType("pdctl_test_dsv4_indexer")
    mod.get_global_indexer_capturer = lambda: capturer
    sys.modules[mod.__name__] = mod
    return mod


def test_v4_indexer_hook_takes_sglangs_query_and_writes_the_exact_top_k(monkeypatch):
    from pdctl.kernels import _indexer
    from pdctl.kernels._build import make_indexer_case
    from pdctl.kernels._indexer import IndexerConfig

    monkeypatch.setitem(_indexer._TUNED, "default", IndexerConfig(programs_per_sm=2, topk_programs=3, topk_block=128))
    lens = [3, 150, 40]
    topk = 32
    q8, w, cache, bt, sl = make_indexer_case(lens, max_context=16 * 64, device="cpu", seed=5)
    rows = len(lens)
    out_buf = torch.full((rows, 64), -1, dtype=torch.int32)  # SGLang pads the width to 64 (_pad_last_dim)
    backend = SimpleNamespace(
        debug_use_external_c4_sparse_indices=False, hisparse_coordinator=None,
        forward_metadata=SimpleNamespace(
            indexer_metadata=SimpleNamespace(compressed_page_size=64, compressed_seq_lens=sl, page_table=bt),
            core_metadata=SimpleNamespace(c4_sparse_raw_indices=None, c4_sparse_page_indices=out_buf)),
        token_to_kv_pool=SimpleNamespace(get_index_k_with_scale_buffer=lambda layer_id: cache.view(-1, 64 * 132)),
    )
    c4 = SimpleNamespace(use_fp4_indexer=False, index_topk=topk, layer_id=3)
    stages = []

    def compute_q(self, q_lora, positions, weight, q_lora_quant=None):
        return q8, w[:, :, None]  # SGLang's shapes: q [T, 64, 128] e4m3, weights [T, 64, 1]

    def forward_c4_indexer(self, x, q_lora, c4_indexer, forward_batch, alt_streams=None, enable_multi_stream=False,
                           q_lora_ready=None, skip_compressor=False, q_lora_quant=None):
        sglang_plugin._v4_compute_q_hook(compute_q, c4_indexer, q_lora, None, None)
        stages.append("compressor")
        if self.debug_use_external_c4_sparse_indices:  # SGLang's early return, before its logits and top-k
            return None
        stages.append("sglang logits + top-k")

    forward_c4_indexer.__module__ = _indexer_module().__name__
    assert sglang_plugin._v4_c4_indexer_hook(forward_c4_indexer, backend, None, None, c4, _decode_batch()) is None
    assert stages == ["compressor"] and backend.debug_use_external_c4_sparse_indices is False
    ref = reference_lightning_indexer(q8, w, cache, bt, sl, topk)
    for b in range(rows):
        assert set(out_buf[b, :topk].tolist()) == set(ref[b].tolist())
    assert (out_buf[:, topk:] == -1).all()
    # extend batches, and decode with the top-k capturer on, run SGLang's own path
    stages.clear()
    sglang_plugin._v4_c4_indexer_hook(forward_c4_indexer, backend, None, None, c4, _extend_batch())
    forward_c4_indexer.__module__ = _indexer_module(capturer=object()).__name__
    sglang_plugin._v4_c4_indexer_hook(forward_c4_indexer, backend, None, None, c4, _decode_batch())
    assert stages == ["compressor", "sglang logits + top-k"] * 2


def test_dataclass_replace_keeps_v4_configs_valid():
    cfg = DecodeConfig(16, 32, 4, 2, splits=4)
    for extra in (dict(pdl=1), dict(pdl=2), dict(bf16_partials=1)):
        check_decode_config(dataclasses.replace(cfg, **extra), 16, 1, "v4", 132)
