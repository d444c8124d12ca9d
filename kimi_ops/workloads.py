"""Synthetic decode workloads (Kimi-K3 TP8 shapes by default) for the demo and benchmarks."""

import math
from dataclasses import dataclass

import torch

from .formats import KV_ROW, fp8_max

KIMI_K3_TP8_HEADS = 12
KIMI_K3_SOFTMAX_SCALE = 1.0 / math.sqrt(192.0)   # nope 128 + rope 64


@dataclass
class DecodeWorkload:
    """One decode step's attention inputs.

    q [R * qlen, H, 576] bf16; kv_cache [N, 576] fp8 with rows randomly permuted
    (a request's tokens are scattered, as in a paged cache); page-size-1 CSR
    kv_indptr [R + 1] / kv_indices int32; seq_lens [R] int32.
    """
    q: torch.Tensor
    kv_cache: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    seq_lens: torch.Tensor
    qlen: int
    scale: float
    kv_scale: float

    @property
    def num_tokens(self) -> int:
        return int(self.kv_indices.numel())

    def decode_args(self):
        return (self.q, self.kv_cache, self.kv_indptr, self.kv_indices)

    def decode_kwargs(self):
        return dict(qlen=self.qlen, scale=self.scale, kv_scale=self.kv_scale)


def decode_workload(seq_lens, *, heads=KIMI_K3_TP8_HEADS, qlen=1, kv_scale=0.0625,
                    cache_dtype=torch.float8_e4m3fn, device="cpu", seed=0) -> DecodeWorkload:
    """Random N(0, 1)-scale data for requests of the given lengths (tokens per request)."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [int(n) for n in seq_lens]
    total = sum(seq_lens)
    bound = fp8_max(cache_dtype)
    rows = (torch.randn(total, KV_ROW, generator=gen) / kv_scale).clamp(-bound, bound).to(cache_dtype)
    indices = torch.randperm(total, generator=gen).to(torch.int32)
    indptr = torch.tensor([0] + seq_lens, dtype=torch.int64).cumsum(0).to(torch.int32)
    q = torch.randn(len(seq_lens) * qlen, heads, KV_ROW, generator=gen).to(torch.bfloat16)
    return DecodeWorkload(q.to(device), rows.to(device), indptr.to(device), indices.to(device),
                          torch.tensor(seq_lens, dtype=torch.int32, device=device), qlen,
                          KIMI_K3_SOFTMAX_SCALE, kv_scale)


def lognormal_lengths(count: int, median: int, sigma: float = 0.6, seed: int = 0, minimum: int = 1):
    """Request lengths drawn log-normally around ``median`` (a variable-length batch)."""
    gen = torch.Generator().manual_seed(seed)
    draws = torch.exp(torch.randn(count, generator=gen) * sigma) * median
    return [max(minimum, int(x)) for x in draws]
