"""The one-call decode step (nn/fused_decode.py; csrc/decode_layers.cpp and csrc/streamed_decode.cpp) equals the
Python layers bit for bit."""

import dataclasses

import pytest
import torch

from mlsyslab.nn import cpu_kernels
from mlsyslab.nn.fused_decode import FusedDecode
from mlsyslab.nn.llama import Llama, LlamaConfig
from mlsyslab.nn import packed_linear
from mlsyslab.nn.packed_linear import packed_for_inference, streamed_below
from mlsyslab.nn.paged_attention import DecodeSteps, PagedAttention, SequenceSlice
from mlsyslab.nn.rope import RopeScaling
from mlsyslab.serve.config import EngineConfig
from mlsyslab.serve.engine import LLM, Engine
from mlsyslab.serve.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="the C++ kernels did not build here")

# ffn_hidden 136: silu(gate)·up is shared out in spans of 64 columns, the last one partial
CONFIG = LlamaConfig(vocab=96, hidden=64, layers=3, heads=4, kv_heads=2, head_dim=32, ffn_hidden=136, max_seq=256)


def serving_model(dtype) -> Llama:
    return packed_for_inference(plain_model(dtype))


def plain_model(dtype) -> Llama:
    """Random weights, the norms' too (each norm's weights its own: a norm applied with another's shows)."""
    model = Llama(CONFIG).initialize(0.1, torch.Generator().manual_seed(0))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.copy_(1 + 0.2 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(len(name))))
    return model.to(dtype).eval()


def decode_case(dtype, context_lens, block_size=16, num_blocks=32, ahead=0):
    """Caches with random contents; each sequence's blocks scattered (room for `ahead` more tokens); one new token
    per sequence."""
    generator = torch.Generator().manual_seed(1)
    shape = (CONFIG.layers, CONFIG.kv_heads, num_blocks, block_size, CONFIG.head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=generator).to(dtype) for _ in range(2))
    order = torch.randperm(num_blocks, generator=generator).tolist()
    slices = []
    for length in context_lens:
        count = -(-(length + ahead) // block_size)
        slices.append(SequenceSlice(1, length, order[:count]))
        order = order[count:]
    ids = torch.randint(CONFIG.vocab, (len(context_lens),), generator=generator)
    positions = torch.tensor(context_lens) - 1
    return k_cache, v_cache, slices, ids, positions


@pytest.fixture(params=["this CPU's plan", "AVX2 plan", "AVX2 plan, ffn_hidden 140", "AVX2 plan, q/k/v biases",
                        "this CPU's plan, q and k head norms"])
def plan(request, monkeypatch):
    """The kernel plan of this CPU, and the one of CPUs where oneDNN cannot pack bf16 (steps under
    `streamed_below(dtype)` rows take the streamed kernel in both, so the step is one `streamed_decode`: every
    row count for bf16 on the pair kernel, 96 for fp32 on the panel kernel, else 4 rows where oneDNN packs bf16, 16
    where it cannot); with
    ffn_hidden 140 an output group of gate|up holds both gate and up rows (each thread computes the gate and
    up rows of its own columns); with Qwen2's biases on q/k/v (both C++ steps: 16 rows take `decode_layers`); with
    Qwen3's q and k head norms."""
    if request.param.startswith("AVX2 plan"):
        monkeypatch.setattr(packed_linear, "onednn_packs_bf16", lambda: False)
        monkeypatch.setattr(cpu_kernels, "panels", lambda dtype: False)
    if request.param.endswith("ffn_hidden 140"):
        monkeypatch.setitem(globals(), "CONFIG", dataclasses.replace(CONFIG, ffn_hidden=140))
    if request.param.endswith("biases"):
        monkeypatch.setitem(globals(), "CONFIG", dataclasses.replace(CONFIG, qkv_bias=True))
    if request.param.endswith("head norms"):
        monkeypatch.setitem(globals(), "CONFIG", dataclasses.replace(CONFIG, qk_norm=True))
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("context_lens", [[1], [40], [5, 16, 17], [5, 16, 17, 70, 33], [3 + 5 * i for i in range(16)]])
def test_fused_decode_equals_the_python_layers_and_writes_the_same_cache(dtype, context_lens, plan):
    model = serving_model(dtype)
    assert FusedDecode.applies_to(model)
    fused = FusedDecode(model)
    # one parallel region under streamed_below(dtype) rows, the per-op loop from there
    assert fused.plan(len(context_lens)).streamed == (len(context_lens) < streamed_below(dtype))
    k_cache, v_cache, slices, ids, positions = decode_case(dtype, context_lens, num_blocks=64)
    rows = torch.arange(len(context_lens))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    some_rows = torch.tensor([len(context_lens) - 1, 0])  # logits of a few rows, in any order
    with torch.inference_mode():
        before = k_cache.clone(), v_cache.clone()
        expected = model.forward_packed(ids, positions, PagedAttention(k_ref, v_ref, slices), rows)
        expected_picked = model.forward_packed(ids, positions, PagedAttention(*before, slices), some_rows)
        got, argmax = fused(ids, positions, PagedAttention(k_cache, v_cache, slices), rows)
        picked, picked_argmax = fused(ids, positions, PagedAttention(*(t.clone() for t in before), slices), some_rows)
    assert torch.equal(got, expected)
    if fused.plan(len(context_lens)).streamed:  # the step's own greedy tokens: torch's first largest logit
        assert torch.equal(argmax, expected.max(dim=-1).indices)
        assert torch.equal(picked_argmax, expected_picked.max(dim=-1).indices)
    else:
        assert argmax is None and picked_argmax is None
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    assert torch.equal(picked, expected_picked)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_streamed_step_is_the_same_on_any_number_of_threads(dtype, threads):
    """Each output is computed by one thread, by the same instructions whatever the team: 1 thread, and 3 (an odd
    team, and more threads than this machine's 2 cores), give the Python layers' logits and cache as 2 do."""
    model = serving_model(dtype)
    fused = FusedDecode(model)
    assert fused.plan(3).streamed
    k_cache, v_cache, slices, ids, positions = decode_case(dtype, [5, 16, 40])
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    rows, before = torch.arange(3), torch.get_num_threads()
    with torch.inference_mode():
        expected = model.forward_packed(ids, positions, PagedAttention(k_ref, v_ref, slices), rows)
        torch.set_num_threads(threads)
        try:
            got, _ = fused(ids, positions, PagedAttention(k_cache, v_cache, slices), rows)
        finally:
            torch.set_num_threads(before)
    assert torch.equal(got, expected)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_the_streamed_steps_greedy_token_is_the_first_of_equal_largest_logits():
    """Two threads note the largest logit of their own columns; a tie across them goes to the first column,
    as torch's max(dim).indices (and HF's argmax) break it."""
    k_cache, v_cache, slices, ids, positions = decode_case(torch.bfloat16, [30])

    def step(model):
        with torch.inference_mode():
            return FusedDecode(packed_for_inference(model))(ids, positions, PagedAttention(k_cache.clone(), v_cache.clone(),
                                                                                         slices), torch.arange(1))

    model = plain_model(torch.bfloat16)
    logits, argmax = step(model)
    largest = int(argmax)
    assert logits[0, largest] > 0
    tied = [token for token in (5, CONFIG.vocab - 3) if token not in ids.tolist() + [largest]]  # one in each half
    with torch.no_grad():  # the tied lm_head's rows of two tokens: twice the largest logit's row
        model.embed_tokens.weight[tied] = 2 * model.embed_tokens.weight[largest]
    logits, argmax = step(model)
    assert logits[0, tied[0]] == logits[0, tied[1]] == logits[0].max()
    assert argmax.tolist() == [tied[0]] == logits.max(dim=-1).indices.tolist()


def test_streamed_decode_refuses_inputs_that_do_not_fit():
    model = serving_model(torch.float32)
    fused = FusedDecode(model)
    k_cache, v_cache, slices, ids, positions = decode_case(torch.float32, [20, 3])
    with pytest.raises(RuntimeError, match=r"logit_rows\[0\] = 2: not a row of hidden \(0..1\)"):
        fused(ids, positions, PagedAttention(k_cache, v_cache, slices), torch.tensor([2]))
    with pytest.raises(RuntimeError, match=r"input_ids\[1\] = 96: not a token of the embedding \(0..95\)"):
        fused(torch.tensor([0, 96]), positions, PagedAttention(k_cache, v_cache, slices), torch.arange(2))
    with pytest.raises(RuntimeError, match=r"positions\[0\]\[0\] = 256: outside the rope tables' 256 positions"):
        fused(ids, torch.tensor([256, 2]), PagedAttention(k_cache, v_cache, slices), torch.arange(2))
    plan = fused.plan(2)
    qkv = plan.weights[5] = plan.weights[4]  # layer 1's o_proj given its q|k|v tiles (groups of 8, or 48 in panels)
    expected = f"tiles: out_features 64 does not fit tiles of {len(qkv)} groups of {qkv.shape[2]} rows"
    with pytest.raises(RuntimeError, match=expected):
        fused(ids, positions, PagedAttention(k_cache, v_cache, slices), torch.arange(2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("context_lens", [[1], [15, 40, 70], [3 + 5 * i for i in range(15)]])
def test_steps_ahead_equal_one_step_at_a_time(dtype, context_lens, plan):
    """Multi-step decoding: k steps in one call, each row's greedy token fed back, give the tokens and the cache of
    k single steps (crossing block boundaries: 15 + 1 token opens a block)."""
    fused = FusedDecode(serving_model(dtype))
    if not fused.runs_ahead(len(context_lens)):  # only the streamed step runs ahead
        assert len(context_lens) >= streamed_below(dtype)
        pytest.skip(f"{len(context_lens)} rows do not take the streamed step under this plan")
    steps = 6
    k_cache, v_cache, slices, ids, positions = decode_case(dtype, context_lens, num_blocks=64, ahead=steps)
    tables = [seq.block_table for seq in slices]
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    expected, next_ids = [], ids
    with torch.inference_mode():
        for step in range(steps):
            step_slices = [SequenceSlice(1, length + step, table) for length, table in zip(context_lens, tables)]
            _, next_ids = fused(next_ids, positions + step, PagedAttention(k_ref, v_ref, step_slices),
                                torch.arange(len(ids)))
            expected.append(next_ids)
        rows = len(ids)
        got = fused.ahead(ids, DecodeSteps.of(k_cache, v_cache, tables, positions.tolist(), steps), torch.zeros(rows),
                          torch.zeros(steps, rows, dtype=torch.float64))
    assert torch.equal(got, torch.stack(expected))
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_steps_ahead_draw_as_the_sampler_does(dtype):
    """Rows with a temperature draw their token in the run from softmax(logits / T) with the uniform given, as
    `serve.sampling.draw` draws it from the single step's logits; greedy rows beside them take the largest."""
    fused = FusedDecode(serving_model(dtype))
    steps, context_lens = 5, [9, 30, 17]
    k_cache, v_cache, slices, ids, positions = decode_case(dtype, context_lens, num_blocks=64, ahead=steps)
    tables = [seq.block_table for seq in slices]
    temperature = torch.tensor([0.7, 0.0, 1.5])
    uniform = torch.rand(steps, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    expected, next_ids = [], ids
    with torch.inference_mode():
        for step in range(steps):
            step_slices = [SequenceSlice(1, length + step, table) for length, table in zip(context_lens, tables)]
            logits, argmax = fused(next_ids, positions + step, PagedAttention(k_ref, v_ref, step_slices), torch.arange(3))
            positive = torch.where(temperature > 0, temperature, 1.0)  # (row 1's draw unused)
            drawn = cpu_kernels.load().softmax_draw(logits, positive, uniform[step])
            next_ids = torch.where(temperature > 0, drawn, argmax)
            expected.append(next_ids)
        got = fused.ahead(ids, DecodeSteps.of(k_cache, v_cache, tables, positions.tolist(), steps), temperature, uniform)
    assert torch.equal(got, torch.stack(expected))
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_steps_ahead_refuse_tables_without_room_and_picked_rows():
    fused = FusedDecode(serving_model(torch.float32))
    k_cache, v_cache, slices, ids, positions = decode_case(torch.float32, [20, 3])
    tables = [seq.block_table for seq in slices]
    with pytest.raises(ValueError, match=r"a block table of 2 blocks cannot hold positions 19..32 \(block size 16\)"):
        DecodeSteps.of(k_cache, v_cache, tables, positions.tolist(), 14)
    steps = DecodeSteps.of(k_cache, v_cache, tables, positions.tolist(), 2)
    greedy, uniform = torch.zeros(2), torch.zeros(2, 2, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"logit_rows: every row \(0..1\) in a run of 2 steps"):
        fused.streamed(ids, steps.positions, k_cache, v_cache, steps.slot_mapping, steps.tables, steps.lengths,
                       torch.tensor([0]), greedy[:1], uniform[:, :1])
    with pytest.raises(RuntimeError, match=r"lengths: as many steps as positions"):
        fused.streamed(ids, steps.positions, k_cache, v_cache, steps.slot_mapping, steps.tables, steps.lengths[:1],
                       torch.arange(2), greedy, uniform)
    with pytest.raises(RuntimeError, match=r"uniform\[1\]\[0\] = 1: must be in \[0, 1\)"):
        fused.streamed(ids, steps.positions, k_cache, v_cache, steps.slot_mapping, steps.tables, steps.lengths,
                       torch.arange(2), greedy, torch.tensor([[0.5, 0.5], [1.0, 0.0]], dtype=torch.float64))


def test_fused_decode_refuses_prefill_steps_and_bad_slots():
    model = serving_model(torch.float32)
    k_cache, v_cache, slices, ids, positions = decode_case(torch.float32, [20, 3])
    with pytest.raises(ValueError, match="decodes only"):
        FusedDecode(model)(ids, positions, PagedAttention(k_cache, v_cache, [SequenceSlice(2, 20, slices[0].block_table)]),
                           torch.tensor([1]))
    attention = PagedAttention(k_cache, v_cache, slices)
    attention.slot_mapping = torch.tensor([0, 32 * 16])
    with pytest.raises(RuntimeError, match=r"slots\[1\] = 512: not a slot of the cache"):
        FusedDecode(model)(ids, positions, attention, torch.arange(2))


def test_fused_decode_applies_only_to_a_serving_copy_with_the_kernels():
    model = Llama(CONFIG).initialize(0.1, torch.Generator().manual_seed(0)).eval()
    assert not FusedDecode.applies_to(model)
    odd_heads = LlamaConfig(vocab=96, hidden=64, layers=1, heads=4, kv_heads=2, head_dim=48, ffn_hidden=128, max_seq=64)
    assert not FusedDecode.applies_to(packed_for_inference(Llama(odd_heads).eval()))  # no paged kernel for head_dim 48


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_outputs_are_the_same_with_and_without_the_fused_decode(dtype):
    model = Llama(CONFIG).initialize(0.1, torch.Generator().manual_seed(0)).to(dtype).eval()
    prompts = [[(7 * i + j) % CONFIG.vocab for j in range(5 + 9 * i)] for i in range(6)]
    outputs = []
    for fused in (False, True):
        engine = Engine(model, config=EngineConfig(kv_cache_bytes=4_000_000, fused_decode=fused))
        assert (engine.fused_decode is not None) == fused
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=12 + i, temperature=0, ignore_eos=True))
        finished = []
        while engine.has_work():
            finished += engine.step()[1]
        engine.check()
        outputs.append({output.request_id: output.output_ids for output in finished})
    assert outputs[0] == outputs[1]


def test_a_model_with_llama3_rope_scaling_serves_its_training_paths_tokens():
    """Scaled rotary frequencies (Llama 3.x's rule) reach every serving path: prefill chunks and the fused decode
    step's rope tables."""
    from tests.serve.tiny import greedy_reference

    config = dataclasses.replace(CONFIG, rope_scaling=RopeScaling("llama3", 8.0, original_max_seq=64))
    model = Llama(config).initialize(0.1, torch.Generator().manual_seed(3)).eval()
    prompts = [[(7 * i + 5 * j) % CONFIG.vocab for j in range(5 + 9 * i)] for i in range(3)]
    llm = LLM(model, config=EngineConfig(kv_cache_bytes=4_000_000, max_batched_tokens=16))
    assert llm.engine.fused_decode is not None
    outputs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    assert [o.output_ids for o in outputs] == [greedy_reference(model, p, 32) for p in prompts]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("draft_at", [[0], [1, 2]])
def test_a_speculative_drafts_rows_read_each_others_keys_and_values(dtype, draft_at, plan):
    """A draft verified as one-token rows of one sequence (`PagedAttention.rows_extend_sequences`): each row reads
    the K/V the rows before it write in the same step. The fused step writes them all before any attention reads
    (one more barrier a layer): equal to the Python layers bit for bit, and to one prefill chunk of the same
    positions within rounding; other sequences' rows beside them unchanged."""
    context_lens = [5, 16, 17, 40]
    model = serving_model(dtype)
    fused = FusedDecode(model)
    k_cache, v_cache, slices, ids, positions = decode_case(dtype, context_lens, num_blocks=64, ahead=4)
    rows_slices, rows_ids, rows_positions, chunks = [], [], [], []
    for index, seq in enumerate(slices):
        extra = 4 if index in draft_at else 0  # the sequence's last token and a draft of 4: 5 rows
        new = torch.randint(CONFIG.vocab, (extra,), generator=torch.Generator().manual_seed(index)).tolist()
        rows_slices += [SequenceSlice(1, seq.context_len + j, seq.block_table) for j in range(extra + 1)]
        rows_ids += [int(ids[index])] + new
        rows_positions += range(seq.context_len - 1, seq.context_len + extra)
        chunks.append(SequenceSlice(extra + 1, seq.context_len + extra, seq.block_table))
    rows_ids, rows_positions = torch.tensor(rows_ids), torch.tensor(rows_positions)
    rows = torch.arange(len(rows_ids))
    with torch.inference_mode():
        caches = [(k_cache.clone(), v_cache.clone()) for _ in range(3)]
        expected = model.forward_packed(rows_ids, rows_positions, PagedAttention(*caches[0], rows_slices, True), rows)
        chunked = model.forward_packed(rows_ids, rows_positions, PagedAttention(*caches[1], chunks), rows)
        got, _ = fused(rows_ids, rows_positions, PagedAttention(*caches[2], rows_slices, True), rows)
    assert torch.equal(got, expected)
    assert torch.equal(caches[2][0], caches[0][0]) and torch.equal(caches[2][1], caches[0][1])
    tolerance = 1e-4 if dtype == torch.float32 else 0.1
    assert torch.allclose(got.float(), chunked.float(), atol=tolerance, rtol=0)
