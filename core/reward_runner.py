"""Running a reward function so that one bad response cannot stop or silently corrupt a run.

The :class:`RewardRunner` splits a :class:`~rlx.protocols.RewardBatch` into calls of ``chunk_size``
responses, runs up to ``num_workers`` calls at the same time (threads, or forked processes that are
killed when they overrun), gives each call ``timeout_s`` seconds, and checks what comes back. A call
can fail in four ways, each counted under its own name:

- ``exception``   the reward function raised;
- ``timeout``     it did not return within ``timeout_s`` seconds;
- ``invalid``     a score is NaN, infinite or not a number;
- ``wrong_count`` it returned a different number of scores (or extra values) than responses, or
  something that is neither a list of scores nor a :class:`~rlx.protocols.RewardOutput`.

A call of several responses that raises or returns the wrong count is retried one response at a
time, so only the responses that really fail are affected (a call that times out is not retried:
its responses all count as timed out). Then the policy decides: ``fail`` raises a
:class:`RewardError` naming the plugin, the response's index and data source, and the reason;
``zero`` gives the failed responses ``failure_score`` and reports them in :attr:`Scored.failures`
(the reward worker turns those into the ``reward/failed`` metrics). No response is dropped.
"""

from __future__ import annotations

import logging
import math
import numbers
import queue
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlx.errors import UserError, describe_exception
from rlx.protocols import RewardBatch, RewardOutput

log = logging.getLogger("rlx.reward")

FAILURE_KINDS: tuple[str, ...] = ("exception", "timeout", "invalid", "wrong_count")


class RewardError(UserError):
    """A reward plugin failed on some response and the policy is ``on_error=fail``."""


@dataclass(frozen=True)
class RewardPolicy:
    """How a reward function is run. The fields mirror ``reward.*`` core keys of the config."""

    on_error: str = "fail"
    failure_score: float = 0.0
    timeout_s: float = 300.0
    num_workers: int = 1
    chunk_size: int = 0
    executor: str = "thread"

    def __post_init__(self) -> None:
        if self.on_error not in ("fail", "zero"):
            raise ValueError(f"on_error must be 'fail' or 'zero'; got {self.on_error!r}")
        if self.executor not in ("thread", "process"):
            raise ValueError(f"executor must be 'thread' or 'process'; got {self.executor!r}")
        if self.num_workers < 1 or self.chunk_size < 0 or self.timeout_s < 0:
            raise ValueError("num_workers must be >= 1, chunk_size >= 0 and timeout_s >= 0")

    @classmethod
    def from_config(cls, section: Any) -> RewardPolicy:
        """From a :class:`rlx.config.RewardConfig` (or anything with the same attributes)."""
        if section is None:
            return cls()
        if isinstance(section, RewardPolicy):
            return section
        defaults = cls()
        return cls(**{f: getattr(section, f, getattr(defaults, f)) for f in cls.__dataclass_fields__})


@dataclass
class Failure:
    """One response whose reward could not be computed."""

    index: int
    kind: str
    message: str


@dataclass
class Scored:
    """The outcome for a whole batch: one score per response, extras, and what failed."""

    scores: list[float]
    extra: dict[str, list[float]] = field(default_factory=dict)
    failures: list[Failure] = field(default_factory=list)

    def failure_columns(self) -> dict[str, list[float]]:
        """Per-response 0/1 flags: ``failed`` and ``failed/<kind>`` for every kind."""
        n = len(self.scores)
        cols = {"failed": [0.0] * n, **{f"failed/{k}": [0.0] * n for k in FAILURE_KINDS}}
        for f in self.failures:
            cols["failed"][f.index] = 1.0
            cols[f"failed/{f.kind}"][f.index] = 1.0
        return cols


@dataclass
class _Outcome:
    ok: bool
    value: Any = None
    kind: str = ""
    message: str = ""


def subset(batch: RewardBatch, idx: Sequence[int]) -> RewardBatch:
    """The responses at ``idx`` as a batch of their own."""

    def pick(values: list[Any]) -> list[Any]:
        return [values[i] for i in idx] if len(values) == len(batch) else list(values)

    return RewardBatch(pick(batch.prompts), pick(batch.responses), pick(batch.ground_truths),
                       pick(batch.data_sources), pick(batch.extra_infos), pick(batch.response_lengths))


def _as_float(value: Any) -> float | None:
    """The score as a finite float, or None (NaN, infinity, a string, None, ...)."""
    if isinstance(value, (str, bytes)) or value is None:
        return None
    if not isinstance(value, numbers.Real):
        try:
            value = float(value)  # numpy scalars, 0-d tensors
        except (TypeError, ValueError):
            return None
    out = float(value)
    return out if math.isfinite(out) else None


def _child(fn: Callable[[RewardBatch], Any], job: RewardBatch, conn: Any) -> None:
    """Body of a forked worker process: call once, send the outcome back through the pipe."""
    try:
        out = _Outcome(True, fn(job))
    except BaseException as exc:
        out = _Outcome(False, kind="exception", message=describe_exception(exc))
    try:
        conn.send(out)
    except Exception as exc:  # the result could not be pickled
        conn.send(_Outcome(False, kind="wrong_count",
                           message=f"the result could not be sent back from the worker process: {exc}"))
    finally:
        conn.close()


class RewardRunner:
    """Runs ``fn`` over a batch with the given :class:`RewardPolicy`; see the module docstring."""

    def __init__(self, fn: Callable[[RewardBatch], Any], name: str, policy: RewardPolicy | None = None) -> None:
        self.fn, self.name = fn, name
        self.policy = policy or RewardPolicy()
        if self.policy.executor == "process":
            import multiprocessing as mp

            if "fork" not in mp.get_all_start_methods():
                raise UserError("reward.executor=process needs the 'fork' start method, which this platform "
                                "lacks.", "Use reward.executor=thread.")

    # -- calling --------------------------------------------------------------------------------
    def _call_many(self, jobs: list[RewardBatch]) -> list[_Outcome]:
        p = self.policy
        if p.executor == "process":
            return self._call_processes(jobs)
        if p.timeout_s == 0 and p.num_workers == 1:  # nothing to bound: call in this thread
            out = []
            for job in jobs:
                try:
                    out.append(_Outcome(True, self.fn(job)))
                except Exception as exc:
                    out.append(_Outcome(False, kind="exception", message=describe_exception(exc)))
            return out
        return self._call_threads(jobs)

    def _timeout_outcome(self, n: int) -> _Outcome:
        return _Outcome(False, kind="timeout",
                        message=f"no result within reward.timeout_s={self.policy.timeout_s:g} s (a call of {n} "
                                f"response{'s' if n != 1 else ''})")

    def _call_threads(self, jobs: list[RewardBatch]) -> list[_Outcome]:
        """Each call in a daemon thread; a call past its deadline is abandoned (it cannot be killed)."""
        results: list[_Outcome | None] = [None] * len(jobs)
        done: queue.SimpleQueue[tuple[int, _Outcome]] = queue.SimpleQueue()

        def work(i: int, job: RewardBatch) -> None:
            try:
                done.put((i, _Outcome(True, self.fn(job))))
            except BaseException as exc:
                done.put((i, _Outcome(False, kind="exception", message=describe_exception(exc))))

        pending = deque(enumerate(jobs))
        running: dict[int, float] = {}  # job index -> deadline
        limit = self.policy.timeout_s or math.inf
        while pending or running:
            while pending and len(running) < self.policy.num_workers:
                i, job = pending.popleft()
                threading.Thread(target=work, args=(i, job), daemon=True, name=f"rlx-reward-{self.name}-{i}").start()
                running[i] = time.monotonic() + limit
            wait = min(running.values()) - time.monotonic()
            try:
                i, outcome = done.get(timeout=None if math.isinf(wait) else max(wait, 0.0))
                if i in running:
                    del running[i]
                    results[i] = outcome
            except queue.Empty:
                pass
            now = time.monotonic()
            for i, deadline in list(running.items()):
                if deadline <= now:
                    del running[i]
                    results[i] = self._timeout_outcome(len(jobs[i]))
        return [r if r is not None else self._timeout_outcome(len(j)) for r, j in zip(results, jobs)]

    def _call_processes(self, jobs: list[RewardBatch]) -> list[_Outcome]:
        """Each call in a forked process; a process past its deadline is killed."""
        import multiprocessing as mp
        from multiprocessing.connection import wait as wait_any

        ctx = mp.get_context("fork")
        results: list[_Outcome | None] = [None] * len(jobs)
        pending = deque(enumerate(jobs))
        running: dict[Any, tuple[int, Any, float]] = {}  # pipe end -> (job index, process, deadline)
        limit = self.policy.timeout_s or math.inf
        while pending or running:
            while pending and len(running) < self.policy.num_workers:
                i, job = pending.popleft()
                reader, writer = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_child, args=(self.fn, job, writer), daemon=True,
                                   name=f"rlx-reward-{self.name}-{i}")
                with warnings.catch_warnings():  # Python >= 3.12 warns about forking a threaded process
                    warnings.simplefilter("ignore", DeprecationWarning)
                    proc.start()
                writer.close()
                running[reader] = (i, proc, time.monotonic() + limit)
            wait = min(d for _, _, d in running.values()) - time.monotonic()
            for reader in wait_any(list(running), timeout=None if math.isinf(wait) else max(wait, 0.0)):
                i, proc, _ = running.pop(reader)
                try:
                    results[i] = reader.recv()
                except (EOFError, OSError):
                    proc.join(5)
                    results[i] = _Outcome(False, kind="exception",
                                          message=f"the worker process died (exit code {proc.exitcode})")
                reader.close()
                proc.join(5)
            now = time.monotonic()
            for reader, (i, proc, deadline) in list(running.items()):
                if deadline <= now:
                    running.pop(reader)
                    proc.kill()
                    proc.join(5)
                    reader.close()
                    results[i] = self._timeout_outcome(len(jobs[i]))
        return [r if r is not None else self._timeout_outcome(len(j)) for r, j in zip(results, jobs)]

    # -- checking -------------------------------------------------------------------------------
    def _check(self, outcome: _Outcome, idx: list[int]) -> tuple[_Outcome, list[Failure]]:
        """Turn a successful call's value into a RewardOutput of the right size, or a failed outcome.

        Returns the (possibly failed) outcome and the per-response ``invalid`` failures.
        """
        if not outcome.ok:
            return outcome, []
        value = outcome.value
        if isinstance(value, RewardOutput):
            scores, extra = value.scores, value.extra
        elif isinstance(value, (list, tuple)) or (hasattr(value, "tolist") and not isinstance(value, (str, bytes))):
            scores, extra = value if isinstance(value, (list, tuple)) else value.tolist(), {}
        else:
            return _Outcome(False, kind="wrong_count",
                            message=f"returned a {type(value).__name__}, not a list of scores or a RewardOutput"), []
        try:
            scores = list(scores)
        except TypeError:
            return _Outcome(False, kind="wrong_count", message=f"scores is a {type(scores).__name__}, not a list"), []
        if len(scores) != len(idx):
            return _Outcome(False, kind="wrong_count",
                            message=f"returned {len(scores)} scores for {len(idx)} responses"), []
        clean_extra: dict[str, list[float]] = {}
        for key, values in (extra or {}).items():
            try:
                values = list(values)
            except TypeError:
                values = []
            if len(values) != len(idx):
                return _Outcome(False, kind="wrong_count",
                                message=f"extra {key!r} has {len(values)} values for {len(idx)} responses"), []
            # Extras are logged as means: a value that is not a finite number is logged as 0.0.
            clean_extra[str(key)] = [v if (v := _as_float(x)) is not None else 0.0 for x in values]
        clean: list[float | None] = [_as_float(s) for s in scores]
        invalid = [Failure(i, "invalid", f"returned the score {s!r}")
                   for i, s, c in zip(idx, scores, clean) if c is None]
        return _Outcome(True, RewardOutput(clean, clean_extra)), invalid  # type: ignore[arg-type]

    def _fail(self, batch: RewardBatch, failure: Failure, total: int) -> RewardError:
        i = failure.index
        source = batch.data_sources[i] if i < len(batch.data_sources) else "?"
        text = batch.responses[i] if i < len(batch.responses) else ""
        more = f" ({total - 1} more response{'s' if total != 2 else ''} failed too)" if total > 1 else ""
        return RewardError(
            f"Reward {self.name!r} failed on response {i} of the batch (data_source {source!r}): "
            f"{failure.kind}: {failure.message}{more}\n  response: {text[:300]!r}",
            "Fix the reward plugin, or set reward.on_error=zero to give such responses reward.failure_score "
            "and count them in the reward/failed metrics (reward.timeout_s bounds each call).",
        )

    # -- the whole batch ------------------------------------------------------------------------
    def run(self, batch: RewardBatch) -> Scored:
        n = len(batch)
        if n == 0:
            return Scored([])
        p = self.policy
        size = p.chunk_size or -(-n // p.num_workers)
        groups = [list(range(s, min(s + size, n))) for s in range(0, n, size)]
        outcomes = self._call_many([subset(batch, g) if len(g) != n else batch for g in groups])

        scores: list[float | None] = [None] * n
        extra: dict[str, list[float]] = {}
        failures: list[Failure] = []
        retry: list[tuple[list[int], _Outcome]] = []

        def accept(out: RewardOutput, idx: list[int]) -> None:
            for j, i in enumerate(idx):
                scores[i] = out.scores[j]
            for key, values in out.extra.items():
                col = extra.setdefault(key, [0.0] * n)
                for j, i in enumerate(idx):
                    col[i] = values[j]

        for idx, raw in zip(groups, outcomes):
            out, invalid = self._check(raw, idx)
            if out.ok:
                accept(out.value, idx)
                failures.extend(invalid)
            elif out.kind != "timeout" and len(idx) > 1:
                retry.append((idx, out))
            else:
                failures.extend(Failure(i, out.kind, out.message) for i in idx)

        for idx, first in retry:  # one response at a time, to find the responses that fail
            if p.on_error == "fail":
                for i in idx:  # stop at the first failure: it is the one to report
                    single, invalid = self._check(self._call_many([subset(batch, [i])])[0], [i])
                    if not single.ok or invalid:
                        failure = invalid[0] if single.ok else Failure(i, single.kind, single.message)
                        raise self._fail(batch, failure, 1)
                    accept(single.value, [i])
                raise self._fail(batch, Failure(idx[0], first.kind, f"{first.message} (a call of responses "
                                 f"{idx[0]}-{idx[-1]}; each of them alone scored fine)"), 1)
            singles = self._call_many([subset(batch, [i]) for i in idx])
            for i, raw in zip(idx, singles):
                single, invalid = self._check(raw, [i])
                if single.ok:
                    accept(single.value, [i])
                    failures.extend(invalid)
                else:
                    failures.append(Failure(i, single.kind, single.message))

        failures.sort(key=lambda f: f.index)
        if failures and p.on_error == "fail":
            raise self._fail(batch, failures[0], len(failures))
        for f in failures:
            scores[f.index] = None
        if failures:
            kinds: dict[str, int] = {}
            for f in failures:
                kinds[f.kind] = kinds.get(f.kind, 0) + 1
            first = failures[0]
            log.warning("reward %r: %d of %d responses failed (%s); they scored %g. First: response %d: %s: %s",
                        self.name, len(failures), n, ", ".join(f"{v} {k}" for k, v in kinds.items()),
                        p.failure_score, first.index, first.kind, first.message)
        final = [s if s is not None else float(p.failure_score) for s in scores]
        return Scored(final, extra, failures)
