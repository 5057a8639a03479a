"""The code reward's sandbox: :mod:`rlx.run.sandbox` (bubblewrap plus resource limits), with assert tests.

Everything that runs a program with limits lives in rlx (:mod:`rlx.run.sandbox`, which the built-in ``python``
tool uses too) and is re-exported here; this module adds what is the code reward's own: the harness's
``asserts`` mode and :func:`run_asserts`, and :func:`resolve` with the reward's option names in its messages.

Verdicts: for assert tests the harness in the sandbox sends back *values* (see :mod:`.probes`) as typed
JSON on a channel, then a final record; the scorer decodes them into plain builtins and compares them with
expected values that never entered the sandbox. Nothing the program writes is trusted as a verdict.
"""

from __future__ import annotations

from rlx.run import sandbox as _base
from rlx.run.sandbox import (
    WORKDIR,
    Interpreter,
    Limits,
    RunResult,
    Sandbox,
    bwrap_problem,
    check_sandbox,
    find_bwraps,
    find_usable_bwrap,
    interpreter,
    run_harness,
    run_program,
)

from .probes import Plan, judge

__all__ = ["HARNESS", "WORKDIR", "Interpreter", "Limits", "RunResult", "Sandbox", "bwrap_problem", "check_sandbox",
           "find_bwraps", "find_usable_bwrap", "interpreter", "resolve", "run_asserts", "run_harness",
           "run_program"]

# The harness's ``asserts`` mode: define the code, run each test's steps in its namespace, send the values.
ASSERTS_MODE = r'''
def _encode(v, depth=0):
    # Plain data of exact builtin types only: an object with its own __eq__ cannot cross.
    if depth > 100:
        raise ValueError("nested too deeply")
    t = type(v)
    if v is None or t is bool or t is int or t is str:
        return v
    if t is float:
        return v if v == v and v not in (float("inf"), float("-inf")) else {"float": repr(v)}
    if t is list:
        return [_encode(x, depth + 1) for x in v]
    if t is tuple:
        return {"tuple": [_encode(x, depth + 1) for x in v]}
    if t is set or t is frozenset:
        return {t.__name__: [_encode(x, depth + 1) for x in v]}
    if t is dict:
        return {"dict": [[_encode(k, depth + 1), _encode(x, depth + 1)] for k, x in v.items()]}
    if t is bytes:
        return {"bytes": v.hex()}
    if t is complex:
        return {"complex": [repr(v.real), repr(v.imag)]}
    raise TypeError("not plain data: " + t.__name__)


def _main(spec, chan, send_raw=os.write, dumps=json.dumps, encode=_encode, base=BaseException,
          kind=type, text=str, compile_=compile, exec_=exec, eval_=eval, exit_=os._exit):
    def send(record):
        data = (dumps(record) + "\n").encode()
        while data:
            data = data[send_raw(chan, data):]

    namespace = {"__name__": "solution", "__builtins__": __builtins__}
    try:
        exec_(compile_(spec["code"], "solution.py", "exec"), namespace)
    except base as exc:
        send({"load_error": kind(exc).__name__ + ": " + text(exc)[:200]})
        send({"done": len(spec["tests"])})
        exit_(0)
    for t, test in enumerate(spec["tests"]):
        if "source" in test:
            try:
                exec_(compile_(test["source"], "test_%d.py" % t, "exec"), namespace)
                ok = True
            except base:
                ok = False
            send({"test": t, "ok": ok})
            continue
        p = 0
        for step in test["steps"]:
            try:
                if "exec" in step:
                    exec_(compile_(step["exec"], "test_%d.py" % t, "exec"), namespace)
                    continue
                value = eval_(compile_(step["eval"], "test_%d.py" % t, "eval"), namespace)
                send({"test": t, "probe": p, "value": encode(value)})
            except base as exc:
                send({"test": t, "probe": p, "error": kind(exc).__name__})
                break
            p += 1
    send({"done": len(spec["tests"])})
    exit_(0)


# The records go to the original stdout; what the program prints goes to stderr.
_chan = os.dup(1)
os.dup2(2, 1)
_run, _spec = _main, spec
del _main, spec
_run(_spec, _chan)
'''

HARNESS = _base.harness(ASSERTS_MODE)  # modes io and asserts


def run_asserts(sandbox: Sandbox, code: str, plans: list[Plan], limits: Limits) -> tuple[list[bool], bool, str]:
    """Define ``code``, then run each planned test in its namespace; judge the values here.

    Returns (passed per test, timed out, load error or ""). Tests that did not get to run (a time-out
    or a crash) count as failed.
    """
    run = run_harness(sandbox, limits, {"mode": "asserts", "code": code, "tests": [p.to_spec() for p in plans]},
                      harness=HARNESS)
    passed, load_error = judge(plans, run.stdout)
    return passed, run.timed_out, load_error


def resolve(mode: str, limits: Limits) -> Sandbox:
    """The sandbox for ``reward.sandbox`` = ``auto`` | ``bwrap`` | ``none``; a UserError if it cannot run."""
    return _base.resolve(mode, limits, who="code reward", option="reward.sandbox",
                         bundled="pip install 'rlx-reward-code[sandbox]'")
