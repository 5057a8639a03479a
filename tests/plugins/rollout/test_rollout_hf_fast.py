"""The ``hf`` engine's static decoder (``hf_static``): on the CPU it runs without a CUDA graph, which checks
its cache, masks, positions, padding buckets and in-step sampling; on a GPU the graph replay must give what
the same steps give unrecorded."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlx.batch import Batch
from rlx.plugins.modeling.head import response_log_probs
from rlx.plugins.rollout.hf import HFRollout, HFRolloutOptions
from rlx.plugins.rollout.hf_sampling import Sampler
from rlx.plugins.rollout.hf_static import SlotDecoder, decode_attention
from rlx.plugins.testing import (
    RolloutEngineContract,
    check_first_token_distribution,
    check_stops_and_length,
    next_token_logits,
)
from rlx.protocols import SamplingParams
from rlx.run.data import PromptExample, collate


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """The tiny model runs on one thread."""


@pytest.fixture(scope="module")
def policy(tiny_model_path, tmp_path_factory):
    """The tiny architecture with larger random weights: peaked, prompt-dependent distributions and responses
    that rarely stop by themselves."""
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    torch.manual_seed(1234)
    model = type(base)(base.config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    folder = tmp_path_factory.mktemp("fast_model")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder), tok


def engine(policy, device: str = "cpu", **options) -> HFRollout:
    folder, tok = policy
    return HFRollout(folder, HFRolloutOptions(**options), device, [tok.eos_token_id], tok.pad_token_id)


@pytest.fixture(scope="module")
def static(policy) -> HFRollout:
    return engine(policy, decoder="static", prompt_bucket=8)


@pytest.fixture(scope="module")
def dynamic(policy) -> HFRollout:
    return engine(policy, decoder="dynamic")


@pytest.fixture(scope="module")
def prompts(policy) -> Batch:
    """Three prompts of different lengths, one longer than the bucket of 8 (so the bucket pads it to 16)."""
    tok = policy[1]
    ids = [[11, 23, 37, 5, 8, 9, 30, 31, 12, 13], [42, 17], [3, 4, 5, 6, 7]]
    return collate([PromptExample(x, tok.decode(x), "s", str(i), {}) for i, x in enumerate(ids)], tok.pad_token_id)


def run(rollout: HFRollout, prompts: Batch, seed: int = 0, **params) -> Batch:
    torch.manual_seed(seed)
    return rollout.generate(prompts, SamplingParams(**params))


class TestStaticDecoderContract(RolloutEngineContract):
    """The whole engine contract through the static decoder (on the CPU: unrecorded steps)."""

    def make_engine(self, model_path: str, tokenizer) -> HFRollout:
        # Prompts of a few tokens: a bucket of 8 keeps the prefill of thousands of rows small.
        return HFRollout(model_path, HFRolloutOptions(micro_batch_size=8192, decoder="static", prompt_bucket=8),
                         "cpu", [tokenizer.eos_token_id], tokenizer.pad_token_id)


def test_auto_is_dynamic_on_the_cpu(policy, static):
    assert engine(policy).static is None
    assert static.static is not None and not static.static.use_graph


def test_greedy_matches_the_dynamic_decoder(static, dynamic, prompts):
    """Bucketed, left-padded prompts and batch rows padded to 8 decode exactly as the unpadded dynamic cache."""
    a = run(static, prompts, n=2, max_tokens=9, greedy=True)
    b = run(dynamic, prompts, n=2, max_tokens=9, greedy=True)
    assert torch.equal(a["responses"], b["responses"]) and torch.equal(a["response_mask"], b["response_mask"])
    torch.testing.assert_close(a["rollout_log_probs"], b["rollout_log_probs"], atol=1e-5, rtol=0)
    assert len(set(map(tuple, a["responses"].tolist()))) == 3  # the prompts' decodes differ


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_sampled_log_probs_match_training_forward(policy, prompts, attn, temperature, top_p):
    """The log-probs each step records are the training forward pass's (at full top_p, where the sampling
    distribution is the policy's), and tokens the nucleus drops are never drawn."""
    rollout = engine(policy, decoder="static", prompt_bucket=8, attn_implementation=attn)
    out = run(rollout, prompts, seed=3, n=3, max_tokens=12, temperature=temperature, top_p=top_p,
              stop_token_ids=(5, 17, 33))
    mask = out["response_mask"].bool()
    assert mask.sum(-1).min() < 12 <= mask.sum(-1).max()  # some rows stopped early, some ran to the end
    with torch.no_grad():
        lp, _ = response_log_probs(rollout.model, out, temperature, with_entropy=False)
    if top_p == 1.0:
        torch.testing.assert_close(out["rollout_log_probs"][mask], lp[mask], atol=1e-4, rtol=0)
    else:  # renormalised over the nucleus: never below the policy's own log-prob
        assert bool((out["rollout_log_probs"][mask] >= lp[mask] - 1e-5).all())
    assert bool((out["rollout_log_probs"][~mask] == 0).all())


@pytest.fixture(scope="module")
def logits(static, prompts) -> torch.Tensor:
    return next_token_logits(static.model, prompts)


@pytest.mark.parametrize("params", [SamplingParams(n=3000, temperature=0.8),
                                    SamplingParams(n=3000, temperature=1.3, top_k=5, top_p=0.8)])
def test_first_token_distribution(static, prompts, logits, params):
    check_first_token_distribution(static, prompts, logits, params, seed=5)


def test_stops_and_length(static, prompts, logits, policy):
    stop = {int(logits[0].argmax()), int(logits[1].argmax())}
    params = SamplingParams(n=300, max_tokens=5, stop_token_ids=tuple(sorted(stop)))
    check_stops_and_length(static, prompts, logits, params, stop | {policy[1].eos_token_id})


def test_stopped_rows_end_the_loop_early(static, dynamic, prompts):
    """When every row has stopped, decoding ends at the next look (every 16 steps), not at max_tokens, and
    the responses are those of the unstopped decode cut after their first stop token."""
    free = run(dynamic, prompts, n=1, max_tokens=40, greedy=True)
    stop = tuple(sorted(set(free["responses"][:, 2].tolist())))  # every row stops by its third token
    out = run(static, prompts, n=1, max_tokens=40, greedy=True, stop_token_ids=stop)
    assert out["responses"].shape[1] == 16
    for row, lengths in enumerate(out["response_mask"].sum(-1).tolist()):
        want = free["responses"][row].tolist()
        cut = next(i for i, t in enumerate(want) if t in stop) + 1
        assert lengths == cut <= 3 and out["responses"][row, :cut].tolist() == want[:cut]
    everything = tuple(range(static.model.config.vocab_size))  # every token stops: one column
    assert run(static, prompts, n=2, max_tokens=40, stop_token_ids=everything)["responses"].shape[1] == 1


def test_shapes_reuse_and_eviction(policy, prompts):
    rollout = engine(policy, decoder="static", prompt_bucket=8)
    rollout.static.max_shapes = 2
    run(rollout, prompts, n=2, max_tokens=4)
    run(rollout, prompts, n=2, max_tokens=4, seed=1)
    assert len(rollout.static.decoders) == 1
    run(rollout, prompts, n=3, max_tokens=4)  # 9 rows: the batch bucket of 16
    run(rollout, prompts, n=2, max_tokens=6)
    keys = list(rollout.static.decoders)
    assert len(keys) == 2 and [k[0] for k in keys] == [16, 8] and keys[-1][2] == 6


def test_decode_attention_equals_transformers_sdpa():
    """One query token with 3 query heads per key/value head: the folded attention equals transformers' sdpa
    (which repeats the keys and values per query head), under a mask with holes."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 3, True
    query, key, value = torch.randn(4, 6, 1, 16), torch.randn(4, 2, 9, 16), torch.randn(4, 2, 9, 16)
    mask = torch.rand(4, 1, 1, 9) > 0.3
    mask[..., 0] = True
    got, _ = decode_attention(module, query, key, value, mask, scaling=0.25)
    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
    assert got.shape == want.shape == (4, 1, 6, 16)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_sampler_options():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    greedy = Sampler.from_params(SamplingParams(greedy=True, temperature=0.3, top_k=1))
    assert greedy == Sampler(True, 1.0, 0, 1.0)
    top2 = Sampler.from_params(SamplingParams(top_k=2))
    lp = top2.log_probs(logits)
    assert torch.isinf(lp[0, 2:]).all()
    torch.testing.assert_close(lp[0, :2].exp().sum(), torch.tensor(1.0))
    nucleus = Sampler(False, 1.0, 0, 0.7).log_probs(logits)
    p = torch.softmax(logits, -1)[0]
    assert float(p[0]) < 0.7 < float(p[:2].sum())  # the nucleus is exactly the first two tokens
    assert torch.isfinite(nucleus[0, :2]).all() and torch.isinf(nucleus[0, 2:]).all()


@pytest.mark.parametrize("sampler", [Sampler(True, 1.0, 0, 1.0), Sampler(False, 1.0, 0, 1.0),
                                     Sampler(False, 0.7, 0, 1.0)])
def test_the_plain_race_draws_the_full_paths_tokens_with_its_log_probs(sampler):
    """Without top-k or top-p the step skips the (b, V) log-probs: arg-max of x - log E is arg-max of p / E (the
    log-softmax differs from x by a constant per row), and the token's log-prob is x_token - logsumexp(x)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(32, 3000, generator=g) * 3
    noise = None if sampler.greedy else torch.empty(32, 3000).exponential_(generator=g)
    log_probs = sampler.log_probs(logits)
    want = log_probs.argmax(-1) if noise is None else (log_probs.exp() / noise).argmax(-1)
    token, log_prob = sampler.race(logits, noise)
    assert sampler.plain and torch.equal(token, want)
    torch.testing.assert_close(log_prob, log_probs.gather(-1, want[:, None])[:, 0], atol=1e-5, rtol=0)
    assert not Sampler(False, 1.0, 5, 1.0).plain and not Sampler(False, 1.0, 0, 0.9).plain


def assert_sampled_log_probs_match_training(rollout, prompts):
    """Tokens sampled at temperature 0.9 on the GPU carry the log-probs the training forward pass gives them."""
    out = run(rollout, prompts, seed=2, n=4, max_tokens=20, temperature=0.9)
    with torch.no_grad():
        lp, _ = response_log_probs(rollout.model, out.to("cuda"), 0.9, with_entropy=False)
    mask = out["response_mask"].bool()
    torch.testing.assert_close(out["rollout_log_probs"][mask], lp.cpu()[mask], atol=1e-3, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("compile_mode", ["off", "default"])
def test_cuda_graph_replays_the_eager_steps(policy, prompts, compile_mode):
    """Greedy decodes through the recorded graph equal the unrecorded static steps and the dynamic cache; sampled
    tokens' log-probs agree with the training forward pass."""
    graph = engine(policy, "cuda", dtype="float32", compile=compile_mode, prompt_bucket=8)
    plain = engine(policy, "cuda", dtype="float32", decoder="static", cuda_graph=False, compile="off",
                   prompt_bucket=8)
    assert graph.static.use_graph
    a = run(graph, prompts, n=4, max_tokens=20, greedy=True)
    b = run(plain, prompts, n=4, max_tokens=20, greedy=True)
    assert torch.equal(a["responses"], b["responses"])
    torch.testing.assert_close(a["rollout_log_probs"], b["rollout_log_probs"], atol=1e-4, rtol=0)
    assert_sampled_log_probs_match_training(graph, prompts)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("rewarm", [True, False])
def test_graphs_recorded_again_after_a_discarding_sleep_replay_the_same_steps(policy, prompts, monkeypatch, rewarm):
    """Under free_on_sleep=discard the graphs are recorded again at the next rollout; without warm-up steps
    (REWARM off, a shape recorded before) they decode what the first recording did."""
    from rlx.plugins.rollout import hf_static

    monkeypatch.setattr(hf_static, "REWARM", rewarm)
    rollout = engine(policy, "cuda", dtype="float32", compile="default", prompt_bucket=8, free_on_sleep="discard")
    first = run(rollout, prompts, n=4, max_tokens=20, greedy=True)
    state = {k: v.clone() for k, v in rollout.model.state_dict().items()}
    for _ in range(2):
        rollout.sleep()
        rollout.wake_up()
        rollout.update_weights(state.items())
        again = run(rollout, prompts, n=4, max_tokens=20, greedy=True)
        (decoder,) = rollout.static.decoders.values()
        assert decoder.graphs and decoder.warm is rewarm
        assert torch.equal(again["responses"], first["responses"])
        torch.testing.assert_close(again["rollout_log_probs"], first["rollout_log_probs"], atol=1e-5, rtol=0)
    assert_sampled_log_probs_match_training(rollout, prompts)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_after_a_discarding_sleep_a_smaller_bucket_is_recorded_when_the_decode_reaches_it(policy, prompts,
                                                                                         monkeypatch):
    """Recorded again without warm-up steps (REWARM off), the full bucket's graph is recorded before the
    prefill and the bucket of 8 only when rows have stopped; the decode is the first recording's."""
    from rlx.plugins.rollout import hf_static

    monkeypatch.setattr(hf_static, "REWARM", False)
    rollout = engine(policy, "cuda", dtype="float32", compile="default", prompt_bucket=8, free_on_sleep="discard")
    free = run(rollout, prompts, n=4, max_tokens=40, greedy=True)
    stop = (int(free["responses"][0, 3]),)  # the first prompt's rows stop at their fourth token
    first = run(rollout, prompts, n=4, max_tokens=40, greedy=True, stop_token_ids=stop)
    assert first["response_mask"].sum(-1).min() < 16 < first["response_mask"].sum(-1).max()
    state = {k: v.clone() for k, v in rollout.model.state_dict().items()}
    rollout.sleep()
    rollout.wake_up()
    rollout.update_weights(state.items())
    recorded: list[tuple[int, list[int] | None]] = []
    original = hf_static.SlotDecoder.capture

    def spy(self, warmup=2, sizes=None):
        recorded.append((warmup, sizes))
        return original(self, warmup, sizes)

    monkeypatch.setattr(hf_static.SlotDecoder, "capture", spy)
    again = run(rollout, prompts, n=4, max_tokens=40, greedy=True, stop_token_ids=stop)
    assert recorded == [(0, [16]), (0, [8])]
    decoder = list(rollout.static.decoders.values())[-1]
    assert decoder.graphs[16] is not None and decoder.graphs[8] is not None and decoder.live == 8
    assert torch.equal(again["responses"], first["responses"])
    torch.testing.assert_close(again["rollout_log_probs"], first["rollout_log_probs"], atol=1e-5, rtol=0)


def test_slot_decoder_steps_llama_family_models(static):
    """The tiny Qwen2 decodes through rlx's own step, its q/k/v and gate/up weights fused, the model's
    parameters views of the fused tensors (no second copy)."""
    static.generate(Batch({"input_ids": torch.tensor([[3, 4]]), "attention_mask": torch.ones(1, 2, dtype=torch.long)},
                          {}), SamplingParams(max_tokens=2))
    assert static.static.slots and all(isinstance(d, SlotDecoder) for d in static.static.decoders.values())
    layer, fused = static.model.model.layers[0], static.static.weights.layers[0]
    q = layer.self_attn.q_proj.weight
    assert q.data_ptr() == fused["qkv"].data_ptr() and fused["qkv"].shape[0] == q.shape[0] + 2 * (
        layer.self_attn.k_proj.weight.shape[0])
    assert layer.mlp.up_proj.weight.data_ptr() == fused["gate_up"][layer.mlp.gate_proj.weight.shape[0]:].data_ptr()


def test_finished_rows_leave_the_batch(static, dynamic, prompts):
    """Rows that stop move out of the step: with 12 rows (a bucket of 16) and some rows stopping within the
    first 16 steps, the step ends at the bucket of 8, and the tokens and log-probs are still those of the
    dynamic cache, which decodes every row to the end."""
    free = run(dynamic, prompts, n=4, max_tokens=70, greedy=True)
    stop = (int(free["responses"][0, 3]),)  # the first prompt's rows stop at their fourth token
    a = run(static, prompts, n=4, max_tokens=70, greedy=True, stop_token_ids=stop)
    b = run(dynamic, prompts, n=4, max_tokens=70, greedy=True, stop_token_ids=stop)
    lengths = b["response_mask"].sum(-1).tolist()
    assert min(lengths) < 16 and max(lengths) > 48
    decoder = list(static.static.decoders.values())[-1]
    assert decoder.batch == 16 and decoder.live == 8
    width = b["responses"].shape[1]
    assert torch.equal(a["responses"][:, :width], b["responses"]) and not a["response_mask"][:, width:].any()
    assert a["response_mask"].sum(-1).tolist() == lengths
    torch.testing.assert_close(a["rollout_log_probs"][:, :width], b["rollout_log_probs"], atol=1e-5, rtol=0)


def test_sampled_rows_leave_the_batch(policy, prompts):
    """Sampling with rows finishing at different steps: every recorded log-prob is the training forward's."""
    rollout = engine(policy, decoder="static", prompt_bucket=8)
    out = run(rollout, prompts, seed=4, n=6, max_tokens=64, temperature=1.0, stop_token_ids=(5,))
    mask = out["response_mask"].bool()
    assert mask.sum(-1).min() < 16 < 32 < mask.sum(-1).max() and list(rollout.static.decoders.values())[-1].live == 8
    with torch.no_grad():
        lp, _ = response_log_probs(rollout.model, out, 1.0, with_entropy=False)
    torch.testing.assert_close(out["rollout_log_probs"][mask], lp[mask], atol=1e-4, rtol=0)


def test_fused_weights_follow_updates_and_sleep(policy, prompts):
    """New weights through update_weights reach the fused step; after a sleep that freed the parameters and
    a reload, the step fuses them again."""
    rollout = engine(policy, decoder="static", prompt_bucket=8, free_on_sleep="discard")
    before = run(rollout, prompts, n=1, max_tokens=6, greedy=True)
    state = {k: v.clone() for k, v in rollout.model.state_dict().items()}
    changed = {k: (v * 0.5 if "mlp" in k else v) for k, v in state.items()}
    rollout.update_weights(changed.items())
    fresh = engine(policy, decoder="dynamic")
    fresh.update_weights(changed.items())
    want = run(fresh, prompts, n=1, max_tokens=6, greedy=True)
    got = run(rollout, prompts, n=1, max_tokens=6, greedy=True)
    assert not torch.equal(want["responses"], before["responses"])
    assert torch.equal(got["responses"], want["responses"])
    rollout.sleep()
    rollout.wake_up()
    rollout.update_weights(state.items())
    assert torch.equal(run(rollout, prompts, n=1, max_tokens=6, greedy=True)["responses"], before["responses"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_slot_attention_kernel_equals_reference(dtype, splits):
    """The Triton decode attention (each row from its own first column, the new key/value from registers; its
    columns in one range or several combined, ``None``: as many as the op chooses) equals the plain-torch
    reference, caches included, on rows of different starts."""
    from rlx.plugins.rollout.hf_static import _triton_attention, attend_reference, attention_op, triton_usable

    torch.manual_seed(0)
    for heads, kv_heads, d, length, slot in [(9, 3, 64, 384, 200), (14, 2, 64, 512, 300), (8, 8, 128, 130, 129)]:
        b, cap = 12, 16
        q = torch.randn(b, heads, d, device="cuda", dtype=dtype)
        k, v = (torch.randn(b, kv_heads, d, device="cuda", dtype=dtype) for _ in range(2))
        caches = [torch.randn(cap, kv_heads, length, d, device="cuda", dtype=dtype) for _ in range(2)]
        start = torch.randint(0, slot, (b,), device="cuda")
        start[0] = slot  # a row with no earlier column
        at = torch.tensor([slot], device="cuda")
        assert triton_usable(q, caches[0])
        ref_caches = [c.clone() for c in caches]
        if splits is None:
            got = attention_op()(q, k, v, caches[0], caches[1], start, at, d ** -0.5)
        else:
            got = _triton_attention()(q, k, v, caches[0], caches[1], start, at, d ** -0.5, splits=splits)
        want = attend_reference(q.float(), k.float(), v.float(), *(c.float() for c in ref_caches), start, at,
                                d ** -0.5)
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
        for c, r in zip(caches, ref_caches, strict=True):
            r[:b].index_copy_(2, at, (k if c is caches[0] else v).unsqueeze(2))
            assert torch.equal(c, r)


@pytest.fixture
def fused_race(monkeypatch):
    """The slot decoder's fused sampling path (rlx::race_sample) on the CPU: the op runs its torch reference
    here, so the decoder's plumbing (the seed drawn each step, the temperature, greedy) is what is tested; the
    Triton kernel itself is tests/plugins/rollout/test_hf_kernels_triton.py's."""
    from rlx.plugins.rollout import hf_kernels

    monkeypatch.setattr(hf_kernels, "race_available", lambda device: True)
    return hf_kernels


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_fused_sampling_path_samples_the_policy(policy, prompts, fused_race, temperature):
    """Through rlx::race_sample: no (rows, vocabulary) noise buffer; every recorded log-prob is the training
    forward's at the temperature; a prompt's samples differ; greedy decodes as the dynamic cache does."""
    rollout = engine(policy, decoder="static", prompt_bucket=8)
    out = run(rollout, prompts, seed=4, n=6, max_tokens=40, temperature=temperature, stop_token_ids=(5,))
    decoder = list(rollout.static.decoders.values())[-1]
    assert decoder.fused and decoder.noise is None
    mask = out["response_mask"].bool()
    with torch.no_grad():
        lp, _ = response_log_probs(rollout.model, out, temperature, with_entropy=False)
    torch.testing.assert_close(out["rollout_log_probs"][mask], lp[mask], atol=1e-4, rtol=0)
    rows = out["responses"].view(3, 6, -1)
    assert all(len({tuple(r.tolist()) for r in rows[i]}) > 1 for i in range(3))
    dynamic = engine(policy, decoder="dynamic")
    a = run(rollout, prompts, n=2, max_tokens=9, greedy=True)
    b = run(dynamic, prompts, n=2, max_tokens=9, greedy=True)
    assert list(rollout.static.decoders.values())[-1].fused
    assert torch.equal(a["responses"], b["responses"])
    torch.testing.assert_close(a["rollout_log_probs"], b["rollout_log_probs"], atol=1e-5, rtol=0)


def test_a_failing_fused_kernel_falls_back_to_torchs_sampling(policy, prompts, fused_race, monkeypatch):
    """A fused kernel that fails (a GPU whose Triton cannot build it) warns once and the engine decodes with the
    kernels before round 3 from then on (torch's sampling): the run goes on with the same law."""
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("no kernel for this GPU")

    from rlx.plugins.rollout import hf_static

    monkeypatch.setattr(fused_race, "race_reference", broken)
    monkeypatch.setattr(hf_static, "FUSED_KERNELS", True)  # restored after the test: the fallback turns it off
    rollout = engine(policy, decoder="static", prompt_bucket=8)
    with pytest.warns(RuntimeWarning, match="decode kernels .* failed"):
        out = run(rollout, prompts, seed=4, n=2, max_tokens=12, temperature=1.0)
    assert calls and not rollout.static.fused_kernels and not hf_static.FUSED_KERNELS
    assert not list(rollout.static.decoders.values())[-1].fused
    mask = out["response_mask"].bool()
    with torch.no_grad():
        lp, _ = response_log_probs(rollout.model, out, 1.0, with_entropy=False)
    torch.testing.assert_close(out["rollout_log_probs"][mask], lp[mask], atol=1e-4, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_rope_attention_kernel_equals_rotation_then_reference():
    """rlx::slot_attention_rope on a GPU (bf16, views of one q/k/v product): the kernel's own rotation equals
    torch's rotation followed by the reference attention, cache included."""
    from rlx.plugins.rollout.hf_static import _rotate, attend_reference, rope_attention_op

    torch.manual_seed(0)
    b, heads, kv_heads, d, length, slot = 12, 14, 2, 64, 512, 300
    qkv = torch.randn(b, (heads + 2 * kv_heads) * d, device="cuda", dtype=torch.bfloat16)
    nq, nk = heads * d, kv_heads * d
    q, k, v = (qkv[:, :nq].reshape(b, heads, d), qkv[:, nq:nq + nk].reshape(b, kv_heads, d),
               qkv[:, nq + nk:].reshape(b, kv_heads, d))
    angle = torch.rand(b, d // 2, device="cuda") * 6
    cos, sin = (torch.cat([f(angle)] * 2, -1).to(torch.bfloat16) for f in (torch.cos, torch.sin))
    caches = [torch.randn(16, kv_heads, length, d, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    ref = [c.clone().float() for c in caches]
    start = torch.randint(0, slot, (b,), device="cuda")
    at = torch.tensor([slot], device="cuda")
    got = rope_attention_op()(q, k, v, cos, sin, caches[0], caches[1], start, at, d ** -0.5)
    qr, kr = (_rotate(x.float(), cos.float()[:, None], sin.float()[:, None]) for x in (q, k))
    want = attend_reference(qr, kr, v.float(), *ref, start, at, d ** -0.5)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(caches[0][:b, :, slot].float(), kr, atol=2e-2, rtol=2e-2)


def test_own_prefill_writes_the_models_keys_values_and_first_token(policy, prompts, dynamic, monkeypatch):
    """slot_prefill (hf_static.OWN_PREFILL): rlx's own pass over the fused weights leaves the cache as the model's
    own forward and the copy do (float32, padding columns zero) and draws the same first token with the same
    log-prob; greedy decoding with it is the dynamic cache's."""
    from rlx.plugins.rollout import hf_static

    monkeypatch.setattr(hf_static, "OWN_PREFILL", True)
    rollout = engine(policy, decoder="static", prompt_bucket=8)
    a = run(rollout, prompts, n=2, max_tokens=9, greedy=True)
    b = run(dynamic, prompts, n=2, max_tokens=9, greedy=True)
    assert torch.equal(a["responses"], b["responses"])
    torch.testing.assert_close(a["rollout_log_probs"], b["rollout_log_probs"], atol=1e-5, rtol=0)
    decoder = list(rollout.static.decoders.values())[-1]
    assert decoder.prefill_fn is not None
    ids, mask = decoder.tokens.new_zeros(8, 16), decoder.tokens.new_zeros(8, 16)
    for i, row in enumerate(prompts["input_ids"].repeat(3, 1)[:8]):
        real = row[prompts["attention_mask"].repeat(3, 1)[i].bool()]
        ids[i, 16 - len(real):], mask[i, 16 - len(real):] = real, 1
    from torch import _dynamo

    from rlx.plugins.rollout.hf_static import slot_prefill

    _dynamo.reset()
    runs = []
    for fn in (torch.compile(slot_prefill, backend="aot_eager"), decoder.prefill_fn, None):  # as the engine compiles it
        decoder.prefill_fn = fn
        decoder.prefill(ids, mask, 8)
        runs.append(([c.clone() for c in decoder.k_caches + decoder.v_caches], decoder.tokens[:, 0].clone(),
                     decoder.log_probs[:, 0].clone()))
    _dynamo.reset()
    *ours, (model, model_token, model_lp) = runs
    for own, own_token, own_lp in ours:
        for x, y in zip(own, model, strict=True):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
        assert torch.equal(own_token, model_token)
        torch.testing.assert_close(own_lp, model_lp, atol=1e-5, rtol=0)


def test_the_decode_step_with_round_3_ops_compiles_without_a_graph_break(policy, prompts, fused_race):
    """The slot step as the engine compiles it on a GPU (dynamic batch), with rlx::race_sample and
    rlx::slot_attention_rope inside: dynamo traces it in one graph (the ops are opaque, registered once, fetched
    outside the step) and the compiled step gives the eager step's tokens and log-probs (greedy)."""
    import torch._dynamo

    rollout = engine(policy, decoder="static", prompt_bucket=8)
    run(rollout, prompts, n=1, max_tokens=4, greedy=True)
    decoder = list(rollout.static.decoders.values())[-1]
    assert decoder.fused and decoder.race is not None
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(decoder._choose, backend="aot_eager", dynamic=None)
    b = decoder.live
    args = (decoder.tok[:b], decoder.pos[:b], decoder.start[:b], decoder.seed)
    for t in args[:3]:
        torch._dynamo.maybe_mark_dynamic(t, 0)
    want = decoder._choose(*(a.clone() for a in args))
    got = compiled(*(a.clone() for a in args))
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=0)
    torch._dynamo.reset()


@pytest.mark.parametrize("own", [True, False], ids=["own-prefill", "model-prefill"])
def test_a_repeated_prompt_is_prefilled_once_with_the_same_cache_and_first_token(policy, prompts, monkeypatch, own):
    """hf_static.SHARE_PREFILL: rows that repeat a prompt (a GRPO step's samples) share one prefill, whose keys,
    values and last logits are copied to them. The cache and first token are those of prefilling every row."""
    from rlx.plugins.rollout import hf_static
    from rlx.step import distinct_prompts

    monkeypatch.setattr(hf_static, "OWN_PREFILL", own)
    rollout = engine(policy, decoder="static", prompt_bucket=8)
    run(rollout, prompts, n=2, max_tokens=3, greedy=True)
    decoder = list(rollout.static.decoders.values())[-1]
    rows = torch.tensor([0, 1, 0, 2, 1, 0, 2, 2])  # three distinct prompts, in the decoder's 8 rows of 16 columns
    ids, mask = decoder.tokens.new_zeros(8, 16), decoder.tokens.new_zeros(8, 16)
    for i, row in enumerate(rows.tolist()):
        real = prompts["input_ids"][row][prompts["attention_mask"][row].bool()]
        ids[i, 16 - len(real):], mask[i, 16 - len(real):] = real, 1
    firsts, inverse = distinct_prompts(ids, mask)
    assert torch.equal(ids[firsts][inverse], ids) and sorted(firsts.tolist()) == [0, 1, 3]
    assert len(distinct_prompts(prompts["input_ids"], prompts["attention_mask"])[0]) == 3  # each its own
    seen: list[int] = []
    if own:
        original = decoder.prefill_fn
        decoder.prefill_fn = lambda w, i, *a: (seen.append(len(i)), original(w, i, *a))[1]
    runs = []
    for share in (True, False):
        monkeypatch.setattr(hf_static, "SHARE_PREFILL", share)
        torch.manual_seed(0)
        decoder.prefill(ids, mask, len(rows))
        runs.append(([c[:len(rows)].clone() for c in decoder.k_caches + decoder.v_caches],
                     decoder.tokens[:len(rows), 0].clone(), decoder.log_probs[:len(rows), 0].clone()))
    if own:
        assert seen == [3, 8]  # the distinct prompts, then every row
    (shared, token, lp), (whole, want_token, want_lp) = runs
    for x, y in zip(shared, whole, strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    assert torch.equal(token, want_token)
    torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=0)


def test_a_late_recording_that_fails_steps_unrecorded_and_is_recorded_again_with_warm_ups(static, dynamic, prompts,
                                                                                         monkeypatch):
    """The control flow of recording after a discard, on the CPU with stand-in graphs (a replay runs the step):
    the full bucket before the prefill, the bucket of 8 when rows have stopped; a late recording that fails
    warns, steps unrecorded (the same tokens), and is recorded with warm-ups before the next prefill."""
    from rlx.plugins.rollout import hf_static

    free = run(dynamic, prompts, n=4, max_tokens=70, greedy=True)
    stop = (int(free["responses"][0, 3]),)  # the first prompt's rows stop at their fourth token
    want = run(static, prompts, n=4, max_tokens=70, greedy=True, stop_token_ids=stop)
    decoder = list(static.static.decoders.values())[-1]
    calls: list[tuple[int, list[int] | None]] = []

    class Replay:
        def __init__(self, b: int) -> None:
            self.b = b

        def replay(self) -> None:
            decoder.step(self.b)

    def capture(self, warmup=2, sizes=None):
        calls.append((warmup, sizes))
        if sizes == [8] and warmup == 0:
            raise RuntimeError("capture failed")
        for b in sizes or hf_static.buckets(self.batch):
            self.graphs[b] = Replay(b)

    monkeypatch.setattr(hf_static.SlotDecoder, "capture", capture)
    decoder.use_graph, decoder.warm, decoder.graphs = True, False, {}
    try:
        with pytest.warns(UserWarning, match="without warm-up failed"):
            got = run(static, prompts, n=4, max_tokens=70, greedy=True, stop_token_ids=stop)
        assert calls == [(0, [16]), (0, [8])] and decoder.graphs[8] is None and decoder.live == 8
        assert torch.equal(got["responses"], want["responses"])
        calls.clear()
        again = run(static, prompts, n=4, max_tokens=70, greedy=True, stop_token_ids=stop)
        assert calls == [(2, [8])] and isinstance(decoder.graphs[8], Replay)
        assert torch.equal(again["responses"], want["responses"])
    finally:  # the module's engine steps unrecorded again, as on the CPU
        decoder.use_graph, decoder.graphs = False, {}


@pytest.mark.parametrize("schedule,calls", [("mlp", 2), ("mlp+next", 3)])
def test_the_l2_prefetch_stays_in_the_compiled_step_and_changes_nothing(policy, prompts, monkeypatch, schedule,
                                                                       calls):
    """With the L2 prefetch on (hf_prefetch: a GPU only; here its op is put in by hand, and off a GPU it returns at
    once), the slot step compiled by inductor keeps one rlx::l2_prefetch call per layer (2 layers; with
    ``mlp+next`` one more between the layers), although nothing reads what it writes, and gives the tokens and
    log-probs of the step without it."""
    import torch._dynamo
    from torch.profiler import ProfilerActivity, profile

    from rlx.plugins.rollout import hf_prefetch

    rollout = engine(policy, decoder="static", prompt_bucket=8)
    run(rollout, prompts, n=1, max_tokens=4, greedy=True)
    decoder = list(rollout.static.decoders.values())[-1]
    w = decoder.w
    assert w.scratch is None  # never on off a GPU
    b = decoder.live
    args = (decoder.tok[:b], decoder.pos[:b], decoder.start[:b], decoder.seed)
    want = decoder._choose(*(a.clone() for a in args))
    monkeypatch.setattr(hf_prefetch, "MODE", "load")
    monkeypatch.setattr(w, "scratch", torch.zeros(1, dtype=torch.int32), raising=False)
    monkeypatch.setattr(w, "prefetch", hf_prefetch.prefetch_op(), raising=False)
    monkeypatch.setattr(w, "schedule", schedule, raising=False)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(decoder._choose, dynamic=None)
    for t in args[:3]:
        torch._dynamo.maybe_mark_dynamic(t, 0)
    compiled(*(a.clone() for a in args))  # compiles
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        got = compiled(*(a.clone() for a in args))
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    counts = {e.key: e.count for e in prof.key_averages()}
    assert counts.get("rlx::l2_prefetch") == calls, {k: v for k, v in counts.items() if "rlx" in k}
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=0)
    torch._dynamo.reset()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("mode", ["line", "bulk", "load"])
def test_recorded_steps_with_the_l2_prefetch_decode_what_they_decode_without_it(policy, prompts, monkeypatch, mode):
    """The prefetch forks a side stream inside each recorded step and joins it at the step's end: greedy decodes
    through the recorded graphs, with each way of asking for the bytes, equal those without the prefetch."""
    from rlx.plugins.rollout import hf_prefetch

    def decode(setting: str) -> Batch:
        monkeypatch.setattr(hf_prefetch, "MODE", setting)
        monkeypatch.setattr(hf_prefetch, "SCHEDULE", "mlp+next")
        rollout = engine(policy, "cuda", dtype="bfloat16", compile="default", prompt_bucket=8)
        out = run(rollout, prompts, n=4, max_tokens=40, greedy=True)
        assert (rollout.static.weights.scratch is not None) == (setting != "off")
        return out

    plain, fetched = decode("off"), decode(mode)
    assert mode == hf_prefetch.MODE  # its kernel ran (a failure turns it off)
    assert torch.equal(plain["responses"], fetched["responses"])
    torch.testing.assert_close(plain["rollout_log_probs"], fetched["rollout_log_probs"], atol=0, rtol=0)
