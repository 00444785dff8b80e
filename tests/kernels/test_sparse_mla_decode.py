"""Sparse-MLA decode vs the float64 reference, through Triton's interpreter (CPU, small shapes).

The interpreter computes bf16 ``tl.dot`` wrongly, so the bf16 cache layout is exercised here with fp16/fp32
data (the kernel is dtype-generic: it computes in q's dtype); the FP8 656-byte layout runs as on the GPU.
Shapes are odd on purpose: head counts that are not multiples of the head block, top-k widths that are not
multiples of the row tile, split counts that do not divide the rows, short and empty rows.
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch", reason="the kernel tests need torch (pdctl[kernels])")
pytest.importorskip("triton", reason="the kernel tests need Triton (pdctl[kernels])")
# Triton's interpreter imports numpy; scripts/setup does not install it yet (asked for in issue 6's report).
pytest.importorskip("numpy", reason="Triton's CPU interpreter needs numpy (add it to scripts/setup's kernels line)")

from pdctl.kernels._reference import dequantize_kv656, quantize_kv656, reference_sparse_mla_decode
from pdctl.kernels._sparse_mla import DecodeConfig, default_decode_config, sparse_mla_decode

SM = 0.135234


def _case(heads, rows=4, topk=96, slots=400, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(rows, heads, 576, generator=g) * 0.5).to(dtype)
    kv = torch.randn(slots, 576, generator=g)
    idx = torch.stack([torch.randperm(slots, generator=g)[:topk] for _ in range(rows)]).to(torch.int32)
    length = torch.full((rows,), topk, dtype=torch.int32)
    length[1] = topk // 3  # a short row: positions past it must be ignored even though their slots are valid
    idx[min(2, rows - 1), 5::7] = -1  # scattered −1 inside a row
    idx[rows - 1] = -1  # an empty row
    return q, kv, idx, length


def _check(o, lse, ro, rl, atol):
    dead = torch.isinf(rl)
    assert torch.isfinite(o).all()
    assert (o.double() - ro).abs().max().item() <= atol
    assert (lse.double()[~dead] - rl[~dead]).abs().max().item() <= 1e-4
    assert torch.isinf(lse[dead]).all() and (lse[dead] > 0).all(), "empty rows must give lse = +inf"
    assert (o[dead] == 0).all(), "empty rows must give o = 0"


@pytest.mark.parametrize("kv_format", ["float", "fp8"])
@pytest.mark.parametrize("heads", [8, 20])
@pytest.mark.parametrize(
    "cfg",
    [DecodeConfig(16, 32, 4, 1, splits=1), DecodeConfig(16, 32, 4, 1, splits=3, prefetch=1),
     DecodeConfig(16, 16, 4, 1, splits=2, prefetch=2)],
    ids=["single", "split3-prefetch", "split2-reload"],
)
def test_decode_matches_reference_with_padding_lengths_and_empty_rows(kv_format, heads, cfg):
    q, kv, idx, length = _case(heads)
    cache = quantize_kv656(kv) if kv_format == "fp8" else kv
    out = torch.full((q.shape[0], heads, 512), float("nan"))
    lse = torch.full((q.shape[0], heads), float("nan"))
    sparse_mla_decode(q, cache, idx, SM, length, out=out, lse=lse, config=cfg)
    ro, rl = reference_sparse_mla_decode(q, cache, idx, SM, length)
    _check(out, lse, ro, rl, atol=2e-5)


@pytest.mark.parametrize("kv_format", ["float", "fp8"])
def test_split_merge_spread_over_lane_blocks_for_small_batches(monkeypatch, kv_format):
    """As on a 132-SM GPU: 2 rows × 8 heads merge in 32-lane blocks (16 programs per (row, head)), one warp each."""
    from pdctl.kernels import _sparse_mla

    monkeypatch.setattr(_sparse_mla, "_num_sms", lambda device: 132)
    assert _sparse_mla._combine_block_d(2 * 8, 132) == 32 and _sparse_mla._combine_block_d(64 * 16, 132) == 512
    assert _sparse_mla._combine_warps(32, 64) == 1 and _sparse_mla._combine_warps(8, 512) == 4
    assert _sparse_mla._combine_warps(8, 512, bf16_partials=True) == 1  # (slower with 4 warps on the H200)
    assert _sparse_mla._combine_warps(16, 512, bf16_partials=True) == 4
    q, kv, idx, length = _case(8, rows=2)
    cache = quantize_kv656(kv) if kv_format == "fp8" else kv
    out = torch.full((2, 8, 512), float("nan"))
    lse = torch.full((2, 8), float("nan"))
    sparse_mla_decode(q, cache, idx, SM, length, out=out, lse=lse, config=DecodeConfig(16, 16, 4, 1, splits=3))
    ro, rl = reference_sparse_mla_decode(q, cache, idx, SM, length)
    _check(out, lse, ro, rl, atol=2e-5)


def test_decode_fp16_operands_with_a_32_head_block():
    q, kv, idx, length = _case(40, rows=3, topk=64, dtype=torch.float16)
    o, lse = sparse_mla_decode(q, kv.half(), idx, SM, length, config=DecodeConfig(32, 32, 4, 1, splits=2))
    ro, rl = reference_sparse_mla_decode(q, kv.half(), idx, SM, length)
    assert o.dtype == torch.float16
    _check(o, lse, ro, rl, atol=2e-3)


def test_topk_length_hides_valid_indices_past_it():
    q, kv, idx, length = _case(8, rows=2, topk=64)
    length = torch.tensor([10, 64], dtype=torch.int32)
    o, lse = sparse_mla_decode(q, kv, idx, SM, length, config=DecodeConfig(16, 16, 4, 1, splits=1))
    o_trunc, lse_trunc = sparse_mla_decode(q[:1], kv, idx[:1, :10].contiguous(), SM, None,
                                           config=DecodeConfig(16, 16, 4, 1, splits=1))
    assert torch.allclose(o[0], o_trunc[0], atol=1e-6) and torch.allclose(lse[0], lse_trunc[0], atol=1e-6)


def test_fp8_layout_round_trip_is_what_the_kernel_reads():
    kv = torch.randn(64, 576) * 3
    buf = quantize_kv656(kv)
    assert buf.shape == (64, 656) and buf.dtype == torch.uint8
    deq = dequantize_kv656(buf)
    assert torch.equal(deq[:, 512:], kv[:, 512:].bfloat16().float())  # rope kept in bf16
    scales = buf[:, 512:528].contiguous().view(torch.float32)
    assert torch.equal(torch.exp2(torch.log2(scales).round()), scales)  # ue8m0: powers of two
    assert ((deq[:, :512] - kv[:, :512]).abs() <= kv[:, :512].abs() * 0.0625 + scales.amax() * 2**-9).all()


def test_default_config_splits_a_single_row_across_the_gpu():
    cfg = default_decode_config(16, 1, "fp8", num_sms=132)
    assert cfg.splits >= 8
    assert default_decode_config(16, 64, "fp8", num_sms=132).splits <= cfg.splits


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (lambda q, kv, idx: (q[..., :512], kv, idx), "q must be"),
        (lambda q, kv, idx: (q, kv[:, :500], idx), "kv must be"),
        (lambda q, kv, idx: (q, kv, idx.long()), "int32"),
        (lambda q, kv, idx: (q, kv.half(), idx), "must match q dtype"),
        (lambda q, kv, idx: (q, kv, idx[:1]), "indices must be"),
    ],
)
def test_decode_rejects_bad_shapes_with_the_values(bad, match):
    q, kv, idx, _ = _case(8, rows=3, topk=16)
    with pytest.raises(ValueError, match=match):
        sparse_mla_decode(*bad(q, kv, idx), SM)


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (DecodeConfig(block_h=64, splits=2, gluon=4), "block_h 16 or 32 \\(gluon 4\\)"),
        (DecodeConfig(block_h=128, splits=2, gluon=5), "16, 32 or 64 \\(gluon 5\\)"),
        (DecodeConfig(block_h=32, splits=2, gluon=7), "64 \\(gluon 7\\)"),
        (DecodeConfig(block_h=64, splits=2, gluon=6), "gluon 1-5 or 7"),
        (DecodeConfig(block_h=64, splits=2, gluon=3), "block_h 16 or 32 and gluon 1-5 or 7"),
    ],
)
def test_gluon_configs_outside_their_head_blocks_are_refused_before_any_launch(config, match):
    # The Gluon kernels need a Hopper GPU; the config check runs first, so a bad tuned entry is named even on a CPU.
    q, kv, idx, _ = _case(64, rows=2, topk=64)
    with pytest.raises(ValueError, match=match):
        sparse_mla_decode(q.bfloat16(), quantize_kv656(kv), idx, SM, config=config)


def test_a_pdl_mode_outside_0_to_2_is_refused_before_any_launch():
    q, kv, idx, _ = _case(16, rows=2, topk=64)
    out = torch.full((2, 16, 512), -7.0)
    with pytest.raises(ValueError, match="pdl must be 0 .*got 3"):
        sparse_mla_decode(q, kv, idx, SM, out=out, config=DecodeConfig(splits=2, pdl=3))
    assert (out == -7.0).all()


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (DecodeConfig(splits=2, merge=2), "merge must be 0 .*got 2"),
        (DecodeConfig(splits=2, merge=1), "merge=1 is a setting of the warp-specialised Gluon kernels"),
        (DecodeConfig(splits=2, gluon=3, merge=1), "merge=1 is a setting of the warp-specialised Gluon kernels"),
        (DecodeConfig(splits=1, gluon=5, merge=1), "merge=1 needs splits > 1"),
        # 2 rows × 4 head blocks × 2 splits = 16 programs on the interpreter's 4 "SMs": not all resident at once
        (DecodeConfig(splits=2, gluon=5, merge=1), "rows × head blocks × splits = 16 here, 4 SMs"),
    ],
)
def test_an_in_kernel_merge_that_cannot_run_is_refused_before_any_launch(config, match):
    # merge = 1 spins on a grid barrier, so a grid that cannot be resident at once must never launch (it would hang).
    q, kv, idx, _ = _case(64, rows=2, topk=64)
    fp8 = config.gluon > 0
    out = torch.full((2, 64, 512), -7.0, dtype=torch.bfloat16 if fp8 else torch.float32)
    with pytest.raises(ValueError, match=match):
        sparse_mla_decode(q.bfloat16() if fp8 else q, quantize_kv656(kv) if fp8 else kv, idx, SM, out=out,
                          config=config)
    assert (out == -7.0).all()
    if "SMs" in match:  # an empty batch has no grid to exceed the SMs; every other refusal holds for it too
        return
    with pytest.raises(ValueError, match=match):  # refused even when there is nothing to compute
        sparse_mla_decode(q[:0].bfloat16() if fp8 else q[:0], quantize_kv656(kv) if fp8 else kv, idx[:0], SM,
                          config=config)


def test_pdl_modes_fall_back_to_plain_launches_off_the_gpu():
    # Programmatic dependent launch needs sm_90+; under the CPU interpreter a tuned pdl entry still computes the
    # same function (the kernels are compiled with GDC 0, nothing emitted).
    q, kv, idx, length = _case(16, rows=3, topk=96)
    plain = sparse_mla_decode(q, kv, idx, SM, length, config=DecodeConfig(splits=3))
    for mode in (1, 2):
        o, lse = sparse_mla_decode(q, kv, idx, SM, length, config=DecodeConfig(splits=3, pdl=mode))
        assert torch.equal(o, plain[0]) and torch.equal(lse, plain[1])


@pytest.mark.parametrize("heads", [8, 20])
@pytest.mark.parametrize("cfg", [DecodeConfig(16, 16, 4, 1, splits=3, fold=1),
                                 DecodeConfig(16, 32, 4, 1, splits=2, prefetch=1, fold=1)], ids=["split3", "prefetch"])
def test_fp8_rows_dequantised_with_their_scales_match_the_reference(heads, cfg):
    q, kv, idx, length = _case(heads)
    cache = quantize_kv656(kv)
    out = torch.full((q.shape[0], heads, 512), float("nan"))
    lse = torch.full((q.shape[0], heads), float("nan"))
    sparse_mla_decode(q, cache, idx, SM, length, out=out, lse=lse, config=cfg)
    ro, rl = reference_sparse_mla_decode(q, cache, idx, SM, length)
    _check(out, lse, ro, rl, atol=2e-5)


def test_fold_is_a_setting_of_the_fp8_tl_dot_kernel_and_a_build_candidate_at_32_row_tiles():
    from pdctl.kernels._build import _decode_candidates
    from pdctl.kernels._sparse_mla import check_decode_config

    for cfg, fmt in [(DecodeConfig(16, 32, 4, 1, splits=64, prefetch=1, fold=1), "bf16"),
                     (DecodeConfig(16, 32, 4, 1, splits=64, prefetch=2, fold=1), "fp8"),
                     (DecodeConfig(16, 64, 4, 1, splits=32, gluon=5, fold=1), "fp8"),
                     (DecodeConfig(16, 32, 4, 1, splits=64, prefetch=1, fold=1, mma_f16=1), "fp8"),
                     (DecodeConfig(16, 32, 4, 1, splits=64, prefetch=1, fold=2), "fp8")]:
        with pytest.raises(ValueError, match="fold=1 is a setting of the tl.dot kernel"):
            check_decode_config(cfg, 16, 1, fmt, 132)
    check_decode_config(DecodeConfig(16, 32, 4, 1, splits=64, prefetch=1, fold=1), 16, 1, "fp8", 132)
    q, kv, idx, length = _case(8, topk=96)
    with pytest.raises(ValueError, match="fold=1"):  # a bf16-layout cache: refused before anything runs
        sparse_mla_decode(q, kv, idx, SM, length, config=DecodeConfig(16, 32, 4, 1, splits=3, prefetch=1, fold=1))

    folded = [c for c in _decode_candidates(16, 1, 132, "fp8") if c.fold]
    assert {(c.block_n, c.num_warps, c.prefetch, c.splits) for c in folded} == {
        (32, w, 1, s) for w in (4, 8) for s in (16, 32, 64)}
    for c in folded:
        check_decode_config(c, 16, 1, "fp8", 132)
    assert not [c for c in _decode_candidates(16, 1, 132, "bf16") if c.fold]
    chained = {dataclasses.replace(c, qk_chains=0) for c in folded if c.qk_chains}
    assert chained == {c for c in folded if not c.qk_chains}  # each folded config is also tried with split chains


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-layout", "fp8-fold"])
@pytest.mark.parametrize("prefetch", [0, 1])
def test_qk_as_independent_chains_matches_the_reference_and_the_single_chain(fp8, prefetch):
    # The scores summed from five separately scaled products instead of one accumulator chain: the same function up
    # to fp32 rounding of the sum, ragged lengths and an empty row included.
    q, kv, idx, length = _case(20, rows=3, topk=96)
    cache = quantize_kv656(kv) if fp8 else kv
    length[1] = 0
    base = DecodeConfig(16, 32, 4, 1, splits=2, prefetch=prefetch, fold=int(fp8))
    out = torch.full((3, 20, 512), float("nan"))
    lse = torch.full((3, 20), float("nan"))
    sparse_mla_decode(q, cache, idx, SM, length, out=out, lse=lse, config=dataclasses.replace(base, qk_chains=1))
    ro, rl = reference_sparse_mla_decode(q, cache, idx, SM, length)
    _check(out, lse, ro, rl, atol=2e-5)
    so, sl = sparse_mla_decode(q, cache, idx, SM, length, config=base)
    assert torch.allclose(out, so, atol=1e-5, rtol=1e-4) and torch.allclose(lse, sl, atol=1e-5, rtol=1e-5)


def test_qk_chains_is_refused_where_the_scores_are_not_one_chain():
    from pdctl.kernels._sparse_mla import check_decode_config

    for cfg, fmt in [(DecodeConfig(16, 32, 4, 1, splits=2, prefetch=1, qk_chains=1), "fp8"),  # no fold: split already
                     (DecodeConfig(16, 32, 4, 1, splits=2, prefetch=2, qk_chains=1), "fp8"),
                     (DecodeConfig(16, 64, 4, 1, splits=2, gluon=5, qk_chains=1), "fp8"),
                     (DecodeConfig(16, 32, 4, 1, splits=2, qk_chains=2), "bf16")]:
        with pytest.raises(ValueError, match="qk_chains=1 is a setting of the tl.dot kernel"):
            check_decode_config(cfg, 16, 1, fmt, 132)
    check_decode_config(DecodeConfig(16, 32, 4, 1, splits=2, prefetch=1, fold=1, qk_chains=1), 16, 1, "fp8", 132)
    check_decode_config(DecodeConfig(16, 32, 4, 1, splits=2, qk_chains=1), 16, 1, "bf16", 132)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-layout", "fp8"])
def test_bf16_partials_are_merged_within_their_rounding_and_refused_without_splits(fp8):
    # Each split's normalised partial is rounded once to bf16 (relative 2^-9), then weighed and summed in fp32. The
    # partials of a few rows each can be larger than their merged output (they partly cancel), so the bound is a few
    # bf16 steps of the output's scale; a split lost or weighed wrongly is off by the order of |o| itself. Empty rows
    # keep o = 0, lse = +inf; the LSEs stay fp32.
    q, kv, idx, length = _case(20, rows=3, topk=96)
    cache = quantize_kv656(kv) if fp8 else kv
    length[1] = 0
    out = torch.full((3, 20, 512), float("nan"))
    lse = torch.full((3, 20), float("nan"))
    sparse_mla_decode(q, cache, idx, SM, length, out=out, lse=lse, config=DecodeConfig(splits=3, bf16_partials=1))
    ro, rl = reference_sparse_mla_decode(q, cache, idx, SM, length)
    assert (out[1] == 0).all() and torch.isinf(lse[1]).all()
    err = (out - ro).abs().max().item()
    fp32 = sparse_mla_decode(q, cache, idx, SM, length, config=DecodeConfig(splits=3))[0]
    assert (fp32 - ro).abs().max().item() < 1e-4 < err <= 2.0 ** -6 * ro.abs().max().item()
    assert torch.allclose(lse, rl.float(), atol=1e-5)
    with pytest.raises(ValueError, match="bf16_partials must be 0 or 1, and 1 only with splits > 1"):
        sparse_mla_decode(q, cache, idx, SM, length, config=DecodeConfig(splits=1, bf16_partials=1))
