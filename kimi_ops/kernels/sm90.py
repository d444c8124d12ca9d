"""Host side of the Hopper (sm_90a) kernels in ``kimi_ops._C`` (``csrc/sm90/``: a header a kernel,
the C++ launchers in ``csrc/sm90/mla_decode_sm90.cu``, the registration in ``csrc/registration.cpp``).

The ``cuda`` backend of :mod:`kimi_ops.dispatch`: ``mla_decode_splitkv`` (M1c) and
``mla_merge`` (M1b) as CUDA C++ kernels, registered as the private ops
``torch.ops.kimi_ops._mla_decode_splitkv_sm90`` / ``_mla_merge_sm90`` (CUDA key), and
``mla_decode`` (M1c + M1b on the work-list grid) as ``_mla_decode_sm90``. The public ops
call these functions after their own host checks.

Numerics: the fp8 cache bytes become f16 exactly in registers; the bf16 query is scaled per
row by 2^k into [2^14, 2^15) and held as f16 (exact); S and O accumulate in f32 on f16
tensor-core MMAs (``mma.sync`` for 16-row CTAs, token-major ``wgmma`` for 24-64 rows); P is
rounded to f16, against a running max that moves only when a tile raises it by more than 2^8
(lazy rescaling: P <= 2^8). See the .cu file's header for the tiling and the byte layouts.

An fp8 query (``torch.float8_e4m3fn`` with ``q_scale``, a float32 [1] device tensor, issue 28):
the kernels read q_scale on the device into the score scale (a CUDA graph replays a new scale)
and stage the fp8 q as f16 (exact), so the MMAs are the bf16 query's: sm_90 emulates mma.sync
e4m3 (f16 MMAs plus conversions of both operands), and an e4m3 wgmma QK misses the lse contract
(measured: csrc/sm90/decode_token_major.cuh's header). An ``e4m3fnuz`` cache or query (gfx942's
formats) has no kernel here: it runs the Triton kernel (:func:`_triton_serves`).
"""
import functools
import os

import torch

from ..device import device_index, multiprocessor_count

LOG2E = 1.4426950408889634
STAGES_ENV = "KIMI_OPS_SM90_STAGES"  # K-ring depth override (MAX_STAGES by CTA height), for tuning
ROWS_ENV = "KIMI_OPS_SM90_ROWS"  # CTA rows override (16, 24, 32, 48, 64), for tuning
BALANCE_WAVES_ENV = "KIMI_OPS_SM90_BALANCE_WAVES"  # waves of CTAs the balanced chunk length aims at (1..8)
WORK_LIST_ENV = "KIMI_OPS_SM90_WORK_LIST"  # "0": mla_decode on the (split, request) grid instead
MAX_SPLITS_ENV = "KIMI_OPS_SM90_MAX_SPLITS"  # the default split cap (MAX_SPLITS) override, for tuning
MAX_SPLITS = 256
MAX_GRID_Y = 65535


def _ops():
    import kimi_ops._C  # noqa: F401  (registers the private ops)
    return torch.ops.kimi_ops


def rows_per_cta(rows_per_request: int) -> int:
    """Query rows one CTA takes: 16 (``splitkv_kernel``, 4 compute warps and a producer warp) or
    24, 32, 48, 64 (``splitkv_tm_kernel``, 8 warps; the MMAs take tokens as M and these rows as N).

    Cost model over 16, 32, 48, 64: the padded rows computed plus half a 16-row tile for each CTA
    of a request (each re-reads the request's KV, from L2 after the first); ties go to the bigger
    CTA. Where that picks one 32-row CTA for a request of 17-24 rows (12 heads x qlen 2), a 24-row
    CTA instead (wgmma n24: a quarter fewer MMAs than n32 with 8 padded rows; H100, in-process,
    outputs bit-equal: H12 qlen 2 2.6-5.4% faster at batch 1-128 and 1k-32k tokens, H24 qlen 1
    4.0-4.4%); every other choice is the model's (24-row CTAs for 36 or 72 rows, two or three a
    request, measured 46-92% slower than 48-row ones: each CTA reads and converts the whole KV).
    KIMI_OPS_SM90_ROWS forces it."""
    env = os.environ.get(ROWS_ENV)
    if env:
        if env not in ("16", "24", "32", "48", "64"):
            raise ValueError(f"{ROWS_ENV} must be 16, 24, 32, 48 or 64, got {env}")
        return int(env)

    def cost(rows):
        ctas = -(-rows_per_request // rows)
        return ctas * rows + 8 * ctas
    rows = min((64, 48, 32, 16), key=cost)
    return 24 if rows == 32 and rows_per_request <= 24 else rows


DEFAULT_STAGES = {16: 2, 24: 2, 32: 2, 48: 2, 64: 2}
MAX_STAGES = {16: 4, 24: 2, 32: 2, 48: 2, 64: 3}  # 24 / 32 / 48 rows: two stages of 128 tokens (74 KB each)
# by shared memory: (16, 2) 97 KB, two a SM; every other (rows, stages) takes over 114 KB: 1 (the
# least, 24 rows: TokenMajorSmem<3, 2, 128> = kv 2 x 128 x 592 + q 24 x 576 x 2 + p 24 x 128 x 2
# + red 8 x 24 x 4 + 4 row arrays of 24 x 4 + 2 mbarriers = 186512 bytes, 182 KB)
CTAS_PER_SM = {(16, 2): 2}


def ring_stages(rows: int) -> int:
    """Shared-memory stages in the CTA's K ring: 64 tokens (37 KB) each, 128 (74 KB) for 24 / 32 / 48 rows."""
    env = os.environ.get(STAGES_ENV)
    if env:
        stages = int(env)
        if not 2 <= stages <= MAX_STAGES[rows]:
            allowed = "2" if MAX_STAGES[rows] == 2 else f"2..{MAX_STAGES[rows]}"
            raise ValueError(f"{STAGES_ENV} must be {allowed} for {rows}-row CTAs, got {stages}")
        return stages
    return DEFAULT_STAGES[rows]


def balance_waves() -> int:
    """How many waves of CTA slots the balanced chunk length aims at (KIMI_OPS_SM90_BALANCE_WAVES,
    default 1). More waves cut a variable-length batch's long requests into more, shorter chunks
    (closer to even per slot) but need more splits (``suggest_num_splits`` scales with it)."""
    return _env_int(BALANCE_WAVES_ENV, 1, 1, 8)


def _env_int(name: str, default: int, lo: int, hi: int) -> int:
    """A tuning switch's integer: ``default`` when unset or empty, else it must be in lo..hi."""
    env = os.environ.get(name)
    if not env:
        return default
    value = int(env)
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be {lo}..{hi}, got {value}")
    return value


def _triton_serves(q, kv_rows) -> bool:
    """Inputs the csrc kernels do not take, served by the Triton kernel: an e4m3fnuz cache or
    query (the kernels take a bf16 q, or an e4m3fn q with q_scale, on an e4m3fn cache)."""
    return kv_rows.dtype != torch.float8_e4m3fn or q.dtype not in (torch.bfloat16, torch.float8_e4m3fn)


def mla_decode_splitkv(q, kv_rows, kv_indptr, kv_indices, qlen: int, scale: float, kv_scale: float,
                       num_splits: int, seq_lens=None, dcp_rank: int = 0, dcp_world_size: int = 1,
                       zero_empty: bool = True, q_scale=None, constant_kv: bool = False):
    """M1c. q [T, H, 576] bf16 (or e4m3fn with q_scale [1] f32), kv_rows [N, 576] fp8 -> (o_part
    [S, T, H, 512] bf16, lse_part [S, T, H] f32).

    A request of n tokens is cut into chunks of max(ceil(n / S), all tokens / the CTAs of
    :func:`balance_waves` waves) rounded up to 64, at most S of them (later splits may be empty:
    o = 0, lse = -inf). The chunk length is computed on the device from kv_indptr, so a CUDA
    graph replayed on a new mix of lengths stays balanced. ``zero_empty=False`` lets an empty
    split leave its o unwritten (for a caller whose merge never reads a -inf split's o); with
    one split o is always written. ``constant_kv``: :func:`mla_decode`'s."""
    if _triton_serves(q, kv_rows):
        from .attention import mla_decode_splitkv as triton_splitkv
        return triton_splitkv(q, kv_rows, kv_indptr, kv_indices, qlen, scale, kv_scale, num_splits,
                              seq_lens, dcp_rank, dcp_world_size, q_scale=q_scale)
    balance = balance_ctas(q, kv_indptr, kv_indices, qlen)
    return _ops()._mla_decode_splitkv_sm90(
        *_kernel_args(q, kv_rows, kv_indptr, kv_indices, qlen, scale, kv_scale, num_splits, seq_lens, dcp_rank,
                      dcp_world_size, balance), zero_empty, q_scale, constant_kv)


def _kernel_args(q, kv_rows, kv_indptr, kv_indices, qlen, scale, kv_scale, num_splits, seq_lens, dcp_rank,
                 dcp_world_size, balance):
    """The arguments _mla_decode_splitkv_sm90 and _mla_decode_sm90 share (the CTA shape from qlen x H)."""
    rows = rows_per_cta(qlen * q.shape[1])
    return (q, kv_rows, kv_indptr, kv_indices, seq_lens, qlen, float(scale) * float(kv_scale) * LOG2E,
            float(kv_scale), num_splits, dcp_rank, dcp_world_size, rows, ring_stages(rows), balance)


def balance_ctas(q, kv_indptr, kv_indices, qlen: int) -> int:
    """CTAs the balanced chunk length aims at: :func:`balance_waves` x requests x
    :func:`one_wave_splits` (a chunk holds at least all tokens / this many)."""
    num_requests = kv_indptr.shape[0] - 1
    return balance_waves() * num_requests * one_wave_splits(
        num_requests, qlen, q.shape[1], kv_indices.shape[0], _multiprocessor_count(q.device))


def work_list_items(num_requests: int, num_splits: int, balance: int) -> int:
    """Work items the work-list grid launches (csrc: work_list_items): an upper bound on the
    requests' used splits, < balance + requests, <= requests x num_splits."""
    by_splits = num_requests * num_splits
    return min(by_splits, balance + num_requests) if balance > 0 else by_splits


def work_list_enabled() -> bool:
    return os.environ.get(WORK_LIST_ENV, "1") != "0"


def mla_decode(q, kv_rows, kv_indptr, kv_indices, qlen: int, scale: float, kv_scale: float,
               num_splits, seq_lens=None, dcp_rank: int = 0, dcp_world_size: int = 1, q_scale=None,
               constant_kv: bool = False):
    """M1c + M1b: q [T, H, 576] bf16 (or e4m3fn with q_scale), kv_rows [N, 576] fp8 -> (o [T, H, 512] bf16,
    lse [T, H] f32).

    The split kernel runs on a work-list grid (``_mla_decode_sm90``): one CTA per (row group,
    non-empty split), whole chunks launched first and partial ones by length after, found on the
    device from kv_indptr, so no CTA is spent on an empty split, the last CTAs to start are short
    ones, and a CUDA graph serves every mix of lengths. A request of one split writes o / lse
    directly; the others go through private partials [W, qlen, H, 512] (W =
    :func:`work_list_items`) and the merge. Where the grid holds at least 1.5 CTAs an SM, a
    request's last split of at most 64 tokens is taken by the split before it (csrc:
    tail_fold_tokens).
    ``num_splits`` caps a request's splits (None: :func:`_split_cap`'s one per 128 tokens of the
    average request, or one a 64-token tile where those CTAs fit one an SM, at most
    :func:`max_splits`; more only costs partials memory).
    With one split, more than 65535 work items, a non-e4m3fn cache or KIMI_OPS_SM90_WORK_LIST=0,
    the (split, request) grid runs instead, its empty splits' o unwritten.

    ``constant_kv`` (the caller's promise that the kernel queued just before this call writes
    neither kv_rows nor kv_indptr / kv_indices / seq_lens): the split kernel is launched with
    programmatic dependent launch and its CTAs find their work items and start copying their
    first tiles before they wait for that kernel (q is read after the wait)."""
    num_requests = kv_indptr.shape[0] - 1
    if num_requests <= 0:
        num_splits = 1
    elif num_splits is None and _triton_serves(q, kv_rows):
        from .attention import suggest_num_splits as triton_splits  # the kernel that will run
        num_splits = triton_splits(num_requests, qlen, q.shape[1], kv_indices.shape[0],
                                   _multiprocessor_count(q.device))
    elif num_splits is None:
        num_splits = (_split_cap(num_requests, kv_indices.shape[0], qlen, q.shape[1], _multiprocessor_count(q.device))
                      if work_list_enabled() else
                      suggest_num_splits(num_requests, qlen, q.shape[1], kv_indices.shape[0],
                                         _multiprocessor_count(q.device)))
    balance = balance_ctas(q, kv_indptr, kv_indices, qlen) if num_requests > 0 else 0
    work_list = (not _triton_serves(q, kv_rows) and num_splits > 1 and work_list_enabled()
                 and work_list_items(num_requests, num_splits, balance) <= MAX_GRID_Y)
    if work_list:
        return _ops()._mla_decode_sm90(*_kernel_args(q, kv_rows, kv_indptr, kv_indices, qlen, scale, kv_scale,
                                                     num_splits, seq_lens, dcp_rank, dcp_world_size, balance),
                                       q_scale, constant_kv)
    o_part, lse_part = mla_decode_splitkv(q, kv_rows, kv_indptr, kv_indices, qlen, scale, kv_scale, num_splits,
                                          seq_lens, dcp_rank, dcp_world_size, zero_empty=False, q_scale=q_scale,
                                          constant_kv=constant_kv)
    if num_splits == 1:
        return o_part[0], lse_part[0]
    return mla_merge(o_part, lse_part)


def _multiprocessor_count(device) -> int:
    return multiprocessor_count(device_index(device))


def mla_merge(o_part, lse_part):
    """M1b. o_part [S, T, H, 512] bf16, lse_part [S, T, H] f32 -> (o [T, H, 512] bf16, lse [T, H] f32)."""
    return _ops()._mla_merge_sm90(o_part, lse_part)


def one_wave_splits(num_requests: int, qlen: int, num_heads: int, num_tokens: int, num_sms: int = 132) -> int:
    """Splits a request of average length takes so that the CTAs (requests x row groups x
    used splits) fill the device's CTA slots in waves at least 90% full (else the fullest), at
    most :func:`_split_cap`. The kernel sizes every split to at least (all tokens / (requests x
    this)), rounded up to whole 64-token tiles: a uniform batch
    uses ceil(n / that chunk) splits a request (the fullness is counted on those, after the
    rounding), a longer request proportionally more."""
    if num_requests <= 0:
        return 1
    return _one_wave_splits(num_requests, qlen, num_heads, num_sms, ring_stages(rows_per_cta(qlen * num_heads)),
                            _split_cap(num_requests, num_tokens, qlen, num_heads, num_sms),
                            max(1, num_tokens // num_requests))


TILE_TOKENS = 64  # the kernels round a split's chunk up to whole 64-token tiles (csrc: split_chunk)


def used_splits(avg_tokens: int, splits: int) -> int:
    """Splits a request of avg_tokens uses when the balanced chunk is ceil(avg / splits) rounded up
    to whole tiles (csrc/sm90/work_list.cuh, split_chunk / used_splits)."""
    per_split = -(-avg_tokens // splits)                    # ceil(avg / splits)
    chunk = -(-per_split // TILE_TOKENS) * TILE_TOKENS     # up to whole tiles
    return -(-avg_tokens // chunk)


@functools.lru_cache(maxsize=1024)
def _one_wave_splits(num_requests, qlen, num_heads, num_sms, stages, cap, avg_tokens):
    # cached: every eager mla_decode call asks (once for num_splits, once for the balance)
    slots, ctas = _slots_and_ctas_per_split(num_requests, qlen, num_heads, num_sms, stages)

    def fullness(splits):
        total = ctas * used_splits(avg_tokens, splits)
        return total / (-(-total // slots) * slots)

    return next((s for s in range(1, cap + 1) if fullness(s) >= 0.9),
                max(range(1, cap + 1), key=lambda s: (fullness(s), -s)))


def max_splits() -> int:
    """A request's split cap when none is given: MAX_SPLITS, or KIMI_OPS_SM90_MAX_SPLITS (1..4096)."""
    return _env_int(MAX_SPLITS_ENV, MAX_SPLITS, 1, 4096)


def _split_cap(num_requests: int, num_tokens: int, qlen: int, num_heads: int, num_sms: int) -> int:
    """A request's most splits: one per 128 tokens, or per 64 (one tile) where 16-row CTAs of
    64 tokens still fit one an SM (at batch 1 a CTA's second tile costs more than the merge of
    twice the partials: H12 B1 512-8192 tokens 1.1-3.0 us faster on the H200, docs/perf-history.md
    "Session 29"; at B2 8k, two an SM, 16.0 -> 17.4 slower), at most :func:`max_splits`. Both
    rounded up: at B2 8193 tokens, 64 splits (rounded down) forced chunks of 192 tokens, 86 CTAs
    (18.1 us), 65 take chunks of 128 (16.6; B8 1025: 17.8 -> 15.5; H100, perf-history.md "Session 62")."""
    avg = num_tokens // num_requests
    tiles = -(-avg // TILE_TOKENS)  # 200 tokens take 4 splits, 12.0 us (2 used: 14.1)
    one_a_tile = rows_per_cta(qlen * num_heads) == 16 and num_requests * tiles <= num_sms
    return int(max(1, min(tiles if one_a_tile else -(-avg // (2 * TILE_TOKENS)), max_splits())))


def _slots_and_ctas_per_split(num_requests: int, qlen: int, num_heads: int, num_sms: int, stages: int):
    """(CTAs the device runs at once, CTAs of one split over all requests)."""
    rows = rows_per_cta(qlen * num_heads)
    return (num_sms * CTAS_PER_SM.get((rows, stages), 1), num_requests * -(-qlen * num_heads // rows))


def suggest_num_splits(num_requests: int, qlen: int, num_heads: int, num_tokens: int,
                       num_sms: int = 132) -> int:
    """A split count from shapes only (never device data): :func:`one_wave_splits` plus
    headroom for requests longer than the average (the kernel gives them more splits of the
    balanced length). Headroom costs the empty splits of average requests: their zeros (at most
    2.5% of the KV bytes) and their CTAs (at most two waves of CTAs that exit at once). Both
    terms scale with :func:`balance_waves`."""
    if num_requests <= 0:
        return 1
    slots, ctas_per_split = _slots_and_ctas_per_split(num_requests, qlen, num_heads, num_sms,
                                                      ring_stages(rows_per_cta(qlen * num_heads)))
    by_bytes = int(0.025 * (num_tokens // num_requests) * 576 // (qlen * num_heads * 1024))
    by_ctas = 2 * slots // ctas_per_split
    waves = balance_waves()
    return int(min(_split_cap(num_requests, num_tokens, qlen, num_heads, num_sms),
                   waves * one_wave_splits(num_requests, qlen, num_heads, num_tokens, num_sms)
                   + waves * min(by_bytes, by_ctas)))
