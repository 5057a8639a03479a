"""Rule rewards (math, format, overlong), the custom Python-file reward, routing by data source and
weighted mixtures, with their options checked through the real config validation."""

from __future__ import annotations

import doctest
import importlib.util
import threading

import pytest

from rlx.config import build_raw
from rlx.context import BuildContext
from rlx.errors import ConfigError, UserError
from rlx.plugins.rewards import arith, custom, mix, overlong, router
from rlx.plugins.rewards import format as format_reward
from rlx.plugins.rewards import math as math_reward
from rlx.protocols import RewardBatch, RewardOutput, RunInfo
from rlx.registry import get_plugin_manager
from rlx.validate import resolve

HAS_MATH_VERIFY = importlib.util.find_spec("math_verify") is not None


def rb(responses: list[str], truths: list | None = None, sources: list[str] | None = None,
       lengths: list[int] | None = None, extra: list[dict] | None = None) -> RewardBatch:
    n = len(responses)
    return RewardBatch([f"q{i}" for i in range(n)], responses, truths if truths is not None else [""] * n,
                       sources if sources is not None else ["src"] * n, extra if extra is not None else [{}] * n,
                       lengths if lengths is not None else [len(r) for r in responses])


def resolved(*overrides: str):
    """The real validation path of `rlx train` (plugins from entry points), data files not checked."""
    return resolve(build_raw(preset="tiny", overrides=list(overrides)), get_plugin_manager(), check_files=False)


def build(*overrides: str):
    res = resolved(*overrides)
    ctx = BuildContext(res.config, RunInfo("", "p", "e", {}), get_plugin_manager(), None)
    return get_plugin_manager().get("reward", res.config.reward.name).load_factory()(res.options["reward"], ctx)


def config_problems(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        resolved(*overrides)
    return info.value.problems


@pytest.mark.parametrize("module", [math_reward, format_reward, overlong, arith])
def test_docstring_examples(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


# -- math ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "expected"), [
    ("so \\boxed{42}.", "42"),
    ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{x^{2} + \\{1\\}}", "x^{2} + \\{1\\}"),
    ("\\fbox{7}", "7"),
    ("\\boxed 5", "5"),
    ("\\boxed{unclosed", None),
    ("no box", None),
])
def test_last_boxed(text, expected):
    assert math_reward.last_boxed(text) == expected


EQUIVALENT = [("\\dfrac{1}{2}", "\\frac12"), ("0.5", "\\frac{1}{2}"), ("x = 5", "5"), ("5\\text{ cm}", "5"),
              ("1,000", "1000"), ("2.50", "5/2"), ("90^\\circ", "90"), ("\\left(1, 2\\right)", "(1,2)"),
              ("\\sqrt2", "\\sqrt{2}"), ("\\text{(A)}", "(A)"), (".5", "0.5"), ("-\\frac{3}{4}", "-0.75")]
DIFFERENT = [("3", "4"), ("\\frac{1}{3}", "0.33"), ("(1,2)", "(2,1)"), ("", "0")]


@pytest.mark.parametrize(("a", "b"), EQUIVALENT)
def test_builtin_equivalence(a, b):
    assert math_reward.builtin_equivalent(a, b)


@pytest.mark.parametrize(("a", "b"), DIFFERENT)
def test_builtin_difference(a, b):
    assert not math_reward.builtin_equivalent(a, b)


@pytest.mark.skipif(not HAS_MATH_VERIFY, reason="needs math-verify (pip install 'rlx[math]')")
def test_math_verify_backend_in_the_main_thread_and_in_a_worker_thread():
    fn = math_reward.build(math_reward.MathOptions(backend="math_verify"), None)
    batch = rb(["\\boxed{\\frac{2}{4}}", "\\boxed{\\{2, 1\\}}", "\\boxed{3}", "no box"],
               ["0.5", "\\{1,2\\}", "4", "1"])
    expected = [1.0, 1.0, 0.0, 0.0]
    assert fn(batch).scores == expected
    seen = []
    t = threading.Thread(target=lambda: seen.append(fn(batch).scores))  # math-verify's signals are main-only
    t.start()
    t.join(60)
    assert seen == [expected]


def test_math_reward_scores_formats_and_ground_truth_solutions():
    fn = math_reward.build(math_reward.MathOptions(backend="builtin", format_score=0.1), None)
    out = fn(rb(["The answer is \\boxed{\\dfrac{1}{2}}.", "\\boxed{3}", "1/2"],
                ["Half of it: $\\boxed{\\frac12}$", "4", "\\frac12"]))
    assert isinstance(out, RewardOutput)
    assert out.scores == [1.0, 0.1, 0.0]
    assert out.extra == {"math/correct": [1.0, 0.0, 0.0], "math/boxed": [1.0, 1.0, 0.0]}


def test_math_auto_backend_and_missing_math_verify(monkeypatch):
    assert build("reward.name=math") is not None
    if math_reward.math_verify_available():
        # Set equality: math-verify scores it right, the built-in check does not, so this shows
        # that "auto" picked math-verify.
        auto = math_reward.build(math_reward.MathOptions(), None)
        builtin = math_reward.build(math_reward.MathOptions(backend="builtin"), None)
        case = rb(["\\boxed{\\{2, 1\\}}"], ["\\{1,2\\}"])
        assert auto(case).scores == [1.0] and builtin(case).scores == [0.0]
    monkeypatch.setattr(math_reward, "math_verify_available", lambda: False)
    fn = math_reward.build(math_reward.MathOptions(), None)  # auto falls back to the built-in check
    assert fn(rb(["\\boxed{0.5}"], ["\\frac{1}{2}"])).scores == [1.0]


# -- format and overlong ---------------------------------------------------------------------------
@pytest.mark.parametrize(("style", "good", "bad"), [
    ("gsm8k", "so #### 42", "42"),
    ("boxed", "\\boxed{42}", "\\boxed{}"),
    ("think", "<think>hm</think> 42", "<think>a</think><think>b</think>"),
])
def test_format_styles(style, good, bad):
    fn = format_reward.build(format_reward.FormatOptions(style=style, miss_score=-0.5), None)
    out = fn(rb([good, bad]))
    assert out.scores == [1.0, -0.5]
    assert out.extra == {"format/ok": [1.0, 0.0]}


def test_format_regex_search_and_full_match():
    search = build("reward.name=format", "reward.style=regex", "reward.pattern=Answer: [0-9]+")
    full = build("reward.name=format", "reward.style=regex", "reward.pattern=Answer: [0-9]+", "reward.match=full")
    batch = rb(["Answer: 12", "Well. Answer: 12", "Answer: x"])
    assert search(batch).scores == [1.0, 1.0, 0.0]
    assert full(batch).scores == [1.0, 0.0, 0.0]


def test_format_options_are_checked():
    problems = config_problems("reward.name=format", "reward.style=regex", "reward.pattern=([")
    assert any(p.startswith("reward: pattern '([' is not a valid regular expression") for p in problems), problems
    assert any("style=regex needs a pattern" in p for p in config_problems("reward.name=format",
                                                                           "reward.style=regex"))


def test_overlong_defaults_to_the_run_response_length():
    fn = build("reward.name=overlong", "reward.buffer_tokens=2", "data.max_response_length=4")
    out = fn(rb([""] * 5, lengths=[1, 2, 3, 4, 5]))
    assert out.scores == [0.0, 0.0, -0.5, -1.0, -1.0]
    assert out.extra == {"overlong/truncated": [0.0, 0.0, 0.0, 1.0, 1.0]}
    with pytest.raises(UserError, match="needs max_tokens"):
        overlong.build(overlong.OverlongOptions(), None)


# -- custom: a function from a Python file ---------------------------------------------------------
VERL_STYLE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if solution_str.strip() == ground_truth else 0.0
'''
RICH = '''
def grade(response, ground_truth, response_length, bonus):
    ok = response == ground_truth
    return {"score": float(ok) + bonus, "exact": float(ok), "length": response_length, "note": "not a number"}
'''
BATCHED = '''
from rlx.protocols import RewardOutput

def score_all(batch, scale=1.0):
    return RewardOutput([scale * len(r) for r in batch.responses], {"custom/len": [len(r) for r in batch.responses]})
'''


def test_custom_verl_signature(tmp_path):
    f = tmp_path / "verl_reward.py"
    f.write_text(VERL_STYLE)
    fn = build("reward.name=custom", f"reward.path={f}")
    assert fn(rb(["7", " 7 ", "8"], ["7"] * 3)).scores == [1.0, 1.0, 0.0]


def test_custom_dict_results_kwargs_and_batched(tmp_path):
    f = tmp_path / "rich.py"
    f.write_text(RICH)
    fn = build("reward.name=custom", f"reward.path={f}", "reward.function=grade", "reward.kwargs={bonus: 0.5}")
    out = fn(rb(["7", "8"], ["7", "7"], lengths=[1, 9]))
    assert out.scores == [1.5, 0.5]
    assert out.extra == {"custom/exact": [1.0, 0.0], "custom/length": [1.0, 9.0]}
    g = tmp_path / "batched.py"
    g.write_text(BATCHED)
    fn = build("reward.name=custom", f"reward.path={g}", "reward.function=score_all", "reward.batched=true",
               "reward.kwargs={scale: 2}")
    assert fn(rb(["ab", "c"])).scores == [4, 2]


def test_custom_errors_are_clear(tmp_path):
    assert any(p.startswith("reward.path: no such file: 'nope.py'") for p in config_problems(
        "reward.name=custom", "reward.path=nope.py"))
    f = tmp_path / "r.py"
    f.write_text("def other(response):\n    return 1.0\n")
    with pytest.raises(UserError, match=r"has no function 'compute_score'. Functions in the file: other"):
        build("reward.name=custom", f"reward.path={f}")
    f.write_text("def compute_score(response, secret):\n    return 1.0\n")
    with pytest.raises(UserError, match="takes arguments rlx cannot fill: secret"):
        build("reward.name=custom", f"reward.path={f}")
    f.write_text("def compute_score(response):\n    return 1.0 +\n")
    with pytest.raises(UserError, match=r"importing .*r.py failed, line 2: SyntaxError"):
        build("reward.name=custom", f"reward.path={f}")
    f.write_text("def compute_score(response):\n    return {'exact': 1.0}\n")
    with pytest.raises(ValueError, match="without a 'score' key"):
        build("reward.name=custom", f"reward.path={f}")(rb(["a"]))


# -- router ----------------------------------------------------------------------------------------
def test_router_default_table_sends_each_source_to_its_reward():
    fn = build("reward.name=router")
    out = fn(rb(["#### 72", "\\boxed{\\frac12}", "7", "#### 5"], ["72", "0.5", "7", "6"],
                ["openai/gsm8k", "DigitalLearningGmbH/MATH-lighteval", "rlx/arith", "openai/gsm8k"]))
    assert out.scores == [1.0, 1.0, 1.0, 0.0]
    assert out.extra["router/gsm8k"] == [1.0, 0.0, 0.0, 1.0]
    assert out.extra["router/math"] == [0.0, 1.0, 0.0, 0.0]
    assert out.extra["gsm8k/correct"] == [1.0, 0.0, 0.0, 0.0]
    assert out.extra["math/correct"] == [0.0, 1.0, 0.0, 0.0]


def test_router_overrides_patterns_and_fallback():
    fn = build("reward.name=router", "reward.routes={openai/gsm8k: {name: format, options: {style: gsm8k}}, "
               "'my_org/*': math}", "reward.fallback=arith")
    out = fn(rb(["#### 1", "\\boxed{2}", "3"], ["9", "2", "3"], ["openai/gsm8k", "my_org/algebra", "elsewhere"]))
    assert out.scores == [1.0, 1.0, 1.0]  # format only checks the shape; math; arith by fallback
    assert out.extra["router/format"] == [1.0, 0.0, 0.0]


def test_router_unknown_source_without_fallback_is_an_error_naming_it():
    fn = build("reward.name=router", "reward.use_defaults=false", "reward.routes={a: arith}")
    with pytest.raises(LookupError, match=r"no reward for data_source 'b'; routes: a. Add reward.routes"):
        fn(rb(["1"], ["1"], ["b"]))


def test_router_options_are_validated_with_dotted_paths():
    problems = config_problems("reward.name=router", "reward.routes={x: {name: math, options: {backnd: 1}}, y: nope}",
                               "reward.fallback={name: mix}")
    assert any(p.startswith("reward.routes.x.options.backnd: unknown option of reward 'math'. Did you mean "
                            "'backend'?") for p in problems), problems
    assert any(p.startswith("reward.routes.y: No reward named 'nope'") for p in problems), problems
    assert any(p.startswith("reward.fallback.options.components: Field required") for p in problems), problems


# -- mix -------------------------------------------------------------------------------------------
def test_mix_weights_and_logs_every_component():
    fn = build("reward.name=mix", "reward.components=[{name: arith, weight: 0.7, options: {distance_penalty: 0.1}}, "
               "{name: format, weight: 0.3, options: {style: regex, pattern: '^[0-9]$'}}]")
    out = fn(rb(["7", "5", "x"], ["7", "7", "7"]))
    assert out.scores == pytest.approx([1.0, 0.7 * 0.8 + 0.3, 0.0])
    assert out.extra["arith/score"] == pytest.approx([1.0, 0.8, 0.0])
    assert out.extra["format/score"] == [1.0, 1.0, 0.0]
    assert out.extra["arith/correct"] == [1.0, 0.0, 0.0]  # a component's own extras pass through
    assert out.extra["format/ok"] == [1.0, 1.0, 0.0]


def test_mix_labels_and_normalize():
    fn = build("reward.name=mix", "reward.normalize=true",
               "reward.components=[{name: arith, weight: 3, options: {distance_penalty: 0.1}}, "
               "{name: arith, weight: 1, label: strict, options: {distance_penalty: 0}}]")
    out = fn(rb(["5"], ["7"]))
    assert out.scores == pytest.approx([(3 * 0.8 + 1 * 0.0) / 4])
    assert set(out.extra) == {"arith/score", "arith/correct", "strict/score", "strict/arith/correct"}


def test_mix_component_failure_names_the_component():
    fn = build("reward.name=mix", "reward.components=[{name: arith}, {name: overlong, options: {max_tokens: 4}}]")
    batch = rb(["7"], ["7"])
    batch.response_lengths = []
    with pytest.raises(mix.ComponentFailed, match=r"mix component 'overlong' \(reward 'overlong'\) failed: "
                                                  r"ValueError: the overlong reward needs"):
        fn(batch)


def test_mix_options_are_validated_with_dotted_paths():
    problems = config_problems(
        "reward.name=mix", "reward.components=[{name: arith, options: {distance_penalty: -1, bogus: 2}}, "
        "{name: reward_model, options: {path: /no/such/rm}}, {name: gsm8kk}, {name: arith, wieght: 2}]")
    expected = [
        "reward.components[0].options.distance_penalty: Input should be greater than or equal to 0",
        "reward.components[0].options.bogus: unknown option of reward 'arith'. Valid options: distance_penalty",
        "reward.components[1].options.path: no such folder: '/no/such/rm'",
        "reward.components[2].name: No reward named 'gsm8kk'. Did you mean 'gsm8k'?",
        "reward.components[3].wieght: unknown key",
    ]
    for start in expected:
        assert any(p.startswith(start) for p in problems), (start, problems)
    assert any("two components are labelled 'arith'" in p for p in config_problems(
        "reward.name=mix", "reward.components=[{name: arith}, {name: arith}]"))
    assert any(p.startswith("reward.components[0].options.components: Field required") for p in config_problems(
        "reward.name=mix", "reward.components=[{name: mix}]"))
    assert any(p.startswith("reward.components: List should have at least 1 item") for p in config_problems(
        "reward.name=mix", "reward.components=[]"))


def test_mix_shows_component_defaults_in_the_resolved_config():
    cfg = resolved("reward.name=mix", "reward.components=[{name: arith, weight: 0.5}]").as_dict()
    assert cfg["reward"]["components"] == [{"name": "arith", "weight": 0.5, "label": None,
                                            "options": {"distance_penalty": 0.0}}]


def test_composites_can_nest():
    fn = build("reward.name=mix", "reward.components=[{name: router, weight: 0.5}, "
               "{name: mix, weight: 0.5, label: inner, options: {components: [{name: arith}]}}]")
    out = fn(rb(["7"], ["7"], ["rlx/arith"]))
    assert out.scores == [1.0]
    assert out.extra["router/score"] == [1.0] and out.extra["inner/score"] == [1.0]


def test_modules_register_their_components():
    pm = get_plugin_manager()
    for name, module in [("math", math_reward), ("format", format_reward), ("overlong", overlong),
                         ("custom", custom), ("router", router), ("mix", mix)]:
        comp = pm.get("reward", name)
        assert comp.distribution == "rlx" and comp.plugin == f"reward_{name}"
        assert all(f.description for f in comp.load_config_model().model_fields.values()), name
        assert module.rlx_rewards()[0].name == name


def test_no_installed_reward_has_an_option_named_like_a_core_reward_key():
    """`reward.timeout_s` & co. belong to the reward runner; a plugin option of the same name could never be set."""
    from rlx.config import RewardConfig

    core = set(RewardConfig.model_fields)
    pm = get_plugin_manager()
    for name in pm.names("reward"):
        model = pm.get("reward", name).load_config_model()
        if model is not None:
            assert not core & set(model.model_fields), (name, core & set(model.model_fields))
