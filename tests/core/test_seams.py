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


def test_the_loss_gets_the_global_counts_of_its_mini_batch_from_the_shared_step(tiny_model_path: str) -> None:
    """The torch worker's update (rlx.step.run_update) hands each micro-batch's loss one LossContext per
    mini-batch: the mini-batch's response tokens and sequences, and max_response_length and old_from_update
    from the UpdateContext; its forward runs at the UpdateContext's temperature (the log-probs the loss sees
    are the worker's own at that temperature)."""
    import torch
    from test_backend_torch import make_batch, make_worker

    from rlx.records import LossContext, UpdateContext

    worker = make_worker(tiny_model_path, micro_batch_size=3)
    mini = make_batch(rows=8)
    mask = mini["response_mask"]
    want_lp = worker.compute_log_probs(mini, temperature=0.7)["log_probs"]
    seen: list[tuple[LossContext, torch.Tensor]] = []

    def loss_fn(outputs: dict[str, torch.Tensor], mb: object, ctx: LossContext) -> tuple[torch.Tensor, dict]:
        seen.append((ctx, outputs["log_probs"].detach()))
        return outputs["log_probs"].sum() * 0.0, {}

    worker.update([mini], loss_fn, UpdateContext(temperature=0.7, max_response_length=16, old_from_update=True))
    assert len(seen) == 3  # 8 rows in micro-batches of 3
    assert {ctx for ctx, _ in seen} == {LossContext(float(mask.sum()), float((mask.sum(-1) > 0).sum()), 16, True)}
    got = torch.cat([lp for _, lp in seen])
    torch.testing.assert_close(got * mask[:, : got.shape[1]], want_lp[:, : got.shape[1]] * mask[:, : got.shape[1]],
                               atol=1e-5, rtol=0)


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
