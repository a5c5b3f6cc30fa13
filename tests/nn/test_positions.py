"""Row positions: the context the runtime and a transformers forward set, and what a layer keeping sink tokens in
8 bits does with them (its first positions' rows as its 8-bit twin computes them, the others in 4 bits)."""

from __future__ import annotations

import threading

import torch

import llmeasyquant as lq
from llmeasyquant import LeanDecoder
from llmeasyquant.nn.positions import attach_position_hooks, current_positions, row_positions, sink_rows


def test_positions_are_set_for_the_block_only_and_nest():
    assert current_positions() is None and sink_rows(4, 1) is None
    with row_positions(torch.arange(3)[None].expand(2, 3)):
        assert current_positions().tolist() == [0, 1, 2, 0, 1, 2]
        assert sink_rows(6, 1).tolist() == [True, False, False, True, False, False]
        assert sink_rows(5, 1) is None  # rows that are not one per position (an expert's share): unknown
        with row_positions(torch.tensor([7])):
            assert sink_rows(1, 1) is None  # a decode step past the sinks
        assert current_positions().numel() == 6
    assert current_positions() is None


def test_a_transformers_forward_says_its_positions_prefill_and_decode(tiny_llama, random_ids):
    attach_position_hooks(tiny_llama.model)
    attach_position_hooks(tiny_llama.model)  # once only
    seen: list[list[int]] = []
    tiny_llama.model.layers[0].mlp.up_proj.register_forward_hook(lambda *_: seen.append(current_positions().tolist()))
    ids = random_ids[:2, :5]
    with torch.no_grad():
        tiny_llama(ids)
        tiny_llama.generate(ids[:1], attention_mask=torch.ones_like(ids[:1]), max_new_tokens=3, do_sample=False,
                            pad_token_id=0)
    assert seen[0] == [0, 1, 2, 3, 4] * 2
    assert seen[1] == [0, 1, 2, 3, 4] and seen[2:] == [[5], [6]]
    assert current_positions() is None


def test_sink_tokens_run_in_eight_bits_everywhere_the_model_runs(tiny_llama, random_ids, tmp_path):
    """Position 0 attends only to itself, so with every layer's sink rows in 8 bits its logits are those of the
    W8A8 model with the same codes, while later positions keep 4-bit activations; the lean decoder agrees."""
    import copy

    sinks = lq.quantize(copy.deepcopy(tiny_llama), lq.RTN(), lq.parse_scheme("w8a4-as1"), progress=False)
    plain = lq.quantize(copy.deepcopy(tiny_llama), lq.RTN(), lq.parse_scheme("w8a4"), progress=False)
    eight = lq.quantize(copy.deepcopy(tiny_llama), lq.RTN(), lq.W8A8, progress=False)
    ids = random_ids[:1, :12]
    with torch.no_grad():
        got, without, reference = sinks(ids).logits[0], plain(ids).logits[0], eight(ids).logits[0]
    assert torch.equal(got[0], reference[0]) and not torch.equal(got[0], without[0])
    assert not torch.equal(got[1:], reference[1:]) and not torch.equal(got[1:], without[1:])
    assert not any("sink" in name for name in sinks.state_dict())  # the 8-bit twin is no state of its own
    with torch.no_grad():
        torch.testing.assert_close(LeanDecoder(sinks, 16).prefill(ids), got[-1], atol=1e-4, rtol=1e-4)
    lq.save(sinks, tmp_path / "ckpt")
    loaded, _ = lq.load(tmp_path / "ckpt")  # the checkpoint's schemes ask for the positions again
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits[0], got)


def test_two_threads_running_one_model_each_see_their_own_positions(tiny_llama, random_ids):
    attach_position_hooks(tiny_llama.model)
    seen: dict[int, set[int]] = {}
    tiny_llama.model.layers[0].mlp.up_proj.register_forward_hook(
        lambda *_: seen.setdefault(threading.get_ident(), set()).add(current_positions().numel()))

    def run(length: int) -> None:
        with torch.no_grad():
            for _ in range(5):
                tiny_llama(random_ids[:1, :length])

    threads = [threading.Thread(target=run, args=(length,)) for length in (7, 11)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(map(sorted, seen.values())) == [[7], [11]]
    assert current_positions() is None
