"""Assert tests judged outside the sandbox: the program's values go out, the expected values never go in.

The program runs in the same interpreter as the code that checks it, so anything decided in there can be
forged by a program that patches builtins, walks frames or returns an object whose ``==`` is always true.
So an assert like ``assert add(1, 2) == 3`` is split: the sandbox evaluates only the *subject*
``add(1, 2)`` and sends its value back as typed JSON (exact builtin types only); the scorer decodes it into
plain data and applies ``== 3`` itself. The literal ``3`` never enters the sandbox, so passing requires
producing the right values, which is solving the task.

Forms split this way (after any setup statements, which run in the sandbox in order):

- ``assert X <op> LITERAL`` or ``assert LITERAL <op> X`` with ``==, !=, <, <=, >, >=, in, not in``, and
  ``is`` / ``is not`` with ``None``, ``True`` or ``False``;
- ``assert math.isclose(X, LITERAL, rel_tol=..., abs_tol=...)`` and ``assert abs(X - LITERAL) < EPS``;
- ``assert f(...)`` and ``assert not f(...)`` where ``f`` is the program's function (not a builtin and not
  defined by the test: those could be replaced by the program);
- HumanEval's ``def check(candidate): <asserts of these forms>`` followed by ``check(entry_point)``.

Any other test (loops of asserts, comparisons of two computed values, helper checkers) is *opaque*: it
runs in the sandbox and its pass/fail comes from there, which a program written to cheat can forge.
``code/opaque`` reports how many such tests a batch had; ``opaque_tests: error`` refuses them.
"""

from __future__ import annotations

import ast
import builtins
import json
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_COMPARE: dict[type[ast.cmpop], Callable[[Any, Any], bool]] = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
    ast.Gt: operator.gt, ast.GtE: operator.ge, ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
    ast.Is: operator.is_, ast.IsNot: operator.is_not,
}
_SINGLETONS = (None, True, False)
_BUILTINS = frozenset(dir(builtins))


class BadRecord(ValueError):
    """The channel held something the harness does not write: the whole run counts as failed."""


@dataclass(frozen=True)
class Probe:
    """One subject evaluated in the sandbox, and how the scorer judges its value."""

    expr: str
    judge: Callable[[Any], bool]


@dataclass
class Plan:
    """One test: ``steps`` go to the sandbox, ``probes`` (one per ``eval`` step) stay here.

    ``source`` set means opaque: the snippet runs as it is and the sandbox reports pass/fail.
    ``static_ok`` is False when an assert between two literals already fails.
    """

    steps: list[dict[str, str]] = field(default_factory=list)
    probes: list[Probe] = field(default_factory=list)
    source: str | None = None
    static_ok: bool = True

    @property
    def opaque(self) -> bool:
        return self.source is not None

    def to_spec(self) -> dict[str, Any]:
        return {"source": self.source} if self.source is not None else {"steps": self.steps}


def _literal(node: ast.expr) -> tuple[bool, Any]:
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def _safe(fn: Callable[[Any], bool]) -> Callable[[Any], bool]:
    def judge(value: Any) -> bool:
        try:
            return bool(fn(value))
        except (TypeError, ValueError, OverflowError, RecursionError):
            return False

    return judge


def _probe_of(test: ast.expr, defined: set[str]) -> Probe | bool | None:
    """A probe for ``assert test``; True/False when it involves literals only; None when opaque."""
    ok, value = _literal(test)
    if ok:
        return bool(value)
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        op, left, right = test.ops[0], test.left, test.comparators[0]
        within = _within(left, op, right)  # before the general form, which would send the target inside
        if within is not None:
            return within
        fn = _COMPARE.get(type(op))
        lok, lval = _literal(left)
        rok, rval = _literal(right)
        if fn is not None and lok and rok:
            return _safe(lambda _: fn(lval, rval))(None)
        if fn is not None and lok != rok:
            lit = lval if lok else rval
            if isinstance(op, (ast.Is, ast.IsNot)) and not any(lit is s for s in _SINGLETONS):
                return None
            subject = right if lok else left
            if lok:
                return Probe(ast.unparse(subject), _safe(lambda x: fn(lit, x)))
            return Probe(ast.unparse(subject), _safe(lambda x: fn(x, lit)))
        return None
    if isinstance(test, ast.Call) and _is_isclose(test.func):
        return _isclose(test)
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) and _program_call(test.operand, defined):
        return Probe(ast.unparse(test.operand), _safe(lambda x: not x))
    if _program_call(test, defined):
        return Probe(ast.unparse(test), _safe(bool))
    return None


def _program_call(node: ast.expr, defined: set[str]) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id not in defined and node.func.id not in _BUILTINS)


def _is_isclose(func: ast.expr) -> bool:
    return ((isinstance(func, ast.Name) and func.id == "isclose")
            or (isinstance(func, ast.Attribute) and func.attr == "isclose"
                and isinstance(func.value, ast.Name) and func.value.id == "math"))


def _number(value: Any) -> bool:
    return type(value) in (int, float)


def _isclose(call: ast.Call) -> Probe | None:
    if len(call.args) != 2:
        return None
    (aok, aval), (bok, bval) = _literal(call.args[0]), _literal(call.args[1])
    if aok == bok:
        return None
    target = aval if aok else bval
    tol: dict[str, float] = {}
    for kw in call.keywords:
        ok, v = _literal(kw.value)
        if kw.arg not in ("rel_tol", "abs_tol") or not ok or not _number(v):
            return None
        tol[kw.arg] = v
    if not _number(target):
        return None
    subject = call.args[1] if aok else call.args[0]
    return Probe(ast.unparse(subject), _safe(lambda x: _number(x) and math.isclose(x, target, **tol)))


def _within(left: ast.expr, op: ast.cmpop, right: ast.expr) -> Probe | None:
    """``abs(X - LIT) < EPS`` (or ``<=``, or ``abs(LIT - X)``)."""
    if not (isinstance(op, (ast.Lt, ast.LtE)) and isinstance(left, ast.Call) and isinstance(left.func, ast.Name)
            and left.func.id == "abs" and len(left.args) == 1 and not left.keywords
            and isinstance(left.args[0], ast.BinOp) and isinstance(left.args[0].op, ast.Sub)):
        return None
    eok, eps = _literal(right)
    diff = left.args[0]
    (aok, aval), (bok, bval) = _literal(diff.left), _literal(diff.right)
    if not eok or not _number(eps) or aok == bok or not _number(aval if aok else bval):
        return None
    target = aval if aok else bval
    subject = diff.right if aok else diff.left
    cmp = _COMPARE[type(op)]
    return Probe(ast.unparse(subject), _safe(lambda x: _number(x) and cmp(abs(x - target), eps)))


def _bound_names(stmt: ast.stmt) -> set[str]:
    names: set[str] = set()
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        names.add(stmt.name)
    elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
        names.update((a.asname or a.name).split(".")[0] for a in stmt.names)
    for node in ast.walk(stmt):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def _checker_body(fn: ast.FunctionDef) -> list[ast.stmt] | None:
    """The body of a HumanEval-style ``check(candidate)`` if it is plain asserts (and imports)."""
    if len(fn.args.args) != 1 or fn.args.vararg or fn.args.kwarg or fn.args.kwonlyargs or fn.decorator_list:
        return None
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if all(isinstance(s, (ast.Assert, ast.Pass, ast.Import, ast.ImportFrom)) for s in body):
        return body
    return None


def _inline_checkers(body: list[ast.stmt]) -> list[ast.stmt] | None:
    """Replace ``check(NAME)`` by ``candidate = NAME`` and check's asserts; None if a checker cannot be."""
    checkers = {s.name: s for s in body if isinstance(s, ast.FunctionDef)}
    out: list[ast.stmt] = []
    for stmt in body:
        if isinstance(stmt, ast.FunctionDef) and stmt.name in checkers and _checker_body(stmt) is not None:
            continue
        call = stmt.value if isinstance(stmt, ast.Expr) else None
        if (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in checkers
                and len(call.args) == 1 and not call.keywords and isinstance(call.args[0], ast.Name)):
            fn = checkers[call.func.id]
            inner = _checker_body(fn)
            if inner is None:
                return None
            bind = ast.Assign(targets=[ast.Name(fn.args.args[0].arg, ast.Store())], value=call.args[0], lineno=0)
            out += [bind, *inner]
            continue
        out.append(stmt)
    return out


def plan(snippet: str) -> Plan:
    """How to run and judge one assert snippet (see the module docstring)."""
    opaque = Plan(source=snippet)
    try:
        tree = ast.parse(snippet)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return opaque
    body = _inline_checkers(tree.body)
    if body is None:
        return opaque
    defined: set[str] = set()
    for stmt in body:
        defined |= _bound_names(stmt)
    result = Plan()
    for stmt in body:
        if isinstance(stmt, ast.Assert):
            probe = _probe_of(stmt.test, defined)
            if probe is None:
                return opaque
            if isinstance(probe, bool):
                result.static_ok = result.static_ok and probe
                continue
            result.steps.append({"eval": probe.expr})
            result.probes.append(probe)
        elif any(isinstance(n, (ast.Assert, ast.Raise)) for n in ast.walk(stmt)):
            return opaque  # a check of its own, decided in the sandbox
        else:
            result.steps.append({"exec": ast.unparse(stmt)})
    return result


def decode(obj: Any, depth: int = 0) -> Any:
    """Typed JSON from the harness back into plain builtins; BadRecord for anything else."""
    if depth > 100:
        raise BadRecord("nested too deeply")
    t = type(obj)
    if obj is None or t in (bool, int, float, str):
        return obj
    if t is list:
        return [decode(x, depth + 1) for x in obj]
    if t is dict and len(obj) == 1:
        ((tag, v),) = obj.items()
        try:
            if tag == "tuple" and type(v) is list:
                return tuple(decode(x, depth + 1) for x in v)
            if tag in ("set", "frozenset") and type(v) is list:
                items = [decode(x, depth + 1) for x in v]
                return set(items) if tag == "set" else frozenset(items)
            if tag == "dict" and type(v) is list and all(type(p) is list and len(p) == 2 for p in v):
                return {decode(k, depth + 1): decode(x, depth + 1) for k, x in v}
            if tag == "bytes" and type(v) is str:
                return bytes.fromhex(v)
            if tag == "float" and v in ("nan", "inf", "-inf"):
                return float(v)
            if tag == "complex" and type(v) is list and len(v) == 2 and all(type(x) is str for x in v):
                return complex(float(v[0]), float(v[1]))
        except (TypeError, ValueError) as exc:  # unhashable set members or keys, bad hex or number
            raise BadRecord(str(exc)) from exc
    raise BadRecord(f"not a value record: {str(obj)[:80]}")


def judge(plans: list[Plan], channel: str) -> tuple[list[bool], str]:
    """Pass/fail per test from the harness's records; all fail unless they are exactly what it writes.

    Returns (passed per test, load error or "").
    """
    failed = [False] * len(plans)
    try:
        records = [json.loads(line) for line in channel.splitlines()]
    except (ValueError, RecursionError):
        return failed, ""
    if not records or not all(type(r) is dict for r in records) or records[-1] != {"done": len(plans)}:
        return failed, ""  # no final record from the harness: it did not finish
    values: dict[tuple[int, int], Any] = {}
    errors: set[int] = set()
    reported: dict[int, bool] = {}
    try:
        for rec in records[:-1]:
            keys = set(rec)
            if keys == {"load_error"} and len(records) == 2 and type(rec["load_error"]) is str:
                return failed, rec["load_error"]
            t = rec.get("test")
            if type(t) is not int or not 0 <= t < len(plans):
                raise BadRecord(f"unexpected record {str(rec)[:80]}")
            p = plans[t]
            if p.opaque and keys == {"test", "ok"} and type(rec["ok"]) is bool and t not in reported:
                reported[t] = rec["ok"]
                continue
            i = rec.get("probe")
            if p.opaque or type(i) is not int or not 0 <= i <= len(p.probes):
                raise BadRecord(f"unexpected record {str(rec)[:80]}")
            if keys == {"test", "probe", "error"} and type(rec["error"]) is str and t not in errors:
                errors.add(t)
            elif keys == {"test", "probe", "value"} and i < len(p.probes) and (t, i) not in values:
                values[(t, i)] = decode(rec["value"])
            else:
                raise BadRecord(f"unexpected record {str(rec)[:80]}")
    except BadRecord:
        return failed, ""
    passed = []
    for t, p in enumerate(plans):
        if p.opaque:
            passed.append(reported.get(t, False))
            continue
        passed.append(p.static_ok and t not in errors and all(
            (t, i) in values and probe.judge(values[(t, i)]) for i, probe in enumerate(p.probes)))
    return passed, ""
