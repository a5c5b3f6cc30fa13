"""The one thread a served model's parallel work runs on (runtime/model_thread.py)."""

from __future__ import annotations

import threading

import pytest
import torch

import llmeasyquant as lq
from llmeasyquant.runtime.engine import Engine, EngineConfig
from llmeasyquant.runtime.model_thread import ModelThread
from llmeasyquant.runtime.requests import SamplingParams


def test_tasks_run_in_order_on_one_thread_and_errors_reach_the_caller():
    runner = ModelThread("test-model-thread")
    seen: list[tuple[int, str]] = []
    futures = [runner.submit(lambda i=i: seen.append((i, threading.current_thread().name))) for i in range(5)]
    for future in futures:
        future.result(timeout=10)
    assert seen == [(i, "test-model-thread") for i in range(5)]
    with pytest.raises(ZeroDivisionError):
        runner.call(lambda: 1 / 0)
    assert runner.call(lambda: 7) == 7  # the thread goes on after an error
    assert runner.call(runner.is_current) and not runner.is_current()


def test_the_engine_loads_and_steps_on_one_thread(tiny_llama, tiny_tokenizer, tmp_path):
    lq.save(lq.quantize(tiny_llama, lq.RTN(), lq.parse_scheme("w8a8"), progress=False), tmp_path / "w8", tiny_tokenizer)
    engine = Engine.load(str(tmp_path / "w8"), EngineConfig(kv_memory_mb=8))
    try:
        loaded_on = engine._runner.call(threading.get_ident)
        stepped_on = []
        forward = engine.decoder.forward

        def spy(*args):
            stepped_on.append((threading.get_ident(), torch.get_num_threads()))
            return forward(*args)

        engine.decoder.forward = spy
        completion = engine.generate([5, 6, 7], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        # the loop holds the thread from now on: every step ran where the model was loaded, with the caller's threads
        assert len(completion.token_ids) == 3
        assert set(stepped_on) == {(loaded_on, torch.get_num_threads())} and loaded_on != threading.get_ident()
    finally:
        engine.shutdown(grace_s=5)
