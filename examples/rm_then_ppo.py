"""From preference pairs to PPO in one flow, on the CPU in a few minutes.

1. ``rlx rm train`` on the built-in preference task (preset ``rm_tiny``: "What is a+b?", the correct sum
   chosen, a wrong digit rejected) writes a reward model to ``OUT/rm/hf_model``.
2. PPO on the built-in addition task (preset ``tiny``) with a ``mix`` reward: 0.7 x the exact-match rule
   (``arith``) + 0.3 x that reward model, each component logged on its own (``reward/arith/score``,
   ``reward/rm/score``) in ``OUT/ppo/metrics.jsonl``.

The same from the command line::

    rlx rm train trainer.output_dir=OUT/rm
    rlx train --algorithm ppo --config mix.yaml --preset tiny trainer.output_dir=OUT/ppo

with ``mix.yaml`` holding the ``reward`` section built below.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import transformers

from rlx.config import build_raw, set_dotted
from rlx.plugins.reward_modeling.config import load_rm_config
from rlx.plugins.reward_modeling.trainer import train_reward_model
from rlx.registry import get_plugin_manager
from rlx.trainer import Trainer
from rlx.validate import resolve


def mix_reward(rm_path: Path) -> dict:
    return {"name": "mix", "components": [
        {"name": "arith", "weight": 0.7},
        {"name": "reward_model", "weight": 0.3, "label": "rm",
         "options": {"path": str(rm_path), "device": "cpu", "batch_size": 128}},
    ]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="outputs/rm_then_ppo", help="Folder for both runs.")
    parser.add_argument("--rm-steps", type=int, default=300, help="Reward-model training steps (the preset's 300).")
    parser.add_argument("--ppo-steps", type=int, default=30, help="PPO steps.")
    args = parser.parse_args()
    out = Path(args.out)
    transformers.utils.logging.set_verbosity_error()  # no load reports for the new heads
    transformers.utils.logging.disable_progress_bar()
    pm = get_plugin_manager()

    rm_cfg = load_rm_config(pm, preset="rm_tiny", overrides=[
        f"trainer.output_dir={out / 'rm'}", f"trainer.total_steps={args.rm_steps}",
        f"trainer.test_freq={args.rm_steps}"])
    rm_run, rm_metrics = train_reward_model(rm_cfg, pm)
    rm_path = rm_run.run_dir / "hf_model"
    print(f"reward model: {rm_path}, pairwise validation accuracy {rm_metrics['val/accuracy']:.3f}")

    raw = build_raw(preset="tiny", shortcuts={"algorithm": "ppo"},
                    overrides=[f"trainer.output_dir={out / 'ppo'}", f"trainer.total_steps={args.ppo_steps}"])
    set_dotted(raw, "reward", mix_reward(rm_path))
    metrics = Trainer(resolve(raw, pm, check_run_dir=True), pm).fit()
    print(f"PPO step {args.ppo_steps}: reward {metrics['reward/mean']:.3f} = 0.7 x arith "
          f"{metrics['reward/arith/score']:.3f} + 0.3 x reward model {metrics['reward/rm/score']:.3f}"
          + (f"; exact-match accuracy {metrics['val/acc']:.2f}" if "val/acc" in metrics else ""))


if __name__ == "__main__":
    main()
