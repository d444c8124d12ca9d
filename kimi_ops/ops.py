"""The ``kimi_ops`` operator library: schemas, fake (meta) implementations,
device implementations (through :mod:`kimi_ops.dispatch`) and the Python
functions that call them.

Every op is ``torch.ops.kimi_ops.<name>``; the functions below are thin,
documented entry points with the same names and arguments. The fake
implementations run the same host checks as the real ones, so a bad call fails
with the same message eagerly and under ``torch.compile``.
"""

import torch

from . import checks, dispatch
from .formats import KV_LORA_RANK, KV_ROW, MXFP4_BLOCK, fp8_max

NAMESPACE = "kimi_ops"

SCHEMAS: dict[str, str] = {
    "mla_decode_splitkv": (
        "mla_decode_splitkv(Tensor q, Tensor kv_cache, Tensor kv_indptr, Tensor kv_indices, *, "
        "int qlen, float scale, float kv_scale, int num_splits, Tensor? q_scale=None, Tensor? seq_lens=None, "
        "int dcp_rank=0, "
        "int dcp_world_size=1) -> (Tensor o_part, Tensor lse_part)"
    ),
    "mla_merge": "mla_merge(Tensor o_part, Tensor lse_part) -> (Tensor o, Tensor lse)",
    "mla_decode": (
        "mla_decode(Tensor q, Tensor kv_cache, Tensor kv_indptr, Tensor kv_indices, *, "
        "int qlen, float scale, float kv_scale, int? num_splits=None, Tensor? q_scale=None, Tensor? seq_lens=None, "
        "int dcp_rank=0, "
        "int dcp_world_size=1, bool constant_kv=False) -> (Tensor o, Tensor lse)"
    ),
    "mla_cache_write": (
        "mla_cache_write(Tensor kv_c, Tensor k_pe, Tensor(a!) kv_cache, Tensor slot_mapping, "
        "float kv_scale) -> ()"
    ),
    "mxfp4_quantize": "mxfp4_quantize(Tensor w) -> (Tensor w_packed, Tensor w_scale)",
    "mxfp4_dequantize": "mxfp4_dequantize(Tensor w_packed, Tensor w_scale, *, ScalarType? dtype=None) -> Tensor",
    "bmm_a16wfp4": "bmm_a16wfp4(Tensor x, Tensor w_packed, Tensor w_scale) -> Tensor",
    "mla_query": (
        "mla_query(Tensor q_nope, Tensor q_pe, Tensor w_uk, Tensor? w_uk_scale=None, *, "
        "int? pad_heads=None, bool constant_w=False) -> Tensor"
    ),
    "gemm_a16w8_block": (
        "gemm_a16w8_block(Tensor x, Tensor w, Tensor w_scale_inv, *, int block_n=128, int block_k=128, "
        "bool constant_w=False) -> Tensor"
    ),
    "gemm_a16w16": "gemm_a16w16(Tensor x, Tensor w, *, bool constant_w=False) -> Tensor",
    "mla_norm_cache_write": (
        "mla_norm_cache_write(Tensor q_c, Tensor kv_c, Tensor k_pe, Tensor q_norm_weight, Tensor kv_norm_weight, "
        "Tensor(a!) kv_cache, Tensor slot_mapping, Tensor? g=None, *, float eps, float kv_scale, "
        "bool constant_w=False) -> (Tensor q_c_normed, Tensor gate)"
    ),
    "mla_norm_cache_write_q_b": (
        "mla_norm_cache_write_q_b(Tensor q_c, Tensor kv_c, Tensor k_pe, Tensor q_norm_weight, Tensor kv_norm_weight, "
        "Tensor(a!) kv_cache, Tensor slot_mapping, Tensor q_b_weight, Tensor? q_b_scale_inv=None, Tensor? g=None, *, "
        "float eps, float kv_scale, int block_n=128, int block_k=128, bool constant_w=False) -> (Tensor q, Tensor gate)"
    ),
    "mla_v_up_proj": (
        "mla_v_up_proj(Tensor o, Tensor w_uv, Tensor? w_uv_scale=None, Tensor? gate=None, *, "
        "bool constant_w=False) -> Tensor"
    ),
}
"""One schema per op: the public contract, pinned by tests/test_schemas.py."""

_lib = torch.library.Library(NAMESPACE, "DEF")
for _schema in SCHEMAS.values():
    _lib.define(_schema)


def _register(name: str, *, fake, real) -> None:
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_lib)
    for key in ("CPU", "CUDA"):  # ROCm tensors use the CUDA key too
        _lib.impl(name, real, key)


def _flat_rows(kv_cache: torch.Tensor) -> torch.Tensor:
    return kv_cache.view(-1, KV_ROW)


def _check_decode(op, q, kv_cache, kv_indptr, kv_indices, qlen, scale, kv_scale, num_splits, q_scale,
                  seq_lens, dcp_rank, dcp_world_size) -> None:
    """The host checks of mla_decode_splitkv and mla_decode (fake and real alike), in this order:
    shapes / dtypes / devices, the value contract, then the q / q_scale pair."""
    checks.check_decode_args(op, q, kv_cache, kv_indptr, kv_indices, qlen, num_splits,
                             seq_lens, dcp_rank, dcp_world_size)
    checks.check_decode_contract(op, kv_indptr, kv_indices, seq_lens, num_splits, scale, kv_scale)
    checks.check_q_scale(op, q, kv_cache, q_scale)


# --- mla_decode_splitkv (M1c) -------------------------------------------------------------------

def _splitkv_fake(q, kv_cache, kv_indptr, kv_indices, *, qlen, scale, kv_scale, num_splits,
                  q_scale=None, seq_lens=None, dcp_rank=0, dcp_world_size=1):
    _check_decode("mla_decode_splitkv", q, kv_cache, kv_indptr, kv_indices, qlen, scale, kv_scale, num_splits, q_scale,
                  seq_lens, dcp_rank, dcp_world_size)
    num_rows, num_heads, _ = q.shape
    return (q.new_empty((num_splits, num_rows, num_heads, KV_LORA_RANK), dtype=torch.bfloat16),
            q.new_empty((num_splits, num_rows, num_heads), dtype=torch.float32))


def _splitkv(q, kv_cache, kv_indptr, kv_indices, qlen, scale, kv_scale, num_splits,
             seq_lens, dcp_rank, dcp_world_size, zero_empty=True, q_scale=None):
    impl = dispatch.implementation("mla_decode_splitkv", q.device)
    return impl(q.contiguous(), _flat_rows(kv_cache), kv_indptr, kv_indices, qlen, scale, kv_scale,
                num_splits, seq_lens, dcp_rank, dcp_world_size, zero_empty=zero_empty, q_scale=q_scale)


def _splitkv_real(q, kv_cache, kv_indptr, kv_indices, *, qlen, scale, kv_scale, num_splits,
                  q_scale=None, seq_lens=None, dcp_rank=0, dcp_world_size=1):
    _check_decode("mla_decode_splitkv", q, kv_cache, kv_indptr, kv_indices, qlen, scale, kv_scale, num_splits, q_scale,
                  seq_lens, dcp_rank, dcp_world_size)
    return _splitkv(q, kv_cache, kv_indptr, kv_indices, qlen, scale, kv_scale, num_splits,
                    seq_lens, dcp_rank, dcp_world_size, q_scale=q_scale)


_register("mla_decode_splitkv", fake=_splitkv_fake, real=_splitkv_real)


# --- mla_merge (M1b) ----------------------------------------------------------------------------

def _merge_fake(o_part, lse_part):
    checks.check_merge_args("mla_merge", o_part, lse_part)
    return o_part.new_empty(o_part.shape[1:]), lse_part.new_empty(lse_part.shape[1:])


def _merge_real(o_part, lse_part):
    checks.check_merge_args("mla_merge", o_part, lse_part)
    return dispatch.implementation("mla_merge", o_part.device)(o_part.contiguous(), lse_part.contiguous())


_register("mla_merge", fake=_merge_fake, real=_merge_real)


# --- mla_decode (M1c + M1b) ---------------------------------------------------------------------

def _decode_fake(q, kv_cache, kv_indptr, kv_indices, *, qlen, scale, kv_scale, num_splits=None,
                 q_scale=None, seq_lens=None, dcp_rank=0, dcp_world_size=1, constant_kv=False):
    _check_decode("mla_decode", q, kv_cache, kv_indptr, kv_indices, qlen, scale, kv_scale, num_splits, q_scale,
                  seq_lens, dcp_rank, dcp_world_size)
    num_rows, num_heads, _ = q.shape
    return (q.new_empty((num_rows, num_heads, KV_LORA_RANK), dtype=torch.bfloat16),
            q.new_empty((num_rows, num_heads), dtype=torch.float32))


def _decode_real(q, kv_cache, kv_indptr, kv_indices, *, qlen, scale, kv_scale, num_splits=None,
                 q_scale=None, seq_lens=None, dcp_rank=0, dcp_world_size=1, constant_kv=False):
    _check_decode("mla_decode", q, kv_cache, kv_indptr, kv_indices, qlen, scale, kv_scale, num_splits, q_scale,
                  seq_lens, dcp_rank, dcp_world_size)
    if dispatch.backend_for("mla_decode_splitkv", q.device) == "cuda":
        from .kernels.sm90 import mla_decode as cuda_decode
        return cuda_decode(q.contiguous(), _flat_rows(kv_cache), kv_indptr, kv_indices, qlen, scale, kv_scale,
                           num_splits, seq_lens, dcp_rank, dcp_world_size, q_scale=q_scale,
                           constant_kv=constant_kv)
    if num_splits is None:
        num_splits = dispatch.default_num_splits(
            kv_indptr.shape[0] - 1, q.shape[0], q.shape[1], kv_indices.shape[0], q.device)
    # the partials are private: the merge never reads an empty (-inf) split's o, so the kernel
    # may leave it unwritten
    o_part, lse_part = _splitkv(q, kv_cache, kv_indptr, kv_indices, qlen, scale, kv_scale, num_splits,
                                seq_lens, dcp_rank, dcp_world_size, zero_empty=False, q_scale=q_scale)
    if num_splits == 1:
        return o_part[0], lse_part[0]
    return dispatch.implementation("mla_merge", q.device)(o_part, lse_part)


_register("mla_decode", fake=_decode_fake, real=_decode_real)


# --- mla_cache_write ----------------------------------------------------------------------------

def _cache_write_fake(kv_c, k_pe, kv_cache, slot_mapping, kv_scale):
    checks.check_cache_write_args("mla_cache_write", kv_c, k_pe, kv_cache, slot_mapping)
    checks.check_cache_write_contract("mla_cache_write", slot_mapping, kv_scale)


def _cache_write_real(kv_c, k_pe, kv_cache, slot_mapping, kv_scale):
    checks.check_cache_write_args("mla_cache_write", kv_c, k_pe, kv_cache, slot_mapping)
    checks.check_cache_write_contract("mla_cache_write", slot_mapping, kv_scale)
    dispatch.implementation("mla_cache_write", kv_cache.device)(
        kv_c, k_pe, _flat_rows(kv_cache), slot_mapping, kv_scale)


_register("mla_cache_write", fake=_cache_write_fake, real=_cache_write_real)


def _norm_cache_write_checks(q_c, kv_c, k_pe, q_norm_weight, kv_norm_weight, kv_cache, slot_mapping, g, eps,
                             kv_scale, name="mla_norm_cache_write"):
    checks.check_norm_cache_write_args(name, q_c, kv_c, k_pe, q_norm_weight, kv_norm_weight, g, eps)
    checks.check_cache_write_args(name, kv_c, k_pe, kv_cache, slot_mapping)
    checks.check_cache_write_contract(name, slot_mapping, kv_scale)


def _norm_cache_write_fake(q_c, kv_c, k_pe, q_norm_weight, kv_norm_weight, kv_cache, slot_mapping, g=None, *,
                           eps, kv_scale, constant_w=False):
    _norm_cache_write_checks(q_c, kv_c, k_pe, q_norm_weight, kv_norm_weight, kv_cache, slot_mapping, g, eps,
                             kv_scale)
    return q_c.new_empty(q_c.shape), q_c.new_empty((q_c.shape[0], 0 if g is None else g.shape[1]))


def _norm_cache_write_real(q_c, kv_c, k_pe, q_norm_weight, kv_norm_weight, kv_cache, slot_mapping, g=None, *,
                           eps, kv_scale, constant_w=False):
    _norm_cache_write_checks(q_c, kv_c, k_pe, q_norm_weight, kv_norm_weight, kv_cache, slot_mapping, g, eps,
                             kv_scale)
    return dispatch.implementation("mla_norm_cache_write", kv_cache.device)(
        q_c, kv_c, k_pe, q_norm_weight, kv_norm_weight, _flat_rows(kv_cache), slot_mapping, g,
        eps=eps, kv_scale=kv_scale, constant_w=constant_w)


_register("mla_norm_cache_write", fake=_norm_cache_write_fake, real=_norm_cache_write_real)


def _norm_cache_write_q_b_checks(q_c, kv_c, k_pe, q_norm_weight, kv_norm_weight, kv_cache, slot_mapping, q_b_weight,
                                 q_b_scale_inv, g, eps, kv_scale, block_n, block_k):
    name = "mla_norm_cache_write_q_b"
    _norm_cache_write_checks(q_c, kv_c, k_pe, q_norm_weight, kv_norm_weight, kv_cache, slot_mapping, g, eps, kv_scale,
                             name)
    if q_b_scale_inv is None:
        _check_gemm_a16w16_args(q_c, q_b_weight, name)
    else:
        _check_gemm_a16w8_block_args(name, q_c, q_b_weight, q_b_scale_inv, block_n, block_k)


def _norm_cache_write_q_b_fake(q_c, kv_c, k_pe, q_norm_weight, kv_norm_weight, kv_cache, slot_mapping, q_b_weight,
                               q_b_scale_inv=None, g=None, *, eps, kv_scale, block_n=128, block_k=128,
                               constant_w=False):
    _norm_cache_write_q_b_checks(q_c, kv_c, k_pe, q_norm_weight, kv_norm_weight, kv_cache, slot_mapping, q_b_weight,
                                 q_b_scale_inv, g, eps, kv_scale, block_n, block_k)
    return (q_c.new_empty((q_c.shape[0], q_b_weight.shape[0])),
            q_c.new_empty((q_c.shape[0], 0 if g is None else g.shape[1])))


def _norm_cache_write_q_b_real(q_c, kv_c, k_pe, q_norm_weight, kv_norm_weight, kv_cache, slot_mapping, q_b_weight,
                               q_b_scale_inv=None, g=None, *, eps, kv_scale, block_n=128, block_k=128,
                               constant_w=False):
    _norm_cache_write_q_b_checks(q_c, kv_c, k_pe, q_norm_weight, kv_norm_weight, kv_cache, slot_mapping, q_b_weight,
                                 q_b_scale_inv, g, eps, kv_scale, block_n, block_k)
    return dispatch.implementation("mla_norm_cache_write_q_b", kv_cache.device)(
        q_c, kv_c, k_pe, q_norm_weight, kv_norm_weight, _flat_rows(kv_cache), slot_mapping, q_b_weight,
        q_b_scale_inv, g, eps=eps, kv_scale=kv_scale, block_n=block_n, block_k=block_k, constant_w=constant_w)


# --- MXFP4 --------------------------------------------------------------------------------------

def _quantize_fake(w):
    checks.check_mxfp4_quantize_args("mxfp4_quantize", w)
    k = w.shape[-1]
    return (w.new_empty((*w.shape[:-1], k // 2), dtype=torch.uint8),
            w.new_empty((*w.shape[:-1], k // MXFP4_BLOCK), dtype=torch.uint8))


def _quantize_real(w):
    checks.check_mxfp4_quantize_args("mxfp4_quantize", w)
    return dispatch.implementation("mxfp4_quantize", w.device)(w)


_register("mxfp4_quantize", fake=_quantize_fake, real=_quantize_real)


def _dequantize_fake(w_packed, w_scale, *, dtype=None):
    checks.check_mxfp4_weight("mxfp4_dequantize", w_packed, w_scale)
    shape = (*w_packed.shape[:-1], w_packed.shape[-1] * 2)
    return w_packed.new_empty(shape, dtype=dtype or torch.bfloat16)


def _dequantize_real(w_packed, w_scale, *, dtype=None):
    checks.check_mxfp4_weight("mxfp4_dequantize", w_packed, w_scale)
    impl = dispatch.implementation("mxfp4_dequantize", w_packed.device)
    return impl(w_packed, w_scale.view(torch.uint8), dtype=dtype or torch.bfloat16)


_register("mxfp4_dequantize", fake=_dequantize_fake, real=_dequantize_real)


def _bmm_fake(x, w_packed, w_scale):
    checks.check_bmm_args("bmm_a16wfp4", x, w_packed, w_scale)
    return x.new_empty((x.shape[0], x.shape[1], w_packed.shape[1]))


def _bmm_real(x, w_packed, w_scale):
    checks.check_bmm_args("bmm_a16wfp4", x, w_packed, w_scale)
    return dispatch.implementation("bmm_a16wfp4", x.device)(x, w_packed, w_scale.view(torch.uint8))


_register("bmm_a16wfp4", fake=_bmm_fake, real=_bmm_real)


def _query_out_shape(q_nope, q_pe, w_uk, w_uk_scale, pad_heads):
    latent = w_uk.shape[2] if w_uk_scale is None else w_uk.shape[1]
    heads = q_nope.shape[1] if pad_heads is None else pad_heads
    return (q_nope.shape[0], heads, latent + q_pe.shape[2])


def _query_fake(q_nope, q_pe, w_uk, w_uk_scale=None, *, pad_heads=None, constant_w=False):
    checks.check_query_args("mla_query", q_nope, q_pe, w_uk, w_uk_scale, pad_heads)
    return q_nope.new_empty(_query_out_shape(q_nope, q_pe, w_uk, w_uk_scale, pad_heads))


def _query_real(q_nope, q_pe, w_uk, w_uk_scale=None, *, pad_heads=None, constant_w=False):
    checks.check_query_args("mla_query", q_nope, q_pe, w_uk, w_uk_scale, pad_heads)
    if w_uk_scale is not None:
        w_uk_scale = w_uk_scale.view(torch.uint8)
    impl = dispatch.implementation("mla_query", q_nope.device)
    return impl(q_nope, q_pe, w_uk, w_uk_scale, pad_heads=pad_heads, constant_w=constant_w)


_register("mla_query", fake=_query_fake, real=_query_real)


def _v_up_proj_fake(o, w_uv, w_uv_scale=None, gate=None, *, constant_w=False):
    checks.check_v_up_proj_args("mla_v_up_proj", o, w_uv, w_uv_scale, gate)
    return o.new_empty((o.shape[0], o.shape[1] * w_uv.shape[1]))


def _v_up_proj_real(o, w_uv, w_uv_scale=None, gate=None, *, constant_w=False):
    checks.check_v_up_proj_args("mla_v_up_proj", o, w_uv, w_uv_scale, gate)
    if w_uv_scale is not None:
        w_uv_scale = w_uv_scale.view(torch.uint8)
    return dispatch.implementation("mla_v_up_proj", o.device)(o, w_uv, w_uv_scale, gate, constant_w=constant_w)


_register("mla_v_up_proj", fake=_v_up_proj_fake, real=_v_up_proj_real)


# --- fp8 block-scaled GEMM ---------------------------------------------------------------------

FP8_WEIGHT_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


def _check_projection_args(name, x, w, w_dtypes, w_kind):
    """A projection's x (bf16 [M, K]) and w ([N, K] of ``w_dtypes``, named ``w_kind``), K agreeing."""
    if x.dim() != 2 or x.dtype != torch.bfloat16:
        raise ValueError(f"kimi_ops.{name}: x must be a bf16 [M, K] tensor, got {x.dtype} {tuple(x.shape)}")
    if w.dim() != 2 or w.dtype not in w_dtypes:
        raise ValueError(f"kimi_ops.{name}: w must be {w_kind} [N, K] tensor, got {w.dtype} {tuple(w.shape)}")
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"kimi_ops.{name}: x is [M, {x.shape[1]}] but w is [N, {w.shape[1]}]: K must agree")


def _check_gemm_a16w8_block_args(name, x, w, w_scale_inv, block_n, block_k):
    _check_projection_args(name, x, w, FP8_WEIGHT_DTYPES, "an fp8 (float8_e4m3fn)")
    if block_n < 1 or block_k < 1:
        raise ValueError(f"kimi_ops.{name}: block_n and block_k must be >= 1, got {block_n}, {block_k}")
    n, k = w.shape
    expected = (-(-n // block_n), -(-k // block_k))
    if w_scale_inv.dtype != torch.float32 or tuple(w_scale_inv.shape) != expected:
        raise ValueError(f"kimi_ops.{name}: w_scale_inv must be float32 [ceil(N / block_n), ceil(K / block_k)] = "
                         f"{list(expected)}, got {w_scale_inv.dtype} {tuple(w_scale_inv.shape)}")
    if not (x.device == w.device == w_scale_inv.device):
        raise ValueError(f"kimi_ops.{name}: x, w and w_scale_inv must be on one device, got "
                         f"{x.device}, {w.device}, {w_scale_inv.device}")


def _gemm_fp8_fake(x, w, w_scale_inv, *, block_n=128, block_k=128, constant_w=False):
    _check_gemm_a16w8_block_args("gemm_a16w8_block", x, w, w_scale_inv, block_n, block_k)
    return x.new_empty((x.shape[0], w.shape[0]))


def _gemm_fp8_real(x, w, w_scale_inv, *, block_n=128, block_k=128, constant_w=False):
    _check_gemm_a16w8_block_args("gemm_a16w8_block", x, w, w_scale_inv, block_n, block_k)
    impl = dispatch.implementation("gemm_a16w8_block", x.device)
    return impl(x, w, w_scale_inv, block_n=block_n, block_k=block_k, constant_w=constant_w)


_register("gemm_a16w8_block", fake=_gemm_fp8_fake, real=_gemm_fp8_real)
_register("mla_norm_cache_write_q_b", fake=_norm_cache_write_q_b_fake, real=_norm_cache_write_q_b_real)


# --- bf16 projection ------------------------------------------------------------------------------

def _check_gemm_a16w16_args(x, w, name="gemm_a16w16"):
    _check_projection_args(name, x, w, (torch.bfloat16,), "a bf16")
    if x.device != w.device:
        raise ValueError(f"kimi_ops.{name}: x and w must be on one device, got {x.device}, {w.device}")


def _gemm_bf16_fake(x, w, *, constant_w=False):
    _check_gemm_a16w16_args(x, w)
    return x.new_empty((x.shape[0], w.shape[0]))


def _gemm_bf16_real(x, w, *, constant_w=False):
    _check_gemm_a16w16_args(x, w)
    return dispatch.implementation("gemm_a16w16", x.device)(x, w, constant_w=constant_w)


_register("gemm_a16w16", fake=_gemm_bf16_fake, real=_gemm_bf16_real)


# --- Python entry points ------------------------------------------------------------------------

def mla_decode_splitkv(q, kv_cache, kv_indptr, kv_indices, *, qlen, scale, kv_scale, num_splits,
                       q_scale=None, seq_lens=None, dcp_rank=0, dcp_world_size=1):
    """M1c: split-KV MLA decode attention, one partial per split.

    Args:
        q: [T, H, 576] bf16, or fp8 (``float8_e4m3fn``; ``float8_e4m3fnuz`` only with an
            e4m3fnuz cache) with ``q_scale``; last dim contiguous; T = R * qlen, row
            ``r * qlen + i`` is request r's query position i.
        kv_cache: fp8 (e4m3fn; e4m3fnuz on gfx942), contiguous, last dim 576
            (``[N, 576]``, ``[blocks, block_size, 576]``, ``[blocks, block_size, 1, 576]``),
            read as flat rows ``[kv_c 512 | k_pe 64]`` = ``fp8(x / kv_scale)``.
        kv_indptr: [R + 1] int32; kv_indices: int32 flat row ids, both contiguous,
            R <= 65535. Request r's tokens, in order, are
            ``kv_indices[kv_indptr[r]:kv_indptr[r + 1]]``; every row they list must be
            finite, even one past a position's causal bound (weight 0, but 0 x NaN = NaN;
            ``kimi_ops.validate_decode_inputs(..., check_finite=True)`` checks it).
        qlen: query positions per request; position i of a request of n tokens
            sees tokens ``0 .. n - qlen + i``.
        scale: softmax scale; kv_scale: the cache's per-tensor dequantization scale;
            both finite (zero and negative allowed; NaN / inf raise ValueError).
        num_splits: splits the visible tokens of each request are partitioned into
            (the partition is the backend's choice), 1..65535.
            (the partition is the backend's choice).
        q_scale: the fp8 query's dequantization scale, a float32 tensor of one element on
            q's device (real q = fp8 q x q_scale; read on the device, so a CUDA graph
            replays a scale computed each step). Required with an fp8 q, refused with a
            bf16 q. Scores: ``s_j = scale * kv_scale * q_scale * (q8 . k8_j)``.
        seq_lens, dcp_rank, dcp_world_size: decode context parallel (DCP). The cache
            holds rank ``dcp_rank``'s shard: a request's j-th listed token is its global
            position ``j * dcp_world_size + dcp_rank`` (token p lives on rank p % W), and
            position i sees global positions ``<= seq_lens[r] - qlen + i``; seq_lens
            [R] int32 are the global lengths (needed when dcp_world_size > 1; None means
            the listed lengths). Defaults: one rank.

    Returns:
        o_part [num_splits, T, H, 512] bf16 and lse_part [num_splits, T, H] f32
        (natural log); a split that sees no token has o = 0, lse = -inf.
    """
    return torch.ops.kimi_ops.mla_decode_splitkv(
        q, kv_cache, kv_indptr, kv_indices, qlen=qlen, scale=scale, kv_scale=kv_scale, num_splits=num_splits,
        q_scale=q_scale, seq_lens=seq_lens, dcp_rank=dcp_rank, dcp_world_size=dcp_world_size)


def mla_merge(o_part, lse_part):
    """M1b: merge split (or DCP rank) partials by their LSE.

    o_part [S, T, H, 512] bf16, lse_part [S, T, H] f32 -> o [T, H, 512] bf16,
    lse [T, H] f32 with ``lse = log sum_s exp(lse_s)``, ``o = sum_s exp(lse_s - lse) o_s``;
    rows whose splits are all empty give o = 0, lse = -inf.
    """
    return torch.ops.kimi_ops.mla_merge(o_part, lse_part)


def mla_decode(q, kv_cache, kv_indptr, kv_indices, *, qlen, scale, kv_scale, num_splits=None,
               q_scale=None, seq_lens=None, dcp_rank=0, dcp_world_size=1, constant_kv=False):
    """M1c + M1b: MLA decode attention, (o [T, H, 512] bf16, lse [T, H] f32).

    Arguments as :func:`mla_decode_splitkv`; ``num_splits=None`` picks the split
    count on the host from shapes and the device (:func:`kimi_ops.dispatch.default_num_splits`).
    ``constant_kv=True`` promises that the kernel queued just before this call on the stream
    writes neither ``kv_cache`` nor ``kv_indptr`` / ``kv_indices`` / ``seq_lens``, nor does any
    kernel that may still run when it starts (with programmatic dependent launch: one before it
    that lets its dependents start before it waits). The decode layer: M1a's query kernel comes
    right before, the cache write in the kernel before M1a (q_b's, :func:`mla_norm_cache_write_q_b`),
    and each of ours waits before letting the next start. The cuda backend (sm_90) then starts
    gathering the cache while that kernel finishes; elsewhere it changes nothing. The result is the
    same.
    """
    return torch.ops.kimi_ops.mla_decode(
        q, kv_cache, kv_indptr, kv_indices, qlen=qlen, scale=scale, kv_scale=kv_scale, num_splits=num_splits,
        q_scale=q_scale, seq_lens=seq_lens, dcp_rank=dcp_rank, dcp_world_size=dcp_world_size,
        constant_kv=constant_kv)


def mla_cache_write(kv_c, k_pe, kv_cache, slot_mapping, kv_scale):
    """Write this step's latent rows into the fp8 cache, in place.

    kv_c [T, 512], k_pe [T, 64] (bf16, f16 or f32, last dim contiguous) go to
    flat row ``slot_mapping[t]`` (int32/int64 [T]) of ``kv_cache`` as
    ``fp8(x / kv_scale)`` (float32 division, saturated, round to nearest even).
    Slot -1 (and any slot outside [0, N)) skips the row. Only kv_cache changes.
    slot_mapping must be contiguous; kv_scale finite and non-zero (else ValueError).
    Duplicate slots in one call are undefined: the row may end up a mix of the
    candidates' bytes (:func:`kimi_ops.validate_cache_write_inputs` catches them).
    """
    torch.ops.kimi_ops.mla_cache_write(kv_c, k_pe, kv_cache, slot_mapping, kv_scale)


def mxfp4_quantize(w):
    """OCP MXFP4: w [..., K] (bf16/f16/f32, K % 32 == 0) -> (w_packed [..., K/2] uint8,
    w_scale [..., K/32] uint8 E8M0). See :mod:`kimi_ops.reference.mxfp4` for the rules."""
    return torch.ops.kimi_ops.mxfp4_quantize(w)


def mxfp4_dequantize(w_packed, w_scale, *, dtype=None):
    """MXFP4 -> ``dtype`` (default bf16) [..., K]; w_scale uint8 or float8_e8m0fnu."""
    return torch.ops.kimi_ops.mxfp4_dequantize(w_packed, w_scale, dtype=dtype)


def bmm_a16wfp4(x, w_packed, w_scale):
    """y[b] = x[b] @ dequant(w)[b]^T: x [B, M, K] bf16, w [B, N, K] in MXFP4
    (w_packed [B, N, K/2], w_scale [B, N, K/32]) -> y [B, M, N] bf16, f32 accumulation."""
    return torch.ops.kimi_ops.bmm_a16wfp4(x, w_packed, w_scale)


def mla_norm_cache_write(q_c, kv_c, k_pe, q_norm_weight, kv_norm_weight, kv_cache, slot_mapping, g=None, *,
                         eps, kv_scale, constant_w=False):
    """The layer's pre step between the qkv_a GEMM and q_b, in one op: the q and kv RMSNorms,
    this step's KV rows into the cache and the output gate's sigmoid.

    q_c [T, Q], kv_c [T, 512], k_pe [T, 64], g [T, G] or None: bf16, unit stride along the last
    dim (e.g. column slices of the qkv_a GEMM's output); q_norm_weight [Q], kv_norm_weight [512]
    (bf16 / f16 / f32); kv_cache and slot_mapping as in :func:`mla_cache_write`. Returns
    ``(q_c_normed [T, Q] bf16, gate [T, G] bf16)`` (gate ``[T, 0]`` without g) and writes
    ``fp8(cat(rms_norm(kv_c), k_pe) / kv_scale)`` (the normed kv_c rounded to bf16 first) at
    each token's slot, the bytes :func:`mla_cache_write` writes for the normed kv_c. RMSNorm:
    float32 ``x * rsqrt(mean(x^2) + eps) * weight``, one rounding. ``constant_w``: as in
    :func:`gemm_a16w8_block` (the norm weights are not written by any kernel queued just before:
    the kernel then loads them before its PDL wait).
    """
    return torch.ops.kimi_ops.mla_norm_cache_write(q_c, kv_c, k_pe, q_norm_weight, kv_norm_weight, kv_cache,
                                                   slot_mapping, g, eps=eps, kv_scale=kv_scale,
                                                   constant_w=constant_w)


def mla_norm_cache_write_q_b(q_c, kv_c, k_pe, q_norm_weight, kv_norm_weight, kv_cache, slot_mapping, q_b_weight,
                             q_b_scale_inv=None, g=None, *, eps, kv_scale, block_n=128, block_k=128,
                             constant_w=False):
    """The layer's pre step between the qkv_a GEMM and M1a: :func:`mla_norm_cache_write` and then
    q_b's projection of the normed q_c, ``q = rms_norm(q_c) @ dequant(q_b_weight)^T``.

    Arguments as :func:`mla_norm_cache_write`, plus q_b's weight: ``q_b_weight [N, Q]`` bf16
    (:func:`gemm_a16w16`), or ``float8_e4m3fn`` with ``q_b_scale_inv`` and ``block_n`` / ``block_k``
    as in :func:`gemm_a16w8_block`. Returns ``(q [T, N] bf16, gate [T, G] bf16)``; the cache rows
    as :func:`mla_norm_cache_write` writes them.

    Numerics: the reference (and any call the fused kernel does not take) computes the two ops
    in turn: the normed q_c rounded to bf16, then the projection. The ``cuda`` backend's kernel
    (sm_90, T <= 16 tokens, bf16 norm weights, an e4m3fn cache: kimi_ops/kernels/sm90_gemv.py's
    ``norm_q_b_serves``) does it in one launch: ``q = rstd * ((q_c * q_norm_weight) @ W^T)``,
    ``q_c * q_norm_weight`` rounded to bf16 and the float32 sums scaled by each token's
    ``rstd = rsqrt(mean(q_c^2) + eps)`` before the one rounding. Both are one bf16 rounding of the
    projection's input away from the exact result, so both are within the projection's bound of it
    plus that rounding (tests/test_norm_cache_write_q_b.py); they are not bit-equal. The cache rows
    and the gate are the same values either way. ``KIMI_OPS_SM90_NORM_Q_B=0`` makes the cuda
    backend run the two ops (A/B measurements). ``constant_w``: the norm weights and q_b's weight
    are constants (as in :func:`gemm_a16w8_block`).
    """
    return torch.ops.kimi_ops.mla_norm_cache_write_q_b(
        q_c, kv_c, k_pe, q_norm_weight, kv_norm_weight, kv_cache, slot_mapping, q_b_weight, q_b_scale_inv, g,
        eps=eps, kv_scale=kv_scale, block_n=block_n, block_k=block_k, constant_w=constant_w)


def mla_v_up_proj(o, w_uv, w_uv_scale=None, gate=None, *, constant_w=False):
    """The layer's W_UV up-projection and output gate (the seeds' ``post``): o_proj's input
    ``out [T, H * v]`` bf16, ``out[t, h*v + j] = (W_UV[h] @ o[t, h])[j] * gate[t, h*v + j]``.

    o [T, H, 512] bf16 (the merged attention output; the last dim contiguous); ``w_uv`` bf16
    [H, v, 512], or MXFP4 packed along the 512 axis (uint8 [H, v, 256] with ``w_uv_scale``
    [H, v, 16] uint8 / float8_e8m0fnu); ``gate`` bf16 [T, H * v] (last dim contiguous) or None.
    float32 accumulation, the gate applied to the float32 sum, one rounding to bf16.
    ``constant_w``: as in :func:`gemm_a16w8_block` (W_UV, and its scale, are not written by any
    kernel queued just before: the GEMV kernel then loads them before its PDL wait).
    """
    return torch.ops.kimi_ops.mla_v_up_proj(o, w_uv, w_uv_scale, gate, constant_w=constant_w)


def mla_query(q_nope, q_pe, w_uk, w_uk_scale=None, *, pad_heads=None, out_dtype=None, q_scale=None,
              constant_w=False):
    """M1a: the absorbed query ``q [T, H', 576] = [q_nope[t, h] @ W_UK[h] | q_pe[t, h]]``.

    q_nope [T, H, 128] and q_pe [T, H, 64] bf16; ``w_uk`` bf16 [H, 128, 512], or
    MXFP4 packed along the 128 axis (uint8 [H, 512, 64] with ``w_uk_scale``
    [H, 512, 4]). ``pad_heads`` (>= H) pads the head dim with all-zero rows.

    ``out_dtype``: None / ``torch.bfloat16`` returns the bf16 query (the ``mla_query`` op).
    ``torch.float8_e4m3fn`` (or ``float8_e4m3fnuz``) returns ``(q8, q_scale)``, the query
    :func:`mla_decode` takes with ``q_scale=``: M1a's bf16 query quantized by
    :func:`quantize_query`, per tensor, with ``q_scale`` (a static float32 [1] scale) or,
    when None, the scale of its amax (:func:`query_scale`, computed on the device).

    ``constant_w``: as in :func:`gemm_a16w8_block` (W_UK, and its scale, are not written by any
    kernel queued just before: the Triton kernel then loads its weight tile before its PDL wait).
    """
    if out_dtype is None or out_dtype == torch.bfloat16:
        if q_scale is not None:
            raise ValueError("kimi_ops.mla_query: q_scale must be None for a bf16 output (out_dtype None or "
                             f"torch.bfloat16), got a q_scale with out_dtype {out_dtype}")
        return torch.ops.kimi_ops.mla_query(q_nope, q_pe, w_uk, w_uk_scale, pad_heads=pad_heads,
                                            constant_w=constant_w)
    checks.check_query_out_dtype("mla_query", out_dtype)
    q = torch.ops.kimi_ops.mla_query(q_nope, q_pe, w_uk, w_uk_scale, pad_heads=pad_heads, constant_w=constant_w)
    return quantize_query(q, q_scale=q_scale, dtype=out_dtype)


def query_amax(q):
    """``max |q|`` as a float32 [1] tensor on q's device (0 for an empty q): what
    :func:`query_scale` divides, or reduces over DCP ranks first."""
    if q.numel() == 0:
        return torch.zeros(1, dtype=torch.float32, device=q.device)
    return q.abs().amax().to(torch.float32).reshape(1)


def query_scale(q, *, dtype=torch.float8_e4m3fn, amax=None):
    """The per-tensor fp8 scale of a query: float32 [1] ``amax(|q|) / fp8 max`` (448 for e4m3fn,
    240 for e4m3fnuz), 1 where q is all zero (or empty). Torch ops on q's device (no host sync,
    CUDA-graph safe). ``amax`` (float32 [1]) overrides q's own, e.g. the max over DCP ranks."""
    checks.check_query_out_dtype("query_scale", dtype)
    if amax is None:
        amax = query_amax(q)
    # a tensor divisor: CUDA turns division by a Python scalar into a multiply by its reciprocal
    fmax = torch.full((), fp8_max(dtype), dtype=torch.float32, device=amax.device)
    return torch.where(amax > 0, amax / fmax, torch.ones_like(amax))


def quantize_query(q, *, q_scale=None, dtype=torch.float8_e4m3fn):
    """Quantize a query for :func:`mla_decode`'s ``q_scale=``: ``(q8, q_scale)`` with
    ``q8 = fp8(q / q_scale)`` (float32 division, round to nearest even, saturated to the
    format's finite max; NaN stays NaN) of the same shape.

    q: bf16 (or f16 / f32) [T, H, 576]; ``q_scale``: a static float32 tensor of one element
    on q's device, or None for the per-tensor amax scale (:func:`query_scale`). Plain torch
    ops on q's device (no host sync; under torch.compile Inductor fuses them).
    """
    checks.check_query_out_dtype("quantize_query", dtype)
    if q_scale is None:
        q_scale = query_scale(q, dtype=dtype)
    else:
        checks.check_scale_tensor("quantize_query", q_scale, q.device)
    fmax = fp8_max(dtype)
    q8 = (q.to(torch.float32) / q_scale.reshape(())).clamp(-fmax, fmax).to(dtype)
    return q8, q_scale


def gemm_a16w8_block(x, w, w_scale_inv, *, block_n=128, block_k=128, constant_w=False):
    """bf16 activations times an fp8 block-scaled weight: ``y = x @ dequant(w)^T``.

    x [M, K] bf16 (any strides); w [N, K] ``float8_e4m3fn``; w_scale_inv [ceil(N / block_n),
    ceil(K / block_k)] float32 with ``dequant(w)[n, k] = w[n, k] * w_scale_inv[n // block_n,
    k // block_k]`` (DeepSeek-V3's / Kimi-K2's ``*.weight`` + ``*.weight_scale_inv``) -> y [M, N]
    bf16, float32 accumulation, no dequantized copy of w. See :mod:`kimi_ops.reference.fp8`.

    ``constant_w=True`` promises that no kernel queued before this call on its stream writes w
    or w_scale_inv (a model's weights): the sm_90 small-M kernel then launches with programmatic
    dependent launch and streams w while the kernel before it finishes (``KIMI_OPS_PDL=0``
    turns that off). The result is the same either way.
    """
    return torch.ops.kimi_ops.gemm_a16w8_block(x, w, w_scale_inv, block_n=block_n, block_k=block_k,
                                               constant_w=constant_w)


def gemm_a16w16(x, w, *, constant_w=False):
    """A bf16 projection: ``y = x @ w^T``.

    x [M, K] bf16 (any strides); w [N, K] bf16 -> y [M, N] bf16, float32 accumulation. On sm_90
    with ``kimi_ops._C`` built, ``M <= 16`` runs a small-M tensor-core kernel that streams w
    (csrc/sm90/gemv.cuh; :mod:`kimi_ops.kernels.sm90_gemv` says what it takes); every other
    call, and every other device, runs torch's ``F.linear`` (cuBLAS). The decode layer's bf16
    projections call it (:func:`kimi_ops.runtime.mla.project`). ``constant_w``: as in
    :func:`gemm_a16w8_block`.
    """
    return torch.ops.kimi_ops.gemm_a16w16(x, w, constant_w=constant_w)


__all__ = [
    "mla_decode_splitkv", "mla_merge", "mla_decode", "mla_cache_write",
    "mxfp4_quantize", "mxfp4_dequantize", "bmm_a16wfp4", "mla_query", "quantize_query", "query_scale",
    "gemm_a16w8_block", "gemm_a16w16", "mla_v_up_proj", "mla_norm_cache_write", "mla_norm_cache_write_q_b",
]
