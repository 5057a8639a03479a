"""``code``: a reward for programming tasks. The response's code is run against the row's tests.

The program is the last fenced code block of the response (```` ```python ... ``` ```` or a bare
```` ``` ````); with ``require_code_block: false`` a response without a block is run as it is. The
ground truth (a dict, or a JSON string of one) gives the tests in one of these forms:

- ``{"tests": ["assert add(1, 2) == 3", ...], "setup": "import math"}``: the program is loaded as a
  module (``__name__ != "__main__"``), then each snippet runs in its namespace (MBPP style);
- ``{"test": "def check(candidate): ...", "entry_point": "add"}``: HumanEval style, ``check(add)``;
- ``{"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}``: the program reads stdin and must print the
  expected output (trailing spaces and blank lines ignored), one process per case (APPS /
  CodeContests style);
- a plain string: the expected output of the program run without input.

Every run is a separate Python process in a bubblewrap sandbox (no network, a private filesystem,
its own PID namespace, an empty environment) with limits on wall-clock and CPU time, memory, processes,
file size, disk and output (see :mod:`rlx_reward_code.sandbox`, over rlx's :mod:`rlx.run.sandbox`);
``sandbox: none`` opts out. Assert tests are judged by the scorer on the values the program returns
(see :mod:`rlx_reward_code.probes`).
Cases run in parallel threads. The score is 1.0 when every test passes (``mode: all``) or the
fraction passed (``mode: fraction``); no code scores 0.0. Logged beside it: ``code/pass_rate``,
``code/has_code``, ``code/timeout`` and ``code/opaque`` (the fraction of a response's tests whose verdict
had to come from inside the sandbox).
"""

from __future__ import annotations

import json
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rlx import Component, hookimpl
from rlx.protocols import RewardBatch, RewardOutput

from .probes import plan
from .sandbox import Limits, Sandbox, resolve, run_asserts, run_program

__all__ = ["CodeOptions", "TestSpec", "build", "extract_code", "parse_tests", "score_one"]

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)


class CodeOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: Literal["all", "fraction"] = Field("all", description="all: 1.0 only if every test passes; fraction: "
                                                                "the fraction of tests passed.")
    time_limit_s: float = Field(5.0, gt=0, description="Wall-clock seconds per process (all assert tests share one "
                                                    "process; each stdin/stdout case gets its own).")
    memory_mb: int = Field(1024, ge=0, description="Address-space limit per process in MiB (0: none).")
    require_code_block: bool = Field(True, description="Only run code inside ``` fences; false: run a response "
                                                       "without fences as it is.")
    site_packages: bool = Field(False, description="Let the program import installed packages (default: the "
                                                   "standard library only).")
    workers: int = Field(0, ge=0, description="Processes run at the same time (0: the number of CPUs).")
    python: str | None = Field(None, description="Python interpreter to run programs with (default: rlx's own).")
    sandbox: Literal["auto", "bwrap", "none"] = Field(
        "auto", description="auto/bwrap: run programs in a bubblewrap sandbox (no network, private filesystem, own "
                            "PID namespace), and refuse to start if it cannot run. none: run them with your own "
                            "rights (they can read your files and secrets, use the network, signal the trainer).")
    processes: int = Field(16, ge=1, description="Processes and threads a program may have at once (sandboxed runs).")
    disk_mb: int = Field(64, ge=1, description="Size of the program's writable folders in MiB (sandboxed runs).")
    output_mb: float = Field(8.0, gt=0, description="Output kept per stream in MiB; a program printing more is "
                                                    "stopped and fails.")
    opaque_tests: Literal["run", "error"] = Field(
        "run", description="Tests the scorer cannot judge on returned values (loops, custom checkers) are run and "
                           "judged inside the sandbox, where a cheating program can forge them (run), or refused "
                           "as an error of the row (error).")


@dataclass
class TestSpec:
    """What to run: assert snippets, or stdin/stdout cases."""

    asserts: list[str]
    cases: list[tuple[str, str]]

    def __len__(self) -> int:
        return len(self.asserts) + len(self.cases)


def extract_code(response: str, require_block: bool = True) -> str | None:
    """The last fenced code block (preferring Python-tagged ones), else the text if blocks are optional."""
    if not isinstance(response, str):
        return None
    blocks = _FENCE.findall(response)
    python = [code for lang, code in blocks if lang.lower() in ("python", "py", "python3")]
    chosen = python or [code for lang, code in blocks if not lang]
    if chosen:
        return chosen[-1]
    if blocks:
        return blocks[-1][1]
    if require_block or not response.strip():
        return None
    return response


def parse_tests(ground_truth: Any) -> TestSpec:
    """The tests of a row's ground truth (see the module docstring); ValueError if it has none."""
    gt = ground_truth
    if isinstance(gt, (bytes, bytearray)):
        gt = gt.decode()
    if isinstance(gt, str):
        text = gt.strip()
        if text.startswith("{"):
            try:
                gt = json.loads(text)
            except json.JSONDecodeError:
                return TestSpec([], [("", gt)])
        else:
            return TestSpec([], [("", gt)])
    if not isinstance(gt, dict):
        raise ValueError(f"code reward: the ground truth must be a dict or a string, got {type(gt).__name__}")
    setup = gt.get("setup") or gt.get("test_setup_code") or ""
    if gt.get("tests") is not None or gt.get("test_list") is not None:
        tests = gt.get("tests") if gt.get("tests") is not None else gt.get("test_list")
        if isinstance(tests, str):
            tests = [tests]
        return TestSpec([f"{setup}\n{t}" if setup else str(t) for t in tests], [])
    if gt.get("test") is not None:
        entry = gt.get("entry_point")
        check = f"\ncheck({entry})" if entry else ""
        return TestSpec([f"{setup}\n{gt['test']}{check}" if setup else f"{gt['test']}{check}"], [])
    if gt.get("inputs") is not None and gt.get("outputs") is not None:
        inputs, outputs = list(gt["inputs"]), list(gt["outputs"])
        if len(inputs) != len(outputs):
            raise ValueError(f"code reward: {len(inputs)} inputs but {len(outputs)} outputs")
        return TestSpec([], [(str(i), str(o)) for i, o in zip(inputs, outputs)])
    raise ValueError(f"code reward: the ground truth has no tests (keys: {sorted(gt)}); expected 'tests', "
                     "'test' + 'entry_point', or 'inputs' + 'outputs'")


def _same_output(got: str, expected: str) -> bool:
    def norm(text: str) -> list[str]:
        return [line.rstrip() for line in text.strip("\n").splitlines()]

    return norm(got) == norm(expected)


def limits_of(opts: CodeOptions) -> Limits:
    return Limits(timeout_s=opts.time_limit_s, memory_mb=opts.memory_mb, disk_mb=opts.disk_mb,
                  processes=opts.processes, output_mb=opts.output_mb, site_packages=opts.site_packages,
                  python=opts.python or sys.executable)


def score_one(response: str, ground_truth: Any, opts: CodeOptions, pool: ThreadPoolExecutor | None = None,
              sandbox: Sandbox | None = None) -> tuple[float, float, bool, bool, float]:
    """``(score, pass rate, has code, timed out, opaque fraction)`` for one response."""
    spec = parse_tests(ground_truth)
    plans = [plan(t) for t in spec.asserts]
    opaque = sum(p.opaque for p in plans)
    if opaque and opts.opaque_tests == "error":
        first = next(p.source for p in plans if p.opaque)
        raise ValueError("code reward: a test cannot be judged on returned values (opaque_tests=error): "
                         f"{(first or '')[:200]!r}")
    code = extract_code(response, opts.require_code_block)
    if code is None or len(spec) == 0:
        return 0.0, 0.0, code is not None, False, 0.0
    limits = limits_of(opts)
    box = sandbox or resolve(opts.sandbox, limits)
    passed: list[bool] = []
    timed_out = False
    if plans:
        results, timed_out, _ = run_asserts(box, code, plans, limits)
        passed.extend(results)
    if spec.cases:
        def case(c: tuple[str, str]) -> tuple[bool, bool]:
            run = run_program(box, code, c[0], limits)
            return run.returncode == 0 and _same_output(run.stdout, c[1]), run.timed_out

        outcomes = list(pool.map(case, spec.cases)) if pool is not None else [case(c) for c in spec.cases]
        passed.extend(ok for ok, _ in outcomes)
        timed_out = timed_out or any(t for _, t in outcomes)
    rate = sum(passed) / len(passed)
    value = rate if opts.mode == "fraction" else float(all(passed))
    return value, rate, True, timed_out, opaque / len(spec)


def build(options: CodeOptions | None, ctx: Any) -> Any:
    opts = options or CodeOptions()
    workers = opts.workers or os.cpu_count() or 1
    sandbox = resolve(opts.sandbox, limits_of(opts))  # before training starts: no sandbox, no run

    def code_reward(batch: RewardBatch) -> RewardOutput:
        with ThreadPoolExecutor(max_workers=workers) as responses, ThreadPoolExecutor(max_workers=workers) as cases:
            results = list(responses.map(lambda pair: score_one(pair[0], pair[1], opts, cases, sandbox),
                                         zip(batch.responses, batch.ground_truths)))
        return RewardOutput([r[0] for r in results], {
            "code/pass_rate": [r[1] for r in results],
            "code/has_code": [float(r[2]) for r in results],
            "code/timeout": [float(r[3]) for r in results],
            "code/opaque": [r[4] for r in results],
        })

    return code_reward


@hookimpl
def rlx_rewards() -> list[Component]:
    return [Component(kind="reward", name="code", factory=build, config_model=CodeOptions,
                      summary="Runs the response's code against the row's tests (asserts or stdin/stdout) in a "
                              "bubblewrap sandbox.")]
