"""Layers that share an input (q/k/v, gate/up) fused into one GEMM: same results, same state dict."""

from __future__ import annotations

import copy

import pytest
import torch
from tests.models.test_arch import tiny

import llmeasyquant as lq
from llmeasyquant.nn.fused import fuse_shared_inputs
from llmeasyquant.nn.qlinear import forced_kernel


@pytest.mark.parametrize("scheme", ["w8a16", "w8a8", "w8a8-aasym", "w8a8-ac80", "w4a16-g32-asym", "w4a16",
                                    "w3a16-g32"])
def test_fused_model_gives_the_same_logits(tiny_llama, random_ids, scheme):
    model = lq.quantize(tiny_llama, lq.RTN(), lq.parse_scheme(scheme), progress=False)
    with torch.no_grad():
        before = model(random_ids).logits
        state = {k: v.clone() for k, v in model.state_dict().items()}
        blocks = len(model.model.layers)
        assert fuse_shared_inputs(model) == 2 * blocks
        attn = model.model.layers[0].self_attn
        assert attn.q_proj.shared is not None and attn.o_proj.shared is None
        # The members' buffers are views into one concatenated tensor: no copy of the weights is kept.
        assert attn.k_proj.qweight.untyped_storage().data_ptr() == attn.q_proj.qweight.untyped_storage().data_ptr()
        after = model(random_ids).logits
        assert torch.equal(after, before)
        assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
        with forced_kernel(model, "reference"):
            torch.testing.assert_close(model(random_ids).logits, before, rtol=2e-2, atol=2e-2)
        assert torch.equal(model(random_ids).logits, before)  # back on the registry's kernels


def test_fused_model_saves_loads_and_copies(tiny_llama, random_ids, tmp_path):
    model = lq.quantize(tiny_llama, lq.RTN(), lq.W8A16, progress=False)
    fuse_shared_inputs(model)
    with torch.no_grad():
        logits = model(random_ids).logits
        loaded, _ = lq.load(lq.save(model, tmp_path / "fused"))
        assert torch.equal(loaded(random_ids).logits, logits)
        twin = copy.deepcopy(model)
        assert torch.equal(twin(random_ids).logits, logits)
        model.to(torch.float32)  # moving a model gives each layer its own buffers back
        assert model.model.layers[0].self_attn.q_proj.shared is None
        assert torch.equal(model(random_ids).logits, logits)


def test_online_float_and_mismatched_layers_stay_apart(make_model):
    assert fuse_shared_inputs(make_model("llama")) == 0  # nothing quantized, nothing to fuse
    online = lq.quantize(make_model("llama"), lq.RTN(), lq.parse_scheme("w8a8-aonline"), progress=False)
    assert fuse_shared_inputs(online) == 0  # each layer's tracked range is its own state
    plan = lq.Plan((lq.Rule(r".*k_proj", lq.parse_scheme("w4a16-g32")), lq.Rule(".*", lq.W8A16)))
    mixed = lq.quantize(make_model("llama"), lq.RTN(), plan, progress=False)
    assert fuse_shared_inputs(mixed) == len(mixed.model.layers)  # gate/up fused; q/k/v differ in scheme


def test_weights_loaded_into_a_fused_model_reach_its_fused_gemm(make_model, random_ids):
    first = lq.quantize(make_model("llama"), lq.RTN(), lq.W8A16, progress=False)
    torch.manual_seed(1)
    other_float = make_model("llama")
    with torch.no_grad():
        for p in other_float.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    other = lq.quantize(other_float, lq.RTN(), lq.W8A16, progress=False)
    fuse_shared_inputs(first)
    with torch.no_grad():
        first(random_ids)  # the fused GEMMs prepare their kernels from the first weights
        first.load_state_dict(other.state_dict())
        assert torch.equal(first(random_ids).logits, other(random_ids).logits)


def test_falcon_runs_attention_and_mlp_inputs_as_one_gemm():
    """Falcon-7B's one LayerNorm feeds query_key_value and dense_h_to_4h in parallel: one group per block."""
    model = lq.quantize(tiny("falcon"), lq.RTN(), lq.W8A16, progress=False)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        separate = model(ids).logits
        assert lq.fuse_shared_inputs(model) == 2
        torch.testing.assert_close(model(ids).logits, separate, atol=1e-5, rtol=1e-5)

