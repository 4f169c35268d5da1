"""The serving engine: `LLM(model).generate(prompts, params)`, and the step the server's loop drives.

One `Engine.step()`: the scheduler picks this iteration's requests and how many tokens each computes
(`serve.scheduler`); their tokens are packed into one row and run through the shared model
(`nn.llama.Llama.forward_packed`; on CPU a copy with oneDNN-prepacked, fused weights,
`nn.packed_linear`, C++ kernels for attention and the per-token steps, `nn.cpu_kernels`, and without
AMX, for 16-bit weights an fp32 copy for steps of many tokens) with attention through the paged KV cache
(`nn.paged_attention`); rows that reached their last known token are sampled (`serve.sampling`; a structured
output's grammar masks its row first and is advanced by the token drawn, `serve.grammar`);
outputs are detokenized and checked for stop conditions (`serve.output`); finished requests free
their blocks. `LLM.generate` adds every prompt and steps until all are done (`LLM.stream`: one prompt's deltas as
they come); `serve.engine_process`
runs the same step in a process of its own for the HTTP server.

Cost per step: one pass over the weights (memory-bound at small batches: weight bytes / bandwidth
is the decode roofline; twin `predict.inference`) plus attention over each request's context.
Measured over HTTP (SmolLM2-135M, 2 cores; benchmarks/README.md, where the machine's drift is noted):
on an AMX host (2026-11-23 18:26 UTC) batch 1 36-39 tok/s fp32 and 48-51 bf16, bf16 at 16 / 32 in
flight 360-400 / 480-500 tok/s; on an AVX2 host (2026-11-24 03:06 UTC, with the streamed matmul of
`nn.packed_linear`) batch 1 35-40 tok/s fp32 and 45-61 bf16, bf16 at 16 / 32 in flight 113-125 /
134-145 (prefill-bound: 2 cores of AVX2).
Decode-only steps run every layer in one C++ call (`nn.fused_decode`) where the kernels apply; those whose
tokens the kernel can pick (greedy, or temperature sampling without top-k / top-p / min-p) with nobody waiting
run up to `EngineConfig.decode_steps` steps in that call (multi-step decoding, `Engine.steps_ahead`; with the
weights and KV pool on huge pages, bf16 batch 1 on the AVX2 host went from 73-78% to 77-84% of the decode
roofline over HTTP, against a stricter roofline: benchmarks/README.md).
With `EngineConfig.speculative_tokens` a decode may verify an n-gram draft of its own context in the same step, as
one-token rows (`serve.speculative`). Not done: draft-model speculation, CUDA graphs / torch.compile, tensor
parallelism across processes.
Tested in tests/serve/test_engine.py (greedy equal to HF transformers at batch 1 and mixed batches).
"""

from __future__ import annotations

import copy
import itertools
import math
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from mlsyslab.comm import heap
from mlsyslab.errors import InvalidValue
from mlsyslab.nn.llama import Llama, release_unheld
from mlsyslab.nn import cpu_kernels
from mlsyslab.nn.fused_decode import FusedDecode
from mlsyslab.nn.packed_linear import can_pack, packed_for_inference
from mlsyslab.nn.paged_attention import DecodeSteps, PagedAttention, SequenceSlice
from mlsyslab.nn.tokenizer import Tokenizer
from mlsyslab.serve.config import EngineConfig, default_fp32_steps_from
from mlsyslab.serve.grammar import Grammars, constrain_draft, grammar_draft
from mlsyslab.serve.kv_cache import KVCache
from mlsyslab.serve.output import Delta, OutputTracker, RequestOutput
from mlsyslab.serve.request import Request
from mlsyslab.serve.sampling import SamplerInput, picked_in_step, sample, score
from mlsyslab.serve.sampling_params import Sampled, SamplingParams
from mlsyslab.serve.scheduler import Scheduled, Scheduler
from mlsyslab.serve.speculative import propose, speculates, verify


def release_matrices(source: Llama, serving: Llama, wide: Llama | None) -> None:
    """Move `source`'s linear layers to the meta device (shapes kept, no bytes) where the serving copies hold their
    own packed matrices; what the copies share with it (embedding, norms, a tied head) stays, in memory of its own:
    loaded without a copy, it was the safetensors file's mapping, which held every page of the file resident (525 MB
    of SmolLM2's fp32 engine) for the 113 MB of its embedding."""
    if serving is source:  # not packed: the source is what runs
        return
    linears = [module for module in source.modules() if isinstance(module, torch.nn.Linear)]
    release_unheld(linears, torch.nn.ModuleList(twin for twin in (serving, wide) if twin is not None))
    with torch.no_grad():
        for parameter in source.parameters():  # the copies share these Parameter objects: they see the new data
            if parameter.device.type == "cpu":
                parameter.data = parameter.data.clone()


class Engine:
    """Requests in, deltas out, one model step at a time."""

    def __init__(self, model: Llama, tokenizer: Tokenizer | None = None, config: EngineConfig = EngineConfig(),
                 eos_token_ids: frozenset[int] | None = None, keep_source: bool = True):
        """`keep_source`: keep `model`'s own weights for `refresh_weights` (whoever trains it in place); without, the
        serving copies hold the only copy of its matrices (SmolLM2 in bf16: 213 MB less)."""
        self.source_model, self.tokenizer, self.config = model.eval(), tokenizer, config
        self.copy_weights(model)
        if not keep_source:
            release_matrices(model, self.model, self.wide_model)
        parameter = next(model.parameters())
        self.kv = KVCache(model.config, config.kv_cache_bytes, config.block_size,
                          kv_cache_dtype(parameter, model.config.head_dim), parameter.device)
        self.scheduler = Scheduler(self.kv, model.config.max_seq, config.max_batched_tokens, config.max_running,
                                   config.max_waiting, config.prefix_cache)
        if eos_token_ids is None:
            eos_token_ids = tokenizer.eos_token_ids if tokenizer is not None else frozenset()
        self.eos_token_ids = eos_token_ids
        self.grammars = Grammars(tokenizer, model.config.vocab)
        self.trackers: dict[str, OutputTracker] = {}
        self.arrivals = itertools.count()
        self.seed_source = torch.Generator().manual_seed(0)
        self.steps = self.prefill_tokens = self.decode_tokens = 0
        self.draft_tokens = self.accepted_draft_tokens = 0  # speculative decoding's guesses, and those kept
        self.decode_step_s: dict[int, float] = {}  # the last decode step's seconds, by rows (`steps_ahead`)

    def copy_weights(self, model: Llama) -> None:
        """The serving copies of `model`: the copy in the model's dtype for the steps under `wide_from` tokens, first
        (its tiles take huge pages while memory is least fragmented: built after the fp32 copy, their 2 MB pages took
        2.4 s here instead of 25 ms), then the fp32 copy of 16-bit weights for the wider steps (`wide_steps_from`)."""
        self.wide_from = self.wide_steps_from(model)
        self.model, self.fused_decode = self.serving_copy(model, (1, self.wide_from or math.inf))
        self.wide_model = None
        if not self.wide_from:
            return
        if self.config.packed_linears and can_pack(model, torch.float32):  # each matrix converted as it is packed
            self.wide_model = packed_for_inference(model, (self.wide_from, math.inf), torch.float32)
        else:
            self.wide_model = copy.deepcopy(model).float()

    def serving_copy(self, model: Llama, rows: tuple = (1, math.inf)) -> tuple[Llama, FusedDecode | None]:
        """The model the steps of `rows` ([first, last) tokens) run (prepacked where it can be), and its one-call
        decode step where it applies."""
        serving = packed_for_inference(model, rows) if self.config.packed_linears and can_pack(model) else model
        fused = FusedDecode(serving) if self.config.fused_decode and FusedDecode.applies_to(serving) else None
        return serving, fused

    def wide_steps_from(self, model: Llama) -> int:
        """The step size from which an fp32 copy of 16-bit CPU weights (the same values: bf16 -> fp32 is exact) runs
        the steps, or 0 for no copy.

        Where the CPU cannot multiply bf16 pairs in one instruction, oneDNN's bf16 GEMM has no more
        multiply-adds per cycle than its fp32 one and pays for the conversions (an AVX-512 host read
        190-210 GFLOP/s in bf16 against 320-400 in fp32 for a 1024-token prefill, fp32 ahead from about
        16 rows; AVX2 CPUs, where oneDNN cannot pack bf16, run it on the plain weight): there steps of 16
        tokens or more take the copy (`serve.config.default_fp32_steps_from`). Where it can
        (`measure.host.cpu_has_bf16_dot`: AVX512_BF16 or AMX),
        bf16 is the faster GEMM and there is no copy: on Zen 4 (AVX512_BF16, 2026-11-25) oneDNN's packed
        bf16 matmul over SmolLM2's matrices took 0.50-0.58x the fp32 one's time at 16-1024 rows, and the
        engine without the copy prefilled 1,000 tokens in 1.00 s against 1.45 s and decoded 16 sequences
        at 449-460 tok/s against 254-261. Decode at small batches stays on the 16-bit weights, where half
        the bytes per token is what counts. So a bf16 engine with the copy costs its memory too (4 bytes
        a weight), and a request's activations are fp32 in wide steps and bf16 in narrow ones (outputs
        can differ in the last bits by batch composition, as they do in any 16-bit engine).
        """
        parameter = next(model.parameters())
        if parameter.device.type != "cpu" or parameter.dtype not in (torch.bfloat16, torch.float16):
            return 0
        wide_from = self.config.fp32_steps_from
        return max(default_fp32_steps_from() if wide_from is None else wide_from, 0)

    def model_for(self, tokens: int) -> Llama:
        """The model a step of `tokens` tokens runs: the fp32 copy from `wide_from` tokens on, if there is one."""
        return self.wide_model if self.wide_model is not None and tokens >= self.wide_from else self.model

    def refresh_weights(self) -> None:
        """Re-read the source model's weights after training changed them: the prepacked linears are
        snapshots (embeddings and norms are shared with the source model, so always current)."""
        if any(p.device.type == "meta" for p in self.source_model.parameters()):
            raise RuntimeError("the engine was built with keep_source=False: it holds no source weights to re-read")
        self.copy_weights(self.source_model)

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> Request:
        """Queue a request; raises InvalidValue (bad input) or QueueFull before any work."""
        max_seq, vocab = self.model.config.max_seq, self.model.config.vocab
        if request_id in self.trackers:
            raise InvalidValue("request_id", request_id, "unique among running requests")
        if not prompt_ids:
            raise InvalidValue("prompt", "", "at least one token")
        if len(prompt_ids) >= max_seq:
            raise InvalidValue("prompt tokens", len(prompt_ids), f"< the context length {max_seq}")
        outside = next((token for token in prompt_ids if not 0 <= token < vocab), None)
        if outside is not None:
            raise InvalidValue("prompt token id", outside, f"0..{vocab - 1}")
        if params.logit_bias and max(token for token, _ in params.logit_bias) >= vocab:
            raise InvalidValue("logit_bias token id", max(token for token, _ in params.logit_bias), f"0..{vocab - 1}")
        if params.stop_token_ids and max(params.stop_token_ids) >= vocab:
            raise InvalidValue("stop_token_ids", max(params.stop_token_ids), f"token ids in 0..{vocab - 1}")
        if params.stop and self.tokenizer is None:
            raise InvalidValue("stop", params.stop, "none (this engine has no tokenizer to match text)")
        matcher = self.grammars.matcher(params.structured_output) if params.structured_output is not None else None
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self.seed_source))
        request = Request(request_id, list(prompt_ids), params, next(self.arrivals),
                          generator=torch.Generator().manual_seed(seed),
                          prompt_logprobs=None if params.prompt_logprobs is None else [None], matcher=matcher)
        self.scheduler.add(request)
        self.trackers[request_id] = OutputTracker(request, self.tokenizer, self.eos_token_ids, max_seq)
        return request

    def add_requests(self, requests: list[tuple[str, list[int], SamplingParams]]) -> list[Request]:
        """Queue (request_id, prompt_ids, params) requests all or none — the choices and prompts of one API
        call: if one is invalid or the queue fills, those already queued are aborted before any step has run
        them (their outputs are not reported) and the error is raised."""
        if len(requests) > self.config.max_waiting:  # would never fit: not a full queue to retry later (503)
            raise InvalidValue("prompts × n", len(requests), f"<= {self.config.max_waiting} requests (max_waiting): "
                               "a call's choices are queued together")
        added = []
        try:
            for request in requests:
                added.append(self.add_request(*request))
        except BaseException:
            for request in added:
                self.abort(request.request_id)
            raise
        return added

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request and free its blocks (no-op if it already finished)."""
        tracker = self.trackers.pop(request_id, None)
        if tracker is None:
            return None
        self.scheduler.abort(tracker.request)
        return tracker.result("abort", time.perf_counter())

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    @torch.inference_mode()
    def step(self) -> tuple[list[Delta], list[RequestOutput]]:
        """Run one iteration; returns the deltas of the requests that produced tokens (one delta each), and the
        finished ones."""
        batch = self.scheduler.schedule()
        if not batch:
            return [], []
        sampling = [item.request for item in batch if item.samples]
        drafts = self.drafts(batch)
        steps = 1 if drafts else self.steps_ahead(batch)
        drawn = self.decode_ahead(batch, steps) if steps > 1 else self.one_step(batch, sampling, drafts)
        return self.deliver(sampling, drawn)

    def drafts(self, batch: list[Scheduled]) -> dict[str, list[int]]:
        """Speculative decoding (`serve.speculative`): each decode's draft, by request id — its n-gram guess, or under a
        grammar what the grammar forces next (`serve.grammar.grammar_draft`) — for the decodes that may speculate and
        have one — no further than max_tokens and the context allow, only where free blocks hold
        the draft's K/V, and only while the step keeps at most `speculative_max_rows` rows: a step of a few rows is
        bound by reading the weights, so extra rows cost little (here, fp32 batch 1: 17 ms a step of one row, 24 of
        five), while a wider one pays for every row (drafts of 4 at 16 in flight lost 0-20% of the throughput of
        free answers, benchmarks/README.md). The default, 8, is the fp32 panel kernel's row block."""
        k = self.config.speculative_tokens
        if not k:
            return {}
        rows = sum(item.num_tokens for item in batch)
        budget = min(self.config.max_batched_tokens, self.config.speculative_max_rows) - rows
        drafts = {}
        for item in batch:
            request = item.request
            most = min(k, budget, request.params.max_tokens - len(request.output_ids) - 1,
                       self.model.config.max_seq - request.num_tokens - 1)
            if most < 1 or item.num_tokens != 1 or not item.samples or not speculates(request.params):
                continue
            draft = propose(request.all_ids, most, self.config.ngram_max, self.config.ngram_min)
            if request.matcher is not None:  # what the grammar forces next, or the n-gram guess as far as it allows
                draft = grammar_draft(request.matcher, self.tokenizer, draft, most)
            if draft and self.scheduler.reserve_ahead([request], 1 + len(draft)):
                drafts[request.request_id] = draft
                budget -= len(draft)
        return drafts

    def one_step(self, batch: list[Scheduled], sampling: list[Request], drafts: dict[str, list[int]]
                 ) -> list[list[Sampled]]:
        """One model step over the batch's tokens packed in a row; the sampling requests' next tokens (one each, or
        up to 1 + its draft's for a request that speculates: `serve.speculative.verify`). Rows of prompt positions
        whose request asked for the prompt's log-probabilities also get their logits (`score_prompts`)."""
        ids, positions, slices, rows, prompt_rows, scored, spans = [], [], [], [], [], [], []
        for item in batch:
            request, start = item.request, item.request.num_computed
            draft = drafts.get(request.request_id, [])
            count = item.num_tokens + len(draft)
            ids += request.all_ids[start:start + item.num_tokens] + draft
            positions += range(start, start + count)
            if draft:  # the last token and the draft as one-token rows, each reading the K/V of those before it
                slices += [SequenceSlice(1, start + 1 + j, request.blocks) for j in range(count)]
            else:
                slices.append(SequenceSlice(count, start + count, request.blocks))
            if item.samples:  # its rows: the last token's, then each draft token's
                spans.append((len(rows), 1 + len(draft)))
                rows += range(len(ids) - 1 - len(draft), len(ids))
            if request.prompt_scored_to is not None:  # position p's row is first_row + p
                first_row = len(ids) - item.num_tokens - start
                chunk = range(max(request.prompt_scored_to, start), min(start + item.num_tokens, len(request.prompt_ids) - 1))
                prompt_rows += [first_row + p for p in chunk]
                scored.append((request, chunk))
        device = self.kv.k.device
        attention = PagedAttention(self.kv.k, self.kv.v, slices, rows_extend_sequences=bool(drafts))
        model = self.model_for(len(ids))
        fused = (model is self.model and self.fused_decode is not None and not attention.prefills and attention.in_place
                 and not prompt_rows)
        inputs = (torch.tensor(ids, device=device), torch.tensor(positions, device=device), attention,
                  torch.tensor(rows + prompt_rows, dtype=torch.long, device=device))
        start_s = time.perf_counter()
        logits, argmax = self.fused_decode(*inputs) if fused else (model.forward_packed(*inputs), None)
        if fused:
            self.decode_step_s[len(batch)] = time.perf_counter() - start_s
        if prompt_rows:
            self.score_prompts(logits[len(rows):], scored)
        self.count(batch, 1)
        self.scheduler.after_step(batch)
        inputs = [SamplerInput(r.params, r.prompt_ids, r.output_ids, r.generator, self.trackers[r.request_id].stop_ids,
                               r.matcher) for r in sampling]
        if not drafts:
            return [[token] for token in sample(logits[:len(rows)], inputs, argmax)]
        plain = [i for i, request in enumerate(sampling) if request.request_id not in drafts]
        drawn = dict(zip(plain, [[token] for token in sample(logits[[spans[i][0] for i in plain]],
                                                             [inputs[i] for i in plain])])) if plain else {}
        for i, request in enumerate(sampling):
            if i not in drawn:
                first, count = spans[i]
                rows = logits[first:first + count]
                if request.matcher is not None:  # masked on an fp32 copy, as `sampling.pick` masks
                    rows = rows.to(torch.float32, copy=True)
                    constrain_draft(rows, request.matcher, drafts[request.request_id])
                drawn[i] = verify(rows, drafts[request.request_id], inputs[i])
                self.draft_tokens += count - 1
                self.accepted_draft_tokens += len(drawn[i]) - 1
        return [drawn[i] for i in range(len(sampling))]

    @staticmethod
    def score_prompts(logits: torch.Tensor, scored: list[tuple[Request, range]]) -> None:
        """Each request's scored positions, in order: position p's log-probability of prompt token p + 1 (and the
        most likely, `prompt_logprobs` of them) under the model's raw distribution, appended to the request."""
        start = 0
        for request, chunk in scored:
            tokens = [request.prompt_ids[p + 1] for p in chunk]
            request.prompt_logprobs += score(logits[start:start + len(tokens)], tokens,
                                             [request.params.prompt_logprobs] * len(tokens))
            start += len(tokens)

    def steps_ahead(self, batch: list[Scheduled]) -> int:
        """How many decode steps the batch runs in one call: multi-step decoding (vLLM's `--num-scheduler-steps`),
        each row's token fed back in C++ (`FusedDecode.ahead`), so the Python around a step (building its inputs,
        bookkeeping; ~0.6 ms of a 12 ms bf16 step at batch 1 here in 4 kB pages, less on huge pages) runs once for
        them all, and the server gets one message per request a run.

        More than one only when it changes no output, keeps nobody waiting and takes no chance of a speculative draft
        (with `speculative_tokens`, steps small enough to draft in run one at a time): every request takes its largest
        logit or a draw without top-k / top-p / min-p, without penalties or logprobs (the kernel picks the token as
        `serve.sampling` would, with the same uniforms of the request's generator), nothing is waiting to be admitted,
        the step takes the streamed kernel on the serving weights, and the pool has free blocks for all of them.
        At most `decode_steps`, about `decode_ahead_s` of measured steps (an arrival waits for the run to end),
        and no request's max_tokens or the context length: a stop token or string met earlier ends the request
        there, and the K/V computed past it are dropped with its blocks."""
        most = self.config.decode_steps
        measured = self.decode_step_s.get(len(batch))
        if (most <= 1 or self.fused_decode is None or measured is None or self.scheduler.waiting
                or self.model_for(len(batch)) is not self.model or not self.fused_decode.runs_ahead(len(batch))):
            return 1
        if any(item.num_tokens != 1 or not item.samples or not picked_in_step(item.request.params) for item in batch):
            return 1
        if self.config.speculative_tokens and len(batch) < self.config.speculative_max_rows:
            return 1  # a request that may speculate looks for a draft every step (`drafts`)
        max_seq = self.model.config.max_seq
        most = min([most, int(self.config.decode_ahead_s / max(measured, 1e-9))]
                   + [min(item.request.params.max_tokens - len(item.request.output_ids), max_seq - item.request.num_tokens)
                      for item in batch])
        if most <= 1 or not self.scheduler.reserve_ahead([item.request for item in batch], most):
            return 1
        return most

    def decode_ahead(self, batch: list[Scheduled], steps: int) -> list[list[Sampled]]:
        """`steps` decode steps of the batch in one call (see `steps_ahead`); each request's tokens. A sampling
        request gives the run the next `steps` uniforms of its generator, those its single steps would draw (a
        request that stops inside the run has used some it did not need: it is done with them)."""
        requests = [item.request for item in batch]
        inputs = DecodeSteps.of(self.kv.k, self.kv.v, [r.blocks for r in requests], [r.num_computed for r in requests],
                                steps)
        ids = torch.tensor([r.all_ids[r.num_computed] for r in requests])
        temperature = torch.tensor([r.params.temperature for r in requests], dtype=torch.float32)
        uniform = torch.stack([torch.rand(steps, generator=r.generator, dtype=torch.float64) if r.params.temperature > 0
                               else torch.zeros(steps, dtype=torch.float64) for r in requests], dim=1)
        start_s = time.perf_counter()
        tokens = self.fused_decode.ahead(ids, inputs, temperature, uniform)
        self.decode_step_s[len(batch)] = (time.perf_counter() - start_s) / steps
        self.count(batch, steps)
        self.scheduler.after_step(batch)
        return [[Sampled(token) for token in row] for row in tokens.t().tolist()]

    def count(self, batch: list[Scheduled], steps: int) -> None:
        self.steps += steps
        self.decode_tokens += steps * sum(1 for item in batch if item.num_tokens == 1)
        self.prefill_tokens += sum(item.num_tokens for item in batch if item.num_tokens > 1)

    def deliver(self, sampling: list[Request], drawn: list[list[Sampled]]) -> tuple[list[Delta], list[RequestOutput]]:
        """Hand each request its tokens in order, up to the first that finishes it; one delta per request."""
        now = time.perf_counter()
        deltas, finished = [], []
        for request, tokens in zip(sampling, drawn):
            if request.first_token_s is None:
                request.first_token_s = now
            tracker = self.trackers[request.request_id]
            delta = None
            for index, sampled in enumerate(tokens):
                if index:  # a multi-step run fed the previous token back: its K/V are in the cache too
                    request.num_computed += 1
                if request.matcher is not None and not request.matcher.accept_token(sampled.token):
                    raise RuntimeError(f"{request.request_id}: token {sampled.token} drawn outside its grammar")
                added, reason = tracker.add(sampled)
                delta = added if delta is None else delta.then(added)
                if reason is not None:
                    break
            deltas.append(delta)
            if reason is not None:
                self.scheduler.finish(request, reason)
                finished.append(tracker.result(reason, now))
                del self.trackers[request.request_id]
        return deltas, finished

    def check(self) -> None:
        """Raise unless every KV block is owned exactly as the scheduler and prefix cache say."""
        self.kv.check(self.scheduler.owners())


def kv_cache_dtype(parameter: torch.Tensor, head_dim: int) -> torch.dtype:
    """The weights' dtype (K and V come out of the projections in it, so the cache holds them exactly),
    except fp32 for 16-bit weights on CPU where the in-place decode kernel (`nn.cpu_kernels`)
    cannot read them: the PyTorch path computes attention in fp32, and converting the gathered
    context every step cost more than the doubled cache bytes."""
    if parameter.device.type != "cpu" or parameter.dtype not in (torch.bfloat16, torch.float16):
        return parameter.dtype
    return parameter.dtype if cpu_kernels.serves_attention(parameter.device, parameter.dtype, head_dim) else torch.float32


class LLM:
    """In-process generation: `LLM("default").generate(["Hello"], SamplingParams(max_tokens=32))`."""

    def __init__(self, model: str | Path | Llama = "default", tokenizer: Tokenizer | None = None, dtype: str = "fp32",
                 config: EngineConfig = EngineConfig(), cache_dir: str | Path | None = None,
                 keep_source: bool | None = None):
        """`keep_source` (`Engine`'s): by default kept for a model passed in (its owner may train it and
        `refresh_weights`), not for one loaded here."""
        if isinstance(model, Llama):
            self.name = "model"
        else:
            from mlsyslab.nn.pretrained import load_pretrained

            model, tokenizer, self.name = load_pretrained(model, dtype, cache_dir)
            keep_source = bool(keep_source)
        self.tokenizer = tokenizer
        self.engine = Engine(model, tokenizer, config, keep_source=keep_source is not False)
        heap.return_freed_memory()  # the serving copies' temporaries (and a released source's matrices)
        self.ids = itertools.count()

    def generate(self, prompts: list[str] | list[list[int]] | str, params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt (text, or token ids); outputs in the order of the prompts."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        params = params if params is not None else SamplingParams()
        each = params if isinstance(params, list) else [params] * len(prompts)
        if len(each) != len(prompts):
            raise InvalidValue("params", f"{len(each)} items", f"one per prompt ({len(prompts)})")
        pending = [(f"generate-{next(self.ids)}", self.encode(prompt), p) for prompt, p in zip(prompts, each)]
        order, results = [request_id for request_id, _, _ in pending], {}
        pending.reverse()
        try:
            while pending or self.engine.has_work():
                while pending and len(self.engine.scheduler.waiting) < self.engine.config.max_waiting:
                    self.engine.add_request(*pending.pop())
                for output in self.engine.step()[1]:
                    results[output.request_id] = output
        except BaseException:
            for request_id in order:
                self.engine.abort(request_id)
            raise
        return [results[request_id] for request_id in order]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[Delta | RequestOutput]:
        """One prompt's deltas as the steps make them, then its RequestOutput; leaving early aborts it."""
        request_id = f"generate-{next(self.ids)}"
        self.engine.add_request(request_id, self.encode(prompt), params if params is not None else SamplingParams())
        try:
            while self.engine.has_work():
                deltas, finished = self.engine.step()
                yield from (delta for delta in deltas if delta.request_id == request_id)
                yield from (output for output in finished if output.request_id == request_id)
        finally:
            self.engine.abort(request_id)  # nothing left to free once it finished

    def chat(self, conversations: list[list[dict]], params: SamplingParams | None = None) -> list[RequestOutput]:
        """Generate the assistant's reply to each conversation, rendered with the model's chat template."""
        return self.generate([self.tokenizer.chat_ids(messages) for messages in conversations], params)

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidValue("prompt", prompt[:40], "token ids (this engine has no tokenizer)")
            return self.tokenizer.encode(prompt)
        return list(prompt)
