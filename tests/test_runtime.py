"""kimi_ops.runtime: config presets, device-built metadata, weight loading, and the whole
layer's decode step against a float64 reference written here (independent of the ops).

The reference (:func:`reference_step`) uses plain float64 matmuls on the weights the layer
holds (MXFP4 ones decoded by a decoder written here), explicit RMSNorm, RoPE as complex
rotation, and the *un-absorbed* attention (k_nope = W_UK kv_c, v = W_UV kv_c per token,
explicit softmax), reading the request's tokens straight from the block table.

Tolerance (:data:`LAYER_RTOL`), derived: the layer keeps bf16 activations between its
GEMMs. Each bf16 rounding adds a relative error of RMS about 2^-8 / sqrt(3) ~ 1.7e-3
(DESIGN.md measures 1.7e-3 for the attention output), and the errors are independent, so
they add in quadrature; linear maps, RMSNorm and the softmax (logits of unit scale) pass a
relative error on at about its size. Along the path to the output there are at most 11
roundings (qkv GEMM, the two norms, q_b, RoPE, M1a's query, the attention output, W_UV, the
gate's g and sigmoid, the gate product; o_proj's output is the 12th): sqrt(12) * 1.7e-3 =
5.9e-3. We allow twice that, 1.2e-2, as the relative L2 error of the whole output. (The
attention reads the fp8 cache as the layer wrote it; the new rows' fp8 rounding is checked
on its own, elementwise, against the reference's rows.)
"""

import math

import pytest
import torch

import kimi_ops
from kimi_ops.runtime import (DecodeMetadata, MLAConfig, MLADecodeLayer, allocate_blocks, build_decode_metadata,
                              build_from_slots, mla, random_hf_weights)
from kimi_ops.runtime.layer import _yarn_inv_freq

LAYER_RTOL = 1.2e-2
KV_ROW, KV_LORA = 576, 512


@pytest.fixture(autouse=True)
def _reference_backend(monkeypatch):
    monkeypatch.setenv("KIMI_OPS_BACKEND", "reference")


# --- the float64 oracle ----------------------------------------------------------------------

E2M1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)


def mxfp4_decode(packed, scale):
    """OCP MXFP4 -> float64: element 2i in the low nibble, one 2^(s - 127) per 32 elements."""
    packed = packed.cpu()
    codes = torch.stack([packed & 15, packed >> 4], -1).flatten(-2).long()
    vals = E2M1[codes]
    s = torch.pow(2.0, scale.cpu().view(torch.uint8).double() - 127)
    return (vals.unflatten(-1, (-1, 32)) * s[..., None]).flatten(-2)


def e4m3_decode(t):
    """float8_e4m3fn bytes -> float64 by the format's bit fields (sign, 4-bit exponent bias 7,
    3-bit mantissa; exponent 0 subnormal; 0x7F / 0xFF NaN)."""
    b = t.cpu().contiguous().view(torch.uint8).long()
    sign = torch.where(b >= 128, -1.0, 1.0).double()
    e, m = (b >> 3) & 15, (b & 7).double()
    mag = torch.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * torch.pow(2.0, e.double() - 7))
    return torch.where((b & 127) == 127, float("nan"), sign * mag)


def fp8_dense64(w, scale, block_n, block_k):
    """fp8 [N, K] x its block's scale (float32 [ceil(N / bn), ceil(K / bk)]) -> float64 [N, K]."""
    n, k = w.shape
    s = scale.cpu().double().repeat_interleave(block_n, 0)[:n].repeat_interleave(block_k, 1)[:, :k]
    return e4m3_decode(w) * s


def proj64(proj):
    """One of the layer's projection modules as float64 on the CPU (fp8 ones decoded here)."""
    if getattr(proj, "weight_scale_inv", None) is None:
        return proj.weight.cpu().double()
    return fp8_dense64(proj.weight, proj.weight_scale_inv, proj.block_n, proj.block_k)


def weights64(layer):
    """The weights the layer applies, float64 on the CPU, the gate unmerged."""
    c = layer.config
    w = proj64(layer.fused_qkv_a_proj)
    gate = None
    if c.gate:
        gate = w[c.qkv_a_rows:] if layer.merge_gate else proj64(layer.g_proj)
    if layer.weight_format in ("bf16", "fp8"):
        w_uk, w_uv = layer.W_UK.cpu().double(), layer.W_UV.cpu().double()
    else:
        w_uk = mxfp4_decode(layer.W_UK, layer.W_UK_scale).transpose(1, 2)   # [H, 128, 512]
        w_uv = mxfp4_decode(layer.W_UV, layer.W_UV_scale)                   # [H, v, 512]
    return dict(qkv=w[:c.qkv_a_rows], gate=gate, q_a_norm=layer.q_a_layernorm.weight.cpu().double(),
                kv_a_norm=layer.kv_a_layernorm.weight.cpu().double(), q_b=proj64(layer.q_b_proj),
                w_uk=w_uk, w_uv=w_uv, o=proj64(layer.o_proj) if layer.o_proj is not None else None)


def rope64(x, positions, inv_freq):
    """Rotate pairs (2i, 2i+1) of x [T, ..., 64] by positions * inv_freq, as complex numbers."""
    z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
    angle = positions.double()[:, None] * inv_freq.double()[None, :]
    rot = torch.polar(torch.ones_like(angle), angle).view(x.shape[0], *([1] * (x.dim() - 2)), -1)
    return torch.view_as_real(z * rot).flatten(-2)


def reference_step(layer, hidden, kv_cache_after, seq_lens, block_table, block_size, qlen, w=None):
    """float64 (out [T, hidden or H*v], new KV rows [T, 576] before fp8) of one decode step.
    Attention reads ``kv_cache_after`` (the cache with this step's rows as the layer wrote them).
    ``w``: the float64 weights (:func:`weights64`'s keys) to use instead of the layer's."""
    c, h = layer.config, layer.config.num_heads
    w = w if w is not None else weights64(layer)
    x = hidden.cpu().double()
    qkv = x @ w["qkv"].T

    def rms(v, g):
        return v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * g

    q_c = rms(qkv[:, :c.q_lora_rank], w["q_a_norm"])
    kv_c = rms(qkv[:, c.q_lora_rank:c.q_lora_rank + KV_LORA], w["kv_a_norm"])
    k_pe = qkv[:, c.q_lora_rank + KV_LORA:]
    q = (q_c @ w["q_b"].T).view(-1, h, c.qk_head_dim)
    q_nope, q_pe = q[..., :c.qk_nope_head_dim], q[..., c.qk_nope_head_dim:]
    positions = torch.tensor([max(0, n - qlen + i) for n in seq_lens for i in range(qlen)])
    if c.rope:
        q_pe = rope64(q_pe, positions, layer.rotary_inv_freq.cpu())
        k_pe = rope64(k_pe, positions, layer.rotary_inv_freq.cpu())
    rows = kv_cache_after.cpu().reshape(-1, KV_ROW).double() * layer.kv_scale
    bt = block_table.cpu().tolist()
    out = torch.zeros(x.shape[0], h, c.v_head_dim, dtype=torch.float64)
    for r, n in enumerate(seq_lens):
        for i in range(qlen):
            visible = n - qlen + i + 1
            if visible <= 0:
                continue
            t = r * qlen + i
            toks = [bt[r][p // block_size] * block_size + p % block_size for p in range(visible)]
            kv = rows[toks]
            k_nope = torch.einsum("hdl,jl->hjd", w["w_uk"], kv[:, :KV_LORA])
            v = torch.einsum("hdl,jl->hjd", w["w_uv"], kv[:, :KV_LORA])
            s = (torch.einsum("hd,hjd->hj", q_nope[t], k_nope) + q_pe[t] @ kv[:, KV_LORA:].T) * c.softmax_scale
            p = torch.exp(s - s.max(-1, keepdim=True).values)
            p = p / p.sum(-1, keepdim=True)
            out[t] = torch.einsum("hj,hjd->hd", p, v)
    core = out.reshape(x.shape[0], -1)
    if w["gate"] is not None:
        core = core * torch.sigmoid(x @ w["gate"].T)
    if w["o"] is not None:
        core = core @ w["o"].T
    return core, torch.cat([kv_c, k_pe], -1)


# --- a decode step's data ---------------------------------------------------------------------

def make_step(config, seq_lens, *, qlen=1, block_size=4, weights="bf16", seed=0, device="cpu", spare=2, **layer_kw):
    """(layer, kv_cache, md, hidden, block_table): requests' earlier tokens hold random fp8 rows,
    every other row (incl. this step's slots) is NaN, blocks randomly permuted."""
    gen = torch.Generator().manual_seed(seed + 1000)
    layer = MLADecodeLayer(config, weights=weights, seed=seed, device=device, **layer_kw)
    max_len = max(max(seq_lens), 1) + spare
    block_table, num_blocks = allocate_blocks(len(seq_lens), max_len, block_size, seed=seed)
    cache = torch.full((num_blocks, block_size, KV_ROW), float("nan")).to(torch.float8_e4m3fn)
    flat = cache.view(-1, KV_ROW)
    for r, n in enumerate(seq_lens):
        for p in range(max(0, n - qlen)):
            row = block_table[r, p // block_size] * block_size + p % block_size
            flat[row] = (torch.randn(KV_ROW, generator=gen) / layer.kv_scale).to(torch.float8_e4m3fn)
    md = build_decode_metadata(torch.tensor(seq_lens, dtype=torch.int32, device=device), block_table.to(device),
                               block_size=block_size, qlen=qlen, max_tokens=sum(seq_lens) + len(seq_lens) * spare + 7)
    hidden = torch.randn(len(seq_lens) * qlen, config.hidden_size, generator=gen).to(torch.bfloat16).to(device)
    return layer, cache.to(device), md, hidden, block_table


def check_step(layer, cache, md, hidden, block_table, seq_lens, out=None, rtol=LAYER_RTOL, w=None):
    """Run (or take) the layer's output and hold it and the written rows to the reference
    (on the layer's weights, or on the float64 weights ``w``)."""
    if out is None:
        out = layer(hidden, cache, md)
    ref, new_rows = reference_step(layer, hidden, cache, seq_lens, block_table, md.block_size, md.qlen, w=w)
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == tuple(ref.shape)
    assert torch.isfinite(out).all(), "no NaN / inf (unused cache rows hold NaN)"
    err = float((out.cpu().double() - ref).norm() / ref.norm())
    assert err <= rtol, f"relative L2 error {err:.3e} > {rtol}"
    # this step's rows: fp8(x / kv_scale) of the reference's rows, to fp8 rounding
    slots = md.slot_mapping.cpu()
    written = cache.cpu().reshape(-1, KV_ROW)[slots[slots >= 0]].double() * layer.kv_scale
    expected = new_rows[slots >= 0]
    # fp8 rounding (<= 2^-4 relative) plus the bf16 roundings upstream (~2^-8 of the row's typical
    # size, which RoPE's x0 cos - x1 sin leaves as is on an element that cancels to near 0)
    bound = 0.075 * expected.abs() + 2.0 ** -7 * expected.abs().mean(-1, keepdim=True) + 2.0 ** -9 * layer.kv_scale
    assert ((written - expected).abs() <= bound).all(), "cache rows match fp8 rounding of the reference rows"
    return err


# --- config -----------------------------------------------------------------------------------

def test_presets():
    k3 = MLAConfig.kimi_k3()
    assert (k3.num_heads, k3.hidden_size, k3.q_lora_rank, k3.qkv_a_rows, k3.gate_rows) == (12, 7168, 1536, 2112, 1536)
    assert k3.softmax_scale == 1 / math.sqrt(192) and k3.gate and not k3.rope
    assert MLAConfig().num_heads == 12 and MLAConfig.kimi_k3(tp=4).num_heads == 24
    ds = MLAConfig.deepseek_v3()
    assert ds.num_heads == 16 and ds.rope and not ds.gate and ds.gate_rows == 0
    mscale = 0.1 * math.log(40) + 1
    assert ds.softmax_scale == pytest.approx(mscale ** 2 / math.sqrt(192))
    with pytest.raises(ValueError, match="576-byte cache row"):
        MLAConfig.small().replace(kv_lora_rank=256)
    with pytest.raises(ValueError, match="split evenly"):
        MLAConfig.kimi_k3(tp=5)


def test_rotary_frequencies():
    plain = MLAConfig.small(rope=True).replace(rope_scaling=None)
    assert torch.allclose(_yarn_inv_freq(plain), 10000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    yarn = _yarn_inv_freq(MLAConfig.deepseek_v3())
    base = 10000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    assert torch.allclose(yarn[:4], base[:4]) and torch.allclose(yarn[-4:], base[-4:] / 40)   # fast dims kept
    x = torch.randn(5, 3, 64).to(torch.bfloat16)
    pos = torch.tensor([0, 1, 7, 100, 4095])
    got = mla.apply_rope(x, pos, yarn.float())
    assert torch.allclose(got.double(), rope64(x.double(), pos, yarn.float()), atol=2e-2, rtol=1e-2)
    assert torch.equal(got[0], x[0])


# --- metadata ---------------------------------------------------------------------------------

def brute_metadata(seq_lens, block_table, block_size, qlen, cap, world=1, rank=0):
    indptr, indices, slots, pos = [0], [], [], []
    for r, n in enumerate(seq_lens):
        local = [p // world for p in range(n) if p % world == rank]
        for k in local:
            indices.append(block_table[r][k // block_size] * block_size + k % block_size)
        indptr.append(len(indices))
        for i in range(qlen):
            p = n - qlen + i
            pos.append(max(p, 0))
            k = p // world
            slots.append(block_table[r][k // block_size] * block_size + k % block_size
                         if p >= 0 and p % world == rank else -1)
    return indptr, indices, slots, pos


@pytest.mark.parametrize("block_size,qlen,world,rank", [(1, 1, 1, 0), (4, 2, 1, 0), (16, 3, 1, 0),
                                                        (4, 1, 2, 1), (2, 2, 4, 3)])
def test_metadata_matches_brute_force(block_size, qlen, world, rank):
    seq_lens = [5, 0, 17, 1, 33, 2]
    bt, _ = allocate_blocks(len(seq_lens), 40, block_size, seed=block_size)
    cap = sum(seq_lens) + 9
    md = build_decode_metadata(torch.tensor(seq_lens, dtype=torch.int32), bt, block_size=block_size, qlen=qlen,
                               max_tokens=cap, dcp_world_size=world, dcp_rank=rank)
    indptr, indices, slots, pos = brute_metadata(seq_lens, bt.tolist(), block_size, qlen, cap, world, rank)
    assert md.kv_indptr.dtype == torch.int32 and md.kv_indices.dtype == torch.int32
    assert md.kv_indptr.tolist() == indptr
    assert md.kv_indices.tolist() == indices + [0] * (cap - len(indices)), "the tail past kv_indptr[-1] is 0"
    assert md.slot_mapping.tolist() == slots and md.positions.tolist() == pos
    assert (md.num_requests, md.num_rows, md.max_tokens) == (6, 6 * qlen, cap)


def test_metadata_slot_list_and_capacity_clamp():
    slots = torch.randperm(64).view(2, 32).to(torch.int32)
    md = build_from_slots(torch.tensor([3, 30], dtype=torch.int32), slots, max_tokens=20)
    assert md.kv_indptr.tolist() == [0, 3, 20], "kv_indptr ends within the index buffer"
    assert md.kv_indices.tolist() == slots[0, :3].tolist() + slots[1, :17].tolist()
    assert md.slot_mapping.tolist() == [slots[0, 2].item(), slots[1, 29].item()]


def test_metadata_updates_in_place():
    bt, _ = allocate_blocks(3, 64, 8)
    md = DecodeMetadata.allocate(3, 100, qlen=2, block_size=8, max_blocks=bt.shape[1])
    ptrs = [t.data_ptr() for t in (md.kv_indptr, md.kv_indices, md.slot_mapping, md.positions, md.seq_lens)]
    md.update_(torch.tensor([4, 0, 9], dtype=torch.int32), bt)
    for _ in range(3):
        md.advance_()
    assert md.seq_lens.tolist() == [10, 0, 15], "padding requests (length 0) stay empty"
    expected = brute_metadata([10, 0, 15], bt.tolist(), 8, 2, 100)
    assert (md.kv_indptr.tolist(), md.slot_mapping.tolist()) == (expected[0], expected[2])
    assert ptrs == [t.data_ptr() for t in (md.kv_indptr, md.kv_indices, md.slot_mapping, md.positions, md.seq_lens)]


# --- the layer --------------------------------------------------------------------------------

SMALL = [5, 0, 17, 1, 33]


@pytest.mark.parametrize("weights", ["bf16", "mxfp4", "fp8"])
@pytest.mark.parametrize("variant", ["gate_merged", "gate_separate", "rope_no_gate", "no_o_proj"])
@pytest.mark.parametrize("qlen", [1, 2])
def test_small_layer_matches_float64(weights, variant, qlen):
    config = {"gate_merged": MLAConfig.small(), "gate_separate": MLAConfig.small(),
              "rope_no_gate": MLAConfig.small(gate=False, rope=True, heads=3),
              "no_o_proj": MLAConfig.small(o_proj=False, heads=2)}[variant]
    layer, cache, md, hidden, bt = make_step(config, SMALL, qlen=qlen, weights=weights, seed=qlen,
                                             merge_gate=variant != "gate_separate")
    assert (layer.g_proj is None) == (variant != "gate_separate")
    check_step(layer, cache, md, hidden, bt, SMALL)


@pytest.mark.parametrize("weights", ["bf16", "mxfp4", "fp8"])
def test_kimi_k3_layer_matches_float64(weights):
    lens = [9, 40]
    layer, cache, md, hidden, bt = make_step(MLAConfig.kimi_k3(), lens, qlen=2, weights=weights, block_size=16)
    err = check_step(layer, cache, md, hidden, bt, lens)
    print(f"kimi_k3 {weights}: relative L2 error {err:.2e}")


def test_deepseek_v3_layer_matches_float64():
    lens = [3, 20]
    layer, cache, md, hidden, bt = make_step(MLAConfig.deepseek_v3(), lens, qlen=1, weights="mxfp4", block_size=16)
    check_step(layer, cache, md, hidden, bt, lens)


def test_merged_and_separate_gate_agree():
    a = make_step(MLAConfig.small(), SMALL, merge_gate=True)
    b = make_step(MLAConfig.small(), SMALL, merge_gate=False)
    assert torch.equal(a[0](a[3], a[1], a[2]), b[0](b[3], b[1], b[2]))
    qkv_a, gate_a = mla.qkv_gate_weights(a[0])
    qkv_b, gate_b = mla.qkv_gate_weights(b[0])
    assert torch.equal(qkv_a, qkv_b) and torch.equal(gate_a, gate_b)
    assert qkv_a.data_ptr() == a[0].fused_qkv_a_proj.weight.data_ptr(), "row slices of the merged weight"
    assert mla.qkv_gate_weights(MLADecodeLayer(MLAConfig.small(gate=False)))[1] is None


def test_pieces_compose_and_m1c_inputs():
    layer, cache, md, hidden, bt = make_step(MLAConfig.small(), SMALL, qlen=2)
    cache2 = cache.clone()
    q, gate = mla.pre(layer, hidden, cache, md)
    assert q.shape == (10, 4, 576) and q.dtype == torch.bfloat16 and gate.shape == (10, 4 * 128)
    o, lse = mla.attend(layer, q, cache, md)
    m1c_in, po, plse = mla.m1c_inputs(layer, q, cache, md, num_splits=3)
    o_part, lse_part = kimi_ops.mla_decode_splitkv(**m1c_in)
    assert o_part.shape == po.shape and lse_part.shape == plse.shape and lse_part.dtype == plse.dtype
    o2, lse2 = kimi_ops.mla_merge(o_part, lse_part)
    assert (o2.double() - o.double()).norm() <= 4e-3 * o.double().norm()
    out = mla.post(layer, o, lse, md, gate)
    assert out.shape == (10, 4 * 128)
    with mla.step_context(md, cache2):
        assert mla.context(layer)[0] is md and mla.context(layer)[3] is md.slot_mapping
        full = layer(hidden)
    assert torch.equal(full, torch.nn.functional.linear(out, layer.o_proj.weight))
    with pytest.raises(RuntimeError, match="no step context"):
        mla.context(layer)


# --- weights in and out -----------------------------------------------------------------------

@pytest.mark.parametrize("weights", ["bf16", "mxfp4", "fp8"])
def test_safetensors_round_trip(tmp_path, weights):
    a, cache, md, hidden, _ = make_step(MLAConfig.small(), SMALL, weights=weights, seed=3)
    path = tmp_path / "layer.safetensors"
    a.save_safetensors(path)
    b = MLADecodeLayer(MLAConfig.small(), weights=weights, seed=None).load_weights(path)
    assert all(torch.equal(x, y) for x, y in zip(a.buffers(), b.buffers())), "same bytes after the round trip"
    assert torch.equal(a(hidden, cache.clone(), md), b(hidden, cache.clone(), md))


def test_hf_checkpoint_names_and_tp_slicing():
    full = MLAConfig.small(heads=4)
    sd = random_hf_weights(full, seed=5)
    rank1 = MLAConfig.small(heads=4).replace(tp=2)
    # an unsharded HF checkpoint with unfused q_a / kv_a and a prefix
    hf = {"model.layers.0.self_attn." + k: v for k, v in sd.items() if k != "fused_qkv_a_proj.weight"}
    qkv = sd["fused_qkv_a_proj.weight"]
    hf["model.layers.0.self_attn.q_a_proj.weight"] = qkv[:128]
    hf["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] = qkv[128:]
    layer = MLADecodeLayer(rank1, seed=None).load_weights(hf, prefix="model.layers.0.self_attn.", tp_rank=1)
    kv_b = sd["kv_b_proj.weight"].view(4, 256, 512)
    assert torch.equal(layer.W_UK, kv_b[2:, :128]) and torch.equal(layer.W_UV, kv_b[2:, 128:])
    assert torch.equal(layer.q_b_proj.weight, sd["q_b_proj.weight"][2 * 192:])
    assert torch.equal(layer.o_proj.weight, sd["o_proj.weight"][:, 256:])
    assert torch.equal(mla.qkv_gate_weights(layer)[1], sd["g_proj.weight"][256:])
    # nn.Module.load_state_dict takes the HF dict too
    again = MLADecodeLayer(MLAConfig.small(), seed=None)
    again.load_state_dict(sd)
    assert torch.equal(again.hf_state_dict()["kv_b_proj.weight"], sd["kv_b_proj.weight"])
    with pytest.raises(KeyError, match="unexpected keys"):
        MLADecodeLayer(MLAConfig.small(), seed=None).load_weights({**sd, "junk.weight": qkv})
    with pytest.raises(KeyError, match="missing"):
        MLADecodeLayer(MLAConfig.small(), seed=None).load_weights({k: v for k, v in sd.items() if "g_proj" not in k})


def test_bad_arguments():
    with pytest.raises(ValueError, match="weights must be"):
        MLADecodeLayer(MLAConfig.small(), weights="int4")
    with pytest.raises(ValueError, match="bf16"):
        MLADecodeLayer(MLAConfig.small(), dtype=torch.float16)


# --- loop helpers (also used by the compile and GPU tests) --------------------------------------

def run_loop(step, layer, cache, md, hiddens):
    """Outputs (clones) of ``step(hidden)`` over the hidden states, in order."""
    outs = []
    with torch.no_grad():
        for hidden in hiddens:
            outs.append(step(hidden).clone())
    return outs


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))
