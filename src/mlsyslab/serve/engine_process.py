"""The engine in a process of its own, as vLLM's EngineCore: model steps and the HTTP server never
share an interpreter.

Why a process and not a thread: a step is ~2,500 small torch calls (counted by `serve.twin`) that
hold the GIL between kernels, and the server's event loop needs the GIL for every streamed token.
In one process the two stall each other, and more intra-op threads make it worse: measured here (2 cores, bf16 SmolLM2-135M,
128-token prompts, 64 output tokens) the engine thread with 2 threads gave a 34 ms TPOT at 1 request
and 81 ms at 16 in flight, although the same engine alone steps in 15 ms and 30 ms. With the engine
in its own process the server's work runs beside it, not between its kernels.

Parent side (`EngineProcess`, used by `serve.server`): `submit` sends ("add", requests) down a pipe —
the choices and prompts of one API call, admitted all or none (`Engine.add_requests`) — and awaits
the child's answer (invalid input and a full queue come back as the same errors `Engine.add_request`
raises); a reader thread receives each step's deltas and finished outputs and hands them to the
call's one `asyncio.Queue`; a consumer that leaves early sends ("abort", id) for each unfinished one. Child
side (`run_engine`): apply every pending command, step while there is work, block on the pipe when
idle, and send one message per step with the engine's counters (`EngineStats`, read by /metrics).
The model reaches the child through torch's shared-memory pickling (no copy through the pipe), or as the
loaders that read it there; the child builds its own `Engine` (its prepacked weights, its KV pool). This process
imports no torch when it is given loaders, so the server's (the HTTP process) starts the child ~1.7 s sooner and its
own start-up (FastAPI, the tokenizer) leaves the cores to the child's: `mlsys serve` bf16 ready in 4.9-7.5 s (median
5.75) against 7.3-9.0 (8.3) when it imported torch, 8 starts each alternating (2-core AVX2 host, 2026-11-27); the
server's process is checked for torch in tests/serve/test_cli.py. Tested through the server in
tests/serve/test_server.py.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from mlsyslab import progress
from mlsyslab.errors import MlsysError
from mlsyslab.serve.output import Delta, RequestOutput
from mlsyslab.serve.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineStats:
    """What the engine's scheduler and pool hold after a step (or a command)."""

    waiting: int = 0
    running: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_cache_blocks: int = 0
    prefix_hit_rate: float = 0.0
    preemptions: int = 0
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    capacity_tokens: int = 0
    max_seq: int = 0
    draft_tokens: int = 0  # speculative decoding's draft tokens verified so far
    accepted_draft_tokens: int = 0  # ... and those kept

    @classmethod
    def of(cls, engine) -> EngineStats:
        scheduler, kv, radix = engine.scheduler, engine.kv, engine.scheduler.radix
        return cls(len(scheduler.waiting), len(scheduler.running), kv.num_used, kv.num_blocks,
                   radix.num_nodes if radix else 0, radix.hit_rate() if radix else 0.0, scheduler.preemptions,
                   engine.steps, engine.prefill_tokens, engine.decode_tokens, scheduler.capacity_tokens,
                   engine.model.config.max_seq, engine.draft_tokens, engine.accepted_draft_tokens)

    @property
    def idle(self) -> bool:
        return self.waiting == 0 and self.running == 0


class EngineProcess:
    """`async for item in await engine.submit([(id, prompt_ids, params), ...])`: the requests' Deltas as their
    tokens come, each one's RequestOutput when it ends."""

    def __init__(self, model, tokenizer, config, threads: int | None = None, on_finish=None,
                 start_timeout_s: float = 300.0):
        """Start the child; call `wait_started` before using the engine. model, tokenizer: the objects,
        or zero-argument picklable functions that load them (`nn.pretrained.loaders`), called in the
        child — so that it reads the weights and imports the tokenizer's libraries while this process
        does its own start-up."""
        context = multiprocessing.get_context("spawn")  # a loaded model pickles by torch's reductions (shared memory)
        child_commands, self.commands = context.Pipe(duplex=False)
        self.results, child_results = context.Pipe(duplex=False)
        self.on_finish = on_finish  # called in the reader thread with each RequestOutput (metrics)
        self.send_lock = threading.Lock()
        self.streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.admissions: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future, asyncio.Queue]] = {}
        self.checks: list[threading.Event] = []
        self.error: BaseException | None = None
        self.start_timeout_s = start_timeout_s
        shows_progress = logging.getLogger(progress.LOGGER).isEnabledFor(logging.INFO)  # as this process does
        self.process = context.Process(target=run_engine, name="mlsys-engine", daemon=True,
                                       args=(model, tokenizer, config, threads, child_commands, child_results,
                                             shows_progress))
        self.process.start()
        child_commands.close()
        child_results.close()

    def wait_started(self) -> None:
        """Block until the child has built its engine (raises if it failed or took too long)."""
        if not self.results.poll(self.start_timeout_s):
            self.process.kill()
            raise RuntimeError(f"the engine process did not start within {self.start_timeout_s:.0f} s")
        kind, payload = self.results.recv()
        if kind == "invalid":  # the model's files: an input error, named as in this process (exit 2, HTTP 4xx)
            self.process.join(5)
            raise payload
        if kind == "error":
            self.process.join(5)
            raise RuntimeError(f"the engine process failed to start: {payload}")
        self.stats: EngineStats = payload
        self.reader = threading.Thread(target=self.read, name="mlsys-engine-reader", daemon=True)
        self.reader.start()

    @property
    def healthy(self) -> bool:
        return self.process.is_alive() and self.error is None

    def send(self, *message) -> None:
        with self.send_lock:
            self.commands.send(message)

    async def submit(self, requests: list[tuple[str, list[int], SamplingParams]]
                     ) -> AsyncIterator[Delta | RequestOutput]:
        """Admit (request_id, prompt_ids, params) requests, all or none (raising InvalidValue / QueueFull before
        anything runs), and return their merged stream: Deltas as tokens come, each request's RequestOutput when
        it ends, the stream's end after the last. Leaving the stream early aborts the unfinished ones."""
        if not self.healthy:
            raise RuntimeError(f"engine is not running: {self.error!r}")
        loop = asyncio.get_running_loop()
        admitted, stream = loop.create_future(), asyncio.Queue()
        request_ids = [request_id for request_id, _, _ in requests]
        self.admissions[request_ids[0]] = (loop, admitted, stream)
        self.send("add", requests)
        try:
            await admitted
        except asyncio.CancelledError:
            for request_id in request_ids:  # queued after the add: admitted, then aborted at once
                self.abort(request_id)
            raise
        return self.stream(request_ids, stream)

    async def stream(self, request_ids: list[str], stream: asyncio.Queue) -> AsyncIterator[Delta | RequestOutput]:
        unfinished = set(request_ids)
        try:
            while unfinished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, RequestOutput):
                    unfinished.discard(item.request_id)
                yield item
        finally:
            for request_id in unfinished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        if self.healthy:
            self.send("abort", request_id)

    def check(self, timeout_s: float = 30.0) -> EngineStats:
        """Ask the child to verify its block pool (`Engine.check`); raises if a block leaked; the stats."""
        done = threading.Event()
        self.checks.append(done)
        self.send("check")
        if not done.wait(timeout_s):
            raise TimeoutError("the engine process did not answer a check")
        if self.error is not None:
            raise RuntimeError(f"engine check failed: {self.error}")
        return self.stats

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.process.is_alive():
            try:
                self.send("stop")
            except OSError:
                pass
            self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.reader.join(timeout_s)

    def read(self) -> None:
        """The reader thread: every message from the child, in order, to the streams it belongs to."""
        try:
            while True:
                kind, *payload = self.results.recv()
                if kind == "admitted":
                    self.admitted(*payload)
                elif kind == "step":
                    deltas, finished, self.stats = payload
                    self.post_many(deltas)
                    for output in finished:
                        self.finish(output)
                elif kind == "aborted":
                    output, self.stats = payload
                    self.finish(output)
                elif kind == "checked":
                    error, self.stats = payload
                    self.error = self.error or error
                    self.checks.pop(0).set()
                elif kind == "error":
                    raise RuntimeError(payload[0])
                elif kind == "stopped":
                    return
        except (EOFError, OSError, RuntimeError) as error:  # the child died or failed: fail every stream
            self.error = error if isinstance(error, RuntimeError) else RuntimeError("the engine process exited")
            for request_id in list(self.streams):
                self.post(request_id, RuntimeError(f"engine failed: {self.error}"))
            for loop, future, _ in self.admissions.values():
                loop.call_soon_threadsafe(settle, future, self.error)
            for done in self.checks:
                done.set()

    def admitted(self, request_ids: list[str], error: BaseException | None) -> None:
        loop, future, stream = self.admissions.pop(request_ids[0])
        if error is None:
            for request_id in request_ids:
                self.streams[request_id] = (loop, stream)
        loop.call_soon_threadsafe(settle, future, error)

    def post_many(self, deltas: list[Delta]) -> None:
        """A step's deltas, handed to each event loop in one wake-up (not one per token)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for delta in deltas:
            if delta.request_id in self.streams:
                loop, stream = self.streams[delta.request_id]
                by_loop.setdefault(loop, []).append((stream, delta))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(put_all, items)

    def post(self, request_id: str, item) -> None:
        if request_id in self.streams:
            loop, stream = self.streams[request_id]
            loop.call_soon_threadsafe(stream.put_nowait, item)

    def finish(self, output: RequestOutput) -> None:
        self.post(output.request_id, output)
        self.streams.pop(output.request_id, None)
        if self.on_finish is not None:
            self.on_finish(output)


def run_engine(model, tokenizer, config, threads: int | None, commands, results, shows_progress: bool) -> None:
    """The child: build the engine (its first-time notices on stderr if the parent prints them), then apply
    commands and step until told to stop."""
    import torch

    from mlsyslab.comm import heap
    from mlsyslab.serve.engine import Engine

    if shows_progress:
        progress.show()
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        model = model if isinstance(model, torch.nn.Module) else model()
        tokenizer = tokenizer() if callable(tokenizer) else tokenizer
        engine = Engine(model, tokenizer, config, keep_source=False)  # no one here trains it: one copy of its matrices
        del model
    except MlsysError as error:
        results.send(("invalid", error))
        return
    except BaseException as error:
        results.send(("error", f"{type(error).__name__}: {error}"))
        raise
    results.send(("ready", EngineStats.of(engine)))
    heap.return_freed_memory()  # the serving copies' temporaries, once the server is up (0.3-0.6 s here)
    try:
        while True:
            if not engine.has_work():
                commands.poll(None)  # idle: sleep until a command comes
            while commands.poll():
                kind, *payload = commands.recv()
                if kind == "stop":
                    results.send(("stopped",))
                    return
                apply(engine, kind, payload, results)
            if engine.has_work():
                deltas, finished = engine.step()
                results.send(("step", deltas, finished, EngineStats.of(engine)))
    except (EOFError, BrokenPipeError):  # the parent is gone (killed, or SIGTERM's default action): stop quietly
        return
    except BaseException as error:  # a bug in a step: tell the parent, which fails every stream
        results.send(("error", f"{type(error).__name__}: {error}"))
        raise


def apply(engine, kind: str, payload: list, results) -> None:
    if kind == "add":
        requests = payload[0]
        request_ids = [request_id for request_id, _, _ in requests]
        try:
            engine.add_requests(requests)
        except Exception as error:  # noqa: BLE001 - any admission error goes back to the caller
            results.send(("admitted", request_ids, error))
            return
        results.send(("admitted", request_ids, None))
    elif kind == "abort":
        output = engine.abort(payload[0])
        if output is not None:
            results.send(("aborted", output, EngineStats.of(engine)))
    elif kind == "check":
        try:
            engine.check()
            error = None
        except Exception as failure:  # noqa: BLE001 - reported to the parent, which raises it
            error = RuntimeError(f"{type(failure).__name__}: {failure}")
        results.send(("checked", error, EngineStats.of(engine)))


def put_all(items: list[tuple[asyncio.Queue, Delta]]) -> None:
    for stream, delta in items:
        stream.put_nowait(delta)


def settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():  # the caller was cancelled while waiting
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
