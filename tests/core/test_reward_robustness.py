"""A reward that raises, hangs, returns NaN or the wrong number of scores: the configured policy decides.

``on_error=zero``: the run goes on, the failed responses get ``failure_score`` and are flagged in the
``reward/failed*`` metrics, and every other response keeps its own score. ``on_error=fail``: the run
stops with a message naming the plugin, the response and the reason. Real reward functions, real
threads and processes, a real tokenizer; end-to-end through ``rlx train`` at the bottom.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from rlx.batch import Batch
from rlx.config import RewardConfig
from rlx.plugins.loggers.jsonl import read_metrics
from rlx.plugins.tasks.builtin import build_tokenizer
from rlx.protocols import RewardBatch, RewardOutput
from rlx.run.reward_worker import RewardWorker
from rlx.run.rewards import FAILURE_KINDS, RewardError, RewardPolicy, RewardRunner

RELEASE = threading.Event()  # lets hung reward threads finish when the module's tests are done


@pytest.fixture(autouse=True, scope="module")
def _release_hung_threads():
    RELEASE.clear()  # module state outlives a pytest session run in the same process (mutation testing)
    yield
    RELEASE.set()


def rb(responses: list[str]) -> RewardBatch:
    n = len(responses)
    return RewardBatch([f"prompt {i}" for i in range(n)], responses, [str(i) for i in range(n)],
                       [f"src{i % 2}" for i in range(n)], [{"index": i} for i in range(n)],
                       [len(r) for r in responses])


def length_score(r: str) -> float:
    return float(len(r))


class Flaky:
    """Scores each response by its length, and misbehaves on marked responses. Counts its calls."""

    def __init__(self) -> None:
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self, batch: RewardBatch) -> RewardOutput:
        with self.lock:
            self.calls += 1
        scores: list[object] = []
        for r in batch.responses:
            if "boom" in r:
                raise ValueError(f"cannot score {r!r}")
            if "hang" in r:
                RELEASE.wait(60)
            if "spin" in r:
                while True:  # burns CPU forever; only a process can be stopped
                    pass
            if "drop" in r:
                continue  # a filtering bug: fewer scores than responses
            scores.append({"nan": math.nan, "inf": math.inf, "str": "1.0", "none": None}.get(r, length_score(r)))
        return RewardOutput(scores, {"flaky/len": [float(len(r)) for r in batch.responses if "drop" not in r]})


def run(responses: list[str], **policy) -> tuple[object, Flaky]:
    fn = Flaky()
    return RewardRunner(fn, "flaky", RewardPolicy(**policy)).run(rb(responses)), fn


def assert_no_score_lost(out, responses: list[str], failure_score: float) -> None:
    """Every response has its own score, or is listed as failed and has the failure score."""
    failed = {f.index for f in out.failures}
    for i, r in enumerate(responses):
        if i in failed:
            assert out.scores[i] == failure_score, (i, r)
        else:
            assert out.scores[i] == length_score(r), (i, r)
    cols = out.failure_columns()
    assert sum(cols["failed"]) == len(failed)
    assert sum(sum(cols[f"failed/{k}"]) for k in FAILURE_KINDS) == len(failed)


# -- exceptions ----------------------------------------------------------------------------------
def test_exception_zero_policy_scores_only_the_failing_response_and_counts_it():
    responses = ["a", "bb", "boom", "dddd", "eeeee"]
    out, fn = run(responses, on_error="zero", failure_score=-1.0)
    assert [(f.index, f.kind) for f in out.failures] == [(2, "exception")]
    assert "ValueError: cannot score 'boom'" in out.failures[0].message
    assert "test_reward_robustness.py" in out.failures[0].message  # where it was raised
    assert_no_score_lost(out, responses, -1.0)
    assert out.extra["flaky/len"] == [1.0, 2.0, 0.0, 4.0, 5.0]  # extras of the others kept
    assert fn.calls == 1 + len(responses)  # the failed call, then one call per response


def test_exception_fail_policy_names_the_plugin_the_response_and_the_reason():
    with pytest.raises(RewardError) as info:
        run(["a", "bb", "boom", "boom again"], on_error="fail")
    msg = str(info.value)
    assert "Reward 'flaky' failed on response 2 of the batch (data_source 'src0')" in msg
    assert "exception: ValueError: cannot score 'boom'" in msg
    assert "response: 'boom'" in msg
    assert "reward.on_error=zero" in info.value.hint


# -- time-outs -----------------------------------------------------------------------------------
def test_a_hanging_call_times_out_and_the_others_finish():
    responses = ["a", "hang", "ccc", "dd"]
    start = time.perf_counter()
    out, _ = run(responses, on_error="zero", timeout_s=0.5, chunk_size=1, num_workers=4)
    assert time.perf_counter() - start < 3.0
    assert [(f.index, f.kind) for f in out.failures] == [(1, "timeout")]
    assert "reward.timeout_s=0.5" in out.failures[0].message
    assert_no_score_lost(out, responses, 0.0)


def test_a_timed_out_call_fails_all_its_responses_without_retrying():
    responses = ["a", "hang", "ccc", "dd"]
    start = time.perf_counter()
    out, fn = run(responses, on_error="zero", timeout_s=0.4, chunk_size=2)
    assert time.perf_counter() - start < 3.0
    assert [(f.index, f.kind) for f in out.failures] == [(0, "timeout"), (1, "timeout")]
    assert fn.calls == 2
    assert_no_score_lost(out, responses, 0.0)


def test_timeout_fail_policy_stops_with_a_message():
    with pytest.raises(RewardError, match=r"response 0 .*timeout: no result within reward.timeout_s=0.3 s"):
        run(["hang"], on_error="fail", timeout_s=0.3)


def test_the_process_executor_kills_a_call_that_burns_cpu():
    responses = ["a", "spin", "ccc"]
    start = time.perf_counter()
    out, _ = run(responses, on_error="zero", timeout_s=1.0, chunk_size=1, num_workers=3, executor="process")
    assert time.perf_counter() - start < 8.0
    assert [(f.index, f.kind) for f in out.failures] == [(1, "timeout")]
    assert_no_score_lost(out, responses, 0.0)
    assert multiprocessing.active_children() == []  # killed, not left spinning


def test_the_process_executor_reports_exceptions_and_crashes():
    def crashes(batch: RewardBatch) -> list[float]:
        if "exit" in batch.responses[0]:
            os._exit(7)
        return Flaky()(batch).scores

    out = RewardRunner(crashes, "crashy", RewardPolicy(on_error="zero", executor="process", chunk_size=1,
                                                        num_workers=2)).run(rb(["a", "exit", "boom", "dd"]))
    kinds = {f.index: (f.kind, f.message) for f in out.failures}
    assert kinds[1][0] == "exception" and "worker process died (exit code 7)" in kinds[1][1]
    assert kinds[2][0] == "exception" and "ValueError" in kinds[2][1]
    assert out.scores == [1.0, 0.0, 0.0, 2.0]


# -- NaN and friends -----------------------------------------------------------------------------
def test_non_finite_or_non_numeric_scores_are_invalid_per_response():
    responses = ["a", "nan", "inf", "str", "none", "ffffff"]
    out, fn = run(responses, on_error="zero", failure_score=-2.0)
    assert [(f.index, f.kind) for f in out.failures] == [(1, "invalid"), (2, "invalid"), (3, "invalid"),
                                                        (4, "invalid")]
    assert "returned the score nan" in out.failures[0].message
    assert fn.calls == 1  # one bad score does not spoil the others: no retry
    assert_no_score_lost(out, responses, -2.0)


def test_nan_fail_policy():
    with pytest.raises(RewardError, match=r"response 1 .*invalid: returned the score nan"):
        run(["a", "nan"], on_error="fail")


# -- the wrong number of scores ------------------------------------------------------------------
def test_wrong_count_is_narrowed_down_to_the_responses_that_cause_it():
    responses = ["a", "drop", "ccc", "drop too", "eeeee"]
    out, _ = run(responses, on_error="zero")
    assert [(f.index, f.kind) for f in out.failures] == [(1, "wrong_count"), (3, "wrong_count")]
    assert "returned 0 scores for 1 responses" in out.failures[0].message
    assert_no_score_lost(out, responses, 0.0)


def test_wrong_count_fail_policy():
    with pytest.raises(RewardError, match=r"response 1 .*wrong_count: returned 0 scores for 1 responses"):
        run(["a", "drop", "c"], on_error="fail")


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_a_malformed_output_is_a_plugin_error_in_both_modes(executor):
    """Extras of the wrong length, answers of the wrong length or type, a dict instead of scores: the
    whole call failed (``bad_output``, not retried) under ``zero``, and ``fail`` stops naming the plugin."""
    calls = []

    def short_extra(batch: RewardBatch) -> RewardOutput:
        calls.append(len(batch))
        return RewardOutput([1.0] * len(batch), {"x": [1.0]})  # alone, a response's extra would fit

    policy = {"executor": executor, "timeout_s": 20}
    out = RewardRunner(short_extra, "extra", RewardPolicy(on_error="zero", failure_score=-1, **policy)).run(
        rb(["a", "b", "c"]))
    assert out.scores == [-1.0, -1.0, -1.0]
    assert [(f.index, f.kind) for f in out.failures] == [(0, "bad_output"), (1, "bad_output"), (2, "bad_output")]
    assert "extra 'x' has 1 values for 3 responses" in out.failures[0].message
    if executor == "thread":
        assert calls == [3]  # not retried one response at a time
    with pytest.raises(RewardError, match=r"Reward 'extra' failed on response 0 .*bad_output: extra 'x' has 1 "
                                          r"values for 3 responses \(2 more responses failed too\)"):
        RewardRunner(short_extra, "extra", RewardPolicy(on_error="fail", **policy)).run(rb(["a", "b", "c"]))

    malformed = {
        "returned a dict, not a list of scores": lambda b: {"scores": [1.0] * len(b)},
        "extra 'x' is a float, not a list": lambda b: RewardOutput([1.0] * len(b), {"x": 1.0}),
        "answers is 1 answers for 2 responses": lambda b: with_answers(RewardOutput([1.0] * len(b)), ["7"]),
        "an answer is a int (7)": lambda b: with_answers(RewardOutput([1.0] * len(b)), [7] * len(b)),
    }
    for message, fn in malformed.items():
        out = RewardRunner(fn, "bad", RewardPolicy(on_error="zero", **policy)).run(rb(["a", "b"]))
        assert [f.kind for f in out.failures] == ["bad_output", "bad_output"], message
        assert message in out.failures[0].message
        with pytest.raises(RewardError, match=r"bad_output: " + re.escape(message)):
            RewardRunner(fn, "bad", RewardPolicy(on_error="fail", **policy)).run(rb(["a", "b"]))


def test_a_batch_level_failure_that_no_single_response_reproduces_fails_the_call_in_both_modes():
    def needs_pairs(batch: RewardBatch) -> list[float]:
        if len(batch) > 2:
            raise RuntimeError("too many")
        return [1.0] * len(batch)

    with pytest.raises(RewardError, match=r"each of them alone scored fine"):
        RewardRunner(needs_pairs, "pairs", RewardPolicy(on_error="fail")).run(rb(["a", "b", "c"]))
    out = RewardRunner(needs_pairs, "pairs", RewardPolicy(on_error="zero", failure_score=-1)).run(rb(["a", "b", "c"]))
    assert out.scores == [-1.0, -1.0, -1.0]
    assert [(f.index, f.kind) for f in out.failures] == [(0, "exception"), (1, "exception"), (2, "exception")]
    assert "RuntimeError: too many" in out.failures[0].message and "alone scored fine" in out.failures[0].message


def with_answers(out: RewardOutput, answers: list) -> RewardOutput:
    out.answers = answers  # type: ignore[attr-defined]
    return out


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_answers_pass_through_and_failed_responses_have_none(executor):
    def answering(batch: RewardBatch) -> RewardOutput:
        if "boom" in batch.responses:
            raise ValueError("boom")
        return with_answers(RewardOutput([1.0] * len(batch)), [r.upper() if r != "none" else None
                                                               for r in batch.responses])

    policy = RewardPolicy(on_error="zero", executor=executor, timeout_s=20)
    out = RewardRunner(answering, "ans", policy).run(rb(["a", "none", "boom", "é"]))
    assert out.answers == ["A", None, None, "É"]
    assert [(f.index, f.kind) for f in out.failures] == [(2, "exception")]
    plain = RewardRunner(lambda b: [1.0] * len(b), "plain", policy).run(rb(["a", "b"]))
    assert plain.answers == [None, None]


# -- the process executor sends JSON, never a pickle ------------------------------------------------
MARKER = Path(os.environ.get("TMPDIR", "/tmp")) / f"rlx-unpickled-{os.getpid()}"


def _plant(path: str) -> None:
    Path(path).write_text(str(os.getpid()))


class Planted:
    """An object that runs code wherever it is unpickled."""

    def __reduce__(self):
        return (_plant, (str(MARKER),))

    def __repr__(self) -> str:
        return "<Planted>"


def test_process_executor_never_unpickles_what_the_child_sends():
    MARKER.unlink(missing_ok=True)

    def planted(batch: RewardBatch) -> RewardOutput:
        return RewardOutput([Planted(), 1.0], {"x": [Planted(), 2.0]})  # type: ignore[list-item]

    out = RewardRunner(planted, "planted", RewardPolicy(on_error="zero", executor="process", timeout_s=20)).run(
        rb(["a", "b"]))
    assert not MARKER.exists(), "a value sent by the worker process was unpickled in the trainer"
    assert [(f.index, f.kind) for f in out.failures] == [(0, "invalid")]
    assert "returned the score <Planted>" in out.failures[0].message
    assert out.scores == [0.0, 1.0] and out.extra == {"x": [0.0, 2.0]}

    def planted_answer(batch: RewardBatch) -> RewardOutput:
        return with_answers(RewardOutput([1.0] * len(batch)), [Planted()] * len(batch))

    out = RewardRunner(planted_answer, "planted", RewardPolicy(on_error="zero", executor="process",
                                                               timeout_s=20)).run(rb(["a"]))
    assert not MARKER.exists()
    assert [f.kind for f in out.failures] == ["bad_output"]


def test_garbage_from_the_worker_process_is_a_failed_call():
    import pickle

    from rlx.run.rewards import decode_outcome

    good = b'{"ok": true, "scores": [1.0, null], "invalid": [[1, "returned the score nan"]], "extra": {"x": [1, 2]}, ' \
           b'"answers": ["7", null]}'
    ok = decode_outcome(good, 2)
    assert ok.ok and ok.value.scores == [1.0, None] and ok.value.extra == {"x": [1.0, 2.0]}
    assert ok.value.invalid == {1: "returned the score nan"} and ok.value.answers == ["7", None]
    garbage = [
        pickle.dumps(Planted()),  # a pickle is not JSON: refused, never loaded
        b"\xff\xfe not json",
        b"[1.0, 2.0]",
        b'{"ok": true, "scores": [1.0], "invalid": [], "extra": {}, "answers": null}',  # one score for two
        b'{"ok": true, "scores": [NaN, 1.0], "invalid": [], "extra": {}, "answers": null}',
        b'{"ok": true, "scores": [1.0, null], "invalid": [], "extra": {}, "answers": null}',  # a null unexplained
        b'{"ok": true, "scores": [1.0, 2.0], "invalid": [], "extra": {"x": [Infinity, 1]}, "answers": null}',
        b'{"ok": true, "scores": [1.0, 2.0], "invalid": [], "extra": {}, "answers": [1, 2]}',
        b'{"ok": true, "scores": [true, 2.0], "invalid": [], "extra": {}, "answers": null}',
        b'{"ok": false, "kind": "whatever", "message": "x"}',
        b"[" * 100000 + b"]" * 100000,
    ]
    for data in garbage:
        out = decode_outcome(data, 2)
        assert not out.ok and out.kind == "bad_output", data[:80]
        assert "not a reward result" in out.message
    assert not MARKER.exists()


def test_a_result_over_the_size_limit_is_a_failed_call(monkeypatch):
    import rlx.run.rewards as rr

    monkeypatch.setattr(rr, "RESULT_BYTES_BASE", 1000)
    monkeypatch.setattr(rr, "RESULT_BYTES_PER_RESPONSE", 100)

    def wordy(batch: RewardBatch) -> RewardOutput:
        return with_answers(RewardOutput([1.0] * len(batch)), ["x" * 10**6] * len(batch))

    start = time.perf_counter()
    out = RewardRunner(wordy, "wordy", RewardPolicy(on_error="zero", executor="process", timeout_s=20)).run(
        rb(["a", "b"]))
    assert time.perf_counter() - start < 10
    assert [f.kind for f in out.failures] == ["bad_output", "bad_output"]
    assert "more than 1200 bytes" in out.failures[0].message


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_a_timed_out_process_call_takes_the_programs_it_started_with_it(tmp_path):
    pid_file = tmp_path / "pid"

    def starts_a_program(batch: RewardBatch) -> list[float]:
        proc = subprocess.Popen(["sleep", "60"])
        pid_file.write_text(str(proc.pid))
        time.sleep(60)
        return [1.0] * len(batch)

    out = RewardRunner(starts_a_program, "prog", RewardPolicy(on_error="zero", executor="process",
                                                              timeout_s=1.5)).run(rb(["a"]))
    assert [f.kind for f in out.failures] == ["timeout"]
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), "the program the reward started outlived the killed call"


# -- parallelism and order -----------------------------------------------------------------------
def test_calls_run_in_parallel_and_scores_keep_their_order():
    def slow(batch: RewardBatch) -> list[float]:
        time.sleep(0.3)
        return [float(r) for r in batch.responses]

    responses = [str(i) for i in range(8)]
    start = time.perf_counter()
    out = RewardRunner(slow, "slow", RewardPolicy(num_workers=4, chunk_size=2)).run(rb(responses))
    parallel = time.perf_counter() - start
    assert out.scores == [float(i) for i in range(8)]
    assert parallel < 0.9, parallel  # 4 calls of 0.3 s one after another would take 1.2 s
    out = RewardRunner(slow, "slow", RewardPolicy(num_workers=4, executor="process")).run(rb(responses))
    assert out.scores == [float(i) for i in range(8)]


def test_no_timeout_and_one_worker_calls_in_this_thread():
    seen = []

    def where(batch: RewardBatch) -> list[float]:
        seen.append(threading.current_thread() is threading.main_thread())
        return [0.0] * len(batch)

    RewardRunner(where, "w", RewardPolicy(timeout_s=0)).run(rb(["a"]))
    RewardRunner(where, "w", RewardPolicy(timeout_s=5)).run(rb(["a"]))
    assert seen == [True, False]


def test_policy_comes_from_the_reward_config_section():
    cfg = RewardConfig(name="gsm8k", on_error="zero", timeout_s=2, num_workers=3, chunk_size=4,
                       executor="process", failure_score=-1)
    assert RewardPolicy.from_config(cfg) == RewardPolicy("zero", -1.0, 2.0, 3, 4, "process")
    assert RewardPolicy.from_config(None) == RewardPolicy()
    assert RewardPolicy() == RewardPolicy.from_config(RewardConfig())  # the same defaults
    with pytest.raises(ValueError):
        RewardPolicy(on_error="ignore")


# -- the reward worker ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def generated(tok, responses: list[str]) -> Batch:
    ids = [tok(r, add_special_tokens=False)["input_ids"] for r in responses]
    width = max(len(i) for i in ids)
    resp = torch.full((len(ids), width), tok.pad_token_id)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for row, seq in enumerate(ids):
        resp[row, :len(seq)] = torch.tensor(seq)
        mask[row, :len(seq)] = 1
    n = len(responses)
    return Batch({"responses": resp, "response_mask": mask},
                 {"prompt_text": ["q"] * n, "ground_truth": ["1"] * n, "data_source": ["s"] * n,
                  "extra_info": [{}] * n})


def test_reward_worker_keeps_its_contract_and_flags_failures(tok):
    responses = ["a", "boom", "ccc", "nan"]
    worker = RewardWorker(Flaky(), tok, "flaky", RewardConfig(name="flaky", on_error="zero", failure_score=-1))
    out = worker.score(generated(tok, responses))
    assert out["scores"].tolist() == [1.0, -1.0, 3.0, -1.0]
    assert out["response_text"] == responses
    assert out["reward_answer"] == [None] * 4  # Flaky reports no answers
    assert out["reward_extra/failed"].tolist() == [0.0, 1.0, 0.0, 1.0]
    assert out["reward_extra/failed/exception"].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert out["reward_extra/failed/invalid"].tolist() == [0.0, 0.0, 0.0, 1.0]
    assert out["reward_extra/flaky/len"].tolist() == [1.0, 0.0, 3.0, 3.0]
    errors = out["reward_error"]
    assert [(i, e.split(":")[0]) for i, e in enumerate(errors) if e] == [(1, "exception"), (3, "invalid")]
    assert {k for k in out.tensors if k.startswith("reward_extra/failed")} == {
        "reward_extra/failed", *(f"reward_extra/failed/{k}" for k in FAILURE_KINDS)}


def test_reward_worker_default_policy_fails(tok):
    worker = RewardWorker(Flaky(), tok, "flaky")
    with pytest.raises(RewardError, match="Reward 'flaky' failed on response 1"):
        worker.score(generated(tok, ["a", "boom"]))


# -- through `rlx train` -------------------------------------------------------------------------
BAD_REWARD = '''
def compute_score(response, ground_truth, extra_info):
    if extra_info["index"] % 3 == 0:
        raise ValueError(f"row {extra_info['index']} is not supported")
    return float(response.strip() == ground_truth)
'''


def train(tmp_path: Path, *overrides: str) -> tuple[subprocess.CompletedProcess, Path]:
    reward = tmp_path / "bad_reward.py"
    reward.write_text(BAD_REWARD)
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "rlx", "train", "--preset", "tiny", "reward.name=custom", f"reward.path={reward}",
            "trainer.total_steps=2", "trainer.test_freq=-1", "trainer.loggers=[jsonl]",
            "trainer.save_hf_model=false", "trainer.save_freq=0", f"trainer.output_dir={run_dir}", *overrides]
    return subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=tmp_path), run_dir


@pytest.mark.slow
def test_train_stops_with_a_message_naming_the_plugin_and_the_response(tmp_path):
    proc, run_dir = train(tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "Error: Reward 'custom' failed on response" in proc.stderr
    assert "ValueError: row" in proc.stderr and "is not supported" in proc.stderr
    assert "reward.on_error=zero" in proc.stderr
    assert not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text().strip()


@pytest.mark.slow
def test_train_continues_with_on_error_zero_and_counts_the_failures(tmp_path):
    proc, run_dir = train(tmp_path, "reward.on_error=zero", "reward.failure_score=0.0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 0.0 < r["reward/failed"] < 1.0  # about a third of the rows fail
        assert r["reward/failed/exception"] == r["reward/failed"]
        assert r["reward/failed/timeout"] == r["reward/failed/invalid"] == r["reward/failed/wrong_count"] == 0.0
    assert "responses failed (" in proc.stderr  # the warning names the count and the kind
