"""Run provenance (versions, plugins, content hashes of data and model files, the command line) and
`rlx replay`: it refuses, naming the file or version, where the recorded run differs from what is here now,
warns with --force, and a replay of the built-in job on one thread reproduces every metric."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml

from rlx.plugins.provenance import record as provenance
from rlx.plugins.provenance.command import compare_metrics
from rlx.registry import get_plugin_manager


def rlx(*args: str, cwd, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NO_COLOR": "1", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "rlx", *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=timeout)


def test_small_files_are_hashed_whole(tmp_path):
    path = tmp_path / "a.bin"
    path.write_bytes(b"rlx" * 1000)
    entry = provenance.file_hash(path)
    assert entry == {"path": str(path), "size": 3000, "sha256": hashlib.sha256(b"rlx" * 1000).hexdigest(),
                     "hashed": "full"}
    assert provenance.file_hash(tmp_path / "none") == {"path": str(tmp_path / "none"), "missing": True}


def test_large_files_are_hashed_from_their_size_and_spread_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(provenance, "FULL_HASH_LIMIT", 1000)
    monkeypatch.setattr(provenance, "SAMPLE_BLOCK", 10)
    monkeypatch.setattr(provenance, "SAMPLE_BLOCKS", 4)
    data = bytearray(range(256)) * 8  # 2048 bytes: blocks at 0, 679, 1358 and 2038 (the last 10 bytes)
    path = tmp_path / "w.safetensors"
    path.write_bytes(bytes(data))
    entry = provenance.file_hash(path)
    assert entry["hashed"] == "sampled" and entry["size"] == 2048
    expected = hashlib.sha256(b"2048" + bytes(data[0:10] + data[679:689] + data[1358:1368] + data[2038:2048]))
    assert entry["sha256"] == expected.hexdigest()
    for offset, seen in ((0, True), (2047, True), (1360, True), (500, False)):
        changed = bytearray(data)
        changed[offset] ^= 0xFF
        path.write_bytes(bytes(changed))
        assert (provenance.file_hash(path)["sha256"] != entry["sha256"]) is seen, offset
    path.write_bytes(bytes(data) + b"\0")  # a longer file: another size
    assert provenance.file_hash(path)["sha256"] != entry["sha256"]


def make_run(tmp_path, **changes) -> tuple[dict, object]:
    """A run folder of the built-in job whose data files are copies in tmp_path (so a test can change them)."""
    from rlx.plugins.tasks.builtin import resolve
    from rlx.validate import load_config

    for name in ("arith-train", "arith-test"):
        shutil.copy(resolve(f"builtin:{name}"), tmp_path / f"{name}.parquet")
    overrides = [f"data.train_files={tmp_path / 'arith-train.parquet'}",
                 f"data.val_files={tmp_path / 'arith-test.parquet'}", f"trainer.output_dir={tmp_path / 'run'}",
                 "trainer.total_steps=1", "trainer.test_freq=1", "trainer.save_freq=0", "trainer.save_hf_model=false",
                 "data.train_batch_size=16", *[f"{k}={v}" for k, v in changes.items()]]
    config = load_config(get_plugin_manager(), preset="tiny", overrides=overrides).as_dict()
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return config, run


def test_collect_records_versions_plugins_files_and_command(tmp_path):
    config, run = make_run(tmp_path)
    record = provenance.collect(config, get_plugin_manager(), argv=["rlx", "train", "x=1"])
    assert record["command"] == {"argv": ["rlx", "train", "x=1"], "cwd": os.getcwd()}
    versions = record["versions"]
    assert versions["rlx"] and versions["torch"] and versions["transformers"] and versions["python"]
    assert set(provenance.PACKAGES) <= set(versions)
    assert record["plugins"]["algorithm/grpo"]["distribution"] == "rlx"
    assert {"backend/torch", "rollout/hf", "reward/arith", "launcher/local", "logger/console",
            "logger/jsonl"} <= set(record["plugins"])
    files = record["files"]
    train = files["data.train_files[0]"]
    assert train["path"] == str(tmp_path / "arith-train.parquet")
    assert train["sha256"] == hashlib.sha256((tmp_path / "arith-train.parquet").read_bytes()).hexdigest()
    assert "data.val_files[0]" in files and "model.path:config.json" in files
    assert any(k.startswith("model.path:") and k.endswith(".safetensors") for k in files)
    path = provenance.write(run, record)
    assert path.name == "provenance.json" and json.loads(path.read_text()) == record
    assert provenance.differences(record, provenance.collect(config, get_plugin_manager())) == []


def test_differences_name_each_file_version_and_plugin():
    recorded = {"versions": {"python": "3.11.1", "torch": "2.13.0", "vllm": None},
                "plugins": {"reward/code": {"distribution": "rlx-reward-code", "version": "0.1.0"}},
                "files": {"data.train_files[0]": {"path": "/d/train.parquet", "sha256": "a" * 64},
                          "model.path": {"path": "Qwen/Qwen2.5-0.5B", "hub_id": True}}}
    current = {"versions": {"python": "3.11.1", "torch": "2.14.0", "vllm": "0.9.0"},
               "plugins": {"reward/code": {"distribution": "rlx-reward-code", "version": "0.2.0"}},
               "files": {"data.train_files[0]": {"path": "/d/train.parquet", "sha256": "b" * 64},
                         "model.path": {"path": "Qwen/Qwen2.5-0.5B", "hub_id": True}}}
    assert provenance.differences(recorded, current) == [
        "package torch: the run used 2.13.0, installed now: 2.14.0",
        "package vllm: the run used none, installed now: 0.9.0",
        "plugin reward/code: the run used rlx-reward-code 0.1.0, now rlx-reward-code 0.2.0",
        "data.train_files[0]: /d/train.parquet has changed (sha256 aaaaaaaaaaaa... then, bbbbbbbbbbbb... now)",
    ]
    current["files"]["data.train_files[0]"] = {"path": "/d/train.parquet", "missing": True}
    assert provenance.differences(recorded, current)[-1] == "data.train_files[0]: /d/train.parquet is gone"


def test_replay_refuses_naming_the_changed_data_file(tmp_path):
    config, run = make_run(tmp_path)
    provenance.write(run, provenance.collect(config, get_plugin_manager()))
    train = tmp_path / "arith-train.parquet"
    shutil.copy(tmp_path / "arith-test.parquet", train)  # another valid parquet under the same name
    proc = rlx("replay", str(run), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("Error:") == 1
    assert f"data.train_files[0]: {train} has changed" in proc.stderr
    assert "--force" in proc.stderr
    assert not (run / "replay").exists()


def test_replay_without_provenance_refuses(tmp_path):
    _, run = make_run(tmp_path)
    proc = rlx("replay", str(run), cwd=tmp_path)
    assert proc.returncode == 2 and "provenance.json does not exist" in proc.stderr
    proc = rlx("replay", str(tmp_path / "nowhere"), cwd=tmp_path)
    assert proc.returncode == 2 and "no config.yaml there" in proc.stderr


def test_compare_metrics_leaves_out_timings_and_names_each_difference():
    recorded = [{"step": 1, "time": 1.0, "reward/mean": 0.5, "timing/step": 3.0, "val/acc": float("nan")},
                {"step": 2, "time": 2.0, "reward/mean": 0.25, "perf/tokens_per_second": 9.0}]
    same = [{"step": 1, "time": 7.0, "reward/mean": 0.5, "timing/step": 1.0, "val/acc": float("nan")},
            {"step": 2, "time": 8.0, "reward/mean": 0.25, "perf/tokens_per_second": 1.0}]
    assert compare_metrics(recorded, same) == []
    other = [{"step": 1, "reward/mean": 0.5000001, "val/acc": float("nan")}, {"step": 2, "extra": 1.0}]
    assert compare_metrics(recorded, other) == ["step 1 reward/mean: 0.5 recorded, 0.5000001 replayed",
                                                "step 2 extra: missing recorded, 1.0 replayed",
                                                "step 2 reward/mean: 0.25 recorded, missing replayed"]


@pytest.mark.slow
def test_replay_of_the_built_in_job_reproduces_its_metrics_and_refuses_after_a_data_change(tmp_path):
    from rlx.plugins.tasks.builtin import resolve

    for name in ("arith-train", "arith-test"):
        shutil.copy(resolve(f"builtin:{name}"), tmp_path / f"{name}.parquet")
    run = tmp_path / "run"
    proc = rlx("train", f"data.train_files={tmp_path / 'arith-train.parquet'}",
               f"data.val_files={tmp_path / 'arith-test.parquet'}", "--preset", "tiny", f"trainer.output_dir={run}",
               "trainer.total_steps=2", "trainer.test_freq=2", "trainer.save_freq=0", "trainer.save_hf_model=false",
               "data.train_batch_size=16", cwd=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = provenance.read(run)  # written by rlx train beside config.yaml
    assert record["command"]["argv"][1:3] == ["train", f"data.train_files={tmp_path / 'arith-train.parquet'}"]
    replay = rlx("replay", str(run), cwd=tmp_path, timeout=900)
    assert replay.returncode == 0, replay.stdout + replay.stderr[-3000:]
    # Steps 0 (the preset's validation before training), 1 and 2.
    assert "The replay's metrics equal the recorded run's at every step (3)" in replay.stdout
    assert (run / "replay" / "metrics.jsonl").is_file()

    with open(tmp_path / "arith-test.parquet", "ab") as f:  # the validation file changes
        f.write(b"\0")
    refused = rlx("replay", str(run), "--out", str(tmp_path / "again"), cwd=tmp_path)
    assert refused.returncode == 2
    assert f"data.val_files[0]: {tmp_path / 'arith-test.parquet'} has changed" in refused.stderr
    assert not (tmp_path / "again").exists()


def test_a_hub_model_is_hashed_in_the_cache_folder_it_loads_from(tmp_path, monkeypatch):
    pytest.importorskip("huggingface_hub")
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny"
    for rev, text in (("1111", '{"a": 1}'), ("2222", '{"a": 2}')):
        (repo / "snapshots" / rev).mkdir(parents=True)
        (repo / "snapshots" / rev / "config.json").write_text(text)
        (repo / "snapshots" / rev / "model.safetensors").write_bytes(text.encode() * 10)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("1111")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    config = {"model": {"path": "org/tiny"}, "data": {}}
    first = provenance.hash_inputs(config)
    assert first["model.path"] == {"path": "org/tiny", "hub_id": True, "revision": "1111"}
    assert first["model.path:config.json"]["sha256"] == hashlib.sha256(b'{"a": 1}').hexdigest()
    assert "model.path:model.safetensors" in first
    (repo / "refs" / "main").write_text("2222")
    problems = provenance.differences({"files": first}, {"files": provenance.hash_inputs(config)})
    assert problems[0] == "model.path: org/tiny was revision 1111, the cache now holds 2222"
    assert any(p.startswith("model.path:config.json: ") and "has changed" in p for p in problems)
    assert provenance.hash_inputs({"model": {"path": "org/absent"}, "data": {}}) == {
        "model.path": {"path": "org/absent", "hub_id": True}}
