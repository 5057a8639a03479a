"""What the sandbox costs per program: the same programs scored with reward.sandbox=bwrap and =none.

    python contrib/rlx-reward-code/benchmarks/sandbox_overhead.py [--n 50]

Programs run one at a time (no parallelism), alternating between the two modes so that load from other
processes on the machine hits both alike. Prints the wall time per program (median, mean, p90) per mode and
the difference.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlx_reward_code import CodeOptions, limits_of, score_one
from rlx_reward_code.sandbox import resolve

JOBS = {
    "stdin/stdout": ("```python\na, b = map(int, input().split())\nprint(a + b)\n```", {"inputs": ["1 2\n"],
                                                                                      "outputs": ["3"]}),
    "asserts": ("```python\ndef add(a, b):\n    return a + b\n```",
                {"tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]}),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=50, help="programs per mode and job")
    args = parser.parse_args()
    modes = ("bwrap", "none")
    for name, (response, truth) in JOBS.items():
        times: dict[str, list[float]] = {m: [] for m in modes}
        # Resolved (and checked) once, as build() does; one warm-up run each.
        boxes = {m: resolve(m, limits_of(CodeOptions(sandbox=m))) for m in modes}
        for mode in modes:
            assert score_one(response, truth, CodeOptions(sandbox=mode), sandbox=boxes[mode])[0] == 1.0
        for _ in range(args.n):
            for mode in modes:
                opts = CodeOptions(sandbox=mode, workers=1)
                start = time.perf_counter()
                value = score_one(response, truth, opts, sandbox=boxes[mode])[0]
                times[mode].append(time.perf_counter() - start)
                assert value == 1.0
        print(f"{name}: {args.n} programs per mode")
        for mode in modes:
            t = sorted(times[mode])
            print(f"  {mode:6s} median {1e3 * statistics.median(t):6.1f} ms  mean {1e3 * statistics.fmean(t):6.1f} ms"
                  f"  p90 {1e3 * t[int(0.9 * (len(t) - 1))]:6.1f} ms")
        diff = statistics.median(times["bwrap"]) - statistics.median(times["none"])
        print(f"  sandbox overhead (median difference): {1e3 * diff:.1f} ms per program")


if __name__ == "__main__":
    main()
