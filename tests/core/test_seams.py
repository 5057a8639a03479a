"""The typed seams of issue 26: worker calls by method reference, what an algorithm needs as data, the
deprecated import paths of moved modules, and the layering (core imports no plugin, no cycles)."""

from __future__ import annotations

import ast
import importlib
import warnings
from pathlib import Path

import pytest

from rlx.protocols import AlgorithmNeeds, RewardScorer, RolloutEngine, TrainWorker, method_name, needs_of

ROOT = Path(__file__).resolve().parents[2]


def test_a_method_reference_gives_its_name_and_a_string_is_deprecated() -> None:
    assert method_name(TrainWorker.update) == "update"
    assert method_name(RolloutEngine.generate) == "generate"
    assert method_name(RewardScorer.score) == "score"
    assert method_name(object.__getattribute__) == "__getattribute__"
    with pytest.warns(DeprecationWarning, match=r"TrainWorker\.update"):
        assert method_name("update") == "update"

    def local() -> None: ...

    with pytest.raises(TypeError, match="method of a class"):
        method_name(local)
    with pytest.raises(TypeError):
        method_name(len)  # a builtin function, no class


def _controller_calls() -> set[tuple[str, str]]:
    """(protocol, method) of every method reference core/ hands a worker group."""
    found = set()
    for path in (ROOT / "core").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in ("call", "call_all") and node.args:
                first = node.args[0]
                assert not isinstance(first, ast.Constant), f"{path}: a worker method named by a string"
                if isinstance(first, ast.Attribute) and isinstance(first.value, ast.Name):
                    found.add((first.value.id, first.attr))
    return found


def test_every_method_the_controller_calls_is_declared_by_its_protocol_and_built_in_workers_have_it() -> None:
    calls = _controller_calls()
    assert ("TrainWorker", "update") in calls and ("RolloutEngine", "generate") in calls
    protocols = {"TrainWorker": TrainWorker, "RolloutEngine": RolloutEngine, "RewardScorer": RewardScorer}
    from rlx.plugins.backends.fsdp import FSDPWorker
    from rlx.plugins.modeling.worker import TorchWorker
    from rlx.plugins.rollout.hf import HFRollout
    from rlx.run.reward_worker import RewardWorker

    workers = {"TrainWorker": [TorchWorker, FSDPWorker], "RolloutEngine": [HFRollout],
               "RewardScorer": [RewardWorker]}
    for owner, name in calls:
        assert name in vars(protocols[owner]), f"{owner}.{name} is called but not declared"
        for cls in workers[owner]:
            assert callable(getattr(cls, name, None)), f"{cls.__name__} lacks {owner}.{name}"


def test_needs_is_data_and_a_01_algorithm_is_read_from_its_attributes() -> None:
    class Old:
        needs_ref, needs_critic, filter_groups, max_num_gen_batches = True, False, True, 3

    assert needs_of(Old()) == AlgorithmNeeds(ref=True, filter_groups=True, max_gen_batches=3)

    class New:
        needs = AlgorithmNeeds(critic=True, old_from_update=True)

    assert needs_of(New()) is New.needs


def test_the_built_in_algorithms_state_their_needs(tiny_model_path: str) -> None:
    from rlx.registry import get_plugin_manager
    from rlx.validate import load_config

    pm = get_plugin_manager()
    from rlx.context import BuildContext

    for name, want in [("grpo", AlgorithmNeeds(ref=True, old_from_update=True)),
                       ("ppo", AlgorithmNeeds(critic=True, old_from_update=True)),
                       ("remax", AlgorithmNeeds(greedy_baseline=True, old_from_update=True))]:
        resolved = load_config(pm, preset="tiny", overrides=[f"algorithm.name={name}"], check_files=False)
        ctx = BuildContext(resolved.config, None, pm)  # type: ignore[arg-type]
        alg = pm.build("algorithm", name, resolved.options["algorithm"], ctx)
        got = alg.needs
        assert (got.critic, got.greedy_baseline, got.filter_groups) == (want.critic, want.greedy_baseline, False), name
        assert got == needs_of(alg)


@pytest.mark.parametrize("old,new", [("rlx.checkpoint", "rlx.run.checkpoint"),
                                     ("rlx.builtin", "rlx.plugins.tasks.builtin"), ("rlx.training", "rlx.step"),
                                     ("rlx.cli.rm", "rlx.plugins.reward_modeling.command")])
def test_a_moved_module_keeps_its_old_path_for_one_release(old: str, new: str) -> None:
    import sys

    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message) for w in seen)


def test_core_imports_no_plugin_and_no_cli_module() -> None:
    """The layering, from the import statements of core/ (lazy ones included). ``__main__`` starts the CLI
    (``python -m rlx``), and is the one module allowed to name it."""
    offenders = []
    for path in (ROOT / "core").rglob("*.py"):
        if path.name == "__main__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names
                          if n.startswith(("rlx.plugins", "rlx.cli"))]
    assert offenders == []


def test_a_batch_carries_columns_only() -> None:
    """No side channel: what a seam needs besides the columns is an argument of its own."""
    import dataclasses

    from rlx.batch import Batch

    assert [f.name for f in dataclasses.fields(Batch)] == ["tensors", "non_tensors"]


def test_the_loss_gets_the_global_counts_of_its_mini_batch_from_the_shared_step() -> None:
    """run_update hands each micro-batch's loss one LossContext per mini-batch: the mini-batch's response tokens
    and sequences (here 2 + 3 + 0 tokens in 2 sequences with tokens, the third row empty), the rollouts'
    max_response_length and old_from_update from the UpdateContext; the forward runs at its temperature."""
    import torch

    from rlx.batch import Batch
    from rlx.records import LossContext, UpdateContext
    from rlx.step import run_update

    seen: list[tuple[LossContext, float]] = []

    class Engine:  # the StepEngine primitives of one rank, on a one-parameter model
        dp_size = 1

        def __init__(self) -> None:
            self.w = torch.nn.Parameter(torch.ones(()))

        def all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
            return list(values)

        def to_device(self, mb: Batch) -> Batch:
            return mb

        def forward(self, mb: Batch, *, grad: bool, entropy_grad: bool = True,
                    temperature: float = 1.0) -> dict[str, torch.Tensor]:
            seen.append((None, temperature))  # type: ignore[arg-type]
            lp = self.w * mb["response_mask"].float()
            return {"log_probs": lp, "entropy": torch.zeros_like(lp)}

        def backward(self, loss: torch.Tensor) -> None:
            loss.backward()

        def zero_grad(self) -> None:
            self.w.grad = None

        def optimizer_step(self) -> tuple[float, bool, float]:
            return float(self.w.grad), True, 0.0

    def loss_fn(outputs: dict[str, torch.Tensor], mb: Batch, ctx: LossContext) -> tuple[torch.Tensor, dict]:
        seen[-1] = (ctx, seen[-1][1])
        return outputs["log_probs"].sum() / ctx.global_tokens, {}

    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    mini = Batch({"response_mask": mask, "prompt_mask": torch.ones(3, 1), "prompts": torch.zeros(3, 1)})
    [step] = run_update(Engine(), [mini], loss_fn, micro_size=1,
                        context=UpdateContext(temperature=0.7, max_response_length=16, old_from_update=True))
    assert [s[1] for s in seen] == [0.7] * len(seen) and len(seen) >= 2  # micro-batches of one row
    assert {s[0] for s in seen} == {LossContext(5.0, 2.0, 16, True)}
    assert step["grad_norm"] == pytest.approx(1.0)  # d/dw of sum(w * mask) / 5 over the micro-batches: 5/5


@pytest.mark.parametrize("old,name,new", [
    ("rlx.plugins.backends.torch_local", "pick_device", "rlx.plugins.modeling.model"),
    ("rlx.plugins.backends.torch_local", "response_log_probs", "rlx.plugins.modeling.head"),
    ("rlx.plugins.launchers.local", "shard", "rlx.dispatch"),
    ("rlx.step", "balanced_order", "rlx.dispatch"),
    ("rlx.plugins.backends.ulysses", "config_problems", "rlx.plugins.modeling.checks")])
def test_a_moved_name_keeps_its_old_module_for_one_release(old: str, name: str, new: str) -> None:
    with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.")):
        got = getattr(importlib.import_module(old), name)
    assert got.__module__ == new
    with pytest.raises(AttributeError):
        importlib.import_module(old).no_such_name  # noqa: B018


def test_a_reference_whose_scheme_no_plugin_provides_says_so(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    """``RLX_DISABLE_PLUGINS=tasks``: builtin: references are not files that do not exist; the message names the
    scheme and the plugin that provides it."""
    from rlx.run.data import check_files

    monkeypatch.chdir(tmp_path)
    assert check_files(["builtin:arith-train"], "data.train_files") == []  # the tasks plugin answers
    [problem] = check_files(["nosuch:rows"], "data.train_files")
    assert "no installed plugin provides the resource scheme 'nosuch'" in problem
    (tmp_path / "c:x.parquet").write_bytes(b"")  # a file whose name has a colon is a path
    assert check_files(["c:x.parquet"], "data.train_files") == []
