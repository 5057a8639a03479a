"""The built-in GRPO job from Python. Extra arguments are dotted overrides, as on the command line."""

import sys

from rlx.registry import get_plugin_manager
from rlx.trainer import Trainer
from rlx.validate import load_config

if __name__ == "__main__":
    pm = get_plugin_manager()
    resolved = load_config(pm, preset="tiny", overrides=sys.argv[1:])
    metrics = Trainer(resolved, pm).fit()
    accuracy = metrics.get("val/acc")  # present when the last step ran a validation (every 20 steps)
    print(f"final mean reward {metrics['reward/mean']:.3f}"
          + (f", exact-match accuracy {accuracy:.2f}" if accuracy is not None else ""))
