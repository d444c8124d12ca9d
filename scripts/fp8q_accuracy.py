"""What quantizing the query to fp8 adds, end to end (issue 28 item 4), on the CPU.

Two measurements, each against float64 on the bf16 problem (the bf16 query, the same fp8 cache):

* ``attention``: the bench's inputs (scripts/bench_attention.py: q ~ N(0, 1) bf16, cache
  ``fp8(2 N(0, 1))`` with kv_scale 0.05, softmax scale 1/sqrt(192)), and the same with the
  heads' query norms spread over 10^-1 .. 10^1 (a stand-in for a model's uneven heads): rel L2
  of o and max |dlse| for the bf16 query (the kimi_ops reference op: only the bf16 output
  rounding), the fp8 query with kimi_ops' per-tensor scale (the op, q_scale=), and, emulated
  in float64, finer scales (one per query row and head, one per token row) that the op does
  not take (its q_scale has one element).
* ``layer``: the Kimi-K3 TP8 layer (MLADecodeLayer, random weights, hidden 7168, 12 heads) one
  decode step, rel L2 of the layer's output against the float64 layer
  (kimi_ops.runtime.reference.layer_float64): the bf16 query (``bf16=True``), the fp8 query
  (``bf16=False``, per-tensor amax scale), and the per-row / per-token scales emulated (the
  step's pieces with the attention in float64 on the dequantized query, rounded to bf16).

Usage: ``KIMI_OPS_BACKEND=reference python scripts/fp8q_accuracy.py [--part attention|layer|all]``.
Prints markdown tables.
"""
import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kimi_ops  # noqa: E402
from kimi_ops.reference import attention as ref_attn  # noqa: E402

FN = torch.float8_e4m3fn
FMAX = float(torch.finfo(FN).max)


def dequant(q: torch.Tensor, granularity: str) -> torch.Tensor:
    """float64 q8 * scale of q [T, H, 576] quantized to e4m3fn with one scale per tensor /
    (row, head) / row (amax / 448, float32), the quantize rule of kimi_ops.quantize_query."""
    x = q.float()
    if granularity == "tensor":
        amax = x.abs().amax().reshape(1, 1, 1)
    elif granularity == "head":
        amax = x.abs().amax(-1, keepdim=True)
    elif granularity == "token":
        amax = x.abs().amax((-1, -2), keepdim=True)
    else:
        raise ValueError(granularity)
    scale = torch.where(amax > 0, amax / torch.tensor(FMAX), torch.ones_like(amax))
    q8 = (x / scale).clamp(-FMAX, FMAX).to(FN)
    return q8.double() * scale.double()


def errors(o, lse, o_ref, lse_ref):
    o, lse = o.double(), lse.double()
    fin = torch.isfinite(lse_ref)
    return float((o - o_ref).norm() / o_ref.norm()), float((lse - lse_ref)[fin].abs().max())


def attention_part(args):
    g = torch.Generator().manual_seed(args.seed)
    H, qlen, lens = 12, 1, [args.context] * args.batch
    scale, kv_scale = 1 / math.sqrt(192), 0.05
    total = sum(lens)
    pool = (torch.randn(total + 64, 576, generator=g) * 2).clamp(-448, 448).to(FN)
    idx = torch.randperm(total + 64, generator=g)[:total].to(torch.int32)
    indptr = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32)
    rows = []
    for spread in (False, True):
        q = torch.randn(len(lens) * qlen, H, 576, generator=g)
        if spread:
            q = q * torch.logspace(-1, 1, H)[None, :, None]
        q = q.to(torch.bfloat16)
        o64, lse64 = ref_attn.decode_float64(q, pool, indptr, idx, qlen, scale, kv_scale)
        label = "q N(0,1)" if not spread else "heads x 10^-1..10^1"
        o, lse = kimi_ops.mla_decode(q, pool, indptr, idx, qlen=qlen, scale=scale, kv_scale=kv_scale)
        rows.append((label, "bf16 q (the op)", *errors(o, lse, o64, lse64)))
        q8, q_scale = kimi_ops.quantize_query(q)
        o, lse = kimi_ops.mla_decode(q8, pool, indptr, idx, qlen=qlen, scale=scale, kv_scale=kv_scale,
                                     q_scale=q_scale)
        rows.append((label, "fp8 q, per-tensor scale (the op)", *errors(o, lse, o64, lse64)))
        for gran, what in (("tensor", "per tensor"), ("token", "per token row"), ("head", "per (row, head)")):
            qd = dequant(q, gran)
            o, lse = ref_attn.mla_decode_splitkv(qd, pool, indptr, idx, qlen, scale, kv_scale, 1)
            rows.append((label, f"fp8 q, {what} scale (emulated)", *errors(o[0], lse[0], o64, lse64)))
    print(f"\nattention: {args.batch} requests x {args.context} tokens, H {H}, qlen {qlen}, bench inputs; "
          "vs float64 on the bf16 q\n")
    print("| query | quantization | rel L2 o | max abs dlse |\n|---|---|---|---|")
    for label, what, e, l in rows:
        print(f"| {label} | {what} | {e:.2e} | {l:.2e} |")


def layer_part(args):
    from kimi_ops.runtime import DecodeMetadata, MLAConfig, MLADecodeLayer, allocate_blocks, mla
    from kimi_ops.runtime.reference import layer_float64, relative_error

    torch.manual_seed(args.seed)
    config = MLAConfig.kimi_k3(tp=8)
    batch, context, qlen, bs = args.batch, args.context, 1, 16
    rows = []
    for weights in args.weights.split(","):
        layer = MLADecodeLayer(config, weights=weights, seed=args.seed)
        lengths = [max(1, context + (i * 97) % 211 - 105) for i in range(batch)]
        block_table, num_blocks = allocate_blocks(batch, max(lengths) + 1, bs, seed=args.seed)
        gen = torch.Generator().manual_seed(args.seed)
        cache = (torch.randn(num_blocks, bs, 576, generator=gen) / layer.kv_scale).to(FN)
        md = DecodeMetadata.allocate(batch, sum(lengths) + batch, qlen=qlen, block_size=bs,
                                     max_blocks=block_table.shape[1])
        md.update_(torch.tensor(lengths, dtype=torch.int32), block_table)
        hidden = torch.randn(batch * qlen, config.hidden_size, generator=gen).to(torch.bfloat16)
        with torch.no_grad():
            layer.bf16 = True
            out16 = layer(hidden, cache, md)
            ref = layer_float64(layer, hidden, cache, md)          # the cache after the step
            rows.append((weights, "bf16 q", relative_error(out16, ref)))
            layer.bf16 = False
            rows.append((weights, "fp8 q, per-tensor scale (the layer)", relative_error(layer(hidden, cache, md), ref)))
            q16, gate = mla.pre(layer, hidden, cache, md, bf16=True)
            rows_flat = cache.view(-1, 576)
            for gran, what in (("tensor", "per tensor"), ("token", "per token row"), ("head", "per (row, head)")):
                qd = dequant(q16, gran)
                o, lse = ref_attn.mla_decode_splitkv(qd, rows_flat, md.kv_indptr, md.kv_indices, qlen,
                                                     config.softmax_scale, layer.kv_scale, 1, md.seq_lens)
                out = mla.post(layer, o[0], lse[0], md, gate)
                out = torch.nn.functional.linear(out, layer.o_proj.weight)
                rows.append((weights, f"fp8 q, {what} scale (emulated)", relative_error(out, ref)))
    print(f"\nKimi-K3 TP8 layer (hidden 7168, 12 heads), one decode step, batch {batch}, context ~{context}; "
          "output vs the float64 layer\n")
    print("| W_UK / W_UV | query | rel L2 of the output |\n|---|---|---|")
    for weights, what, e in rows:
        print(f"| {weights} | {what} | {e:.2e} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=("attention", "layer", "all"), default="all")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--weights", default="bf16,mxfp4")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    os.environ.setdefault("KIMI_OPS_BACKEND", "reference")
    if args.part in ("attention", "all"):
        attention_part(args)
    if args.part in ("layer", "all"):
        layer_part(args)


if __name__ == "__main__":
    main()
