"""Run folders are data: hostile copies of one real tiny run show that `rlx replay`, `rlx export` and
`rlx train` run no code a folder names (unless --trust-code), write nothing outside it, refuse its links,
print its text escaped, and that export never destroys its source (issue 25, and the export and replay
classes of issue 33)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from rlx.errors import UserError
from rlx.plugins.loggers import jsonl as jsonl_mod
from rlx.plugins.loggers import mlflow as mlflow_mod
from rlx.plugins.loggers import swanlab as swanlab_mod
from rlx.plugins.loggers import tensorboard as tensorboard_mod
from rlx.plugins.loggers import wandb as wandb_mod
from rlx.run.files import check_run_folder_links, code_requests, open_append_nofollow, printable, write_private

TINY = ["--preset", "tiny", "trainer.test_freq=-1", "trainer.loggers=[jsonl]", "trainer.save_hf_model=false",
        "trainer.total_steps=1", "trainer.save_freq=1", "data.train_batch_size=16"]


def rlx(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NO_COLOR": "1", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "rlx", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env=env)


def refused(proc: subprocess.CompletedProcess[str], *words: str) -> None:
    """Exit 2, a message with each of ``words``, no traceback."""
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    for word in words:
        assert word in text, (word, text[-3000:])


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (links as their target) and its content hash."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_symlink():
            out[str(p.relative_to(folder))] = "-> " + os.readlink(p)
        elif p.is_file():
            out[str(p.relative_to(folder))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny run (one step, one checkpoint, the jsonl logger), trained once for the whole module."""
    where = tmp_path_factory.mktemp("trained")
    run = where / "run"
    proc = rlx("train", *TINY, f"trainer.output_dir={run}", cwd=where)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


@pytest.fixture
def run(finished_run: Path, tmp_path: Path) -> Path:
    """A copy of the finished run in this test's folder, to be made hostile."""
    copy = tmp_path / "run"
    shutil.copytree(finished_run, copy, symlinks=True)
    return copy


def edit_config(run: Path, change) -> None:
    config = yaml.safe_load((run / "config.yaml").read_text())
    change(config)
    (run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


def plant_reward(tmp_path: Path) -> tuple[Path, Path]:
    """A custom reward file whose import writes a marker file: the marker shows that it ran."""
    marker = tmp_path / "planted-code-ran"
    reward = tmp_path / "reward.py"
    reward.write_text(f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n\n"
                      "def compute_score(response, ground_truth):\n    return 0.0\n")
    return reward, marker


def use_custom_reward(run: Path, reward: Path) -> None:
    def change(config: dict) -> None:
        core = {k: v for k, v in config["reward"].items() if k != "distance_penalty"}  # arith's own option
        config["reward"] = {**core, "name": "custom", "path": str(reward), "function": "compute_score"}
    edit_config(run, change)


# -- code runs only when the person at the keyboard says so ------------------------------------------
def test_a_custom_reward_in_a_run_folder_runs_only_with_trust_code(run: Path, tmp_path: Path) -> None:
    reward, marker = plant_reward(tmp_path)
    use_custom_reward(run, reward)
    for extra in ([], ["--force"]):  # --force forgives a changed version or file, never code
        proc = rlx("replay", str(run), *extra, cwd=tmp_path)
        refused(proc, "asks to run code", "reward.name: custom", str(reward), "--trust-code")
        assert not marker.exists(), "the planted reward was imported"
        assert not (run / "replay").exists()
    # export builds the model alone: it has no reason to import the reward, and does not
    exported = rlx("export", str(run), "--out", str(tmp_path / "hf"), cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert not marker.exists(), "export imported the planted reward"
    # the person at the keyboard says so: the reward runs (--force: the recorded run used another reward)
    trusted = rlx("replay", str(run), "--trust-code", "--force", cwd=tmp_path)
    assert trusted.returncode in (0, 1), trusted.stderr[-3000:]
    assert marker.read_text() == "ran"
    assert "Replay folder" in trusted.stdout


@pytest.mark.parametrize("where", ["model", "reward"])
def test_trust_remote_code_in_a_run_folder_is_refused(run: Path, tmp_path: Path, where: str) -> None:
    def change(config: dict) -> None:
        if where == "model":
            config["model"]["trust_remote_code"] = True
        else:
            config["reward"] = {**{k: v for k, v in config["reward"].items() if k != "distance_penalty"},
                                "name": "reward_model", "path": "builtin:tiny-qwen2", "trust_remote_code": True}
    edit_config(run, change)
    before = snapshot(run)
    refused(rlx("replay", str(run), "--force", cwd=tmp_path), f"{where}.trust_remote_code: true", "--trust-code")
    assert not (run / "replay").exists()
    out = tmp_path / "hf"
    if where == "model":
        refused(rlx("export", str(run), "--out", str(out), cwd=tmp_path), "model.trust_remote_code: true",
                "--trust-code")
        assert not out.exists()
        # --trust-code opens it (the tiny model has no code of its own: it loads as usual)
        proc = rlx("export", str(run), "--out", str(out), "--trust-code", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert (out / "config.json").is_file()
    assert snapshot(run) == before


def test_code_requests_name_each_way_a_config_runs_code() -> None:
    asks = code_requests({"model": {"trust_remote_code": True}, "reward": {
        "name": "mix", "components": [{"name": "custom", "options": {"path": "/x/r.py"}},
                                      {"name": "code", "options": {"python": "/usr/bin/py", "sandbox": "none"}}]}})
    assert asks == ["model.trust_remote_code: true (runs the model folder's own Python code)",
                    "reward.components[0].name: custom (imports the Python file /x/r.py)",
                    "reward.components[1].options.python: /usr/bin/py (an interpreter to run)",
                    "reward.components[1].options.sandbox: none (runs model-written programs outside the sandbox)"]
    assert code_requests({"model": {"trust_remote_code": False}, "reward": {"name": "arith"}}) == []


def test_from_verl_never_turns_on_remote_code_by_itself() -> None:
    from rlx.cli.from_verl import translate

    t = translate("python3 -m verl.trainer.main_ppo actor_rollout_ref.model.path=/m data.train_files=/d.parquet "
                  "actor_rollout_ref.model.trust_remote_code=True")
    assert "model.trust_remote_code" not in t.settings
    assert any("actor_rollout_ref.model.trust_remote_code=True is left out" in n
               and "model.trust_remote_code=true" in n for n in t.notes)


def test_from_verl_never_imports_a_reward_file_by_itself(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    reward = tmp_path / "reward.py"
    reward.write_text(f"open({str(marker)!r}, 'w').write('ran')\n"
                      "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    script = tmp_path / "verl.yaml"
    script.write_text(yaml.safe_dump({"data": {"train_files": "builtin:arith-train"},
                                      "actor_rollout_ref": {"model": {"path": "builtin:tiny-qwen2"}},
                                      "custom_reward_function": {"path": str(reward), "name": "compute_score"}}))
    common = ["trainer.total_steps=1", "trainer.test_freq=-1", "trainer.loggers=[jsonl]"]
    result = rlx("train", "--from-verl", str(script), f"trainer.output_dir={tmp_path / 'a'}", *common, cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"add reward.path={reward} to the rlx command" in result.stderr
    assert not marker.exists()
    # Named on the command line by the person at the keyboard, it runs.
    result = rlx("train", "--from-verl", str(script), f"reward.path={reward}", f"trainer.output_dir={tmp_path / 'b'}",
                 *common, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-1500:]
    assert marker.read_text() == "ran"


# -- writes stay inside the run folder --------------------------------------------------------------
@pytest.mark.parametrize("name", ["ABSOLUTE", "../escaped.jsonl", "config.yaml", "checkpoints", "SAME"])
def test_logger_file_names_that_leave_the_folder_are_refused(run: Path, tmp_path: Path, name: str) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    value = str(outside / "keep.txt") if name == "ABSOLUTE" else "m.jsonl" if name == "SAME" else name

    def change(config: dict) -> None:
        config["loggers"]["jsonl"] = {"filename": value,
                                      "samples_filename": "m.jsonl" if name == "SAME" else "samples.jsonl"}
    edit_config(run, change)
    before, config_before = snapshot(tmp_path), (run / "config.yaml").read_bytes()
    refused(rlx("replay", str(run), "--force", cwd=run), "config.yaml", "loggers.jsonl")
    refused(rlx("train", *TINY, f"trainer.output_dir={tmp_path / 'new'}", f"loggers.jsonl.filename={value}",
                *(["loggers.jsonl.samples_filename=m.jsonl"] if name == "SAME" else []), cwd=run), "loggers.jsonl")
    assert snapshot(tmp_path) == before, "a file outside changed"
    assert (run / "config.yaml").read_bytes() == config_before
    assert not (tmp_path / "escaped.jsonl").exists() and not (tmp_path / "new").exists()


@pytest.mark.parametrize("value", ["../up", "a/../../up", "checkpoints/tb", "", "x\x1b[2J"])
@pytest.mark.parametrize("options", [tensorboard_mod.TensorboardOptions, wandb_mod.WandbOptions,
                                     swanlab_mod.SwanlabOptions])
def test_logger_folders_stay_inside_the_run_folder(options, value: str) -> None:
    with pytest.raises(ValidationError, match="logdir"):
        options(logdir=value)
    assert options(logdir="logs/tb").logdir == "logs/tb"  # inside the run folder
    assert options(logdir="/elsewhere/tb").logdir == "/elsewhere/tb"  # the user's explicit choice


@pytest.mark.parametrize("value", ["/abs.jsonl", "..", ".", "a/b.jsonl", "a\\b.jsonl", "provenance.json", "COMPLETE",
                                   "hf_model", "x\ny"])
def test_jsonl_names_are_plain_names(value: str) -> None:
    with pytest.raises(ValidationError, match="filename"):
        jsonl_mod.JsonlOptions(filename=value)
    with pytest.raises(ValidationError, match="samples_filename"):
        jsonl_mod.JsonlOptions(samples_filename=value)
    with pytest.raises(ValidationError, match="two files"):
        jsonl_mod.JsonlOptions(filename="a.jsonl", samples_filename="a.jsonl")


def test_an_explicit_sqlite_store_keeps_its_artifacts_beside_it(tmp_path: Path) -> None:
    assert mlflow_mod.artifact_location(f"sqlite:///{tmp_path}/db/mlflow.db") == (tmp_path / "db" /
                                                                                   "mlartifacts").as_uri()
    assert mlflow_mod.artifact_location(mlflow_mod.default_store(tmp_path)) == (tmp_path / "mlartifacts").as_uri()
    assert mlflow_mod.artifact_location("http://tracking:5000") is None


@pytest.mark.parametrize("link", ["relative", "absolute"])
def test_a_linked_config_is_refused_and_its_target_left_alone(run: Path, tmp_path: Path, link: str) -> None:
    target = tmp_path / "elsewhere.yaml"
    shutil.move(run / "config.yaml", target)
    (run / "config.yaml").symlink_to(os.path.relpath(target, run) if link == "relative" else target)
    before = snapshot(tmp_path)
    for proc in (rlx("replay", str(run), "--force", cwd=tmp_path),
                 rlx("export", str(run), "--out", str(tmp_path / "hf"), cwd=tmp_path),
                 rlx("train", *TINY, f"trainer.output_dir={run}", "trainer.resume=never", cwd=tmp_path)):
        refused(proc, "symbolic link", "config.yaml ->")
    assert snapshot(tmp_path) == before


def test_a_linked_metrics_file_is_refused(run: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").symlink_to(victim)
    refused(rlx("replay", str(run), "--force", cwd=tmp_path), "metrics.jsonl ->", str(victim))
    refused(rlx("train", *TINY, f"trainer.output_dir={run}", "trainer.total_steps=2", cwd=tmp_path),
            "metrics.jsonl ->")
    assert victim.read_text() == "keep"


def test_write_private_replaces_a_link_and_append_refuses_one(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (folder / "config.yaml").symlink_to(victim)
    write_private(folder / "config.yaml", "new: 1\n")
    assert victim.read_text() == "keep" and not (folder / "config.yaml").is_symlink()
    assert (folder / "config.yaml").stat().st_mode & 0o777 == 0o600  # private, as its folder is
    (folder / "log.jsonl").symlink_to(victim)
    with pytest.raises(UserError, match="symbolic link"):
        open_append_nofollow(folder / "log.jsonl")
    with pytest.raises(UserError, match=r"log\.jsonl -> "):
        check_run_folder_links(folder, ["log.jsonl"])
    assert victim.read_text() == "keep"


# -- terminal safety ---------------------------------------------------------------------------------
def test_text_from_files_is_printed_escaped(run: Path, tmp_path: Path) -> None:
    record = json.loads((run / "provenance.json").read_text())
    record["versions"]["torch"] = "\x1b[31mred\x1b]0;title\x07"
    (run / "provenance.json").write_text(json.dumps(record))
    proc = rlx("replay", str(run), cwd=tmp_path)
    refused(proc, "package torch", "\\x1b[31mred\\x1b]0;title\\x07")
    assert "\x1b" not in proc.stdout + proc.stderr and "\x07" not in proc.stderr
    assert printable("ok\u202eevil\n") == "ok\\u202eevil\\n" and printable("plain ü") == "plain ü"


# -- damaged files: exit 2 naming the file -----------------------------------------------------------
@pytest.mark.parametrize("case", ["config-truncated", "config-list", "config-type", "provenance-truncated",
                                  "provenance-type", "provenance-file", "metrics-garbage", "metrics-step"])
def test_damaged_files_are_named_before_anything_trains(run: Path, tmp_path: Path, case: str) -> None:
    name = {"config": "config.yaml", "provenance": "provenance.json", "metrics": "metrics.jsonl"}[case.split("-")[0]]
    path = run / name
    text = path.read_text()
    if case == "config-truncated":
        path.write_text(text[: len(text) // 3] + "\n  - [unclosed")
    elif case == "config-list":
        path.write_text("- just\n- a list\n")
    elif case == "config-type":
        edit_config(run, lambda c: c["trainer"].update(total_steps="many"))
    elif case == "provenance-truncated":
        path.write_text(text[: len(text) // 2])
    elif case == "provenance-type":
        record = json.loads(text)
        record["plugins"] = {"reward/arith": "rlx"}
        path.write_text(json.dumps(record))
    elif case == "provenance-file":
        record = json.loads(text)
        record["files"] = {"data.train_files[0]": {"path": "/d.parquet", "size": 1}}
        path.write_text(json.dumps(record))
    elif case == "metrics-garbage":
        path.write_text("{not json\n" + text)
    else:
        lines = text.splitlines()
        path.write_text("\n".join([json.dumps({**json.loads(lines[0]), "step": "one"}), *lines[1:]]) + "\n")
    proc = rlx("replay", str(run), cwd=tmp_path)
    refused(proc, name)
    if case == "config-type":
        assert "trainer.total_steps" in proc.stderr
    assert not (run / "replay").exists()


def test_replay_brings_logger_places_back_into_its_own_folder(capsys) -> None:
    from rlx.plugins.provenance.command import _logger_places

    config = {"loggers": {"tensorboard": {"logdir": "/home/someone/tb"}, "wandb": {"logdir": "in-run"},
                          "mlflow": {"tracking_uri": "http://their-server:5000"}}}
    assert _logger_places(config) == ["loggers.tensorboard.logdir=null", "loggers.mlflow.tracking_uri=null"]
    assert "/home/someone/tb points outside the run folder" in capsys.readouterr().err


def test_replay_out_may_not_be_the_run_or_hold_it(run: Path, tmp_path: Path) -> None:
    before = snapshot(run)
    for out in (run, tmp_path, run / "checkpoints"):
        refused(rlx("replay", str(run), "--out", str(out), cwd=tmp_path), "--out", "the run it replays")
    assert snapshot(run) == before


def test_an_ordinary_replay_still_reproduces_the_run_privately(run: Path, tmp_path: Path) -> None:
    proc = rlx("replay", str(run), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "The replay's metrics equal the recorded run's at every step (1)" in proc.stdout
    for name in ("config.yaml", "provenance.json", "metrics.jsonl"):
        assert (run / "replay" / name).stat().st_mode & 0o777 == 0o600, name
    assert (run / "replay" / "checkpoints" / "global_step_1").stat().st_mode & 0o777 == 0o700
    # Everything under the checkpoint too (what torch.save and safetensors wrote).
    assert_private_tree(run / "replay" / "checkpoints" / "global_step_1")


def assert_private_tree(folder: Path) -> None:
    modes = {p.relative_to(folder).as_posix(): p.stat().st_mode & 0o777 for p in folder.rglob("*")}
    assert modes and all(mode == (0o700 if (folder / name).is_dir() else 0o600) for name, mode in modes.items()), \
        modes


def test_the_final_model_in_a_private_run_folder_is_private(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = rlx("train", *[a for a in TINY if not a.startswith("trainer.save_hf_model")], "trainer.total_steps=1",
               f"trainer.output_dir={run}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert run.stat().st_mode & 0o777 == 0o700
    assert_private_tree(run / "hf_model")
    assert_private_tree(run / "checkpoints")


# -- export never destroys its source ----------------------------------------------------------------
def test_export_out_over_its_source_is_refused_whatever_force_says(run: Path, tmp_path: Path) -> None:
    before = snapshot(run)
    ckpt = run / "checkpoints" / "global_step_1"
    for source in (run, ckpt):
        for out in (run, run / "checkpoints", ckpt, ckpt / "actor", run / "hf", tmp_path):
            refused(rlx("export", str(source), "--out", str(out), "--force", cwd=tmp_path), "--out",
                    "the export reads from")
    assert snapshot(run) == before


def test_export_force_replaces_only_an_earlier_export(run: Path, tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    refused(rlx("export", str(run), "--out", str(mine), "--force", cwd=tmp_path), "not an earlier export",
            ".rlx-export")
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    out = tmp_path / "models" / "new" / "name"  # its parents do not exist yet: they are created
    first = rlx("export", str(run), "--out", str(out), cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert (out / ".rlx-export").is_file() and (out / "model.safetensors").is_file()
    refused(rlx("export", str(run), "--out", str(out), cwd=tmp_path), "already holds files", "--force")
    again = rlx("export", str(run), "--out", str(out), "--force", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (out / ".rlx-export").is_file() and not list(out.parent.glob(".tmp-*"))


@pytest.mark.parametrize("out", ["", "/proc/rlx-export-test", "FILE"])
def test_export_out_that_cannot_be_written_is_a_message(run: Path, tmp_path: Path, out: str) -> None:
    if out == "FILE":
        out = str(tmp_path / "a-file")
        Path(out).write_text("x")
    refused(rlx("export", str(run), "--out", out, cwd=tmp_path), "--out")


def test_export_names_a_model_folder_that_is_gone(run: Path, tmp_path: Path) -> None:
    gone = tmp_path / "models" / "my-base"
    edit_config(run, lambda c: c["model"].update(path=str(gone)))
    refused(rlx("export", str(run), "--out", str(tmp_path / "hf"), cwd=tmp_path), str(gone), "is gone",
            "model.path")
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".tmp-*"))
