"""YaRN's mscale (issue 30): with ``mscale != mscale_all_dim`` the rotary cos / sin are scaled by
get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim), as transformers and vLLM do
for DeepSeek-V3 (get_mscale(s, m) = 0.1 m ln(s) + 1 for s > 1, else 1); the softmax scale
keeps get_mscale(factor, mscale_all_dim)^2. Everything here is computed by hand."""

import math

import pytest
import torch

import test_runtime
from kimi_ops.runtime import MLAConfig, mla
from kimi_ops.runtime.config import RopeScaling


@pytest.fixture(autouse=True)
def _reference_backend(monkeypatch):
    monkeypatch.setenv("KIMI_OPS_BACKEND", "reference")


def by_hand(factor, mscale, mscale_all_dim):
    top = 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0
    bottom = 0.1 * mscale_all_dim * math.log(factor) + 1.0 if factor > 1 else 1.0
    return top / bottom


def config(mscale, mscale_all_dim, factor=40.0, **kw):
    return MLAConfig.small(rope=True, gate=False, heads=3, **kw).replace(
        rope_scaling=RopeScaling(factor=factor, mscale=mscale, mscale_all_dim=mscale_all_dim))


@pytest.mark.parametrize("factor,mscale,all_dim", [(40.0, 0.707, 1.0), (40.0, 1.0, 0.707), (8.0, 2.0, 0.0),
                                                   (40.0, 1.0, 1.0), (1.0, 0.5, 1.0), (0.5, 3.0, 1.0)])
def test_config_factors(factor, mscale, all_dim):
    c = config(mscale, all_dim, factor=factor)
    assert c.rope_mscale == pytest.approx(by_hand(factor, mscale, all_dim), rel=1e-12)
    m_all = 0.1 * all_dim * math.log(factor) + 1.0 if factor > 1 else 1.0
    assert c.softmax_scale == pytest.approx(m_all ** 2 / math.sqrt(192), rel=1e-12)
    assert MLAConfig.deepseek_v3().rope_mscale == 1.0          # its config has mscale == mscale_all_dim
    assert MLAConfig.kimi_k3().rope_mscale == 1.0              # NoPE
    assert c.replace(rope=False).rope_mscale == 1.0


def test_apply_rope_scales_cos_and_sin():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 2, 64, generator=gen).to(torch.bfloat16)
    pos = torch.tensor([0, 1, 9, 3000])
    inv_freq = 10000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    m = by_hand(40.0, 0.707, 1.0)
    got = mla.apply_rope(x, pos, inv_freq.float(), m).double()
    xd = x.double()
    for t in range(4):
        for h in range(2):
            for i in range(32):
                a = float(pos[t]) * float(inv_freq.float()[i])
                c, s = math.cos(a) * m, math.sin(a) * m
                x0, x1 = float(xd[t, h, 2 * i]), float(xd[t, h, 2 * i + 1])
                for k, want in ((2 * i, x0 * c - x1 * s), (2 * i + 1, x1 * c + x0 * s)):
                    assert abs(float(got[t, h, k]) - want) <= 2 ** -8 * abs(want) + 1e-6, (t, h, k)


def test_layer_rope_parts_scale_by_mscale():
    """q's rope part (M1a copies q_pe) and the cache's k_pe scale by the ratio against the same
    layer with mscale == mscale_all_dim (rotation is linear); the nope parts do not change."""
    ratio = by_hand(40.0, 0.5, 1.0)
    out = {}
    for name, cfg in (("plain", config(1.0, 1.0)), ("scaled", config(0.5, 1.0))):
        layer, cache, md, hidden, _ = test_runtime.make_step(cfg, [5, 9], qlen=2, seed=3)
        assert cfg.softmax_scale == config(1.0, 1.0).softmax_scale
        q, _ = mla.pre(layer, hidden, cache, md)
        slots = md.slot_mapping[md.slot_mapping >= 0]
        out[name] = (q.double(), cache.view(-1, 576)[slots].double() * layer.kv_scale)
    (q0, rows0), (q1, rows1) = out["plain"], out["scaled"]
    assert torch.equal(q0[..., :512], q1[..., :512]) and torch.equal(rows0[:, :512], rows1[:, :512])
    assert torch.allclose(q1[..., 512:], ratio * q0[..., 512:], rtol=2 ** -7, atol=1e-3)
    assert torch.allclose(rows1[:, 512:], ratio * rows0[:, 512:], rtol=0.15, atol=2e-2)   # fp8 rows
    assert not torch.allclose(q1[..., 512:], q0[..., 512:], rtol=2 ** -7, atol=1e-3)


@pytest.mark.parametrize("mscale,all_dim", [(0.5, 1.0), (1.0, 0.707)])
def test_layer_matches_float64_with_mscale(monkeypatch, mscale, all_dim):
    """The whole step against tests/test_runtime.py's independent float64 oracle, its RoPE
    scaled by the by-hand ratio; and kimi_ops' own float64 layer (the demo's check) agrees."""
    from kimi_ops.runtime.reference import layer_float64, relative_error
    ratio = by_hand(40.0, mscale, all_dim)
    rope64 = test_runtime.rope64
    monkeypatch.setattr(test_runtime, "rope64", lambda x, p, f: ratio * rope64(x, p, f))
    lens = [6, 1, 11]
    layer, cache, md, hidden, bt = test_runtime.make_step(config(mscale, all_dim), lens, qlen=2, seed=5)
    out = layer(hidden, cache, md)
    test_runtime.check_step(layer, cache, md, hidden, bt, lens, out=out)
    assert relative_error(out, layer_float64(layer, hidden, cache, md)) <= test_runtime.LAYER_RTOL
