"""Placement of the rollout engine: a separate rollout pool (``launcher.rollout_nproc``) trains the built-in
job and its engine holds the actor's exact weights after every bucketed broadcast; a colocated engine is
woken before it takes weights or generates and sleeps while the models train; bad placements are one
message."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from rlx import Component, hookimpl
from rlx.batch import Batch
from rlx.context import BuildContext
from rlx.errors import UserError
from rlx.plugins.launchers.local import LocalOptions, build
from rlx.plugins.rollout import hf
from rlx.protocols import RunInfo

pytestmark = pytest.mark.multiproc

SMALL = ["trainer.test_freq=-1", "trainer.loggers=[jsonl]", "trainer.save_hf_model=false", "trainer.save_freq=0",
         "data.train_batch_size=16", "actor.ppo_mini_batch_size=8", "rollout.n=4"]

POOL_RUN = textwrap.dedent('''
    import json, os, sys
    import torch
    from rlx.registry import get_plugin_manager
    from rlx.trainer import Trainer
    from rlx.validate import load_config
    from rlx.plugins.launchers.weight_sync import bucket_bytes, buckets

    class Checked(Trainer):
        """After every step: the rollout pool's engine holds exactly the actor's weights."""
        steps = []

        def train_step(self, examples):
            metrics = super().train_step(examples)
            # The actor's and the engine's models, from their processes (neither has an accessor of its own).
            actor = self.actor.call_all(object.__getattribute__, "model")[0].state_dict()
            [model] = self.rollout.call_all(object.__getattribute__, "model")
            engine = model.state_dict()
            limit = bucket_bytes(self.launcher.options.bucket_size_mb)
            self.steps.append({{
                "differ": [n for n, t in actor.items() if not torch.equal(engine[n], t)],
                "fingerprint": float(sum(t.double().sum() for t in actor.values())),
                "expected_bytes": sum(t.numel() * t.element_size() for t in actor.values()),
                "expected_buckets": len(list(buckets(actor.items(), limit))),
                "metrics": metrics,
            }})
            return metrics

    if __name__ == "__main__":
        pm = get_plugin_manager()
        trainer = Checked(load_config(pm, preset="tiny", overrides=sys.argv[2:]), pm)
        layout = {{"actor": trainer.actor.ranks, "rollout": trainer.rollout.ranks,
                  "actor_dp": [i.dp_size for i in trainer.actor.infos],
                  "rollout_dp": [i.dp_size for i in trainer.rollout.infos]}}
        trainer.fit()
        json.dump({{"layout": layout, "steps": Checked.steps}}, open(sys.argv[1], "w"))
        sys.stdout.flush()
        os._exit(0)  # as the CLI does after torch.distributed was used
''')

# Every folder of the test tree: the scripts these tests run import helpers of other test modules.
TEST_DIRS = sorted({str(p.parent) for p in Path(__file__).parents[2].rglob("test_*.py")})


@pytest.mark.slow
@pytest.mark.parametrize("launcher", [
    pytest.param("local", id="local-2+1"),
    pytest.param("ray", id="ray-1+1", marks=pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                                              reason="ray is not installed")),
])
def test_a_rollout_pool_trains_and_its_engine_holds_the_actor_weights_after_every_sync(tmp_path: Path,
                                                                                     launcher: str) -> None:
    """local: 2 training processes and 1 rollout process (world size 3, gloo); ray: 1 training actor and 1
    rollout actor in a placement group of its own. Generate runs in the rollout pool, training in the other;
    after each update rank 0 broadcasts the weights in 0.05 MiB buckets (the tiny model is 0.31 MiB: several
    buckets) and the engine's weights equal the actor's bit for bit."""
    script = tmp_path / "pool_run.py"
    script.write_text(POOL_RUN.format())
    out = tmp_path / "result.json"
    pools = (["launcher.nproc=2", "launcher.rollout_nproc=1"] if launcher == "local" else
             ["launcher.name=ray", "launcher.nproc=1", "launcher.rollout_nproc=1"])
    run = subprocess.run([sys.executable, str(script), str(out), *SMALL, "trainer.total_steps=3", *pools,
                          "launcher.bucket_size_mb=0.05", f"trainer.output_dir={tmp_path / 'run'}"],
                         capture_output=True, text=True, timeout=400,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "RLX_CACHE": str(tmp_path / "cache")})
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["layout"] == ({"actor": [0, 1], "rollout": [2], "actor_dp": [2, 2], "rollout_dp": [1]}
                                if launcher == "local" else
                                {"actor": [0], "rollout": [1], "actor_dp": [1], "rollout_dp": [1]})
    steps = result["steps"]
    assert len(steps) == 3
    for step in steps:
        m = step["metrics"]
        assert step["differ"] == [], step["differ"]
        assert m["weight_sync/bytes"] == step["expected_bytes"]
        assert m["weight_sync/buckets"] == step["expected_buckets"] > 1
        assert m["timing/weight_sync"] > 0 and "actor/pg_loss" in m and "reward/mean" in m
        assert "timing/sleep" not in m and "timing/wake_up" not in m  # a pool of its own never sleeps
    fingerprints = [s["fingerprint"] for s in steps]
    assert len(set(fingerprints)) == 3, "the actor changed at every step, so every sync carried new weights"


class Probe(hf.HFRollout):
    """The hf engine, recording the phase calls and refusing to take weights or generate while asleep."""

    events: ClassVar[list[str]] = []
    asleep = False

    def generate(self, prompts: Any, params: Any) -> Any:
        assert not self.asleep, "generate while asleep"
        self.events.append("generate")
        return super().generate(prompts, params)

    def update_weights(self, named_tensors: Any) -> None:
        assert not self.asleep, "update_weights while asleep"
        self.events.append("update_weights")
        super().update_weights(named_tensors)

    def sleep(self) -> None:
        self.asleep = True
        self.events.append("sleep")
        super().sleep()

    def wake_up(self) -> None:
        self.asleep = False
        self.events.append("wake_up")
        super().wake_up()


def build_probe(options: Any, ctx: BuildContext) -> Probe:
    engine = hf.build(options, ctx)
    engine.__class__ = Probe  # the engine the hf plugin builds, with the recording methods above
    return engine


@hookimpl
def rlx_rollout_engines() -> list[Component]:
    return [Component(kind="rollout", name="hf_probe", factory=build_probe, config_model=hf.HFRolloutOptions,
                      summary="test: hf engine recording its phases")]


@pytest.mark.slow
@pytest.mark.parametrize("sleep", [True, False])
def test_a_colocated_engine_wakes_before_weights_and_generation_and_sleeps_while_training(
        tmp_path: Path, tiny_model_path: str, sleep: bool) -> None:
    from rlx.registry import PluginManager
    from rlx.trainer import Trainer
    from rlx.validate import load_config

    pm = PluginManager()
    pm.load_entry_points()
    pm.register(sys.modules[__name__], name="placement_probe")
    Probe.events = []
    resolved = load_config(pm, preset="tiny", overrides=[*SMALL, "trainer.total_steps=2", "rollout.name=hf_probe",
                                                         f"launcher.sleep_rollout={str(sleep).lower()}",
                                                         f"trainer.output_dir={tmp_path}"])
    trainer = Trainer(resolved, pm)
    trainer.fit()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    if sleep:
        # Built awake; each step: generate, sleep while the models train, wake, take the new weights.
        assert Probe.events == ["update_weights"] + ["generate", "sleep", "wake_up", "update_weights"] * 2
        assert all(r["timing/sleep"] >= 0 and r["timing/wake_up"] >= 0 for r in rows)
    else:
        assert Probe.events == ["update_weights"] + ["generate", "update_weights"] * 2
        assert not any("timing/sleep" in r or "timing/wake_up" in r for r in rows)
    assert all(r["weight_sync/buckets"] == 1 and r["weight_sync/bytes"] > 0 for r in rows)


def _ctx() -> BuildContext:
    return BuildContext(None, RunInfo("/tmp", "p", "e", {}))


def test_rollout_nproc_under_torchrun_is_a_user_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(UserError, match="rollout_nproc=1 needs processes that rlx starts itself"):
        build(LocalOptions(nproc=2, rollout_nproc=1), _ctx())


def test_more_processes_than_gpus_counts_both_pools(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    from rlx.plugins.launchers.local import ProcessLauncher

    with pytest.raises(UserError, match=r"3 processes \(2 training \+ 1 rollout"):
        ProcessLauncher(LocalOptions(nproc=2, rollout_nproc=1, weight_sync="broadcast"), "cuda", 0)
    # auto: the rollout process shares training rank 0's GPU instead; the training pool alone must fit.
    with pytest.raises(UserError, match=r"^3 processes on this machine need as many GPUs, but 2"):
        ProcessLauncher(LocalOptions(nproc=3, rollout_nproc=1), "cuda", 0)


def test_a_negative_rollout_nproc_is_a_config_error(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "rlx", "train", "launcher.rollout_nproc=-1",
                          f"trainer.output_dir={tmp_path}"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "launcher.rollout_nproc" in run.stderr and "Traceback" not in run.stderr


def _spawned(pid: int) -> list[int]:
    """Worker processes spawned by ``pid`` (not multiprocessing's resource tracker)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid and "spawn_main" in cmdline:
                found.append(int(entry.name))
    return found


@pytest.mark.slow
def test_a_dead_rollout_process_ends_the_run_naming_its_rank(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    err_file = tmp_path / "stderr.txt"
    with open(err_file, "w") as err_out:  # a file, not a pipe: nobody reads it while the run goes on
        proc = subprocess.Popen([sys.executable, "-m", "rlx", "train", "--preset", "tiny", *SMALL,
                                 "trainer.total_steps=100000", "launcher.rollout_nproc=1",
                                 f"trainer.output_dir={run_dir}"], cwd=tmp_path, stdout=subprocess.DEVNULL,
                                stderr=err_out, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.time() + 300
        while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 1):
            assert proc.poll() is None, err_file.read_text()[-3000:]
            time.sleep(0.2)
        [rollout] = _spawned(proc.pid)  # --nproc 1: rank 0 trains and drives, rank 1 holds the engine
        os.kill(rollout, signal.SIGKILL)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = err_file.read_text()
    assert proc.returncode == 1, err[-3000:]
    assert "Error: worker rank 1 failed: exited with status -9" in err, err[-3000:]
    assert "Traceback" not in err.split("Error:")[-1]


# -- balancing the data-parallel ranks by tokens (actor/critic.use_dynamic_bsz) ------------------------------
def ragged(rows: int, seed: int) -> Batch:
    """Rows of 1 to 40 prompt and 1 to 60 response tokens (padded), each with its index in ``row``."""
    g = torch.Generator().manual_seed(seed)
    plens = torch.randint(1, 41, (rows,), generator=g)
    rlens = torch.randint(1, 61, (rows,), generator=g)
    prompt_mask = (torch.arange(40) >= 40 - plens[:, None]).long()
    response_mask = (torch.arange(60) < rlens[:, None]).long()
    return Batch({"prompts": torch.randint(3, 60, (rows, 40), generator=g) * prompt_mask,
                  "prompt_mask": prompt_mask,
                  "responses": torch.randint(3, 60, (rows, 60), generator=g) * response_mask,
                  "response_mask": response_mask, "row": torch.arange(rows)})


@pytest.mark.parametrize("parts", [2, 3, 4])
def test_balanced_dispatch_evens_the_ranks_tokens_and_returns_rows_in_their_order(parts: int) -> None:
    """On ragged batches (8 seeds, 9 to 64 rows): every rank gets as many rows as the plain split gives it,
    every row goes to exactly one rank, the ranks' token totals differ by at most the longest row (the
    greedy's bound: a rank takes a row only while it is the lightest with room), and the results come back
    bit for bit in the original order."""
    from rlx.dispatch import balance, gather, shard, unbalance
    from rlx.step import row_tokens

    for seed in range(8):
        batch = ragged(9 + 7 * seed, seed)
        batch = batch.index(sorted(range(len(batch)), key=lambda i: row_tokens(batch)[i]))  # skewed split
        plain = [sum(row_tokens(b)) for b in shard(batch, parts)]
        balanced, order = balance(batch, parts)
        shares = shard(balanced, parts)
        tokens = [sum(row_tokens(b)) for b in shares]
        assert [len(b) for b in shares] == [len(b) for b in shard(batch, parts)]
        assert sorted(torch.cat([b["row"] for b in shares]).tolist()) == list(range(len(batch)))
        assert max(tokens) - min(tokens) <= max(row_tokens(batch)), (seed, tokens)
        assert max(tokens) - min(tokens) < max(plain) - min(plain), (seed, tokens, plain)
        back = unbalance(gather(shares), order)
        for key, value in batch.tensors.items():
            assert torch.equal(back[key], value), key
    minibatches, order = balance([ragged(16, 0), ragged(16, 1)], 2)  # an update's: each balanced, metrics back
    assert order is None and [m["row"].tolist() for m in minibatches] == [
        batch["row"].tolist() for batch in (balance(ragged(16, 0), 2)[0], balance(ragged(16, 1), 2)[0])]


def grouped(groups: int, n: int, seed: int) -> Batch:
    """``groups`` prompts of 1 to 40 tokens with ``n`` responses each of 1 to 60 (a GRPO batch), rows of a
    prompt side by side, each with its index in ``row``."""
    batch = ragged(groups * n, seed)
    first = torch.arange(groups).repeat_interleave(n) * n
    for key in ("prompts", "prompt_mask"):
        batch.tensors[key] = batch[key][first]
    return batch


def test_balanced_dispatch_keeps_a_prompts_rows_on_one_rank_where_they_share_it() -> None:
    """share_prompts: a prompt's rows are placed together, weighed with the prompt once. By hand: 4 prompts of
    10 tokens with 2 responses each of 5, 1, 8 and 3 tokens (20, 12, 26 and 16 tokens carried): heaviest first
    to the lightest rank, 26 and 12 on one rank, 20 and 16 on the other (38 and 36 tokens), each prompt on one
    rank. On ragged GRPO batches the heaviest rank carries no more than under the row-by-row balance or the
    plain split (prompts counted once on each rank), every rank gets as many rows as the plain split gives it,
    and the results come back in the rows' order. Where each rank's rows are whole prompts, two or more (here 8
    of 4 rows on 4 ranks, 64 of 8 on 8), the grouped order wins on these seeds and every prompt stays on one
    rank: the ranks carry each prompt once in all, where the row-by-row balance carries it on every rank its
    rows reach."""
    from rlx.dispatch import balance, balanced_order, gather, shard, unbalance
    from rlx.step import prompt_shares

    response = torch.tensor([[1] * 5 + [0] * 3, [1] + [0] * 7, [1] * 8, [1] * 3 + [0] * 5]).repeat_interleave(2, 0)
    hand = Batch({"prompts": torch.arange(4).repeat_interleave(2)[:, None].expand(8, 10) + 3,
                  "prompt_mask": torch.ones(8, 10, dtype=torch.long), "response_mask": response})
    assert balanced_order(hand, 2, share_prompts=True) == [2, 3, 4, 5, 0, 1, 6, 7]
    for parts, groups, n, whole in [(2, 8, 4, False), (4, 8, 4, True), (2, 6, 8, False), (3, 8, 4, False),
                                    (4, 3, 8, False), (8, 64, 8, True)]:
        for seed in range(4):
            batch = grouped(groups, n, seed)
            shares = prompt_shares(batch)
            balanced, order = balance(batch, parts, share_prompts=True)
            ranks = shard(balanced, parts)
            assert [len(b) for b in ranks] == [len(b) for b in shard(batch, parts)]
            carried = [shares.load(b["row"].tolist()) for b in ranks]
            by_rows = [shares.load(b["row"].tolist()) for b in shard(balance(batch, parts)[0], parts)]
            plain = [shares.load(b["row"].tolist()) for b in shard(batch, parts)]
            assert max(carried) <= min(max(by_rows), max(plain)), (parts, groups, seed, carried, by_rows, plain)
            if whole:
                reach = [{int(r) // n for r in b["row"]} for b in ranks]  # the prompts each rank holds
                assert [sum(g in held for held in reach) for g in range(groups)] == [1] * groups
                assert sum(carried) == shares.load(list(range(len(batch)))) < sum(by_rows)
            back = unbalance(gather(ranks), order)
            for key, value in batch.tensors.items():
                assert torch.equal(back[key], value), key


@pytest.mark.parametrize("share", [True, False])
def test_a_worker_group_balances_as_its_role_says(share: bool) -> None:
    """The launchers' dispatch (ProcessWorkerGroup.call, under every launcher) sends each rank the rows of
    balanced_order with its role's share flag, and gives the per-row results back in the batch's order."""
    from rlx.dispatch import balanced_order
    from rlx.plugins.launchers._process import ProcessWorkerGroup
    from rlx.protocols import DispatchInfo, TrainWorker

    class Launcher:
        def __init__(self) -> None:
            self.balanced_roles = {"actor": share}
            self.sent: list[Any] = []

        def run(self, cmd: Any, shares: list[Any], ranks: list[int]) -> list[Any]:
            self.sent = shares
            return [Batch({"row": b["row"] * 10}) for b in shares]  # a per-row result

    launcher = Launcher()
    group = ProcessWorkerGroup(launcher, "actor", [DispatchInfo(r, 4, True) for r in range(4)])
    batch = grouped(8, 4, 0)
    out = group.call(TrainWorker.compute_log_probs, batch)
    order = balanced_order(batch, 4, share_prompts=share)
    assert order is not None and order != balanced_order(batch, 4, share_prompts=not share)
    assert [b["row"].tolist() for b in launcher.sent] == [order[8 * r:8 * (r + 1)] for r in range(4)]
    assert out["row"].tolist() == [10 * i for i in range(len(batch))]


def test_roles_are_balanced_under_dynamic_batch_sizes_only() -> None:
    from rlx.dispatch import balanced_roles
    from rlx.registry import get_plugin_manager
    from rlx.validate import load_config

    pm = get_plugin_manager()

    def roles(*overrides: str) -> dict[str, bool]:
        return balanced_roles(load_config(pm, preset="tiny", overrides=list(overrides)).config)

    assert roles() == {}
    # the reference scores like the actor; a role that shares prompts keeps a prompt's rows on one rank
    assert roles("actor.use_dynamic_bsz=true") == {"actor": True, "ref": True}
    assert roles("actor.use_dynamic_bsz=true", "actor.share_prompts=false") == {"actor": False, "ref": False}
    assert roles("critic.use_dynamic_bsz=true", "critic.share_prompts=false") == {"critic": False}
    assert roles("critic.use_dynamic_bsz=true", "critic.use_remove_padding=false") == {"critic": False}


BALANCED_UPDATE = textwrap.dedent('''
    import os, sys
    from functools import partial
    import torch
    sys.path[:0] = {tests!r}
    from test_backend_torch import make_batch, grpo_loss
    from rlx.plugins.tasks import builtin
    from rlx.context import BuildContext
    from rlx.plugins.backends.torch_local import TorchBackend
    from rlx.plugins.modeling.worker import TorchBackendOptions
    from rlx.plugins.launchers.local import LocalOptions, build
    from rlx.protocols import RoleSpec, RunInfo, TrainWorker
    from rlx.records import ForwardOptions
    from rlx.trainer import ppo_update
    from rlx.step import row_tokens

    def main(nproc, out):
        launcher = build(LocalOptions(nproc=nproc), BuildContext(None, RunInfo(out, "p", "e", {{}})))
        launcher.balanced_roles = {{"actor": False}}  # actor.use_dynamic_bsz=true, share_prompts=false
        dynamic = {{"use_dynamic_bsz": True, "ppo_max_token_len": 30, "ppo_max_token_len_option": "ppo",
                   "log_prob_max_token_len": 30, "log_prob_max_token_len_option": "log_prob"}}
        spec = RoleSpec(role="actor", model_path=builtin.resolve("builtin:tiny-qwen2"), trainable=True, lr=3e-4,
                        micro_batch_size=2, seed=0, forward=ForwardOptions(**dynamic))
        actor = launcher.create_group("actor", partial(TorchBackend(TorchBackendOptions(), "cpu").worker, spec))
        shares = []  # the tokens each rank is sent, per call
        if nproc > 1:
            run = launcher.run

            def recording(cmd, sent=None, ranks=None):
                if cmd[0] == "call":
                    shares.append([sum(row_tokens(s if hasattr(s, "tensors") else s[0])) for s in sent])
                return run(cmd, sent, ranks)

            launcher.run = recording
        batch = make_batch(seed=1, rows=8)  # 7 to 14 tokens a row; sorted, a plain split gives 35 and 49
        batch = batch.index(sorted(range(8), key=lambda i: row_tokens(batch)[i]))
        log_probs = actor.call(TrainWorker.compute_log_probs, batch)["log_probs"]
        batch.tensors["old_log_probs"] = log_probs
        metrics = {{}}
        ppo_update(actor, batch, grpo_loss(loss_agg_mode="token-mean"), epochs=2, mini_size=8, shuffle=False,
                   seed=7, prefix="actor", metrics=metrics)
        actor.call_all(TrainWorker.save_pretrained, out + "/model")
        launcher.shutdown()
        torch.save({{"metrics": metrics, "log_probs": log_probs, "shares": shares}}, out + "/result.pt")

    if __name__ == "__main__":
        main(int(sys.argv[1]), sys.argv[2])
        os._exit(0)  # as the CLI does after torch.distributed was used
''')


@pytest.mark.slow
def test_balanced_ranks_give_the_one_process_log_probs_and_update(tmp_path: Path) -> None:
    """Dynamic batch sizes, 2 processes with the ranks balanced by tokens against 1 process: each rank gets
    41-43 tokens (the plain split: 35 and 49), the log-probs come back row by row in the batch's order, and the
    update (2 epochs of one mini-batch) matches.

    Not bit for bit: moving a row to another rank moves its terms into other float32 sums (its micro-batch's
    packed matmuls, its rank's gradient accumulation, then the sum over ranks), and float addition is not
    associative. Measured over data seeds 1-3 (the worst of the three): log-probs 3.8e-6 apart, gradient norm
    4.5e-7 and policy loss 1.9e-6 relative, weights 6.6e-6 (AdamW's first steps move a weight by about
    lr x g / (|g| + eps), so an entry whose gradient is near eps turns a 1e-9 round-off into ~1e-5). The
    tolerances are about 5 times those. The same comparison without balancing differs as much (the
    micro-batches already differ between 1 and 2 processes): balancing adds no error of its own. What must
    be exact is tested without float sums: the rows each rank gets and the order of the results
    (test_balanced_dispatch_evens_the_ranks_tokens_and_returns_rows_in_their_order)."""
    from transformers import AutoModelForCausalLM

    script = tmp_path / "balanced_update.py"
    script.write_text(BALANCED_UPDATE.format(tests=TEST_DIRS))
    results = {}
    for nproc in (1, 2):
        out = tmp_path / f"n{nproc}"
        out.mkdir()
        run = subprocess.run([sys.executable, str(script), str(nproc), str(out)], capture_output=True, text=True,
                             timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert run.returncode == 0, run.stderr[-3000:]
        results[nproc] = (torch.load(out / "result.pt"),
                          AutoModelForCausalLM.from_pretrained(out / "model").state_dict())
    (one, w1), (two, w2) = results[1], results[2]
    assert two["shares"] == [[43, 41], [43, 41]], two["shares"]  # log-probs, then the update's mini-batch
    torch.testing.assert_close(two["log_probs"], one["log_probs"], atol=2e-5, rtol=0)
    m1, m2 = one["metrics"], two["metrics"]
    assert m2["actor/grad_norm"] == pytest.approx(m1["actor/grad_norm"], rel=2e-6)
    assert m2["actor/pg_loss"] == pytest.approx(m1["actor/pg_loss"], rel=1e-5)
    for k, v in w1.items():
        torch.testing.assert_close(w2[k], v, atol=3e-5, rtol=0, msg=k)
