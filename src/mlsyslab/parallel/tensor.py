"""Tensor parallelism (Shoeybi et al. 2019, Megatron-LM) and sequence parallelism (Korthikanti et al. 2022).

Each of t ranks holds a slice of every matrix. A column-parallel linear splits the output features
(Q/K/V by heads — and KV heads under GQA — and the MLP's gate and up), a row-parallel linear the
input features (the attention output and the MLP's down projection), so a block needs
communication only at its two ends, through a pair of conjugate functions:
  f: identity forward, all-reduce of the input gradient backward;
  g: all-reduce of the partial outputs forward, identity backward.
That is 2 all-reduces of s·b·h per layer forward and 2 backward. With sequence parallelism the
activations between blocks are split along the sequence instead of replicated: f becomes an
all-gather along the sequence (reduce-scatter backward) and g a reduce-scatter (all-gather
backward) — the same bytes, but norms and residuals run on 1/t of the tokens; and a block's column-parallel
entry keeps only its shard of the gathered input for backward, gathering it again there (one more all-gather of
s·b·h per entry: `_GatheredLinears`, and for an MoE MLP's router `_RouterOnGathered`; the experts keep their
routed copies, as without SP). The embedding is split
by vocabulary rows, and the loss is computed without gathering the logits (vocab-parallel
cross-entropy: max, sum of exponentials and target logit are each one all-reduce). An MoE MLP is
split expert by expert behind the same f and g (`TensorParallelExperts`). Biases of column-parallel linears (Qwen2's
on Q, K and V) are split with their outputs; a norm whose weight every rank holds but applies to only part of the
data — under SP the rank's tokens, Qwen3's query and key head norms the rank's heads — has its gradient summed over
the group (`TensorParallelNorm`).
Twin: predict.training (4 collectives of s·b·h per layer, 6 with recompute, and SP's regathers). Held against the
single-process model in tests/parallel/test_tensor.py.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mlsyslab.comm import shared_memory
from mlsyslab.comm.launch import Rank
from mlsyslab.comm.log import CommLog, nbytes, traced
from mlsyslab.comm.torch_ops import all_gather_single, reduce_scatter_single
from mlsyslab.errors import InvalidValue
from mlsyslab.nn import training_kernels
from mlsyslab.nn.moe import MixtureOfExperts, combine, run_routed


class TensorGroup:
    """The tensor-parallel group of one rank, and the log its collectives write to."""

    def __init__(self, rank: Rank, log: CommLog | None = None, use_shared_memory: bool = True):
        """use_shared_memory: all-reduce, all-gather and reduce-scatter through `comm.shared_memory` where it applies
        (False: always the process group's, as DTensor does)."""
        self.rank, self.log, self.use_shared_memory = rank, log, use_shared_memory
        self.size, self.index, self.group = rank.world_size, rank.rank, rank.group

    def all_reduce(self, x: torch.Tensor, op: str = "all_reduce", maximum: bool = False) -> torch.Tensor:
        """Sum (or with `maximum`, the elementwise maximum) over the group, logged as `op`: through shared memory
        where every rank is a CPU process on this host (`comm.shared_memory`), else the process group's all-reduce."""
        x = x.contiguous()
        shared = self._shared_memory()
        if shared is not None:
            traced(self.log, op, nbytes(x), self.size, shared.all_reduce, x, maximum)
        else:
            reduction = dist.ReduceOp.MAX if maximum else dist.ReduceOp.SUM
            traced(self.log, op, nbytes(x), self.size, dist.all_reduce, x, reduction, group=self.group)
        return x

    def all_gather_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """[b, s/t, ...] on each rank → [b, s, ...] on every rank."""
        local = x.transpose(0, 1).contiguous()
        full = torch.empty((local.shape[0] * self.size, *local.shape[1:]), dtype=x.dtype, device=x.device)
        shared = self._shared_memory()
        if shared is not None:
            traced(self.log, "all_gather", nbytes(full), self.size, shared.all_gather, full, local)
        else:
            traced(self.log, "all_gather", nbytes(full), self.size, all_gather_single, full, local, group=self.group)
        return full.transpose(0, 1)

    def reduce_scatter_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """Partial sums [b, s, ...] → this rank's sequence slice of their sum, [b, s/t, ...]."""
        full = x.transpose(0, 1).contiguous()
        local = torch.empty((full.shape[0] // self.size, *full.shape[1:]), dtype=x.dtype, device=x.device)
        shared = self._shared_memory()
        if shared is not None:
            traced(self.log, "reduce_scatter", nbytes(full), self.size, shared.reduce_scatter, local, full)
        else:
            traced(self.log, "reduce_scatter", nbytes(full), self.size, reduce_scatter_single, local, full, group=self.group)
        return local.transpose(0, 1)

    def _shared_memory(self):
        """The group's shared-memory collectives where they apply (`comm.shared_memory`), else None."""
        return shared_memory.for_group(self.rank) if self.use_shared_memory else None


class _Enter(torch.autograd.Function):
    """Into a column-parallel region: f (identity / all-reduce) or, with SP, all-gather / reduce-scatter."""

    @staticmethod
    def forward(ctx, x, tp: TensorGroup, sequence_parallel: bool):
        ctx.tp, ctx.sp = tp, sequence_parallel
        return tp.all_gather_sequence(x) if sequence_parallel else x

    @staticmethod
    def backward(ctx, grad):
        return (ctx.tp.reduce_scatter_sequence(grad) if ctx.sp else ctx.tp.all_reduce(grad)), None, None


class _GatheredLinears(torch.autograd.Function):
    """Under sequence parallelism, into a column-parallel region and through its linears in one step: the sequence
    is all-gathered for the products, and gathered again in backward, so that only this rank's shard of the input is
    kept for backward rather than all t shards (Korthikanti et al. 2022 §4.2.2; Megatron-LM's
    LinearWithGradAccumulationAndAsyncCommunication) — one more all-gather of s·b·h per entry, in backward.
    Backward: each weight's gradient from the regathered input, a bias's (None: no bias) the sum of its output's
    gradient, the input's gradient reduce-scattered. `weights_and_biases`: each linear's weight, then its bias."""

    @staticmethod
    def forward(ctx, x, tp: TensorGroup, *weights_and_biases):
        weights, biases = weights_and_biases[::2], weights_and_biases[1::2]
        ctx.tp, ctx.biased = tp, [bias is not None for bias in biases]
        ctx.save_for_backward(x, *weights)
        full = tp.all_gather_sequence(x)
        return tuple(F.linear(full, weight, bias) for weight, bias in zip(weights, biases))

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        input_grad = sum(grad @ weight for grad, weight in zip(grads, weights))
        weight_grads = _regathered_weight_grads(ctx.tp, x, grads)
        bias_grads = [grad.reshape(-1, grad.shape[-1]).sum(0) if biased else None
                      for grad, biased in zip(grads, ctx.biased)]
        return (ctx.tp.reduce_scatter_sequence(input_grad), None,
                *(g for pair in zip(weight_grads, bias_grads) for g in pair))


def _regathered_weight_grads(tp: TensorGroup, shard: torch.Tensor, grads) -> list:
    """Each product's weight gradient, grad^T · input, from the input gathered again from this rank's shard."""
    full = tp.all_gather_sequence(shard)
    flat = full.reshape(-1, full.shape[-1])
    return [grad.reshape(-1, grad.shape[-1]).t() @ flat for grad in grads]


def _enter_linears(x, tp: TensorGroup, sequence_parallel: bool, *linears) -> tuple:
    """The column-parallel products of `linears` on x, entering the region once: f then each linear module (whose
    hooks, ZeRO-3's gathers among them, run), or under SP the all-gather that keeps only the shard for backward
    (`_GatheredLinears`, on the weights as they are: ZeRO-3 gathers the whole decoder layer as one unit, so the
    linears' own hooks need not run: parallel/mesh_zero.py)."""
    if sequence_parallel:
        return _GatheredLinears.apply(x, tp, *(p for linear in linears for p in (linear.weight, linear.bias)))
    x = _Enter.apply(x, tp, False)
    return tuple(linear(x) for linear in linears)


class _Leave(torch.autograd.Function):
    """Out of a row-parallel region: g (all-reduce / identity) or, with SP, reduce-scatter / all-gather. The partial
    sums are the fresh output of the product before it, which nothing saves for backward: they are summed in place
    (marked dirty, so that autograd would refuse a backward that needed them) rather than copied first."""

    @staticmethod
    def forward(ctx, x, tp: TensorGroup, sequence_parallel: bool):
        ctx.tp, ctx.sp = tp, sequence_parallel
        if sequence_parallel:
            return tp.reduce_scatter_sequence(x)
        if x.is_contiguous() and x._base is None:
            ctx.mark_dirty(x)
            return tp.all_reduce(x)
        return tp.all_reduce(x.clone(memory_format=torch.contiguous_format))

    @staticmethod
    def backward(ctx, grad):
        return (ctx.tp.all_gather_sequence(grad) if ctx.sp else grad), None, None


class ColumnParallelLinear(nn.Module):
    """y[..., rank's slice of outputs] = x W_slice^T (+ b_slice); `source` rows [rank·out/t, (rank+1)·out/t)."""

    def __init__(self, source: nn.Linear, tp: TensorGroup, sequence_parallel: bool, enter: bool = True):
        super().__init__()
        self.tp, self.sp, self.enter = tp, sequence_parallel, enter
        self.weight = nn.Parameter(source.weight.detach().chunk(tp.size, dim=0)[tp.index].clone())
        self.bias = None if source.bias is None else nn.Parameter(source.bias.detach().chunk(tp.size)[tp.index].clone())

    def forward(self, x):
        if not self.enter:  # behind a block's shared entry (_QKV, _GateUp)
            return F.linear(x, self.weight, self.bias)
        if self.sp:
            return _GatheredLinears.apply(x, self.tp, self.weight, self.bias)[0]
        return F.linear(_Enter.apply(x, self.tp, False), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = Σ_ranks x[..., rank's slice] W[:, slice]^T: the partial products summed (or reduce-scattered)."""

    def __init__(self, source: nn.Linear, tp: TensorGroup, sequence_parallel: bool):
        super().__init__()
        self.tp, self.sp = tp, sequence_parallel
        self.weight = nn.Parameter(source.weight.detach().chunk(tp.size, dim=1)[tp.index].clone())

    def forward(self, x):
        return _Leave.apply(F.linear(x, self.weight), self.tp, self.sp)


class _QKV(nn.Module):
    """Q, K and V column-parallel behind one entry (one all-gather under SP, not three)."""

    def __init__(self, attention, tp: TensorGroup, sequence_parallel: bool):
        super().__init__()
        self.tp, self.sp = tp, sequence_parallel
        self.q = ColumnParallelLinear(attention.q_proj, tp, sequence_parallel, enter=False)
        self.k = ColumnParallelLinear(attention.k_proj, tp, sequence_parallel, enter=False)
        self.v = ColumnParallelLinear(attention.v_proj, tp, sequence_parallel, enter=False)

    def forward(self, x):
        return _enter_linears(x, self.tp, self.sp, self.q, self.k, self.v)


class _GateUp(nn.Module):
    def __init__(self, mlp, tp: TensorGroup, sequence_parallel: bool):
        super().__init__()
        self.tp, self.sp = tp, sequence_parallel
        self.gate = ColumnParallelLinear(mlp.gate_proj, tp, sequence_parallel, enter=False)
        self.up = ColumnParallelLinear(mlp.up_proj, tp, sequence_parallel, enter=False)

    def forward(self, x):
        return _enter_linears(x, self.tp, self.sp, self.gate, self.up)


class _OnGradient(torch.autograd.Function):
    """Identity forward; `transform(gradient)` backward."""

    @staticmethod
    def forward(ctx, x, transform):
        ctx.transform = transform
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.transform(grad), None


class _RouterOnGathered(torch.autograd.Function):
    """Under sequence parallelism, the router's logits from the gathered tokens, keeping only this rank's shard of
    them for the weight's gradient and gathering it again in backward (as `_GatheredLinears` does for the dense
    entries); the gathered tokens get their gradient, which their all-gather's backward reduce-scatters."""

    @staticmethod
    def forward(ctx, shard, gathered, weight, tp: TensorGroup):
        ctx.tp = tp
        ctx.save_for_backward(shard, weight)
        return F.linear(gathered, weight)

    @staticmethod
    def backward(ctx, grad):
        shard, weight = ctx.saved_tensors
        return None, grad @ weight, *_regathered_weight_grads(ctx.tp, shard, [grad]), None


class TensorParallelExperts(nn.Module):
    """An MoE MLP (nn.moe) split like the dense one: every expert's gate and up by columns, its down
    projection by rows, the router replicated (Megatron-Core's expert tensor parallelism, ETP = TP).
    Every rank routes the same tokens the same way, so the experts' partial outputs are combined first
    and summed once (f and g around the layer: the dense MLP's 2 collectives of s·b·h). Two gradients
    need care: a routing weight's is <output gradient, expert output>, of which each rank holds a
    partial sum, so the kept slots' weights have their gradient summed over TP (4 bytes a slot,
    "all_reduce_routing"); the router's input gradient is then whole on every rank, so it enters the
    all-reduce of f at 1/t. The balancing loss, the same on every rank, needs neither.
    Under TP × EP (Megatron-Core's ETP with EP) `dispatch` becomes a `parallel.expert.ExpertDispatch`: the
    routed copies go to the EP ranks of the same TP index, which hold the same slice of their experts, and
    come back as partial outputs, summed over TP as before."""

    def __init__(self, layer, tp: TensorGroup, sequence_parallel: bool):
        super().__init__()
        self.layer, self.tp, self.sp = layer, tp, sequence_parallel
        self.dispatch = run_routed  # the routed copies through this rank's experts: here, or over EP
        for expert in layer.experts:
            for name, dim in (("gate_proj", 0), ("up_proj", 0), ("down_proj", 1)):
                linear = getattr(expert, name)
                linear.weight = nn.Parameter(linear.weight.detach().chunk(tp.size, dim=dim)[tp.index].clone())

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        shard = x
        x = _Enter.apply(x, self.tp, self.sp)
        tokens = x.reshape(-1, x.shape[-1])
        router_input = _OnGradient.apply(tokens, lambda gradient: gradient / self.tp.size)
        logits = _RouterOnGathered.apply(shard, router_input, self.layer.router.weight, self.tp) if self.sp else None
        routing = self.layer.route(router_input, logits)
        self.layer.last_routing = routing
        routing.weight = _OnGradient.apply(routing.weight,
                                           lambda gradient: self.tp.all_reduce(gradient, "all_reduce_routing"))
        partial = combine(tokens, routing, self.dispatch(self.layer.experts, tokens, routing)).reshape(x.shape)
        out = _Leave.apply(partial, self.tp, self.sp)
        return out if residual is None else residual + out


class VocabParallelEmbedding(nn.Module):
    """Rank r holds rows [r·V/t, (r+1)·V/t); each rank looks up its own ids, zeros elsewhere, then sum."""

    def __init__(self, source: nn.Embedding, tp: TensorGroup, sequence_parallel: bool):
        super().__init__()
        self.tp, self.sp = tp, sequence_parallel
        self.rows = source.num_embeddings // tp.size
        self.first = tp.index * self.rows
        self.weight = nn.Parameter(source.weight.detach()[self.first: self.first + self.rows].clone())

    def forward(self, ids):
        local = ids - self.first
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.clamp(0, self.rows - 1), self.weight).masked_fill(outside[..., None], 0.0)
        return _Leave.apply(out, self.tp, self.sp)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy over rows of logits split by vocabulary, without gathering them."""

    @staticmethod
    def forward(ctx, logits, targets, tp: TensorGroup, first: int):
        """Two passes over the logits' slice besides the reductions: exp(logits − max) into one new tensor, then its
        division by the total in place (the softmax backward needs); the target's shifted logit is gathered alone."""
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        maximum = tp.all_reduce(logits.max(dim=-1).values, maximum=True)
        exp = torch.sub(logits, maximum[..., None]).exp_()
        total = tp.all_reduce(exp.sum(dim=-1))
        local = targets - first
        inside = (local >= 0) & (local < logits.shape[-1])
        target_logit = logits.gather(-1, local.clamp(0, logits.shape[-1] - 1)[..., None])[..., 0]
        picked = tp.all_reduce((target_logit - maximum) * inside)
        softmax = exp.div_(total[..., None])
        ctx.save_for_backward(softmax, local, inside)
        return (total.log() - picked).mean()

    @staticmethod
    def backward(ctx, grad):
        """(softmax − onehot(target)) · grad / rows, as softmax · scale with the scale taken off at the targets: one
        pass, and the saved softmax left as it is (a second backward, with retain_graph, reads it again)."""
        softmax, local, inside = ctx.saved_tensors
        scale = grad / local.numel()
        grad_logits = softmax * scale
        rows = grad_logits.view(-1, grad_logits.shape[-1])
        flat_local, flat_inside = local.reshape(-1), inside.reshape(-1)
        rows[torch.arange(rows.shape[0])[flat_inside], flat_local[flat_inside]] -= scale
        return grad_logits, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, tp: TensorGroup) -> torch.Tensor:
    """logits [..., V/t] of this rank's vocabulary slice; targets [...] global ids."""
    return _VocabParallelCrossEntropy.apply(logits, targets, tp, tp.index * logits.shape[-1])


def split_parameters(module: nn.Module) -> set[int]:
    """The ids of the parameters TP splits, each rank holding its own slice; every other parameter of a parallelized
    model (the norms, an MoE router) has the same value and gradient on every rank of the group (a norm over the
    ranks counts those once: parallel/clipping.py)."""
    split = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)
    return {id(p) for m in module.modules() if isinstance(m, split) for p in m.parameters()} | \
        {id(p) for m in module.modules() if isinstance(m, TensorParallelExperts) for p in m.layer.experts.parameters()}


class TensorParallelNorm(nn.Module):
    """A norm every rank of the group holds whole but applies to part of the data — under sequence parallelism this
    rank's tokens, as Qwen3's query and key head norms this rank's heads — so its weight's gradient is summed over
    the TP group inside backward, every microbatch (Megatron sums the SP norms' once a step, after the gradients'
    reduction) — before ZeRO's hooks take it, which then see the whole gradient. Same weight, same name as the
    `RMSNorm` it replaces."""

    def __init__(self, source: nn.Module, tp: TensorGroup):
        super().__init__()
        self.weight, self.eps, self.tp = source.weight, source.eps, tp

    def forward(self, x):
        return training_kernels.rms_norm(x, _OnGradient.apply(self.weight, self.tp.all_reduce), self.eps)


def parallelize_llama(model, tp: TensorGroup, sequence_parallel: bool = False):
    """Split an nn.llama.Llama in place across the tensor-parallel group (every rank starts from the
    same full weights) and return it; `model(ids)` then yields this rank's vocabulary slice of logits."""
    config, t = model.config, tp.size
    for field, value in (("heads", config.heads), ("kv_heads", config.kv_heads), ("ffn_hidden", config.ffn_hidden),
                         ("expert_ffn_hidden", config.expert_ffn_hidden or config.ffn_hidden), ("vocab", config.vocab)):
        if value % t:
            raise InvalidValue("tp", t, f"a divisor of {field}={value}")
    if sequence_parallel:
        model.norm = TensorParallelNorm(model.norm, tp)
    for layer in model.layers:
        if sequence_parallel:
            layer.input_layernorm = TensorParallelNorm(layer.input_layernorm, tp)
            layer.post_attention_layernorm = TensorParallelNorm(layer.post_attention_layernorm, tp)
        attention, mlp = layer.self_attn, layer.mlp
        if attention.q_norm is not None:  # Qwen3's: each rank normalises its own heads
            attention.q_norm, attention.k_norm = (TensorParallelNorm(norm, tp) for norm in (attention.q_norm, attention.k_norm))
        attention.fused_qkv = _QKV(attention, tp, sequence_parallel)
        attention.o_proj = RowParallelLinear(attention.o_proj, tp, sequence_parallel)
        attention.heads, attention.kv_heads = attention.heads // t, attention.kv_heads // t
        del attention.q_proj, attention.k_proj, attention.v_proj
        if isinstance(mlp, MixtureOfExperts):
            layer.mlp = TensorParallelExperts(mlp, tp, sequence_parallel)
            continue
        mlp.fused_gate_up = _GateUp(mlp, tp, sequence_parallel)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, tp, sequence_parallel)
        del mlp.gate_proj, mlp.up_proj
    embedding = VocabParallelEmbedding(model.embed_tokens, tp, sequence_parallel)
    head = ColumnParallelLinear(model.lm_head, tp, sequence_parallel)
    if config.tied_embeddings:
        head.weight = embedding.weight  # the same vocabulary rows
    model.embed_tokens, model.lm_head = embedding, head
    return model
