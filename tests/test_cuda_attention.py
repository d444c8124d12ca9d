"""The Hopper kernels of kimi_ops._C (csrc/sm90/: decode_rows16.cuh, decode_token_major.cuh, merge.cuh)
against the float64 oracle.

GPU tests run on an sm_90 GPU with kimi_ops._C built; they reuse the Triton tests' inputs
(fresh random data, permuted cache rows among NaN-filled unused rows, out-of-range indices,
empty and short requests) and oracle. The fp8 query (test_fp8q_*): every CTA height against the
float64 oracle on q8 * q_scale within the fp8-query contract (rel L2 of o <= 4e-3, |dlse| <= 4e-3,
-inf where the oracle has it). CPU (CI): the extension's private op schemas, what the host code
hands the kernels.
"""

import itertools

import pytest
import torch

import kimi_ops
from kimi_ops import dispatch
from conftest import quantize_per_tensor, requires_sm90
from test_triton_attention import (SCALE, check_decode, check_decode_grid, check_graph_replay, check_merge,
                                   check_variable_lengths, make_inputs, oracle)

FP8Q_RTOL, FP8Q_LSE_ATOL = 4e-3, 4e-3  # the fp8-query contract (README, Numerics)


@pytest.mark.skipif(dispatch.cuda_extension_unavailable_reason() is not None, reason="kimi_ops._C not built")
def test_private_op_schemas():
    import kimi_ops.kernels.sm90
    ops = kimi_ops.kernels.sm90._ops()
    split = ops._mla_decode_splitkv_sm90.default._schema
    decode = ops._mla_decode_sm90.default._schema
    merge = ops._mla_merge_sm90.default._schema
    common = ["q", "kv_cache", "kv_indptr", "kv_indices", "seq_lens", "qlen", "qk_scale_log2", "kv_scale",
              "num_splits", "dcp_rank", "dcp_world_size", "rows_per_cta", "stages", "balance_ctas"]
    assert [a.name for a in split.arguments] == common + ["zero_empty", "q_scale", "constant_kv"]
    assert [a.name for a in decode.arguments] == common + ["q_scale", "constant_kv"]
    assert [a.name for a in merge.arguments] == ["o_part", "lse_part"]


def test_split_heuristic_fills_one_wave():
    from kimi_ops.kernels.sm90 import one_wave_splits, suggest_num_splits, used_splits
    # splitkv_kernel's 2-stage 16-row CTAs: two a SM
    assert one_wave_splits(1, 1, 12, 65536) == 256             # one long request: 256 chunks of 256 tokens
    assert one_wave_splits(32, 1, 12, 32 * 8192) == 8          # 256 CTAs in 264 slots
    # fullness counts the splits used after the chunk is rounded up to 64-token tiles: 30 splits of
    # 8192 tokens would be chunks of 274 -> 320 tokens, 26 used (208 CTAs, 79% of 264); 32 use 256
    assert one_wave_splits(8, 1, 12, 8 * 8192) == 32
    assert used_splits(8192, 30) == 26 and used_splits(8192, 32) == 32 and used_splits(100, 7) == 2  # chunk 64
    assert one_wave_splits(128, 8, 12, 128 * 8192) == 1        # already several waves
    assert one_wave_splits(1, 1, 12, 64) == 1                  # one tile: nothing to split
    assert suggest_num_splits(1, 1, 12, 64) == 1
    assert one_wave_splits(1, 1, 12, 200) == 4                 # one split a tile (64, 64, 64, 8)
    # headroom for longer-than-average requests costs <= 2.5% of the KV bytes in zeros
    for args in [(8, 1, 12, 8 * 8192), (64, 1, 96, 64 * 4096), (3, 4, 12, 3 * 1000), (32, 1, 12, 32 * 32768)]:
        s, base = suggest_num_splits(*args), one_wave_splits(*args)
        assert base <= s <= 256
        R, qlen, H, tokens = args
        assert (s - base) * R * qlen * H * 1024 <= 0.025 * tokens * 576 + 1
        assert (s - base) * R * -(-qlen * H // 16) <= 2 * 2 * 132  # at most two waves of empty CTAs


def _rows_per_cta_before_24(rows_per_request):
    """rows_per_cta's rule before the 24-row CTA: padded rows + half a 16-row tile a CTA, ties to
    the bigger CTA, over 16, 32, 48, 64."""
    def cost(rows):
        ctas = -(-rows_per_request // rows)
        return ctas * rows + 8 * ctas
    return min((64, 48, 32, 16), key=cost)


def test_cta_shape_and_ring_depth(monkeypatch):
    from kimi_ops.kernels.sm90 import ROWS_ENV, STAGES_ENV, ring_stages, rows_per_cta
    monkeypatch.delenv(ROWS_ENV, raising=False)
    monkeypatch.delenv(STAGES_ENV, raising=False)
    # fewest padded rows, then fewest KV re-reads, ties to the bigger CTA; 17-24 rows: one 24-row CTA
    assert [rows_per_cta(r) for r in (1, 12, 16, 17, 24, 25, 32, 48, 64, 96, 128, 1536)] == \
        [16, 16, 16, 24, 24, 32, 32, 48, 64, 48, 64, 64]
    assert ring_stages(16) == 2 and ring_stages(24) == 2 and ring_stages(32) == 2 and ring_stages(48) == 2
    assert ring_stages(64) == 2
    monkeypatch.setenv(ROWS_ENV, "16")
    assert rows_per_cta(96) == 16
    monkeypatch.setenv(ROWS_ENV, "24")
    assert rows_per_cta(96) == 24 and ring_stages(24) == 2
    monkeypatch.setenv(ROWS_ENV, "40")
    with pytest.raises(ValueError, match="16, 24, 32, 48 or 64"):
        rows_per_cta(96)
    monkeypatch.delenv(ROWS_ENV)
    monkeypatch.setenv(STAGES_ENV, "4")
    assert ring_stages(16) == 4
    with pytest.raises(ValueError, match=r"2\.\.3 for 64-row"):
        ring_stages(64)
    monkeypatch.setenv(STAGES_ENV, "3")
    assert ring_stages(64) == 3
    with pytest.raises(ValueError, match="must be 2 for 48-row"):  # two 128-token stages
        ring_stages(48)
    with pytest.raises(ValueError, match="must be 2 for 24-row"):
        ring_stages(24)


def test_rows_per_cta_24_only_for_17_to_24_rows(monkeypatch):
    """The 24-row CTA replaces exactly the one 32-row CTA (8 padded rows) of a 17-24-row request;
    every other request keeps the CTA height of the rule before it (_rows_per_cta_before_24)."""
    from kimi_ops.kernels.sm90 import CTAS_PER_SM, DEFAULT_STAGES, MAX_STAGES, ROWS_ENV, rows_per_cta
    monkeypatch.delenv(ROWS_ENV, raising=False)
    for r in range(1, 2049):
        expected = 24 if 17 <= r <= 24 else _rows_per_cta_before_24(r)
        assert rows_per_cta(r) == expected, r
        if 17 <= r <= 24:
            assert _rows_per_cta_before_24(r) == 32, r  # one 32-row CTA before
    assert DEFAULT_STAGES[24] == MAX_STAGES[24] == 2 and CTAS_PER_SM.get((24, 2), 1) == 1


@requires_sm90
def test_auto_backend_is_cuda():
    dev = torch.device("cuda")
    assert dispatch.backend_for("mla_decode_splitkv", dev) == "cuda"
    assert dispatch.backend_for("mla_merge", dev) == "cuda"


@requires_sm90
@pytest.mark.gpu
def test_gpu_private_op_messages():
    """The launcher's own guards raise (the public ops never pass these) with messages built as one
    string: csrc/sm90/mla_decode_sm90.cu says why (a number formatted by c10::str crashed the
    process on the H200 image)."""
    ops = torch.ops.kimi_ops
    q = torch.zeros(2, 12, 576, device="cuda", dtype=torch.bfloat16)
    kv = torch.zeros(64, 576, device="cuda").to(torch.float8_e4m3fn)
    indptr = torch.tensor([0, 32, 64], device="cuda", dtype=torch.int32)
    indices = torch.arange(64, device="cuda", dtype=torch.int32)
    tail = (0, 1, 16, 2, 0)  # dcp rank, world, rows_per_cta, stages, balance_ctas

    def call(q=q, kv=kv, splits=2):
        return ops._mla_decode_sm90(q, kv, indptr, indices, None, 1, 0.1, 1.0, splits, *tail)

    with pytest.raises(RuntimeError, match="kv_cache must be Float8_e4m3fn, got BFloat16"):
        call(kv=kv.to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="q must be BFloat16, got Float"):
        call(q=q.float())
    with pytest.raises(RuntimeError, match="at most 65535 items, got 80000"):
        call(splits=40000)
    o, lse = call()  # and the same arguments, well formed, run
    assert o.shape == (2, 12, 512) and lse.shape == (2, 12)


def test_max_splits(monkeypatch):
    """KIMI_OPS_SM90_MAX_SPLITS replaces the default cap (256) of a request's splits."""
    from kimi_ops.kernels.sm90 import MAX_SPLITS, MAX_SPLITS_ENV, one_wave_splits, suggest_num_splits
    assert MAX_SPLITS == 256 and suggest_num_splits(1, 1, 12, 1 << 20) == 256
    monkeypatch.setenv(MAX_SPLITS_ENV, "128")
    assert one_wave_splits(1, 1, 12, 65536) == 128 and suggest_num_splits(1, 1, 12, 1 << 20) == 128
    monkeypatch.setenv(MAX_SPLITS_ENV, "0")
    with pytest.raises(ValueError, match="1..4096"):
        suggest_num_splits(1, 1, 12, 65536)


def test_balance_waves(monkeypatch):
    """KIMI_OPS_SM90_BALANCE_WAVES scales the split suggestion (one-wave splits and headroom)."""
    from kimi_ops.kernels.sm90 import BALANCE_WAVES_ENV, suggest_num_splits
    tokens = 64 * 12128  # bench_attention.py's variable-length batch, 64 requests
    monkeypatch.setenv(BALANCE_WAVES_ENV, "1")
    assert suggest_num_splits(64, 1, 12, tokens) == 4 + 8        # one wave + two waves of empty CTAs
    monkeypatch.setenv(BALANCE_WAVES_ENV, "2")
    assert suggest_num_splits(64, 1, 12, tokens) == 2 * (4 + 8)
    assert suggest_num_splits(1, 1, 12, 4096) == 64              # one split per 64 tokens: 64 CTAs fit
    assert suggest_num_splits(2, 1, 12, 2 * 8192) == 64          # 2 x 128 one-tile CTAs do not: per 128
    assert suggest_num_splits(1, 2, 12, 4096) == 32              # 24-row CTAs: per 128 tokens
    monkeypatch.setenv(BALANCE_WAVES_ENV, "9")
    with pytest.raises(ValueError, match="1..8"):
        suggest_num_splits(64, 1, 12, tokens)


@requires_sm90
@pytest.mark.parametrize("stages", ["2", "3", "4"])
@pytest.mark.parametrize("H", [12, 16, 96, 128])
def test_grid(H, stages, monkeypatch):
    """splitkv_kernel at each forced ring depth over the grid (the (split, request) grid)."""
    import kimi_ops.kernels.sm90 as hopper
    qlens = [qlen for qlen in (1, 2, 3, 4, 8) if int(stages) <= hopper.MAX_STAGES[hopper.rows_per_cta(qlen * H)]]
    if not qlens:
        pytest.skip(f"no {stages} CTA serves {H} heads")
    monkeypatch.setenv(hopper.STAGES_ENV, stages)
    worst = check_decode_grid(H, torch.Generator().manual_seed(H), kernels=hopper, qlens=qlens, max_splits=128)
    print(f"cuda H={H} stages={stages}: worst rel L2 {worst[0]:.2e}, worst |lse| {worst[1]:.2e}")


@requires_sm90
def test_variable_lengths():
    import kimi_ops.kernels.sm90 as hopper
    check_variable_lengths(torch.Generator().manual_seed(7), kernels=hopper)


@requires_sm90
def test_kv_scale_and_extreme_queries():
    """Query rows of very different magnitudes (the per-row 2^k scaling) and other kv_scales."""
    import kimi_ops.kernels.sm90 as hopper
    g = torch.Generator().manual_seed(17)
    q, kv, indptr, idx = make_inputs([700, 33], 2, 12, kv_scale=0.03, device="cuda", gen=g)
    mags = torch.tensor([1e-30, 1e-6, 1.0, 1e4, 3e30, 0.0], device="cuda")
    q = (q.float() * mags.repeat(2)[:, None, None].repeat(2, 1, 1)[: q.shape[0]].reshape(-1, 1, 1)).to(torch.bfloat16)
    q[0, 3] = 0
    for S in (1, 4):
        op, lp = hopper.mla_decode_splitkv(q, kv, indptr, idx, 2, SCALE, 0.03, S)
        o, lse = hopper.mla_merge(op, lp)
        ro, rl = oracle(q, kv, indptr, idx, 2, SCALE, 0.03)
        fin = ~torch.isneginf(rl)
        assert torch.equal(torch.isneginf(lse), ~fin) and not torch.isnan(o).any()
        # f32 holds an lse of 5e4 to 4e-3: the absolute 1e-3 of the contract, relative beyond 1e3
        assert ((lse.double()[fin] - rl[fin]).abs() <= 1e-3 + 1e-6 * rl[fin].abs()).all()
        # per row: each row's own relative error (magnitudes differ by 1e60)
        err = ((o.double() - ro).norm(dim=-1) / ro.norm(dim=-1).clamp_min(1e-300))[fin]
        assert err.max().item() <= 4e-3, err.max().item()


@requires_sm90
@pytest.mark.parametrize("rise", [-40.0, 0.5, 4.0, 40.0])
@pytest.mark.parametrize("H,qlen", [(12, 1), (12, 2), (16, 2), (96, 1)])
def test_rising_scores(H, qlen, rise):
    """Scores that climb (or fall) along the tokens, so the running max keeps moving: the lazy
    rescaling's slow path (a tile's row max above the running one by more than 2^8) taken on every
    tile (a rise of 40 natural-log units a tile), every other tile (4), every ~11 tiles (0.5: P
    grows toward 2^8 against a stale max) or only on the first tile (falling scores); 16-, 24-,
    32- and 48-row CTAs. kv_scale 2 keeps the values (<= 135) inside e4m3's range."""
    import kimi_ops.kernels.sm90 as hopper
    g = torch.Generator().manual_seed(23)
    lens = [1000, 300]
    kv_scale = 2.0
    q, kv, indptr, idx = make_inputs(lens, qlen, H, kv_scale=kv_scale, device="cuda", gen=g)
    q.zero_()
    q[..., :16] = 1.0  # every score = SCALE * 16 * (the token's value in columns 0-15)
    per_unit = SCALE * 16
    for r, n in enumerate(lens):
        t = torch.arange(n, device="cuda", dtype=torch.float32)
        value = (t - n / 2) * (rise / 64) / per_unit  # a tile of 64 tokens moves the score by `rise`
        rows = idx[int(indptr[r]): int(indptr[r + 1])].long()
        kv[rows, :16] = (value / kv_scale)[:, None].to(kv.dtype)
    ro, rl = oracle(q, kv, indptr, idx, qlen, SCALE, kv_scale)
    for S in (1, 3):
        o, lse = hopper.mla_merge(*hopper.mla_decode_splitkv(q, kv, indptr, idx, qlen, SCALE, kv_scale, S))
        assert not torch.isnan(o).any()
        assert (lse.double() - rl).abs().max().item() <= 1e-3
        assert ((o.double() - ro).norm() / ro.norm()).item() <= 4e-3


def check_work_list_decode(lens, qlen, H, S, gen, oob=0):
    """hopper.mla_decode (work-list grid + its merge) against the oracle, its partials drawn from
    an allocator block poisoned with NaN: a row the kernel or the merge misses shows as NaN."""
    import kimi_ops.kernels.sm90 as hopper
    q, kv, indptr, idx = make_inputs(lens, qlen, H, device="cuda", gen=gen, oob=oob)
    poison = torch.full((1 << 22,), float("nan"), dtype=torch.float32, device="cuda")
    del poison  # the partials below reuse the block
    o, lse = hopper.mla_decode(q, kv, indptr, idx, qlen, SCALE, 0.5, S)
    ro, rl = oracle(q, kv, indptr, idx, qlen, SCALE, 0.5)
    fin = ~torch.isneginf(rl)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert torch.equal(torch.isneginf(lse), ~fin) and (o[~fin] == 0).all()
    err = ((o.double() - ro).norm() / ro.norm().clamp_min(1e-30)).item()
    lerr = (lse.double()[fin] - rl[fin]).abs().max().item() if fin.any() else 0.0
    assert err <= 4e-3 and lerr <= 1e-3, (lens[:8], qlen, H, S, err, lerr)
    return err, lerr


@requires_sm90
@pytest.mark.parametrize("rows,load", [("24", "cp"), ("24", "bulk"), ("32", "cp"), ("32", "bulk"), ("48", "cp"),
                                       ("48", "halves"), ("64", None)])
def test_tile_edges(rows, load, monkeypatch):
    """Lengths at the 64- and 128-token tile edges, 1-3 splits, on each token-major CTA height:
    24, 32 and 48 rows stream 128-token tiles, whose last one reaches past the split's end when the
    split holds an odd number of 64-token tiles (its rows zero-filled and masked). 24 and 32 rows
    under both gathers (KIMI_OPS_SM90_TM_LOAD: cp.async chunks, or bulk copies with the rows past
    the split zeroed by stores), 48 rows under both of theirs (whole tiles, or by halves), the fp8
    query too. (24 rows at qlen 2 x 12 heads: one CTA; forced elsewhere, several.)"""
    import kimi_ops.kernels.sm90 as hopper
    monkeypatch.setenv(hopper.ROWS_ENV, rows)
    if load is not None:
        monkeypatch.setenv("KIMI_OPS_SM90_TM_LOAD", load)
    g = torch.Generator().manual_seed(int(rows))
    lens = [1, 63, 64, 65, 127, 128, 129, 191, 192, 193, 320, 0]
    for S in (1, 2, 3):
        check_decode(lens, 2, 12, S, kernels=hopper, device="cuda", gen=g)
        check_work_list_decode(lens, 2, 12, S, g)
    if load is not None:
        check_decode(lens, 2, 12, 2, kernels=hopper, device="cuda", gen=g, fp8_q=True, oob=3)


@requires_sm90
@pytest.mark.parametrize("waves", ["1", "2", "4"])
@pytest.mark.parametrize("H", [12, 16, 96, 128])
def test_work_list_grid(H, waves, monkeypatch):
    """mla_decode's work-list grid over the grid's shapes, each balance depth: the items bound
    by requests x splits (small S) and by balance + requests (S = None: the default cap),
    requests past the scan's 32-request steps, empty requests among them."""
    import kimi_ops.kernels.sm90 as hopper
    monkeypatch.setenv(hopper.BALANCE_WAVES_ENV, waves)
    monkeypatch.delenv(hopper.WORK_LIST_ENV, raising=False)
    g = torch.Generator().manual_seed(31 + H)
    many = torch.randint(0, 700, (70,), generator=g).tolist()
    many[31] = many[32] = many[69] = 0
    worst = (0.0, 0.0)
    for qlen in (1, 2, 4, 8) if H <= 16 else (1, 3):
        for lens, S, oob in [([0, 1, 2, 7, 63, 64, 65, 300], 3, 0), ([4096, 17, 2500, 0], None, 2),
                             ([5, 1, 0, 2], 9, 0), ([16384], None, 0), ([65536, 3, 9000], 2, 0),
                             (many, None, 0), (many, 2, 0)]:
            if H > 16 and len(lens) > 8:
                continue
            e = check_work_list_decode(lens, qlen, H, S, g, oob=oob)
            worst = (max(worst[0], e[0]), max(worst[1], e[1]))
    print(f"cuda work list H={H} waves={waves}: worst rel L2 {worst[0]:.2e}, worst |lse| {worst[1]:.2e}")


@requires_sm90
def test_work_list_launch_order(monkeypatch):
    """The work list launches whole chunks first and partial ones by length after, while each
    request's splits keep consecutive partials slots: 2000 requests (63 scan steps) of 0-23 tokens
    (one split each: partial chunks of two tail classes, or empty) with long ones among them of two
    splits each (a whole and a partial chunk, launched far apart), against the oracle."""
    import kimi_ops.kernels.sm90 as hopper
    monkeypatch.delenv(hopper.BALANCE_WAVES_ENV, raising=False)
    monkeypatch.delenv(hopper.WORK_LIST_ENV, raising=False)
    g = torch.Generator().manual_seed(47)
    lens = torch.randint(0, 24, (2000,), generator=g).tolist()
    for r, n in ((0, 5000), (31, 4500), (32, 2600), (1000, 5000), (1999, 3000)):
        lens[r] = n
    err, lerr = check_work_list_decode(lens, 1, 12, 2, g)
    print(f"cuda work list, 2000 requests: rel L2 {err:.2e}, |lse| {lerr:.2e}")


@requires_sm90
def test_work_list_merge_rounds(monkeypatch):
    """A request with more splits than the merge was sized for: beside 127 requests of 64 tokens
    (one split each) the merge is told rows have about 3 splits (merge_rows_kernel), but the
    8192-token request takes 16, its rows merged in 4 rounds of 4 split rows."""
    import kimi_ops.kernels.sm90 as hopper
    monkeypatch.delenv(hopper.BALANCE_WAVES_ENV, raising=False)
    monkeypatch.delenv(hopper.WORK_LIST_ENV, raising=False)
    lens = [64] * 127 + [8192]
    q = torch.empty(len(lens), 12, 576, dtype=torch.bfloat16, device="cuda")
    indptr = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device="cuda")
    balance = hopper.balance_ctas(q, indptr, torch.empty(sum(lens), dtype=torch.int32, device="cuda"), 1)
    assert balance // len(lens) + 2 <= 4  # the hint mla_decode_sm90 gives launch_merge
    err, lerr = check_work_list_decode(lens, 1, 12, 16, torch.Generator().manual_seed(53))
    print(f"cuda work list, a 16-split request among hints of 3 splits: rel L2 {err:.2e}, |lse| {lerr:.2e}")


@requires_sm90
@pytest.mark.parametrize("few_rows", ["1", "0"])
def test_work_list_merge_few_rows(few_rows, monkeypatch):
    """Fewer rows than 2 x SMs take merge_kernel with 2-16 column blocks sized from the hint
    (launch_merge; KIMI_OPS_SM90_MERGE_FEW_ROWS=0: the rule for more rows); a long request beside
    short ones has more splits than the hint, so its rows take several load rounds: 36 rows with a
    65536-token request of ~170 splits, 192 rows with a 32768-token one; then one request of 8193
    tokens and eight of 1024."""
    import kimi_ops.kernels.sm90 as hopper
    monkeypatch.setenv("KIMI_OPS_SM90_MERGE_FEW_ROWS", few_rows)
    monkeypatch.delenv(hopper.BALANCE_WAVES_ENV, raising=False)
    monkeypatch.delenv(hopper.WORK_LIST_ENV, raising=False)
    g = torch.Generator().manual_seed(61)
    for lens in ([100, 100, 65536], [64] * 15 + [32768], [8193], [1024] * 8):
        err, lerr = check_work_list_decode(lens, 1, 12, None, g)
        print(f"few rows {few_rows}, {len(lens)} requests, longest {max(lens)}: rel L2 {err:.2e}, |lse| {lerr:.2e}")


@requires_sm90
@pytest.mark.parametrize("fold", ["", "0", "64", "255"])
def test_work_list_tail_fold(fold, monkeypatch):
    """A request's short last split folded into the one before (KIMI_OPS_SM90_TAIL_FOLD; unset:
    64 tokens at >= 1.5 CTAs an SM, which 8 x 8193 at qlen 1 reach): tails of 1-65 tokens beside
    whole chunks, 8 requests of ~8k (chunks of 256: 255 folds every partial tail, 64 all but the
    65-token one) and a mix, at 12 heads x qlen 1, 2, 4 and 16 heads x qlen 2 (16-, 24-, 48- and
    32-row CTAs), against the oracle."""
    import kimi_ops.kernels.sm90 as hopper
    monkeypatch.setenv("KIMI_OPS_SM90_TAIL_FOLD", fold)
    monkeypatch.delenv(hopper.BALANCE_WAVES_ENV, raising=False)
    monkeypatch.delenv(hopper.WORK_LIST_ENV, raising=False)
    g = torch.Generator().manual_seed(67)
    for H, qlen in ((12, 1), (12, 2), (12, 4), (16, 2)):
        errs = [check_work_list_decode(lens, qlen, H, None, g) for lens in
                ([8193] * 8, [8192 + 64] * 7 + [8192 + 65], [8200, 1, 8255, 8193, 300, 8192, 4097, 65])]
        print(f"tail fold {fold!r} H{H} qlen {qlen}: worst rel L2 {max(e[0] for e in errs):.2e}, "
              f"|lse| {max(e[1] for e in errs):.2e}")


@requires_sm90
@pytest.mark.parametrize("work_list", ["0", "1"])
@pytest.mark.parametrize("waves", ["1", "2"])
def test_private_partials(waves, work_list, monkeypatch):
    """zero_empty=False: empty splits leave o unwritten (NaN from a poisoned allocator block) and
    say lse = -inf; both merges must skip them. Then mla_decode on either grid."""
    import kimi_ops.kernels.sm90 as hopper
    import kimi_ops.kernels.attention as triton_kernels
    monkeypatch.setenv(hopper.BALANCE_WAVES_ENV, waves)
    monkeypatch.setenv(hopper.WORK_LIST_ENV, work_list)
    monkeypatch.delenv(hopper.STAGES_ENV, raising=False)
    g = torch.Generator().manual_seed(29)
    for lens, qlen, S in [([0, 5, 3000, 70, 0], 1, 16), ([9000, 64, 1], 2, 40), ([0], 1, 3)]:
        q, kv, indptr, idx = make_inputs(lens, qlen, 12, device="cuda", gen=g)
        T, H = q.shape[:2]
        poison = torch.full((S, T, H, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        del poison  # o_part below reuses the block: whatever the kernel does not write stays NaN
        op, lp = hopper.mla_decode_splitkv(q, kv, indptr, idx, qlen, SCALE, 0.5, S, zero_empty=False)
        ro, rl = oracle(q, kv, indptr, idx, qlen, SCALE, 0.5)
        fin = ~torch.isneginf(rl)
        for merge in (hopper.mla_merge, triton_kernels.mla_merge):
            o, lse = merge(op, lp)
            assert not torch.isnan(o).any() and torch.equal(torch.isneginf(lse), ~fin)
            assert (o[~fin] == 0).all()
            assert ((o.double() - ro).norm() / ro.norm().clamp_min(1e-30)).item() <= 4e-3
            assert not fin.any() or (lse.double()[fin] - rl[fin]).abs().max().item() <= 1e-3
        check_work_list_decode(lens, qlen, 12, S, g)


@requires_sm90
def test_merge(monkeypatch):
    import kimi_ops.kernels.sm90 as hopper
    import kimi_ops.kernels.attention as triton_kernels
    monkeypatch.setattr(triton_kernels, "mla_merge", hopper.mla_merge)  # check_merge calls it from there
    g = torch.Generator().manual_seed(5)
    # rows 12..1536, 1..256 splits: merge_kernel's column block counts (4, 8, 16 of 128, 64, 32
    # columns; 16 where a row has more than 64 splits: one load round up to 128, two at 130 / 256)
    # for S > 16, merge_rows_kernel (a warp a row, 4 rows a CTA) for S <= 16 in rounds of 4 (S <= 4)
    # or 8 split rows, one round or two (S = 9, 13), its last CTA part empty (15, 18, 45 rows)
    for S, T, H in [(64, 40, 12), (1, 3, 128), (5, 6, 3), (17, 2, 96), (130, 1, 12), (5, 64, 12), (9, 128, 12),
                    (2, 96, 12), (4, 7, 16), (3, 1, 12), (3, 5, 3), (8, 33, 4), (13, 9, 5), (128, 1, 12),
                    (256, 2, 12), (100, 1, 3)]:
        check_merge(S, T, H, device="cuda", gen=g)
        check_merge(S, T, H, device="cuda", gen=g, spread=80.0)
        # the kernel loads an empty split's o with its lse (one round of latency less): NaN there
        # must not reach the sum
        check_merge(S, T, H, device="cuda", gen=g, dead_frac=0.7, dead_nan=True)


@requires_sm90
@pytest.mark.parametrize("work_list", ["0", "1"])
def test_public_ops_and_cuda_graph(work_list, monkeypatch):
    """mla_decode through the dispatcher (auto -> cuda), captured in a CUDA graph, replayed after
    the lengths, indices and q changed in place: equal to eager and to the oracle, on the
    work-list grid (its items found on the device) and on the (split, request) grid."""
    import kimi_ops.kernels.sm90 as hopper
    monkeypatch.setenv(hopper.WORK_LIST_ENV, work_list)
    assert dispatch.backend_for("mla_decode_splitkv", torch.device("cuda")) == "cuda"
    check_graph_replay(lambda q, kv, indptr, idx, qlen, S: kimi_ops.mla_decode(
        q, kv, indptr, idx, qlen=qlen, scale=SCALE, kv_scale=0.5, num_splits=S))


@requires_sm90
@pytest.mark.parametrize("lens", [[900, 0, 65, 3000, 1], [3000], [900, 0, 3000],
                                  [900, 0, 65, 3000, 1, 17, 64, 128, 2048]], ids=["five", "one", "three", "nine"])
@pytest.mark.parametrize("work_list", ["0", "1"])
@pytest.mark.parametrize("H,qlen", [(12, 1), (12, 2), (96, 1)])
def test_constant_kv_reads_q_after_the_wait(H, qlen, work_list, lens, monkeypatch):
    """constant_kv=True (the split kernel's CTAs find their work and start gathering the cache
    before griddepcontrol.wait) right after M1a, a PDL kernel that lets its dependents start
    before it writes q: the same bits as constant_kv=False and within the oracle's contract, on
    the 16-row and token-major kernels, both grids, one split and many, empty requests, eager and
    in a CUDA graph, q new each time (a q read before the wait would be the previous one). One
    request, five and nine take the merge as a PDL launch, three a plain one (merge_pdl)."""
    import kimi_ops.kernels.sm90 as hopper
    monkeypatch.setenv(hopper.WORK_LIST_ENV, work_list)
    g = torch.Generator().manual_seed(31)
    _, kv, indptr, idx = make_inputs(lens, qlen, H, device="cuda", gen=g)
    T = len(lens) * qlen
    w_uk = (torch.randn(H, 128, 512, generator=g) * 0.05).to(torch.bfloat16).cuda()
    q_nope = torch.empty(T, H, 128, dtype=torch.bfloat16, device="cuda")
    q_pe = torch.empty(T, H, 64, dtype=torch.bfloat16, device="cuda")

    def step(splits, constant_kv):
        q = kimi_ops.mla_query(q_nope, q_pe, w_uk, constant_w=True)
        return q, kimi_ops.mla_decode(q, kv, indptr, idx, qlen=qlen, scale=SCALE, kv_scale=0.5,
                                      num_splits=splits, constant_kv=constant_kv)

    for splits in (1, 8):
        graphs = {}
        for constant_kv in (False, True):
            step(splits, constant_kv)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = step(splits, constant_kv)
            graphs[constant_kv] = (graph, out)
        for trial in range(3):
            q_nope.copy_(torch.randn(q_nope.shape, generator=g).to(torch.bfloat16))
            q_pe.copy_(torch.randn(q_pe.shape, generator=g).to(torch.bfloat16))
            got = {c: step(splits, c) for c in (False, True)}
            for c in (False, True):
                graphs[c][0].replay()
            torch.cuda.synchronize()
            q, (o, lse) = got[True]
            for name, (q2, (o2, lse2)) in (("eager", got[False]), ("graph", graphs[False][1]),
                                           ("graph, constant_kv", graphs[True][1])):
                assert torch.equal(q, q2), name
                assert torch.equal(o, o2) and torch.equal(lse, lse2), f"{name}: splits {splits}, trial {trial}"
            ro, rl = oracle(q, kv, indptr, idx, qlen, SCALE, 0.5)
            fin = ~torch.isneginf(rl)
            assert torch.equal(torch.isneginf(lse), ~fin)
            assert ((o.double() - ro).norm() / ro.norm()).item() <= 4e-3
            assert (lse.double()[fin] - rl[fin]).abs().max().item() <= 1e-3


@requires_sm90
def test_agrees_with_triton():
    """The two GPU backends on one input: both within the contract of each other."""
    import kimi_ops.kernels.sm90 as hopper
    import kimi_ops.kernels.attention as triton_kernels
    g = torch.Generator().manual_seed(23)
    q, kv, indptr, idx = make_inputs([3000, 1, 700], 4, 16, device="cuda", gen=g)
    a = hopper.mla_merge(*hopper.mla_decode_splitkv(q, kv, indptr, idx, 4, SCALE, 0.5, 5))
    b = triton_kernels.mla_merge(*triton_kernels.mla_decode_splitkv(q, kv, indptr, idx, 4, SCALE, 0.5, 5))
    assert ((a[0].float() - b[0].float()).norm() / b[0].float().norm()).item() <= 4e-3
    fin = ~torch.isneginf(b[1])
    assert torch.equal(torch.isneginf(a[1]), ~fin)
    assert (a[1][fin] - b[1][fin]).abs().max().item() <= 1e-3


class _RecordOps:
    """Stands in for torch.ops.kimi_ops' private sm90 ops on the CPU: records each call's
    arguments and returns partials / outputs of the right shapes (zeros)."""

    def __init__(self):
        self.split_calls, self.decode_calls, self.merge_calls, self.q_scales = [], [], [], []

    def _mla_decode_splitkv_sm90(self, q, kv, indptr, indices, seq_lens, qlen, qk_scale_log2, kv_scale,
                                 num_splits, dcp_rank, dcp_world_size, rows, stages, balance, zero_empty,
                                 q_scale=None, constant_kv=False):
        self.split_calls.append(dict(num_splits=num_splits, rows=rows, stages=stages, balance=balance,
                                     zero_empty=zero_empty, constant_kv=constant_kv))
        self.q_scales.append(q_scale)
        T, H, _ = q.shape
        return (torch.zeros(num_splits, T, H, 512, dtype=torch.bfloat16),
                torch.zeros(num_splits, T, H, dtype=torch.float32))

    def _mla_decode_sm90(self, q, kv, indptr, indices, seq_lens, qlen, qk_scale_log2, kv_scale,
                         num_splits, dcp_rank, dcp_world_size, rows, stages, balance, q_scale=None,
                         constant_kv=False):
        self.decode_calls.append(dict(num_splits=num_splits, rows=rows, stages=stages, balance=balance,
                                      constant_kv=constant_kv))
        self.q_scales.append(q_scale)
        T, H, _ = q.shape
        return torch.zeros(T, H, 512, dtype=torch.bfloat16), torch.zeros(T, H, dtype=torch.float32)

    def _mla_merge_sm90(self, o_part, lse_part):
        self.merge_calls.append(o_part.shape[0])
        return o_part[0].clone(), lse_part[0].clone()


@pytest.fixture
def recorded_sm90(monkeypatch):
    """The cuda backend's host code on CPU tensors, the kernels replaced by _RecordOps."""
    import kimi_ops.kernels.sm90 as hopper
    rec = _RecordOps()
    monkeypatch.setattr(hopper, "_ops", lambda: rec)
    monkeypatch.setattr(hopper, "_multiprocessor_count", lambda device: 132)
    for env in (hopper.STAGES_ENV, hopper.BALANCE_WAVES_ENV, hopper.WORK_LIST_ENV):
        monkeypatch.delenv(env, raising=False)
    return hopper, rec


def test_host_passes_the_switches(recorded_sm90, monkeypatch):
    """What kimi_ops/kernels/sm90.py hands the kernels: the defaults, then each switch."""
    hopper, rec = recorded_sm90
    q, kv, indptr, idx = make_inputs([300, 40], 1, 12)
    args = (q, kv, indptr, idx, 1, SCALE, 0.5, 8)
    hopper.mla_merge(*hopper.mla_decode_splitkv(*args))
    one_wave = hopper.one_wave_splits(2, 1, 12, idx.shape[0])
    balance = hopper.balance_waves() * 2 * one_wave
    assert rec.split_calls[-1] == dict(num_splits=8, rows=16, stages=2, balance=balance, zero_empty=True,
                                       constant_kv=False)
    assert rec.merge_calls[-1] == 8
    monkeypatch.setenv(hopper.BALANCE_WAVES_ENV, "3")
    monkeypatch.setenv(hopper.STAGES_ENV, "4")
    hopper.mla_decode_splitkv(*args, zero_empty=False)
    assert rec.split_calls[-1] == dict(num_splits=8, rows=16, stages=4, balance=3 * 2 * one_wave, zero_empty=False,
                                       constant_kv=False)


def test_mla_decode_runs_the_work_list(recorded_sm90, monkeypatch):
    """mla_decode (cuda backend): the work-list op (split kernel + merge in one); with one split,
    KIMI_OPS_SM90_WORK_LIST=0 or too many items: the (split, request) grid with private partials
    and the merge. The public mla_decode_splitkv keeps its contract (o = 0 written)."""
    hopper, rec = recorded_sm90
    monkeypatch.setattr(dispatch, "backend_for", lambda op, device: "cuda")
    monkeypatch.setattr(dispatch, "implementation", lambda op, device: getattr(hopper, op))
    q, kv, indptr, idx = make_inputs([3000, 400], 1, 12)
    balance = hopper.balance_waves() * 2 * hopper.one_wave_splits(2, 1, 12, idx.shape[0])
    o, lse = kimi_ops.mla_decode(q, kv, indptr, idx, qlen=1, scale=SCALE, kv_scale=0.5, num_splits=4)
    assert o.shape == (2, 12, 512) and lse.shape == (2, 12)
    assert rec.decode_calls[-1] == dict(num_splits=4, rows=16, stages=2, balance=balance, constant_kv=False)
    assert not rec.split_calls and not rec.merge_calls
    kimi_ops.mla_decode(q, kv, indptr, idx, qlen=1, scale=SCALE, kv_scale=0.5, num_splits=4, constant_kv=True)
    assert rec.decode_calls[-1]["constant_kv"] is True
    kimi_ops.mla_decode(q, kv, indptr, idx, qlen=1, scale=SCALE, kv_scale=0.5)  # default: the cap
    # 2 requests x 27 one-tile splits fit the 132 SMs: one split a 64-token tile
    assert rec.decode_calls[-1]["num_splits"] == hopper._split_cap(2, idx.shape[0], 1, 12, 132) == -(-3400 // 2 // 64)
    kimi_ops.mla_decode(q, kv, indptr, idx, qlen=1, scale=SCALE, kv_scale=0.5, num_splits=1, constant_kv=True)
    assert rec.split_calls[-1]["num_splits"] == 1 and not rec.merge_calls
    assert rec.split_calls[-1]["constant_kv"] is True  # the (split, request) grid takes it too
    monkeypatch.setenv(hopper.WORK_LIST_ENV, "0")
    kimi_ops.mla_decode(q, kv, indptr, idx, qlen=1, scale=SCALE, kv_scale=0.5, num_splits=4)
    assert rec.split_calls[-1]["zero_empty"] is False and rec.merge_calls == [4]
    monkeypatch.delenv(hopper.WORK_LIST_ENV)
    monkeypatch.setattr(hopper, "MAX_GRID_Y", 3)
    kimi_ops.mla_decode(q, kv, indptr, idx, qlen=1, scale=SCALE, kv_scale=0.5, num_splits=4)
    assert rec.merge_calls == [4, 4] and len(rec.decode_calls) == 3
    kimi_ops.mla_decode_splitkv(q, kv, indptr, idx, qlen=1, scale=SCALE, kv_scale=0.5, num_splits=4)
    assert rec.split_calls[-1]["zero_empty"] is True


def _used_splits(n, num_splits, balanced):
    """csrc's used_splits / split_chunk, for the bound below (a folded tail only lowers it)."""
    per_split = max(-(-n // num_splits), balanced) if n > 0 else 0
    chunk = -(-per_split // 64) * 64
    return -(-n // chunk) if chunk > 0 else 0


def test_work_list_items_bound_the_used_splits():
    """work_list_items (the grid the host launches and the partials it allocates) is never fewer
    than the splits the device finds, for any mix of lengths and any balance."""
    from kimi_ops.kernels.sm90 import work_list_items
    g = torch.Generator().manual_seed(3)
    for trial in range(400):
        R = int(torch.randint(1, 80, (1,), generator=g))
        lens = torch.distributions.LogNormal(6.0, 2.5).sample((R,)).long().clamp(0, 1 << 20)
        lens[torch.rand(R, generator=g) < 0.2] = 0
        S = int(torch.randint(1, 129, (1,), generator=g))
        balance = int(torch.randint(0, 2000, (1,), generator=g))
        total = int(lens.sum())
        balanced = -(-total // balance) if balance > 0 else 0
        used = sum(_used_splits(int(n), S, balanced) for n in lens)
        assert used <= work_list_items(R, S, balance), (R, S, balance, used)
        assert all(_used_splits(int(n), S, balanced) <= S for n in lens)


def test_fp8_query_runs_the_kernels(recorded_sm90, monkeypatch):
    """An e4m3fn q with q_scale goes to the csrc kernels (both ops), q_scale handed through as
    the tensor (read on the device); an e4m3fnuz q or cache still runs the Triton kernel."""
    hopper, rec = recorded_sm90
    q, kv, indptr, idx = make_inputs([3000, 400], 2, 12)
    q8, q_scale = quantize_per_tensor(q.float())
    o_part, _ = hopper.mla_decode_splitkv(q8, kv, indptr, idx, 2, SCALE, 0.5, 4, q_scale=q_scale)
    assert o_part.dtype == torch.bfloat16 and rec.q_scales[-1] is q_scale
    assert rec.split_calls[-1]["rows"] == hopper.rows_per_cta(24)
    hopper.mla_decode(q8, kv, indptr, idx, 2, SCALE, 0.5, 4, q_scale=q_scale)
    assert len(rec.decode_calls) == 1 and rec.q_scales[-1] is q_scale
    hopper.mla_decode_splitkv(q, kv, indptr, idx, 2, SCALE, 0.5, 4)
    assert rec.q_scales[-1] is None
    assert hopper._triton_serves(q8.to(torch.float8_e4m3fnuz), kv)
    assert hopper._triton_serves(q8, kv.to(torch.float8_e4m3fnuz))
    assert not hopper._triton_serves(q8, kv) and not hopper._triton_serves(q, kv)


def check_fp8q(lens, qlen, H, S, gen, *, oob=0, q_gain=1.0, work_list=False, kv_scale=0.5):
    """The cuda kernels on an fp8 q (per-tensor amax scale): mla_decode_splitkv + merge, or
    mla_decode (work-list grid), against the float64 oracle on q8 * q_scale. (rel L2, |dlse|)."""
    import kimi_ops.kernels.sm90 as hopper
    q, kv, indptr, idx = make_inputs(lens, qlen, H, kv_scale=kv_scale, device="cuda", gen=gen, oob=oob)
    q8, q_scale = quantize_per_tensor(q.float() * q_gain)
    if work_list:
        o, lse = hopper.mla_decode(q8, kv, indptr, idx, qlen, SCALE, kv_scale, S, q_scale=q_scale)
    else:
        o_part, lse_part = hopper.mla_decode_splitkv(q8, kv, indptr, idx, qlen, SCALE, kv_scale, S, q_scale=q_scale)
        assert not torch.isnan(o_part).any() and not torch.isnan(lse_part).any()
        assert (o_part[torch.isneginf(lse_part)] == 0).all()
        o, lse = hopper.mla_merge(o_part, lse_part)
    ro, rl = oracle(q8.double() * q_scale.double(), kv, indptr, idx, qlen, SCALE, kv_scale)
    fin = ~torch.isneginf(rl)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert torch.equal(torch.isneginf(lse), ~fin) and (o[~fin] == 0).all()
    den = ro.norm().item()
    err = (o.double() - ro).norm().item() / den if den > 0 else o.double().norm().item()
    lerr = (lse.double()[fin] - rl[fin]).abs().max().item() if fin.any() else 0.0
    assert err <= FP8Q_RTOL and lerr <= FP8Q_LSE_ATOL, (lens[:8], qlen, H, S, work_list, err, lerr)
    return err, lerr


@requires_sm90
@pytest.mark.parametrize("rows", ["16", "24", "32", "48", "64"])
def test_fp8q_grid(rows, monkeypatch):
    """The fp8 query on each CTA height (both kernels stage it as f16, exact), both grids, edge
    lengths, out-of-range indices, empty requests, more splits than tokens, small and large
    query scales."""
    import kimi_ops.kernels.sm90 as hopper
    monkeypatch.setenv(hopper.ROWS_ENV, rows)
    g = torch.Generator().manual_seed(100 + int(rows))
    worst = (0.0, 0.0)
    for H, qlen in [(12, 1), (12, 2), (16, 4), (12, 8), (96, 1), (128, 1)]:
        for lens, S, oob in [([0, 1, 2, 7, 63, 64, 65, 127, 128, 129, 300], 3, 2), ([4096, 17, 2500, 0], 8, 0),
                             ([5, 1, 0, 2], 9, 0), ([16384], 32, 0)]:
            if H >= 96 and len(lens) > 4:
                continue
            for work_list in (False, True):
                e = check_fp8q(lens, qlen, H, S, g, oob=oob, work_list=work_list)
                worst = (max(worst[0], e[0]), max(worst[1], e[1]))
    for gain in (1e-3, 40.0):
        check_fp8q([700, 33], 2, 12, 2, g, q_gain=gain, kv_scale=0.03)
    print(f"cuda fp8 q rows={rows}: worst rel L2 {worst[0]:.2e}, worst |lse| {worst[1]:.2e}")


@requires_sm90
@pytest.mark.parametrize("rows", ["16", "24", "32", "48", "64"])
def test_fp8q_power_of_two_scale_is_the_bf16_query(rows, monkeypatch):
    """The kernels stage the fp8 q as f16 (exact) and fold q_scale into the score scale, so a
    power-of-two q_scale gives the bf16 query q8 * q_scale bit for bit (both exact f16 products,
    the same sums scaled by a power of two)."""
    import kimi_ops.kernels.sm90 as hopper
    monkeypatch.setenv(hopper.ROWS_ENV, rows)
    g = torch.Generator().manual_seed(5)
    q, kv, indptr, idx = make_inputs([700, 3, 0, 2000], 2, 12, device="cuda", gen=g)
    q8, _ = quantize_per_tensor(q.float())
    p2 = torch.tensor([2.0 ** -5], device="cuda")
    a = hopper.mla_decode_splitkv(q8, kv, indptr, idx, 2, SCALE, 0.5, 4, q_scale=p2)
    b = hopper.mla_decode_splitkv((q8.float() * p2).to(torch.bfloat16), kv, indptr, idx, 2, SCALE, 0.5, 4)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@requires_sm90
def test_fp8q_graph_replays_a_new_scale():
    """mla_decode on an fp8 q captured in a CUDA graph, q8 and q_scale rewritten in place between
    replays: replay == eager, within the contract (the kernels read q_scale on the device)."""
    import kimi_ops.kernels.sm90 as hopper
    g = torch.Generator().manual_seed(9)
    q, kv, indptr, idx = make_inputs([700, 3, 0, 2000], 4, 12, device="cuda", gen=g)
    q8, q_scale = quantize_per_tensor(q.float())

    def step():
        return hopper.mla_decode(q8, kv, indptr, idx, 4, SCALE, 0.5, 4, q_scale=q_scale)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_g, lse_g = step()
    for gain in (1.0, 37.0, 1e-2):
        x8, s = quantize_per_tensor(torch.randn(q.shape, generator=g).cuda() * gain)
        q8.copy_(x8)
        q_scale.copy_(s)
        graph.replay()
        o_e, lse_e = step()
        torch.cuda.synchronize()
        assert torch.equal(o_g, o_e) and torch.equal(lse_g, lse_e)
        ro, rl = oracle(q8.double() * q_scale.double(), kv, indptr, idx, 4, SCALE, 0.5)
        fin = ~torch.isneginf(rl)
        assert ((o_g.double() - ro).norm() / ro.norm()).item() <= FP8Q_RTOL
        assert (lse_g.double()[fin] - rl[fin]).abs().max().item() <= FP8Q_LSE_ATOL
