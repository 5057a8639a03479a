"""Running untrusted Python in a child process with limits: wall time, CPU time, memory, file size.

Each run gets a fresh temporary folder as its working directory and home, an empty environment
(``PATH`` only), Python's isolated mode (``-I``: no user site, no ``PYTHON*`` variables) and, unless
asked otherwise, no site-packages (``-S``: the standard library only). The limits are set by the
child itself before any of the untrusted code runs, with equal soft and hard values so the code
cannot raise them. The child runs in its own session and the whole process group is killed at the
wall-clock limit.

This bounds what a wrong or runaway program can cost; it is not a security boundary against code
written to escape (use a container or a VM for that). In "asserts" mode the harness keeps its tools
out of the solution's reach by ordinary means (replacing builtins, reading globals), but code that
inspects interpreter frames could still forge test results: a policy trained against this reward
should be checked for that (e.g. by running its solutions elsewhere).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

# Runs in the child. argv: limits JSON, mode ("io" or "asserts"), spec path.
HARNESS = r'''
import json, resource, sys

limits = json.loads(sys.argv[1])
for name, value in (("RLIMIT_AS", limits["memory_bytes"]), ("RLIMIT_CPU", limits["cpu_seconds"]),
                    ("RLIMIT_FSIZE", limits["file_bytes"]), ("RLIMIT_CORE", 0)):
    if value is not None and hasattr(resource, name):
        try:
            resource.setrlimit(getattr(resource, name), (value, value))
        except (ValueError, OSError):
            pass
mode, spec_path = sys.argv[2], sys.argv[3]
import os
with open(spec_path, encoding="utf-8") as f:
    spec = json.load(f)
os.remove(spec_path)  # the result file's path is known to the harness only
del f, os
if mode == "io":
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    exec(compile(spec["code"], "solution.py", "exec"), namespace)
else:
    # The harness's own tools are bound as this function's defaults before the solution runs, and
    # nothing of the harness stays in the module's globals: a solution that replaces builtins.exec
    # or looks up the result file through globals cannot make failing tests pass.
    def run_asserts(code, tests, write, run=exec, comp=compile, dumps=json.dumps, each=enumerate,
                    kind=type, text=str, base=BaseException):
        namespace = {"__name__": "solution", "__builtins__": __builtins__}
        try:
            run(comp(code, "solution.py", "exec"), namespace)
        except base as exc:
            write(dumps({"load_error": kind(exc).__name__ + ": " + text(exc)[:200]}) + "\n")
            return
        for i, test in each(tests):
            try:
                run(comp(test, "test_%d.py" % i, "exec"), namespace)
                ok = True
            except base:
                ok = False
            write(dumps({"test": i, "ok": ok}) + "\n")

    _harness = run_asserts
    del run_asserts
    _harness(spec.pop("code"), spec.pop("tests"), open(spec.pop("result"), "a", encoding="utf-8", buffering=1).write)
'''


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 5.0
    memory_mb: int = 1024
    file_mb: int = 16
    site_packages: bool = False
    python: str = sys.executable


@dataclass
class RunResult:
    returncode: int | None  # None: killed at the time limit
    stdout: str
    stderr: str
    timed_out: bool


def _command(limits: Limits, mode: str, spec: Path) -> list[str]:
    lim = {"memory_bytes": limits.memory_mb * 2**20 if limits.memory_mb else None,
           "cpu_seconds": int(limits.timeout_s) + 1, "file_bytes": limits.file_mb * 2**20}
    flags = ["-I"] if limits.site_packages else ["-I", "-S"]
    return [limits.python, *flags, "-c", HARNESS, json.dumps(lim), mode, str(spec)]


def _run(cmd: list[str], cwd: Path, stdin: str, timeout: float) -> RunResult:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(cwd), "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(stdin, timeout=timeout)
        return RunResult(proc.returncode, out, err, False)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return RunResult(None, out or "", err or "", True)


class Workdir:
    """A temporary folder removed afterwards, whatever the child left in it."""

    def __enter__(self) -> Path:
        self.path = Path(tempfile.mkdtemp(prefix="rlx-code-"))
        return self.path

    def __exit__(self, *exc: object) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def run_program(code: str, stdin: str, limits: Limits) -> RunResult:
    """Run ``code`` as a program (``__name__ == "__main__"``) with ``stdin``; capture its output."""
    with Workdir() as root:
        wd = root / "run"
        wd.mkdir()
        spec = wd / ".spec.json"
        spec.write_text(json.dumps({"code": code}), encoding="utf-8")
        return _run(_command(limits, "io", spec), wd, stdin, limits.timeout_s)


def run_asserts(code: str, tests: list[str], limits: Limits) -> tuple[list[bool], bool, str]:
    """Define ``code``, then run each test snippet in its namespace.

    Returns (passed per test, timed out, load error or ""). Tests that did not get to run (a time-out
    or a crash) count as failed.
    """
    with Workdir() as root:
        wd = root / "run"  # the child's folder; the results go next to it, not in it
        wd.mkdir()
        spec, result = wd / ".spec.json", root / f"result-{os.urandom(8).hex()}.jsonl"
        spec.write_text(json.dumps({"code": code, "tests": tests, "result": str(result)}), encoding="utf-8")
        run = _run(_command(limits, "asserts", spec), wd, "", limits.timeout_s)
        passed = [False] * len(tests)
        load_error = ""
        lines = result.read_text(encoding="utf-8").splitlines() if result.exists() else []
        for line in lines:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "load_error" in rec:
                load_error = rec["load_error"]
            elif isinstance(rec.get("test"), int) and 0 <= rec["test"] < len(tests):
                passed[rec["test"]] = bool(rec.get("ok"))
        return passed, run.timed_out, load_error
