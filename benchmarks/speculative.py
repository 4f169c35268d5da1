"""Speculative decoding by prompt lookup (n-gram drafts): ours beside transformers' on the same weights.

SmolLM2-135M-Instruct, greedy, in process, one request at a time (where a decode step is memory-bound and extra
positions are nearly free) and 16 at once (ours). Two workloads: outputs that copy their prompts (repeat, correct,
extract: drafts are kept) and free answers (drafts mostly refused). For each: ours without and with
`speculative_tokens=4`, transformers' `generate` without and with `prompt_lookup_num_tokens=4`; decode tokens per
second (tokens after the first over the time after the first), ratios within each engine, and the share of draft
tokens kept. Greedy outputs are checked equal with and without speculation in both engines.

    python benchmarks/speculative.py              # ~4 min on 2 cores; writes benchmarks/results/speculative.json
"""

import argparse
import time

import torch
from record import ROOT, OtherProcesses, machine, save  # benchmarks/record.py

from mlsyslab.nn.pretrained import default_gguf_path, load_pretrained
from mlsyslab.serve.config import EngineConfig
from mlsyslab.serve.engine import LLM
from mlsyslab.serve.sampling_params import SamplingParams

TEXT = ("Paged attention stores the key and value cache in fixed-size blocks, so memory is allocated on demand "
        "and shared between sequences with a common prefix; continuous batching re-forms the batch at every step.")
WORKLOADS = {
    "copy": [f"Repeat this text exactly: {TEXT}",
             f"Correct the spelling and repeat: {TEXT.replace('memory', 'memmory').replace('prefix', 'prefx')}",
             "Copy this list, one per line: apples, oranges, bananas, grapes, pears, plums, cherries, lemons.",
             f"Put this sentence in quotation marks: {TEXT}"],
    "free": ["Write a short poem about the sea.", "Explain gravity to a child.", "Give me a recipe for pancakes.",
             "What does a compiler do?"],
}
MAX_TOKENS, DRAFT = 96, 4


def ours(model, tokenizer, prompts, speculative: int, concurrent: bool) -> dict:
    llm = LLM(model, tokenizer, config=EngineConfig(kv_cache_bytes=200_000_000, speculative_tokens=speculative))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params) if concurrent else [llm.generate([p], params)[0] for p in prompts]
    wall = time.perf_counter() - start
    decode_s = sum(o.latency_s - o.ttft_s for o in outputs)
    decoded = sum(len(o.output_ids) - 1 for o in outputs)
    return {"tokens": [o.output_ids for o in outputs], "decode_tok_s": decoded / decode_s if not concurrent else None,
            "tok_s": sum(len(o.output_ids) for o in outputs) / wall,
            "kept": llm.engine.accepted_draft_tokens / max(1, llm.engine.draft_tokens)}


def transformers(model, prompts, lookup: int, eos: list[int]) -> dict:
    tokens, decode_s, decoded = [], 0.0, 0
    for prompt in prompts:
        ids = torch.tensor([prompt])
        options = dict(do_sample=False, eos_token_id=eos, prompt_lookup_num_tokens=lookup or None)
        with torch.no_grad():
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=1, **options)
            first = time.perf_counter() - start
            start = time.perf_counter()
            out = model.generate(ids, max_new_tokens=MAX_TOKENS, **options)[0, len(prompt):].tolist()
            total = time.perf_counter() - start
        tokens.append(out)
        decode_s += total - first
        decoded += len(out) - 1
    return {"tokens": tokens, "decode_tok_s": decoded / decode_s}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "speculative.json"))
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    ours_model, tokenizer, _ = load_pretrained("default", "fp32")
    path = default_gguf_path()
    theirs = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    eos = sorted(tokenizer.eos_token_ids)
    out = {"machine": machine(torch=torch.__version__), "max_tokens": MAX_TOKENS, "draft_tokens": DRAFT, "rows": []}
    others = OtherProcesses()
    for workload, questions in WORKLOADS.items():
        prompts = [tokenizer.chat_ids([{"role": "user", "content": q}]) for q in questions]
        plain, spec = (ours(ours_model, tokenizer, prompts, k, False) for k in (0, DRAFT))
        crowd_plain, crowd_spec = (ours(ours_model, tokenizer, prompts * 4, k, True) for k in (0, DRAFT))
        hf_plain, hf_lookup = (transformers(theirs, prompts, k, eos) for k in (0, DRAFT))
        assert spec["tokens"] == plain["tokens"] and crowd_spec["tokens"] == crowd_plain["tokens"], workload
        assert hf_lookup["tokens"] == hf_plain["tokens"], workload
        out["rows"].append({
            "workload": workload, "outputs_equal_transformers": plain["tokens"] == hf_plain["tokens"],
            "ours_batch1_tok_s": [plain["decode_tok_s"], spec["decode_tok_s"]],
            "ours_16_tok_s": [crowd_plain["tok_s"], crowd_spec["tok_s"]],
            "transformers_batch1_tok_s": [hf_plain["decode_tok_s"], hf_lookup["decode_tok_s"]],
            "kept_share": [spec["kept"], crowd_spec["kept"]]})
    out["other_processes_cpu_share"] = others.share()
    save(out, args.out, print_table)


def print_table(out):
    print(f"\n{out['machine']['date_utc']}, greedy, {out['max_tokens']} tokens, drafts of {out['draft_tokens']}; "
          f"decode tok/s without -> with speculation (ratio); kept: share of draft tokens kept")
    for row in out["rows"]:
        def pair(values):
            return f"{values[0]:.1f} -> {values[1]:.1f} ({values[1] / values[0]:.2f}x)"
        print(f"{row['workload']:>5}: ours batch 1 {pair(row['ours_batch1_tok_s'])}, ours 16 in flight "
              f"{pair(row['ours_16_tok_s'])}, transformers batch 1 {pair(row['transformers_batch1_tok_s'])}; "
              f"kept {row['kept_share'][0]:.0%} / {row['kept_share'][1]:.0%}; "
              f"ours = transformers: {row['outputs_equal_transformers']}")
    print(f"load average {out['machine']['load_avg_start']} -> {out['load_avg_end']}; "
          f"other processes {out['other_processes_cpu_share']:.0%} of the CPU")


if __name__ == "__main__":
    main()
