"""`rlx config from-verl` and `rlx train --from-verl`: verl's GSM8K quick-start, its GRPO example and the
seed's LoRA / dynamic-batch / reward-model run translate key by key; what rlx cannot follow is named and
stops the command (exit 2) unless --allow-unmapped; the translations pass `rlx config validate`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlx.cli.from_verl import read_verl_source, translate
from rlx.registry import get_plugin_manager

# verl's quick-start (docs/start/quickstart.rst): PPO with a critic on GSM8K, Qwen2.5-0.5B-Instruct.
QUICKSTART = r"""PYTHONUNBUFFERED=1 python3 -m verl.trainer.main_ppo \
 data.train_files=$HOME/data/gsm8k/train.parquet \
 data.val_files=$HOME/data/gsm8k/test.parquet \
 data.train_batch_size=256 \
 data.max_prompt_length=512 \
 data.max_response_length=512 \
 actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct \
 actor_rollout_ref.actor.optim.lr=1e-6 \
 actor_rollout_ref.actor.ppo_mini_batch_size=64 \
 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
 actor_rollout_ref.rollout.name=vllm \
 actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
 actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
 actor_rollout_ref.rollout.gpu_memory_utilization=0.4 \
 actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4 \
 critic.optim.lr=1e-5 \
 critic.model.path=Qwen/Qwen2.5-0.5B-Instruct \
 critic.ppo_micro_batch_size_per_gpu=4 \
 algorithm.kl_ctrl.kl_coef=0.001 \
 trainer.logger=console \
 trainer.val_before_train=False \
 trainer.n_gpus_per_node=1 \
 trainer.nnodes=1 \
 trainer.save_freq=10 \
 trainer.test_freq=10 \
 trainer.total_epochs=15 2>&1 | tee verl_demo.log
"""

# verl's examples/grpo_trainer/run_qwen2-7b.sh (GRPO, KL loss, 8 GPUs, W&B).
GRPO_7B = r"""set -x
python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files=$HOME/data/gsm8k/train.parquet \
    data.val_files=$HOME/data/gsm8k/test.parquet \
    data.train_batch_size=1024 \
    data.max_prompt_length=512 \
    data.max_response_length=1024 \
    data.filter_overlong_prompts=True \
    data.truncation='error' \
    actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.ppo_mini_batch_size=256 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.fsdp_config.param_offload=False \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.n=5 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40 \
    actor_rollout_ref.ref.fsdp_config.param_offload=True \
    algorithm.use_kl_in_reward=False \
    trainer.critic_warmup=0 \
    trainer.logger='["console","wandb"]' \
    trainer.project_name='verl_grpo_example_gsm8k' \
    trainer.experiment_name='qwen2_7b_function_rm' \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 \
    trainer.save_freq=20 \
    trainer.test_freq=5 \
    trainer.total_epochs=15 $@
"""

# The seed's run: GSM8K GRPO on Qwen2.5-0.5B with LoRA, packed sequences, dynamic batches and a reward model.
SEED = r"""python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo \
 data.train_files=$HOME/data/gsm8k/train.parquet data.val_files=$HOME/data/gsm8k/test.parquet \
 data.train_batch_size=64 data.max_prompt_length=512 data.max_response_length=512 \
 actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct \
 actor_rollout_ref.model.lora_rank=32 actor_rollout_ref.model.lora_alpha=32 \
 actor_rollout_ref.model.target_modules=all-linear \
 actor_rollout_ref.model.use_remove_padding=True \
 actor_rollout_ref.actor.use_dynamic_bsz=True actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384 \
 actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True \
 actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=16384 \
 actor_rollout_ref.actor.optim.lr=3e-6 actor_rollout_ref.actor.ppo_mini_batch_size=16 \
 actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_coef=0.001 \
 actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.n=8 \
 reward_model.enable=True reward_model.model.path=$HOME/models/gsm8k-rm \
 reward_model.micro_batch_size_per_gpu=16 \
 trainer.logger='["console","tensorboard"]' trainer.total_epochs=2 trainer.save_freq=-1 trainer.test_freq=10
"""


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A $HOME with the GSM8K files the command lines name (rows in verl's shape)."""
    from rlx.plugins.tasks.builtin import resolve

    source = resolve("builtin:arith-train")
    monkeypatch.setenv("HOME", str(tmp_path))
    data = tmp_path / "data" / "gsm8k"
    data.mkdir(parents=True)
    shutil.copy(source, data / "train.parquet")
    shutil.copy(source, data / "test.parquet")
    return tmp_path


def rlx(*args: str, home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HOME": str(home), "NO_COLOR": "1", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "rlx", *args], capture_output=True, text=True, env=env,
                          cwd=home, timeout=300)


def test_quickstart_translates_key_by_key(home):
    t = translate(QUICKSTART, get_plugin_manager())
    assert t.unmapped == []
    s = t.settings
    assert s["algorithm.name"] == "ppo"  # verl's default estimator, gae, with the critic the command configures
    assert s["data.train_files"] == str(home / "data/gsm8k/train.parquet")  # $HOME expanded as a shell would
    assert (s["data.train_batch_size"], s["actor.ppo_mini_batch_size"], s["actor.micro_batch_size_per_device"]) \
        == (256, 64, 4)
    assert s["actor.log_prob_micro_batch_size_per_device"] == 4  # rollout 8, ref 4: one size in rlx, the smaller
    assert s["actor.optim.lr"] == 1e-6 and s["critic.optim.lr"] == 1e-5
    assert s["critic.model_path"] == "Qwen/Qwen2.5-0.5B-Instruct" and s["critic.micro_batch_size_per_device"] == 4
    assert s["algorithm.kl_ctrl.kl_coef"] == 0.001
    assert s["trainer.loggers"] == ["console", "jsonl"]
    assert (s["trainer.save_freq"], s["trainer.test_freq"], s["trainer.total_epochs"]) == (10, 10, 15)
    assert s["trainer.val_before_train"] is False
    assert s["rollout.n"] == 1 and s["algorithm.use_kl_loss"] is False  # verl's defaults where rlx's differ
    assert s["reward.name"] == "router"
    assert "launcher.nproc" not in s  # one GPU
    engine_keys = {"actor_rollout_ref.rollout.tensor_model_parallel_size",
                   "actor_rollout_ref.rollout.gpu_memory_utilization"}
    if s["rollout.name"] == "vllm":  # vLLM installed: its own settings carry over
        assert (s["rollout.tensor_parallel_size"], s["rollout.gpu_memory_utilization"]) == (1, 0.4)
        assert t.ignored == []
    else:  # the hf engine has no such settings; they change memory and placement only
        assert s["rollout.name"] == "hf"
        assert {k for k, _ in t.ignored} == engine_keys
        assert any(n.startswith("actor_rollout_ref.rollout.name=vllm: ") for n in t.notes)


def test_quickstart_config_passes_rlx_config_validate(home):
    proc = rlx("config", "from-verl", QUICKSTART, home=home)
    assert proc.returncode == 0, proc.stderr
    path = home / "quickstart.yaml"
    path.write_text(proc.stdout)
    assert yaml.safe_load(proc.stdout)["model"]["path"] == "Qwen/Qwen2.5-0.5B-Instruct"
    check = rlx("config", "validate", "--config", str(path), f"trainer.output_dir={home / 'run'}", home=home)
    assert check.returncode == 0, check.stderr
    assert check.stdout.strip() == "Config is valid."


def test_grpo_example_translates_and_validates(home):
    t = translate(GRPO_7B, get_plugin_manager())
    assert t.unmapped == []
    s = t.settings
    assert s["algorithm.name"] == "grpo" and s["algorithm.use_kl_loss"] is True
    assert (s["algorithm.kl_loss_coef"], s["algorithm.kl_loss_type"], s["algorithm.entropy_coeff"]) == \
        (0.001, "low_var_kl", 0)
    assert s["rollout.n"] == 5 and s["launcher.nproc"] == 8
    assert s["trainer.loggers"] == ["console", "wandb", "jsonl"]
    assert (s["trainer.project"], s["trainer.experiment"]) == ("verl_grpo_example_gsm8k", "qwen2_7b_function_rm")
    assert s["model.gradient_checkpointing"] is True and s["actor.use_remove_padding"] is True
    assert s["trainer.val_before_train"] is True  # verl's default
    ignored = {k for k, _ in t.ignored}
    assert "actor_rollout_ref.actor.fsdp_config.param_offload" in ignored and "data.truncation" in ignored
    path = home / "grpo.yaml"
    path.write_text(t.to_yaml())
    # With vLLM installed, its tensor_parallel_size=2 is checked against this machine's devices: use one here.
    here = ["rollout.tensor_parallel_size=1"] if s["rollout.name"] == "vllm" else []
    check = rlx("config", "validate", "--config", str(path), f"trainer.output_dir={home / 'run'}", *here, home=home)
    assert check.returncode == 0, check.stderr


def test_seed_run_translates_and_names_what_rlx_lacks(home):
    (home / "models" / "gsm8k-rm").mkdir(parents=True)
    t = translate(SEED, get_plugin_manager())
    s = t.settings
    assert s["algorithm.name"] == "grpo" and s["rollout.n"] == 8
    assert s["actor.use_dynamic_bsz"] is True and s["actor.ppo_max_token_len_per_gpu"] == 16384
    assert s["actor.log_prob_max_token_len_per_gpu"] == 16384 and s["actor.use_remove_padding"] is True
    assert s["reward.name"] == "reward_model" and s["reward.path"] == str(home / "models/gsm8k-rm")
    assert s["reward.batch_size"] == 16
    assert s["trainer.save_freq"] == 0  # verl's -1 (never) is rlx's 0
    assert s["trainer.loggers"] == ["console", "tensorboard", "jsonl"]
    from rlx.config import RLXConfig

    lora = {"actor_rollout_ref.model.lora_rank", "actor_rollout_ref.model.lora_alpha",
            "actor_rollout_ref.model.target_modules"}
    if "lora_rank" in RLXConfig.model_fields["model"].annotation.model_fields:  # LoRA landed: mapped
        assert s["model.lora_rank"] == 32 and s["model.lora_alpha"] == 32
        assert not lora & {k for k, _ in t.unmapped}
        return
    assert {k for k, _ in t.unmapped} == lora
    proc = rlx("config", "from-verl", SEED, home=home)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "3 verl key(s) have no rlx counterpart" in proc.stderr
    for key in lora:
        assert key in proc.stderr and f"# UNMAPPED: {key}" in proc.stdout
    assert "--allow-unmapped" in proc.stderr
    allowed = rlx("config", "from-verl", "--allow-unmapped", SEED, home=home)
    assert allowed.returncode == 0, allowed.stderr
    path = home / "seed.yaml"
    path.write_text(allowed.stdout)
    check = rlx("config", "validate", "--config", str(path), f"trainer.output_dir={home / 'run'}", home=home)
    assert check.returncode == 0, check.stderr


def test_unknown_keys_stop_train_before_anything_runs(home):
    line = QUICKSTART.replace("trainer.nnodes=1", "trainer.nnodes=1 actor_rollout_ref.actor.made_up_knob=3 "
                              "~data.val_files")
    proc = rlx("train", "--from-verl", line, f"trainer.output_dir={home / 'run'}", home=home)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("Error:") == 1
    assert "actor_rollout_ref.actor.made_up_knob (no rlx counterpart)" in proc.stderr
    assert "~data.val_files (Hydra key deletion)" in proc.stderr
    assert not (home / "run").exists()


def test_train_from_verl_applies_the_translation_under_the_users_overrides(home):
    """The translated settings reach validation (a wrong value is reported under its rlx key), and the
    user's overrides win over them."""
    bad = QUICKSTART.replace("actor.ppo_mini_batch_size=64", "actor.ppo_mini_batch_size=100")
    proc = rlx("train", "--from-verl", bad, f"trainer.output_dir={home / 'run'}", home=home)
    assert proc.returncode == 2
    assert ("actor_rollout_ref.actor.ppo_mini_batch_size=100 (rlx's actor.ppo_mini_batch_size): 100 must divide "
            "data.train_batch_size (256)") in proc.stderr
    ok = rlx("train", "--from-verl", bad, "actor.ppo_mini_batch_size=64", "data.train_files=/nonexistent.parquet",
             f"trainer.output_dir={home / 'run'}", home=home)
    assert ok.returncode == 2 and "ppo_mini_batch_size" not in ok.stderr and "/nonexistent.parquet" in ok.stderr


def test_conversions_where_verl_and_rlx_differ():
    t = translate({"algorithm.adv_estimator": "gae", "trainer.save_freq": -1, "trainer.logger": ["console", "file"],
                   "trainer.default_local_dir": "ckpts/${trainer.project_name}/${trainer.experiment_name}",
                   "trainer.resume_mode": "disable", "trainer.total_training_steps": 7,
                   "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": 0.5,
                   "actor_rollout_ref.rollout.val_kwargs.do_sample": False, "trainer.nnodes": 2,
                   "trainer.n_gpus_per_node": 4, "actor_rollout_ref.model.lora_rank": 0},
                  get_plugin_manager())
    s = t.settings
    assert s["algorithm.name"] == "ppo" and s["trainer.save_freq"] == 0
    assert s["trainer.loggers"] == ["console", "jsonl"]
    assert s["trainer.output_dir"] == "ckpts/{project}/{experiment}"
    assert s["trainer.resume"] == "never" and s["trainer.total_steps"] == 7
    assert s["actor.optim.warmup_ratio"] == 0.5 and s["rollout.val_temperature"] == 0.0
    assert s["launcher.name"] == "ray" and s["launcher.nproc"] == 8
    assert ("actor_rollout_ref.model.lora_rank", "0: no LoRA, the whole model trains") in t.ignored
    nulls = translate({"data.val_batch_size": None, "actor_rollout_ref.model.tokenizer_path": None})
    assert [k for k, _ in nulls.ignored] == ["data.val_batch_size", "actor_rollout_ref.model.tokenizer_path"]
    assert "data.val_batch_size" not in nulls.settings and "model.tokenizer_path" not in nulls.settings
    assert t.unmapped == []
    other = translate({"algorithm.adv_estimator": "grpo_passk", "trainer.resume_mode": "resume_path",
                       "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": 0.1}, get_plugin_manager())
    assert other.settings["algorithm.name"] == "grpo" and other.settings["algorithm.adv_estimator"] == "grpo_passk"
    assert {k for k, _ in other.unmapped} == {"trainer.resume_mode"}
    assert other.settings["actor.optim.warmup_ratio"] == 0.1  # of the run's optimizer steps, known at run time
    # verl steps its schedule per training step, rlx per optimizer step: 2 epochs x 4 mini-batches each.
    steps = translate({"actor_rollout_ref.actor.optim.lr_warmup_steps": 3, "actor_rollout_ref.actor.ppo_epochs": 2,
                       "data.train_batch_size": 64, "actor_rollout_ref.actor.ppo_mini_batch_size": 16,
                       "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": 0.1}, get_plugin_manager())
    assert steps.settings["actor.optim.warmup_steps"] == 24 and "actor.optim.warmup_ratio" not in steps.settings


def test_yaml_source_is_flattened_with_its_interpolations(tmp_path):
    path = tmp_path / "verl.yaml"
    path.write_text(yaml.safe_dump({
        "defaults": ["ppo_trainer"], "hydra": {"run": {"dir": "x"}},
        "data": {"train_batch_size": 32, "max_prompt_length": 128},
        "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": "${data.train_batch_size}"},
                              "model": {"path": "m"}},
        "trainer": {"experiment_name": "run-${data.max_prompt_length}"},
    }))
    keys = read_verl_source(str(path))
    assert keys == {"data.train_batch_size": 32, "data.max_prompt_length": 128,
                    "actor_rollout_ref.actor.ppo_mini_batch_size": 32, "actor_rollout_ref.model.path": "m",
                    "trainer.experiment_name": "run-128"}
    assert translate(str(path)).settings["actor.ppo_mini_batch_size"] == 32


def test_command_line_words_that_are_not_settings_are_skipped():
    keys = read_verl_source("CUDA_VISIBLE_DEVICES=0,1 python3 -m verl.trainer.main_ppo --some-flag "
                            "+data.seed=3 ++trainer.logger='[\"console\"]' --config-name=ppo.yaml $@ ; echo data.x=1")
    assert keys == {"data.seed": 3, "trainer.logger": ["console"]}


def test_docs_list_every_key_the_translation_knows():
    from rlx.cli import from_verl

    doc = (Path(__file__).parents[2] / "docs" / "from-verl.md").read_text()
    keys = [*from_verl.DIRECT, *from_verl.SPECIAL, *from_verl.VERL_DEFAULTS, *from_verl.IGNORED]
    missing = [k for k in keys if f"`{k}`" not in doc and f"`{k}*`" not in doc]
    assert missing == []


def test_values_other_than_verls_defaults_of_ignorable_keys_are_unmapped():
    t = translate({"trainer.val_only": True, "reward_model.reward_manager": "prime",
                   "trainer.del_local_ckpt_after_load": True}, get_plugin_manager())
    assert {k for k, _ in t.unmapped} == {"trainer.val_only", "reward_model.reward_manager"}
    fine = translate({"trainer.val_only": False, "reward_model.reward_manager": "naive"}, get_plugin_manager())
    assert fine.unmapped == []


@pytest.mark.slow
def test_train_from_verl_runs_the_translated_job(tmp_path):
    """A verl GRPO command line on rlx's built-in model and data trains one step with the translated settings."""
    out = tmp_path / "run"
    line = ("python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo data.train_files=builtin:arith-train "
            "data.train_batch_size=16 data.max_prompt_length=64 data.max_response_length=4 "
            "actor_rollout_ref.model.path=builtin:tiny-qwen2 actor_rollout_ref.actor.ppo_mini_batch_size=8 "
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 actor_rollout_ref.rollout.n=4 "
            "actor_rollout_ref.actor.use_kl_loss=True trainer.total_training_steps=1 trainer.logger=console "
            f"trainer.default_local_dir={out} trainer.val_before_train=False trainer.test_freq=-1")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "rlx", "train", "--from-verl", line, "trainer.save_hf_model=false"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["algorithm"]["name"] == "grpo" and config["reward"]["name"] == "router"
    assert config["rollout"]["n"] == 4 and config["actor"]["ppo_mini_batch_size"] == 8
    assert config["trainer"]["total_steps"] == 1 and config["trainer"]["save_freq"] == 0
    assert config["trainer"]["loggers"] == ["console", "jsonl"] and config["model"]["path"] == "builtin:tiny-qwen2"
    from rlx.plugins.loggers.jsonl import read_metrics

    (row,) = read_metrics(out)
    assert row["step"] == 1 and "reward/mean" in row
    assert "from-verl: " in proc.stderr  # the notes are shown
