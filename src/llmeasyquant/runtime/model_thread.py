"""One thread for all of a served model's parallel work: loading it, choosing its kernels, and every step.

PyTorch's CPU operators and ours run their parallel loops on OpenMP, and GNU OpenMP keeps a team of worker
threads for each thread that opens parallel regions. When two threads of a process have opened them (a model loaded
on the main thread, its steps run on the engine's thread), the process holds more OpenMP threads than the machine
has cores, and OpenMP then stops spinning between regions: every region of a step wakes its workers from sleep.
Measured on the 2-core reference machine, SmolLM2-135M W8A8, one sequence: 12-13 ms a token when the steps ran on
the thread that loaded the model (or when everything ran on one other thread), 20-22 ms when the steps ran on a
second thread (timed by hand on 2026-11-28, no record kept). So `Engine.load` loads the model on the engine's
thread, and the engine's loop runs on it too: the process's only OpenMP team.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

_T = TypeVar("_T")


class ModelThread:
    """A daemon thread that runs the callables given to it, one at a time, in order (`submit`: a Future; `call`:
    wait for the result). A task that runs long holds it: the engine's loop, once started, until shutdown (a call
    made meanwhile waits for it). A daemon, so that a process that never shuts its engine down still exits."""

    def __init__(self, name: str = "llmeasyquant-engine") -> None:
        self._tasks: queue.SimpleQueue[tuple[Callable[[], object], Future]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            task, future = self._tasks.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(task())
            except BaseException as error:  # the caller gets it from the Future; the thread goes on
                future.set_exception(error)

    def submit(self, task: Callable[[], _T]) -> Future[_T]:
        future: Future[_T] = Future()
        self._tasks.put((task, future))
        return future

    def call(self, task: Callable[[], _T]) -> _T:
        return self.submit(task).result()

    def is_current(self) -> bool:
        return threading.current_thread() is self._thread
