"""Lightning indexer vs the float64 reference, through Triton's interpreter (CPU, small shapes).

The interpreter reports 2 SMs, so the persistent logits grid is 8 programs walking many more work items, and the
top-k splits rows over a few programs: the work distribution of the GPU path is exercised, at small widths.
Lengths straddle page and top-k boundaries (0, 1, 63, 64, 65, k, k + 1, several k).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the kernel tests need torch (pdctl[kernels])")
pytest.importorskip("triton", reason="the kernel tests need Triton (pdctl[kernels])")
# Triton's interpreter imports numpy; scripts/setup does not install it yet (asked for in issue 6's report).
pytest.importorskip("numpy", reason="Triton's CPU interpreter needs numpy (add it to scripts/setup's kernels line)")

from pdctl.kernels._build import check_first_histogram, check_topk, make_indexer_case
from pdctl.kernels._indexer import IndexerConfig, indexer_logits, lightning_indexer, topk_over_logits
from pdctl.kernels._reference import (
    logical_to_physical,
    pack_index_k_cache,
    reference_indexer_logits,
    reference_lightning_indexer,
    unpack_index_k_cache,
)

TOPK = 128
CFG = IndexerConfig(chunk_pages=2, programs_per_sm=4, topk_block=128, topk_programs=6)


def _case(lens, max_context=1024, seed=1):
    return make_indexer_case(lens, max_context=max_context, device="cpu", seed=seed, extra_pages=3)


@pytest.mark.parametrize("chunk_pages,tma", [(1, 0), (2, 0), (1, 1)])
def test_logits_match_reference_on_exactly_each_rows_tokens(chunk_pages, tma):
    lens = [0, 1, 63, 64, 65, 300, 700]
    q8, w, cache, bt, sl = _case(lens)
    lg = torch.full((len(lens), bt.shape[1] * 64), float("nan"))
    cfg = IndexerConfig(chunk_pages=chunk_pages, programs_per_sm=4, logits_tma=tma)
    indexer_logits(q8, w, cache, bt, sl, logits=lg, config=cfg)
    ref = reference_indexer_logits(q8, w, cache, bt, sl)
    for b, n in enumerate(lens):
        assert torch.isfinite(lg[b, :n]).all()
        if n:
            assert ((lg[b, :n].double() - ref[b]).abs().max() / ref[b].abs().max()).item() < 1e-6
        assert torch.isnan(lg[b, n:]).all(), "columns past L_b must not be touched"


def test_logits_need_no_tma_alignment_or_pages():
    # A cache whose base sits on 8 bytes (a contiguous view into a larger buffer) or that has no pages at all cannot
    # be described for bulk tensor copies: the default config falls back to per-thread copies, same logits.
    lens = [65, 300]
    q8, w, cache, bt, sl = _case(lens)
    buf = torch.zeros(cache.numel() + 8, dtype=torch.uint8)
    shifted = buf[8:].view(cache.shape)
    shifted.copy_(cache)
    assert shifted.is_contiguous() and shifted.data_ptr() % 16 == 8
    want = indexer_logits(q8, w, cache, bt, sl, config=IndexerConfig(logits_tma=0))
    got = indexer_logits(q8, w, shifted, bt, sl)
    for b, n in enumerate(lens):
        assert torch.equal(got[b, :n], want[b, :n])
    empty = indexer_logits(q8, w, cache[:0], bt[:, :0], torch.zeros(2, dtype=torch.int32))
    assert empty.shape[0] == 2


def test_relu_is_applied_per_head_before_the_weighted_sum():
    # With mixed-sign weights, folding the heads into one GEMV (no per-head ReLU) gives different logits.
    q8, w, cache, bt, sl = _case([200])
    lg = indexer_logits(q8, w, cache, bt, sl, config=CFG)[0, :200].double()
    k8, ks = unpack_index_k_cache(cache)
    slots = logical_to_physical(torch.arange(200), bt[0]).long()
    folded = ((w[0].double()[:, None] * q8[0].double()).sum(0) @ k8[slots].double().T) * ks[slots].double()
    assert (lg - folded).abs().max() > 1e-3 * lg.abs().max()


@pytest.mark.parametrize("physical,fuse_hist0", [(True, 0), (False, 0), (True, 1)])
def test_topk_is_a_valid_topk_over_exactly_each_row(physical, fuse_hist0):
    from dataclasses import replace

    lens = [0, 1, 65, TOPK, TOPK + 1, 333, 1000]
    q8, w, cache, bt, sl = _case(lens)
    out = torch.full((len(lens), TOPK), -7, dtype=torch.int32)
    lightning_indexer(q8, w, cache, bt, sl, TOPK, out=out, physical=physical,
                      config=replace(CFG, fuse_hist0=fuse_hist0))
    assert not (out == -7).any(), "every output entry must be written"
    ref = reference_indexer_logits(q8, w, cache, bt, sl)
    if physical:
        phys = out
    else:
        phys = torch.stack([logical_to_physical(out[b], bt[b]) for b in range(len(lens))])
    res = check_topk(phys, ref, bt, sl, TOPK, rel_tol=1e-6)
    assert res["ok"], res
    # Rows with L <= k answer [0 .. L-1, -1 ...] in order.
    for b, n in enumerate(lens):
        if n <= TOPK:
            expect = logical_to_physical(torch.arange(TOPK).where(torch.arange(TOPK) < n, -1), bt[b])
            assert torch.equal(phys[b], expect)


def test_topk_matches_reference_sets_without_ties():
    lens = [500, 900]
    q8, w, cache, bt, sl = _case(lens, seed=5)
    out = lightning_indexer(q8, w, cache, bt, sl, TOPK, config=CFG)
    ref = reference_lightning_indexer(q8, w, cache, bt, sl, TOPK)
    for b in range(len(lens)):
        assert sorted(out[b].tolist()) == sorted(ref[b].tolist())


def test_topk_with_all_logits_tied_returns_k_distinct_tokens():
    q8, w, cache, bt, sl = _case([777])
    out = lightning_indexer(q8, torch.zeros_like(w), cache, bt, sl, TOPK, config=CFG)
    valid = logical_to_physical(torch.arange(777), bt[0])
    row = out[0]
    assert row.unique().numel() == TOPK and torch.isin(row, valid).all()


def test_negative_logits_order_correctly():
    q8, w, cache, bt, sl = _case([400], seed=9)
    out = lightning_indexer(q8, -w.abs() - 1e-3, cache, bt, sl, TOPK, config=CFG)  # every logit <= 0
    ref = reference_indexer_logits(q8, -w.abs() - 1e-3, cache, bt, sl)
    assert (ref[0] <= 0).all()
    assert check_topk(out, ref, bt, sl, TOPK, rel_tol=1e-6)["ok"]


def test_output_does_not_depend_on_the_block_table_width():
    q8, w, cache, bt, sl = _case([300, 1000], max_context=4096)
    narrow = bt[:, : 1024 // 64].contiguous()
    a = lightning_indexer(q8, w, cache, bt, sl, TOPK, config=CFG)
    b = lightning_indexer(q8, w, cache, narrow, sl, TOPK, config=CFG)
    assert torch.equal(a.sort(dim=1).values, b.sort(dim=1).values)


def _topk_sets(logits, lens, topk=TOPK, cap=8192, physical=False, **cfg):
    # Logical positions of each row's top-k. With physical, the rows' pages are scattered (a shuffled block table)
    # and the physical slots that come out are mapped back, so the same checks cover the slot mapping too.
    from dataclasses import replace

    sl = torch.tensor(lens, dtype=torch.int32)
    pages = -(-logits.shape[1] // 64)
    g = torch.Generator().manual_seed(99)
    bt = torch.stack([torch.randperm(pages, generator=g) + b * pages for b in range(len(lens))]).to(torch.int32)
    out = torch.full((len(lens), topk), -7, dtype=torch.int32)
    topk_over_logits(logits, sl, bt, topk, physical=physical, out=out,
                     config=replace(CFG, topk_refine_cap=cap, **cfg))
    if physical:
        for b in range(len(lens)):
            where = torch.empty(len(lens) * pages, dtype=torch.int64)  # physical page -> logical page of row b
            where[bt[b].long()] = torch.arange(pages)
            keep = out[b] >= 0
            out[b, keep] = (where[out[b, keep].long() // 64] * 64 + out[b, keep] % 64).to(torch.int32)
    return out


# Both outputs: logical positions, and physical slots through a shuffled block table (mapped back by _topk_sets).
PHYS = pytest.mark.parametrize("physical", [False, True])


@PHYS
def test_topk_is_exact_when_most_programs_of_a_row_have_no_share(physical):
    # 32 programs per row. Partition: row 0 (5000 keys, two 128-key blocks per program) leaves 12 of them without
    # a share, row 1 (300 keys, one block each) 29 and row 2 (129 keys) 30. Refinement: row 0's ~1500 candidates
    # take 6 programs (26 exit at once), rows 1 and 2 one (31 exit); the last of each row's active programs
    # must still finish it.
    g = torch.Generator().manual_seed(7)
    lens = [5000, 300, 129]
    logits = torch.randn(3, 5000, generator=g)
    out = _topk_sets(logits, lens, physical=physical, topk_programs=96, refine_block=256)
    for b, n in enumerate(lens):
        assert sorted(out[b].tolist()) == sorted(logits[b, :n].topk(TOPK).indices.tolist())


# The refining program holds up to 1024 keys sharing the k-th key's top 20 bits in registers, then up to
# topk_refine_cap, and loops over the whole candidate list beyond that: cap = 1024 sends every row with more than
# 1024 such keys down the loop.
CAPS = pytest.mark.parametrize("cap", [1024, 8192])


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_topk_when_the_kth_keys_exponent_bin_holds_exactly_the_keys_still_needed(sign):
    # 100 keys in the top exponent bin, 28 in the next, 500 further down: the k-th key's top byte is that of the
    # second bin, and the 28 keys sharing it are exactly the 28 still needed (nothing to resolve below the top
    # byte). Mirrored into negative values with sign = -1.
    g = torch.Generator().manual_seed(3)
    if sign > 0:
        bins = [4 + 4 * torch.rand(100, generator=g), 2 + 2 * torch.rand(28, generator=g), torch.rand(500, generator=g)]
    else:
        bins = [-0.5 - 0.5 * torch.rand(100, generator=g), -1 - torch.rand(28, generator=g),
                -4 - 4 * torch.rand(500, generator=g)]
    vals = torch.cat(bins)
    perm = torch.randperm(vals.numel(), generator=g)
    logits = vals[perm][None, :].contiguous()
    out = _topk_sets(logits, [vals.numel()])
    assert sorted(out[0].tolist()) == sorted(perm.argsort()[:TOPK].tolist())


def test_first_histogram_counts_every_key_of_each_row_exactly():
    # The first radix pass counts a block's keys with two 16-byte windows (below each sign's largest top byte) and
    # falls back to the 256-bin histogram for a block with a key outside them: rows that take either path (see
    # check_first_histogram) must get torch's counts exactly, and nothing may land past bin 255.
    res = check_first_histogram("cpu")
    assert res["ok"], res


@CAPS
@PHYS
@pytest.mark.parametrize("seed", [0, 1])
def test_topk_over_logits_is_exact_on_long_rows_and_negative_values(seed, physical, cap):
    g = torch.Generator().manual_seed(seed)
    lens = [5000, 129, 3000]
    # row 0: ~N(0, 1); row 1: a tiny spread around -5; row 2: every value in one exponent bin (> 1024 candidates)
    logits = torch.stack([torch.randn(5000, generator=g), torch.randn(5000, generator=g) * 1e-3 - 5,
                          16 + 15.99 * torch.rand(5000, generator=g)])
    out = _topk_sets(logits, lens, cap=cap, physical=physical)
    for b, n in enumerate(lens):
        assert sorted(out[b].tolist()) == sorted(logits[b, :n].topk(TOPK).indices.tolist())


@CAPS
@PHYS
@pytest.mark.parametrize("n_tied", [50, 3000])
def test_topk_rations_ties_at_the_kth_value_among_candidates(n_tied, physical, cap):
    # 100 keys above, then n_tied copies of the k-th value sharing its top byte with smaller ones: 28 ties kept.
    logits = torch.cat([torch.full((100,), 9.0), torch.full((n_tied,), 3.5), torch.full((400,), 3.0),
                        torch.linspace(-1, 1, 300)])[None, :].contiguous()
    out = _topk_sets(logits, [logits.shape[1]], cap=cap, physical=physical)[0]
    assert out.unique().numel() == TOPK
    vals = logits[0, out.long()]
    assert (vals == 9.0).sum() == 100 and (vals == 3.5).sum() == 28


@CAPS
@PHYS
@pytest.mark.parametrize("n_close", [300, 3000])
def test_topk_resolves_keys_that_differ_only_in_their_lowest_bits(n_close, physical, cap):
    # n_close consecutive floats from 3.0 up (one ulp apart, so every digit down to the lowest 6 bits decides),
    # shuffled with 100 larger keys, 20 keys in [3.8, 3.9) and 200 in [2, 2.5) (same top byte as the run, other
    # next digits): the top-k is the 100, the 20, and the 8 largest of the run, exactly.
    g = torch.Generator().manual_seed(11)
    run = (torch.tensor(3.0).view(torch.int32) + torch.arange(n_close, dtype=torch.int32)).view(torch.float32)
    vals = torch.cat([torch.full((100,), 9.0), 3.8 + 0.1 * torch.rand(20, generator=g), run,
                      2 + 0.5 * torch.rand(200, generator=g), -torch.rand(500, generator=g)])
    perm = torch.randperm(vals.numel(), generator=g)
    out = _topk_sets(vals[perm][None, :].contiguous(), [vals.numel()], cap=cap, physical=physical)[0]
    expect = perm.argsort()[torch.cat([torch.arange(120), 120 + torch.arange(n_close - 8, n_close)])]
    assert sorted(out.tolist()) == sorted(expect.tolist())


def test_index_cache_pack_round_trip():
    k8 = torch.randn(128, 128).to(torch.float8_e4m3fn)
    ks = torch.rand(128)
    cache = pack_index_k_cache(k8, ks)
    assert cache.shape == (2, 8448)
    k2, s2 = unpack_index_k_cache(cache)
    assert torch.equal(k2.view(torch.uint8), k8.view(torch.uint8)) and torch.equal(s2, ks)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda a: a.update(q8=a["q8"].float()), "q8 must be"),
        (lambda a: a.update(weights=a["weights"][:, :32]), "weights must be"),
        (lambda a: a.update(index_k_cache=a["index_k_cache"][:, :8000]), "index_k_cache must be"),
        (lambda a: a.update(block_table=a["block_table"].long()), "block_table must be"),
        (lambda a: a.update(seq_lens=a["seq_lens"].long()), "seq_lens must be"),
    ],
)
def test_indexer_rejects_bad_inputs(mutate, match):
    q8, w, cache, bt, sl = _case([10, 20])
    args = dict(q8=q8, weights=w, index_k_cache=cache, block_table=bt, seq_lens=sl)
    mutate(args)
    with pytest.raises(ValueError, match=match):
        lightning_indexer(**args)
