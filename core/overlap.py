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

On a GPU, a job in this process generates on a CUDA stream of its own (of high priority), so its kernels run
beside the training step's; the stream waits for the work already queued (the weights just loaded) before the job
starts, and the job's results are complete before they are handed over.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

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
    carry: Batch | None = None  # partial rollouts: responses of groups not finished yet (no scores)


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
        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return 0, None
        device = torch.cuda.current_device()
        if self._stream is None:
            # High priority: the generation is the step's long pole as a rule (decoding is bound by memory
            # bandwidth, training by compute), so its small kernels go first whenever the GPU can take a block.
            self._stream = torch.cuda.Stream(device, priority=-1)
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


# -- partial rollouts (rollout.partial) ----------------------------------------------------------------------
# A response interrupted at a step boundary is a row whose ``finished`` is False: its prompt, the tokens it has
# (``responses`` under ``response_mask``), their log-probs and, per token, the policy version that made them
# (``response_versions``). It continues as a new prompt, its prompt followed by those tokens, and the new tokens
# are appended (:func:`stitch`). A group trains once all its responses are finished.


def continuation_prompts(rows: Batch, pad_token_id: int) -> Batch:
    """Each row's prompt followed by its response so far, left-padded (the engine continues from there)."""
    import torch

    from rlx.batch import Batch

    seqs = [torch.cat([rows["prompts"][i][rows["prompt_mask"][i].bool()],
                       rows["responses"][i][rows["response_mask"][i].bool()]]) for i in range(len(rows))]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = s
        mask[i, width - len(s):] = 1
    return Batch({"input_ids": ids, "attention_mask": mask}, dict(rows.non_tensors))


def stitch(rows: Batch, new: Batch, version: int, max_tokens: int, pad_token_id: int) -> Batch:
    """``rows`` with ``new``'s tokens (generated from :func:`continuation_prompts` of them) appended, each row
    cut at ``max_tokens`` in all; the new tokens get ``version``. A row is finished when the engine says so or
    when it has used its whole budget."""
    import torch

    from rlx.batch import Batch

    lengths, parts = [], []
    for i in range(len(rows)):
        have = int(rows["response_mask"][i].sum())
        got = min(int(new["response_mask"][i].sum()), max_tokens - have)
        parts.append((have, got))
        lengths.append(have + got)
    width = max(max(lengths), 1)
    out = {"responses": torch.full((len(rows), width), pad_token_id, dtype=torch.long),
           "response_mask": torch.zeros((len(rows), width), dtype=torch.long),
           "rollout_log_probs": torch.zeros((len(rows), width)),
           "response_versions": torch.zeros((len(rows), width), dtype=torch.long)}
    old_versions = rows.tensors.get("response_versions")
    for i, (have, got) in enumerate(parts):
        out["responses"][i, :have] = rows["responses"][i, :have]
        out["rollout_log_probs"][i, :have] = rows["rollout_log_probs"][i, :have]
        if old_versions is not None:
            out["response_versions"][i, :have] = old_versions[i, :have]
        out["responses"][i, have:have + got] = new["responses"][i, :got]
        out["rollout_log_probs"][i, have:have + got] = new["rollout_log_probs"][i, :got]
        out["response_versions"][i, have:have + got] = version
        out["response_mask"][i, :have + got] = 1
    finished = new["finished"].bool() | (torch.tensor(lengths) >= max_tokens)
    # A response cut at its budget before the engine's own stop is finished by length, as a clipped one is.
    tensors = dict(rows.tensors)
    tensors.update(out, finished=finished)
    return Batch(tensors, dict(rows.non_tensors))


def head_versions(batch: Batch) -> torch.Tensor:
    """(B,) the version of each response's first token; a response without tokens gets a very large one."""
    import torch

    versions = batch["response_versions"].masked_fill(batch["response_mask"] == 0, 2**62)
    return versions.min(-1).values if versions.shape[1] else torch.full((len(batch),), 2**62)


def complete_groups(batch: Batch) -> torch.Tensor:
    """(B,) whether every response of the row's group is finished."""
    import torch

    groups, inverse = torch.unique(batch["group_index"], return_inverse=True)
    unfinished = torch.zeros(len(groups), dtype=torch.long).index_add_(0, inverse, (~batch["finished"]).long())
    return unfinished[inverse] == 0


def restart(batch: Batch, rows: torch.Tensor, pad_token_id: int) -> Batch:
    """``batch`` with the responses of ``rows`` (a bool mask) emptied, to be generated again from the prompt."""
    from rlx.batch import Batch

    tensors = dict(batch.tensors)
    keep = ~rows.unsqueeze(-1)
    tensors["responses"] = batch["responses"].masked_fill(~keep, pad_token_id)
    for key in ("response_mask", "rollout_log_probs", "response_versions"):
        tensors[key] = batch[key] * keep
    tensors["finished"] = batch["finished"] & ~rows
    return Batch(tensors, dict(batch.non_tensors))
