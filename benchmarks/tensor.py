"""Tensor parallelism on this machine: our Megatron-style TP beside torch's DTensor TP, same model, same run.

    python benchmarks/tensor.py             # ~2 min on 2 cores; writes benchmarks/results/tensor.json
    python benchmarks/tensor.py --sequence-parallel   # both with sequence parallelism; results/tensor_sp.json

TP = 2 spawned ranks (gloo, one thread each), two 4-layer Llamas, each in fp32 and in bf16 — "small" (hidden 256,
8 heads / 4 KV heads of 32, FFN 768, vocab 1024, batch 4 x 128 tokens: per-op overhead shows) and
"medium" (hidden 512, heads of 64, FFN 1536, vocab 2048, batch 4 x 256: the matmuls dominate) —
one training step = forward, loss, backward:
- ours: `parallel.tensor.parallelize_llama` (column/row-parallel linears with the conjugate f/g
  functions, vocabulary-parallel embedding and cross-entropy), with its all-reduces through shared memory
  (`comm.shared_memory`, the default on one host) and again on the gloo process group, as DTensor's;
- torch: `torch.distributed.tensor.parallel.parallelize_module` with the plan torchtitan uses for
  Llama — `ColwiseParallel` for q/k/v and gate/up, `RowwiseParallel` for o and down, the embedding
  `RowwiseParallel(input_layouts=Replicate())`, the head `ColwiseParallel(output_layouts=Shard(-1))`
  and the loss under `loss_parallel()` (on fp32 logits, as ours computes it); attention's head counts divided by TP as
  in torch's tutorial.
With `--sequence-parallel` both split the activations between the blocks along the sequence (Korthikanti et al.):
ours `parallelize_llama(..., sequence_parallel=True)`, torch torchtitan's SP plan (`SequenceParallel` norms,
`PrepareModuleInput` gathering each block's input, o, down and the embedding returning sequence shards).
Both run the same module code — without SP the norms, rope, silu·up and attention on plain tensors on both sides, so
both take `nn.training_kernels`' one-pass kernels; with SP torch's norms get DTensors, which keep PyTorch's own autograd of
F.rms_norm (ours take the one-pass backward), and that difference is in the SP rows' ratio.
Both start from the same weights; their first losses must agree (printed). The time is the slowest
rank's, median (best) of 10 steps after 3 warm-ups, the three alternating step by step ("paired": the median of the
steps' own DTensor / ours ratios). In bf16 the matmuls run on AMX tiles where the CPU has them (oneDNN), so the
shared matmul time is smaller and what the two TPs do differently weighs more.

The matmul floor bounds what any TP can gain over another: the step's matmul FLOPs per rank (counted by torch's
`FlopCounterMode` on our step; attention's, which it does not count on CPU, left out) over the best one-thread GEMM rate
measured in the same run, on both ranks at once, in the step's own shapes. Attention, the elementwise ops and the
all-reduces are left out, so the floor is generous and "DTensor / floor" is an upper bound on DTensor / ours.
"""

import argparse
import functools
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from record import ROOT, OtherProcesses, machine, paired_ratio, save  # benchmarks/record.py
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.utils.flop_counter import FlopCounterMode

from mlsyslab.comm.launch import spawn
from mlsyslab.nn.llama import Llama, LlamaConfig
from mlsyslab.parallel.tensor import TensorGroup, parallelize_llama, vocab_parallel_cross_entropy

RESULTS = ROOT / "benchmarks" / "results" / "tensor.json"
RESULTS_SP = ROOT / "benchmarks" / "results" / "tensor_sp.json"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
WHO = ("ours", "ours on gloo", "torch")  # ours with its shared-memory all-reduce, ours on the process group, DTensor's
KEYS = {"ours": "ours", "ours on gloo": "ours_gloo", "torch": "torch"}
CONFIGS = {  # name: (model, sequences, tokens each)
    "small": (LlamaConfig(vocab=1024, hidden=256, layers=4, heads=8, kv_heads=4, head_dim=32, ffn_hidden=768,
                          tied_embeddings=False, max_seq=128), 4, 128),
    "medium": (LlamaConfig(vocab=2048, hidden=512, layers=4, heads=8, kv_heads=4, head_dim=64, ffn_hidden=1536,
                           tied_embeddings=False, max_seq=256), 4, 256),
}


def dtensor_llama(model: Llama, tp: int, sequence_parallel: bool) -> Llama:
    """torchtitan's Llama plan; with `sequence_parallel` its SP form: the norms `SequenceParallel`, the blocks'
    inputs gathered by `PrepareModuleInput` and their outputs (o, down, the embedding) sequence-sharded."""
    mesh = init_device_mesh("cpu", (tp,))
    between = Shard(1) if sequence_parallel else Replicate()  # the activations between the blocks
    for layer in model.layers:
        plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(output_layouts=between),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(output_layouts=between)}
        if sequence_parallel:
            plan |= {"input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel(),
                     "self_attn": gather(4), "mlp": gather(1)}
        parallelize_module(layer, mesh, plan)
        layer.self_attn.heads //= tp
        layer.self_attn.kv_heads //= tp
    parallelize_module(model, mesh, {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        "lm_head": ColwiseParallel(input_layouts=between, output_layouts=Shard(-1), use_local_output=False)}
        | ({"norm": SequenceParallel()} if sequence_parallel else {}))
    return model


def gather(arguments: int) -> PrepareModuleInput:
    """A block's input x (its first of `arguments` positional arguments; the rest are not tensors) from sequence shards
    to the whole sequence on every rank."""
    unchanged = (None,) * (arguments - 1)
    return PrepareModuleInput(input_layouts=(Shard(1), *unchanged), desired_input_layouts=(Replicate(), *unchanged))


def run_rank(rank, warmups: int, steps: int, sequence_parallel: bool):
    return {(name, dtype): run_config(rank, config, batch, seq, DTYPES[dtype], warmups, steps, sequence_parallel)
            for name, (config, batch, seq) in CONFIGS.items() for dtype in DTYPES}


def run_config(rank, config: LlamaConfig, batch: int, seq: int, dtype: torch.dtype, warmups: int, steps: int,
               sequence_parallel: bool) -> dict:
    ids = torch.randint(0, config.vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(1))
    inputs, targets = ids[:, :-1], ids[:, 1:]
    fresh = lambda: Llama(config).initialize(generator=torch.Generator().manual_seed(0)).to(dtype)  # noqa: E731
    groups = {"ours": TensorGroup(rank), "ours on gloo": TensorGroup(rank, use_shared_memory=False)}
    models = {who: parallelize_llama(fresh(), group, sequence_parallel) for who, group in groups.items()}
    theirs = dtensor_llama(fresh(), rank.world_size, sequence_parallel)

    def ours_step(who):
        loss = vocab_parallel_cross_entropy(models[who](inputs), targets, groups[who])
        loss.backward()
        models[who].zero_grad(set_to_none=True)
        return loss.item()

    def theirs_step():
        with loss_parallel():
            logits = theirs(inputs)
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
            loss.backward()
        theirs.zero_grad(set_to_none=True)
        return loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item()

    times, first = {who: [] for who in WHO}, {}
    steps_of = {who: functools.partial(ours_step, who) for who in groups} | {"torch": theirs_step}
    for step in range(warmups + steps):
        for who, run in steps_of.items():
            dist.barrier()
            began = time.perf_counter()
            loss = run()
            elapsed = time.perf_counter() - began
            first.setdefault(who, loss)
            if step >= warmups:
                times[who].append(elapsed)
    with FlopCounterMode(display=False) as counter:
        ours_step("ours")
    return {"times": times, "first_loss": first, "matmul_flops": counter.get_total_flops(),
            "gemm_flops_per_s": best_gemm_rate(config, batch * seq, rank.world_size, dtype)}


def best_gemm_rate(config: LlamaConfig, tokens: int, tp: int, dtype: torch.dtype, repeats: int = 20) -> float:
    """The best FLOP/s of this rank's thread over the step's larger matmul shapes (rows x inner x columns, as
    `torch.mm` multiplies them), every rank at once as in the step."""
    shapes = [(tokens, config.hidden, config.ffn_hidden // tp), (tokens, config.ffn_hidden // tp, config.hidden),
              (config.ffn_hidden // tp, tokens, config.hidden), (tokens, config.hidden, config.vocab // tp)]
    best = 0.0
    for rows, inner, columns in shapes:
        left, right = torch.randn(rows, inner, dtype=dtype), torch.randn(inner, columns, dtype=dtype)
        dist.barrier()
        for _ in range(repeats):
            began = time.perf_counter()
            torch.mm(left, right)
            best = max(best, 2 * rows * inner * columns / (time.perf_counter() - began))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmups", type=int, default=3)
    parser.add_argument("--sequence-parallel", action="store_true", help="both TPs with sequence parallelism")
    parser.add_argument("--output", default=None, help=f"default {RESULTS.name}, or {RESULTS_SP.name} with SP")
    args = parser.parse_args()
    args.output = args.output or (RESULTS_SP if args.sequence_parallel else RESULTS)
    out = {**machine(torch=torch.__version__), "workload": vars(args) | {"output": str(args.output)}}
    others = OtherProcesses()
    ranks = spawn(run_rank, 2, args.warmups, args.steps, args.sequence_parallel, timeout_s=1800)
    share, out["rows"] = others.share(), []
    for (name, dtype), result in ranks[0].items():
        _, batch, seq = CONFIGS[name]
        slowest = {who: [max(r[name, dtype]["times"][who][i] for r in ranks) for i in range(args.steps)]
                   for who in WHO}
        row = {"model": name, "dtype": dtype, "batch": batch, "seq": seq, "tp": 2,
               "sequence_parallel": args.sequence_parallel, "others_cpu_share": share}
        for who in WHO:
            key = KEYS[who]
            row |= {f"{key}_median_s": statistics.median(slowest[who]), f"{key}_best_s": min(slowest[who]),
                    f"first_loss_{key}": result["first_loss"][who]}
        row["speedup_median"] = row["torch_median_s"] / row["ours_median_s"]
        row["speedup_paired"] = paired_ratio(slowest["torch"], slowest["ours"])
        row["speedup_gloo_median"] = row["torch_median_s"] / row["ours_gloo_median_s"]
        row["matmul_gflop_per_rank"] = max(r[name, dtype]["matmul_flops"] for r in ranks) / 1e9
        row["gemm_gflop_per_s"] = min(r[name, dtype]["gemm_flops_per_s"] for r in ranks) / 1e9
        row["matmul_floor_s"] = row["matmul_gflop_per_rank"] / row["gemm_gflop_per_s"]
        row["speedup_ceiling"] = row["torch_median_s"] / row["matmul_floor_s"]
        out["rows"].append(row)
    save(out, args.output, print_table)


def print_table(out: dict) -> None:
    print(f"# tensor parallel, {out['date_utc']}, TP=2{' with SP' if out['rows'][0]['sequence_parallel'] else ''}")
    print("| model | ours median (best) | ours on gloo | DTensor | DTensor / ours (paired) | DTensor / ours on gloo | "
          "matmul floor | DTensor / floor | first losses |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in out["rows"]:
        times = " | ".join(f"{r[f'{KEYS[who]}_median_s'] * 1e3:.1f} ms ({r[f'{KEYS[who]}_best_s'] * 1e3:.1f})" for who in WHO)
        losses = " / ".join(f"{r[f'first_loss_{KEYS[who]}']:.6f}" for who in WHO)
        print(f"| {r['model']}, {r['batch']} x {r['seq']}, {r['dtype']} | {times} | {r['speedup_median']:.2f}x "
              f"({r['speedup_paired']:.2f}x) | "
              f"{r['speedup_gloo_median']:.2f}x | {r['matmul_floor_s'] * 1e3:.1f} ms ({r['matmul_gflop_per_rank']:.1f} GFLOP at "
              f"{r['gemm_gflop_per_s']:.0f} GFLOP/s) | {r['speedup_ceiling']:.2f}x | {losses} |")


if __name__ == "__main__":
    main()
