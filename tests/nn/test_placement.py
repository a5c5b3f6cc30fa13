"""Weights moved onto 2 MiB pages: the same tensors (values, views, sharing), the same outputs bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch

import llmeasyquant as lq
from llmeasyquant.infra import memory
from llmeasyquant.nn.fused import fuse_shared_inputs
from llmeasyquant.nn.placement import place_on_huge_pages
from llmeasyquant.runtime.decoder import LeanDecoder

needs_huge_pages = pytest.mark.skipif(not memory.huge_pages_available(), reason="no transparent huge pages here")


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@needs_huge_pages
@pytest.mark.parametrize("scheme", ["w4a16", "w4a16-g32-asym", "w8a16", "w8a8"])
def test_fused_quantized_model_gives_the_same_logits(tiny_llama, random_ids, scheme):
    model = lq.quantize(tiny_llama, lq.RTN(), lq.parse_scheme(scheme), progress=False).eval()
    fuse_shared_inputs(model)
    decoder = LeanDecoder(model, 40)
    with torch.no_grad():
        before, state = model(random_ids).logits, _state(model)
        tokens = decoder.generate(random_ids[:1, :8], 6)
        attn = model.model.layers[0].self_attn
        old = attn.q_proj.qweight.data_ptr()
        moved = place_on_huge_pages(model)
        assert moved >= sum(t.numel() * t.element_size() for t in state.values()) // 2  # fused views counted once
        assert attn.q_proj.qweight.data_ptr() != old
        # The members are still views into their group's joined buffers, now in the new memory.
        combined = attn.q_proj.shared[0].combined
        assert attn.k_proj.qweight.untyped_storage().data_ptr() == combined.qweight.untyped_storage().data_ptr()
        assert attn.k_proj.qweight.data_ptr() == combined.qweight.data_ptr() + attn.q_proj.qweight.numel()
        assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
        assert torch.equal(model(random_ids).logits, before)
        assert torch.equal(LeanDecoder(model, 40).generate(random_ids[:1, :8], 6), tokens)


@needs_huge_pages
def test_moved_model_saves_loads_and_copies(tiny_llama, random_ids, tmp_path):
    model = lq.quantize(tiny_llama, lq.RTN(), lq.parse_scheme("w4a16"), progress=False).eval()
    fuse_shared_inputs(model)
    place_on_huge_pages(model)
    with torch.no_grad():
        before = model(random_ids).logits
        lq.save(model, tmp_path / "ckpt")
        loaded, _ = lq.load(tmp_path / "ckpt")
        assert torch.equal(loaded(random_ids).logits, before)
        twin = copy.deepcopy(model)
        down = model.model.layers[0].mlp.down_proj
        assert twin.model.layers[0].mlp.down_proj.qweight.data_ptr() != down.qweight.data_ptr()
        assert torch.equal(twin(random_ids).logits, before)


@needs_huge_pages
def test_float_model_keeps_its_tied_weights(tiny_llama, random_ids):
    model = tiny_llama.eval()
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():
        before = model(random_ids).logits
        place_on_huge_pages(model)
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
        assert isinstance(model.lm_head.weight, torch.nn.Parameter)
        assert torch.equal(model(random_ids).logits, before)


def test_nothing_moves_without_huge_pages(tiny_llama, monkeypatch):
    monkeypatch.setattr(memory, "huge_pages_available", lambda: False)
    pointer = tiny_llama.lm_head.weight.data_ptr()
    assert place_on_huge_pages(tiny_llama) == 0
    assert tiny_llama.lm_head.weight.data_ptr() == pointer
