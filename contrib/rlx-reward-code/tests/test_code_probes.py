"""Which assert tests are judged on returned values, and how strictly the scorer reads the harness's records."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

try:
    probes = importlib.import_module("rlx_reward_code.probes")
except ImportError:  # not installed: use the source folder
    sys.path.insert(0, str(ROOT))
    probes = importlib.import_module("rlx_reward_code.probes")


@pytest.mark.parametrize("snippet, expr, good, bad", [
    ("assert add(1, 2) == 3", "add(1, 2)", 3, 4),
    ("assert 3 == add(1, 2)", "add(1, 2)", 3.0, "3"),
    ("assert f(x) != [1]", "f(x)", [2], [1]),
    ("assert sorted(f([3, 1])) == (1, 3)", "sorted(f([3, 1]))", (1, 3), [1, 3]),
    ("assert f() in {1, 2}", "f()", 2, 5),
    ("assert 2 in f()", "f()", [1, 2], [1]),
    ("assert f() is None", "f()", None, 0),
    ("assert f() is True", "f()", True, 1),
    ("assert f() < -1.5", "f()", -2, -1),
    ("assert math.isclose(area(2), 12.566, rel_tol=0.001)", "area(2)", 12.5664, 12.6),
    ("assert abs(area(2) - 12.566) < 1e-3", "area(2)", 12.5665, 12.57),
    ("assert abs(1.0 - g()) <= 0.5", "g()", 0.5, 0.4),
    ("assert is_prime(7)", "is_prime(7)", True, 0),
    ("assert not is_prime(4)", "is_prime(4)", False, [0]),
])
def test_assert_forms_become_probes_judged_here(snippet, expr, good, bad):
    plan = probes.plan(snippet)
    assert not plan.opaque
    assert plan.steps == [{"eval": expr}]
    (probe,) = plan.probes
    assert probe.judge(good) is True
    assert probe.judge(bad) is False


@pytest.mark.parametrize("snippet", [
    "for x in range(3):\n    assert f(x) == x",                  # asserts inside a loop
    "assert f(1) == g(1)",                                      # both sides computed in the sandbox
    "def helper(v):\n    return v == 3\nassert helper(f())",     # a checker defined by the test
    "assert isinstance(f(), int)",                              # a builtin the program can replace
    "assert f() is 3",                                          # identity with a non-singleton
    "if f() != 3:\n    raise AssertionError",                   # a check without assert
    "def check(c):\n    for i in range(3):\n        assert c(i) == i\ncheck(f)",  # a checker that loops
    "assert (",                                                 # not Python
])
def test_other_tests_are_opaque_and_run_whole(snippet):
    plan = probes.plan(snippet)
    assert plan.opaque and plan.to_spec() == {"source": snippet}


def test_setup_statements_run_in_order_and_expected_values_stay_out():
    plan = probes.plan("import math\nxs = [3, 1, 2]\nassert my_sort(xs) == [1, 2, 3]\nassert my_max(xs) == 3")
    assert plan.to_spec() == {"steps": [{"exec": "import math"}, {"exec": "xs = [3, 1, 2]"},
                                        {"eval": "my_sort(xs)"}, {"eval": "my_max(xs)"}]}
    assert "[1, 2, 3]" not in json.dumps(plan.to_spec())


def test_humaneval_checkers_are_inlined():
    test = ("METADATA = {'author': 'x'}\n\ndef check(candidate):\n    '''doc'''\n    import math\n"
            "    assert candidate(1, 2) == 3\n    assert True, 'message'\n"
            "    assert abs(candidate(0.5, 0.25) - 0.75) < 1e-6\n"
            "\ncheck(add)")
    plan = probes.plan(test)
    assert not plan.opaque and plan.static_ok
    assert [s for s in plan.steps if "eval" in s] == [{"eval": "candidate(1, 2)"}, {"eval": "candidate(0.5, 0.25)"}]
    assert {"exec": "candidate = add"} in plan.steps


def test_an_assert_between_literals_is_decided_here():
    assert probes.plan("assert 1 == 2").static_ok is False
    assert probes.plan("assert True").static_ok is True


def test_decode_accepts_only_plain_data():
    enc = {"tuple": [1, {"set": ["a"]}, {"dict": [[{"tuple": [1, 2]}, {"bytes": "ff"}]]}, {"float": "nan"},
                     {"complex": ["1.0", "-2.0"]}, {"frozenset": []}, [None, True, 1.5]]}
    out = probes.decode(enc)
    assert out[:3] == (1, {"a"}, {(1, 2): b"\xff"}) and out[3] != out[3]
    assert out[4:] == (complex(1, -2), frozenset(), [None, True, 1.5])
    for bad in ({"object": 1}, {"tuple": [1], "x": 2}, {"set": [[1]]}, {"float": "1e999"}, {"bytes": "zz"},
                {"dict": [[1]]}):
        with pytest.raises(probes.BadRecord):
            probes.decode(bad)


def records(*recs: dict) -> str:
    return "".join(json.dumps(r) + "\n" for r in recs)


def test_judge_needs_the_final_record_and_nothing_extra():
    plans = [probes.plan("assert f() == 1"), probes.plan("assert g() == 2")]
    good = [{"test": 0, "probe": 0, "value": 1}, {"test": 1, "probe": 0, "value": 2}]
    assert probes.judge(plans, records(*good, {"done": 2})) == ([True, True], "")
    assert probes.judge(plans, records(*good)) == ([False, False], "")                       # no final record
    assert probes.judge(plans, records(*good, {"done": 2}, {"test": 0, "probe": 0, "value": 1}))[0] == [False] * 2
    assert probes.judge(plans, records(good[0], *good, {"done": 2}))[0] == [False] * 2     # a duplicate
    assert probes.judge(plans, records(*good, {"test": 0, "ok": True}, {"done": 2}))[0] == [False] * 2
    assert probes.judge(plans, "noise\n" + records(*good, {"done": 2}))[0] == [False] * 2
    assert probes.judge(plans, records(good[0], {"test": 1, "probe": 0, "error": "ZeroDivisionError"},
                                       {"done": 2})) == ([True, False], "")
    assert probes.judge(plans, records(good[0], {"test": 1, "probe": 0, "value": {"tuple": [2]}},
                                       {"done": 2})) == ([True, False], "")
    assert probes.judge(plans, records({"load_error": "SyntaxError: x"}, {"done": 2})) == ([False] * 2,
                                                                                            "SyntaxError: x")


def test_judge_reads_opaque_verdicts_only_for_opaque_tests():
    plans = [probes.plan("for i in range(2):\n    assert f(i) == i"), probes.plan("assert f(0) == 0")]
    ok = records({"test": 0, "ok": True}, {"test": 1, "probe": 0, "value": 0}, {"done": 2})
    assert probes.judge(plans, ok)[0] == [True, True]
    forged = records({"test": 0, "ok": True}, {"test": 1, "ok": True}, {"done": 2})
    assert probes.judge(plans, forged)[0] == [False, False]
