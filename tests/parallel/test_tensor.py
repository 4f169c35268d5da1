"""Tensor parallelism (TP = 2, 4; with and without sequence parallelism) equals the single-process
model: logits, loss and every gradient shard, and the wire carries 4 collectives of s·b·h per layer."""

import copy
import dataclasses

import pytest
import torch

from mlsyslab.comm.launch import spawn
from mlsyslab.comm.log import CommLog
from mlsyslab.nn.llama import Llama, LlamaConfig
from mlsyslab.nn.moe import AUX_LOSS_WEIGHT, load_balancing_loss
from mlsyslab.parallel.tensor import TensorGroup, parallelize_llama, vocab_parallel_cross_entropy

CONFIG = LlamaConfig(vocab=64, hidden=32, layers=2, heads=8, kv_heads=4, head_dim=4, ffn_hidden=48, tied_embeddings=True,
                     max_seq=64)


def _compare(rank, sequence_parallel, config=CONFIG):
    torch.manual_seed(0)
    reference = Llama(config).initialize(generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # norms not all ones, so that a gradient summed wrongly over the ranks shows in the update
        for name, parameter in reference.named_parameters():
            if name.endswith("norm.weight"):
                parameter.normal_(1, 0.3, generator=torch.Generator().manual_seed(len(name)))
    ids = torch.randint(0, config.vocab, (2, 9), generator=torch.Generator().manual_seed(2))
    inputs, targets = ids[:, :-1], ids[:, 1:]
    logits = reference(inputs)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, config.vocab), targets.reshape(-1))
    loss.backward()

    log = CommLog()
    tp = TensorGroup(rank, log)
    model = parallelize_llama(copy.deepcopy(reference), tp, sequence_parallel)
    model.zero_grad(set_to_none=True)
    log.reset()
    local_logits = model(inputs)
    ours = vocab_parallel_cross_entropy(local_logits, targets, tp)
    forward_log = log.as_dict()
    ours.backward()
    t, r = tp.size, tp.index
    errors = {"logits": (local_logits - logits.chunk(t, dim=-1)[r]).abs().max().item(), "loss": abs(ours.item() - loss.item())}
    for index, (ours_layer, ref_layer) in enumerate(zip(model.layers, reference.layers)):
        pairs = {
            "q": (ours_layer.self_attn.fused_qkv.q.weight, ref_layer.self_attn.q_proj.weight, 0),
            "k": (ours_layer.self_attn.fused_qkv.k.weight, ref_layer.self_attn.k_proj.weight, 0),
            "v": (ours_layer.self_attn.fused_qkv.v.weight, ref_layer.self_attn.v_proj.weight, 0),
            "o": (ours_layer.self_attn.o_proj.weight, ref_layer.self_attn.o_proj.weight, 1),
            "gate": (ours_layer.mlp.fused_gate_up.gate.weight, ref_layer.mlp.gate_proj.weight, 0),
            "up": (ours_layer.mlp.fused_gate_up.up.weight, ref_layer.mlp.up_proj.weight, 0),
            "down": (ours_layer.mlp.down_proj.weight, ref_layer.mlp.down_proj.weight, 1),
            "norm": (ours_layer.input_layernorm.weight, ref_layer.input_layernorm.weight, None),
        }
        if config.qkv_bias:  # Qwen2's: split with the outputs
            pairs.update({f"{name}_bias": (getattr(ours_layer.self_attn.fused_qkv, name).bias,
                                           getattr(ref_layer.self_attn, f"{name}_proj").bias, 0) for name in "qkv"})
        if config.qk_norm:  # Qwen3's: whole on every rank, the gradient summed over the ranks' heads
            pairs.update({name: (getattr(ours_layer.self_attn, name).weight, getattr(ref_layer.self_attn, name).weight,
                                 None) for name in ("q_norm", "k_norm")})
        for name, (mine, full, dim) in pairs.items():
            expected = full.grad if dim is None else full.grad.chunk(t, dim=dim)[r]
            errors[f"layer{index}.{name}"] = (mine.grad - expected).abs().max().item()
    errors["embedding"] = (model.embed_tokens.weight.grad - reference.embed_tokens.weight.grad.chunk(t, 0)[r]).abs().max().item()
    return errors, forward_log


@pytest.mark.parametrize("world, sequence_parallel", [(2, False), (2, True), (4, False), (4, True)])
def test_tensor_parallel_equals_single_process(world, sequence_parallel):
    results = spawn(_compare, world, sequence_parallel)
    for errors, _ in results:
        assert max(errors.values()) < 1e-5, errors
    # Forward wire: per layer 2 all-reduces (or all-gather + reduce-scatter pairs) of s·b·h, plus the
    # embedding's and the head's; and the loss's three small all-reduces.
    tokens, hidden, layers = 2 * 8, CONFIG.hidden, CONFIG.layers
    message = tokens * hidden * 4
    _, log = results[0]
    if sequence_parallel:
        # all-gathers: 2 per layer + the head's; reduce-scatters: 2 per layer + the embedding's.
        assert log["all_gather"]["calls"] == 2 * layers + 1 and log["reduce_scatter"]["calls"] == 2 * layers + 1
        assert log["reduce_scatter"]["bytes_sent"] == pytest.approx((2 * layers + 1) * (world - 1) / world * message)
    else:
        assert log["all_reduce"]["calls"] == 2 * layers + 1 + 3  # + embedding, + loss: max, sum, target



def _loss_twice(rank):
    logits = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    targets = torch.randint(0, 64, (3, 5), generator=torch.Generator().manual_seed(4))
    full = logits.clone().requires_grad_(True)
    reference = torch.nn.functional.cross_entropy(full.reshape(-1, 64), targets.reshape(-1))
    reference.backward()
    tp = TensorGroup(rank)
    local = logits.chunk(tp.size, dim=-1)[tp.index].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(local, targets, tp)
    loss.backward(retain_graph=True)
    first = local.grad.clone()
    local.grad = None
    loss.backward()
    expected = full.grad.chunk(tp.size, dim=-1)[tp.index]
    return abs(loss.item() - reference.item()), (first - expected).abs().max().item(), (local.grad - first).abs().max().item()


def test_vocab_parallel_loss_equals_cross_entropy_and_backs_up_twice():
    """The loss over vocabulary slices equals F.cross_entropy over the whole logits, its gradient the slice of
    theirs; a second backward through the same graph (retain_graph) gives the same gradient: backward leaves
    the saved softmax as it found it."""
    for loss_error, gradient_error, second_backward in spawn(_loss_twice, 2):
        assert loss_error < 1e-12 and gradient_error < 1e-12 and second_backward == 0.0

@pytest.mark.parametrize("family", [{"qkv_bias": True}, {"qk_norm": True}])
@pytest.mark.parametrize("world, sequence_parallel", [(2, False), (2, True), (4, True)])
def test_tensor_parallel_qwen_equals_single_process(family, world, sequence_parallel):
    """Qwen2's biases on Q, K and V, split with their heads (under SP through the gathered entry's backward), and
    Qwen3's query and key head norms, whose gradients each rank holds for its heads only (summed over TP): logits,
    loss and every gradient equal to one process's."""
    for errors, _ in spawn(_compare, world, sequence_parallel, dataclasses.replace(CONFIG, **family)):
        assert max(errors.values()) < 1e-5, errors


# capacity 1.25: some slots are dropped, and the same ones on every rank (they route the same tokens)
MOE = LlamaConfig(vocab=64, hidden=32, layers=2, heads=8, kv_heads=4, head_dim=4, ffn_hidden=48, tied_embeddings=True,
                  max_seq=64, experts=4, experts_per_token=2, dense_layers=1)


def _compare_moe(rank, sequence_parallel):
    """An MoE model under TP: logits, loss (with the balancing loss) and the gradients of the router,
    the expert slices and the rest, against one process."""
    reference = Llama(MOE).initialize(generator=torch.Generator().manual_seed(1)).double()
    model = copy.deepcopy(reference)  # before a forward leaves its routing on the reference
    ids = torch.randint(0, MOE.vocab, (2, 9), generator=torch.Generator().manual_seed(2))
    inputs, targets = ids[:, :-1], ids[:, 1:]
    logits = reference(inputs)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, MOE.vocab), targets.reshape(-1)) \
        + AUX_LOSS_WEIGHT * load_balancing_loss(reference)
    loss.backward()

    log = CommLog()
    tp = TensorGroup(rank, log)
    model = parallelize_llama(model, tp, sequence_parallel)
    local_logits = model(inputs)
    ours = vocab_parallel_cross_entropy(local_logits, targets, tp) + AUX_LOSS_WEIGHT * load_balancing_loss(model)
    ours.backward()
    t, r = tp.size, tp.index
    moe, reference_moe = model.layers[1].mlp.layer, reference.layers[1].mlp
    errors = {"logits": (local_logits - logits.chunk(t, dim=-1)[r]).abs().max().item(),
              "loss": abs(ours.item() - loss.item()),
              "router": (moe.router.weight.grad - reference_moe.router.weight.grad).abs().max().item(),
              "embedding": (model.embed_tokens.weight.grad - reference.embed_tokens.weight.grad.chunk(t, 0)[r]).abs().max().item(),
              "layer1.norm": (model.layers[1].post_attention_layernorm.weight.grad
                              - reference.layers[1].post_attention_layernorm.weight.grad).abs().max().item(),
              "layer1.q": (model.layers[1].self_attn.fused_qkv.q.weight.grad
                           - reference.layers[1].self_attn.q_proj.weight.grad.chunk(t, 0)[r]).abs().max().item()}
    for e, (expert, full) in enumerate(zip(moe.experts, reference_moe.experts)):
        for name, dim in (("gate_proj", 0), ("up_proj", 0), ("down_proj", 1)):
            errors[f"expert{e}.{name}"] = (getattr(expert, name).weight.grad
                                           - getattr(full, name).weight.grad.chunk(t, dim=dim)[r]).abs().max().item()
    assert reference_moe.last_routing.dropped > 0
    return errors, log.as_dict(), moe.last_routing.expert.numel()


@pytest.mark.parametrize("world, sequence_parallel", [(2, False), (2, True), (4, False)])
def test_tensor_parallel_moe_equals_single_process(world, sequence_parallel):
    results = spawn(_compare_moe, world, sequence_parallel)
    for errors, log, kept in results:
        assert max(errors.values()) < 1e-9, errors  # float64
        # the MoE layer's f and g are the dense MLP's; its kept slots' weights (fp32, whatever the model's
        # dtype) add one small all-reduce backward
        assert log["all_reduce_routing"] == {"calls": 1, "bytes_sent": int(2 * (world - 1) / world * kept * 4)}
        if not sequence_parallel:  # f and g of every layer, forward and backward, dense or MoE: as test above
            assert log["all_reduce"]["calls"] == 4 * MOE.layers + 1 + 3 + 1
