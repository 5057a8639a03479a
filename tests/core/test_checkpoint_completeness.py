"""Only complete checkpoints are ever resumed from: folders without their ``COMPLETE`` marker,
left-over temporary folders (even one whose marker was written before a kill stopped the rename) and
names that are not ``global_step_<int>`` are never used, by the checkpoint module or by the trainer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rlx.errors import UserError
from rlx.registry import PluginManager
from rlx.run import checkpoint
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


# ---------------------------------------------------------------------------------------------
# The folder helpers under the checkpoints (gaps found by scripts/mutation.py)
def test_pruning_keeps_exactly_the_newest_complete_checkpoints(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4):
        checkpoint.save(root, step, write_weights, {}, keep=2)
    assert [p.name for p in checkpoint.list_complete(root)] == [f"{checkpoint.PREFIX}3", f"{checkpoint.PREFIX}4"]


def test_saving_a_step_again_replaces_it_whole(tmp_path):
    """A second save of one step (a run resumed from it that saves it again) replaces the folder: the
    new files only, a fresh marker, and no temporary or set-aside folder left behind."""
    root = tmp_path / "checkpoints"
    checkpoint.save(root, 2, write_weights, {"loader": {"epoch": 0, "index": 1}})
    (root / f"{checkpoint.PREFIX}2" / "stale.txt").write_text("from the first save")

    def write_new(folder: Path) -> None:
        write_weights(folder)
        (folder / "actor" / "model.safetensors").write_bytes(b"new weights")

    final = checkpoint.save(root, 2, write_new, {"loader": {"epoch": 0, "index": 2}})
    assert final == root / f"{checkpoint.PREFIX}2"
    assert not (final / "stale.txt").exists()
    assert (final / "actor" / "model.safetensors").read_bytes() == b"new weights"
    state = checkpoint.read_state(final)
    assert state["loader"] == {"epoch": 0, "index": 2} and state["format"] == checkpoint.FORMAT
    assert checkpoint.verify(final) is None
    assert sorted(p.name for p in root.iterdir()) == [f"{checkpoint.PREFIX}2"]


def test_replace_dir_swaps_a_folder_and_cleans_set_aside_copies(tmp_path):
    final, tmp = tmp_path / "hf_model", tmp_path / ".tmp-hf_model"
    final.mkdir()
    (final / "old").write_text("old")
    left_over = tmp_path / ".tmp-old-hf_model-1"  # from a kill between the two renames
    left_over.mkdir()
    tmp.mkdir()
    (tmp / "new").write_text("new")
    checkpoint.replace_dir(tmp, final)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf_model"]
    assert [p.name for p in final.iterdir()] == ["new"]


def test_remove_tree_of_a_missing_path_is_a_no_op(tmp_path):
    checkpoint.remove_tree(tmp_path / "never-created")
    checkpoint.remove_tree(tmp_path / "never-created" / "file")
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep").write_text("x")
    link = tmp_path / "link"
    link.symlink_to(target)
    checkpoint.remove_tree(link)
    assert not link.exists() and (target / "keep").is_file(), "a link is removed, never its target"
    checkpoint.remove_tree(target)
    assert not target.exists()


def test_make_dir_creates_parents_private_folders_and_refuses_links_and_files(tmp_path):
    import stat

    deep = tmp_path / "a" / "b" / "run"
    checkpoint.make_dir(deep, private=True)
    assert deep.is_dir() and stat.S_IMODE(deep.stat().st_mode) == 0o700
    shared = tmp_path / "shared"
    checkpoint.make_dir(shared)
    assert stat.S_IMODE(shared.stat().st_mode) != 0o700
    checkpoint.make_dir(deep, private=False)  # an existing folder is left as it is
    assert stat.S_IMODE(deep.stat().st_mode) == 0o700
    link = tmp_path / "link"
    link.symlink_to(deep)
    with pytest.raises(UserError, match="symbolic link") as exc:
        checkpoint.make_dir(link)
    assert "Remove the link" in (exc.value.hint or "")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(UserError, match="not a folder") as exc:
        checkpoint.make_dir(a_file)
    assert "Move it away" in (exc.value.hint or "")


def test_latest_of_an_empty_or_missing_folder_is_none(tmp_path):
    assert checkpoint.latest(tmp_path / "missing") is None
    (tmp_path / "empty").mkdir()
    assert checkpoint.latest(tmp_path / "empty") is None
    assert checkpoint.latest_verified(tmp_path / "empty") == (None, [])


def _sealed(tmp_path: Path, marker: dict) -> Path:
    folder = tmp_path / "checkpoints" / f"{checkpoint.PREFIX}5"
    write_weights(folder)
    (folder / checkpoint.MARKER).write_text(json.dumps(marker))
    return folder


@pytest.mark.parametrize(("files", "problem"), [
    ({}, "no valid file manifest"),
    ([], "no valid file manifest"),
    ({"../outside": {"size": 1, "sha256": "0"}}, "bad manifest entry '../outside'"),
    ({"/etc/passwd": {"size": 1, "sha256": "0"}}, "bad manifest entry '/etc/passwd'"),
    ({"actor/model.safetensors": 7}, "bad manifest entry 'actor/model.safetensors'"),
    ({"actor/model.safetensors": {"size": 3, "sha256": "0"}}, "has 7 bytes, 3 were written"),
    ({"actor/missing.pt": {"size": 3, "sha256": "0"}}, "missing"),
])
def test_verify_rejects_a_bad_manifest_and_says_why(tmp_path, files, problem):
    folder = _sealed(tmp_path, {"step": 5, "format": checkpoint.FORMAT, "files": files})
    why = checkpoint.verify(folder)
    assert why is not None and problem in why, why
    assert str(folder / checkpoint.MARKER) in why or str(folder) in why


def test_verify_trusts_an_old_marker_without_manifest_only_in_format_1(tmp_path):
    assert checkpoint.verify(_sealed(tmp_path / "a", {"step": 5})) is None  # rlx 0.1.0 wrote no format
    assert checkpoint.verify(_sealed(tmp_path / "b", {"step": 5, "format": 1})) is None
    why = checkpoint.verify(_sealed(tmp_path / "c", {"step": 5, "format": 2}))
    assert why is not None and "no valid file manifest" in why
    why = checkpoint.verify(_sealed(tmp_path / "d", {"step": 6}))
    assert why is not None and "records step 6" in why


def test_unreadable_marker_and_missing_tensor_file_are_user_errors_with_a_fix(tmp_path):
    folder = _sealed(tmp_path, {"step": 5})
    (folder / checkpoint.MARKER).write_text("{not json")
    with pytest.raises(UserError, match="not a valid checkpoint marker") as exc:
        checkpoint.read_state(folder)
    assert exc.value.hint == "Delete that checkpoint folder; the previous one is used instead."
    (folder / checkpoint.MARKER).write_text(json.dumps({"step": "5"}))
    with pytest.raises(UserError, match="no integer 'step'") as exc:
        checkpoint.read_state(folder)
    assert exc.value.hint == "Delete that checkpoint folder; the previous one is used instead."
    with pytest.raises(UserError, match="is missing from the checkpoint") as exc:
        checkpoint.torch_load(folder / "actor" / "optim.pt")
    assert "optim.pt" in exc.value.message and "Resume from another checkpoint" in (exc.value.hint or "")
