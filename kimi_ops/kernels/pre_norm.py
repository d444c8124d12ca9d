"""Triton ``mla_norm_cache_write``: the layer's pre step after the qkv_a GEMM, in one launch.

For each token t (every input bf16, unit stride along its last dim, any row stride):

* ``q_c_normed[t] = RMSNorm(q_c[t]) * q_norm_weight`` -> bf16 ``[T, Q]`` (q_b's input);
* the cache row ``slot_mapping[t]`` of ``kv_rows [N, 576]`` (fp8) gets
  ``fp8(cat(bf16(RMSNorm(kv_c[t]) * kv_norm_weight), k_pe[t]) / kv_scale)``, as
  :func:`kimi_ops.kernels.cache.mla_cache_write` stores it (a slot outside [0, N) is skipped);
* ``gate[t] = sigmoid(g[t])`` -> bf16 ``[T, G]`` when ``g`` is given (else ``[T, 0]``).

RMSNorm as :func:`kimi_ops.reference.attention.rms_norm`: float32, ``x * rsqrt(mean(x^2) + eps)``, times
the weight, one rounding. Grid ``(T, 3)`` (``(T, 2)`` without g): program (t, 0) the q norm,
(t, 1) the kv norm and the cache row, (t, 2) the gate, so a step of T tokens is 2-3 T programs
of one row each. In the compiled layer this replaces Inductor's norm and sigmoid kernels and the
cache write: one kernel where there were two to four.
"""
import torch
import triton
import triton.language as tl

from ..formats import KV_LORA_RANK, KV_ROW, ROPE_DIM
from . import interpreting
from .cache import FP8_FNUZ, store_kv_row
from .mxfp4 import _to_bf16
from .pdl import pdl_args, wait_prior_grid, weights_first


@triton.jit
def _rms_norm_row(x_ptr, w, n, eps, BLOCK: tl.constexpr):
    """One row of n elements (BLOCK >= n, masked) times its weight w (float32 [BLOCK], loaded):
    (x / rms(x)) * w in float32, and the offsets and mask it used."""
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.math.rsqrt(tl.sum(x * x, axis=0) / n + eps)
    return x * r * w, offs, mask


@triton.jit
def _norm_cache_write_kernel(
    qc_ptr, kvc_ptr, kpe_ptr, g_ptr, qw_ptr, kvw_ptr,
    qn_ptr, gate_ptr, kv_ptr, slot_ptr,
    N, Q, G, eps, kv_scale,
    stride_qc, stride_kvc, stride_pe, stride_g,
    FNUZ: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_G: tl.constexpr,
    INTERP: tl.constexpr, PDL: tl.constexpr = False, W_FIRST: tl.constexpr = False,
):
    DC: tl.constexpr = 512   # KV_LORA_RANK
    DP: tl.constexpr = 64    # ROPE_DIM
    if not W_FIRST:
        wait_prior_grid(PDL)
    t = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    # the program's norm weight (W_FIRST, constant_w: before the PDL wait)
    offs_q = tl.arange(0, BLOCK_Q)
    q_w = tl.load(qw_ptr + offs_q, mask=(offs_q < Q) & (part == 0), other=0.0).to(tl.float32)
    kv_w = tl.load(kvw_ptr + tl.arange(0, DC), mask=part == 1, other=0.0).to(tl.float32)
    if W_FIRST:
        wait_prior_grid(PDL)
    if part == 0:
        y, offs, mask = _rms_norm_row(qc_ptr + t * stride_qc, q_w, Q, eps, BLOCK_Q)
        tl.store(qn_ptr + t * Q + offs, _to_bf16(y, INTERP), mask=mask)
    elif part == 1:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if (slot >= 0) & (slot < N):
            y, _, _ = _rms_norm_row(kvc_ptr + t * stride_kvc, kv_w, DC, eps, DC)
            y = _to_bf16(y, INTERP).to(tl.float32)    # the bf16 kv_c the unfused step writes
            offs_p = tl.arange(0, DP)
            pe = tl.load(kpe_ptr + t * stride_pe + offs_p).to(tl.float32)
            store_kv_row(kv_ptr + slot * (DC + DP), y, pe, kv_scale, True, FNUZ, DC, DP)
    else:
        offs = tl.arange(0, BLOCK_G)
        mask = offs < G
        g = tl.load(g_ptr + t * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(gate_ptr + t * G + offs, _to_bf16(tl.sigmoid(g), INTERP), mask=mask)


def mla_norm_cache_write(q_c, kv_c, k_pe, q_norm_weight, kv_norm_weight, kv_rows, slot_mapping,
                         g=None, *, eps: float, kv_scale: float, constant_w: bool = False):
    """-> (q_c_normed [T, Q] bf16, gate [T, G] bf16) and the cache rows written (inputs validated
    by the op layer; ``kv_rows`` the cache as [N, 576] fp8 rows). ``constant_w``: the norm weights
    are loaded before the PDL wait (:func:`kimi_ops.kernels.pdl.weights_first`)."""
    t, q = q_c.shape
    gcols = 0 if g is None else g.shape[1]
    q_normed = torch.empty((t, q), dtype=torch.bfloat16, device=q_c.device)
    gate = torch.empty((t, gcols), dtype=torch.bfloat16, device=q_c.device)
    if t == 0:
        return q_normed, gate
    pdl = pdl_args(q_c.device)
    _norm_cache_write_kernel[(t, 3 if gcols else 2)](
        q_c, kv_c, k_pe, q_c if g is None else g, q_norm_weight, kv_norm_weight,
        q_normed, gate, kv_rows.view(torch.uint8), slot_mapping,
        kv_rows.shape[0], q, gcols, float(eps), float(kv_scale),
        q_c.stride(0), kv_c.stride(0), k_pe.stride(0), 0 if g is None else g.stride(0),
        FNUZ=kv_rows.dtype == FP8_FNUZ, BLOCK_Q=triton.next_power_of_2(q),
        BLOCK_G=triton.next_power_of_2(max(gcols, 1)), INTERP=interpreting(), **pdl,
        W_FIRST=weights_first(constant_w, pdl), num_warps=4,
    )
    return q_normed, gate


def mla_norm_cache_write_q_b(q_c, kv_c, k_pe, q_norm_weight, kv_norm_weight, kv_rows, slot_mapping, q_b_weight,
                             q_b_scale_inv=None, g=None, *, eps: float, kv_scale: float, block_n: int = 128,
                             block_k: int = 128, constant_w: bool = False):
    """The two ops in turn: :func:`mla_norm_cache_write` (this kernel), then q_b's projection by
    whatever serves ``gemm_a16w16`` / ``gemm_a16w8_block`` on the device (kimi_ops.dispatch).
    -> (q [T, N] bf16, gate [T, G] bf16)."""
    from .. import dispatch

    q_normed, gate = mla_norm_cache_write(q_c, kv_c, k_pe, q_norm_weight, kv_norm_weight, kv_rows, slot_mapping, g,
                                          eps=eps, kv_scale=kv_scale, constant_w=constant_w)
    if q_b_scale_inv is None:
        return dispatch.implementation("gemm_a16w16", q_c.device)(q_normed, q_b_weight, constant_w=constant_w), gate
    gemm = dispatch.implementation("gemm_a16w8_block", q_c.device)
    return gemm(q_normed, q_b_weight, q_b_scale_inv, block_n=block_n, block_k=block_k, constant_w=constant_w), gate


# ----------------------------------------------------------------------------------------------
# cross-compilation registry (scripts/cross_compile.py; format in kimi_ops/kernels/__init__.py)

def _specs():
    sig = {"qc_ptr": "*bf16", "kvc_ptr": "*bf16", "kpe_ptr": "*bf16", "g_ptr": "*bf16", "qw_ptr": "*bf16",
           "kvw_ptr": "*bf16", "qn_ptr": "*bf16", "gate_ptr": "*bf16", "kv_ptr": "*u8", "slot_ptr": "*i64",
           "N": "i32", "Q": "i32", "G": "i32", "eps": "fp32", "kv_scale": "fp32",
           "stride_qc": "i32", "stride_kvc": "i32", "stride_pe": "i32", "stride_g": "i32",
           "FNUZ": "constexpr", "BLOCK_Q": "constexpr", "BLOCK_G": "constexpr", "INTERP": "constexpr",
           "PDL": "constexpr", "W_FIRST": "constexpr"}
    # Kimi-K3 TP8: q_lora 1536, the gate 12 heads x 128 (BLOCK 2048 each); PDL False as in cache.py
    specs = [dict(name=f"norm_cache_write_{sdt}_{'fnuz' if fnuz else 'fn'}", kernel=_norm_cache_write_kernel,
                  signature={**sig, "slot_ptr": f"*{sdt}"},
                  constexprs={"FNUZ": fnuz, "BLOCK_Q": 2048, "BLOCK_G": 2048, "INTERP": False, "PDL": False,
                              "W_FIRST": False},
                  num_warps=4, num_stages=1, targets=("gfx942",) if fnuz else ("gfx950", "gfx942", "sm90"))
             for fnuz in (False, True) for sdt in ("i32", "i64")]
    # the decode layer's launch on sm_90 as it runs: PDL, the norm weights before the wait (constant_w)
    specs.append(dict(name="norm_cache_write_i64_fn_pdl_wfirst", kernel=_norm_cache_write_kernel,
                      signature={**sig, "slot_ptr": "*i64"},
                      constexprs={"FNUZ": False, "BLOCK_Q": 2048, "BLOCK_G": 2048, "INTERP": False, "PDL": True,
                                  "W_FIRST": True},
                      num_warps=4, num_stages=1, targets=("sm90",)))
    return specs


CROSS_COMPILE_SPECS = _specs()

assert (KV_LORA_RANK, ROPE_DIM, KV_ROW) == (512, 64, 576), "_norm_cache_write_kernel's DC / DP"
