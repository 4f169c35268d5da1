"""Continuous batching under pressure: random arrivals, lengths, aborts, tiny pools that force preemption.

Every request must finish or be aborted, every finished output must equal its batch-1 greedy output
(the training path, no cache), the block invariant must hold after every step, and the pool must
return to empty.
"""

import functools
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from mlsyslab.errors import InvalidValue, QueueFull
from mlsyslab.nn import cpu_kernels
from mlsyslab.nn.llama import Llama, LlamaConfig
from mlsyslab.serve.config import EngineConfig
from mlsyslab.serve.engine import Engine
from mlsyslab.serve.kv_cache import block_bytes as kv_block_bytes
from mlsyslab.serve.sampling_params import SamplingParams

from tests.serve.tiny import CONFIG, block_bytes, greedy_reference, tiny_model

MODEL = tiny_model()


@functools.cache
def reference(prompt: tuple[int, ...], new_tokens: int) -> list[int]:
    return greedy_reference(MODEL, list(prompt), new_tokens)


@functools.cache
def prompt_reference(prompt: tuple[int, ...]) -> list[float]:
    """Each prompt token's log-probability after the first, from one pass of the training path."""
    with torch.no_grad():
        logprobs = torch.log_softmax(MODEL(torch.tensor([prompt]))[0], dim=-1)
    return [float(logprobs[p, prompt[p + 1]]) for p in range(len(prompt) - 1)]


def run(engine: Engine, arrivals: list[tuple[int, list[int], int, int | None]], stop_token_ids=(),
        temperature: float = 0.0, scored: bool = False) -> tuple[dict, set]:
    """Step the engine, adding and aborting requests on schedule (request i seeded with i; with `scored`, the
    even ones also score their prompts); check the block invariant every step."""
    finished, aborted, step = {}, set(), 0
    while step < 1000 and (engine.has_work() or any(arrive >= step for arrive, *_ in arrivals)):
        for index, (arrive, prompt, max_tokens, abort_at) in enumerate(arrivals):
            if arrive == step:
                engine.add_request(str(index), prompt, SamplingParams(
                    max_tokens=max_tokens, temperature=temperature, seed=index, stop_token_ids=stop_token_ids,
                    prompt_logprobs=0 if scored and index % 2 == 0 else None))
            if abort_at == step and str(index) not in finished and arrive <= step:
                engine.abort(str(index))
                aborted.add(str(index))
        for output in engine.step()[1]:
            finished[output.request_id] = output
        engine.check()
        step += 1
    return finished, aborted


request_strategy = st.tuples(
    st.integers(0, 8),  # arrival step
    st.integers(0, 3),  # which shared prefix (exercises the prefix cache)
    st.integers(1, 30),  # prompt length
    st.integers(1, 12),  # max_tokens
    st.one_of(st.none(), st.integers(0, 25)),  # abort step
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=st.lists(request_strategy, min_size=1, max_size=6), block_size=st.sampled_from([2, 4, 8]),
       spare_blocks=st.integers(0, 12), budget=st.integers(1, 48), prefix_cache=st.booleans(),
       scored=st.booleans(), speculative=st.sampled_from([0, 3]), seed=st.integers(0, 2**16))
def test_every_request_finishes_or_aborts_with_batch_1_output_and_no_leak(requests, block_size, spare_blocks,
                                                                          budget, prefix_cache, scored, speculative,
                                                                          seed):
    """... and every prompt asked to be scored (`prompt_logprobs`) is scored as one pass of the training path
    scores it, whatever its chunks, cached prefix or preemptions; with speculative decoding too (n-gram drafts of
    up to 3 tokens: greedy outputs unchanged)."""
    import random

    rng = random.Random(seed)
    prefixes = [[rng.randrange(CONFIG.vocab) for _ in range(30)] for _ in range(4)]
    arrivals = []
    for arrive, prefix, length, max_tokens, abort_at in requests:
        cut = rng.randrange(length + 1)
        prompt = prefixes[prefix][:cut] + [rng.randrange(CONFIG.vocab) for _ in range(length - cut)]
        arrivals.append((arrive, prompt, max_tokens, abort_at))
    largest = max(-(-(len(p) + m) // block_size) for _, p, m, _ in arrivals)
    engine = Engine(MODEL, config=EngineConfig(kv_cache_bytes=(largest + spare_blocks) * block_bytes(block_size),
                                               block_size=block_size, max_batched_tokens=budget,
                                               prefix_cache=prefix_cache, speculative_tokens=speculative, ngram_min=1,
                                               speculative_max_rows=32))
    finished, aborted = run(engine, arrivals, scored=scored)
    event(f"draft tokens kept: {engine.accepted_draft_tokens > 0}")
    event(f"preempted: {engine.scheduler.preemptions > 0}")
    event(f"aborted: {bool(aborted)}")
    event(f"prefix hits: {bool(engine.scheduler.radix and engine.scheduler.radix.hit_tokens)}")
    for index, (_, prompt, max_tokens, _) in enumerate(arrivals):
        request_id = str(index)
        assert request_id in finished or request_id in aborted
        if request_id in finished:
            assert finished[request_id].finish_reason == "length"
            assert finished[request_id].output_ids == reference(tuple(prompt), max_tokens)
            if scored and index % 2 == 0:
                got = [s.logprob for s in finished[request_id].prompt_logprobs[1:]]
                assert got == pytest.approx(prompt_reference(tuple(prompt)), abs=1e-5)
    radix = engine.scheduler.radix
    assert engine.kv.num_used == (len(radix.blocks()) if radix else 0)
    if radix:
        radix.evict(engine.kv.num_blocks)
    assert engine.kv.num_used == 0
    engine.kv.check([])


# head_dim 32: a model the one-call decode step (nn.fused_decode) runs, so greedy decodes run several steps a call
AHEAD_CONFIG = LlamaConfig(vocab=96, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=32, ffn_hidden=136, max_seq=192)
AHEAD_MODEL = Llama(AHEAD_CONFIG).initialize(0.5, torch.Generator().manual_seed(0)).eval()


@functools.cache
def one_step_reference(prompt: tuple[int, ...], max_tokens: int, stop_token_ids: tuple[int, ...],
                       temperature: float = 0.0, seed: int | None = None) -> list[int]:
    """The request alone, one decode step per call."""
    engine = Engine(AHEAD_MODEL, config=EngineConfig(kv_cache_bytes=10_000_000, decode_steps=1))
    engine.add_request("alone", list(prompt), SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                                                             stop_token_ids=stop_token_ids))
    while engine.has_work():
        if finished := engine.step()[1]:
            return finished[0].output_ids


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the C++ kernels did not build here")
@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(requests=st.lists(request_strategy, min_size=1, max_size=6), block_size=st.sampled_from([2, 4, 8]),
       spare_blocks=st.integers(0, 12), budget=st.integers(1, 48), prefix_cache=st.booleans(),
       stop_token=st.integers(0, AHEAD_CONFIG.vocab - 1), temperature=st.sampled_from([0.0, 0.8]),
       seed=st.integers(0, 2**16))
def test_multi_step_decoding_loses_nothing_and_equals_one_step_at_a_time(requests, block_size, spare_blocks, budget,
                                                                          prefix_cache, stop_token, temperature, seed):
    """The same property, with decodes running up to 5 steps a call (fp32 on the streamed step, whose numbers do
    not depend on the batch), greedy or sampled with a seed per request: stop tokens met inside a run, aborts and
    preemptions between runs, and look-ahead blocks taken only when free."""
    import random

    rng = random.Random(seed)
    arrivals = []
    for arrive, _, length, max_tokens, abort_at in requests:
        arrivals.append((arrive, [rng.randrange(AHEAD_CONFIG.vocab) for _ in range(length)], max_tokens, abort_at))
    bytes_per_block = kv_block_bytes(AHEAD_CONFIG, block_size, torch.float32)
    largest = max(-(-(len(p) + m) // block_size) for _, p, m, _ in arrivals)
    engine = Engine(AHEAD_MODEL, config=EngineConfig(
        kv_cache_bytes=(largest + spare_blocks) * bytes_per_block, block_size=block_size,
        max_batched_tokens=budget, prefix_cache=prefix_cache, decode_steps=5))
    with mock.patch.object(engine, "decode_ahead", wraps=engine.decode_ahead) as ahead:
        finished, aborted = run(engine, arrivals, stop_token_ids=[stop_token], temperature=temperature)
    expected = {str(i): one_step_reference(tuple(prompt), max_tokens, (stop_token,), temperature, i)
                for i, (_, prompt, max_tokens, _) in enumerate(arrivals)}
    event(f"ran ahead: {ahead.call_count > 0}")
    for request_id in expected:
        assert request_id in finished or request_id in aborted
        if request_id in finished:
            assert finished[request_id].output_ids == expected[request_id]
    radix = engine.scheduler.radix
    assert engine.kv.num_used == (len(radix.blocks()) if radix else 0)


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the C++ kernels did not build here")
def test_greedy_decodes_run_ahead_only_while_nobody_waits():
    # no bound in seconds on a run (decode_ahead_s): its length must not depend on how busy the machine is
    engine = Engine(AHEAD_MODEL, config=EngineConfig(kv_cache_bytes=10_000_000, decode_steps=4, decode_ahead_s=1e6))
    ahead = mock.patch.object(engine, "decode_ahead", wraps=engine.decode_ahead).start()
    outputs = {}

    def step():
        deltas, finished = engine.step()
        outputs.update({output.request_id: output.output_ids for output in finished})
        return deltas

    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=11, temperature=0))
    engine.add_request("b", [4, 5], SamplingParams(max_tokens=11, temperature=0, logprobs=0))
    engine.add_request("c", [6], SamplingParams(max_tokens=11, temperature=0))
    step()  # the three prompts
    engine.abort("b")  # logprobs need the logits of every step
    step()  # the first decode step of two rows: measured, one step
    assert ahead.call_count == 0
    deltas = step()
    assert [call.args[1] for call in ahead.call_args_list] == [4]
    assert [len(delta.token_ids) for delta in deltas] == [4, 4]  # one delta per request, of the run's 4 tokens
    engine.add_request("d", [7, 8], SamplingParams(max_tokens=5, temperature=0))
    step()  # d waits: one step, its prompt with a's and c's decodes
    step()  # the first decode step of three rows
    step()  # a and c have 11 - 8 tokens left, d 5 - 2
    assert [call.args[1] for call in ahead.call_args_list] == [4, 3]
    assert not engine.has_work()
    assert engine.prefill_tokens == 3 + 2 + 2  # the prompts of more than one token, nothing computed twice
    for request_id, prompt, max_tokens in (("a", [1, 2, 3], 11), ("c", [6], 11), ("d", [7, 8], 5)):
        assert outputs[request_id] == one_step_reference(tuple(prompt), max_tokens, ())
    assert engine.kv.num_used == len(engine.scheduler.radix.blocks())


def test_preemption_by_recompute_loses_nothing():
    """A pool that holds one request at a time: the younger ones are preempted and recomputed."""
    prompts = [[(7 * i + j) % CONFIG.vocab for j in range(10 + i)] for i in range(3)]
    engine = Engine(MODEL, config=EngineConfig(kv_cache_bytes=6 * block_bytes(4), block_size=4,
                                               max_batched_tokens=64, prefix_cache=False))
    finished, _ = run(engine, [(0, prompt, 12, None) for prompt in prompts])
    assert engine.scheduler.preemptions > 0
    for index, prompt in enumerate(prompts):
        assert finished[str(index)].output_ids == reference(tuple(prompt), 12)
    assert engine.kv.num_used == 0


def test_chunked_prefill_mixes_with_decodes():
    engine = Engine(MODEL, config=EngineConfig(kv_cache_bytes=64 * block_bytes(4), block_size=4, max_batched_tokens=8))
    engine.add_request("short", [1, 2, 3], SamplingParams(max_tokens=20, temperature=0))
    engine.step()
    engine.add_request("long", list(range(40)), SamplingParams(max_tokens=2, temperature=0))
    batch = engine.scheduler.schedule()
    assert [(item.request.request_id, item.num_tokens) for item in batch] == [("short", 1), ("long", 7)]


def test_queue_bound_and_input_errors():
    engine = Engine(MODEL, config=EngineConfig(kv_cache_bytes=20 * block_bytes(4), block_size=4, max_waiting=2))
    engine.add_request("a", [1], SamplingParams())
    engine.add_request("b", [1], SamplingParams())
    with pytest.raises(QueueFull):
        engine.add_request("c", [1], SamplingParams())
    with pytest.raises(InvalidValue, match="request_id"):
        engine.add_request("a", [1], SamplingParams())
    with pytest.raises(InvalidValue, match="prompt tokens"):
        engine.add_request("d", [1] * CONFIG.max_seq, SamplingParams())
    with pytest.raises(InvalidValue, match="KV cache"):
        engine.add_request("e", [1] * 70, SamplingParams(max_tokens=20))
    engine.abort("a")
    engine.abort("b")
    assert not engine.has_work() and engine.kv.num_used == 0


def test_a_request_is_held_to_the_pool_only_as_far_as_the_context_lets_it_grow():
    """max_tokens past the context length ends at the context (finish "length"): such a request fits a pool larger
    than the context, and one that could reach the context in a smaller pool is refused."""
    roomy = Engine(MODEL, config=EngineConfig(kv_cache_bytes=(CONFIG.max_seq // 4 + 1) * block_bytes(4), block_size=4,
                                              prefix_cache=False))
    finished, _ = run(roomy, [(0, [1] * 40, 10**6, None)])
    assert len(finished["0"].output_ids) == CONFIG.max_seq - 40 and finished["0"].finish_reason == "length"
    assert roomy.kv.num_used == 0
    tight = Engine(MODEL, config=EngineConfig(kv_cache_bytes=(CONFIG.max_seq // 4 - 1) * block_bytes(4), block_size=4))
    with pytest.raises(InvalidValue, match="KV cache's capacity"):
        tight.add_request("long", [1] * 40, SamplingParams(max_tokens=10**6))
