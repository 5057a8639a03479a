"""The built-in tools an agent's model may call (``agent.tools=[calculator, python]``).

``calculator`` evaluates one arithmetic expression: numbers, ``+ - * / // % **``, unary ``+ -``, parentheses
and ``abs``, ``round``, ``min``, ``max``, ``sqrt``. It walks Python's syntax tree itself (nothing is ever
``eval``-ed) and bounds the work: the expression's length, integers of at most ``max_digits`` digits (a power is
refused *before* it is computed when its result would be longer), finite floats only. An integer result prints
as an integer (``85``), and so does a float that is an exact integer below 2**53 (``17 / 5 * 5`` gives ``17``);
other floats print with 15 significant digits (``0.1 + 0.2`` gives ``0.3``).

>>> calc = build_calculator(CalculatorOptions(), None)
>>> calc({"expression": "(3 + 4) * 12 + 1"}), calc({"expression": "7 / 2"}), calc({"expression": "2 ** 0.5"})
('85', '3.5', '1.4142135623731')

``python`` runs a program in the sandbox of :mod:`rlx.run.sandbox` (bubblewrap: no network, a private
filesystem, its own PID namespace, limits on memory, CPU, processes, disk and output) and returns what it
printed: its stdout, then ``stderr:`` and the standard error if there is any. Each call is a fresh process:
nothing is kept between calls. A program that fails (an exception: its traceback, a non-zero exit status,
the deadline, too much output) raises :class:`rlx.protocols.ToolError` with that same text ending in the
reason (``exit status 1``, ``timed out after 10 s``), so the model reads it and the call counts as a tool
error. ``tools.python.sandbox=auto`` (the default) refuses to build when bwrap cannot run here.

Every call rejects arguments other than the schema's (a dict with exactly ``expression`` or ``code``, a string)
with a :class:`~rlx.protocols.ToolError` saying what is expected.
"""

from __future__ import annotations

import ast
import math
import operator
import re
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rlx import Component, hookimpl
from rlx.protocols import ToolError

if TYPE_CHECKING:
    from rlx.run.sandbox import Limits, Sandbox


def _arguments(arguments: object, tool: str, key: str) -> str:
    """The one string argument ``key`` of a call, or a ToolError naming what the tool takes."""
    expected = f'{tool} takes one argument: {{"{key}": "<text>"}}'
    if not isinstance(arguments, dict):
        raise ToolError(f"Error: {expected}; got {type(arguments).__name__}.")
    extra = sorted(str(k) for k in arguments if k != key)
    if extra:
        raise ToolError(f"Error: {expected}; unknown argument(s): {', '.join(extra)}.")
    value = arguments.get(key)
    if not isinstance(value, str):
        got = "nothing" if key not in arguments else type(value).__name__
        raise ToolError(f'Error: {expected}; "{key}" must be a string, got {got}.')
    return value


def _schema(name: str, description: str, key: str, about: str) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {key: {"type": "string", "description": about}},
                       "required": [key], "additionalProperties": False}}}


# -- calculator ---------------------------------------------------------------------------------------------------
class CalculatorOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_length: int = Field(1000, ge=1, le=100_000, description="Characters of one expression, at most.")
    max_digits: int = Field(100, ge=1, le=4000, description="Digits of any integer in a calculation (literals, "
                            "intermediate values, the result), at most; a power past it is refused before it "
                            "is computed.")


_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_SYMBOLS = {ast.BitXor: "^ (use ** for a power)", ast.BitAnd: "&", ast.BitOr: "|", ast.LShift: "<<",
            ast.RShift: ">>", ast.MatMult: "@", ast.Invert: "~", ast.Not: "not"}
_MAX_DEPTH = 100  # nested operations; the parser itself stops at 200 nested parentheses
_EXACT = 2**53  # floats below it that are integers are exact integers


class Calculator:
    """The ``calculator`` tool: ``{"expression": "..."}`` -> the value as text."""

    def __init__(self, options: CalculatorOptions) -> None:
        self.options = options
        self._limit = 10**options.max_digits
        self._functions: dict[str, tuple[Callable[..., Any], int, int]] = {  # name: (fn, fewest args, most args)
            "abs": (abs, 1, 1), "round": (self._round, 1, 2), "min": (min, 2, 100), "max": (max, 2, 100),
            "sqrt": (math.sqrt, 1, 1)}

    def schema(self) -> dict[str, Any]:
        return _schema("calculator", "Evaluate an arithmetic expression exactly and return its value. Supports "
                       "numbers, + - * / // % ** and parentheses, and the functions abs, round, min, max, sqrt.",
                       "expression", 'The expression, e.g. "(3 + 4) * 12 / 5".')

    def __call__(self, arguments: dict[str, Any]) -> str:
        text = _arguments(arguments, "calculator", "expression").strip()
        if not text:
            raise ToolError("Error: the expression is empty.")
        if len(text) > self.options.max_length:
            raise ToolError(f"Error: the expression is longer than {self.options.max_length} characters.")
        try:
            with warnings.catch_warnings():  # "47a" warns of an invalid literal on stderr: the model's text, not ours
                warnings.simplefilter("ignore", SyntaxWarning)
                tree = ast.parse(text, mode="eval")
        except SyntaxError as exc:
            raise ToolError(f"Error: invalid expression ({exc.msg}).") from None
        except (ValueError, RecursionError, MemoryError):  # a null byte; nesting the parser cannot hold
            raise ToolError("Error: invalid expression.") from None
        try:
            return _format(self._eval(tree.body, 0))
        except ZeroDivisionError:
            raise ToolError("Error: division by zero.") from None
        except OverflowError:
            raise ToolError("Error: the result is too large.") from None
        except RecursionError:
            raise ToolError("Error: the expression is nested too deeply.") from None

    def _eval(self, node: ast.expr, depth: int) -> int | float:
        if depth > _MAX_DEPTH:
            raise ToolError(f"Error: the expression is nested more than {_MAX_DEPTH} deep.")
        if isinstance(node, ast.Constant):
            if type(node.value) not in (int, float):
                raise ToolError(f"Error: only numbers are allowed, not {node.value!r}.")
            return self._checked(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self._eval(node.left, depth + 1), self._eval(node.right, depth + 1)
            if isinstance(node.op, ast.Pow):
                self._check_power(left, right)
            return self._checked(_BINARY[type(node.op)](left, right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return self._checked(_UNARY[type(node.op)](self._eval(node.operand, depth + 1)))
        if isinstance(node, ast.Call):
            return self._call(node, depth)
        op = getattr(node, "op", None)
        if op is not None and type(op) in _SYMBOLS:
            raise ToolError(f"Error: the operator {_SYMBOLS[type(op)]} is not supported.")
        if isinstance(node, ast.Name):
            raise ToolError(f"Error: unknown name {node.id!r}: the expression may contain numbers only.")
        if isinstance(node, ast.Attribute):
            raise ToolError("Error: attribute access is not allowed.")
        raise ToolError(f"Error: {type(node).__name__.lower()} expressions are not supported: use numbers, "
                        "+ - * / // % ** and parentheses.")

    def _call(self, node: ast.Call, depth: int) -> int | float:
        names = ", ".join(sorted(self._functions))
        if not isinstance(node.func, ast.Name) or node.func.id not in self._functions:
            what = node.func.id if isinstance(node.func, ast.Name) else ast.unparse(node.func)[:40]
            raise ToolError(f"Error: unknown function {what!r}; the functions are {names}.")
        name = node.func.id
        fn, fewest, most = self._functions[name]
        if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
            raise ToolError(f"Error: {name}() takes plain positional arguments only.")
        if not fewest <= len(node.args) <= most:
            count = str(fewest) if fewest == most else f"{fewest} to {most}"
            raise ToolError(f"Error: {name}() takes {count} argument(s), got {len(node.args)}.")
        args = [self._eval(a, depth + 1) for a in node.args]
        if name == "sqrt" and args[0] < 0:
            raise ToolError("Error: the square root of a negative number.")
        return self._checked(fn(*args))

    def _round(self, x: int | float, ndigits: int | float | None = None) -> int | float:
        if ndigits is None:
            return round(x)
        if type(ndigits) is not int:
            raise ToolError("Error: round()'s second argument must be an integer.")
        if abs(ndigits) > self.options.max_digits:  # round(1, -10**9) would compute 10**(10**9)
            raise ToolError(f"Error: round() takes at most {self.options.max_digits} digits.")
        return round(x, ndigits)

    def _check_power(self, base: int | float, exponent: int | float) -> None:
        if type(base) is int and type(exponent) is int and exponent > 0 and abs(base) > 1:
            digits = exponent * math.log10(abs(base))
            if digits > self.options.max_digits:
                raise ToolError(f"Error: the result would have about {digits:.3g} digits, more than "
                                f"{self.options.max_digits}.")

    def _checked(self, value: object) -> int | float:
        if type(value) is int:
            if abs(value) >= self._limit:
                raise ToolError(f"Error: a number has more than {self.options.max_digits} digits.")
            return value
        if type(value) is float:
            if not math.isfinite(value):
                raise ToolError("Error: the result is not a finite number.")
            return value
        if type(value) is complex:
            raise ToolError("Error: the result is a complex number (a fractional power of a negative number).")
        raise ToolError(f"Error: unexpected value of type {type(value).__name__}.")


def _format(value: int | float) -> str:
    if type(value) is int:
        return str(value)
    if value.is_integer() and abs(value) < _EXACT:
        return str(int(value))
    return f"{value:.15g}"


def build_calculator(options: CalculatorOptions | None, ctx: object) -> Calculator:
    return Calculator(options or CalculatorOptions())


# -- python -------------------------------------------------------------------------------------------------------
class PythonToolOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sandbox: Literal["auto", "bwrap", "none"] = Field(
        "auto", description="auto/bwrap: run programs in a bubblewrap sandbox (no network, private filesystem, own "
        "PID namespace), and refuse to start if it cannot run. none: run them with your own rights (they can read "
        "your files and secrets, use the network, signal the trainer).")
    timeout_s: float = Field(10.0, gt=0, le=3600.0, description="Seconds one program may run (wall clock; CPU "
                             "seconds: one more); keep it below agent.tool_timeout_s so the sandbox's own "
                             "deadline ends the call.")
    memory_mb: int = Field(512, ge=64, le=2**20, description="Address space of the program in MiB.")
    processes: int = Field(16, ge=1, le=4096, description="Processes and threads a program may have at once "
                           "(sandboxed runs).")
    disk_mb: int = Field(64, ge=1, le=2**16, description="Size of the program's writable folders in MiB "
                         "(sandboxed runs); nothing written outlives the call.")
    output_kb: int = Field(64, ge=1, le=2**16, description="Output kept per stream in KiB; a program printing "
                           "more is stopped (its call fails with the output so far).")
    max_code_chars: int = Field(100_000, ge=1, le=10**7, description="Characters of one program, at most.")


# The harness's own frame, first in every traceback of the program: not the model's code.
_HARNESS_FRAME = re.compile(r'^Traceback \(most recent call last\):\n  File "<string>", line \d+, in <module>\n',
                            re.MULTILINE)


class PythonTool:
    """The ``python`` tool: ``{"code": "..."}`` -> what the program printed."""

    def __init__(self, options: PythonToolOptions, sandbox: Sandbox, limits: Limits) -> None:
        self.options = options
        self.sandbox = sandbox
        self.limits = limits

    def schema(self) -> dict[str, Any]:
        return _schema("python", "Run a Python 3 program (standard library only, no network, no files kept "
                       "between calls) and return what it prints. Print the values you need.",
                       "code", "The program's source code.")

    def __call__(self, arguments: dict[str, Any]) -> str:
        from rlx.run.sandbox import run_program

        code = _arguments(arguments, "python", "code")
        if len(code) > self.options.max_code_chars:
            raise ToolError(f"Error: the program is longer than {self.options.max_code_chars} characters.")
        run = run_program(self.sandbox, code, "", self.limits)
        parts = [run.stdout] if run.stdout else []
        stderr = _HARNESS_FRAME.sub("Traceback (most recent call last):\n", run.stderr)
        if stderr:
            parts.append("stderr:\n" + stderr)
        text = "\n".join(p.rstrip("\n") for p in parts)
        if run.timed_out:
            status = f"timed out after {self.options.timeout_s:g} s"
        elif run.output_exceeded:
            status = f"output limit reached ({self.options.output_kb} KiB per stream): the program was stopped"
        elif run.returncode != 0:
            status = f"exit status {run.returncode}"
        else:
            return text or "(no output)"
        raise ToolError(f"{text}\n{status}" if text else status)


def build_python(options: PythonToolOptions | None, ctx: object) -> PythonTool:
    from rlx.run.sandbox import Limits, resolve

    opts = options or PythonToolOptions()
    limits = Limits(timeout_s=opts.timeout_s, memory_mb=opts.memory_mb, disk_mb=opts.disk_mb,
                    file_mb=min(16, opts.disk_mb), processes=opts.processes, output_mb=opts.output_kb / 1024)
    sandbox = resolve(opts.sandbox, limits, who="python tool", option="tools.python.sandbox")
    return PythonTool(opts, sandbox, limits)


class Gsm8kAnswerOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")


_LAST_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _gsm8k_number(text: str) -> str | None:
    """The last number of ``text`` (commas and a trailing ``.0`` dropped), as GSM8K answers are compared."""
    found = _LAST_NUMBER.findall(text.replace("$", ""))
    if not found:
        return None
    number = found[-1].replace(",", "").rstrip(".")
    return number[:-2] if number.endswith(".0") else number


class Gsm8kAnswer:
    """``calc_gsm8k_reward``, as verl's gsm8k tool: the model submits its answer (``{"answer": "72"}``) and reads
    back whether it is right, so it can try again. Bound to each episode's ground truth (``for_episode``); the
    answer is compared as the last number, the way verl's ``flexible`` extraction does. The reward of the run is
    still the reward plugin's, on the final turn."""

    name = "calc_gsm8k_reward"

    def __init__(self, truth: str | None = None) -> None:
        self.truth = truth

    def schema(self) -> dict[str, Any]:
        return _schema(self.name, "A tool for calculating the reward of gsm8k: submit the answer to the question, "
                       "get back its reward (1.0 right, 0.0 wrong).", "answer", "The answer to the question")

    def for_episode(self, row: dict[str, Any]) -> Gsm8kAnswer:
        truth = row.get("ground_truth")
        text = str(truth) if truth is not None else ""
        if "####" in text:  # a whole GSM8K solution as the ground truth
            text = text.rsplit("####", 1)[1]
        return Gsm8kAnswer(_gsm8k_number(text))

    def __call__(self, arguments: dict[str, Any]) -> str:
        if not isinstance(arguments, dict) or "answer" not in arguments:
            raise ToolError('Error: calc_gsm8k_reward takes one argument: {"answer": "<the answer>"}.')
        answer = arguments["answer"]
        answer = answer if isinstance(answer, str) else str(answer)  # as verl's tool does
        if self.truth is None:
            raise ToolError("Error: this question has no ground truth to compare with.")
        got = _gsm8k_number(answer[5:] if answer.startswith("#### ") else answer)
        reward = 1.0 if got is not None and got == self.truth else 0.0
        return f"Current parsed answer={answer!r} reward={reward}"


def build_gsm8k_answer(options: Gsm8kAnswerOptions | None, ctx: object) -> Gsm8kAnswer:
    return Gsm8kAnswer()


@hookimpl
def rlx_tools() -> list[Component]:
    here = "rlx.plugins.agents.tools"
    return [
        Component(kind="tool", name="calculator", factory=f"{here}:build_calculator",
                  config_model=f"{here}:CalculatorOptions",
                  summary="Evaluates an arithmetic expression (+ - * / // % **, abs, round, min, max, sqrt), "
                          "bounded; never eval."),
        Component(kind="tool", name="python", factory=f"{here}:build_python", config_model=f"{here}:PythonToolOptions",
                  summary="Runs a Python program in the bubblewrap sandbox (no network, limits) and returns its "
                          "output."),
        Component(kind="tool", name="calc_gsm8k_reward", factory=f"{here}:build_gsm8k_answer",
                  config_model=f"{here}:Gsm8kAnswerOptions",
                  summary="verl's gsm8k tool: the model submits an answer and reads whether it matches the row's "
                          "ground truth."),
    ]
