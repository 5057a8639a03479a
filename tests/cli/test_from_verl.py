"""`rlx config from-verl` and `rlx train --from-verl`: verl's GSM8K quick-start, its GRPO example and the
seed's LoRA / dynamic-batch / reward-model run translate key by key; what rlx cannot follow is named and
stops the command (exit 2) unless --allow-unmapped; the translations pass `rlx config validate`."""

from __future__ import annotations

import os
import re
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


def test_a_misspelt_verl_key_is_named_with_the_key_meant():
    """verl's Hydra refuses a misspelt key; rlx names it unmapped, and says which known key was meant."""
    t = translate({"data.train_file": "x.parquet", "actor_rollout_ref.actor.ppo_mini_batchsize": 16,
                   "actor_rollout_ref.actr.optim.lr": 1e-6, "actor_rollout_ref.rolout.n": 4,
                   "actor_rollout_ref.actor.made_up_knob": 3}, get_plugin_manager())
    assert dict(t.unmapped) == {
        "data.train_file": "no rlx counterpart; did you mean data.train_files?",
        "actor_rollout_ref.actor.ppo_mini_batchsize":
            "no rlx counterpart; did you mean actor_rollout_ref.actor.ppo_mini_batch_size?",
        "actor_rollout_ref.actr.optim.lr": "no rlx counterpart; did you mean actor_rollout_ref.actor.optim.lr?",
        "actor_rollout_ref.rolout.n": "no rlx counterpart; did you mean actor_rollout_ref.rollout.n?",
        "actor_rollout_ref.actor.made_up_knob": "no rlx counterpart"}


@pytest.mark.parametrize("key", [
    "actor_rollout_ref.actor.optim.lr_decay_steps", "actor_rollout_ref.actor.optim.lr_wsd_decay_style",
    "actor_rollout_ref.actor.strategy", "actor_rollout_ref.actor.use_fused_kernels", "algorithm.kl_ctrl._target_",
    "actor_rollout_ref.rollout.pipeline_model_parallel_size", "critic.forward_micro_batch_size",
    "reward_model.micro_batch_size", "critic.optim.lr_warmup_steps"])
def test_real_verl_keys_near_known_ones_get_no_suggestion(key):
    """Keys of verl's own config that look like ones the translation knows are not called misspellings."""
    from rlx.cli.from_verl import _verl_key_meant

    assert _verl_key_meant(key) == ""


def test_command_line_words_that_are_not_settings_are_skipped():
    keys = read_verl_source("CUDA_VISIBLE_DEVICES=0,1 python3 -m verl.trainer.main_ppo --some-flag "
                            "+data.seed=3 ++trainer.logger='[\"console\"]' --config-name=ppo.yaml $@ ; echo data.x=1")
    assert keys == {"data.seed": 3, "trainer.logger": ["console"]}


def test_docs_list_every_key_the_translation_knows():
    from rlx.cli import from_verl

    doc = (Path(__file__).parents[2] / "docs" / "from-verl.md").read_text()
    keys = [*from_verl.DIRECT, *from_verl.SPECIAL, *from_verl.VERL_DEFAULTS, *from_verl.IGNORED,
            *(k for k, why in from_verl.AGENT_IGNORED.items() if why), *from_verl.AGENT_LOOPS,
            *from_verl.TOOL_FORMATS, *from_verl.REFUSED_TOOLS, from_verl.SANDBOX_FUSION]
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


# -- multi-turn rollouts with tool calls (verl's agent loop) ----------------------------------------------
# The multi-turn lines of verl's examples/sglang_multiturn/run_qwen3_4b_dapo_multiturn.sh (ReTool-style DAPO with
# a code interpreter); its whole script is in tests/data/verl_scripts.
MULTI_TURN = r"""PROJECT_DIR="$(pwd)"
python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files=$HOME/data/gsm8k/train.parquet \
    data.return_raw_chat=True \
    data.train_batch_size=32 \
    data.max_prompt_length=2048 \
    data.max_response_length=16384 \
    actor_rollout_ref.model.path=font-info/qwen3-4b-sft-SGLang-RL \
    actor_rollout_ref.actor.ppo_mini_batch_size=32 \
    actor_rollout_ref.rollout.name=sglang \
    actor_rollout_ref.rollout.mode=async \
    actor_rollout_ref.rollout.multi_turn.enable=True \
    actor_rollout_ref.rollout.multi_turn.max_user_turns=16 \
    actor_rollout_ref.rollout.multi_turn.max_assistant_turns=16 \
    actor_rollout_ref.rollout.multi_turn.tool_config_path=$PROJECT_DIR/recipe/retool/sandbox_fusion_tool_config.yaml \
    actor_rollout_ref.rollout.multi_turn.format=hermes \
    actor_rollout_ref.rollout.n=8 \
    trainer.total_epochs=15 $@
"""
# The shape of verl's sandbox-fusion tool config (examples/sglang_multiturn/config/tool_config/).
SANDBOX_TOOLS = {"tools": [{
    "class_name": "verl.tools.sandbox_fusion_tools.SandboxFusionTool",
    "config": {"sandbox_fusion_url": "https://sandbox.example/run_code", "num_workers": 10,
               "enable_global_rate_limit": True, "rate_limit": 10, "default_timeout": 30,
               "default_language": "python", "memory_limit_mb": 1024, "type": "native"},
    "tool_schema": {"type": "function", "function": {
        "name": "code_interpreter", "description": "A tool for executing code.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}}]}
MT = "actor_rollout_ref.rollout.multi_turn."


def _tool_config(folder: Path, tools: object) -> Path:
    path = folder / "recipe" / "retool" / "sandbox_fusion_tool_config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(tools))
    return path


def test_a_multi_turn_run_with_the_sandbox_code_tool_is_rlxs_tool_call_loop_with_python(home, monkeypatch):
    monkeypatch.chdir(home)  # verl's multi-turn scripts run from its checkout: $(pwd) holds the tool config
    _tool_config(home, SANDBOX_TOOLS)
    t = translate(MULTI_TURN, get_plugin_manager())
    assert t.unmapped == []
    s = t.settings
    assert (s["agent.name"], s["agent.tools"], s["agent.format"]) == ("tool_call", ["python"], "hermes")
    assert s["agent.max_turns"] == 16  # min(16 assistant turns, 16 tool turns + the answer after them)
    assert s["agent.max_tool_calls"] == 1  # verl's default max_parallel_calls, where rlx's is 4
    assert (s["tools.python.timeout_s"], s["tools.python.memory_mb"]) == (30.0, 1024)
    assert s["agent.tool_timeout_s"] > s["tools.python.timeout_s"]  # the sandbox's own deadline ends a call
    assert any("bubblewrap" in n and "code_interpreter" in n for n in t.notes)
    ignored = dict(t.ignored)
    assert "batches the turns" in ignored["actor_rollout_ref.rollout.mode"]
    assert "data.return_raw_chat" in ignored
    from rlx.validate import load_config

    load_config(get_plugin_manager(), overrides=t.overrides(), check_files=False)  # raises with the problems
    proc = rlx("config", "from-verl", MULTI_TURN, home=home)  # the CLI, from the same folder
    assert proc.returncode == 0, proc.stderr
    tree = yaml.safe_load(proc.stdout)
    assert tree["agent"]["tools"] == ["python"] and tree["tools"]["python"]["memory_mb"] == 1024
    path = home / "multi_turn.yaml"
    path.write_text(proc.stdout)
    check = rlx("config", "validate", "--config", str(path), f"trainer.output_dir={home / 'run'}", home=home)
    assert check.returncode == 0, check.stderr


@pytest.mark.parametrize(("given", "turns"), [
    ({"max_assistant_turns": 5}, 5),
    ({"max_user_turns": 1}, 2),  # one tool turn, then the model's answer
    ({"max_assistant_turns": 5, "max_user_turns": 1}, 2),
    ({"max_assistant_turns": 2, "max_user_turns": 7}, 2),
    ({"max_assistant_turns": None, "max_user_turns": 0}, None),  # verl: null and 0 are no limit
])
def test_turn_limits_are_the_fewest_assistant_turns_either_allows(given, turns):
    t = translate({MT + "enable": True, **{MT + k: v for k, v in given.items()}}, get_plugin_manager())
    assert t.unmapped == []
    assert t.settings.get("agent.max_turns") == turns
    if turns is None:  # no limit in verl: rlx's default stays, and the note says so
        assert any("max_assistant_turns and max_user_turns are null" in n for n in t.notes)


def test_multi_turn_limits_formats_and_loops_convert_by_meaning():
    pm = get_plugin_manager()
    t = translate({MT + "enable": True, MT + "max_parallel_calls": 3, MT + "max_tool_response_length": 500,
                   MT + "tool_response_truncate_side": "left", MT + "format": "llama3_json",
                   MT + "use_inference_chat_template": True, MT + "tokenization_sanity_check_mode": "disable",
                   "actor_rollout_ref.rollout.agent.num_workers": 8}, pm)
    assert t.unmapped == []
    s = t.settings
    assert (s["agent.max_tool_calls"], s["agent.max_tool_response_length"]) == (3, 500)
    assert s["agent.tool_response_truncate_side"] == "left"  # both keep the start
    assert s["agent.format"] == "llama3" and "agent.tools" not in s
    assert {MT + "use_inference_chat_template", MT + "tokenization_sanity_check_mode",
            "actor_rollout_ref.rollout.agent.num_workers"} <= {k for k, _ in t.ignored}
    loop = translate({"actor_rollout_ref.rollout.agent.default_agent_loop": "tool_agent"}, pm)
    assert loop.settings["agent.name"] == "tool_call" and loop.unmapped == []
    single = translate({"actor_rollout_ref.rollout.agent.default_agent_loop": "single_turn_agent",
                        MT + "format": "hermes"}, pm)
    assert "agent.name" not in single.settings and single.unmapped == []
    assert (MT + "format", "the multi-turn loop is off (multi_turn.enable is not true): verl does not read it") \
        in single.ignored  # verl's grpo_trainer/run_qwen2-7b_seq_balance.sh sets it with no multi-turn


def test_what_rlxs_agents_cannot_follow_is_named(tmp_path):
    pm = get_plugin_manager()
    t = translate({MT + "enable": True, MT + "format": "gpt-oss",
                   "actor_rollout_ref.rollout.agent.agent_loop_config_path": "loops.yaml",
                   "actor_rollout_ref.rollout.agent.default_agent_loop": "react_agent"}, pm)
    why = dict(t.unmapped)
    assert "gpt-oss" in why[MT + "format"]
    assert "docs/agents.md" in why["actor_rollout_ref.rollout.agent.agent_loop_config_path"]
    assert "react_agent" in why["actor_rollout_ref.rollout.agent.default_agent_loop"]
    assert "agent.format" not in t.settings
    tools = _tool_config(tmp_path, {"tools": [
        {"class_name": "verl.tools.gsm8k_tool.Gsm8kTool", "config": {"type": "native"}},
        {"class_name": "verl.tools.search_tool.SearchTool", "config": {}},
        {"class_name": "my_project.tools.Weather", "config": {}},
        SANDBOX_TOOLS["tools"][0]]})
    t = translate({MT + "enable": True, MT + "tool_config_path": str(tools)}, pm)
    reasons = [why for key, why in t.unmapped if key == MT + "tool_config_path"]
    assert len(reasons) == 2
    assert "SearchTool" in reasons[0] and "retrieval" in reasons[0]
    assert "my_project.tools.Weather" in reasons[1] and "rlx tool plugin" in reasons[1]
    # verl's gsm8k answer tool is rlx's calc_gsm8k_reward; --allow-unmapped runs with the tools rlx has
    assert t.settings["agent.tools"] == ["calc_gsm8k_reward", "python"]
    assert any("calc_gsm8k_reward" in n for n in t.notes)


def test_tool_configs_are_read_as_data_and_a_bad_one_is_a_user_error(tmp_path):
    from rlx.errors import UserError

    missing = translate({MT + "enable": True, MT + "tool_config_path": "/placeholder/tools.yaml"})
    assert "is not on this machine" in dict(missing.unmapped)[MT + "tool_config_path"]
    binary = tmp_path / "tools.yaml"
    binary.write_bytes(b"\xff\xfe\x00tools")
    with pytest.raises(UserError, match=r"tool_config_path=.*tools\.yaml: not a text file"):
        translate({MT + "enable": True, MT + "tool_config_path": str(binary)})
    shape = tmp_path / "shape.yaml"
    shape.write_text("tools: {class_name: x}\n")
    with pytest.raises(UserError, match=r"shape\.yaml: not a verl tool config"):
        translate({MT + "enable": True, MT + "tool_config_path": str(shape)})
    # YAML tags that would build Python objects are never followed (safe_load).
    tagged = tmp_path / "tagged.yaml"
    tagged.write_text("tools: !!python/object/apply:os.system ['touch " + str(tmp_path / "ran") + "']\n")
    with pytest.raises(UserError, match="cannot read it as YAML"):
        translate({MT + "enable": True, MT + "tool_config_path": str(tagged)})
    assert not (tmp_path / "ran").exists()
    off = translate({MT + "tool_config_path": str(binary)})  # no multi-turn loop: verl picks it per data row
    assert "multi_turn.enable=True" in dict(off.unmapped)[MT + "tool_config_path"]


# -- verl's interactions (a simulated user) -----------------------------------------------------------------
# A script in the shape of verl's examples/sglang_multiturn/run_qwen2.5-0.5b_gsm8k_multiturn_w_interaction.sh: the
# multi-turn loop with no tools and the gsm8k interaction, from verl's checkout as the working folder.
INTERACTION = r"""PROJECT_DIR="$(pwd)"
python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files=$HOME/data/gsm8k/train.parquet \
    data.train_batch_size=64 \
    data.max_response_length=3072 \
    actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.multi_turn.enable=True \
    actor_rollout_ref.rollout.multi_turn.max_user_turns=5 \
    actor_rollout_ref.rollout.multi_turn.interaction_config_path="$PROJECT_DIR/config/interaction.yaml" \
    trainer.total_epochs=1 $@
"""
GSM8K_INTERACTION = "verl.interactions.gsm8k_interaction.Gsm8kInteraction"


def _interaction_config(folder: Path, data: object) -> Path:
    path = folder / "config" / "interaction.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def test_verls_gsm8k_interaction_is_rlxs_and_the_run_validates(home, monkeypatch):
    monkeypatch.chdir(home)
    _interaction_config(home, {"interaction": [{"name": "gsm8k", "class_name": GSM8K_INTERACTION, "config": {}}]})
    t = translate(INTERACTION, get_plugin_manager())
    assert t.unmapped == []
    s = t.settings
    assert (s["agent.name"], s["agent.interactions"]) == ("tool_call", ["gsm8k"]) and "agent.tools" not in s
    assert s["agent.max_turns"] == 6  # five user turns answered, then the model's last turn
    assert any("extra_info['turn_scores']" in n and "interaction_kwargs.name" in n for n in t.notes)
    from rlx.validate import load_config

    cfg = load_config(get_plugin_manager(), overrides=t.overrides(), check_files=False).config
    assert cfg.agent.interactions == ["gsm8k"] and cfg.agent.tools == []
    proc = rlx("config", "from-verl", INTERACTION, home=home)
    assert proc.returncode == 0, proc.stderr
    path = home / "interaction.yaml"
    path.write_text(proc.stdout)
    assert yaml.safe_load(proc.stdout)["agent"]["interactions"] == ["gsm8k"]
    check = rlx("config", "validate", "--config", str(path), f"trainer.output_dir={home / 'run'}", home=home)
    assert check.returncode == 0, check.stderr


def test_an_interaction_named_by_its_class_and_with_tools_as_in_verls_4xgpu_scripts(tmp_path):
    """No name: verl names it by its class (Gsm8kInteraction -> gsm8k); its config is noted as not carried over."""
    path = _interaction_config(tmp_path, {"interaction": [{"class_name": GSM8K_INTERACTION, "config": {"x": 1}}]})
    tools = tmp_path / "tools.yaml"
    tools.write_text(yaml.safe_dump({"tools": [{"class_name": "verl.tools.gsm8k_tool.Gsm8kTool", "config": {}}]}))
    t = translate({MT + "enable": True, MT + "tool_config_path": str(tools), MT + "interaction_config_path": str(path),
                   MT + "max_user_turns": 1}, get_plugin_manager())
    assert t.unmapped == []
    s = t.settings
    assert (s["agent.tools"], s["agent.interactions"], s["agent.max_turns"]) == (["calc_gsm8k_reward"], ["gsm8k"], 2)
    assert any("{'x': 1}" in n and "not carried over" in n for n in t.notes)


def test_an_interaction_rlx_has_not_is_named_as_unmapped(tmp_path):
    path = _interaction_config(tmp_path, {"interaction": [
        {"name": "weather", "class_name": "verl.interactions.weather_interaction.WeatherInteraction", "config": {}},
        {"name": "math_checker", "class_name": GSM8K_INTERACTION, "config": {}}]})
    t = translate({MT + "enable": True, MT + "interaction_config_path": str(path)}, get_plugin_manager())
    reasons = [why for key, why in t.unmapped if key == MT + "interaction_config_path"]
    assert len(reasons) == 2
    assert "WeatherInteraction" in reasons[0] and "rlx interaction plugin" in reasons[0]
    assert "'math_checker'" in reasons[1] and "named gsm8k" in reasons[1]
    assert "agent.interactions" not in t.settings
    empty = translate({MT + "enable": True, MT + "interaction_config_path": str(_interaction_config(
        tmp_path, {"interaction": []}))})
    assert dict(empty.ignored)[MT + "interaction_config_path"] == "the interaction config lists no interactions"
    off = translate({MT + "interaction_config_path": str(path)})  # no multi-turn loop
    assert "multi_turn.enable=True" in dict(off.unmapped)[MT + "interaction_config_path"]
    null = translate({MT + "enable": True, MT + "interaction_config_path": None})
    assert (MT + "interaction_config_path", "null: no simulated user") in null.ignored


@pytest.mark.parametrize(("content", "expect"), [
    (None, "no such file"),
    (b"\xff\xfe\x00interaction", "not a text file"),
    ("interaction: [unclosed\n", "cannot read it as YAML"),
    ("interaction: !!python/object/apply:os.system ['true']\n", "cannot read it as YAML"),  # safe_load: no tags
    ("interaction: {class_name: x}\n", "not a verl interaction config"),
    ("- class_name: x\n", "not a verl interaction config"),
    ("interaction: [{name: gsm8k}]\n", "not a verl interaction config"),
])
def test_a_bad_interaction_config_is_a_user_error_naming_the_key_and_path(tmp_path, content, expect):
    from rlx.errors import UserError

    path = tmp_path / "interaction.yaml"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(UserError, match=rf"interaction_config_path={re.escape(str(path))}: {expect}"):
        translate({MT + "enable": True, MT + "interaction_config_path": str(path)})


def test_a_missing_interaction_config_exits_2(home):
    proc = rlx("config", "from-verl", "python3 -m verl.trainer.main_ppo actor_rollout_ref.rollout.multi_turn.enable="
               "True actor_rollout_ref.rollout.multi_turn.interaction_config_path=/nowhere/i.yaml", home=home)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "interaction_config_path=/nowhere/i.yaml: no such file" in proc.stderr


def test_a_scripts_config_name_file_is_read_under_the_command_line(tmp_path, monkeypatch):
    """verl's multi-turn examples keep multi_turn.enable in their --config-name file."""
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "examples" / "config"
    config.mkdir(parents=True)
    (config / "multiturn_grpo.yaml").write_text(yaml.safe_dump({
        "hydra": {"searchpath": ["file://verl/trainer/config"]}, "defaults": ["ppo_trainer", "_self_"],
        "data": {"max_prompt_length": 1024, "train_batch_size": 256},
        "actor_rollout_ref": {"hybrid_engine": True,
                              "rollout": {"multi_turn": {"enable": True, "max_assistant_turns": 5}}}}))
    script = ('CONFIG_PATH="$(pwd)/examples/config"\npython3 -m verl.trainer.main_ppo --config-path="$CONFIG_PATH" '
              "--config-name='multiturn_grpo' data.train_batch_size=64 "
              "actor_rollout_ref.rollout.multi_turn.max_user_turns=1")
    t = translate(script, get_plugin_manager())
    assert t.unmapped == []
    s = t.settings
    assert s["data.train_batch_size"] == 64 and s["data.max_prompt_length"] == 1024  # the command line wins
    assert s["agent.name"] == "tool_call" and s["agent.max_turns"] == 2
    assert any(n.startswith("--config-name=multiturn_grpo: the settings of ") for n in t.notes)
    away = translate(script.replace("multiturn_grpo", "elsewhere"), get_plugin_manager())
    assert "agent.name" not in away.settings
    assert any("is not on this machine" in n for n in away.notes)


MEGATRON_OPTIM = "actor_rollout_ref.actor.optim.override_optimizer_config."


def test_megatron_optimizer_offload_is_placement_and_lower_precision_states_are_named():
    pm = get_plugin_manager()
    offload = {"actor_rollout_ref.actor.strategy": "megatron", MEGATRON_OPTIM + "optimizer_cpu_offload": True,
               MEGATRON_OPTIM + "optimizer_offload_fraction": 1.0,
               MEGATRON_OPTIM + "overlap_cpu_optimizer_d2h_h2d": True,
               MEGATRON_OPTIM + "use_precision_aware_optimizer": True}
    t = translate(offload, pm)
    assert t.unmapped == [] and t.settings["backend.name"] == "megatron"
    assert {k for k, _ in t.ignored} >= {k for k in offload if k.startswith(MEGATRON_OPTIM)}
    low = translate({**offload, MEGATRON_OPTIM + "exp_avg_dtype": "bf16"}, pm)
    assert {k for k, _ in low.unmapped} == {MEGATRON_OPTIM + "use_precision_aware_optimizer",
                                            MEGATRON_OPTIM + "exp_avg_dtype"}
    other = translate({**offload, MEGATRON_OPTIM + "adam_eps": 1e-5}, pm)
    assert [k for k, _ in other.unmapped] == [MEGATRON_OPTIM + "adam_eps"]
    fsdp = translate({MEGATRON_OPTIM + "bf16_stochastic_round": True}, pm)  # the FSDP optimizer's kwargs
    assert [k for k, _ in fsdp.unmapped] == [MEGATRON_OPTIM + "bf16_stochastic_round"]


def test_verls_megatron_config_name_is_the_megatron_strategy():
    keys = read_verl_source("python3 -m verl.trainer.main_ppo --config-path=config "
                            "--config-name='ppo_megatron_trainer.yaml' actor_rollout_ref.model.path=m "
                            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2")
    assert keys["actor_rollout_ref.actor.strategy"] == "megatron"
    t = translate(keys, get_plugin_manager())
    assert t.settings["backend.name"] == "megatron" and t.settings["backend.tensor_model_parallel_size"] == 2
    lora = translate({**keys, "actor_rollout_ref.model.lora.rank": 8}, get_plugin_manager())
    assert lora.settings["backend.name"] == "fsdp2"  # rlx's megatron backend has no LoRA
    assert "fused LoRA" in dict(lora.unmapped)["actor_rollout_ref.model.lora.rank"]  # verl's default lora type


MEG = "actor_rollout_ref.actor.megatron."
OTC = MEG + "override_transformer_config."
ML = "actor_rollout_ref.model.lora."


def _megatron(model: str, **keys: object) -> dict[str, object]:
    return {"actor_rollout_ref.actor.strategy": "megatron", "actor_rollout_ref.model.path": model,
            "data.train_files": "/d.parquet", "algorithm.adv_estimator": "grpo", **keys}


def test_a_megatron_mixture_of_experts_run_trains_on_fsdp2_with_placement_ignored():
    pm = get_plugin_manager()
    t = translate(_megatron("deepseek-ai/DeepSeek-V3", **{
        MEG + "expert_model_parallel_size": 8, MEG + "expert_tensor_parallel_size": 1,
        MEG + "tensor_model_parallel_size": 4, MEG + "pipeline_model_parallel_size": 2,
        OTC + "moe_permute_fusion": True, OTC + "moe_enable_deepep": True, OTC + "moe_token_dispatcher_type": "flex",
        OTC + "moe_grouped_gemm": True, OTC + "moe_router_dtype": "fp32", OTC + "moe_aux_loss_coeff": 0.01,
        OTC + "recompute_granularity": "full"}), pm)
    assert not t.unmapped, t.unmapped
    assert t.settings["backend.name"] == "fsdp2" and t.settings["model.gradient_checkpointing"] is True
    assert not any(k.startswith("backend.") and k != "backend.name" for k in t.settings)  # no megatron options
    ignored = dict(t.ignored)
    assert "FSDP shards every expert" in ignored[MEG + "expert_model_parallel_size"]
    assert "float32 too" in ignored[OTC + "moe_router_dtype"]  # DeepSeek-V3's HF router is float32
    assert "never reads the coefficient" in ignored[OTC + "moe_aux_loss_coeff"]
    assert any("trains on rlx's fsdp2 backend" in n for n in t.notes)
    # a dense megatron run stays on the megatron backend
    assert translate(_megatron("/m", **{MEG + "expert_model_parallel_size": 1}), pm).settings["backend.name"] == \
        "megatron"


@pytest.mark.parametrize(("key", "value", "words"), [
    (OTC + "moe_router_dtype", "fp64", "auto (the model's dtype) or float32"),  # rlx has no float64 router
    (OTC + "moe_z_loss_coeff", 0.001, "z-loss"),
    (OTC + "moe_router_load_balancing_type", "aux_loss", "load-balancing loss"),
    (OTC + "moe_expert_capacity_factor", 1.25, "drops the tokens"),
    (OTC + "moe_router_topk", 4, "model's shape or routing"),
])
def test_megatron_moe_settings_that_change_the_math_are_named(key, value, words):
    t = translate(_megatron("Qwen/Qwen3-30B-A3B", **{MEG + "expert_model_parallel_size": 4, key: value}),
                  get_plugin_manager())
    assert t.settings["backend.name"] == "fsdp2"
    assert words in dict(t.unmapped)[key]


def test_the_router_dtype_is_read_from_a_local_model_folders_config(tmp_path):
    pm = get_plugin_manager()
    (tmp_path / "config.json").write_text('{"model_type": "deepseek_v3", "n_routed_experts": 256}')
    t = translate(_megatron(str(tmp_path), **{OTC + "moe_router_dtype": "fp32"}), pm)
    assert not t.unmapped and t.settings["backend.name"] == "fsdp2"
    assert "float32 too" in dict(t.ignored)[OTC + "moe_router_dtype"] and "model.router_dtype" not in t.settings
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_moe", "num_experts": 128}')
    t = translate(_megatron(str(tmp_path), **{OTC + "moe_router_dtype": "fp32"}), pm)
    assert not t.unmapped and t.settings["backend.name"] == "fsdp2"
    assert t.settings["model.router_dtype"] == "float32"
    assert t.sources["model.router_dtype"] == OTC + "moe_router_dtype"
    # Qwen3-VL-MoE's experts are counted in its text_config; Qwen3-VL-8B's text_config has none: no router.
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_vl_moe", "text_config": {"num_experts": 128}}')
    assert translate(_megatron(str(tmp_path), **{OTC + "moe_router_dtype": "fp32"}), pm).settings[
        "model.router_dtype"] == "float32"
    (tmp_path / "config.json").write_text('{"model_type": "qwen3", "num_hidden_layers": 2}')
    t = translate(_megatron(str(tmp_path), **{OTC + "moe_router_dtype": "fp32"}), pm)
    assert not t.unmapped and "model.router_dtype" not in t.settings
    assert "no experts" in dict(t.ignored)[OTC + "moe_router_dtype"]


@pytest.mark.parametrize(("model", "router_dtype"), [
    ("Qwen/Qwen3-30B-A3B-Base", "float32"), ("/models/Qwen3-235B-A22B", "float32"),
    ("Qwen/Qwen3-VL-30B-A3B-Instruct", "float32"), ("Qwen/Qwen1.5-MoE-A2.7B", "float32"),
    ("mistralai/Mixtral-8x7B-v0.1", "float32"), ("", "float32"),  # no name: it may have experts
    ("Qwen/Qwen3-8B", None), ("/models/Qwen3-VL-8B-Instruct", None)])
def test_a_float32_router_is_model_router_dtype_unless_the_model_has_no_experts(model, router_dtype):
    t = translate(_megatron(model, **{OTC + "moe_router_dtype": "fp32", OTC + "moe_grouped_gemm": True}),
                  get_plugin_manager())
    assert not t.unmapped, t.unmapped
    assert t.settings.get("model.router_dtype") == router_dtype
    if router_dtype is None:  # a dense model's MoE settings are moot: a text model stays on rlx's megatron backend
        ignored = dict(t.ignored)
        assert "no experts" in ignored[OTC + "moe_router_dtype"] and "no experts" in ignored[OTC + "moe_grouped_gemm"]
        assert t.settings["backend.name"] == ("fsdp2" if "-VL-" in model else "megatron")  # fsdp2 has vision
    else:
        assert t.settings["backend.name"] == "fsdp2"


def test_routing_replay_stays_refused_on_fsdp2():
    t = translate(_megatron("Qwen/Qwen3-30B-A3B", **{
        MEG + "expert_model_parallel_size": 4, "actor_rollout_ref.actor.router_replay.mode": "R3",
        "actor_rollout_ref.rollout.enable_rollout_routing_replay": True}), get_plugin_manager())
    assert "routing replay" in dict(t.unmapped)["actor_rollout_ref.actor.router_replay.mode"]
    assert "actor_rollout_ref.rollout.enable_rollout_routing_replay" in dict(t.unmapped)


def test_megatron_canonical_lora_is_rlxs_lora_on_fsdp2():
    pm = get_plugin_manager()
    keys = _megatron("/m", **{ML + "rank": 16, ML + "alpha": 32, ML + "type": "canonical_lora",
                              ML + "lora_A_init_method": "kaiming", ML + "lora_B_init_method": "zero",
                              ML + "dropout": 0.05, ML + "dropout_position": "pre", ML + "merge": False,
                              ML + "target_modules": ["linear_q", "linear_k", "linear_v", "linear_proj",
                                                      "linear_fc1_up", "linear_fc1_gate", "linear_fc2"]})
    t = translate(keys, pm)
    assert not t.unmapped, t.unmapped
    s = t.settings
    assert s["backend.name"] == "fsdp2" and s["model.lora_rank"] == 16 and s["model.lora_alpha"] == 32
    assert s["model.lora_dropout"] == 0.05
    assert s["model.target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "gate_proj", "down_proj"]
    # verl's default A initialisation (xavier_normal) has no peft counterpart; post-adapter dropout neither
    del keys[ML + "lora_A_init_method"]
    t = translate({**keys, ML + "dropout_position": "post"}, pm)
    assert "xavier" in dict(t.unmapped)[ML + "lora_A_init_method"]
    assert ML + "dropout_position" in dict(t.unmapped)
    # canonical LoRA on a mixture-of-experts model: the experts' adapters have no peft counterpart
    t = translate({**keys, ML + "lora_A_init_method": "kaiming", MEG + "expert_model_parallel_size": 4}, pm)
    assert "experts" in dict(t.unmapped)[ML + "rank"]


def test_a_reward_model_served_by_verls_reward_loop_is_rlxs_reward_model():
    pm = get_plugin_manager()
    rm = {"algorithm.adv_estimator": "grpo", "data.max_prompt_length": 1024, "data.max_response_length": 512,
          "reward_model.enable": True, "reward_model.model.path": "org/rm", "reward_model.rollout.name": "vllm",
          "reward_model.rollout.gpu_memory_utilization": 0.8, "reward_model.rollout.tensor_model_parallel_size": 2,
          "reward_model.rollout.prompt_length": 2048, "reward_model.rollout.response_length": 1024}
    t = translate(rm, pm)
    assert t.unmapped == [] and t.settings["reward.name"] == "reward_model"
    assert t.settings["reward.max_length"] == 3072  # nothing verl scores whole is cut at the start
    assert any("scores each conversation whole" in note for note in t.notes)
    short = translate({k: v for k, v in rm.items() if "length" not in k or k.startswith("data.")}, pm)
    assert short.settings["reward.max_length"] == 1536
    legacy = translate({**rm, "reward_model.use_reward_loop": False}, pm)
    assert legacy.settings["reward.max_length"] == 1536  # verl's worker: the prompt + response width
    assert "does not read it" in dict(legacy.ignored)["reward_model.rollout.name"]
    judge = translate({**rm, "custom_reward_function.path": "judge.py"}, pm)  # verl's generative reward model
    assert "custom_reward_function.path" in dict(judge.unmapped)


@pytest.mark.parametrize("model, files, refused", [
    ("Qwen/Qwen2.5-VL-7B-Instruct", "~/data/geo3k/train.parquet", False),  # rlx feeds it the images
    ("/models/Qwen3-VL-8B-Instruct", "~/data/math/train.parquet", False),
    ("zai-org/GLM-4.1V-9B-Thinking", "x.parquet", False),
    ("openbmb/MiniCPM-o-2_6", "x.parquet", True),  # another family: its image tokens are counted otherwise
    ("llava-hf/llava-1.5-7b-hf", "x.parquet", True),
    ("Qwen/Qwen2.5-3B-Instruct", "~/data/geo3k/train.parquet", True),  # images for a language model
    ("Qwen/Qwen2.5-7B-Instruct", "~/data/gsm8k/train.parquet", False),
    ("sfairXC/FsfairX-LLaMA3-RM-v0.1", "x.parquet", False),
])
def test_vision_runs_of_the_families_rlx_feeds_translate_and_others_are_named(model, files, refused):
    t = translate({"actor_rollout_ref.model.path": model, "data.train_files": files}, get_plugin_manager())
    assert ("data.image_key" in dict(t.unmapped)) is refused
    if refused:
        assert "vision" in dict(t.unmapped)["data.image_key"]


def test_vision_keys_convert_by_meaning_and_a_megatron_vision_run_trains_on_fsdp2():
    pm = get_plugin_manager()
    base = {"actor_rollout_ref.model.path": "Qwen/Qwen2.5-VL-7B-Instruct", "data.image_key": "images",
            "data.return_multi_modal_inputs": True, "actor_rollout_ref.actor.freeze_vision_tower": False,
            "data.image_patch_size": 14, "data.video_key": None}
    t = translate(base, pm)
    assert not t.unmapped
    assert t.settings["data.image_key"] == "images"
    ignored = dict(t.ignored)
    assert {"data.return_multi_modal_inputs", "data.image_patch_size", "data.video_key"} <= set(ignored)
    assert t.settings["actor.freeze_vision_tower"] is False
    for key, value in (("data.video_key", "videos"), ("data.return_multi_modal_inputs", False)):
        t = translate({**base, key: value}, pm)
        assert key in dict(t.unmapped), key
    frozen = translate({**base, "actor_rollout_ref.actor.freeze_vision_tower": True}, pm)
    assert not frozen.unmapped and frozen.settings["actor.freeze_vision_tower"] is True
    megatron = translate({**base, "actor_rollout_ref.actor.strategy": "megatron",
                          "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": 4}, pm)
    assert megatron.settings["backend.name"] == "fsdp2" and not megatron.unmapped
    assert any("vision" in note for note in megatron.notes)


def test_machinery_keys_of_verls_scripts_are_ignored_with_a_reason():
    pm = get_plugin_manager()
    keys = {"actor_rollout_ref.rollout.expert_parallel_size": 8, "data.filter_overlong_prompts_workers": 64,
            "actor_rollout_ref.rollout.over_sample_rate": 0.1, "actor_rollout_ref.actor.use_prefix_grouper": True,
            "actor_rollout_ref.ref.entropy_from_logits_with_chunking": True,
            "actor_rollout_ref.model.enable_activation_offload": True,
            "actor_rollout_ref.model.fused_kernel_options.impl_backend": "triton",
            "trainer.resume_from_path": "checkpoints/"}
    t = translate(keys, pm)
    assert t.unmapped == [] and set(dict(t.ignored)) >= set(keys)
    assert "not read by verl" in dict(t.ignored)["actor_rollout_ref.rollout.over_sample_rate"]
    by_path = translate({"trainer.resume_mode": "resume_path", "trainer.resume_from_path": "ckpt/global_step_5"}, pm)
    assert set(dict(by_path.unmapped)) == {"trainer.resume_mode", "trainer.resume_from_path"}
    bucket = translate({"actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes": 4096,
                        "actor_rollout_ref.rollout.checkpoint_engine.backend": "naive",
                        "actor_rollout_ref.actor.optim.lr_decay_style": "cosine"}, pm)
    assert bucket.unmapped == [] and bucket.settings["launcher.bucket_size_mb"] == 4096.0
    assert bucket.settings["actor.optim.lr_schedule"] == "cosine"
    inverse = translate({"actor_rollout_ref.actor.optim.lr_decay_style": "inverse_square_root"}, pm)
    assert "actor_rollout_ref.actor.optim.lr_decay_style" in dict(inverse.unmapped)


def test_the_tokenizers_remote_code_is_left_out_with_a_note():
    t = translate({"data.trust_remote_code": True, "critic.model.trust_remote_code": True}, get_plugin_manager())
    assert t.unmapped == [] and "model.trust_remote_code" not in t.settings
    assert any("model.trust_remote_code=true" in note for note in t.notes)


def test_a_brace_of_the_checkpoint_folder_itself_stays_a_brace():
    t = translate({"trainer.default_local_dir": "/ckpts/${trainer.project_name}/run_8npu}"}, get_plugin_manager())
    assert t.settings["trainer.output_dir"] == "/ckpts/{project}/run_8npu}}"
    assert t.settings["trainer.output_dir"].format(project="p", experiment="e") == "/ckpts/p/run_8npu}"
    bad = translate({"trainer.default_local_dir": "/ckpts/${oc.env:X}"}, get_plugin_manager())
    assert "trainer.default_local_dir" in dict(bad.unmapped)


def test_a_config_file_on_verls_megatron_defaults_is_the_megatron_strategy(tmp_path):
    (tmp_path / "mt_megatron.yaml").write_text(yaml.safe_dump({
        "defaults": ["ppo_megatron_trainer", "_self_"], "data": {"train_batch_size": 32}}))
    keys = read_verl_source(f"python3 -m verl.trainer.main_ppo --config-path={tmp_path} --config-name=mt_megatron "
                            "actor_rollout_ref.model.path=m actor_rollout_ref.actor.megatron.context_parallel_size=2")
    assert keys["actor_rollout_ref.actor.strategy"] == "megatron" and keys["data.train_batch_size"] == 32
    t = translate(keys, get_plugin_manager())
    assert t.settings["backend.name"] == "megatron" and "backend.context_parallel_size" not in t.settings
    assert "one rank" in dict(t.ignored)["actor_rollout_ref.actor.megatron.context_parallel_size"]


def test_verls_random_test_sampler_is_a_shuffle_and_another_sampler_is_named():
    pm = get_plugin_manager()
    random = {"data.shuffle": False, "data.sampler.class_name": "RandomCurriculumSampler",
              "data.sampler.class_path": "pkg://tests.utils.dataset.test_create_rl_sampler_on_cpu"}
    t = translate(random, pm)
    assert t.unmapped == [] and t.settings["data.shuffle"] is True  # the sampler wins over data.shuffle in verl
    other = translate({**random, "data.sampler.class_name": "MyCurriculum"}, pm)
    assert "custom sampler" in dict(other.unmapped)["data.sampler.class_name"]
