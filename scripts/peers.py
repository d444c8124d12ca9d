"""Peer MLA decode implementations for scripts/bench_attention.py, behind one interface.

Each ``make_<peer>(case)`` builds everything a peer needs for one input set (its own index
layout, workspaces, plans) OUTSIDE any timed region and returns a closure ``f() -> (o, lse)``
(``lse`` may be None) that only launches the peer's kernels, so the benchmark can capture it
in a CUDA graph like ours (``lse`` may also be any view whose ``reshape(T, H)`` is ours:
FlashMLA's). Anything that goes wrong raises :class:`PeerUnavailable` (or any
other exception) with a reason; the benchmark records "did not run: <reason>" and carries on.

None of the peers' code lives in this repository:

* ``flashinfer``: ``flashinfer.mla.BatchMLAPagedAttentionWrapper`` (FA3 backend on sm_90,
  bf16 q with the fp8 e4m3 cache, per-tensor KV scale), imported from an installed or
  unpacked flashinfer-python (``scripts/setup_peers.sh`` puts it on the path; a prebuilt
  kernel placed in the package's ``data/aot`` directory spares the device its JIT build).
* ``vllm_triton``: ``decode_attention_fwd`` from vLLM's ``triton_decode_attention.py``, the
  grouped (MLA) path that vLLM's TritonMLA backend calls. The file is unpacked from the vllm
  wheel into ``.peers/vllm/`` (git-ignored) and loaded by path; :func:`load_vllm_decode` stands
  in for the two vllm modules it imports (``vllm.platforms``, ``vllm.triton_utils``).
* ``flashinfer_bf16``: the same wrapper on a bf16 copy of the cache (``k8 * kv_scale``, made
  once a pool, :func:`bf16_pool`), its own prebuilt kernel beside the fp8 one.
* ``flashmla_bf16``: FlashMLA's dense decode (``_flashmla_C::dense_decode_fwd``, sm_90a) on the
  bf16 copy in pages of 64 rows; ``flashmla_fp8``: vLLM's dense fp8 FlashMLA
  (``_flashmla_extension_C::fwd_kvcache_mla_fp8``) on the fp8 cache in the same pages, with q
  quantized to fp8 per tensor (:func:`quantize_q_fp8`; descale_q = its scale, descale_k =
  kv_scale). Both .so files come out of the vllm 0.26.0 wheel (it pins torch 2.11 / CUDA 13)
  into ``.peers/flashmla/`` (git-ignored) and are loaded with ``torch.ops.load_library``
  (:func:`load_flashmla`). Where a set's requests are whole 64-row pages of the pool (the bench's
  contiguous layout), the block table points into the pool itself; otherwise the set's rows are
  copied into pages of a cache of its own (:func:`flashmla_paged`, ``f.layout`` says which).
* ``naive``: gather + dequantize to bf16 + padded bmm + masked softmax + bmm (plain torch).

Common semantics (ours): q [T, H, 576] bf16 with T = R * qlen; request r's tokens are rows
``idx[indptr[r]:indptr[r+1]]`` of ``pool`` [N, 576] fp8 e4m3 (page size 1); query i of a
request of length n sees its first ``n - qlen + i + 1`` tokens; logits are
``q . (k * kv_scale) * scale``, values ``k[:512] * kv_scale``; lse is natural-log.
"""
from __future__ import annotations

import importlib.util
import math
import os
import sys
import types
from dataclasses import dataclass

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEERS_DIR = os.path.join(REPO, ".peers")
VLLM_FILE = os.path.join(PEERS_DIR, "vllm", "triton_decode_attention.py")
FLASHINFER_DIR = os.path.join(PEERS_DIR, "flashinfer")   # holds the unpacked flashinfer/ package
FLASHMLA_DIR = os.path.join(PEERS_DIR, "flashmla")       # the two FlashMLA .so files of the vllm wheel
FLASHMLA_LIBS = ("_flashmla_C.abi3.so", "_flashmla_extension_C.abi3.so")
FLASHMLA_PAGE = 64                                        # the only page size its dense kernels take
FLASHMLA_VLLM_VERSION = "0.26.0"                          # pins torch 2.11 / CUDA 13, as the device has
SITE_DIR = os.environ.get("KIMI_PEERS_SITE", "/tmp/site")  # where setup_peers.sh installs wheels

ALL = ("naive", "flashinfer", "flashinfer_bf16", "flashmla_fp8", "flashmla_bf16", "vllm_triton")


class PeerUnavailable(RuntimeError):
    """A peer cannot run here; the message says why."""


@dataclass
class Case:
    """One input set of one benchmark shape, in our layout."""
    q: torch.Tensor            # [T, H, 576] bf16
    pool: torch.Tensor         # [N, 576] fp8 e4m3
    indptr_list: list          # R + 1 python ints
    idx: torch.Tensor          # [total tokens] int32 rows of pool
    qlen: int
    scale: float
    kv_scale: float
    _fp8_query: tuple | None = None

    @property
    def lens(self):
        p = self.indptr_list
        return [p[r + 1] - p[r] for r in range(len(p) - 1)]

    def fp8_query(self):
        """(q8 [T, H, 576] float8_e4m3fn, q_scale [1] float32): q quantized per tensor, made once
        a case, so FlashMLA's fp8 kernel and kimi_ops' fp8-query path get the same inputs."""
        if self._fp8_query is None:
            self._fp8_query = quantize_q_fp8(self.q)
        return self._fp8_query


def _add_paths():
    """The unpacked flashinfer first (it must win over any installed one); the carried wheels'
    site last, so the device's own packages (torch's packaging, ...) keep precedence."""
    if os.path.isdir(FLASHINFER_DIR) and FLASHINFER_DIR not in sys.path:
        sys.path.insert(0, FLASHINFER_DIR)
    if os.path.isdir(SITE_DIR) and SITE_DIR not in sys.path:
        sys.path.append(SITE_DIR)


# ---------------------------------------------------------------- layout conversions (CPU-testable)

def padded_table(idx: torch.Tensor, indptr_list, width: int | None = None) -> torch.Tensor:
    """[R, width] int32: row r = request r's pool rows, padded with 0 (never read: lengths mask)."""
    lens = [indptr_list[r + 1] - indptr_list[r] for r in range(len(indptr_list) - 1)]
    R = len(lens)
    L = max(lens) if width is None else width
    L = max(L, 1)
    if R and all(n == L for n in lens):
        return idx[: R * L].view(R, L).to(torch.int32).clone()
    t = torch.zeros(R, L, dtype=torch.int32, device=idx.device)
    for r in range(R):
        t[r, : lens[r]] = idx[indptr_list[r]: indptr_list[r + 1]]
    return t


def per_row_extents(lens, qlen: int, device=None) -> torch.Tensor:
    """[R * qlen] int32: how many tokens query row (r, i) sees, n - qlen + i + 1 (>= 0)."""
    n = torch.tensor(lens, dtype=torch.int32, device=device)
    off = torch.arange(1 - qlen, 1, dtype=torch.int32, device=device)
    return (n[:, None] + off[None, :]).flatten().clamp(min=0).to(torch.int32)


def flashinfer_csr(indptr_list, idx: torch.Tensor, qlen: int):
    """FlashInfer page-size-1 CSR metadata: (qo_indptr, kv_indptr, kv_indices, kv_len), int32."""
    dev = idx.device
    R = len(indptr_list) - 1
    qo_indptr = torch.arange(R + 1, dtype=torch.int32, device=dev) * qlen
    kv_indptr = torch.tensor(indptr_list, dtype=torch.int32, device=dev)
    kv_len = kv_indptr[1:] - kv_indptr[:-1]
    return qo_indptr, kv_indptr, idx.to(torch.int32).contiguous(), kv_len.contiguous()


def quantize_q_fp8(q: torch.Tensor):
    """Per-tensor fp8 e4m3 quantization: q_scale = amax|q| / 448 (float32, shape [1], on q's
    device), q8 = fp8(q / q_scale) (round to nearest even, saturated); real q ~ q8 * q_scale."""
    amax = q.abs().amax().float().clamp_min(1e-12)
    q_scale = (amax / 448.0).reshape(1)
    q8 = (q.float() / q_scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q8, q_scale


def page_table(idx: torch.Tensor, indptr_list, num_pool_rows: int, page: int = FLASHMLA_PAGE):
    """[R, max pages] int32 block table into the pool seen as pages of ``page`` rows, if every
    request's rows are whole pages in order (token t of a request is row ``page * table[r, t //
    page] + t % page``; a last partial page is fine) and every page lies inside the first
    ``num_pool_rows // page`` pages; else None. Unused entries are 0 (never read: seqlens bound)."""
    lens = [indptr_list[r + 1] - indptr_list[r] for r in range(len(indptr_list) - 1)]
    width = max([-(-n // page) for n in lens] + [1])
    table = torch.zeros(len(lens), width, dtype=torch.int32, device=idx.device)
    full_pages = num_pool_rows // page
    for r, n in enumerate(lens):
        if n == 0:
            continue
        rows = idx[indptr_list[r]: indptr_list[r] + n].long()
        first = rows[::page]
        expect = first.repeat_interleave(page)[:n] + torch.arange(n, device=idx.device) % page
        if bool((first % page != 0).any()) or not torch.equal(rows, expect) \
                or int(first.max()) // page >= full_pages:
            return None
        table[r, : first.numel()] = (first // page).to(torch.int32)
    return table


def paged_copy(kv: torch.Tensor, idx: torch.Tensor, indptr_list, page: int = FLASHMLA_PAGE):
    """The rows ``kv[idx]`` copied into a cache of pages of their own: (cache [P * page, D] of
    kv's dtype, table [R, max pages] int32), request r's pages consecutive, page-aligned."""
    lens = [indptr_list[r + 1] - indptr_list[r] for r in range(len(indptr_list) - 1)]
    npages = [-(-n // page) for n in lens]
    width = max(npages + [1])
    dev = idx.device
    cache = torch.zeros(max(sum(npages), 1) * page, kv.shape[1], dtype=kv.dtype, device=dev)
    table = torch.zeros(len(lens), width, dtype=torch.int32, device=dev)
    dst, first = [], 0
    for r, n in enumerate(lens):
        table[r, : npages[r]] = torch.arange(first, first + npages[r], dtype=torch.int32, device=dev)
        dst.append(torch.arange(n, device=dev) + first * page)
        first += npages[r]
    if dst:
        cache[torch.cat(dst)] = kv[idx.long()]
    return cache, table


def flashmla_paged(kv: torch.Tensor, c: "Case"):
    """FlashMLA's view of request rows ``c.idx`` of ``kv`` [N, 576] (the fp8 pool or its bf16
    copy): (kcache [pages, 64, 1, 576], block_table [R, max pages] int32, seqlens [R] int32,
    layout) with layout "pool pages" (the pool itself, zero copy) or "paged copy"."""
    table = page_table(c.idx, c.indptr_list, kv.shape[0])
    if table is not None:
        rows = kv.shape[0] // FLASHMLA_PAGE * FLASHMLA_PAGE
        cache, layout = kv[:rows], "pool pages"
    else:
        cache, table = paged_copy(kv, c.idx, c.indptr_list)
        layout = "paged copy"
    seqlens = torch.tensor(c.lens, dtype=torch.int32, device=c.q.device)
    return cache.view(-1, FLASHMLA_PAGE, 1, kv.shape[1]), table, seqlens, layout


def flashmla_to_ours(out: torch.Tensor, lse: torch.Tensor, T: int, H: int):
    """FlashMLA's (out [B, s_q, H, 512], lse [B, H, s_q]) in our row order: o [T, H, 512] and lse
    [B, s_q, H], whose reshape(T, H) is ours. Views only (no kernel, so none enters a timed graph;
    for s_q > 1 lse's reshape would copy, so the check outside timing does it)."""
    return out.reshape(T, H, out.shape[-1]), lse.transpose(1, 2)


_bf16_pools = {}


def bf16_pool(pool: torch.Tensor, kv_scale: float) -> torch.Tensor:
    """The dequantized bf16 copy ``bf16(k8 * kv_scale)`` [N, 576] of an fp8 pool, made once a pool
    (cached by storage; :func:`clear_caches` frees it). Peers reading it use kv_scale 1."""
    key = (pool.data_ptr(), tuple(pool.shape), float(kv_scale))
    if key not in _bf16_pools:
        out = torch.empty(pool.shape, dtype=torch.bfloat16, device=pool.device)
        step = 1 << 18
        for i in range(0, pool.shape[0], step):
            out[i: i + step] = pool[i: i + step].to(torch.bfloat16).mul_(kv_scale)
        _bf16_pools[key] = (pool, out)   # the pool is held so its address stays its own
    return _bf16_pools[key][1]


def clear_caches():
    _bf16_pools.clear()


def vllm_num_kv_splits(max_seq_len: int, num_sms: int) -> int:
    """vLLM TritonMLA's split rule: the power of two >= max_seq_len / 512, at most 2 per SM."""
    want = max(1, max_seq_len // 512)
    p2 = 1 << (want - 1).bit_length()
    return max(1, min(p2, 2 * num_sms))


# ---------------------------------------------------------------- naive torch

def make_naive(c: Case):
    R = len(c.indptr_list) - 1
    lens = c.lens
    L = max(lens)
    H = c.q.shape[1]
    dev = c.q.device
    gidx = padded_table(c.idx, c.indptr_list).long()
    lens_t = torch.tensor(lens, device=dev)
    qq = c.q.view(R, c.qlen * H, 576)
    pos = torch.arange(c.qlen, device=dev).repeat_interleave(H)
    lim = lens_t[:, None] - c.qlen + pos[None, :] + 1                      # [R, qlen*H]
    mask = torch.arange(L, device=dev)[None, None, :] >= lim[:, :, None]

    def f():
        k = c.pool[gidx].to(torch.bfloat16) * c.kv_scale                   # [R, L, 576]
        s = torch.matmul(qq, k.transpose(1, 2)).float() * c.scale           # [R, qlen*H, L]
        s = s.masked_fill(mask, -math.inf)
        lse = torch.logsumexp(s, -1)
        p = torch.softmax(s, -1).nan_to_num(0.0).to(torch.bfloat16)
        o = torch.matmul(p, k[..., :512])
        return o.view(R * c.qlen, H, 512), lse.view(R * c.qlen, H)

    return f


# ---------------------------------------------------------------- vLLM Triton MLA decode

_vllm_mod = None


class _Platform:
    """Stands in for vllm.platforms.current_platform: the one question the kernel file asks."""

    def is_rocm(self):
        return torch.version.hip is not None


def load_vllm_decode(path: str = VLLM_FILE):
    """Import vLLM's triton_decode_attention.py by path, with stand-ins for its vllm imports."""
    global _vllm_mod
    if _vllm_mod is not None:
        return _vllm_mod
    if not os.path.isfile(path):
        raise PeerUnavailable(f"{os.path.relpath(path, REPO)} missing (unpack it from the vllm wheel)")
    import triton
    import triton.language as tl
    stand_ins = {
        "vllm": types.ModuleType("vllm"),
        "vllm.platforms": types.ModuleType("vllm.platforms"),
        "vllm.triton_utils": types.ModuleType("vllm.triton_utils"),
    }
    stand_ins["vllm.platforms"].current_platform = _Platform()
    stand_ins["vllm.triton_utils"].triton = triton
    stand_ins["vllm.triton_utils"].tl = tl
    saved = {k: sys.modules.get(k) for k in stand_ins}
    sys.modules.update(stand_ins)
    try:
        spec = importlib.util.spec_from_file_location("peer_vllm_triton_decode_attention", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    _vllm_mod = mod
    return mod


def vllm_layout(c: Case):
    """vLLM's decode layout: one row per query token, each with its own block-table row and
    extent (what TritonMLA's forward_mqa does for a uniform multi-token block), page size 1."""
    table = padded_table(c.idx, c.indptr_list)
    if c.qlen > 1:
        table = table.repeat_interleave(c.qlen, dim=0).contiguous()
    seq = per_row_extents(c.lens, c.qlen, c.q.device)
    return table, seq


def make_vllm_triton(c: Case, num_sms: int, shared: dict | None = None):
    mod = load_vllm_decode()
    T, H, D = c.q.shape
    table, seq = vllm_layout(c)
    S = vllm_num_kv_splits(max(c.lens), num_sms)
    kbuf = c.pool.view(-1, 1, 1, D)          # [pages, page_size 1, 1 kv head, 576]
    vbuf = kbuf[..., :512]
    shared = {} if shared is None else shared
    key = ("vllm", T, H, S)
    if key not in shared:  # scratch and outputs reused by every set of a shape (calls run in order)
        shared[key] = dict(
            logits=torch.empty(T, H, S, 512 + 1, dtype=torch.float32, device=c.q.device),
            o=torch.empty(T, H, 512, dtype=c.q.dtype, device=c.q.device),
            lse=torch.empty(T, H, dtype=torch.float32, device=c.q.device),
            ks=torch.tensor(float(c.kv_scale), dtype=torch.float32, device=c.q.device),
        )
    b = shared[key]

    def f():
        mod.decode_attention_fwd(c.q, kbuf, vbuf, b["o"], b["lse"], table, seq, b["logits"], S, c.scale,
                                 1, k_scale=b["ks"], v_scale=b["ks"], is_mla=True)
        return b["o"], b["lse"]

    f.num_splits = S
    return f


# ---------------------------------------------------------------- FlashInfer MLA (FA3 on sm_90)

_fi = None


def _preload_cudart():
    """The prebuilt kernel needs libcudart.so.13 by soname; make sure one is loaded (torch's
    bundled copy, else the toolkit's) so dlopen resolves it without LD_LIBRARY_PATH."""
    import ctypes
    import glob
    cands = ["libcudart.so.13"]
    for d in sys.path:
        cands += sorted(glob.glob(os.path.join(d, "nvidia", "cu13", "lib", "libcudart.so.13")))
        cands += sorted(glob.glob(os.path.join(d, "nvidia", "cuda_runtime", "lib", "libcudart.so.13")))
    cands += [os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "lib64", "libcudart.so.13")]
    for c in cands:
        try:
            ctypes.CDLL(c, mode=ctypes.RTLD_GLOBAL)
            return c
        except OSError:
            continue
    return None


def load_flashinfer():
    global _fi
    if _fi is not None:
        return _fi
    _add_paths()
    os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", "/tmp/flashinfer-ws")
    _preload_cudart()
    try:
        import flashinfer
        import flashinfer.mla as fmla
    except Exception as e:  # noqa: BLE001 - any import failure is a reason
        raise PeerUnavailable(f"import flashinfer failed: {type(e).__name__}: {e}") from e
    if not hasattr(fmla, "MLAPlanMetadata"):
        raise PeerUnavailable(f"flashinfer {flashinfer.__version__}: no MLAPlanMetadata (adapter needs >= 0.7)")
    _fi = flashinfer
    return flashinfer


def flashinfer_variant(kv_dtype=torch.float8_e4m3fn) -> str:
    return "flashinfer" if kv_dtype == torch.float8_e4m3fn else "flashinfer (bf16 cache)"


def make_flashinfer(c: Case, shared: dict | None = None, backend: str = "fa3", kv_dtype=torch.float8_e4m3fn):
    """FlashInfer's MLA wrapper on the fp8 pool (kv_dtype float8_e4m3fn: per-tensor ckv / kpe
    scale kv_scale) or on its bf16 copy (kv_dtype bfloat16: :func:`bf16_pool`, no scale)."""
    if kv_dtype not in (torch.float8_e4m3fn, torch.bfloat16):
        raise ValueError(f"make_flashinfer: kv_dtype must be float8_e4m3fn or bfloat16, got {kv_dtype}")
    fi = load_flashinfer()
    fmla = fi.mla
    T, H, D = c.q.shape
    dev = c.q.device
    fp8 = kv_dtype == torch.float8_e4m3fn
    shared = {} if shared is None else shared
    if "fi_ws" not in shared:
        shared["fi_ws"] = torch.empty(512 << 20, dtype=torch.uint8, device=dev)
    qo_indptr, kv_indptr, kv_indices, kv_len = flashinfer_csr(c.indptr_list, c.idx, c.qlen)
    # CUDA-graph mode: plan copies the metadata into these buffers, which the graph then reads.
    w = fmla.BatchMLAPagedAttentionWrapper(
        shared["fi_ws"], use_cuda_graph=True, qo_indptr=torch.empty_like(qo_indptr),
        kv_indptr=torch.empty_like(kv_indptr), kv_indices=torch.empty_like(kv_indices),
        kv_len_arr=torch.empty_like(kv_len), backend=backend)
    w.plan(metadata=fmla.MLAPlanMetadata.csr(qo_indptr, kv_indptr, kv_indices, kv_len),
           num_heads=H, head_dim_ckv=512, head_dim_kpe=64, page_size=1, causal=True, sm_scale=c.scale,
           q_data_type=torch.bfloat16, kv_data_type=kv_dtype, query_layout="packed",
           kv_cache_layout="packed", lse_mode="basee", scale_mode="kv-per-tensor" if fp8 else "default")
    pool = c.pool if fp8 else bf16_pool(c.pool, c.kv_scale)
    kv = pool.view(-1, 1, D)                 # [pages, page_size 1, 576]
    out = torch.empty(T, H, 512, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(T, H, dtype=torch.float32, device=dev)
    scales = dict(ckv_scale=float(c.kv_scale), kpe_scale=float(c.kv_scale)) if fp8 else {}

    def f():
        return w.run(query=c.q, kv_cache=kv, out=out, lse=lse, return_lse=True, return_lse_base_on_e=True,
                     **scales)

    f.wrapper = w
    return f


# ---------------------------------------------------------------- FlashMLA (vllm 0.26.0's build, sm_90a)

_flashmla = None


def load_flashmla(folder: str = FLASHMLA_DIR):
    """Load FlashMLA's two extension libraries; returns (torch.ops._flashmla_C,
    torch.ops._flashmla_extension_C). They use torch's stable C ABI and need libcudart.so.13."""
    global _flashmla
    if _flashmla is not None:
        return _flashmla
    paths = [os.path.join(folder, name) for name in FLASHMLA_LIBS]
    for p in paths:
        if not os.path.isfile(p):
            raise PeerUnavailable(f"{os.path.relpath(p, REPO)} missing (scripts/peers.py prepare takes it "
                                  f"out of the vllm {FLASHMLA_VLLM_VERSION} wheel)")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        raise PeerUnavailable("FlashMLA's dense decode kernels run on sm_90 (Hopper) only")
    _preload_cudart()
    for p in paths:
        try:
            torch.ops.load_library(p)
        except Exception as e:  # noqa: BLE001 - any load failure is a reason
            raise PeerUnavailable(f"loading {os.path.basename(p)} failed: {type(e).__name__}: {e}") from e
    _flashmla = (torch.ops._flashmla_C, torch.ops._flashmla_extension_C)
    return _flashmla


def make_flashmla_bf16(c: Case):
    """``_flashmla_C::dense_decode_fwd`` on the bf16 copy of the cache in 64-row pages, causal
    (query i of s_q sees seqlen - s_q + i + 1 tokens, ours). Its tile-scheduler metadata and
    split offsets come from one call here, outside timing, and are passed to every later call."""
    flash_c, _ = load_flashmla()
    T, H, D = c.q.shape
    R = len(c.indptr_list) - 1
    kcache, table, seqlens, layout = flashmla_paged(bf16_pool(c.pool, c.kv_scale), c)
    q4 = c.q.view(R, c.qlen, H, D)
    _, _, sched, splits = flash_c.dense_decode_fwd(q4, kcache, 512, seqlens, table, c.scale, True,
                                                   None, None, None)

    def f():
        out, lse, _, _ = flash_c.dense_decode_fwd(q4, kcache, 512, seqlens, table, c.scale, True,
                                                  sched, splits, None)
        return flashmla_to_ours(out, lse, T, H)

    f.layout = layout
    return f


def make_flashmla_fp8(c: Case):
    """``_flashmla_extension_C::fwd_kvcache_mla_fp8`` on the fp8 cache in 64-row pages with
    q8 = :meth:`Case.fp8_query` (descale_q = its q_scale, descale_k = kv_scale), causal as ours;
    metadata from ``get_mla_decoding_metadata_dense_fp8(seqlens, qlen * H, 1)`` outside timing."""
    _, flash_x = load_flashmla()
    T, H, D = c.q.shape
    R = len(c.indptr_list) - 1
    kcache, table, seqlens, layout = flashmla_paged(c.pool, c)
    q8, q_scale = c.fp8_query()
    q4 = q8.view(R, c.qlen, H, D)
    k_scale = torch.tensor([float(c.kv_scale)], dtype=torch.float32, device=c.q.device)
    sched, splits = flash_x.get_mla_decoding_metadata_dense_fp8(seqlens, c.qlen * H, 1)

    def f():
        out, lse = flash_x.fwd_kvcache_mla_fp8(q4, kcache, 512, seqlens, table, c.scale, True, sched, splits,
                                               q_scale, k_scale)
        return flashmla_to_ours(out, lse, T, H)

    f.layout = layout
    return f


# ---------------------------------------------------------------- float32 reference (the accuracy check)

def reference_f32(c: Case, q: torch.Tensor | None = None, q_scale: torch.Tensor | None = None):
    """Float32 attention on the case's cache, in our semantics: (o [T, H, 512] f32, lse [T, H] f32),
    one request at a time. ``q``: another query of q's shape (an fp8 one with ``q_scale``: real
    q = q8 * q_scale); default the case's bf16 q."""
    q = c.q if q is None else q
    qf = q.float() if q_scale is None else q.float() * q_scale.float()
    T, H, _ = q.shape
    L = c.qlen
    o = torch.zeros(T, H, 512, dtype=torch.float32, device=q.device)
    lse = torch.full((T, H), -math.inf, dtype=torch.float32, device=q.device)
    for r, n in enumerate(c.lens):
        if n == 0:
            continue
        s = c.indptr_list[r]
        k = c.pool[c.idx[s: s + n].long()].float() * c.kv_scale               # [n, 576]
        logits = torch.einsum("lhd,nd->lhn", qf[r * L: (r + 1) * L], k) * c.scale
        vis = n - L + 1 + torch.arange(L, device=q.device)                     # tokens query i sees
        mask = torch.arange(n, device=q.device)[None, :] >= vis[:, None]
        logits = logits.masked_fill(mask[:, None, :], -math.inf)
        lr = torch.logsumexp(logits, -1)                                       # [L, H]
        p = torch.exp(logits - lr[..., None]).nan_to_num(0.0)
        o[r * L: (r + 1) * L] = torch.einsum("lhn,nd->lhd", p, k[:, :512])
        lse[r * L: (r + 1) * L] = lr
    return o, lse


# ---------------------------------------------------------------- comparison

def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a = a.float()
    b = b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def lse_max_abs(a, b) -> float | None:
    if a is None or b is None:
        return None
    a = a.float().reshape(b.shape)
    b = b.float()
    fin = torch.isfinite(b)
    if not bool(fin.any()):
        return 0.0
    return float((a[fin] - b[fin]).abs().max())


# ---------------------------------------------------------------- preparing .peers/ (run here, not on the device)

FI_MLA_SOURCES = ("batch_mla_config.jinja", "batch_mla_sm90_plan.cu", "batch_mla_sm90_run.cu",
                  "batch_mla_sm90_binding.cu")


def trim_flashinfer(src_root: str, dst_root: str, imported_files: list, aot_sos=()) -> int:
    """Copy the parts of an unpacked flashinfer-python that the MLA decode path needs: the Python
    modules that importing flashinfer + its MLA wrapper loads (``imported_files``), everything
    under flashinfer/mla and flashinfer/jit, every package's __init__.py, the four MLA sm_90
    sources that module generation reads, and the prebuilt kernels ``aot_sos`` as AOT modules
    (``data/aot/<name>/<name>.so``, which FlashInfer loads without building). Returns bytes."""
    import shutil
    src_pkg = os.path.join(src_root, "flashinfer")
    keep = set(os.path.abspath(f) for f in imported_files)
    for d, _, files in os.walk(src_pkg):
        rel = os.path.relpath(d, src_pkg)
        if rel.split(os.sep)[0] == "data":
            continue
        for fn in files:
            p = os.path.abspath(os.path.join(d, fn))
            top = rel.split(os.sep)[0]
            if fn == "__init__.py" or fn == "py.typed" or (fn.endswith(".py") and top in ("mla", "jit", ".")) \
                    or p in keep:
                keep.add(p)
    for fn in FI_MLA_SOURCES:
        keep.add(os.path.join(src_pkg, "data", "csrc", fn))
    total = 0
    for p in sorted(keep):
        q = os.path.join(dst_root, "flashinfer", os.path.relpath(p, src_pkg))
        os.makedirs(os.path.dirname(q), exist_ok=True)
        shutil.copy2(p, q)
        total += os.path.getsize(p)
    for so in aot_sos:
        name = os.path.basename(so)[:-3]
        q = os.path.join(dst_root, "flashinfer", "data", "aot", name, name + ".so")
        os.makedirs(os.path.dirname(q), exist_ok=True)
        shutil.copy2(so, q)
        total += os.path.getsize(so)
    return total


def extract_flashmla(wheel: str, dst: str) -> int:
    """Copy FlashMLA's two libraries (``vllm/<FLASHMLA_LIBS>``) out of a vllm wheel into dst;
    returns bytes."""
    import zipfile
    os.makedirs(dst, exist_ok=True)
    total = 0
    with zipfile.ZipFile(wheel) as z:
        for name in FLASHMLA_LIBS:
            data = z.read(f"vllm/{name}")
            with open(os.path.join(dst, name), "wb") as f:
                f.write(data)
            total += len(data)
    return total


FI_VERSION = "0.7.4"
VLLM_VERSION = "0.33.0"   # the Triton decode file's release (FlashMLA's: FLASHMLA_VLLM_VERSION)
FI_DEPS = ("apache-tvm-ffi==0.1.15.post2", "packaging==26.4", "requests==2.34.2", "urllib3==2.8.0", "idna==3.20",
           "certifi==2026.10.19.post1", "nvidia-ml-py==13.615.71", "tqdm==4.70.1", "einops==0.8.2",
           "tabulate==0.10.0")
TEST_DEPS = ("expecttest==0.3.0",)   # the device image lacks it (hypothesis it has)
DEVICE_PIP = ("--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
              "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
              "--platform", "manylinux2014_x86_64", "--platform", "any")

# FlashInfer's MLA modules to prebuild: (q, kv, o) dtypes, the fp8 cache's and the bf16 copy's.
FI_MODULES = (("bfloat16", "float8_e4m3fn", "bfloat16"), ("bfloat16", "bfloat16", "bfloat16"))

_FI_PROBE = r"""
import json, sys, torch
import flashinfer, flashinfer.mla
from flashinfer.mla._batch_mla._backends import fa3_backend, _fa_common  # noqa: F401
from flashinfer.jit import gen_batch_mla_module
sos = []
for dq, dkv, do in json.loads(sys.argv[2]):
    spec = gen_batch_mla_module("fa3", getattr(torch, dq), getattr(torch, dkv), getattr(torch, do), torch.int32,
                                512, 64, False)
    spec.build()
    sos.append(str(spec.jit_library_path))
files = [m.__file__ for k, m in list(sys.modules.items()) if k.startswith("flashinfer") and getattr(m, "__file__", None)]
json.dump(dict(files=files, sos=sos), open(sys.argv[1], "w"))
"""


def prepare(work: str, python: str, jobs: int = 2, repo: str = REPO) -> None:
    """Fill ``repo``/.whl/ (device wheels: FlashInfer's dependencies, the test dependencies the
    device lacks) and ``repo``/.peers/ (vLLM's Triton kernel file, FlashMLA's two libraries, a
    trimmed FlashInfer with its sm_90a MLA kernels prebuilt for the fp8 and the bf16 cache) on a
    machine without a GPU. ``python``: an interpreter with a CUDA build of torch (for FlashInfer's
    JIT); nvcc from CUDA_HOME (default /usr/local/cuda). Slow part: the kernel builds."""
    import glob
    import json
    import shutil
    import subprocess
    import zipfile
    whl = os.path.join(repo, ".whl")
    peers_dir = os.path.join(repo, ".peers")
    vllm_file = os.path.join(peers_dir, "vllm", os.path.basename(VLLM_FILE))
    fi_dir = os.path.join(peers_dir, "flashinfer")
    os.makedirs(work, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "download", "-q", "-d"]
    subprocess.run(pip + [whl, *DEVICE_PIP, *FI_DEPS, *TEST_DEPS], check=True)
    subprocess.run(pip + [work, *DEVICE_PIP, f"flashinfer-python=={FI_VERSION}", f"vllm=={VLLM_VERSION}"], check=True)
    subprocess.run(pip + [work, *DEVICE_PIP, f"vllm=={FLASHMLA_VLLM_VERSION}"], check=True)  # one version a call
    with zipfile.ZipFile(glob.glob(os.path.join(work, f"vllm-{VLLM_VERSION}-*.whl"))[0]) as z:
        os.makedirs(os.path.dirname(vllm_file), exist_ok=True)
        with open(vllm_file, "wb") as f:
            f.write(z.read("vllm/v1/attention/ops/triton_decode_attention.py"))
    n_mla = extract_flashmla(glob.glob(os.path.join(work, f"vllm-{FLASHMLA_VLLM_VERSION}-*.whl"))[0],
                             os.path.join(peers_dir, "flashmla"))
    src = os.path.join(work, "flashinfer-src")
    with zipfile.ZipFile(glob.glob(os.path.join(work, f"flashinfer_python-{FI_VERSION}-*.whl"))[0]) as z:
        z.extractall(src)
    site = os.path.join(work, "site")  # the same dependencies, for the local interpreter
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--upgrade", "--target", site, *FI_DEPS],
                   check=True)
    stub = os.path.join(work, "cudastub")  # link-time stand-in for the driver library (no GPU here)
    os.makedirs(stub, exist_ok=True)
    subprocess.run(["gcc", "-shared", "-Wl,-soname,libcuda.so.1", "-o", os.path.join(stub, "libcuda.so"),
                    "-x", "c", "/dev/null"], check=True)
    cuda = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    env = dict(os.environ, PYTHONPATH=f"{src}:{site}", FLASHINFER_CUDA_ARCH_LIST="9.0a", CUDA_HOME=cuda,
               FLASHINFER_WORKSPACE_BASE=os.path.join(work, "ws"), MAX_JOBS=str(jobs),
               LIBRARY_PATH=stub + (":" + os.environ["LIBRARY_PATH"] if "LIBRARY_PATH" in os.environ else ""),
               PATH=f"{cuda}/bin:" + os.environ.get("PATH", ""))
    probe = os.path.join(work, "probe.json")
    subprocess.run([python, "-c", _FI_PROBE, probe, json.dumps(FI_MODULES)], env=env, check=True)
    with open(probe) as f:
        info = json.load(f)
    shutil.rmtree(fi_dir, ignore_errors=True)
    n = trim_flashinfer(src, fi_dir, info["files"], info["sos"])
    print(f"{os.path.relpath(fi_dir, repo)}: {n / 1e6:.1f} MB ({len(info['sos'])} prebuilt kernels); "
          f".peers/flashmla: {n_mla / 1e6:.1f} MB; {os.path.relpath(vllm_file, repo)}")


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description="prepare .whl/ and .peers/ for the device (run here, not there)")
    ap.add_argument("command", choices=["prepare"])
    ap.add_argument("--work", default="/tmp/kimi-peers-work")
    ap.add_argument("--python", default=sys.executable, help="a Python with a CUDA torch (FlashInfer's JIT)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--repo", default=REPO, help="the checkout whose .whl/ and .peers/ to fill (default: this one)")
    a = ap.parse_args()
    prepare(a.work, a.python, a.jobs, os.path.abspath(a.repo))
