"""The training model's one-pass forwards and backwards (nn.training_kernels: csrc/layer_ops.cpp and layer_grads.cpp,
or torch's ops and the same formulas in PyTorch ops where the kernels do not apply): a forward with gradients gives
the bits of one without, the kernels' within a rounding of the plain ops (torch's ops: their bits), the gradients are
as close to exact as autograd's, and what the functions do not take keeps the plain ops."""

import pytest
import torch
import torch.nn.functional as F

from mlsyslab.nn import cpu_kernels, training_kernels
from mlsyslab.nn.llama import Llama, LlamaConfig
from mlsyslab.nn.rope import apply_rope, base_frequencies, rope_cos_sin

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="the C++ kernels did not build here")

# Largest gradient error against fp64 allowed, as a multiple of autograd's own (plus an ulp's slack at fp32).
SLACK = 2.0


@pytest.fixture(params=["kernels", "torch ops"])
def backward(request, monkeypatch):
    """Each test twice: the C++ backward, and the PyTorch formulas the functions use where it does not apply."""
    if request.param == "torch ops":
        monkeypatch.setattr(training_kernels, "on_kernels", lambda x: False)
    return request.param


def leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def gradients(fn, inputs, grad):
    out = fn(*inputs)
    out.backward(grad)
    return out.detach(), [t.grad for t in inputs]


def compare(ours_fn, plain_fn, tensors, grad, backward):
    """Ours and the plain ops' outputs and gradients, and each one's gradient errors against the plain ops in fp64."""
    ours_out, ours = gradients(ours_fn, leaves(*tensors), grad)
    plain_out, plain = gradients(plain_fn, leaves(*tensors), grad)
    _, exact = gradients(plain_fn, leaves(*(t.double() for t in tensors)), grad.double())
    with torch.no_grad():
        assert torch.equal(ours_fn(*tensors), ours_out), "a forward with gradients must give the bits of one without"
    if backward == "torch ops":
        assert torch.equal(ours_out, plain_out), "torch's ops must give the plain ops' bits"
    else:
        torch.testing.assert_close(ours_out, plain_out)  # within a rounding of the dtype
    for mine, theirs, truth in zip(ours, plain, exact):
        assert mine.dtype == theirs.dtype and mine.shape == theirs.shape
        scale = truth.abs().max().item()
        ours_error = (mine.double() - truth).abs().max().item()
        plain_error = (theirs.double() - truth).abs().max().item()
        assert ours_error <= SLACK * plain_error + 1e-6 * scale, (ours_error, plain_error)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 200, 576])  # whole vectors, a tail, SmolLM2's width
def test_rms_norm_backward(dtype, hidden, backward):
    generator = torch.Generator().manual_seed(hidden)
    x = (torch.randn(3, 37, hidden, generator=generator) * 2).to(dtype)
    weight = (1 + 0.2 * torch.randn(hidden, generator=generator)).to(dtype)
    grad = torch.randn(3, 37, hidden, generator=generator).to(dtype)
    compare(lambda x, w: training_kernels.rms_norm(x, w, 1e-5),
            lambda x, w: F.rms_norm(x, (hidden,), w, 1e-5), (x, weight), grad, backward)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [48, 77, 1536])
def test_silu_and_mul_backward(dtype, width, backward):
    generator = torch.Generator().manual_seed(width)
    gate = (torch.randn(5, width, generator=generator) * 4).to(dtype)
    gate[0, :3] = torch.tensor([-100.0, 60.0, 0.0])  # past vec.h's exp range, saturated, zero
    up = torch.randn(5, width, generator=generator).to(dtype)
    grad = torch.randn(5, width, generator=generator).to(dtype)
    compare(training_kernels.silu_and_mul, lambda g, u: F.silu(g) * u, (gate, up), grad, backward)
    if dtype == torch.bfloat16:  # the kernel rounds where torch does
        assert torch.equal(training_kernels.silu_and_mul(gate, up), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 64, 80])
def test_rope_backward(dtype, head_dim, backward):
    generator = torch.Generator().manual_seed(head_dim)
    q = torch.randn(2, 9, 3, head_dim, generator=generator).to(dtype)
    grad = torch.randn(2, 9, 3, head_dim, generator=generator).to(dtype)
    cos, sin = rope_cos_sin(base_frequencies(head_dim, 10000.0), torch.arange(9).expand(2, 9), dtype)
    compare(lambda x: training_kernels.rope(x, cos, sin), lambda x: apply_rope(x, cos, sin), (q,), grad, backward)
    one_row = tuple(table[:1] for table in (cos, sin))  # tables broadcast over the batch
    compare(lambda x: training_kernels.rope(x, *one_row), lambda x: apply_rope(x, *one_row), (q,), grad, backward)
    if dtype == torch.bfloat16:  # the kernel rounds where torch does
        assert torch.equal(training_kernels.rope(q, cos, sin), apply_rope(q, cos, sin))


def test_the_weight_gradient_does_not_depend_on_the_thread_count():
    generator = torch.Generator().manual_seed(0)
    x, grad = torch.randn(2, 300, 512, generator=generator), torch.randn(2, 300, 512, generator=generator)
    weight = torch.randn(512, generator=generator)
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            results.append(gradients(lambda x, w: training_kernels.rms_norm(x, w, 1e-6), leaves(x, weight), grad)[1])
    finally:
        torch.set_num_threads(threads)
    for dx, dw in results[1:]:
        assert torch.equal(dx, results[0][0]) and torch.equal(dw, results[0][1])


def test_what_the_functions_do_not_take_keeps_the_plain_ops():
    x, weight = torch.randn(4, 8, requires_grad=True), torch.ones(8, requires_grad=True)
    assert training_kernels.applies(x, weight) and training_kernels.applies(x.double(), weight.double())
    with torch.no_grad():
        assert not training_kernels.applies(x, weight)
    assert not training_kernels.applies(x.detach(), weight.detach())  # nothing wants a gradient
    assert not training_kernels.applies(x, weight.bfloat16())  # mixed dtypes
    assert training_kernels.rms_norm(x, weight, 1e-5).grad_fn.name() == "RMSNormFunctionBackward"
    assert training_kernels.rms_norm(x.double(), weight.double(), 1e-5).grad_fn.name() == "RMSNormFunctionBackward"
    assert training_kernels.on_kernels(x) and not training_kernels.on_kernels(x.double())


def test_the_ops_refuse_mismatched_input():
    x, weight = torch.randn(4, 8), torch.ones(8)
    rstd = torch.ones(4)
    kernels = cpu_kernels.load()
    with pytest.raises(RuntimeError, match="grad"):
        kernels.rms_norm_backward(torch.randn(4, 9), x, rstd, weight)
    with pytest.raises(RuntimeError, match="weight"):
        kernels.rms_norm_backward(x, x, rstd, torch.ones(9))
    with pytest.raises(RuntimeError, match="rstd"):
        kernels.rms_norm_backward(x, x, torch.ones(5), weight)
    with pytest.raises(RuntimeError, match="up"):
        kernels.silu_and_mul_backward(x, x, x.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_training_step_matches_the_plain_ops(dtype, monkeypatch):
    """A Llama step's loss and every parameter's gradient within a few roundings of the plain ops' (a Qwen3 shape:
    the head norms take the kernels too)."""
    config = LlamaConfig(vocab=97, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn_hidden=80,
                         qk_norm=True, max_seq=32)
    model = Llama(config).initialize(generator=torch.Generator().manual_seed(0)).to(dtype)
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))

    def step():
        model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}

    loss, grads = step()
    monkeypatch.setattr(training_kernels, "plain", lambda *tensors: False)
    monkeypatch.setattr(training_kernels, "applies", lambda *tensors: False)
    plain_loss, plain_grads = step()
    torch.testing.assert_close(loss, plain_loss, rtol=1e-6 if dtype == torch.float32 else 1e-2, atol=0)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    for name, grad in grads.items():
        scale = plain_grads[name].abs().max().item()
        assert (grad.float() - plain_grads[name].float()).abs().max().item() <= tolerance * scale + 1e-12, name


def test_inputs_laid_out_sequence_major_take_the_functions_too():
    """Under sequence parallelism a norm's input arrives [b, s, h] with s outermost in memory: the functions take a
    contiguous copy of it (what they keep for backward), with the plain ops' values and gradients."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(16, 2, 32, generator=generator).transpose(0, 1)
    weight, grad = torch.randn(32, generator=generator), torch.randn(2, 16, 32, generator=generator)
    assert not x.is_contiguous()
    compare(lambda x, w: training_kernels.rms_norm(x, w, 1e-5), lambda x, w: F.rms_norm(x, (32,), w, 1e-5),
            (x, weight), grad, "kernels")
    compare(training_kernels.silu_and_mul, lambda g, u: F.silu(g) * u, (x, x.flip(0)), grad, "kernels")


def sdpa(q, k, v):
    """torch's causal attention of [B, T, heads, d] tensors (grouped-query)."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                          enable_gqa=True).transpose(1, 2)


@pytest.fixture
def one_thread():
    """One thread, so that every (sequence, KV head) count takes the kernel (`causal_attention` wants one a thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 37, 4, 2, 16), (1, 130, 6, 2, 80), (2, 64, 2, 2, 64), (1, 1, 4, 1, 32),
                                   (2, 100, 4, 2, 64), (1, 45, 2, 1, 128), (1, 1100, 2, 1, 32)])
def test_causal_attention(dtype, shape, one_thread):
    """Forward and gradients against fp64 within 4x torch's SDPA's own error (a block boundary, tails of a block and
    of a vector, grouped and plain heads, one token), the same bits with gradients and without."""
    batch, tokens, heads, kv_heads, dim = shape
    generator = torch.Generator().manual_seed(tokens)
    q, k, v = (torch.randn(batch, tokens, n, dim, generator=generator).to(dtype) for n in (heads, kv_heads, kv_heads))
    grad = torch.randn(batch, tokens, heads, dim, generator=generator).to(dtype)
    ours_out, ours = gradients(training_kernels.causal_attention, leaves(q, k, v), grad)
    assert ours_out.shape == (batch, tokens, heads, dim) and ours_out.dtype == dtype
    theirs_out, theirs = gradients(sdpa, leaves(q, k, v), grad)
    exact_out, exact = gradients(sdpa, leaves(q.double(), k.double(), v.double()), grad.double())
    for mine, torch_own, truth in zip([ours_out, *ours], [theirs_out, *theirs], [exact_out, *exact]):
        ours_error = (mine.double() - truth).abs().max().item()
        torch_error = (torch_own.double() - truth).abs().max().item()
        assert ours_error <= 4 * torch_error + 1e-6 * truth.abs().max().item(), (ours_error, torch_error)
    with torch.no_grad():
        assert torch.equal(training_kernels.causal_attention(q, k, v), ours_out)
    assert training_kernels.causal_attention(*leaves(q, k, v)).grad_fn.name() == "CausalAttentionFunctionBackward"


@pytest.mark.skipif(not cpu_kernels.serves_prompt_attention(torch.zeros(1, 1, 32, dtype=torch.bfloat16)),
                    reason="no AMX tiles here")
@pytest.mark.parametrize("shape", [(2, 100, 4, 2, 64), (1, 45, 2, 1, 128), (1, 77, 6, 3, 32), (3, 16, 2, 2, 96)])
def test_the_backward_on_tiles_is_as_exact_as_the_vector_one(shape, one_thread):
    """bf16 on AMX tiles (P and dS rounded to bf16 for their products, as torch's flash attention rounds P) against
    fp64: within 4x torch's own error, as the FMA loops' backward (tiles=False) — query blocks and key tiles cut short,
    grouped heads, head_dim 32 to 128."""
    batch, tokens, heads, kv_heads, dim = shape
    generator = torch.Generator().manual_seed(tokens)
    q, k, v = (torch.randn(batch, tokens, n, dim, generator=generator).bfloat16() for n in (heads, kv_heads, kv_heads))
    grad = torch.randn(batch, tokens, heads, dim, generator=generator).bfloat16()
    out, lse = training_kernels.attention_forward(q, k, v, with_lse=True)
    _, theirs = gradients(sdpa, leaves(q, k, v), grad)
    _, exact = gradients(sdpa, leaves(q.double(), k.double(), v.double()), grad.double())
    for tiles in (True, False):
        ours = cpu_kernels.load().causal_attention_backward(grad, q, k, v, out, lse, tiles=tiles)
        for mine, torch_own, truth in zip(ours, theirs, exact):
            assert mine.dtype == torch.bfloat16 and mine.shape == truth.shape
            ours_error = (mine.double() - truth).abs().max().item()
            torch_error = (torch_own.double() - truth).abs().max().item()
            assert ours_error <= 4 * torch_error + 1e-6 * truth.abs().max().item(), (tiles, ours_error, torch_error)
    with pytest.raises(RuntimeError, match="tiles take bf16"):
        cpu_kernels.load().causal_attention_backward(grad.float(), q.float(), k.float(), v.float(), out.float(), lse,
                                                     tiles=True)


def test_causal_attention_takes_strided_heads_and_leaves_the_rest_to_torch(one_thread):
    """q, k, v as views of one fused projection (token rows wider than the heads) take the kernel; head_dim 8 and
    fp64 keep torch's attention."""
    generator = torch.Generator().manual_seed(0)
    fused = torch.randn(2, 40, 8 * 32, generator=generator)
    q, k, v = fused[..., :128].view(2, 40, 4, 32), fused[..., 128:192].view(2, 40, 2, 32), fused[..., 192:].view(
        2, 40, 2, 32)
    assert not q.is_contiguous()
    torch.testing.assert_close(training_kernels.causal_attention(q, k, v), sdpa(q, k, v))
    small = torch.randn(1, 5, 2, 8, generator=generator, requires_grad=True)
    assert training_kernels.causal_attention(small, small, small).grad_fn.name() != "CausalAttentionFunctionBackward"
    wide = small.detach().double().requires_grad_()
    assert training_kernels.causal_attention(wide, wide, wide).grad_fn.name() != "CausalAttentionFunctionBackward"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_attention_does_not_depend_on_the_thread_count(dtype):
    """Each (sequence, KV head) is one thread's from start to end: 1 and 2 threads give the same bits, forward and
    backward."""
    generator = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 70, n, 64, generator=generator).to(dtype) for n in (4, 2, 2))
    grad = torch.randn(2, 70, 4, 64, generator=generator).to(dtype)
    threads, results = torch.get_num_threads(), []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            out, grads = gradients(training_kernels.causal_attention, leaves(q, k, v), grad)
            results.append([out, *grads])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_causal_attention_leaves_fewer_units_than_threads_to_torch():
    """One (sequence, KV head) is the kernel's unit of work: with fewer of them than threads, torch's attention runs."""
    q = torch.randn(1, 20, 4, 16, requires_grad=True)
    k = torch.randn(1, 20, 2, 16, requires_grad=True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert training_kernels.causal_attention(q, k, k).grad_fn.name() == "CausalAttentionFunctionBackward"
        torch.set_num_threads(3)
        assert training_kernels.causal_attention(q, k, k).grad_fn.name() != "CausalAttentionFunctionBackward"
    finally:
        torch.set_num_threads(threads)


def test_causal_attention_refuses_mismatched_input():
    kernels = cpu_kernels.load()
    q, k = torch.randn(1, 4, 4, 16), torch.randn(1, 4, 3, 16)
    with pytest.raises(RuntimeError, match="kv_heads dividing heads"):
        kernels.causal_attention_forward(q, k, k)
    with pytest.raises(RuntimeError, match="head_dim: a multiple"):
        kernels.causal_attention_forward(*(torch.randn(1, 4, 2, 12) for _ in range(3)))
    with pytest.raises(RuntimeError, match="v: "):
        kernels.causal_attention_forward(q, q[:, :, :2], q[:, :, :2].double())
