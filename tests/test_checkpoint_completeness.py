"""Only complete checkpoints are ever resumed from: folders without their ``COMPLETE`` marker,
left-over temporary folders (even one whose marker was written before a kill stopped the rename) and
names that are not ``global_step_<int>`` are never used, by the checkpoint module or by the trainer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rlx import checkpoint
from rlx.errors import UserError
from rlx.registry import PluginManager
from rlx.trainer import Trainer
from rlx.validate import load_config

QUIET = ["trainer.test_freq=-1", "trainer.loggers=[]", "trainer.save_hf_model=false", "trainer.log_samples=0",
         "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=2"]


def write_weights(folder: Path) -> None:
    (folder / "actor").mkdir(parents=True)
    (folder / "actor" / "model.safetensors").write_bytes(b"weights")


def plant_incomplete(root: Path, like: Path) -> list[Path]:
    """Folders that look like checkpoints but are not complete ones, copied from the complete ``like``:
    a newer step without its marker, a temporary folder whose marker was written (killed before the
    rename), a temporary folder of an older-style name, and a non-numeric step with a marker."""
    no_marker = root / f"{checkpoint.PREFIX}90"
    shutil.copytree(like, no_marker)
    (no_marker / checkpoint.MARKER).unlink()
    tmp_with_marker = root / f".tmp-{checkpoint.PREFIX}95-4242"
    shutil.copytree(like, tmp_with_marker)
    state = json.loads((tmp_with_marker / checkpoint.MARKER).read_text())
    (tmp_with_marker / checkpoint.MARKER).write_text(json.dumps({**state, "step": 95}))
    tmp_old = root / f".tmp-old-{checkpoint.PREFIX}97-4242"
    shutil.copytree(like, tmp_old)
    odd_name = root / f"{checkpoint.PREFIX}99b"
    shutil.copytree(like, odd_name)
    return [no_marker, tmp_with_marker, tmp_old, odd_name]


def test_module_never_lists_an_incomplete_folder(tmp_path):
    root = tmp_path / "checkpoints"
    checkpoint.save(root, 3, write_weights, {"loader": {"epoch": 0, "index": 3}})
    planted = plant_incomplete(root, root / f"{checkpoint.PREFIX}3")
    assert [p.name for p in checkpoint.list_complete(root)] == [f"{checkpoint.PREFIX}3"]
    assert checkpoint.latest(root) == root / f"{checkpoint.PREFIX}3"
    assert checkpoint.latest_verified(root) == (root / f"{checkpoint.PREFIX}3", [])
    # The next save clears the temporary folders and keeps only complete checkpoints when pruning.
    checkpoint.save(root, 4, write_weights, {}, keep=1)
    assert not planted[1].exists() and not planted[2].exists()
    assert [p.name for p in checkpoint.list_complete(root)] == [f"{checkpoint.PREFIX}4"]
    assert planted[0].exists() and planted[3].exists(), "pruning removes complete checkpoints only"


def test_marker_is_written_after_every_other_file(tmp_path):
    """While the checkpoint's files are written, neither the marker nor the final folder exists."""
    root = tmp_path / "checkpoints"
    seen = {}

    def write(folder: Path) -> None:
        write_weights(folder)
        seen["marker"] = (folder / checkpoint.MARKER).exists()
        seen["final"] = (root / f"{checkpoint.PREFIX}1").exists()
        seen["listed"] = checkpoint.list_complete(root)

    final = checkpoint.save(root, 1, write, {"loader": {"epoch": 0, "index": 1}})
    assert seen == {"marker": False, "final": False, "listed": []}
    state = checkpoint.read_state(final)
    assert state["step"] == 1 and state["loader"] == {"epoch": 0, "index": 1}
    assert checkpoint.verify(final) is None
    assert list(root.iterdir()) == [final], "no temporary folder is left behind"


# ---------------------------------------------------------------------------------------------
def make_trainer(out: Path, *overrides: str) -> Trainer:
    pm = PluginManager()
    pm.load_entry_points(strict=False, disabled=[])
    return Trainer(load_config(pm, preset="tiny", overrides=[*QUIET, f"trainer.output_dir={out}", *overrides]), pm)


@pytest.fixture(scope="module")
def one_step_run(tmp_path_factory) -> Path:
    """A run folder holding the complete checkpoint of step 1."""
    out = tmp_path_factory.mktemp("one_step") / "run"
    make_trainer(out, "trainer.total_steps=1").fit()
    assert [p.name for p in checkpoint.list_complete(out / "checkpoints")] == [f"{checkpoint.PREFIX}1"]
    return out


def test_trainer_resumes_from_the_complete_checkpoint_only(one_step_run, tmp_path, one_thread, capsys):
    out = tmp_path / "run"
    shutil.copytree(one_step_run, out)
    root = out / "checkpoints"
    plant_incomplete(root, root / f"{checkpoint.PREFIX}1")
    t = make_trainer(out, "trainer.total_steps=2")
    assert t.resume_from == root / f"{checkpoint.PREFIX}1"
    t.fit()
    assert t.step == 2
    assert "(step 1)" in capsys.readouterr().out
    assert checkpoint.latest(root) == root / f"{checkpoint.PREFIX}2"


def test_only_incomplete_checkpoints_is_a_fresh_start_not_a_resume(one_step_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(one_step_run, out)
    root = out / "checkpoints"
    plant_incomplete(root, root / f"{checkpoint.PREFIX}1")
    shutil.rmtree(root / f"{checkpoint.PREFIX}1")
    with pytest.raises(UserError, match="no complete checkpoint"):
        make_trainer(out, "trainer.total_steps=2", "trainer.resume=must")
    t = make_trainer(out, "trainer.total_steps=1")
    assert t.resume_from is None
    assert make_trainer(out, "trainer.total_steps=1", "trainer.resume=never").resume_from is None
