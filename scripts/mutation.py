#!/usr/bin/env python
"""Mutation testing of rlx's core modules with mutmut 3 (https://github.com/boxed/mutmut).

    pip install 'mutmut==3.8.1'
    python scripts/mutation.py                      # every module below, 2 workers
    python scripts/mutation.py checkpoint jsonl     # some modules
    python scripts/mutation.py --jobs 1 --list      # what would run

The working tree is never touched. mutmut derives module names from file paths, and rlx's folders
(``core/`` = ``rlx``, ``plugins/`` = ``rlx.plugins``, ``cli/`` = ``rlx.cli``) are mapped with
setuptools ``package-dir``, so each module is tested in a scratch folder (``--workdir``, default
``/tmp/rlx-mutation/<module>``) holding the package in its import layout (``rlx/``,
``rlx/plugins/``, ``rlx/cli/``) and a copy of ``tests/``. mutmut's own config is written there as
``setup.cfg``, so the project needs no mutmut section. mutmut puts its ``mutants/`` copy first on
``sys.path``, ahead of the editable install's finder, so the tests import the mutated package, and
entry points (resolved by import name) load the mutated plugins.

Each module is run against a targeted, fast selection of tests (``MODULES``): mutmut first records
which tests reach which function, then runs only those against each mutant. Results per module are
printed as a table (killed / timeout / survived / no tests / not run) and written to
``<workdir>/report.json``, every mutant not killed with the lines it changed to ``<workdir>/survivors.md``;
``--survivors`` also prints their full diffs. ``--budget SECONDS`` bounds each module's run (mutmut tests
the mutants with the fastest tests first; the rest are reported as not run), ``--only PATTERN`` restricts a
module to some functions, ``--rev REV`` tests a commit instead of the working tree.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# import-layout folder in the scratch copy -> folder in the repository
LAYOUT = {"rlx": "core", "rlx/plugins": "plugins", "rlx/cli": "cli"}


@dataclass(frozen=True)
class Module:
    path: str  # in the repository
    tests: tuple[str, ...]  # pytest selection (paths, node ids, -k/-m options)


MODULES: dict[str, Module] = {
    "functional": Module("plugins/algorithms/functional.py",
                         ("tests/plugins/algorithms/test_functional.py",
                          "tests/plugins/algorithms/test_loss_accumulation.py",
                          "tests/plugins/algorithms/test_algorithms.py")),
    "estimators": Module("plugins/algorithms/estimators.py",
                         ("tests/plugins/algorithms/test_estimator_wiring.py",
                          "tests/plugins/algorithms/test_functional.py",
                          "tests/plugins/algorithms/test_algorithms.py")),
    "checkpoint": Module("core/run/checkpoint.py", (
        "tests/core/test_checkpoint_completeness.py",
        "tests/core/test_trainer.py::test_checkpoint_write_failure_leaves_no_partial_checkpoint",
        # the in-process tests of test_checkpoint_safety.py (the others run `rlx train` in a subprocess,
        # which imports the installed, unmutated package)
        "tests/core/test_checkpoint_safety.py::test_marker_records_every_file_and_verify_names_the_damaged_one",
        "tests/core/test_checkpoint_safety.py::test_garbage_marker_is_not_trusted",
        "tests/core/test_checkpoint_safety.py::test_stale_temporary_link_is_removed_not_followed",
        "tests/core/test_checkpoint_safety.py::test_torch_load_refuses_a_pickle_and_runs_nothing")),
    "jsonl": Module("plugins/loggers/jsonl.py", ("tests/plugins/loggers/test_loggers.py",
                                                 "tests/plugins/loggers/test_logger_contract.py")),
    "console": Module("plugins/loggers/console.py", ("tests/plugins/loggers/test_loggers.py",
                                                     "tests/plugins/loggers/test_logger_contract.py")),
    "reward_runner": Module("core/run/rewards.py", ("tests/core/test_reward_runner_checks.py",
                                                      "tests/core/test_reward_robustness.py", "-m", "not slow")),
    "trainer": Module("core/trainer.py", ("tests/core/test_wiring.py", "tests/core/test_trainer_surface.py",
                                          "tests/core/test_checkpoint_completeness.py",
                                          "tests/cli/test_export.py",
                                          "tests/plugins/algorithms/test_algorithms_trainer.py",
                                          "-m", "not slow")),
}

# The console script, not ``python -m mutmut``: that would put the scratch folder, which holds the
# unmutated package, first on sys.path.
MUTMUT = str(Path(sys.executable).with_name("mutmut"))
STATUSES = ("killed", "survived", "timeout", "suspicious", "no tests", "skipped", "caught by type check",
            "segfault", "not checked")


# mutmut runs pytest several times in one process (statistics, the clean run, then forks of that
# process per mutant), so module-level state of a test module (a threading.Event set at the end of its
# tests, say) would leak from one session into the next. This plugin makes each session import the
# test modules afresh, as a separate pytest process would.
FRESH_PLUGIN = "rlx_mutation_fresh_tests"
FRESH_PLUGIN_SOURCE = '''"""Written by scripts/mutation.py: every pytest session imports the test modules afresh."""
import sys


def pytest_sessionstart(session):
    for name in [n for n in sys.modules if n.rpartition(".")[2].startswith("test_") or n == "conftest"]:
        del sys.modules[name]
'''


def import_path(repo_path: str) -> str:
    """``plugins/loggers/jsonl.py`` -> ``rlx/plugins/loggers/jsonl.py``."""
    for target, source in sorted(LAYOUT.items(), key=lambda kv: -len(kv[1])):
        if repo_path.startswith(source + "/"):
            return target + repo_path[len(source):]
    raise ValueError(f"{repo_path} is not in {sorted(LAYOUT.values())}")


def source_tree(root: Path, rev: str | None) -> Path:
    """The files to test: the working tree, or (``--rev``) a commit exported with ``git archive``, which
    cannot catch a file half-way through someone's edit."""
    if rev is None:
        return REPO
    out = root / f"src-{rev.replace('/', '_')}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "core", "plugins", "cli", "tests",
                              "pyproject.toml"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out


def prepare(src: Path, work: Path, module: Module) -> None:
    """A fresh scratch folder: the package in import layout, the tests, and mutmut's setup.cfg."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(src / "core", work / "rlx", ignore=ignore)
    shutil.copytree(src / "plugins", work / "rlx" / "plugins", ignore=ignore)
    shutil.copytree(src / "cli", work / "rlx" / "cli", ignore=ignore)
    shutil.copytree(src / "tests", work / "tests", ignore=ignore)
    (work / f"{FRESH_PLUGIN}.py").write_text(FRESH_PLUGIN_SOURCE)
    selection = "\n    ".join(module.tests)
    (work / "setup.cfg").write_text(
        "[mutmut]\n"
        "source_paths = rlx\n"
        f"only_mutate = {import_path(module.path)}\n"
        f"also_copy =\n    tests\n    {FRESH_PLUGIN}.py\n"
        f"pytest_add_cli_args_test_selection =\n    {selection}\n"
        f"pytest_add_cli_args =\n    -p\n    no:cacheprovider\n    -p\n    {FRESH_PLUGIN}\n    -q\n"
        # The tiny-model tests take seconds; a mutant that makes them loop is cut at 10x their time.
        "timeout_multiplier = 5.0\n"
        "timeout_constant = 5.0\n")
    undecorate(work / import_path(module.path))
    # pytest in the scratch folder reads the project's pytest/ruff settings from a copy.
    shutil.copy(src / "pyproject.toml", work / "pyproject.toml")
    text = (work / "pyproject.toml").read_text()
    if "[tool.mutmut]" in text:
        raise SystemExit("pyproject.toml has a [tool.mutmut] section, which would override this script's config")


def undecorate(path: Path) -> int:
    """Rewrite ``@dec`` + ``def f`` at module level as ``def f`` + ``f = dec(f)`` (the same code):
    mutmut leaves decorated functions alone, and the advantage estimators are all decorated.
    ``@hookimpl`` registration functions are left as they are. Returns how many were rewritten."""
    source = path.read_text()
    lines = source.splitlines(keepends=True)
    done = 0
    nodes = [n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.decorator_list]
    for node in sorted(nodes, key=lambda n: -n.lineno):
        decorators = [ast.get_source_segment(source, d) or "" for d in node.decorator_list]
        if "hookimpl" in decorators:
            continue
        wrapped = node.name
        for d in reversed(decorators):
            wrapped = f"({d})({wrapped})"
        assert node.end_lineno is not None
        lines.insert(node.end_lineno, f"{node.name} = {wrapped}\n")
        first = node.decorator_list[0].lineno - 1
        del lines[first:node.lineno - 1]
        done += 1
    path.write_text("".join(lines))
    return done


def failing_tests(work: Path, module: Module, env: dict[str, str]) -> list[str]:
    """The selected tests that fail on the unmutated copy. mutmut refuses to start when a test fails
    before any mutation; such tests are deselected (and reported), since they cannot tell a mutant
    from the original anyway."""
    # ``python -m pytest`` in the scratch folder imports the unmutated copy (the folder is on sys.path).
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", *module.tests],
                          cwd=work, env=env, capture_output=True, text=True)
    failed = []
    for line in proc.stdout.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            failed.append(line.split(" ", 2)[1])
    if proc.returncode not in (0, 1) and not failed:
        raise SystemExit(f"the test selection does not run in {work}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return failed


def parse_results(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        name, sep, status = line.strip().rpartition(": ")
        if sep and status in STATUSES:
            out[name] = status
    return out


def run_module(name: str, module: Module, src: Path, root: Path, jobs: int, show: bool, budget: float | None,
               patterns: list[str]) -> dict[str, object]:
    work = root / name
    prepare(src, work, module)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", RLX_TEST_CACHE=str(root / "cache"),
               PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTHONPATH", None)
    deselected = failing_tests(work, module, env)
    if deselected:
        cfg = (work / "setup.cfg").read_text()
        extra = "".join(f"    --deselect\n    {t}\n" for t in deselected)
        (work / "setup.cfg").write_text(cfg.replace("pytest_add_cli_args =\n", "pytest_add_cli_args =\n" + extra))
        print(f"   deselected (failing before any mutation): {deselected}", flush=True)
    log = work / "mutmut-run.log"
    start = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen([MUTMUT, "run", "--max-children", str(jobs), *patterns], cwd=work, env=env,
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            # mutmut stops on Ctrl-C and keeps every result so far; the rest stay "not checked"
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    seconds = time.monotonic() - start
    listing = subprocess.run([MUTMUT, "results", "--all", "true"], cwd=work, env=env,
                             capture_output=True, text=True)
    results = parse_results(listing.stdout)
    counts = {s: sum(1 for v in results.values() if v == s) for s in STATUSES}
    # Every generated mutant counts, those no selected test reaches ("no tests") as not killed.
    tested = len(results) - counts["skipped"] - counts["not checked"]
    report: dict[str, object] = {
        "module": module.path, "mutants": len(results), "seconds": round(seconds, 1), "exit_code": proc.returncode,
        "counts": {k: v for k, v in counts.items() if v},
        # a timeout means the mutant made the tests hang: the tests noticed, it counts as killed
        "kill_rate": round((counts["killed"] + counts["timeout"]) / tested, 4) if tested else None,
        "not_checked": counts["not checked"],
        "survivors": sorted(k for k, v in results.items() if v in ("survived", "no tests", "suspicious")),
        "deselected": deselected,
        "log": str(log),
    }
    if proc.returncode != 0 and not results:
        print(f"{name}: mutmut failed (exit {proc.returncode}); last lines of {log}:")
        print("\n".join(log.read_text(errors="replace").splitlines()[-30:]))
    changes: dict[str, list[str]] = {}
    for mutant in report["survivors"]:  # type: ignore[union-attr]
        diff = subprocess.run([MUTMUT, "show", mutant], cwd=work, env=env, capture_output=True, text=True).stdout
        changes[mutant] = [line for line in diff.splitlines()
                           if line[:2] in ("- ", "+ ") and not line.startswith(("--- ", "+++ "))]
        if show:
            print(f"--- {mutant} ({results[mutant]})\n{diff}")
    report["survivor_changes"] = changes
    return report


def write_markdown(reports: dict[str, dict[str, object]], path: Path, rev: str) -> None:
    """Every surviving mutant with the lines it changed, one section per module."""
    out = [f"# Surviving mutants ({rev})", ""]
    for name, r in reports.items():
        changes: dict[str, list[str]] = r["survivor_changes"]  # type: ignore[assignment]
        out += [f"## {name} ({r['module']}): {len(changes)} not killed", ""]
        for mutant, lines in changes.items():
            short = mutant.rsplit(".", 1)[-1]
            body = " / ".join(line.strip() for line in lines) or "(no textual change shown)"
            out.append(f"- `{short}`: `{body.replace('`', chr(39))}`")
        out.append("")
    path.write_text("\n".join(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("modules", nargs="*", help="default: all of " + ", ".join(MODULES))
    parser.add_argument("--jobs", type=int, default=2, help="mutants tested at once (default 2)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/rlx-mutation"))
    parser.add_argument("--budget", type=float, help="seconds per module; mutants not reached by then are "
                        "reported as 'not checked' (mutmut tests the fastest first)")
    parser.add_argument("--only", nargs="*", default=[], metavar="PATTERN",
                        help="mutmut mutant-name patterns to test, e.g. 'rlx.trainer.x_ppo_update*' "
                        "(one module at a time)")
    parser.add_argument("--rev", help="test this commit (git archive) instead of the working tree")
    parser.add_argument("--survivors", action="store_true", help="print the diff of every surviving mutant")
    parser.add_argument("--list", action="store_true", help="print the modules and test selections, run nothing")
    args = parser.parse_args()
    names = args.modules or list(MODULES)
    unknown = sorted(set(names) - set(MODULES))
    if unknown:
        parser.error(f"unknown modules {unknown}; choose from {', '.join(MODULES)}")
    if args.list:
        for n in names:
            print(f"{n:14} {MODULES[n].path:38} {' '.join(MODULES[n].tests)}")
        return
    try:
        import mutmut  # noqa: F401
    except ImportError:
        raise SystemExit("mutmut is not installed: pip install 'mutmut==3.8.1'") from None
    args.workdir.mkdir(parents=True, exist_ok=True)
    reports = {}
    total_start = time.monotonic()
    src = source_tree(args.workdir, args.rev)
    for n in names:
        print(f"== {n}: {MODULES[n].path}", flush=True)
        reports[n] = run_module(n, MODULES[n], src, args.workdir, args.jobs, args.survivors, args.budget,
                                args.only)
        r = reports[n]
        print(f"   {r['mutants']} mutants, {r['counts']}, kill rate {r['kill_rate']}, {r['seconds']} s", flush=True)
        for s in r["survivors"]:  # type: ignore[union-attr]
            print(f"   survived: {s}")
    (args.workdir / "report.json").write_text(json.dumps(reports, indent=2))
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", args.rev or "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    write_markdown(reports, args.workdir / "survivors.md",
                   f"commit {head}" if args.rev else f"working tree on commit {head}")
    print(f"\n{'module':14} {'mutants':>7} {'killed':>6} {'timeout':>7} {'survived':>8} {'no tests':>8} "
          f"{'not run':>7} {'kill rate':>9} {'seconds':>8}")
    for n, r in reports.items():
        c: dict[str, int] = r["counts"]  # type: ignore[assignment]
        print(f"{n:14} {r['mutants']:>7} {c.get('killed', 0):>6} {c.get('timeout', 0):>7} {c.get('survived', 0):>8} "
              f"{c.get('no tests', 0):>8} {c.get('not checked', 0):>7} {r['kill_rate']!s:>9} {r['seconds']:>8}")
    print(f"total {time.monotonic() - total_start:.0f} s; report: {args.workdir / 'report.json'}")


if __name__ == "__main__":
    main()
