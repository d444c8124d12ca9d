"""The public contract: every op's schema, pinned. A change here is an API change."""

import expecttest
import torch

import kimi_ops  # noqa: F401  (registers the ops)


def schema(name: str) -> str:
    return str(getattr(torch.ops.kimi_ops, name).default._schema)


class TestSchemas(expecttest.TestCase):
    def test_attention_schemas(self):
        self.assertExpectedInline(schema("mla_decode_splitkv"), """kimi_ops::mla_decode_splitkv(Tensor q, Tensor kv_cache, Tensor kv_indptr, Tensor kv_indices, *, int qlen, float scale, float kv_scale, int num_splits, Tensor? q_scale=None, Tensor? seq_lens=None, int dcp_rank=0, int dcp_world_size=1) -> (Tensor o_part, Tensor lse_part)""")
        self.assertExpectedInline(schema("mla_merge"), """kimi_ops::mla_merge(Tensor o_part, Tensor lse_part) -> (Tensor o, Tensor lse)""")
        self.assertExpectedInline(schema("mla_decode"), """kimi_ops::mla_decode(Tensor q, Tensor kv_cache, Tensor kv_indptr, Tensor kv_indices, *, int qlen, float scale, float kv_scale, int? num_splits=None, Tensor? q_scale=None, Tensor? seq_lens=None, int dcp_rank=0, int dcp_world_size=1, bool constant_kv=False) -> (Tensor o, Tensor lse)""")
        self.assertExpectedInline(schema("mla_cache_write"), """kimi_ops::mla_cache_write(Tensor kv_c, Tensor k_pe, Tensor(a!) kv_cache, Tensor slot_mapping, float kv_scale) -> ()""")
        self.assertExpectedInline(schema("mla_norm_cache_write"), """kimi_ops::mla_norm_cache_write(Tensor q_c, Tensor kv_c, Tensor k_pe, Tensor q_norm_weight, Tensor kv_norm_weight, Tensor(a!) kv_cache, Tensor slot_mapping, Tensor? g=None, *, float eps, float kv_scale, bool constant_w=False) -> (Tensor q_c_normed, Tensor gate)""")
        self.assertExpectedInline(schema("mla_norm_cache_write_q_b"), """kimi_ops::mla_norm_cache_write_q_b(Tensor q_c, Tensor kv_c, Tensor k_pe, Tensor q_norm_weight, Tensor kv_norm_weight, Tensor(a!) kv_cache, Tensor slot_mapping, Tensor q_b_weight, Tensor? q_b_scale_inv=None, Tensor? g=None, *, float eps, float kv_scale, int block_n=128, int block_k=128, bool constant_w=False) -> (Tensor q, Tensor gate)""")

    def test_mxfp4_schemas(self):
        self.assertExpectedInline(schema("mxfp4_quantize"), """kimi_ops::mxfp4_quantize(Tensor w) -> (Tensor w_packed, Tensor w_scale)""")
        self.assertExpectedInline(schema("mxfp4_dequantize"), """kimi_ops::mxfp4_dequantize(Tensor w_packed, Tensor w_scale, *, ScalarType? dtype=None) -> Tensor""")
        self.assertExpectedInline(schema("bmm_a16wfp4"), """kimi_ops::bmm_a16wfp4(Tensor x, Tensor w_packed, Tensor w_scale) -> Tensor""")
        self.assertExpectedInline(schema("mla_query"), """kimi_ops::mla_query(Tensor q_nope, Tensor q_pe, Tensor w_uk, Tensor? w_uk_scale=None, *, int? pad_heads=None, bool constant_w=False) -> Tensor""")
        self.assertExpectedInline(schema("mla_v_up_proj"), """kimi_ops::mla_v_up_proj(Tensor o, Tensor w_uv, Tensor? w_uv_scale=None, Tensor? gate=None, *, bool constant_w=False) -> Tensor""")

    def test_only_declared_mutation(self):
        mutable = {name: [a.name for a in getattr(torch.ops.kimi_ops, name).default._schema.arguments
                          if a.alias_info is not None and a.alias_info.is_write]
                   for name in kimi_ops.ops.SCHEMAS}
        self.assertEqual({k: v for k, v in mutable.items() if v}, {"mla_cache_write": ["kv_cache"],
                                                                    "mla_norm_cache_write": ["kv_cache"],
                                                                    "mla_norm_cache_write_q_b": ["kv_cache"]})
        for name in kimi_ops.ops.SCHEMAS:
            returns = getattr(torch.ops.kimi_ops, name).default._schema.returns
            self.assertTrue(all(r.alias_info is None for r in returns), f"{name} returns an alias")
