"""Host-side argument checks shared by every op's fake and real implementation.

Each check reads only shapes, dtypes, devices and strides (never device data), so
it runs unchanged under FakeTensor / torch.compile and inside CUDA-graph capture.
A failed check raises ``ValueError`` naming the op, the argument, what was
expected and what came. Device-data preconditions (indices in range, indptr
monotone) are the opt-in validator's job: :mod:`kimi_ops.validate`.
"""

import math
from collections.abc import Sequence

import torch

from .formats import FP8_KV_DTYPES, KV_LORA_RANK, KV_ROW, MXFP4_BLOCK, ROPE_DIM


def fail(op: str, arg: str, expected: str, got: object) -> None:
    raise ValueError(f"kimi_ops.{op}: {arg} must be {expected}, got {got}")


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)} dtype {t.dtype} on {t.device}"


def check_tensor(op: str, arg: str, t, *, ndim: int | None = None,
                 dtypes: Sequence[torch.dtype] | None = None, what: str = "") -> None:
    if not isinstance(t, torch.Tensor):
        fail(op, arg, "a tensor", type(t).__name__)
    if (ndim is not None and t.dim() != ndim) or (dtypes is not None and t.dtype not in dtypes):
        fail(op, arg, what, _describe(t))


def check_same_device(op: str, **tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        fail(op, "all tensors", "on one device", devices)


def check_kv_cache(op: str, kv_cache) -> None:
    check_tensor(op, "kv_cache", kv_cache, dtypes=FP8_KV_DTYPES,
                 what=f"an fp8 (e4m3fn or e4m3fnuz) tensor whose last dim is {KV_ROW}")
    if kv_cache.dim() < 2 or kv_cache.shape[-1] != KV_ROW:
        fail(op, "kv_cache", f"an fp8 tensor whose last dim is {KV_ROW} ([N, {KV_ROW}], "
             f"[blocks, block_size, {KV_ROW}] or [blocks, block_size, 1, {KV_ROW}])",
             _describe(kv_cache))
    if not kv_cache.is_contiguous():
        fail(op, "kv_cache", "contiguous (it is read as flat token rows)",
             f"strides {kv_cache.stride()}")


def check_decode_args(op: str, q, kv_cache, kv_indptr, kv_indices, qlen: int, num_splits: int | None,
                      seq_lens=None, dcp_rank: int = 0, dcp_world_size: int = 1) -> None:
    """q [T, H, 576] bf16, fp8 cache, int32 CSR (indptr [R+1]), T = R * qlen; DCP rank < world."""
    check_tensor(op, "q", q, ndim=3, dtypes=Q_DTYPES, what=f"a [T, H, {KV_ROW}] bfloat16 tensor {Q_FP8_NOTE}")
    if q.shape[2] != KV_ROW or q.shape[1] < 1:
        fail(op, "q", f"a [T, H, {KV_ROW}] bfloat16 tensor {Q_FP8_NOTE} with H >= 1", _describe(q))
    if q.stride(2) != 1:
        fail(op, "q", "contiguous in its last dim", f"strides {q.stride()}")
    check_kv_cache(op, kv_cache)
    check_tensor(op, "kv_indptr", kv_indptr, ndim=1, dtypes=(torch.int32,), what="a 1-D int32 tensor [R + 1]")
    if kv_indptr.shape[0] < 1:
        fail(op, "kv_indptr", "a 1-D int32 tensor [R + 1] with at least one entry", _describe(kv_indptr))
    check_tensor(op, "kv_indices", kv_indices, ndim=1, dtypes=(torch.int32,), what="a 1-D int32 tensor")
    check_same_device(op, q=q, kv_cache=kv_cache, kv_indptr=kv_indptr, kv_indices=kv_indices)
    if not isinstance(qlen, int) or qlen < 1:
        fail(op, "qlen", "an int >= 1", qlen)
    num_requests = kv_indptr.shape[0] - 1
    if q.shape[0] != num_requests * qlen:
        fail(op, "q.shape[0]", f"R * qlen = {num_requests} * {qlen} (R = len(kv_indptr) - 1)", q.shape[0])
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        fail(op, "num_splits", "an int >= 1", num_splits)
    if dcp_world_size < 1 or not 0 <= dcp_rank < dcp_world_size:
        fail(op, "dcp_rank, dcp_world_size", "0 <= dcp_rank < dcp_world_size", (dcp_rank, dcp_world_size))
    if seq_lens is None:
        if dcp_world_size > 1:
            fail(op, "seq_lens", "the global lengths [R] int32 when dcp_world_size > 1", None)
    else:
        check_tensor(op, "seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), what="a [R] int32 tensor")
        if seq_lens.shape[0] != num_requests:
            fail(op, "seq_lens", f"a [{num_requests}] int32 tensor (R = len(kv_indptr) - 1)", _describe(seq_lens))
        check_same_device(op, q=q, seq_lens=seq_lens)


# --- index layout, grid limits, finite scales (issue 30) --------------------------------------
# Separate from check_decode_args / check_cache_write_args: ops.py calls them right after those.

MAX_GRID_DIM = 65535
"""A CUDA grid's y / z dimension limit. The Triton split-KV grid is (row blocks, splits,
requests), so R and num_splits above it cannot launch; every backend refuses them alike."""


def check_index_layout(op: str, **tensors) -> None:
    """Index tensors (kv_indptr, kv_indices, seq_lens, slot_mapping) must be contiguous: every
    kernel reads them as flat arrays from their data pointer. ``None`` entries are skipped."""
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and not t.is_contiguous():
            fail(op, name, "contiguous (the kernels read it as a flat array from its data pointer; "
                 "pass .contiguous())", f"a strided view: shape {tuple(t.shape)} strides {t.stride()}")


def check_grid_limits(op: str, kv_indptr, num_splits) -> None:
    """R = len(kv_indptr) - 1 and num_splits at most :data:`MAX_GRID_DIM` (None: the host picks)."""
    num_requests = kv_indptr.shape[0] - 1
    if num_requests > MAX_GRID_DIM:
        fail(op, "R = len(kv_indptr) - 1 (the number of requests)",
             f"at most {MAX_GRID_DIM} (a CUDA grid dimension's limit; split the batch)", num_requests)
    if num_splits is not None and num_splits > MAX_GRID_DIM:
        fail(op, "num_splits", f"at most {MAX_GRID_DIM} (a CUDA grid dimension's limit)", num_splits)


def check_finite_scales(op: str, **scales) -> None:
    """Each scale a finite number: NaN or +-inf would make NaN outputs (or, in mla_cache_write,
    NaN bytes in a cache every request shares). Zero and negative scales are well defined.
    Symbolic floats (torch.compile) are not inspected, so no guard is added."""
    for name, value in scales.items():
        if isinstance(value, (int, float)) and not math.isfinite(value):
            fail(op, name, "a finite float (zero and negative are allowed)", value)


def check_decode_contract(op: str, kv_indptr, kv_indices, seq_lens, num_splits, scale, kv_scale) -> None:
    """mla_decode_splitkv / mla_decode: index layout, grid limits, finite scales."""
    check_index_layout(op, kv_indptr=kv_indptr, kv_indices=kv_indices, seq_lens=seq_lens)
    check_grid_limits(op, kv_indptr, num_splits)
    check_finite_scales(op, scale=scale, kv_scale=kv_scale)


def check_cache_write_contract(op: str, slot_mapping, kv_scale) -> None:
    """mla_cache_write: slot_mapping contiguous; kv_scale finite and non-zero (rows are stored
    as ``fp8(x / kv_scale)``: zero would store +-inf saturated and 0 / 0 = NaN bytes)."""
    check_index_layout(op, slot_mapping=slot_mapping)
    check_finite_scales(op, kv_scale=kv_scale)
    if isinstance(kv_scale, (int, float)) and kv_scale == 0:
        fail(op, "kv_scale", "finite and non-zero (rows are stored as fp8(x / kv_scale))", kv_scale)


Q_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
"""fp8 query dtypes (issue 28): e4m3fn with any cache, e4m3fnuz only with an e4m3fnuz cache."""
Q_DTYPES = (torch.bfloat16,) + Q_FP8_DTYPES
Q_FP8_NOTE = "(or fp8 e4m3fn / e4m3fnuz with q_scale)"


def check_q_scale(op: str, q, kv_cache, q_scale) -> None:
    """The fp8 query's scale (real q = fp8 q x q_scale): with a float8 ``q`` (e4m3fn; e4m3fnuz
    only with an e4m3fnuz cache) ``q_scale`` must be a float32 tensor of one element (any
    shape, e.g. ``[]`` or ``[1]``) on q's device; with a bf16 ``q`` it must be None. Shapes,
    dtypes and devices only: its value is read on the device (a CUDA graph replays a new one).
    Run after :func:`check_decode_args` (which checks q's dtype is one of :data:`Q_DTYPES`)."""
    if q.dtype in Q_FP8_DTYPES:
        if q.dtype == torch.float8_e4m3fnuz and kv_cache.dtype != torch.float8_e4m3fnuz:
            fail(op, "q", f"float8_e4m3fn with a {kv_cache.dtype} cache (an e4m3fnuz query needs an "
                 "e4m3fnuz cache)", _describe(q))
        if q_scale is None:
            fail(op, "q_scale", f"a float32 tensor of one element (q's dequantization scale) when q is {q.dtype}",
                 None)
        check_scale_tensor(op, q_scale, q.device)
    elif q_scale is not None:
        fail(op, "q_scale", f"None when q is {q.dtype} (q_scale only goes with an fp8 q)",
             _describe(q_scale) if isinstance(q_scale, torch.Tensor) else q_scale)


def check_scale_tensor(op: str, q_scale, device) -> None:
    """``q_scale``: a float32 tensor of one element (any shape, e.g. ``[]`` or ``[1]``) on ``device``."""
    check_tensor(op, "q_scale", q_scale, dtypes=(torch.float32,),
                 what=f"a float32 tensor of one element on q's device ({device})")
    if q_scale.numel() != 1:
        fail(op, "q_scale", "a float32 tensor of one element (one per-tensor scale)", _describe(q_scale))
    if q_scale.device != device:
        fail(op, "q_scale", f"on q's device ({device})", _describe(q_scale))


def check_query_out_dtype(op: str, dtype) -> None:
    """An fp8 query dtype: float8_e4m3fn or float8_e4m3fnuz."""
    if dtype not in Q_FP8_DTYPES:
        fail(op, "out_dtype" if op == "mla_query" else "dtype",
             "torch.float8_e4m3fn or torch.float8_e4m3fnuz (or None / torch.bfloat16 for mla_query's bf16 query)",
             dtype)


def check_merge_args(op: str, o_part, lse_part) -> None:
    """o_part [S, T, H, 512] bf16, lse_part [S, T, H] f32."""
    check_tensor(op, "o_part", o_part, ndim=4, dtypes=(torch.bfloat16,),
                 what=f"a [S, T, H, {KV_LORA_RANK}] bfloat16 tensor")
    if o_part.shape[3] != KV_LORA_RANK or o_part.shape[0] < 1:
        fail(op, "o_part", f"a [S, T, H, {KV_LORA_RANK}] bfloat16 tensor with S >= 1", _describe(o_part))
    check_tensor(op, "lse_part", lse_part, ndim=3, dtypes=(torch.float32,), what="a [S, T, H] float32 tensor")
    if tuple(lse_part.shape) != tuple(o_part.shape[:3]):
        fail(op, "lse_part", f"shape {tuple(o_part.shape[:3])} (o_part's [S, T, H])", _describe(lse_part))
    check_same_device(op, o_part=o_part, lse_part=lse_part)


def check_cache_write_args(op: str, kv_c, k_pe, kv_cache, slot_mapping) -> None:
    """kv_c [T, 512], k_pe [T, 64] (bf16/f16/f32), fp8 cache, slot_mapping [T] int32/int64."""
    floats = (torch.bfloat16, torch.float16, torch.float32)
    check_tensor(op, "kv_c", kv_c, ndim=2, dtypes=floats, what=f"a [T, {KV_LORA_RANK}] bf16/f16/f32 tensor")
    if kv_c.shape[1] != KV_LORA_RANK:
        fail(op, "kv_c", f"a [T, {KV_LORA_RANK}] bf16/f16/f32 tensor", _describe(kv_c))
    check_tensor(op, "k_pe", k_pe, ndim=2, dtypes=floats, what=f"a [T, {ROPE_DIM}] bf16/f16/f32 tensor")
    if tuple(k_pe.shape) != (kv_c.shape[0], ROPE_DIM):
        fail(op, "k_pe", f"shape ({kv_c.shape[0]}, {ROPE_DIM}) (kv_c's T)", _describe(k_pe))
    check_kv_cache(op, kv_cache)
    check_tensor(op, "slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int32, torch.int64),
                 what="a 1-D int32/int64 tensor [T]")
    if slot_mapping.shape[0] != kv_c.shape[0]:
        fail(op, "slot_mapping", f"length {kv_c.shape[0]} (kv_c's T)", _describe(slot_mapping))
    if kv_c.stride(1) != 1 or k_pe.stride(1) != 1:
        fail(op, "kv_c and k_pe", "contiguous in their last dim", (kv_c.stride(), k_pe.stride()))
    check_same_device(op, kv_c=kv_c, k_pe=k_pe, kv_cache=kv_cache, slot_mapping=slot_mapping)


def check_mxfp4_weight(op: str, w_packed, w_scale, *, packed_name: str = "w_packed",
                       scale_name: str = "w_scale") -> None:
    """w_packed [..., N, K/2] uint8, w_scale [..., N, K/32] uint8 or float8_e8m0fnu."""
    check_tensor(op, packed_name, w_packed, dtypes=(torch.uint8,), what="a uint8 tensor [..., N, K/2]")
    if w_packed.dim() < 1 or w_packed.shape[-1] % (MXFP4_BLOCK // 2) != 0:
        fail(op, packed_name, f"a uint8 tensor [..., N, K/2] with K a multiple of {MXFP4_BLOCK}",
             _describe(w_packed))
    scale_dtypes = (torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8))
    expected = tuple(w_packed.shape[:-1]) + (w_packed.shape[-1] // (MXFP4_BLOCK // 2),)
    check_tensor(op, scale_name, w_scale, dtypes=scale_dtypes,
                 what=f"a uint8 or float8_e8m0fnu tensor of shape {expected}")
    if tuple(w_scale.shape) != expected:
        fail(op, scale_name, f"shape {expected} (one scale per {MXFP4_BLOCK} elements)", _describe(w_scale))
    check_same_device(op, **{packed_name: w_packed, scale_name: w_scale})


def check_mxfp4_quantize_args(op: str, w) -> None:
    check_tensor(op, "w", w, dtypes=(torch.bfloat16, torch.float16, torch.float32),
                 what=f"a bf16/f16/f32 tensor whose last dim is a multiple of {MXFP4_BLOCK}")
    if w.dim() < 1 or w.shape[-1] % MXFP4_BLOCK != 0 or w.shape[-1] == 0:
        fail(op, "w", f"a bf16/f16/f32 tensor whose last dim is a positive multiple of {MXFP4_BLOCK}",
             _describe(w))


def check_bmm_args(op: str, x, w_packed, w_scale) -> None:
    """x [B, M, K] bf16 against w [B, N, K] in MXFP4."""
    check_tensor(op, "x", x, ndim=3, dtypes=(torch.bfloat16,), what="a [B, M, K] bfloat16 tensor")
    check_tensor(op, "w_packed", w_packed, ndim=3, dtypes=(torch.uint8,), what="a [B, N, K/2] uint8 tensor")
    check_mxfp4_weight(op, w_packed, w_scale)
    if w_packed.shape[0] != x.shape[0] or w_packed.shape[2] * 2 != x.shape[2]:
        fail(op, "w_packed", f"shape ({x.shape[0]}, N, {x.shape[2] // 2}) for x {tuple(x.shape)}",
             _describe(w_packed))
    check_same_device(op, x=x, w_packed=w_packed)


def check_head_weight(op: str, name: str, w, scale_name: str, scale, whose: str, *, bf16_dims, mxfp4_dims) -> None:
    """A per-head weight (W_UK, W_UV): bf16 of ``bf16_dims``, or with ``scale`` MXFP4 uint8 of
    ``mxfp4_dims``; each dims a tuple of (letter, size), size None where any size goes, the
    others ``whose`` dims (an odd D gives D/2 = x.5, which no shape matches)."""
    dims = bf16_dims if scale is None else mxfp4_dims
    letters = "[" + ", ".join(letter for letter, _ in dims) + "]"
    kind = "a bf16" if scale is None else "an MXFP4 uint8"
    what = (f"a bf16 {letters} tensor (or uint8 MXFP4 with {scale_name})" if scale is None
            else f"an MXFP4 uint8 {letters} tensor (with {scale_name} given)")
    check_tensor(op, name, w, ndim=len(dims), dtypes=(torch.bfloat16 if scale is None else torch.uint8,), what=what)
    if scale is not None:
        check_mxfp4_weight(op, w, scale, packed_name=name, scale_name=scale_name)
    if any(size is not None and w.shape[i] != size for i, (_, size) in enumerate(dims)):
        shown = [letter if size is None else str(int(size)) if float(size).is_integer() else str(size)
                 for letter, size in dims]
        want = "[" + ", ".join(shown) + "]"
        fixed = ", ".join(letter for letter, size in dims if size is not None)
        fail(op, name, f"{kind} {want} tensor ({whose} {fixed})", _describe(w))


def check_norm_cache_write_args(op: str, q_c, kv_c, k_pe, q_norm_weight, kv_norm_weight, g, eps) -> None:
    """q_c [T, Q], kv_c [T, 512], k_pe [T, 64], g [T, G] bf16 with unit last stride; the norm
    weights [Q] / [512] bf16 / f16 / f32 contiguous; eps finite and >= 0."""
    check_tensor(op, "q_c", q_c, ndim=2, dtypes=(torch.bfloat16,), what="a [T, Q] bfloat16 tensor")
    tokens = q_c.shape[0]
    for name, x, cols in (("kv_c", kv_c, KV_LORA_RANK), ("k_pe", k_pe, ROPE_DIM), ("g", g, None)):
        if x is None:
            continue
        shape = f"[{tokens}, {cols if cols else 'G'}]"
        check_tensor(op, name, x, ndim=2, dtypes=(torch.bfloat16,), what=f"a {shape} bfloat16 tensor")
        if x.shape[0] != tokens or (cols is not None and x.shape[1] != cols):
            fail(op, name, f"a {shape} bfloat16 tensor (q_c's T)", _describe(x))
    for name, x in (("q_c", q_c), ("kv_c", kv_c), ("k_pe", k_pe), ("g", g)):
        if x is not None and x.shape[1] > 1 and x.stride(1) != 1:
            fail(op, name, "a tensor contiguous along its last dim", f"strides {tuple(x.stride())}")
    floats = (torch.bfloat16, torch.float16, torch.float32)
    for name, w, n in (("q_norm_weight", q_norm_weight, q_c.shape[1]), ("kv_norm_weight", kv_norm_weight,
                                                                        KV_LORA_RANK)):
        check_tensor(op, name, w, ndim=1, dtypes=floats, what=f"a contiguous [{n}] bf16/f16/f32 tensor")
        if w.shape[0] != n or not w.is_contiguous():
            fail(op, name, f"a contiguous [{n}] bf16/f16/f32 tensor", _describe(w))
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0):
        fail(op, "eps", "a finite float >= 0", eps)
    check_same_device(op, q_c=q_c, kv_c=kv_c, k_pe=k_pe, g=g, q_norm_weight=q_norm_weight,
                      kv_norm_weight=kv_norm_weight)


def check_v_up_proj_args(op: str, o, w_uv, w_uv_scale, gate) -> None:
    """o [T, H, L] bf16 (L contiguous); w_uv bf16 [H, v, L] or MXFP4 [H, v, L/2]; gate [T, H * v] bf16."""
    check_tensor(op, "o", o, ndim=3, dtypes=(torch.bfloat16,), what="a [T, H, L] bfloat16 tensor")
    if o.shape[2] > 1 and o.stride(2) != 1:
        fail(op, "o", "a tensor contiguous along its last dim", f"strides {tuple(o.stride())}")
    heads, latent = o.shape[1], o.shape[2]
    check_head_weight(op, "w_uv", w_uv, "w_uv_scale", w_uv_scale, "o's",
                      bf16_dims=(("H", heads), ("v", None), ("L", latent)),
                      mxfp4_dims=(("H", heads), ("v", None), ("L/2", latent / 2)))
    if gate is not None:
        rows = (o.shape[0], heads * w_uv.shape[1])
        check_tensor(op, "gate", gate, ndim=2, dtypes=(torch.bfloat16,), what=f"a bfloat16 {list(rows)} tensor")
        if tuple(gate.shape) != rows:
            fail(op, "gate", f"a bfloat16 {list(rows)} tensor ([T, H * v])", _describe(gate))
        if gate.shape[1] > 1 and gate.stride(1) != 1:
            fail(op, "gate", "a tensor contiguous along its last dim", f"strides {tuple(gate.stride())}")
    check_same_device(op, o=o, w_uv=w_uv, w_uv_scale=w_uv_scale, gate=gate)


def check_query_args(op: str, q_nope, q_pe, w_uk, w_uk_scale, pad_heads) -> None:
    """q_nope [T, H, D], q_pe [T, H, P] bf16; w_uk bf16 [H, D, 512] or MXFP4 [H, 512, D/2]."""
    check_tensor(op, "q_nope", q_nope, ndim=3, dtypes=(torch.bfloat16,), what="a [T, H, D] bfloat16 tensor")
    check_tensor(op, "q_pe", q_pe, ndim=3, dtypes=(torch.bfloat16,), what="a [T, H, P] bfloat16 tensor")
    if tuple(q_pe.shape[:2]) != tuple(q_nope.shape[:2]):
        fail(op, "q_pe", f"[T, H, P] with [T, H] = {tuple(q_nope.shape[:2])} (q_nope's)", _describe(q_pe))
    heads, nope = q_nope.shape[1], q_nope.shape[2]
    check_head_weight(op, "w_uk", w_uk, "w_uk_scale", w_uk_scale, "q_nope's",
                      bf16_dims=(("H", heads), ("D", nope), ("L", None)),
                      mxfp4_dims=(("H", heads), ("L", None), ("D/2", nope / 2)))
    if pad_heads is not None and (not isinstance(pad_heads, int) or pad_heads < heads):
        fail(op, "pad_heads", f"None or an int >= H = {heads}", pad_heads)
    check_same_device(op, q_nope=q_nope, q_pe=q_pe, w_uk=w_uk, w_uk_scale=w_uk_scale)
