"""fp8 block-scaled weights: the checkpoint format (``*.weight`` fp8 + ``*.weight_scale_inv``),
``MLADecodeLayer(weights="fp8")``, and the op ``kimi_ops.gemm_a16w8_block``.

The checkpoint is written here, by a quantizer of this file's own (block amax / 448, torch's
fp8 cast), to a small safetensors file with HF names and an unsharded (TP 2) layout; the
oracle is float64: the checkpoint's bytes decoded by :func:`test_runtime.e4m3_decode` (the
format's bit fields) times the blocks' scales, and the whole layer computed from those weights
by :func:`test_runtime.reference_step` (un-absorbed attention, explicit softmax).

CPU (CI): the reference backend; the Triton kernel under ``TRITON_INTERPRET=1`` in a
subprocess (TRITON_INTERPRET must be set before the kernels are decorated). GPU (skipped
without CUDA): the kernel at Kimi-K3's shapes, and the fp8 layer captured in a CUDA graph.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

import kimi_ops
from kimi_ops.runtime import MLAConfig, MLADecodeLayer, random_hf_weights
from kimi_ops.runtime.graph import GraphedStep
from test_runtime import LAYER_RTOL, SMALL, check_step, e4m3_decode, fp8_dense64, make_step, weights64

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
PREFIX = "model.layers.3.self_attn."


@pytest.fixture(autouse=True)
def _reference_backend(monkeypatch):
    monkeypatch.setenv("KIMI_OPS_BACKEND", "reference")


# --- a checkpoint written here ------------------------------------------------------------------

def quantize_blocks(w: torch.Tensor, bn: int, bk: int):
    """Block-wise fp8: scale = block amax / 448 (1 for a zero block), fp8(w / scale). A loop over
    the blocks, so it shares nothing with kimi_ops.reference.fp8."""
    n, k = w.shape
    scales = torch.ones(math.ceil(n / bn), math.ceil(k / bk), dtype=torch.float32)
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            blk = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float()
            amax = float(blk.abs().max())
            if amax > 0:
                scales[i, j] = amax / 448.0
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (blk / scales[i, j]).to(torch.float8_e4m3fn)
    return q, scales


def write_checkpoint(path, full: MLAConfig, *, block=(128, 128), seed=0, fp8_gate=True):
    """An unsharded fp8 checkpoint of ``full``'s layer (all heads) in a safetensors file, HF names under
    PREFIX, q_a / kv_a unfused. Returns the float64 dequantized weights, HF names."""
    from safetensors.torch import save_file
    gen = torch.Generator().manual_seed(seed)
    c = full
    heads = c.total_heads

    def linear(rows, cols):
        return torch.randn(rows, cols, generator=gen) / math.sqrt(cols)

    dense = {
        "q_a_proj": linear(c.q_lora_rank, c.hidden_size),
        "kv_a_proj_with_mqa": linear(512 + 64, c.hidden_size),
        "q_b_proj": linear(heads * c.qk_head_dim, c.q_lora_rank),
        "kv_b_proj": linear(heads * (c.qk_nope_head_dim + c.v_head_dim), 512),
        "o_proj": linear(c.hidden_size, heads * c.v_head_dim),
    }
    if c.gate:
        dense["g_proj"] = linear(heads * c.v_head_dim, c.hidden_size)
    files, w64 = {}, {}
    for name, w in dense.items():
        if name == "g_proj" and not fp8_gate:
            files[PREFIX + name + ".weight"] = w.to(torch.bfloat16)
            w64[name] = w.to(torch.bfloat16).double()
            continue
        q, s = quantize_blocks(w, *block)
        files[PREFIX + name + ".weight"] = q
        files[PREFIX + name + ".weight_scale_inv"] = s
        w64[name] = fp8_dense64(q, s, *block)
    for name, n in (("q_a_layernorm", c.q_lora_rank), ("kv_a_layernorm", 512)):
        files[PREFIX + name + ".weight"] = (1 + 0.1 * torch.randn(n, generator=gen)).to(torch.bfloat16)
        w64[name] = files[PREFIX + name + ".weight"].double()
    files["model.layers.4.self_attn.q_b_proj.weight"] = torch.zeros(3, 3)    # another layer: not ours
    save_file(files, os.fspath(path))
    return w64, files


def rank_weights64(w64, c: MLAConfig, rank: int):
    """The float64 weights of tensor-parallel rank ``rank`` (weights64's keys)."""
    h, nope, v = c.num_heads, c.qk_nope_head_dim, c.v_head_dim
    kv_b = w64["kv_b_proj"][rank * h * (nope + v):(rank + 1) * h * (nope + v)].view(h, nope + v, 512)
    return dict(qkv=torch.cat([w64["q_a_proj"], w64["kv_a_proj_with_mqa"]], 0),
                gate=w64["g_proj"][rank * h * v:(rank + 1) * h * v] if c.gate else None,
                q_a_norm=w64["q_a_layernorm"], kv_a_norm=w64["kv_a_layernorm"],
                q_b=w64["q_b_proj"][rank * h * c.qk_head_dim:(rank + 1) * h * c.qk_head_dim],
                w_uk=kv_b[:, :nope], w_uv=kv_b[:, nope:], o=w64["o_proj"][:, rank * h * v:(rank + 1) * h * v])


def tp2_config(block=(64, 64), **kw):
    return MLAConfig.small(heads=4, **kw).replace(tp=2, quantization_config={
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)})


# --- the layer ----------------------------------------------------------------------------------

@pytest.mark.parametrize("weights", ["fp8", "bf16", "mxfp4"])
@pytest.mark.parametrize("merge_gate", [True, False])
def test_fp8_checkpoint_file_loads_and_matches_float64(tmp_path, weights, merge_gate):
    config = tp2_config()
    path = tmp_path / "model-00001-of-00001.safetensors"
    w64, files = write_checkpoint(path, config.replace(tp=1), block=(64, 64), seed=7)
    layer, cache, md, hidden, bt = make_step(config, SMALL, qlen=2, weights=weights, seed=1, merge_gate=merge_gate)
    layer.load_weights(path, prefix=PREFIX, tp_rank=1, strict=False)   # strict=False: the other layer's key
    ref_w = rank_weights64(w64, config, rank=1)
    if weights == "fp8":
        # the checkpoint's own bytes and scales, this rank's rows (q_b rows 384:768, o_proj columns 256:512)
        q_b = files[PREFIX + "q_b_proj.weight"][384:]
        assert torch.equal(layer.q_b_proj.weight.view(torch.uint8), q_b.view(torch.uint8))
        assert torch.equal(layer.q_b_proj.weight_scale_inv, files[PREFIX + "q_b_proj.weight_scale_inv"][6:])
        assert torch.equal(layer.o_proj.weight.view(torch.uint8),
                           files[PREFIX + "o_proj.weight"][:, 256:].contiguous().view(torch.uint8))
        assert layer.fused_qkv_a_proj.weight.dtype == torch.float8_e4m3fn
        w = weights64(layer)
        for key in ("qkv", "gate", "q_b", "o"):
            assert torch.equal(w[key], ref_w[key]), f"{key}: the layer applies exactly the checkpoint's weights"
        check_step(layer, cache, md, hidden, bt, SMALL, w=ref_w)
    elif weights == "bf16":
        w = weights64(layer)
        for key in ("qkv", "gate", "q_b", "o", "w_uk", "w_uv"):
            assert torch.equal(w[key], ref_w[key].to(torch.bfloat16).double()), f"{key}: bf16 of the dequantized"
        check_step(layer, cache, md, hidden, bt, SMALL, w=ref_w)
    else:   # MXFP4 W_UK / W_UV quantize the dequantized kv_b: hold the layer to its own weights
        w = weights64(layer)
        assert torch.equal(w["q_b"], ref_w["q_b"].to(torch.bfloat16).double())
        check_step(layer, cache, md, hidden, bt, SMALL)


def test_strict_load_names_the_unexpected_keys(tmp_path):
    from safetensors.torch import load_file
    config = tp2_config()
    path = tmp_path / "ckpt.safetensors"
    write_checkpoint(path, config.replace(tp=1), block=(64, 64))
    layer = MLADecodeLayer(config, weights="fp8", seed=None)
    sd = load_file(os.fspath(path))
    sd[PREFIX + "o_proj.input_scale"] = torch.ones(())      # static activation scales: not taken
    with pytest.raises(KeyError, match=r"unexpected keys \['o_proj.input_scale'\]"):
        layer.load_weights(sd, prefix=PREFIX, tp_rank=0)
    layer.load_weights(path, prefix=PREFIX, tp_rank=0)      # every key of layer 3 is used


def test_bf16_gate_in_an_fp8_checkpoint_is_quantized(tmp_path):
    config = tp2_config()
    path = tmp_path / "ckpt.safetensors"
    w64, _ = write_checkpoint(path, config.replace(tp=1), block=(64, 64), fp8_gate=False)
    layer = MLADecodeLayer(config, weights="fp8", seed=None).load_weights(path, prefix=PREFIX, tp_rank=0,
                                                                          strict=False)
    gate = weights64(layer)["gate"]
    ref = w64["g_proj"][:256]
    blocks = ref.abs().view(4, 64, 4, 64).amax(dim=(1, 3)).repeat_interleave(64, 0).repeat_interleave(64, 1)
    # e4m3 rounding of w / s, s = block amax / 448: half an ulp, 2^-4 relative (2^-10 s below 2^-6)
    assert ((gate - ref).abs() <= 2.0 ** -4 * ref.abs() + 2.0 ** -10 * blocks / 448).all(), "fp8 of its own blocks"
    assert torch.equal(layer.fused_qkv_a_proj.weight_scale_inv[-4:].float(),
                       (w64["g_proj"][:256].float().abs().view(4, 64, 4, 64).amax(dim=(1, 3)) / 448))


def test_kimi_k3_fused_scale_grid():
    """Kimi-K3's [q_a 1536 | kv_a 576 | gate 1536] rows: kv_a ends mid-block, so the fused
    weight keeps one scale row per 64 rows, each 128-row block's scale twice; the checkpoint
    format comes back out of hf_state_dict."""
    c = MLAConfig.kimi_k3()
    layer = MLADecodeLayer(c, weights="fp8", seed=3)
    fused = layer.fused_qkv_a_proj
    assert fused.weight.shape == (3648, 7168) and fused.weight.dtype == torch.float8_e4m3fn
    assert fused.block_n == 64 and fused.weight_scale_inv.shape == (57, 56)
    sd = layer.hf_state_dict()
    assert sd["kv_a_proj_with_mqa.weight_scale_inv"].shape == (5, 56) and sd["q_a_proj.weight_scale_inv"].shape == (12, 56)
    assert torch.equal(fused.weight_scale_inv[24:33:2], sd["kv_a_proj_with_mqa.weight_scale_inv"])
    assert torch.equal(fused.weight_scale_inv[25:32:2], sd["kv_a_proj_with_mqa.weight_scale_inv"][:4])
    again = MLADecodeLayer(c, weights="fp8", seed=None).load_weights(sd)
    for a, b in zip(layer.buffers(), again.buffers()):
        assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a, b.view(torch.uint8)
                           if b.element_size() == 1 else b)
    bf16 = MLADecodeLayer(c, weights="bf16", seed=3)
    assert layer.weight_bytes() < 0.53 * bf16.weight_bytes()


def test_tp_cut_that_splits_a_block_is_refused():
    full = MLAConfig.small(heads=4)                       # q_b 192 rows a head: 128-row blocks straddle heads
    sd = random_hf_weights(full, seed=2, fp8=True)
    rank = full.replace(tp=4)
    with pytest.raises(ValueError, match=r"rows 192:384 of q_b_proj split a 128-row fp8 scale block"):
        MLADecodeLayer(rank, weights="fp8", seed=None).load_weights(sd, tp_rank=1)
    with pytest.raises(ValueError, match="split a 128-row fp8 scale block"):
        MLADecodeLayer(rank, weights="bf16", seed=None).load_weights(sd, tp_rank=0)
    # the same cut of a bf16 checkpoint is fine
    MLADecodeLayer(rank, weights="fp8", seed=None).load_weights(random_hf_weights(full, seed=2), tp_rank=1)
    # o_proj's columns (128 a head) on 128-column blocks: TP 2 cuts fine, 96-wide blocks do not
    cfg96 = MLAConfig.small(heads=4).replace(quantization_config={"weight_block_size": [64, 96]})
    sd96 = random_hf_weights(cfg96, seed=2, fp8=True)
    with pytest.raises(ValueError, match="columns 256:512 of o_proj split a 96-column"):
        MLADecodeLayer(cfg96.replace(tp=2), weights="fp8", seed=None).load_weights(sd96, tp_rank=1)


def test_bad_fp8_checkpoints():
    c = MLAConfig.small()
    sd = random_hf_weights(c, seed=1, fp8=True)
    layer = MLADecodeLayer(c, weights="fp8", seed=None)
    with pytest.raises(ValueError, match="without q_b_proj.weight_scale_inv"):
        layer.load_weights({k: v for k, v in sd.items() if k != "q_b_proj.weight_scale_inv"})
    bad = dict(sd, **{"q_b_proj.weight_scale_inv": torch.ones(3, 1)})
    with pytest.raises(ValueError, match=r"q_b_proj.weight_scale_inv must be \[ceil\(768 / 128\)"):
        layer.load_weights(bad)
    bad = dict(random_hf_weights(c, seed=1), **{"o_proj.weight_scale_inv": torch.ones(2, 4)})
    with pytest.raises(ValueError, match="with o_proj.weight_scale_inv"):
        layer.load_weights(bad)
    # a 64-block config refuses 128-block scales
    c64 = c.replace(quantization_config={"weight_block_size": [64, 64]})
    with pytest.raises(ValueError, match="weight_block_size 64 x 64"):
        MLADecodeLayer(c64, weights="fp8", seed=None).load_weights(sd)


def test_weight_block_size_from_quantization_config():
    assert MLAConfig.small().weight_block_size == (128, 128)
    c = tp2_config(block=(64, 32))
    assert c.weight_block_size == (64, 32)
    assert dict(c.quantization_config)["quant_method"] == "fp8"
    hash(c)   # stays hashable (torch.compile guards on the layer's config)
    layer = MLADecodeLayer(c, weights="fp8")
    assert layer.q_b_proj.weight_scale_inv.shape == (384 // 64, 128 // 32)
    with pytest.raises(ValueError, match="weight_block_size"):
        MLAConfig.small().replace(quantization_config={"weight_block_size": [0, 128]})


def test_fp8_layer_from_bf16_weights_quantizes_per_block():
    c = MLAConfig.small()
    sd = random_hf_weights(c, seed=4)
    layer = MLADecodeLayer(c, weights="fp8", seed=None).load_weights(sd)
    w = e4m3_decode(layer.q_b_proj.weight)
    s = layer.q_b_proj.weight_scale_inv.double()
    ref = sd["q_b_proj.weight"].double()
    amax = ref.abs().view(6, 128, 1, 128).amax(dim=(1, 3))
    assert torch.allclose(s, (amax.float() / 448).double())
    deq = w * s.repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert ((deq - ref).abs() <= 2.0 ** -4 * ref.abs() + 2.0 ** -9 * s.max()).all()


def test_fp8_merged_and_separate_gate_agree():
    a = make_step(MLAConfig.small(), SMALL, weights="fp8", merge_gate=True)
    b = make_step(MLAConfig.small(), SMALL, weights="fp8", merge_gate=False)
    assert b[0].g_proj.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(a[0](a[3], a[1], a[2]), b[0](b[3], b[1], b[2]))


# --- the op -------------------------------------------------------------------------------------

def gemm64(x, w, s, bn, bk):
    return x.double() @ fp8_dense64(w, s, bn, bk).T


def random_fp8(n, k, bn, bk, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.exp(torch.randn(n, 1, generator=gen))
    return quantize_blocks(w, bn, bk)


GEMM_CASES = [(1, 200, 300, 128, 128), (7, 576, 256, 128, 128), (33, 96, 192, 64, 64), (4, 64, 160, 32, 32)]


@pytest.mark.parametrize("m,n,k,bn,bk", GEMM_CASES)
def test_gemm_reference_matches_float64(m, n, k, bn, bk):
    w, s = random_fp8(n, k, bn, bk, seed=m)
    x = torch.randn(m, k).to(torch.bfloat16)
    y = kimi_ops.gemm_a16w8_block(x, w, s, block_n=bn, block_k=bk)
    ref = gemm64(x, w, s, bn, bk)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert ((y.double() - ref).abs() <= 2.0 ** -8 * ref.abs() + 1e-5 * ref.abs().max()).all()


def test_gemm_errors():
    w, s = random_fp8(64, 128, 128, 128, seed=0)
    x = torch.randn(2, 128).to(torch.bfloat16)
    with pytest.raises(ValueError, match="x must be a bf16"):
        kimi_ops.gemm_a16w8_block(x.float(), w, s)
    with pytest.raises(ValueError, match="w must be an fp8"):
        kimi_ops.gemm_a16w8_block(x, w.to(torch.bfloat16), s)
    with pytest.raises(ValueError, match="K must agree"):
        kimi_ops.gemm_a16w8_block(x[:, :64], w, s)
    with pytest.raises(ValueError, match=r"w_scale_inv must be float32 \[ceil\(N / block_n\), ceil\(K / block_k\)\] = \[2, 4\]"):
        kimi_ops.gemm_a16w8_block(x, w, s, block_n=32, block_k=32)


def test_gemm_schema_opcheck_and_compile():
    assert str(torch.ops.kimi_ops.gemm_a16w8_block.default._schema) == (
        "kimi_ops::gemm_a16w8_block(Tensor x, Tensor w, Tensor w_scale_inv, *, int block_n=128, int block_k=128, "
        "bool constant_w=False) -> Tensor")
    devices = ["cpu"] + (["cuda"] if HAS_CUDA else [])
    for dev in devices:
        w, s = random_fp8(192, 256, 128, 128, seed=3)
        w, s = w.to(dev), s.to(dev)
        x = torch.randn(5, 256).to(torch.bfloat16).to(dev)
        # test_schema's SchemaCheckMode cannot take fp8 tensors: the other three, and bytes by hand
        for kwargs in ({"block_n": 128}, {"block_n": 128, "constant_w": True}):
            torch.library.opcheck(torch.ops.kimi_ops.gemm_a16w8_block.default, (x, w, s), kwargs,
                                  test_utils=("test_autograd_registration", "test_faketensor",
                                              "test_aot_dispatch_dynamic"))
        assert torch.equal(kimi_ops.gemm_a16w8_block(x, w, s, constant_w=True), kimi_ops.gemm_a16w8_block(x, w, s))
        before = [t.clone().view(torch.uint8) if t.element_size() == 1 else t.clone() for t in (x, w, s)]
        kimi_ops.gemm_a16w8_block(x, w, s)
        after = [t.view(torch.uint8) if t.element_size() == 1 else t for t in (x, w, s)]
        assert all(torch.equal(a, b) for a, b in zip(before, after)), "no argument changes"

        def fn(x, w, s):
            # exact epilogue ops only (a power-of-two scale, relu): Inductor's fused sigmoid differs
            # from eager's by an ulp on the GPU, which would hide nothing about the op itself
            return torch.relu(kimi_ops.gemm_a16w8_block(x * 2, w, s)).float() * 0.5

        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True)
        assert torch.equal(compiled(x, w, s), fn(x, w, s))


_INTERP = r"""
import sys
sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
import torch
from kimi_ops.kernels.fp8_gemm import gemm_a16w8_block, gemm_config
from test_fp8_weights import gemm64, random_fp8
for m, n, k, bn, bk, cfg in [
        (1, 200, 300, 128, 128, None),               # N and K tails, the default config
        (5, 72, 512, 64, 128, (16, 32, 64, 2, 4, 1)),   # split K, BLOCK_K 64 inside 128-wide blocks
        (19, 40, 96, 128, 32, (16, 16, 32, 3, 4, 1)),   # M tail over two M tiles, split K with an uneven split
        (3, 48, 256, 16, 64, (16, 32, 64, 4, 4, 1)),    # block_n 16 < BLOCK_N: per-column scale rows
]:
    w, s = random_fp8(n, k, bn, bk, seed=m)
    x = torch.randn(m, 2 * k)[:, ::2].to(torch.bfloat16)   # strided x
    ref = gemm64(x, w, s, bn, bk)
    for swap in (False, True):   # the tl.dot kernel, y = x w^T and y^T = w x^T
        y = gemm_a16w8_block(x, w, s, block_n=bn, block_k=bk, config=cfg, gemv=False, swap=swap)
        err = ((y.double() - ref).abs() / (2.0 ** -8 * ref.abs() + 1e-5 * ref.abs().max())).max().item()
        assert y.shape == (m, n) and err <= 1.0, (m, n, k, cfg, swap, err)
print("OK")
"""


def test_gemm_triton_kernel_under_the_interpreter():
    code = _INTERP.format(root=ROOT, tests=os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", KIMI_OPS_BACKEND="triton")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-3000:] + r.stderr[-6000:]


# GEMV (M <= 16): each case is (m, n, k, bn, bk, config, x / w layout); config None = gemv_config
_GEMV_CASES = r"""[
    (1, 200, 300, 128, 128, None, "strided x"),              # N and K tails, the default config
    (1, 70, 416, 128, 128, (64, 64, 3, 4, 3, 1), "strided x"),   # x ahead, depth 3 > a split's 2-3 tiles
    (2, 72, 512, 64, 128, (32, 128, 2, 8, 2, 0), "plain"),   # split K 2, block_n 64, depth 2
    (3, 40, 96, 16, 32, (32, 64, 3, 4, 1, 0), "strided w"),  # block_n 16 < BLOCK_N, K tail inside a slot row
    (4, 33, 200, 64, 64, (16, 32, 1, 4, 4, 1), "strided x"), # SPLIT_K 1 (bf16 straight out), depth 4, N tail
    (5, 130, 384, 128, 128, (64, 128, 3, 8, 1, 0), "plain"), # M 5 (BLOCK_M 8 with 3 masked rows), N tail at 128
    (6, 48, 136, 64, 8, (16, 16, 4, 4, 3, 0), "strided x"),  # block_k 8: VEC 8, uneven split
    (7, 64, 256, 64, 128, (32, 64, 8, 4, 2, 1), "strided w"),
    (8, 96, 320, 128, 64, (32, 128, 2, 8, 4, 1), "plain"),   # M 8, K tail in the last tile
    (16, 24, 160, 64, 128, (32, 64, 2, 4, 2, 0), "plain"),   # M 16 = GEMV_LIMIT_M
]"""

_GEMV_RUN = r"""
import math, os, sys
sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
import torch
import kimi_ops
from kimi_ops.kernels import fp8_gemm
from test_fp8_weights import gemm64, random_fp8
dev = {dev!r}
gemv_calls = []
real = fp8_gemm._gemv
def spy(*a, **kw):
    gemv_calls.append(a[0].shape[0])
    return real(*a, **kw)
fp8_gemm._gemv = spy
worst = 0.0
for m, n, k, bn, bk, cfg, layout in {cases}:
    w, s = random_fp8(n, k, bn, bk, seed=m)
    x = torch.randn(m, k).to(torch.bfloat16)
    ref = gemm64(x, w, s, bn, bk)
    xd, wd, sd = x.to(dev), w.to(dev), s.to(dev)
    if layout == "strided x":
        xd = torch.zeros(m, 2 * k, dtype=torch.bfloat16, device=dev)[:, ::2]
        xd.copy_(x.to(dev))
    if layout == "strided w":       # a column view of a wider weight: row stride k + 24
        wide = torch.zeros(n, k + 24, dtype=torch.uint8, device=dev)
        wide[:, 8:8 + k] = w.view(torch.uint8).to(dev)
        wd = wide.view(torch.float8_e4m3fn)[:, 8:8 + k]
        assert wd.stride() == (k + 24, 1)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=dev)   # poisoned
    y = fp8_gemm.gemm_a16w8_block(xd, wd, sd, block_n=bn, block_k=bk, config=cfg, gemv=True, out=out)
    assert y.data_ptr() == out.data_ptr()
    err = ((y.cpu().double() - ref).abs() / (2.0 ** -8 * ref.abs() + 1e-5 * ref.abs().max())).max().item()
    assert y.shape == (m, n) and math.isfinite(err) and err <= 1.0, (m, n, k, bn, bk, cfg, layout, err)
    worst = max(worst, err)
# the op's dispatch: M = GEMV_MAX_M runs the GEMV, GEMV_MAX_M + 1 the tl.dot kernel, both right (and
# KIMI_OPS_FP8_GEMV=0 keeps M = 1 on the tl.dot kernel)
os.environ.pop(fp8_gemm.GEMV_ENV, None)
for m in (fp8_gemm.GEMV_MAX_M, fp8_gemm.GEMV_MAX_M + 1):
    w, s = random_fp8(80, 256, 64, 128, seed=m)
    x = torch.randn(m, 256).to(torch.bfloat16)
    gemv_calls.clear()
    y = kimi_ops.gemm_a16w8_block(x.to(dev), w.to(dev), s.to(dev), block_n=64, block_k=128)
    assert gemv_calls == ([m] if m <= fp8_gemm.GEMV_MAX_M else []), (m, gemv_calls)
    ref = gemm64(x, w, s, 64, 128)
    err = ((y.cpu().double() - ref).abs() / (2.0 ** -8 * ref.abs() + 1e-5 * ref.abs().max())).max().item()
    assert err <= 1.0, (m, err)
os.environ[fp8_gemm.GEMV_ENV] = "0"
gemv_calls.clear()
kimi_ops.gemm_a16w8_block(x[:1].to(dev), w.to(dev), s.to(dev), block_n=64, block_k=128)
assert gemv_calls == [], gemv_calls
print("OK worst", worst)
"""


def _run_gemv_cases(dev, env_extra):
    code = _GEMV_RUN.format(root=ROOT, tests=os.path.dirname(os.path.abspath(__file__)), dev=dev, cases=_GEMV_CASES)
    env = dict(os.environ, KIMI_OPS_BACKEND="triton", **env_extra)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-3000:] + r.stderr[-6000:]
    print(r.stdout.strip())


def test_gemv_kernel_under_the_interpreter():
    """The dot-free GEMV at M = 1..8 and 16 against float64: N and K tails, strided x and w views,
    block_n 16 / 64 / 128, block_k 8 / 32 / 64 / 128, split K (even, uneven, none), a NaN-filled output
    buffer, and the dispatch boundary (GEMV_MAX_M on the GEMV, one more on the tl.dot kernel)."""
    _run_gemv_cases("cpu", {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""})


_CODES = r"""
import sys
sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
import torch
from kimi_ops.kernels import attention, fp8_gemm
from test_fp8_weights import gemm64, random_fp8
attention.native_e4m3fn = lambda device: False   # NVIDIA before sm_89: the weight as e4m3fn codes
attention.native_fnuz = lambda: False            # NVIDIA: an e4m3fnuz weight as its codes
assert attention._as_codes(torch.zeros(2, 2, dtype=torch.float8_e4m3fn))[1] == attention.FN_BYTES
for m, n, k, bn, bk, cfg, gemv, fnuz in [
        (3, 200, 300, 128, 128, None, False, False),              # the tl.dot kernel, N and K tails
        (1, 70, 416, 128, 128, (64, 64, 3, 4, 3, 1), True, False),   # the GEMV, split K, x ahead
        (5, 40, 96, 16, 32, (32, 64, 3, 4, 1, 0), True, False),
        (2, 64, 256, 64, 128, None, False, True),                 # e4m3fnuz codes, both kernels
        (2, 64, 256, 64, 128, None, True, True),
]:
    w, s = random_fp8(n, k, bn, bk, seed=m)
    if fnuz:   # the same values (each is an e4m3fn value too: the reference decodes e4m3fn)
        w = w.float().clamp(-240.0, 240.0).to(torch.float8_e4m3fn)
    x = torch.randn(m, k).to(torch.bfloat16)
    wk = w.float().to(torch.float8_e4m3fnuz) if fnuz else w
    y = fp8_gemm.gemm_a16w8_block(x, wk, s, block_n=bn, block_k=bk, config=cfg, gemv=gemv)
    ref = gemm64(x, w, s, bn, bk)
    err = ((y.double() - ref).abs() / (2.0 ** -8 * ref.abs() + 1e-5 * ref.abs().max())).max().item()
    assert err <= 1.0, (m, n, k, gemv, err)
print("OK")
"""


def test_gemm_e4m3fn_codes_under_the_interpreter():
    """Where Triton lacks the weight's fp8 type (e4m3fn before sm_89, e4m3fnuz on NVIDIA) the
    weight reaches both kernels as its uint8 codes (attention._as_codes), decoded by integer
    arithmetic (kimi_ops.kernels.cache.fp8_value): forced here."""
    code = _CODES.format(root=ROOT, tests=os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", KIMI_OPS_BACKEND="triton")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-3000:] + r.stderr[-6000:]


def test_gemv_dispatch_rule(monkeypatch):
    from kimi_ops.kernels import fp8_gemm
    monkeypatch.delenv(fp8_gemm.GEMV_ENV, raising=False)
    assert [fp8_gemm.use_gemv(m, 3648, 7168) for m in (0, 1, 4, 5, 8, 16)] == [False, True, True, False, False, False]
    monkeypatch.setenv(fp8_gemm.GEMV_ENV, "0")
    assert not fp8_gemm.use_gemv(1, 3648, 7168)
    monkeypatch.setenv(fp8_gemm.GEMV_ENV, "1")
    assert fp8_gemm.use_gemv(16, 3648, 7168) and not fp8_gemm.use_gemv(17, 3648, 7168)
    monkeypatch.setenv(fp8_gemm.GEMV_ENV, "4")
    assert fp8_gemm.use_gemv(4, 64, 64) and not fp8_gemm.use_gemv(5, 64, 64)
    monkeypatch.setenv(fp8_gemm.GEMV_ENV, "64")
    assert fp8_gemm.use_gemv(16, 64, 64) and not fp8_gemm.use_gemv(17, 64, 64), "capped at GEMV_LIMIT_M"
    monkeypatch.setenv(fp8_gemm.GEMV_ENV, "yes")
    with pytest.raises(ValueError, match="KIMI_OPS_FP8_GEMV must be 0, 1 or an M limit"):
        fp8_gemm.use_gemv(1, 64, 64)
    monkeypatch.setenv(fp8_gemm.GEMV_CONFIG_ENV, "64,128,4,8,2,1")
    assert fp8_gemm._env_gemv_config() == (64, 128, 4, 8, 2, 1)
    for bad in ("64,128,4,8,2,2", "64,128,4,8,5,0", "64,128"):
        monkeypatch.setenv(fp8_gemm.GEMV_CONFIG_ENV, bad)
        with pytest.raises(ValueError, match="BLOCK_N,BLOCK_K,SPLIT_K,num_warps,DEPTH,X_AHEAD"):
            fp8_gemm._env_gemv_config()
    monkeypatch.delenv(fp8_gemm.GEMV_CONFIG_ENV)
    w, s = random_fp8(64, 128, 64, 128, seed=0)
    x = torch.randn(2, 128).to(torch.bfloat16)
    with pytest.raises(ValueError, match="GEMV kernel's config"):
        fp8_gemm.gemm_a16w8_block(x, w, s, block_n=64, config=(64, 128, 4, 8), gemv=True)
    with pytest.raises(ValueError, match="GEMV DEPTH must be 1..4"):
        fp8_gemm.gemm_a16w8_block(x, w, s, block_n=64, config=(16, 32, 64, 2, 8, 3), gemv=True)
    with pytest.raises(ValueError, match="tl.dot kernel's config"):
        fp8_gemm.gemm_a16w8_block(x, w, s, block_n=64, config=(64, 128, 4, 8), gemv=False)
    # every default GEMV config at Kimi-K3's shapes is one the cross-compile registry lists
    names = {sp["name"] for sp in fp8_gemm.CROSS_COMPILE_SPECS}
    for n, k in fp8_gemm.KIMI_K3_SHAPES:
        for m in range(1, fp8_gemm.GEMV_MAX_M + 1):
            assert fp8_gemm._gemv_spec_name(m, n, k) in names, (m, n, k)


def test_gemm_config_env(monkeypatch):
    from kimi_ops.kernels import fp8_gemm
    monkeypatch.setenv(fp8_gemm.CONFIG_ENV, "16,32,64,2,4,3")
    assert fp8_gemm._env_config() == (16, 32, 64, 2, 4, 3)
    monkeypatch.setenv(fp8_gemm.CONFIG_ENV, "16,32")
    with pytest.raises(ValueError, match="BLOCK_M,BLOCK_N,BLOCK_K,SPLIT_K,num_warps,num_stages"):
        fp8_gemm._env_config()
    # the defaults measured on the H200 (gemm_config's docstring), Kimi-K3 TP8's fused qkv_a + gate
    assert fp8_gemm.gemm_config(64, 3648, 7168, 128, 132) == (64, 128, 128, 4, 8, 4)
    # 33..64 rows: the split whose programs come closest to one wave (29 x 4 = 116, q_b's 8 is 6
    # effective: 18 x 6 = 108, o_proj 56 x 2 = 112; the next power of two passes 132)
    assert fp8_gemm.gemm_config(48, 2304, 1536, 128, 132) == (64, 128, 128, 8, 8, 4)
    assert fp8_gemm.gemm_config(64, 7168, 1536, 128, 132) == (64, 128, 128, 2, 8, 4)
    assert fp8_gemm.split_count(64, 2304, 1536, 128, 132) == 6
    assert fp8_gemm.one_wave_split(200, 56, 132) == 1, "more tiles than SMs: no split"
    assert fp8_gemm.one_wave_split(1, 3, 132) == 4, "nominal 4: _split_plan runs 3, one a K tile"
    assert fp8_gemm.gemm_config(1, 3648, 7168, 128, 132) == (32, 64, 128, 4, 4, 6)
    assert fp8_gemm.gemm_config(3, 3648, 7168, 128, 132) == (32, 64, 128, 4, 4, 6)
    assert fp8_gemm.gemm_config(32, 2304, 1536, 128, 132) == (32, 64, 128, 4, 4, 6)
    # AMD's own, spill-free on gfx950 / gfx942 with Triton 3.6 and 3.8 (gemm_config's docstring)
    assert fp8_gemm.gemm_config(32, 2304, 1536, 128, 304, amd=True) == (32, 32, 128, 4, 4, 3)
    assert fp8_gemm.gemm_config(64, 3648, 7168, 128, 256, amd=True) == (64, 64, 128, 4, 8, 3)
    assert fp8_gemm.gemm_config(8, 3648, 7168, 128, 256, amd=True)[:3] == (16, 16, 128)
    big = fp8_gemm.gemm_config(256, 7168, 1536, 128, 256, amd=True)
    assert big[:3] + big[4:] == (64, 64, 128, 4, 1)
    bm, bn, bk, split, _, _ = fp8_gemm.gemm_config(8, 3648, 7168, 128, 132)
    assert (bm, bn, bk, split) == (16, 32, 128, 2)
    assert fp8_gemm.gemm_config(1, 64, 256, 128, 132)[3] == 1, "at least 2 K tiles a split"
    assert fp8_gemm.gemm_config(1, 64, 256, 64, 132)[2] == 64, "BLOCK_K divides block_k"


def test_gemm_swap_rule(monkeypatch):
    from kimi_ops.kernels import fp8_gemm
    monkeypatch.delenv(fp8_gemm.SWAP_ENV, raising=False)
    # measured on the H200 (use_swap's docstring): transposed from 33 rows, on sm_90 only
    assert [fp8_gemm.use_swap(m, 64, hopper=True) for m in (16, 32, 33, 64, 256)] == [False, False, True, True, True]
    assert not fp8_gemm.use_swap(64, 64, hopper=False)
    monkeypatch.setenv(fp8_gemm.SWAP_ENV, "1")
    assert fp8_gemm.use_swap(8, 16, hopper=False) and not fp8_gemm.use_swap(8, 8, hopper=True), "BLOCK_M >= 16"
    monkeypatch.setenv(fp8_gemm.SWAP_ENV, "0")
    assert not fp8_gemm.use_swap(64, 64, hopper=True)
    monkeypatch.setenv(fp8_gemm.SWAP_ENV, "yes")
    with pytest.raises(ValueError, match="KIMI_OPS_FP8_GEMM_SWAP must be 0 or 1"):
        fp8_gemm.use_swap(64, 64, hopper=True)
    monkeypatch.delenv(fp8_gemm.SWAP_ENV)
    w, s = random_fp8(64, 128, 64, 128, seed=0)
    with pytest.raises(ValueError, match="swap needs BLOCK_M >= 16"):
        fp8_gemm.gemm_a16w8_block(torch.randn(2, 128).to(torch.bfloat16), w, s, block_n=64,
                                  config=(8, 32, 64, 1, 4, 2), gemv=False, swap=True)
    # the sm90 cross-compile builds the transposed form where the default runs it
    swapped = {sp["constexprs"]["BLOCK_M"] for sp in fp8_gemm.CROSS_COMPILE_SPECS
               if sp["targets"] == ("sm90",) and sp["constexprs"].get("SWAP")}
    assert swapped == {64} and not any(sp["constexprs"].get("SWAP") for sp in fp8_gemm.CROSS_COMPILE_SPECS
                                       if sp["targets"] != ("sm90",))


# --- GPU ----------------------------------------------------------------------------------------

@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 32, 64])
def test_gpu_gemm_kimi_k3_shapes(monkeypatch, m):
    monkeypatch.setenv("KIMI_OPS_BACKEND", "auto")
    for n, k in ((3648, 7168), (2304, 1536), (7168, 1536)):
        w, s = random_fp8(n, k, 128, 128, seed=n + m)
        x = torch.randn(m, k).to(torch.bfloat16)
        y = kimi_ops.gemm_a16w8_block(x.cuda(), w.cuda(), s.cuda())
        ref = gemm64(x, w, s, 128, 128)
        rel = float((y.cpu().double() - ref).norm() / ref.norm())
        print(f"gemm_a16w8_block M {m} N {n} K {k}: rel L2 {rel:.2e}")
        assert rel <= 4e-3


@requires_cuda
@pytest.mark.gpu
def test_gpu_gemv_cases():
    """The interpreter's GEMV cases (and the dispatch boundary) on the GPU."""
    _run_gemv_cases("cuda", {})


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 16])
def test_gpu_gemv_kimi_k3_shapes(monkeypatch, m):
    """The GEMV at Kimi-K3 TP8's shapes (the fused qkv_a + gate on its 64-row scale grid), its
    default config, against float64, with the caching allocator handed NaN-filled blocks first
    (the output and the split-K partials must be written everywhere)."""
    from kimi_ops.kernels import fp8_gemm
    monkeypatch.setenv("KIMI_OPS_BACKEND", "triton")   # (auto: the cuda backend's kernel at M <= 8, tests/test_gemv.py)
    monkeypatch.setenv(fp8_gemm.GEMV_ENV, "16")
    for (n, k), bn in zip(fp8_gemm.KIMI_K3_SHAPES, (64, 128, 128)):
        w, s = random_fp8(n, k, bn, 128, seed=n + m)
        x = torch.randn(m, k).to(torch.bfloat16)
        wd, sd, xd = w.cuda(), s.cuda(), x.cuda()
        split = fp8_gemm.gemv_config(m, n, k, 128, fp8_gemm._sm_count(xd.device))[2]
        for shape, dt in (((m, n), torch.bfloat16), ((split, m, n), torch.float32)):
            torch.full(shape, float("nan"), dtype=dt, device="cuda")   # freed at once: the next allocation's bytes
        y = kimi_ops.gemm_a16w8_block(xd, wd, sd, block_n=bn, block_k=128)
        ref = gemm64(x, w, s, bn, 128)
        rel = float((y.cpu().double() - ref).norm() / ref.norm())
        err = ((y.cpu().double() - ref).abs() / (2.0 ** -8 * ref.abs() + 1e-5 * ref.abs().max())).max().item()
        dot = fp8_gemm.gemm_a16w8_block(xd, wd, sd, block_n=bn, block_k=128, gemv=False)
        rel_dot = float((dot.cpu().double() - ref).norm() / ref.norm())
        print(f"GEMV M {m} N {n} K {k} block_n {bn}: rel L2 {rel:.2e} (tl.dot {rel_dot:.2e}), "
              f"max err / bound {err:.2f}")
        assert torch.isfinite(y).all() and err <= 1.0 and rel <= 4e-3


@requires_cuda
@pytest.mark.gpu
def test_gpu_fp8_layer_matches_float64_and_replays_in_a_cuda_graph(monkeypatch):
    monkeypatch.setenv("KIMI_OPS_BACKEND", "auto")
    lens = [9, 700, 1, 0, 64]
    layer, cache, md, hidden, bt = make_step(MLAConfig.kimi_k3(), lens, qlen=1, weights="fp8", block_size=16,
                                             device="cuda")
    start = cache.clone()
    out = layer(hidden, cache, md)
    err = check_step(layer, cache, md, hidden, bt, lens, out=out)
    print(f"GPU kimi_k3 fp8 layer: relative L2 error vs float64 {err:.2e}")
    cache.copy_(start)
    with torch.no_grad():
        graphed = GraphedStep(lambda lay, h, c, m: lay(h, c, m), layer, cache, md, hidden)
    cache.copy_(start)
    again = graphed(hidden)
    assert float((again.double() - out.double()).norm() / out.double().norm()) <= 1e-3
    assert err <= LAYER_RTOL


# --- the demo -----------------------------------------------------------------------------------

def test_demo_fp8_weights_and_its_step_table():
    env = {**os.environ, "PYTHONPATH": ROOT, "KIMI_OPS_BACKEND": "reference"}
    r = subprocess.run([sys.executable, "-m", "kimi_ops", "demo", "--weights", "fp8", "--steps", "2", "--batch", "2",
                        "--context", "60", "--device", "cpu", "--no-progress"], capture_output=True, text=True,
                       env=env, timeout=600)
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    assert "fp8 projections" in out and "PASS" in out and "FAIL" not in out, out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip().split()[:1] in
            (["step"], ["attention"], ["rest"]) and line.strip().endswith("%")}
    assert set(rows) == {"step", "attention", "rest"}, out
    shares = {k: float(v[-1].rstrip("%")) for k, v in rows.items()}
    assert shares["step"] == 100 and abs(shares["attention"] + shares["rest"] - 100) <= 1, out
