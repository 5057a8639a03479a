"""What the reward runner accepts from a reward function and how it labels what it refuses, checked
call by call (``_check_value`` / ``_call_checked``) and through the process executor's wire format.
(Gaps found by scripts/mutation.py in core/run/rewards.py.)"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rlx.protocols import RewardBatch, RewardOutput
from rlx.run import rewards as rr


def batch(n: int) -> RewardBatch:
    return RewardBatch([f"p{i}" for i in range(n)], [f"r{i}" for i in range(n)], ["1"] * n, ["src"] * n,
                       [{}] * n, [1] * n)


@pytest.mark.parametrize(("value", "kind", "message"), [
    (RewardOutput(scores="1.0"), "bad_output", "scores is a str, not a list"),
    ("1.0", "bad_output", "returned a str, not a list of scores or a RewardOutput"),
    ({"a": 1.0}, "bad_output", "returned a dict, not a list of scores or a RewardOutput"),
    ([1.0], "wrong_count", "returned 1 scores for 2 responses"),
    (RewardOutput([1.0, 2.0], extra=[("k", [1, 2])]), "bad_output", "extra is a list, not a dict of lists"),
    (RewardOutput([1.0, 2.0], extra={"k": "ab"}), "bad_output", "extra 'k' is a str, not a list"),
    (RewardOutput([1.0, 2.0], extra={"k": [1.0]}), "bad_output", "extra 'k' has 1 values for 2 responses"),
])
def test_malformed_outputs_are_labelled(value, kind, message):
    out = rr._check_value(value, 2)
    assert not out.ok and out.kind == kind and out.message == message


def test_answers_must_be_one_str_or_none_per_response():
    out = rr._check_value(SimpleNamespace(), 2)
    assert out.kind == "bad_output"
    ok = RewardOutput([1.0, 0.0])
    ok.answers = ["7", None]
    assert rr._check_value(ok, 2).value.answers == ["7", None]
    short = RewardOutput([1.0, 0.0])
    short.answers = ["7"]
    assert rr._check_value(short, 2).message == ("answers is 1 answers for 2 responses; give a list of one answer "
                                                 "(a str, or None) per response")
    odd = RewardOutput([1.0, 0.0])
    odd.answers = 7
    assert rr._check_value(odd, 2).message.startswith("answers is a int for 2 responses")
    typed = RewardOutput([1.0, 0.0])
    typed.answers = ["7", 8]
    assert rr._check_value(typed, 2).message == "an answer is a int (8); answers are str or None"


def test_scores_and_extras_of_any_numeric_kind():
    value = RewardOutput(torch.tensor([0.5, 2.0]), extra={"len": np.array([3, 4]), "bad": [float("nan"), "x"]})
    out = rr._check_value(value, 2)
    assert out.ok and out.value.scores == [0.5, 2.0] and out.value.invalid == {}
    assert out.value.extra == {"len": [3.0, 4.0], "bad": [0.0, 0.0]}  # non-finite extras are logged as 0
    mixed = rr._check_value([np.float32(0.25), torch.tensor(1.5), True, None, "1", float("inf")], 6)
    assert mixed.value.scores == [0.25, 1.5, 1.0, None, None, None]
    assert sorted(mixed.value.invalid) == [3, 4, 5] and mixed.value.invalid[4] == "returned the score '1'"


def test_an_exception_is_a_failed_call_and_interrupts_pass_through_the_main_thread():
    def boom(b):
        raise ValueError("no")

    out = rr._call_checked(boom, batch(2))
    assert (out.ok, out.kind) == (False, "exception") and "ValueError: no" in out.message

    def interrupt(b):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        rr._call_checked(interrupt, batch(1))
    seen = []
    worker = threading.Thread(target=lambda: seen.append(rr._call_checked(interrupt, batch(1))))
    worker.start()
    worker.join()
    assert seen[0].kind == "exception"  # a worker thread must not die silently


def test_wire_format_round_trip():
    good = rr._check_value(RewardOutput([1.0, None], extra={"k": [1.0, 2.0]}), 2)
    back = rr.decode_outcome(rr.encode_outcome(good), 2)
    assert back.ok and back.value.scores == [1.0, None] and back.value.extra == {"k": [1.0, 2.0]}
    assert back.value.invalid == {1: "returned the score None"}
    failed = rr.decode_outcome(rr.encode_outcome(rr._failed("timeout", "slow")), 2)
    assert (failed.ok, failed.kind, failed.message) == (False, "timeout", "slow")


def test_policy_from_config_keeps_defaults_for_missing_fields():
    policy = rr.RewardPolicy.from_config(SimpleNamespace(on_error="zero", num_workers=3))
    assert policy == rr.RewardPolicy(on_error="zero", num_workers=3)
    assert rr.RewardPolicy.from_config(None) == rr.RewardPolicy()
