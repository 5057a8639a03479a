"""Running a reward function so that one bad response cannot stop or silently corrupt a run.

The :class:`RewardRunner` splits a :class:`~rlx.protocols.RewardBatch` into calls of ``chunk_size``
responses, runs up to ``num_workers`` calls at the same time (threads, or forked processes that are
killed when they overrun), gives each call ``timeout_s`` seconds, and checks what comes back. A call
can fail in five ways, each counted under its own name:

- ``exception``   the reward function raised;
- ``timeout``     it did not return within ``timeout_s`` seconds;
- ``invalid``     a score is NaN, infinite or not a number;
- ``wrong_count`` it returned a different number of scores than responses;
- ``bad_output``  what it returned is malformed: neither a list of scores nor a
  :class:`~rlx.protocols.RewardOutput`, extra values or answers of the wrong length or type, or (with
  ``executor=process``) a result the worker process could not send back as JSON.

One rule decides what is an error, whatever ``on_error`` says. A call of several responses that raises
or returns the wrong count is retried one response at a time, so only the responses that really fail
are affected; if every response scores fine alone, the call's failure cannot be pinned on one of them
and all its responses count as failed. A ``bad_output`` or a ``timeout`` is not retried: every response
of the call counts as failed (a malformed output is a bug of the plugin, not of one response). Then the
policy decides: ``fail`` raises a :class:`RewardError` naming the plugin, the response's index and data
source, and the reason; ``zero`` gives the failed responses ``failure_score`` and reports them in
:attr:`Scored.failures` (the reward worker turns those into the ``reward/failed`` metrics). No response
is dropped.

Answers: a reward may say which final answer it scored in each response (``RewardOutput.answers``: a
string, or None where it found none); majority voting in :mod:`rlx.run.evaluation` uses them.

With ``executor=process`` the forked child checks the output itself and sends it back as JSON (finite
floats, ``null`` for an invalid score, strings), never a pickle: the parent parses it with a size limit and
treats anything malformed as a failed call, so nothing the child sends can run code in the trainer. The
child leads its own process group, and the whole group is killed when the call overruns.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import queue
import signal
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlx.errors import UserError, describe_exception
from rlx.protocols import RewardBatch, RewardOutput

log = logging.getLogger("rlx.reward")

FAILURE_KINDS: tuple[str, ...] = ("exception", "timeout", "invalid", "wrong_count", "bad_output")

# What a worker process may send back for one call: room for scores, extras and answers of every
# response, small enough that a runaway reward cannot fill the trainer's memory through the pipe.
RESULT_BYTES_BASE = 1 << 20
RESULT_BYTES_PER_RESPONSE = 64 << 10


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
    """The outcome for a whole batch: one score per response, extras, answers, and what failed.

    ``answers[i]`` is the final answer the reward scored in response ``i`` when the reward reports
    answers (``RewardOutput.answers``), else None; a failed response has none.
    """

    scores: list[float]
    extra: dict[str, list[float]] = field(default_factory=dict)
    failures: list[Failure] = field(default_factory=list)
    answers: list[str | None] = field(default_factory=list)

    def failure_columns(self) -> dict[str, list[float]]:
        """Per-response 0/1 flags: ``failed`` and ``failed/<kind>`` for every kind."""
        n = len(self.scores)
        cols = {"failed": [0.0] * n, **{f"failed/{k}": [0.0] * n for k in FAILURE_KINDS}}
        for f in self.failures:
            cols["failed"][f.index] = 1.0
            cols[f"failed/{f.kind}"][f.index] = 1.0
        return cols


@dataclass
class _Checked:
    """A call's output after checking, positions relative to the call."""

    scores: list[float | None]  # None where the score was not a finite number
    invalid: dict[int, str]  # position -> what was wrong with its score
    extra: dict[str, list[float]]
    answers: list[str | None] | None


@dataclass
class _Outcome:
    ok: bool
    value: _Checked | None = None
    kind: str = ""
    message: str = ""


def _failed(kind: str, message: str) -> _Outcome:
    return _Outcome(False, kind=kind, message=message)


def subset(batch: RewardBatch, idx: Sequence[int]) -> RewardBatch:
    """The responses at ``idx`` as a batch of their own."""

    def pick(values: list[Any]) -> list[Any]:
        return [values[i] for i in idx] if len(values) == len(batch) else list(values)

    return RewardBatch(pick(batch.prompts), pick(batch.responses), pick(batch.ground_truths),
                       pick(batch.data_sources), pick(batch.extra_infos), pick(batch.response_lengths),
                       pick(batch.messages))


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


def _as_list(values: Any) -> list[Any] | None:
    if isinstance(values, (str, bytes, Mapping)):
        return None
    if hasattr(values, "tolist"):  # numpy arrays, tensors
        values = values.tolist()
    try:
        return list(values)
    except TypeError:
        return None


def _check_value(value: Any, n: int) -> _Outcome:
    """A reward function's return value for a call of ``n`` responses, checked: scores, extras, answers."""
    if isinstance(value, RewardOutput):
        scores, extra, answers = _as_list(value.scores), value.extra, getattr(value, "answers", None)
        if scores is None:
            return _failed("bad_output", f"scores is a {type(value.scores).__name__}, not a list")
    else:
        scores, extra, answers = _as_list(value), {}, None
        if scores is None:
            return _failed("bad_output", f"returned a {type(value).__name__}, not a list of scores or a "
                                         "RewardOutput")
    if len(scores) != n:
        return _failed("wrong_count", f"returned {len(scores)} scores for {n} responses")
    if not isinstance(extra or {}, Mapping):
        return _failed("bad_output", f"extra is a {type(extra).__name__}, not a dict of lists")
    clean_extra: dict[str, list[float]] = {}
    for key, raw in (extra or {}).items():
        values = _as_list(raw)
        if values is None:
            return _failed("bad_output", f"extra {key!r} is a {type(raw).__name__}, not a list")
        if len(values) != n:
            return _failed("bad_output", f"extra {key!r} has {len(values)} values for {n} responses")
        # Extras are logged as means: a value that is not a finite number is logged as 0.0.
        clean_extra[str(key)] = [v if (v := _as_float(x)) is not None else 0.0 for x in values]
    clean_answers: list[str | None] | None = None
    if answers is not None:
        clean_answers = _as_list(answers)
        if clean_answers is None or len(clean_answers) != n:
            size = f"{len(clean_answers)} answers" if clean_answers is not None else f"a {type(answers).__name__}"
            return _failed("bad_output", f"answers is {size} for {n} responses; give a list of one answer "
                                         "(a str, or None) per response")
        wrong = next((a for a in clean_answers if a is not None and not isinstance(a, str)), None)
        if wrong is not None:
            return _failed("bad_output", f"an answer is a {type(wrong).__name__} ({wrong!r:.80}); answers are "
                                         "str or None")
    clean = [_as_float(s) for s in scores]
    invalid = {j: f"returned the score {s!r:.200}" for j, (s, c) in enumerate(zip(scores, clean)) if c is None}
    return _Outcome(True, _Checked(clean, invalid, clean_extra, clean_answers))


def _call_checked(fn: Callable[[RewardBatch], Any], job: RewardBatch) -> _Outcome:
    """Call once; an exception of the function, or of a malformed value while checking it, is a failed call."""
    try:
        value = fn(job)
    except BaseException as exc:
        if isinstance(exc, (KeyboardInterrupt, SystemExit)) and threading.current_thread() is threading.main_thread():
            raise
        return _failed("exception", describe_exception(exc))
    try:
        return _check_value(value, len(job))
    except Exception as exc:  # e.g. a score whose float() or an extra whose iteration raises
        return _failed("bad_output", f"its output could not be read: {describe_exception(exc)}")


# -- the process executor's wire format ------------------------------------------------------------
def encode_outcome(out: _Outcome) -> bytes:
    """A checked outcome as JSON: only finite floats, null, strings and lists/dicts of them."""
    if out.ok and out.value is not None:
        c = out.value
        doc: dict[str, Any] = {"ok": True, "scores": c.scores, "invalid": [[j, m] for j, m in c.invalid.items()],
                               "extra": c.extra, "answers": c.answers}
    else:
        doc = {"ok": False, "kind": out.kind, "message": out.message}
    return json.dumps(doc, allow_nan=False).encode("utf-8")


def _finite_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def decode_outcome(data: bytes, n: int) -> _Outcome:
    """Parse what a worker process sent for a call of ``n`` responses; anything malformed is a failed call."""
    try:
        doc = json.loads(data)
        if not isinstance(doc, dict) or not isinstance(doc.get("ok"), bool):
            raise ValueError("not a result record")
        if not doc["ok"]:
            kind, message = doc.get("kind"), doc.get("message")
            if kind not in FAILURE_KINDS or not isinstance(message, str):
                raise ValueError("a failure record without a known kind and a message")
            return _failed(kind, message[:4000])
        scores, invalid, extra, answers = doc.get("scores"), doc.get("invalid"), doc.get("extra"), doc.get("answers")
        if not isinstance(scores, list) or len(scores) != n or \
                not all(s is None or _finite_number(s) for s in scores):
            raise ValueError(f"scores is not a list of {n} finite numbers or nulls")
        if not isinstance(invalid, list) or not all(
                isinstance(p, list) and len(p) == 2 and isinstance(p[0], int) and 0 <= p[0] < n
                and isinstance(p[1], str) for p in invalid):
            raise ValueError("malformed list of invalid scores")
        problems = {int(j): str(m) for j, m in invalid}
        if {j for j, s in enumerate(scores) if s is None} != set(problems):
            raise ValueError("the invalid scores do not match the nulls")
        if not isinstance(extra, dict) or not all(
                isinstance(v, list) and len(v) == n and all(_finite_number(x) for x in v) for v in extra.values()):
            raise ValueError(f"extra is not a dict of lists of {n} finite numbers")
        if answers is not None and (not isinstance(answers, list) or len(answers) != n
                                    or not all(a is None or isinstance(a, str) for a in answers)):
            raise ValueError(f"answers is not a list of {n} strings or nulls")
        return _Outcome(True, _Checked([None if s is None else float(s) for s in scores], problems,
                                       {str(k): [float(x) for x in v] for k, v in extra.items()}, answers))
    except (ValueError, TypeError, RecursionError) as exc:
        return _failed("bad_output", f"the worker process sent back something that is not a reward result: {exc}")


def _child(fn: Callable[[RewardBatch], Any], job: RewardBatch, conn: Any) -> None:
    """Body of a forked worker process: call once, send the checked outcome back as JSON."""
    os.setpgid(0, 0)  # its own process group, so the parent can kill whatever the reward starts
    out = _call_checked(fn, job)
    try:
        data = encode_outcome(out)
    except (TypeError, ValueError) as exc:
        data = encode_outcome(_failed("bad_output", f"the result could not be encoded as JSON: {exc}"))
    try:
        conn.send_bytes(data)
    finally:
        conn.close()


def _kill_group(proc: Any) -> None:
    """Kill a worker process and every process it started in its group."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.join(5)


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
            return [_call_checked(self.fn, job) for job in jobs]
        return self._call_threads(jobs)

    def _timeout_outcome(self, n: int) -> _Outcome:
        return _failed("timeout", f"no result within reward.timeout_s={self.policy.timeout_s:g} s (a call of {n} "
                                  f"response{'s' if n != 1 else ''})")

    def _call_threads(self, jobs: list[RewardBatch]) -> list[_Outcome]:
        """Each call in a daemon thread; a call past its deadline is abandoned (it cannot be killed)."""
        results: list[_Outcome | None] = [None] * len(jobs)
        done: queue.SimpleQueue[tuple[int, _Outcome]] = queue.SimpleQueue()

        def work(i: int, job: RewardBatch) -> None:
            done.put((i, _call_checked(self.fn, job)))

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
        """Each call in a forked process; a process past its deadline is killed with its process group."""
        import multiprocessing as mp
        from multiprocessing.connection import wait as wait_any

        ctx = mp.get_context("fork")
        results: list[_Outcome | None] = [None] * len(jobs)
        pending = deque(enumerate(jobs))
        running: dict[Any, tuple[int, Any, float]] = {}  # pipe end -> (job index, process, deadline)
        limit = self.policy.timeout_s or math.inf
        try:
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
                    results[i] = self._receive(reader, proc, len(jobs[i]))
                    reader.close()
                    proc.join(5)
                now = time.monotonic()
                for reader, (i, proc, deadline) in list(running.items()):
                    if deadline <= now:
                        running.pop(reader)
                        _kill_group(proc)
                        reader.close()
                        results[i] = self._timeout_outcome(len(jobs[i]))
        finally:
            for reader, (_, proc, _) in running.items():  # interrupted: leave no worker behind
                _kill_group(proc)
                reader.close()
        return [r if r is not None else self._timeout_outcome(len(j)) for r, j in zip(results, jobs)]

    @staticmethod
    def _receive(reader: Any, proc: Any, n: int) -> _Outcome:
        limit = RESULT_BYTES_BASE + RESULT_BYTES_PER_RESPONSE * n
        try:
            data = reader.recv_bytes(limit)
        except EOFError:
            proc.join(5)
            return _failed("exception", f"the worker process died (exit code {proc.exitcode})")
        except OSError as exc:
            _kill_group(proc)
            return _failed("bad_output", f"the worker process sent back more than {limit} bytes for {n} "
                                         f"response{'s' if n != 1 else ''}, or nothing readable ({exc})")
        return decode_outcome(data, n)

    # -- the whole batch ------------------------------------------------------------------------
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

    def run(self, batch: RewardBatch) -> Scored:
        n = len(batch)
        if n == 0:
            return Scored([])
        p = self.policy
        size = p.chunk_size or -(-n // p.num_workers)
        groups = [list(range(s, min(s + size, n))) for s in range(0, n, size)]
        outcomes = self._call_many([subset(batch, g) if len(g) != n else batch for g in groups])

        scores: list[float | None] = [None] * n
        answers: list[str | None] = [None] * n
        extra: dict[str, list[float]] = {}
        failures: list[Failure] = []
        retry: list[tuple[list[int], _Outcome]] = []

        def accept(out: _Checked, idx: list[int]) -> None:
            for j, i in enumerate(idx):
                scores[i] = out.scores[j]
                if out.answers is not None:
                    answers[i] = out.answers[j]
            for key, values in out.extra.items():
                col = extra.setdefault(key, [0.0] * n)
                for j, i in enumerate(idx):
                    col[i] = values[j]
            failures.extend(Failure(idx[j], "invalid", message) for j, message in out.invalid.items())

        for idx, out in zip(groups, outcomes):
            if out.ok and out.value is not None:
                accept(out.value, idx)
            elif out.kind in ("exception", "wrong_count") and len(idx) > 1:
                retry.append((idx, out))
            else:
                failures.extend(Failure(i, out.kind, out.message) for i in idx)

        for idx, first in retry:  # one response at a time, to find the responses that fail
            singles = self._call_many([subset(batch, [i]) for i in idx])
            if all(s.ok for s in singles):
                # No single response reproduces the failure: it belongs to the call, so the whole call failed.
                failures.extend(Failure(i, first.kind, f"{first.message} (a call of responses {idx[0]}-{idx[-1]}; "
                                                       "each of them alone scored fine)") for i in idx)
                continue
            for i, single in zip(idx, singles):
                if single.ok and single.value is not None:
                    accept(single.value, [i])
                else:
                    failures.append(Failure(i, single.kind, single.message))

        failures.sort(key=lambda f: f.index)
        if failures and p.on_error == "fail":
            raise self._fail(batch, failures[0], len(failures))
        for f in failures:
            scores[f.index] = None
            answers[f.index] = None
        if failures:
            kinds: dict[str, int] = {}
            for f in failures:
                kinds[f.kind] = kinds.get(f.kind, 0) + 1
            first_failure = failures[0]
            log.warning("reward %r: %d of %d responses failed (%s); they scored %g. First: response %d: %s: %s",
                        self.name, len(failures), n, ", ".join(f"{v} {k}" for k, v in kinds.items()),
                        p.failure_score, first_failure.index, first_failure.kind, first_failure.message)
        final = [s if s is not None else float(p.failure_score) for s in scores]
        return Scored(final, extra, failures, answers)
