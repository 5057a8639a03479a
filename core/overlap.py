"""Rollouts generated ahead of the trainer (``trainer.max_staleness >= 1``): one generation in flight while a
step trains, its results handed over at the next step.

The controller (:mod:`rlx.trainer`) decides *what* to generate and *when* the engine takes new weights; this
module only runs one rollout job at a time beside the caller's thread and hands its result over:

- :meth:`RolloutAhead.launch` starts a job: in a thread of its own when the rollout group may run beside the
  other groups (``overlaps_training``: its workers live in this process or in processes of their own), at
  once otherwise (the engine shares processes with the trained roles, whose commands must not interleave:
  the schedule, and so the staleness, is the same, only the overlap is lost).
- :meth:`RolloutAhead.wait` waits for the job under way; its error, if it failed, is raised here, in the
  caller's thread. :meth:`RolloutAhead.take` hands over the finished rollouts.

On a GPU, a job in this process generates on a CUDA stream of its own, so its kernels run beside the
training step's; the stream waits for the work already queued (the weights just loaded) before the job
starts, and the job's results are complete before they are handed over.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlx.batch import Batch


@dataclass
class Rollouts:
    """One step's scored rollouts and how they were made."""

    batch: Batch
    metrics: dict[str, float] = field(default_factory=dict)  # the rollout's own (dynamic sampling)
    times: dict[str, float] = field(default_factory=dict)  # timing/gen, timing/reward, ... of making them
    version: int = 0  # the policy version the engine held when the job started
    started: float = 0.0  # time.perf_counter() when the job started and ended
    finished: float = 0.0


class RolloutAhead:
    """At most one rollout job in flight, and the finished one waiting to be trained on."""

    def __init__(self, concurrent: bool) -> None:
        self.concurrent = concurrent
        self._thread: threading.Thread | None = None
        self._result: Rollouts | None = None
        self._error: BaseException | None = None
        self.ready: Rollouts | None = None
        self.last_finished: float | None = None  # when the previous job ended (the engine idles since)
        self._started = 0.0  # when the job under way (or the last one) started
        self._stream: Any = None

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    def launch(self, job: Callable[[], Rollouts]) -> float:
        """Start ``job``; returns how long the engine sat idle since the previous job ended."""
        if self._thread is not None or self.ready is not None:
            raise RuntimeError("a rollout job is launched while the previous one is not taken yet")
        now = time.perf_counter()
        idle = 0.0 if self.last_finished is None else max(0.0, now - self.last_finished)
        self._started = now
        if not self.concurrent:
            self.ready = job()
            self.last_finished = self.ready.finished
            return idle
        device, stream = self._cuda_stream()
        self._result, self._error = None, None

        def run() -> None:
            try:
                if stream is None:
                    self._result = job()
                    return
                import torch

                torch.cuda.set_device(device)
                stream.wait_stream(torch.cuda.default_stream(device))  # the weights just loaded come first
                with torch.cuda.stream(stream):
                    result = job()
                stream.synchronize()  # handed over complete
                self._result = result
            except BaseException as exc:  # raised again in the caller's thread by wait()
                self._error = exc

        # A daemon: Ctrl-C or an error in the trainer must not wait for a long generation to end.
        self._thread = threading.Thread(target=run, name="rlx-rollout-ahead", daemon=True)
        self._thread.start()
        return idle

    def _cuda_stream(self) -> tuple[int, Any]:
        import sys

        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return 0, None
        device = torch.cuda.current_device()
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return device, self._stream

    def wait(self) -> float:
        """Wait for the job under way (if any) to end; returns the seconds waited. Its rollouts become
        :attr:`ready`; its error is raised here."""
        if self._thread is None:
            return 0.0
        start = time.perf_counter()
        self._thread.join()
        waited = time.perf_counter() - start
        self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        assert self._result is not None
        self.ready, self._result = self._result, None
        self.last_finished = self.ready.finished
        return waited

    def take(self) -> tuple[Rollouts | None, float]:
        """The finished rollouts (None when no job was launched) and the seconds waited for them."""
        waited = self.wait()
        ready, self.ready = self.ready, None
        return ready, waited


    def overlap(self, start: float, end: float) -> float:
        """Seconds of ``(start, end)`` during which the last job launched was generating beside the caller."""
        if not self.concurrent:
            return 0.0
        finished = self._result.finished if self._result is not None else (
            self.ready.finished if self.ready is not None else end)
        return interval_overlap((start, end), (self._started, finished))


def interval_overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    """Seconds two intervals (start, end) share."""
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))
