"""`rlx plot`: a PNG of two runs overlaid (a real PNG, of a sensible size, with both runs' lines drawn) and
text charts in the terminal, from the runs' metrics.jsonl."""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import pytest

from rlx.cli import plot as plot_cli
from rlx.errors import MissingDependencyError, UserError


def write_run(folder, steps: int, scale: float, with_val: bool = True) -> None:
    folder.mkdir(parents=True)
    with open(folder / "metrics.jsonl", "w") as f:
        for step in range(1, steps + 1):
            row = {"step": step, "time": 1.0 * step, "reward/mean": scale * step / steps,
                   "actor/kl_loss": 0.001 * step, "actor/entropy": 2.0 - step / steps,
                   "response_length/mean": 10.0 + step, "timing/step": 1.5, "note": "text"}
            if with_val and step % 5 == 0:
                row["val/acc"] = scale * step / steps
            f.write(json.dumps(row) + "\n")


def rlx(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlx", *args], capture_output=True, text=True, cwd=cwd, timeout=300)


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_png_of_two_runs_overlaid(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.image
    import numpy as np

    write_run(tmp_path / "a" / "run", 20, 1.0)
    write_run(tmp_path / "b" / "run", 30, 0.5)
    out = tmp_path / "curves.png"
    proc = rlx("plot", "a/run", "b/run", "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == (f"Wrote {out}: reward/mean, val/acc, actor/kl_loss, actor/entropy, "
                                   "response_length/mean, timing/step for 2 run(s).")
    width, height = png_size(out)
    assert (width, height) == (1500, 720)  # 3 x 2 panels
    assert out.stat().st_size > 20_000
    pixels = matplotlib.image.imread(out)[..., :3]
    for color in ("#1f77b4", "#ff7f0e"):  # the lines of run 1 and run 2 (matplotlib's C0 and C1)
        rgb = np.array([int(color[i:i + 2], 16) / 255 for i in (1, 3, 5)])
        assert (np.abs(pixels - rgb).max(axis=-1) < 0.02).sum() > 500, color


def test_panels_follow_the_metrics_present_and_named(tmp_path):
    write_run(tmp_path / "a", 10, 1.0, with_val=False)
    series = [plot_cli.load_series(str(tmp_path / "a"))]
    assert [m for _, m in plot_cli.choose_panels(series, None)] == [
        "reward/mean", "actor/kl_loss", "actor/entropy", "response_length/mean", "timing/step"]
    assert plot_cli.choose_panels(series, ["actor/kl_loss"]) == [("actor/kl_loss", "actor/kl_loss")]
    with pytest.raises(UserError, match=r"reward/mena\. Did you mean 'reward/mean'\?"):
        plot_cli.choose_panels(series, ["reward/mena"])
    assert "note" not in series[0]


def test_text_chart_in_the_terminal(tmp_path):
    write_run(tmp_path / "a", 120, 1.0)
    write_run(tmp_path / "b", 10, 0.5)
    proc = rlx("plot", "a", "b", "-m", "reward/mean,actor/entropy", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "reward/mean" and lines[3] == "actor/entropy"
    spark_a = lines[1].split()[1]
    assert len(spark_a) == plot_cli.TEXT_WIDTH and spark_a[0] == "▁" and spark_a[-1] == "█"
    assert lines[1].endswith("0.008333 -> 1 (min 0.008333, max 1; steps 1-120)")
    assert lines[2].split()[1] == "▁▂▃▃▄▅▆▆▇█"  # round(i / 9 * 7), i = 0..9 and lines[2].split()[0] == "b"
    assert lines[4].split()[1][0] == "█" and lines[4].split()[1][-1] == "▁"  # entropy falls


def test_sparkline_scaling():
    assert plot_cli.sparkline([]) == ""
    assert plot_cli.sparkline([3.0, 3.0]) == "▄▄"
    assert plot_cli.sparkline([0.0, 1.0, 0.5]) == "▁█▅"
    assert len(plot_cli.sparkline(list(range(1000)), width=50)) == 50


def test_errors_are_user_errors(tmp_path, monkeypatch):
    proc = rlx("plot", "missing-run", cwd=tmp_path)
    assert proc.returncode == 2 and "missing-run: no metrics.jsonl there." in proc.stderr
    assert "Traceback" not in proc.stderr
    write_run(tmp_path / "a", 3, 1.0)
    proc = rlx("plot", "a", "--out", "x.svg", cwd=tmp_path)
    assert proc.returncode == 2 and "name it *.png" in proc.stderr
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingDependencyError) as info:
        plot_cli.plot_command([str(tmp_path / "a")], out=tmp_path / "x.png", metrics=None)
    assert "pip install 'rlx[plot]'" in info.value.hint
    assert not (tmp_path / "x.png").exists()
