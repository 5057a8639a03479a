"""Checkpoints and run folders as untrusted input: damaged files are caught before they are used, a
planted pickle is refused without running, links are never followed, a resumed run's metrics.jsonl
holds each step once, and a failing logger does not lose the run."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlx.errors import UserError
from rlx.plugins.loggers.jsonl import read_metrics
from rlx.run import checkpoint

TINY = ["--preset", "tiny", "trainer.test_freq=-1", "trainer.loggers=[jsonl]", "trainer.save_hf_model=false"]


def rlx(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "rlx", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env=env)


def write_files(folder: Path) -> None:
    (folder / "actor").mkdir(parents=True)
    (folder / "actor" / "weights.bin").write_bytes(b"\x01" * 100)
    (folder / "actor" / "optim.pt").write_bytes(b"\x02" * 50)


def reseal(path: Path) -> None:
    """Rewrite the marker's manifest for the files as they are now, as an attacker who edits a copied
    run folder can: only the loading rules stand between the files and the trainer then."""
    state = json.loads((path / checkpoint.MARKER).read_text())
    state["files"] = checkpoint.manifest(path)
    (path / checkpoint.MARKER).write_text(json.dumps(state))


# -- the manifest -----------------------------------------------------------------------------------
def test_marker_records_every_file_and_verify_names_the_damaged_one(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    first = checkpoint.save(root, 1, write_files, {"loader": {"epoch": 0}})
    second = checkpoint.save(root, 2, write_files, {})
    state = checkpoint.read_state(second)
    assert set(state["files"]) == {"actor/weights.bin", "actor/optim.pt"}
    assert state["files"]["actor/weights.bin"]["size"] == 100
    assert checkpoint.verify(second) is None
    assert checkpoint.latest_verified(root) == (second, [])

    (second / "actor" / "weights.bin").write_bytes(b"\x01" * 60)  # truncated
    why = checkpoint.verify(second)
    assert why is not None and "weights.bin" in why and "60 bytes" in why
    (second / "actor" / "weights.bin").write_bytes(b"\x07" * 100)  # same size, other bytes
    assert "checksum" in (checkpoint.verify(second) or "")
    (second / "actor" / "optim.pt").unlink()
    assert "optim.pt is missing" in (checkpoint.verify(second) or "")
    path, rejected = checkpoint.latest_verified(root)
    assert path == first and [p for p, _ in rejected] == [second]


@pytest.mark.parametrize("marker", ["", "garbage{", "[1, 2]", '{"step": "2"}', '{"step": 7, "files": {}}',
                                    '{"step": 2, "format": 2}'])
def test_garbage_marker_is_not_trusted(tmp_path: Path, marker: str) -> None:
    root = tmp_path / "checkpoints"
    checkpoint.save(root, 2, write_files, {})
    (root / "global_step_2" / checkpoint.MARKER).write_text(marker)
    assert checkpoint.verify(root / "global_step_2") is not None
    assert checkpoint.latest_verified(root)[0] is None


def test_stale_temporary_link_is_removed_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / ".tmp-global_step_9-1").symlink_to(outside, target_is_directory=True)
    checkpoint.save(root, 1, write_files, {})
    assert (outside / "keep.txt").read_text() == "mine"
    assert not (root / ".tmp-global_step_9-1").exists()
    (root / "global_step_2").symlink_to(outside, target_is_directory=True)
    with pytest.raises(UserError, match="symbolic link"):
        checkpoint.save(root, 2, write_files, {})
    assert sorted(p.name for p in outside.iterdir()) == ["keep.txt"]


def test_torch_load_refuses_a_pickle_and_runs_nothing(tmp_path: Path) -> None:
    flag = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {flag}",))

    evil = tmp_path / "rng.pt"
    evil.write_bytes(pickle.dumps({"cpu": Payload()}))
    with pytest.raises(UserError, match="Refused to load"):
        checkpoint.torch_load(evil)
    assert not flag.exists()


# -- through the trainer ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2-step run with checkpoints at steps 1 and 2 (copied by each test that damages it)."""
    base = tmp_path_factory.mktemp("ckpt")
    run = base / "run"
    result = rlx("train", *TINY, "trainer.total_steps=2", "trainer.save_freq=1", f"trainer.output_dir={run}",
                 cwd=base)
    assert result.returncode == 0, result.stderr[-2000:]
    assert [p.name for p in checkpoint.list_complete(run / "checkpoints")] == ["global_step_1", "global_step_2"]
    assert {p.name for p in (run / "checkpoints" / "global_step_2" / "actor").iterdir()} == {
        "model.safetensors", "optim.pt", "rng.pt"}
    return run


def copy_run(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(src, dst, symlinks=True)
    return dst


def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(two_checkpoints: Path, tmp_path: Path) -> None:
    run = copy_run(two_checkpoints, tmp_path)
    weights = run / "checkpoints" / "global_step_2" / "actor" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    result = rlx("train", *TINY, "trainer.total_steps=3", "trainer.save_freq=1", f"trainer.output_dir={run}",
                 cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "global_step_2 cannot be trusted" in result.stderr and "model.safetensors" in result.stderr
    assert "using global_step_1 instead" in result.stderr
    assert "(step 1)" in result.stdout
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3], "steps 2-3 trained again, each logged once"


def test_no_trustworthy_checkpoint_is_a_clear_refusal(two_checkpoints: Path, tmp_path: Path) -> None:
    run = copy_run(two_checkpoints, tmp_path)
    for step in (1, 2):
        (run / "checkpoints" / f"global_step_{step}" / checkpoint.MARKER).write_text("not json")
    result = rlx("train", *TINY, "trainer.total_steps=3", f"trainer.output_dir={run}", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "none can be trusted" in result.stderr and "global_step_1" in result.stderr


def test_planted_pickle_in_a_resealed_checkpoint_is_refused(two_checkpoints: Path, tmp_path: Path) -> None:
    run = copy_run(two_checkpoints, tmp_path)
    flag = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {flag}",))

    ckpt = run / "checkpoints" / "global_step_2"
    (ckpt / "actor" / "rng.pt").write_bytes(pickle.dumps({"cpu": Payload(), "cuda": None}))
    reseal(ckpt)
    result = rlx("train", *TINY, "trainer.total_steps=3", f"trainer.output_dir={run}", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "Refused to load" in result.stderr and "rng.pt" in result.stderr
    assert not flag.exists(), "the pickle ran"


def test_missing_optimizer_state_is_not_resumed_silently(two_checkpoints: Path, tmp_path: Path) -> None:
    run = copy_run(two_checkpoints, tmp_path)
    ckpt = run / "checkpoints" / "global_step_2"
    (ckpt / "actor" / "optim.pt").unlink()
    reseal(ckpt)
    result = rlx("train", *TINY, "trainer.total_steps=3", f"trainer.output_dir={run}", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "optim.pt is missing" in result.stderr


def test_resumed_run_logs_each_step_once_with_the_uninterrupted_values(tmp_path: Path) -> None:
    """A run killed after logging step 4 but before saving it: steps 3-4 are in metrics.jsonl and samples.jsonl
    although the newest checkpoint is step 2. The resumed run drops them and logs them again."""
    straight = tmp_path / "straight"
    assert rlx("train", *TINY, "trainer.total_steps=5", f"trainer.output_dir={straight}",
               cwd=tmp_path).returncode == 0
    run = tmp_path / "run"
    first = rlx("train", *TINY, "trainer.total_steps=4", "trainer.save_freq=2", f"trainer.output_dir={run}",
                cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    shutil.rmtree(run / "checkpoints" / "global_step_4")  # as if killed between logging step 4 and saving it
    second = rlx("train", *TINY, "trainer.total_steps=5", f"trainer.output_dir={run}", cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-2000:]
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    expected = {r["step"]: r for r in read_metrics(straight)}
    for row in rows:
        for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm"):
            assert row[key] == pytest.approx(expected[row["step"]][key], rel=1e-5, abs=1e-7), (row["step"], key)
    samples = [json.loads(line)["step"] for line in (run / "samples.jsonl").read_text().splitlines()]
    assert sorted(set(samples)) == [1, 2, 3, 4, 5] and len(samples) == 2 * 5


def test_run_folder_link_is_refused_and_export_temp_link_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    linked = tmp_path / "linked"
    linked.symlink_to(outside, target_is_directory=True)
    refused = rlx("train", *TINY, "trainer.total_steps=1", f"trainer.output_dir={linked}", cwd=tmp_path)
    assert refused.returncode == 2 and "symbolic link" in refused.stderr and "Traceback" not in refused.stderr
    assert not list(outside.iterdir())

    run = tmp_path / "run"
    run.mkdir()
    (run / ".tmp-hf_model").symlink_to(outside, target_is_directory=True)
    result = rlx("train", "--preset", "tiny", "trainer.test_freq=-1", "trainer.loggers=[jsonl]",
                 "trainer.total_steps=1", "trainer.save_freq=0", f"trainer.output_dir={run}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert not list(outside.iterdir()), "the export wrote through the planted link"
    assert (run / "hf_model" / "config.json").is_file()


def test_new_run_folder_is_private_unless_asked(tmp_path: Path) -> None:
    run, shared = tmp_path / "run", tmp_path / "shared"
    for folder, extra in ((run, []), (shared, ["trainer.private_run_dir=false"])):
        result = rlx("train", *TINY, "trainer.total_steps=1", "trainer.save_freq=0", f"trainer.output_dir={folder}",
                     *extra, cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-2000:]
    assert run.stat().st_mode & 0o077 == 0
    mask = os.umask(0)
    os.umask(mask)
    assert shared.stat().st_mode & 0o777 == 0o777 & ~mask  # as any folder the user creates


def test_a_failing_logger_is_switched_off_and_the_run_goes_on(tmp_path: Path, capsys, one_thread) -> None:
    import types

    from rlx import Component, hookimpl
    from rlx.registry import PluginManager
    from rlx.trainer import Trainer
    from rlx.validate import load_config

    class Flaky:
        def __init__(self) -> None:
            self.calls = 0

        def log(self, metrics, step) -> None:
            self.calls += 1
            if step == 2:
                raise ConnectionError("dashboard unreachable")

        def log_samples(self, rows, step) -> None: ...

        def finish(self) -> None: ...

    flaky = Flaky()
    mod = types.ModuleType("flaky_logger")
    mod.rlx_loggers = hookimpl(lambda: [Component(kind="logger", name="flaky", factory=lambda o, c: flaky)])
    pm = PluginManager()
    pm.load_entry_points(strict=True, disabled=[])
    pm.register(mod, name="flaky_logger")
    run = tmp_path / "run"
    resolved = load_config(pm, preset="tiny", overrides=[
        "trainer.test_freq=-1", "trainer.save_hf_model=false", "trainer.save_freq=0", "trainer.total_steps=3",
        "trainer.loggers=[flaky,jsonl]", f"trainer.output_dir={run}"])
    Trainer(resolved, pm).fit()
    err = capsys.readouterr().err
    assert "logger 'flaky' failed in log at step 2" in err and "dashboard unreachable" in err
    assert "Still logging to: jsonl" in err
    assert flaky.calls == 2, "switched off after its failure"
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
