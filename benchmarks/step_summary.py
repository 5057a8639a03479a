"""One line per grpo_vs_trl.py results.json: its folder's name and the step, generation and update times and peak
memory (the probe scripts' summary).

    python3 benchmarks/step_summary.py OUT/fast_off/results.json OUT/fast_on/results.json ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

KEYS = ("timing/step", "timing/gen", "timing/update_actor", "/peak_gib")


def main(paths: list[str]) -> None:
    for path in map(Path, paths):
        if not path.is_file():
            print(path.parent.name, "no results")
            continue
        r = json.loads(path.read_text())
        keys = [k for k in r if any(s in k for s in KEYS) and "peak_gib/" not in k and "first" not in k]
        print(path.parent.name, {k: round(r[k], 3) for k in keys if isinstance(r[k], (int, float))})


if __name__ == "__main__":
    main(sys.argv[1:])
