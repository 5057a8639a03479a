"""The run's services, used by the controller (:mod:`rlx.trainer`) and the commands: checkpoints
(:mod:`~rlx.run.checkpoint`), prompt data (:mod:`~rlx.run.data`), models and tokenizers (:mod:`~rlx.run.models`),
evaluation (:mod:`~rlx.run.evaluation`), the reward runner (:mod:`~rlx.run.rewards`, its worker
:mod:`~rlx.run.reward_worker`), throughput metrics (:mod:`~rlx.run.metrics`), the run folder's files
(:mod:`~rlx.run.files`) and the program sandbox (:mod:`~rlx.run.sandbox`). A layer below the controller and
above the contracts: nothing here imports a plugin."""
