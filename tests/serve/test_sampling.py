"""Sampling options: filters, penalties, seeds at any batch composition, logprobs, validation."""

import math

import pytest
import torch

from mlsyslab.errors import InvalidValue
from mlsyslab.nn import cpu_kernels
from mlsyslab.serve import sampling
from mlsyslab.serve.config import EngineConfig
from mlsyslab.serve.engine import LLM
from mlsyslab.serve.sampling import SamplerInput, sample
from mlsyslab.serve.sampling_params import SamplingParams
from tests.serve.tiny import block_bytes, tiny_model


def rows(logits, count, **options):
    params = SamplingParams(**options)
    return [SamplerInput(params, [], [], torch.Generator().manual_seed(i)) for i in range(count)]


def frequencies(logits, draws=4000, **options):
    tokens = [s.token for s in sample(logits.expand(draws, -1), rows(logits, draws, **options))]
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[-1]).double() / draws


@pytest.fixture(params=["kernel", "pytorch"])
def unfiltered_path(request, monkeypatch):
    """The unfiltered draw through nn/csrc's softmax_draw (where the C++ kernels build) or through PyTorch."""
    if request.param == "kernel" and cpu_kernels.load() is None:
        pytest.skip("C++ kernels not built here")
    if request.param == "pytorch":
        monkeypatch.setattr(sampling.cpu_kernels, "serves", lambda tensor: False)


def test_unfiltered_sampling_follows_the_softmax(unfiltered_path):
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]])
    expected = torch.softmax(logits[0].double() / 0.7, -1)
    observed = frequencies(logits, temperature=0.7)
    assert (observed - expected).abs().max() < 0.03  # ~4 standard errors at 4000 draws


def test_unfiltered_sampling_never_draws_an_impossible_token(unfiltered_path):
    logits = torch.tensor([[1.0, 2.0, float("-inf"), 0.5, float("-inf")]])
    assert set(frequencies(logits, temperature=1.0).nonzero().flatten().tolist()) == {0, 1, 3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_draws_the_token_whose_interval_of_the_softmax_cdf_holds_the_uniform(dtype):
    """softmax_draw (nn/csrc), 48 rows of a 49k vocabulary at temperatures 0.5, 1 and 2, a fifth of the
    tokens ruled out (-inf): a uniform in the middle of a token's interval of the float64 CDF (tokens of
    probability >= 1e-4, far from rounding) draws that token; a uniform of 0, the first possible token."""
    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("C++ kernels not built here")
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(48, 49152, generator=generator) * 3).to(dtype)
    logits[:, ::5] = float("-inf")
    temperature = torch.tensor([0.5, 1.0, 2.0]).repeat(16)
    probs = torch.softmax(logits.double() / temperature[:, None].double(), dim=-1)
    wanted = torch.multinomial((probs >= 1e-4).double(), 1, generator=generator)[:, 0]
    before = probs.cumsum(-1).gather(-1, wanted[:, None])[:, 0] - probs.gather(-1, wanted[:, None])[:, 0]
    uniform = before + probs.gather(-1, wanted[:, None])[:, 0] / 2
    assert torch.equal(kernels.softmax_draw(logits, temperature, uniform), wanted)
    assert (kernels.softmax_draw(logits, temperature, torch.zeros(48, dtype=torch.float64)) == 1).all()


def test_top_k_top_p_min_p_restrict_the_support():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05]]))
    assert set(frequencies(logits, top_k=2).nonzero().flatten().tolist()) == {0, 1}
    assert set(frequencies(logits, top_p=0.65).nonzero().flatten().tolist()) == {0, 1}  # 0.4 + 0.3 reaches 0.65
    assert set(frequencies(logits, min_p=0.3).nonzero().flatten().tolist()) == {0, 1, 2}  # >= 0.3 * 0.4
    kept = frequencies(logits, top_k=3)
    assert kept[0] / kept[1] == pytest.approx(4 / 3, rel=0.15)  # renormalised, proportions kept


@pytest.mark.parametrize("sharpness", [8.0, 0.1])  # kept sets inside the sorted candidates, and far beyond
def test_filters_on_the_top_candidates_draw_what_a_full_sort_draws(sharpness):
    from mlsyslab.serve.sampling import CANDIDATES, draw_filtered, inverse_cdf, kept

    vocab = 3 * CANDIDATES
    probs = torch.softmax(torch.randn(6, vocab, generator=torch.Generator().manual_seed(3)) * sharpness, dim=-1)
    params = [SamplingParams(top_p=0.9), SamplingParams(top_k=40), SamplingParams(min_p=0.01),
              SamplingParams(top_p=0.5, min_p=0.001), SamplingParams(top_k=CANDIDATES + 7), SamplingParams(top_p=0.99)]
    uniform = torch.rand(6, 1, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    position = inverse_cdf(sorted_probs * kept(sorted_probs, params, vocab), uniform)
    assert torch.equal(draw_filtered(probs, params, uniform), order.gather(-1, position[:, None])[:, 0])


def test_penalties():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.0]])
    params = SamplingParams(temperature=0, repetition_penalty=4.0, logprobs=0)
    (result,) = sample(logits, [SamplerInput(params, [0], [1], torch.Generator())])
    assert result.token == 2  # 2.0 / 4 = 0.5 < 1.0
    assert result.logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[2]))  # raw distribution
    params = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.3)
    (result,) = sample(logits, [SamplerInput(params, [], [0, 0], torch.Generator())])
    assert result.token == 2  # 2.0 - 0.5 - 2·0.3 = 0.9 < 1.0


def test_logit_bias_is_added_to_the_raw_logits_before_penalties_and_sampling():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.0]])
    params = SamplingParams(temperature=0, logit_bias={3: 2.5}, logprobs=0)
    (result,) = sample(logits, [SamplerInput(params, [], [], torch.Generator())])
    assert result.token == 3 and params.logit_bias == ((3, 2.5),)
    assert result.logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[3]))  # raw distribution
    assert frequencies(logits, 500, temperature=1.0, logit_bias={0: -100, 2: -100})[[0, 2]].sum() == 0
    # the bias comes first: 0.0 + 2.5 = 2.5 is then divided by the repetition penalty (token 3 is in the prompt)
    params = SamplingParams(temperature=0, logit_bias={3: 2.5}, repetition_penalty=2.0)
    (result,) = sample(logits, [SamplerInput(params, [3], [], torch.Generator())])
    assert result.token == 0  # 2.5 / 2 = 1.25 < 2.0


def test_min_tokens_masks_the_stop_tokens_until_reached():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.0]])
    params = SamplingParams(temperature=0, min_tokens=2, logprobs=0)
    under = SamplerInput(params, [], [3], torch.Generator(), stop_ids=frozenset({0}))
    reached = SamplerInput(params, [], [3, 3], torch.Generator(), stop_ids=frozenset({0}))
    assert [r.token for r in sample(logits.expand(2, -1), [under, reached])] == [2, 0]
    assert frequencies(logits, 300, temperature=1.0)[0] > 0
    drawn = sample(logits.expand(300, -1), [SamplerInput(SamplingParams(min_tokens=1), [], [], torch.Generator().manual_seed(i),
                                                         stop_ids=frozenset({0})) for i in range(300)])
    assert all(r.token != 0 for r in drawn)


def test_same_seed_same_tokens_at_any_batch_composition():
    model = tiny_model()
    llm = LLM(model, config=EngineConfig(kv_cache_bytes=200 * block_bytes(16)))
    prompt = [5, 6, 7, 8, 9]
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234)
    alone = llm.generate([prompt], params)[0].output_ids
    crowd = [[i, i + 1] for i in range(7)]
    mixed = llm.generate(crowd[:3] + [prompt] + crowd[3:], [SamplingParams(max_tokens=9, temperature=1.0)] * 3
                         + [params] + [SamplingParams(max_tokens=30, temperature=0.5)] * 4)
    assert mixed[3].output_ids == alone
    assert llm.generate([prompt], SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=99))[0].output_ids != alone


def test_logprobs_and_top_logprobs():
    model = tiny_model()
    llm = LLM(model, config=EngineConfig(kv_cache_bytes=50 * block_bytes(16)))
    output = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0, logprobs=5))[0]
    assert len(output.logprobs) == 3
    first = output.logprobs[0]
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([[1, 2, 3]]))[0, -1].float(), -1)
    assert first.token == output.output_ids[0] == int(expected.argmax())
    assert first.logprob == pytest.approx(float(expected.max()), abs=1e-5)
    assert [t for t, _ in first.top] == expected.topk(5).indices.tolist()
    assert all(a[1] >= b[1] for a, b in zip(first.top, first.top[1:]))


@pytest.mark.parametrize("field, value", [("temperature", -1.0), ("top_p", 0.0), ("top_k", -2), ("min_p", 1.5),
                                          ("max_tokens", 0), ("logprobs", 21), ("presence_penalty", 3.0),
                                          ("temperature", math.nan), ("stop", [""]), ("logit_bias", {5: 101}),
                                          ("logit_bias", {-1: 1.0}), ("min_tokens", 17), ("min_tokens", -1),
                                          ("seed", 2**63), ("seed", -2**63 - 1)])
def test_invalid_parameters_name_the_field(field, value):
    with pytest.raises(InvalidValue, match=field):
        SamplingParams(**{field: value})
