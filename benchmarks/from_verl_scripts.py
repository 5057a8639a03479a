"""How many of verl's own launch scripts `rlx config from-verl` turns into a config rlx accepts.

    python benchmarks/from_verl_scripts.py VERL_CHECKOUT_OR_GIT_DIR [--show unmapped|refused|invalid|crash]

Reads every ``examples/**.sh`` and ``recipe/**.sh`` of a verl checkout (or a bare git directory, read
at HEAD) that starts ``verl.trainer.main_ppo``, translates it as ``rlx config from-verl`` does, and
validates the result without checking that data and model files exist (they live on the script author's
machine). Each script lands in one class: valid; unmapped (verl keys with no rlx counterpart: the most
frequent are listed); refused (a clear user error, e.g. a variable the script needs from its caller);
invalid (translated, but rlx's validation refuses the config); crash (any other exception: a bug).
Variables a script takes from its caller and does not default are given a placeholder value, as a user
running the script would set them.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import traceback
from pathlib import Path


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


class Placeholders(dict):
    """The environment a user would run a script with: any variable the script reads is set."""

    def get(self, key: str, default: object = None) -> str:
        if key in ("PYTHONPATH",):
            return ""
        counts = ("NODE", "GPU", "NUM", "SIZE", "RANK", "WORLD", "TP", "PP", "SP", "EP", "CP")
        return "1" if any(part in key.upper() for part in counts) else f"/placeholder/{key}"

    def __contains__(self, key: object) -> bool:
        return True

    def __getitem__(self, key: str) -> str:
        return self.get(key)


def classify(text: str, pm: object) -> tuple[str, str]:
    from rlx.cli import from_verl
    from rlx.errors import UserError
    from rlx.validate import load_config

    try:
        t = from_verl.translate(text, pm, environ=Placeholders())
    except UserError as exc:
        return "refused", exc.message
    except Exception:
        return "crash", traceback.format_exc(limit=-3)
    if t.unmapped:
        return "unmapped", "; ".join(k for k, _ in t.unmapped)
    try:
        load_config(pm, overrides=t.overrides(), check_files=False)
    except UserError as exc:
        return "invalid", exc.message
    except Exception:
        return "crash", traceback.format_exc(limit=-3)
    return "valid", ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("verl", type=Path)
    parser.add_argument("--show", choices=["unmapped", "refused", "invalid", "crash", "valid"], action="append",
                        default=[])
    args = parser.parse_args()
    from rlx.registry import get_plugin_manager

    pm = get_plugin_manager()
    found = scripts(args.verl)
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
    sys.exit(0)


if __name__ == "__main__":
    main()
