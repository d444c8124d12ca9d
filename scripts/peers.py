"""Peer MLA decode implementations for scripts/bench_attention.py, behind one interface.

Each ``make_<peer>(case)`` builds everything a peer needs for one input set (its own index
layout, workspaces, plans) OUTSIDE any timed region and returns a closure ``f() -> (o, lse)``
(``lse`` may be None) that only launches the peer's kernels, so the benchmark can capture it
in a CUDA graph like ours. Anything that goes wrong raises :class:`PeerUnavailable` (or any
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
SITE_DIR = os.environ.get("KIMI_PEERS_SITE", "/tmp/site")  # where setup_peers.sh installs wheels

ALL = ("naive", "flashinfer", "vllm_triton")


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

    @property
    def lens(self):
        p = self.indptr_list
        return [p[r + 1] - p[r] for r in range(len(p) - 1)]


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


def make_flashinfer(c: Case, shared: dict | None = None, backend: str = "fa3"):
    fi = load_flashinfer()
    fmla = fi.mla
    T, H, D = c.q.shape
    dev = c.q.device
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
           q_data_type=torch.bfloat16, kv_data_type=c.pool.dtype, query_layout="packed",
           kv_cache_layout="packed", lse_mode="basee", scale_mode="kv-per-tensor")
    kv = c.pool.view(-1, 1, D)               # [pages, page_size 1, 576]
    out = torch.empty(T, H, 512, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(T, H, dtype=torch.float32, device=dev)

    def f():
        return w.run(query=c.q, kv_cache=kv, out=out, lse=lse, return_lse=True, return_lse_base_on_e=True,
                     ckv_scale=float(c.kv_scale), kpe_scale=float(c.kv_scale))

    f.wrapper = w
    return f


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


def trim_flashinfer(src_root: str, dst_root: str, imported_files: list, aot_so: str | None = None) -> int:
    """Copy the parts of an unpacked flashinfer-python that the MLA decode path needs: the Python
    modules that importing flashinfer + its MLA wrapper loads (``imported_files``), everything
    under flashinfer/mla and flashinfer/jit, every package's __init__.py, the four MLA sm_90
    sources that module generation reads, and (optionally) a prebuilt kernel as an AOT module
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
    if aot_so:
        name = os.path.basename(aot_so)[:-3]
        q = os.path.join(dst_root, "flashinfer", "data", "aot", name, name + ".so")
        os.makedirs(os.path.dirname(q), exist_ok=True)
        shutil.copy2(aot_so, q)
        total += os.path.getsize(aot_so)
    return total


FI_VERSION = "0.7.4"
VLLM_VERSION = "0.33.0"
FI_DEPS = ("apache-tvm-ffi==0.1.15.post2", "packaging==26.4", "requests==2.34.2", "urllib3==2.8.0", "idna==3.20",
           "certifi==2026.10.19.post1", "nvidia-ml-py==13.615.71", "tqdm==4.70.1", "einops==0.8.2",
           "tabulate==0.10.0")
DEVICE_PIP = ("--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
              "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
              "--platform", "manylinux2014_x86_64", "--platform", "any")

_FI_PROBE = r"""
import json, sys, torch
import flashinfer, flashinfer.mla
from flashinfer.mla._batch_mla._backends import fa3_backend, _fa_common  # noqa: F401
from flashinfer.jit import gen_batch_mla_module
spec = gen_batch_mla_module("fa3", torch.bfloat16, torch.float8_e4m3fn, torch.bfloat16, torch.int32, 512, 64, False)
spec.build()
files = [m.__file__ for k, m in list(sys.modules.items()) if k.startswith("flashinfer") and getattr(m, "__file__", None)]
json.dump(dict(files=files, so=str(spec.jit_library_path)), open(sys.argv[1], "w"))
"""


def prepare(work: str, python: str, jobs: int = 2) -> None:
    """Fill .whl/ (device wheels of FlashInfer's dependencies) and .peers/ (vLLM's kernel file, a
    trimmed FlashInfer with its sm_90a MLA kernel prebuilt) on a machine without a GPU.
    ``python``: an interpreter with a CUDA build of torch (for FlashInfer's JIT); nvcc from
    CUDA_HOME (default /usr/local/cuda). Slow part: the kernel build, ~3 min on 2 cores."""
    import glob
    import json
    import shutil
    import subprocess
    import zipfile
    os.makedirs(work, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "download", "-q", "-d"]
    subprocess.run(pip + [os.path.join(REPO, ".whl"), *DEVICE_PIP, *FI_DEPS], check=True)
    subprocess.run(pip + [work, *DEVICE_PIP, f"flashinfer-python=={FI_VERSION}", f"vllm=={VLLM_VERSION}"], check=True)
    with zipfile.ZipFile(glob.glob(os.path.join(work, f"vllm-{VLLM_VERSION}-*.whl"))[0]) as z:
        os.makedirs(os.path.dirname(VLLM_FILE), exist_ok=True)
        with open(VLLM_FILE, "wb") as f:
            f.write(z.read("vllm/v1/attention/ops/triton_decode_attention.py"))
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
    subprocess.run([python, "-c", _FI_PROBE, probe], env=env, check=True)
    with open(probe) as f:
        info = json.load(f)
    shutil.rmtree(FLASHINFER_DIR, ignore_errors=True)
    n = trim_flashinfer(src, FLASHINFER_DIR, info["files"], info["so"])
    print(f"{os.path.relpath(FLASHINFER_DIR, REPO)}: {n / 1e6:.1f} MB; {os.path.relpath(VLLM_FILE, REPO)}")


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description="prepare .whl/ and .peers/ for the device (run here, not there)")
    ap.add_argument("command", choices=["prepare"])
    ap.add_argument("--work", default="/tmp/kimi-peers-work")
    ap.add_argument("--python", default=sys.executable, help="a Python with a CUDA torch (FlashInfer's JIT)")
    ap.add_argument("--jobs", type=int, default=2)
    a = ap.parse_args()
    prepare(a.work, a.python, a.jobs)
