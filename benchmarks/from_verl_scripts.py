"""How many of verl's own launch scripts `rlx config from-verl` turns into a config rlx accepts.

    python benchmarks/from_verl_scripts.py VERL_CHECKOUT_OR_GIT_DIR [--show unmapped|refused|invalid|crash]
    python benchmarks/from_verl_scripts.py --smoke    # CI: the 19 scripts of tests/data/verl_scripts (a second)

Reads every ``examples/**.sh`` and ``recipe/**.sh`` of a verl checkout (or a bare git directory, read
at HEAD) that starts ``verl.trainer.main_ppo``, translates it as ``rlx config from-verl`` does, and
validates the result without checking that data and model files exist (they live on the script author's
machine: a model folder given by an absolute path that is not here counts as the author's, and the custom
reward file a translation's note asks for is given as the note says). Each script lands in one class:
valid; unmapped (verl keys with no rlx counterpart: the most frequent are listed); refused (a clear user
error, e.g. a script bug such as a division by a variable set only later); invalid (translated, but rlx's
validation refuses the config); crash (any other exception: a bug). Variables a script takes from its
caller and does not default are given a placeholder value, as a user running the script would set them
(only those: a variable the script defaults, ``${VAR:-default}``, keeps its default): 1 for a count, a
path for a path, ``True`` for a ``use_``/``enable_`` switch, a word otherwise. ``--smoke`` reads the copies
of verl's scripts in ``tests/data/verl_scripts`` (``<folder>__<name>.sh`` for ``examples/<folder>/<name>.sh``)
instead of a checkout, and fails (exit 1) if a script crashed.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any


def scripts(verl: Path) -> dict[str, str]:
    """{path: text} of the launch scripts that start main_ppo."""
    if (verl / "HEAD").is_file() and not (verl / ".git").exists():  # a bare git directory
        names = subprocess.run(["git", "-C", str(verl), "ls-tree", "-r", "--name-only", "HEAD"],
                               capture_output=True, text=True, check=True).stdout.split()
        read = {n: subprocess.run(["git", "-C", str(verl), "show", f"HEAD:{n}"], capture_output=True,
                                  check=True).stdout.decode("utf-8", "replace")
                for n in names if n.endswith(".sh") and n.startswith(("examples/", "recipe/"))}
    else:
        read = {str(p.relative_to(verl)): p.read_text(encoding="utf-8", errors="replace")
                for top in ("examples", "recipe") for p in sorted((verl / top).rglob("*.sh"))}
    return {n: t for n, t in sorted(read.items()) if "main_ppo" in t}


CORPUS = Path(__file__).resolve().parent.parent / "tests" / "data" / "verl_scripts"


def corpus_scripts(folder: Path) -> dict[str, str]:
    """{examples/<folder>/<name>.sh: text} of the test corpus's copies (``<folder>__<name>.sh``) that start main_ppo."""
    read = {"examples/" + p.name.replace("__", "/", 1): p.read_text(encoding="utf-8", errors="replace")
            for p in sorted(folder.glob("*.sh"))}
    return {n: t for n, t in read.items() if "main_ppo" in t}


def placeholder(name: str) -> str:
    """The value a user would give a variable the script needs: a count for a size, else a path."""
    if name in ("PYTHONPATH",):
        return ""
    counts = ("NODE", "GPU", "NUM", "SIZE", "RANK", "WORLD", "TP", "PP", "SP", "EP", "CP")
    paths = ("PATH", "DIR", "FILE", "HOME", "ROOT", "MODEL", "DATA", "CKPT", "LLM")
    if any(part in name.upper() for part in counts):
        return "1"
    if name.lower().startswith(("use_", "enable_")):
        return "True"
    return f"/placeholder/{name}" if any(part in name.upper() for part in paths) else "placeholder"


_NEEDS = re.compile(r"needs ((?:\$\w+(?:, )?)+), which the script does not set")


def translate(text: str, pm: object) -> object:
    """The translation with the environment a user would run the script with: each variable the script
    reads, does not set and does not default, set to a placeholder (found one error at a time)."""
    from rlx.cli import from_verl
    from rlx.errors import UserError

    environ: dict[str, str] = {}
    while True:
        try:
            return from_verl.translate(text, pm, environ=environ)
        except UserError as exc:
            needed = _NEEDS.search(exc.message)
            names = [n for n in re.findall(r"\$(\w+)", needed.group(1))] if needed else []
            if not names or all(n in environ for n in names):
                raise
            environ.update({n: placeholder(n) for n in names})


def classify(text: str, pm: object) -> tuple[str, str]:
    from rlx.errors import UserError
    from rlx.validate import load_config

    try:
        t: Any = translate(text, pm)
    except UserError as exc:
        return "refused", exc.message
    except Exception:
        return "crash", traceback.format_exc(limit=-3)
    if t.unmapped:
        return "unmapped", "; ".join(k for k, _ in t.unmapped)
    # What the translation's notes ask the user to add on the rlx command line (a custom reward's file).
    asked = re.findall(r"add (reward\.path=\S+) to the rlx command", "\n".join(t.notes))
    try:
        load_config(pm, overrides=t.overrides() + asked, check_files=False)
    except UserError as exc:
        problems = re.findall(r"^\s*- (\S+): (.*)$", exc.message, re.M)
        if problems and all(why.startswith("no such folder") or why.startswith("no such file")
                            for _, why in problems):
            return "valid", "a model or reward folder that only the script's author has: " + exc.message
        return "invalid", exc.message
    except Exception:
        return "crash", traceback.format_exc(limit=-3)
    return "valid", ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("verl", type=Path, nargs="?", help="a verl checkout or bare git directory (not with --smoke)")
    parser.add_argument("--show", choices=["unmapped", "refused", "invalid", "crash", "valid"], action="append",
                        default=[])
    parser.add_argument("--smoke", action="store_true",
                        help="the scripts of tests/data/verl_scripts instead of a checkout; exit 1 if one crashed")
    args = parser.parse_args()
    if (args.verl is None) != args.smoke:
        parser.error("give a verl checkout, or --smoke (and no checkout)")
    from rlx.registry import get_plugin_manager

    pm = get_plugin_manager()
    found = corpus_scripts(CORPUS) if args.smoke else scripts(args.verl)
    classes: dict[str, list[tuple[str, str]]] = collections.defaultdict(list)
    for name, text in found.items():
        kind, why = classify(text, pm)
        classes[kind].append((name, why))
    keys = collections.Counter(k.split(" ")[0] for _, why in classes["unmapped"] for k in why.split("; "))
    print(f"{len(found)} scripts start main_ppo: " + ", ".join(f"{k} {len(v)}" for k, v in sorted(classes.items())))
    print("unmapped keys, most frequent first: " + ", ".join(f"{k} ({n})" for k, n in keys.most_common(25)))
    for kind in args.show:
        print(f"\n## {kind}")
        for name, why in classes[kind]:
            print(f"- {name}: " + re.sub(r"\s+", " ", why)[:400])
    if args.smoke and (not found or classes["crash"]):
        print("smoke run failed: " + ("no scripts found in " + str(CORPUS) if not found else "crashed on " +
              ", ".join(name for name, _ in classes["crash"])), file=sys.stderr)
        sys.exit(1)
    sys.exit(0)


if __name__ == "__main__":
    main()
