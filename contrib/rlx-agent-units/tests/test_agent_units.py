"""Tests of the rlx-agent-units plugin, installed or straight from its source folder.

The loop runs through rlx's own episode runner (``rlx.agent.EpisodeRunner``) with a scripted engine: what the
model says each turn is a function of the conversation so far. The tokenizer is a real byte-level BPE with a
Qwen2.5-shaped chat template; the tool is the real ``units`` component."""

from __future__ import annotations

import doctest
import importlib
import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from rlx.agent import AgentLimits, EpisodeRunner, episode_metrics, render_after_turn
from rlx.batch import Batch
from rlx.plugins.testing import ScriptedEngine, agent_tokenizer, prompt_batch
from rlx.protocols import AgentLoop, SamplingParams, Tool, ToolError
from rlx.registry import PluginManager

ROOT = Path(__file__).resolve().parents[1]

try:
    plugin = importlib.import_module("rlx_agent_units")
except ImportError:  # not installed: use the source folder
    sys.path.insert(0, str(ROOT))
    plugin = importlib.import_module("rlx_agent_units")

from rlx_agent_units import loop as loop_mod  # noqa: E402
from rlx_agent_units import units as units_mod  # noqa: E402

try:
    INSTALLED = importlib.metadata.distribution("rlx-agent-units") is not None
except importlib.metadata.PackageNotFoundError:
    INSTALLED = False

CHECK = loop_mod.CHECK_PROMPT


# -- the units tool ---------------------------------------------------------------------------------------------
def convert(value: Any, src: str, dst: str, **options: Any) -> str:
    return units_mod.build_units(units_mod.UnitsOptions(**options), None)({"value": value, "from": src, "to": dst})


def test_docstring_examples():
    result = doctest.testmod(units_mod)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize(("value", "src", "dst", "expected"), [
    (3, "km", "mi", "1.86411"),         # 3000 / 1609.344 = 1.864113...
    (1, "mi", "ft", "5280"),            # 1609.344 / 0.3048
    (12, "in", "cm", "30.48"),          # 12 * 2.54
    (1, "nmi", "m", "1852"),
    (2.5, "kg", "lb", "5.51156"),       # 2.5 / 0.45359237 = 5.511556...
    (1, "lb", "g", "453.592"),          # 453.59237
    (16, "oz", "lb", "1"),              # 16 * 28.349523125 g = 453.59237 g
    (1, "st", "lb", "14"),
    (100, "C", "F", "212"),             # 100 * 9/5 + 32
    (0, "degF", "degC", "-17.7778"),    # (0 - 32) * 5/9
    (-40, "fahrenheit", "celsius", "-40"),
    (300, "K", "degC", "26.85"),
    (-273.15, "C", "K", "0"),           # absolute zero, not a rounding error below it
    (491.67, "degR", "degC", "0"),      # 491.67 * 5/9 - 273.15
    (90, "min", "h", "1.5"),
    (1, "wk", "h", "168"),
    (1500, "ms", "s", "1.5"),
    (2, "days", "minutes", "2880"),
    ("2", "Kilometers", "m", "2000"),   # a numeric string, unit names in any case
])
def test_conversions_against_hand_computed_values(value, src, dst, expected):
    assert convert(value, src, dst) == expected


def test_precision_is_significant_digits():
    assert convert(3, "km", "mi", precision=3) == "1.86"
    assert convert(3, "km", "mi", precision=12) == "1.86411357671"  # 1.864113576712...
    assert convert(1, "mm", "km", precision=2) == "1e-06"


@pytest.mark.parametrize(("arguments", "message"), [
    ({"value": 1, "from": "parsec", "to": "m"}, "unknown unit 'parsec' in \"from\""),
    ({"value": 1, "from": "m", "to": "furlong"}, "unknown unit 'furlong' in \"to\""),
    ({"value": 1, "from": "km", "to": "kg"}, "cannot convert km (length) to kg (mass)"),
    ({"value": 1, "from": "h", "to": "degC"}, "cannot convert h (time) to degC (temperature)"),
    ({"value": "three", "from": "km", "to": "m"}, "must be a number, got the text 'three'"),
    ({"value": True, "from": "km", "to": "m"}, "must be a number, got bool"),
    ({"value": [1], "from": "km", "to": "m"}, "must be a number, got list"),
    ({"value": "nan", "from": "km", "to": "m"}, "finite"),
    ({"value": 10**400, "from": "km", "to": "m"}, "finite"),
    ({"value": 1e13, "from": "km", "to": "m"}, "at most 1e+12"),
    ({"value": -300, "from": "C", "to": "K"}, "below absolute zero"),
    ({"value": 1, "from": 5, "to": "m"}, "\"from\" must be a unit name"),
    ({"value": 1, "from": "m"}, "missing: to"),
    ({"value": 1, "from": "m", "to": "km", "round": 2}, "unknown argument(s): round"),
])
def test_bad_calls_raise_tool_errors_that_say_what_is_wrong(arguments, message):
    tool = units_mod.build_units(None, None)
    with pytest.raises(ToolError) as info:
        tool(arguments)
    assert message in str(info.value) and str(info.value).startswith("Error:")


def test_schema_is_an_openai_function_schema_listing_every_unit():
    tool = units_mod.build_units(None, None)
    assert isinstance(tool, Tool)
    schema = tool.schema()
    assert schema["type"] == "function" and schema["function"]["name"] == "units"
    params = schema["function"]["parameters"]
    assert params["type"] == "object" and params["additionalProperties"] is False
    assert params["required"] == ["value", "from", "to"]
    assert params["properties"]["value"]["type"] == "number"
    assert params["properties"]["from"]["enum"] == params["properties"]["to"]["enum"] == list(units_mod.SYMBOLS)
    for symbol in units_mod.SYMBOLS:  # every listed unit converts to itself
        assert convert(1, symbol, symbol) == "1"


def test_options_forbid_unknown_keys_bound_numbers_and_describe_every_field():
    for bad in ({"digits": 3}, {"precision": 0}, {"precision": 16}, {"max_magnitude": 0}, {"max_magnitude": 1e101}):
        with pytest.raises(ValidationError):
            units_mod.UnitsOptions(**bad)
    for bad in ({"prompt": "x"}, {"check_prompt": ""}, {"format": "xml"}):
        with pytest.raises(ValidationError):
            loop_mod.CheckOnceOptions(**bad)
    for model in (units_mod.UnitsOptions, loop_mod.CheckOnceOptions):
        assert all(f.description for f in model.model_fields.values())


# -- the check_once loop through rlx's episode runner ---------------------------------------------------------------
@pytest.fixture(scope="module")
def tok() -> Any:
    return agent_tokenizer('{"name": "units", "arguments": {"value": 3, "from": "km", "to": "mi"}} user '
                           'assistant tool_response Check your answer once more')


def prompts(tok: Any, questions: list[str]) -> Batch:
    return prompt_batch(tok, questions, "1.86")


def runner(tok: Any, engine: ScriptedEngine, **limits: Any) -> EpisodeRunner:
    loop = loop_mod.build_check_once(loop_mod.CheckOnceOptions(format="hermes"), None)
    assert isinstance(loop, AgentLoop)
    return EpisodeRunner(loop, {"units": units_mod.build_units(None, None)}, tok, AgentLimits(**limits),
                         engine.generate, "agent_loop 'check_once'")


CALL = '<tool_call>\n{"name": "units", "arguments": {"value": 3, "from": "km", "to": "mi"}}\n</tool_call>'


def call_then_answer(context: str) -> str:
    """Calls the tool first; answers with its result, and with the bare number once asked to check."""
    results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", context, re.DOTALL)
    if not results:
        return CALL
    return results[-1] if CHECK in context else f"3 km is {results[-1]} mi."


def ids_of(tok: Any, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def test_an_answer_is_checked_once_and_the_check_turn_is_not_trained(tok: Any) -> None:
    seen: list[str] = []

    def reply(context: str) -> str:
        seen.append(context)
        return "2" if CHECK in context else "About 2 miles."

    engine = ScriptedEngine(tok, reply)
    out = runner(tok, engine).run(prompts(tok, ["3 km in miles?"]), SamplingParams(n=2, max_tokens=200))
    assert engine.calls == [2, 2]  # two turns, each one engine call for both episodes
    check_turn = render_after_turn(tok, [{"role": "user", "content": CHECK}], None)
    assert tok.decode(check_turn) == f"\n<|im_start|>user\n{CHECK}<|im_end|>\n<|im_start|>assistant\n"
    first, second = ids_of(tok, "About 2 miles."), ids_of(tok, "2")
    for i in range(2):
        n = int(out["response_mask"][i].sum())
        assert out["responses"][i, :n].tolist() == first + check_turn + second
        assert out["loss_mask"][i, :n].tolist() == [1] * len(first) + [0] * len(check_turn) + [1] * len(second)
        assert out["messages"][i] == [{"role": "assistant", "content": "About 2 miles."},
                                      {"role": "user", "content": CHECK},
                                      {"role": "assistant", "content": "2"}]
    assert [c.count(CHECK) for c in seen] == [0, 0, 1, 1]  # the second turns saw the prompt, once
    m = episode_metrics(out)
    assert m["agent/turns/max"] == 2 and m["agent/end/answer"] == 1.0 and m["agent/tool_calls/mean"] == 0


def test_tool_calls_run_before_the_answer_and_its_check(tok: Any) -> None:
    engine = ScriptedEngine(tok, call_then_answer)
    out = runner(tok, engine).run(prompts(tok, ["3 km in miles?"]), SamplingParams(n=1, max_tokens=400))
    assert out["messages"][0] == [{"role": "assistant", "content": CALL},
                                  {"role": "tool", "name": "units", "content": "1.86411"},
                                  {"role": "assistant", "content": "3 km is 1.86411 mi."},
                                  {"role": "user", "content": CHECK},
                                  {"role": "assistant", "content": "1.86411"}]
    tool_turn = render_after_turn(tok, [{"role": "tool", "name": "units", "content": "1.86411"}], None)
    check_turn = render_after_turn(tok, [{"role": "user", "content": CHECK}], None)
    parts = [(ids_of(tok, CALL), 1), (tool_turn, 0), (ids_of(tok, "3 km is 1.86411 mi."), 1), (check_turn, 0),
             (ids_of(tok, "1.86411"), 1)]
    n = int(out["response_mask"][0].sum())
    assert out["responses"][0, :n].tolist() == [t for ids, _ in parts for t in ids]
    assert out["loss_mask"][0, :n].tolist() == [bit for ids, bit in parts for _ in ids]
    m = episode_metrics(out)
    assert m["agent/turns/max"] == 3 and m["agent/tool_calls/mean"] == 1 and m["agent/tool_errors/mean"] == 0
    assert m["agent/end/answer"] == 1.0


def test_a_tool_error_is_a_turn_the_model_reads(tok: Any) -> None:
    bad = '<tool_call>{"name": "units", "arguments": {"value": 3, "from": "km", "to": "kg"}}</tool_call>'
    engine = ScriptedEngine(tok, lambda c: bad if "<tool_response>" not in c else "ok")
    out = runner(tok, engine).run(prompts(tok, ["q"]), SamplingParams(n=1, max_tokens=400))
    tool = out["messages"][0][1]
    assert tool["role"] == "tool" and "cannot convert km (length) to kg (mass)" in tool["content"]
    assert episode_metrics(out)["agent/tool_errors/mean"] == 1


def test_the_turn_limit_is_respected(tok: Any) -> None:
    # An answer in the last turn allowed is not checked: its check could never be answered.
    engine = ScriptedEngine(tok, lambda c: "2" if CHECK in c else "About 2.")
    out = runner(tok, engine, max_turns=1).run(prompts(tok, ["q"]), SamplingParams(n=1, max_tokens=200))
    assert out["messages"][0] == [{"role": "assistant", "content": "About 2."}]
    assert episode_metrics(out)["agent/end/answer"] == 1.0
    # A tool call, its result and the first answer use up max_turns=2: no check.
    engine = ScriptedEngine(tok, call_then_answer)
    out = runner(tok, engine, max_turns=2).run(prompts(tok, ["q"]), SamplingParams(n=1, max_tokens=400))
    assert [m["role"] for m in out["messages"][0]] == ["assistant", "tool", "assistant"]
    assert int(out["agent/turns"][0]) == 2
    # A model that only ever calls tools ends at the limit, unanswered.
    engine = ScriptedEngine(tok, lambda c: CALL)
    out = runner(tok, engine, max_turns=3).run(prompts(tok, ["q", "r"]), SamplingParams(n=1, max_tokens=2000))
    m = episode_metrics(out)
    assert m["agent/turns/max"] == 3 and m["agent/end/max_turns"] == 1.0 and m["agent/tool_calls/mean"] == 2
    assert engine.calls == [2, 2, 2]


def test_the_token_budget_is_never_exceeded(tok: Any) -> None:
    engine = ScriptedEngine(tok, call_then_answer)
    full = runner(tok, engine).run(prompts(tok, ["q"]), SamplingParams(n=1, max_tokens=400))
    length = int(full["response_mask"].sum())
    for budget in (3, 20, length // 2, length - 3):
        out = runner(tok, engine).run(prompts(tok, ["q"]), SamplingParams(n=1, max_tokens=budget))
        assert int(out["response_mask"].sum()) <= budget
        assert episode_metrics(out)["agent/end/budget"] == 1.0
    # The first answer fits, the check prompt does not: it is cut, and no turn follows it.
    first = ids_of(tok, "About 2.")
    engine = ScriptedEngine(tok, lambda c: "2" if CHECK in c else "About 2.")
    out = runner(tok, engine).run(prompts(tok, ["q"]), SamplingParams(n=1, max_tokens=len(first) + 4))
    assert int(out["response_mask"].sum()) == len(first) + 4 and int(out["agent/turns"][0]) == 1
    assert out["loss_mask"][0].tolist() == [1] * len(first) + [0] * 4
    assert episode_metrics(out)["agent/end/budget"] == 1.0
    # A model that never ends its turn: the first turn runs to the budget and ends the episode.
    engine = ScriptedEngine(tok, lambda c: "la", stop=False)
    out = runner(tok, engine).run(prompts(tok, ["q"]), SamplingParams(n=1, max_tokens=30))
    assert int(out["response_mask"].sum()) == 30 and int(out["agent/turns"][0]) == 1
    assert CHECK not in tok.decode(out["responses"][0].tolist())


def test_the_check_prompt_option_and_auto_format(tok: Any) -> None:
    engine = ScriptedEngine(tok, lambda c: "2" if "Sure?" in c else "About 2.")
    loop = loop_mod.build_check_once(loop_mod.CheckOnceOptions(check_prompt="Sure?"), None)
    assert loop.format == "hermes"  # auto, without a tokenizer to read the template of
    r = EpisodeRunner(loop, {}, tok, AgentLimits(), engine.generate)
    out = r.run(prompts(tok, ["q"]), SamplingParams(n=1, max_tokens=200))
    assert out["messages"][0][1] == {"role": "user", "content": "Sure?"}
    assert loop_mod.CheckOnce("llama3").parse('{"name": "units", "parameters": {"value": 1}}')[0].name == "units"


# -- registration -------------------------------------------------------------------------------------------------
def plugin_manager() -> PluginManager:
    """The installed distribution's entry point when installed, else the source folder's module."""
    pm = PluginManager()
    if INSTALLED:
        pm.load_entry_points(strict=True)
    else:
        pm.register(plugin, name="agent-units", distribution="rlx-agent-units", version="0.1.0")
    return pm


def test_registers_a_tool_and_an_agent_loop():
    pm = plugin_manager()
    tool, loop = pm.get("tool", "units"), pm.get("agent_loop", "check_once")
    assert tool.distribution == loop.distribution == "rlx-agent-units"
    assert tool.load_config_model() is units_mod.UnitsOptions
    assert loop.load_config_model() is loop_mod.CheckOnceOptions
    built = pm.build("tool", "units", units_mod.UnitsOptions(precision=3), None)
    assert built({"value": 3, "from": "km", "to": "mi"}) == "1.86"
    assert isinstance(pm.build("agent_loop", "check_once", None, None), loop_mod.CheckOnce)


def test_pyproject_declares_the_rlx_entry_point():
    tomllib = pytest.importorskip("tomllib")
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["entry-points"]["rlx"] == {"agent-units": "rlx_agent_units"}
    assert "rlx>=0.1.0,<0.2" in meta["project"]["dependencies"]  # a range of rlx releases, not any


def rlx_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RLX_STRICT", "RLX_DISABLE"))}
    return subprocess.run([sys.executable, "-m", "rlx", *args], capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.skipif(not INSTALLED, reason="rlx-agent-units is not installed (pip install ./contrib/rlx-agent-units)")
def test_rlx_config_validate_accepts_the_plugin_when_installed():
    ok = rlx_cli("config", "validate", "--preset", "tiny", "agent.name=check_once", "agent.tools=[units]",
                 "tools.units.precision=4", "agent.check_prompt=Sure?")
    assert ok.returncode == 0, ok.stderr[-2000:]
    bad = rlx_cli("config", "validate", "--preset", "tiny", "agent.name=check_once", "agent.tools=[units]",
                  "tools.units.precision=99")
    assert bad.returncode == 2 and "tools.units.precision" in bad.stderr and "Traceback" not in bad.stderr
