"""Ring attention on CPU (our context parallelism) beside one process's attention, and torch's own
context parallelism tried on the same ranks.

    python benchmarks/context.py            # ~2 min on 2 cores; writes benchmarks/results/context.json

Causal attention forward + backward, grouped-query (8 query heads, 2 K/V heads, head dim 64), fp32,
batch 1, sequences of 2,048-8,192 tokens:
- one process: `F.scaled_dot_product_attention(is_causal=True)` over the whole sequence, all cores;
- ours: `parallel.context.ring_attention` with zig-zag shards on CP = 2 spawned ranks (gloo, one
  thread each): each rank holds half the queries and a K/V block circulates; the time is the slowest
  rank's. Per-rank attention memory and compute halve — what makes a longer context fit at all;
- torch's `torch.distributed.tensor.experimental.context_parallel` on the same 2 ranks: recorded as
  what it did (at torch 2.13 on CPU it raises; the message is kept in the JSON).
Best of 3 timed runs after a warm-up. Correctness is not measured here: tests/parallel/test_context.py
holds ring attention to full attention, forward and backward.
"""

import argparse
import time

import torch
import torch.nn.functional as F
from record import ROOT, OtherProcesses, machine, save  # benchmarks/record.py

from mlsyslab.comm.launch import spawn
from mlsyslab.comm.p2p import Wire
from mlsyslab.parallel.context import ring_attention, zigzag_indices

RESULTS = ROOT / "benchmarks" / "results" / "context.json"
HEADS, KV_HEADS, HEAD_DIM, REPEATS = 8, 2, 64, 3


def tensors(sequence: int):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, sequence, HEADS, HEAD_DIM, generator=generator)
    k = torch.randn(1, sequence, KV_HEADS, HEAD_DIM, generator=generator)
    v = torch.randn(1, sequence, KV_HEADS, HEAD_DIM, generator=generator)
    return q, k, v


def best_of(step) -> float:
    step()
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return min(times)


def one_process(sequence: int) -> float:
    q, k, v = (t.transpose(1, 2).contiguous().requires_grad_() for t in tensors(sequence))

    def step():
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()

    return best_of(step)


def ours(rank, sequence: int) -> float:
    mine = zigzag_indices(sequence, rank.world_size, rank.rank)
    q, k, v = (t[:, mine].contiguous().requires_grad_() for t in tensors(sequence))
    wire = Wire(rank)

    def step():
        ring_attention(wire, q, k, v).sum().backward()

    return best_of(step)


def torch_context_parallel(rank, sequence: int) -> str:
    """Run torch's context parallel SDPA once; 'ran' or the error it raised."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (rank.world_size,))
    q, k, v = (t.transpose(1, 2).contiguous() for t in tensors(sequence))  # sharded in place: no grad yet
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2], no_restore_buffers={q, k, v}):
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()
    except Exception as error:  # noqa: BLE001 - what it does on CPU is the result
        return f"{type(error).__name__}: {error}"[:400]
    return "ran"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--output", default=RESULTS)
    args = parser.parse_args()
    out = {**machine(torch=torch.__version__), "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
           "cp": 2, "rows": []}
    for sequence in args.sequences:
        others = OtherProcesses()
        single = one_process(sequence)
        ring = max(spawn(ours, 2, sequence, timeout_s=900))
        out["rows"].append({"sequence": sequence, "one_process_s": single, "ours_cp2_s": ring,
                            "other_processes_cpu_share": others.share()})
    out["torch_context_parallel"] = spawn(torch_context_parallel, 2, args.sequences[0], timeout_s=300)[0]
    save(out, args.output, print_table)


def print_table(out):
    print(f"# causal attention fwd+bwd, {out['heads']} heads / {out['kv_heads']} K/V heads x {out['head_dim']}, fp32, "
          f"{out['date_utc']}")
    print("| tokens | one process (all cores) | ours, CP = 2 (1 thread per rank) | ratio | others' CPU |")
    print("|---:|---:|---:|---:|---:|")
    for r in out["rows"]:
        print(f"| {r['sequence']} | {r['one_process_s'] * 1e3:.0f} ms | {r['ours_cp2_s'] * 1e3:.0f} ms | "
              f"{r['one_process_s'] / r['ours_cp2_s']:.2f}x | {100 * r['other_processes_cpu_share']:.0f}% |")
    print(f"\ntorch context_parallel on CPU (2 ranks): {out['torch_context_parallel']}")


if __name__ == "__main__":
    main()
