"""`mlsys train`: bad input is refused before any rank starts; a run killed with SIGKILL resumes
from its last checkpoint and reproduces the uninterrupted run's losses bitwise; the final report
holds model-state and wire bytes equal to predict's."""

import contextlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
import torch

from mlsyslab.cli.main import main
from mlsyslab.errors import InvalidValue
from mlsyslab.train.trainer import TrainConfig
from mlsyslab.verify.training import compare_mesh_training
from tests.cli.test_cli import run

TINY = """name: llama-tiny
source: test config
family: llama
hidden: 32
layers: 2
heads: 4
kv_heads: 2
ffn_hidden: 64
vocab: 49152
tied_embeddings: true
max_seq: 128
published_params: 1.6e6
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("spec") / "tiny.yaml"
    path.write_text(TINY)
    return path


MOE = TINY.replace("name: llama-tiny", "name: llama-tiny-moe") + "moe:\n  experts: 4\n  experts_per_token: 2\n  expert_ffn_hidden: 32\n"


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    """The tiny model with 4 experts, top-2, in every layer."""
    path = tmp_path_factory.mktemp("spec") / "moe.yaml"
    path.write_text(MOE)
    return path


@pytest.fixture(scope="module")
def moe_ddp_losses(moe):
    """The MoE model's first 3 losses on 2 ranks under DDP, every rank holding every expert."""
    return _train_json(moe, "--steps", "3")["result"]["losses"]


def mlsys(*args, **kwargs):
    return subprocess.run([sys.executable, "-m", "mlsyslab", *args], capture_output=True, text=True, timeout=300, **kwargs)


@pytest.mark.parametrize("args, field", [
    (["--nproc", "3", "--global-batch", "8"], "global_batch"),
    (["--strategy", "zero4"], "strategy"),
    (["--offload"], "offload"),
    (["--nproc", "16", "--global-batch", "8"], "nproc"),
    (["--resume"], "resume"),
    (["--tp", "3"], "nproc"),  # dp, not given, takes the ranks TP leaves: none (it named "layout" dp1·tp3=3)
    (["--tp", "2", "--nproc", "4", "--dp", "1"], "layout"),
    (["--pp", "2", "--global-batch", "1"], "microbatches"),  # fewer sequences than stages
    (["--ep", "2"], "ep"),  # a dense model has no experts to split
    (["--pp", "2", "--schedule", "pipedream"], "schedule"),
    (["--pp", "2", "--interleave", "2"], "interleave"),
    (["--pp", "2", "--microbatches", "3"], "microbatches"),
    (["--dp", "1"], "dp"),
    (["--sequence-parallel"], "sequence_parallel"),  # no TP
    (["--tp", "2", "--seq", "33", "--sequence-parallel"], "sequence_parallel"),  # 33 tokens do not split over TP 2
    (["--timeline", "timeline.png"], "timeline"),  # no pipeline to draw
    (["--pp", "2", "--timeline", "timeline.svg"], "timeline"),
    (["--lr", "-1"], "lr"), (["--lr", "nan"], "lr"), (["--lr-schedule", "linear"], "lr_schedule"),
    (["--steps", "10", "--warmup-steps", "11"], "warmup_steps"), (["--min-lr-ratio", "2"], "min_lr_ratio"),
    (["--clip-grad-norm", "-1"], "clip_grad_norm"),
    # found by a sweep (2026-11-27): tracebacks before launch, ignored options, a wrong field named
    (["--tp", "0"], "tp"), (["--dp", "0"], "dp"), (["--global-batch", "-8"], "global-batch"),
    (["--micro-batch", "0"], "micro-batch"), (["--micro-batch", "2", "--microbatches", "4"], "microbatches"),
    (["--checkpoint-every", "1"], "checkpoint_every"),  # no --checkpoint-dir: nothing was written
    (["--schedule", "gpipe"], "schedule"),  # no pipeline: it was ignored
    (["--steps", "-1"], "steps"),  # named warmup_steps
    (["--lr-schedule", "cosine", "--steps", "2", "--warmup-steps", "2"], "warmup_steps"),  # never decays
    (["--pp", "2", "--timeline", "/proc/timeline.png"], "timeline"),  # failed in the ranks after training
    (["--hardware", "a100", "--hardware-spec", "hw.yaml"], "--hardware"),  # the spec won silently
    (["--checkpoint-every", "-1"], "checkpoint_every"),
    (["--schedule", "bogus"], "schedule"),  # without --pp too
    (["--schedule", "interleaved", "--interleave", "2"], "interleave"),  # no pipeline to interleave
    (["--nnodes", "0"], "nnodes"), (["--nnodes", "2", "--node-rank", "2"], "node_rank"),
    (["--master-port", "99999"], "master_port"),
    (["--checkpoint-dir", "/proc/mlsys-checkpoints"], "checkpoint_dir"),  # cannot be created
])
def test_bad_input_is_refused_before_launch(tiny, args, field, capsys, monkeypatch):
    """In process (`mlsys`'s own entry point): a refusal that failed would launch torchrun and take seconds."""
    started = time.perf_counter()
    code, _, err = run(capsys, monkeypatch, "train", "--model-spec", str(tiny), *args)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and field in lines[0] and "torchrun" not in err
    assert time.perf_counter() - started < 5


def test_resume_from_a_damaged_checkpoint(tiny, tmp_path, capsys, monkeypatch):
    """A checkpoint directory without dcp's metadata, or whose metadata does not load, is refused before launch
    (exit 2; the second failed in the ranks, exit 1, before its metadata was read up front)."""
    damaged = tmp_path / "step_00000002"
    damaged.mkdir()
    args = ("train", "--model-spec", str(tiny), "--checkpoint-dir", str(tmp_path), "--resume")
    code, _, err = run(capsys, monkeypatch, *args)
    assert code == 2 and "checkpoint_dir" in err and ".metadata" in err
    (damaged / ".metadata").write_bytes(b"not a checkpoint")
    code, _, err = run(capsys, monkeypatch, *args)
    assert code == 2 and "checkpoint_dir" in err and ".metadata reads" in err


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_with_a_shard_missing_or_cut_short_is_refused(tmp_path):
    """Every file dcp's metadata lists must be there, as long as it says (a lost or truncated shard failed in the
    ranks after launch, with a traceback per rank)."""
    import torch.distributed.checkpoint as dcp

    from mlsyslab.train import checkpoint

    dcp.save({"weight": torch.arange(1000.0)}, checkpoint_id=str(tmp_path), no_dist=True)
    checkpoint.check_complete(tmp_path)  # whole
    shard = next(tmp_path.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(InvalidValue, match="cut short"):
        checkpoint.check_complete(tmp_path)
    shard.unlink()
    with pytest.raises(InvalidValue, match=shard.name):
        checkpoint.check_complete(tmp_path)


def test_two_nodes_train_as_one_process(tiny, single_process_losses):
    """`--nnodes 2` as on a cluster, both "nodes" on this machine (torchrun's static rendezvous at --master-addr): node
    0 reports one process's losses (data parallelism over the two nodes' ranks); node 1 says its ranks finished."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    args = ["train", "--model-spec", str(tiny), "--steps", "3", "--seq", "32", "--global-batch", "4", "--nproc", "1",
            "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", port, "--json"]
    second = subprocess.Popen([sys.executable, "-m", "mlsyslab", *args, "--node-rank", "1"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    first = mlsys(*args, "--node-rank", "0")
    out, err = second.communicate(timeout=300)
    assert first.returncode == 0, first.stderr
    assert second.returncode == 0 and out == "" and "node 1 of 2: its ranks finished" in err, err
    assert json.loads(first.stdout)["result"]["losses"] == pytest.approx(single_process_losses, rel=1e-5)


def test_cosine_schedule_with_warmup_is_the_formula():
    config = TrainConfig(model={}, steps=10, lr=1e-3, lr_schedule="cosine", warmup_steps=2, min_lr_ratio=0.1)
    lrs = [config.lr_at(step) for step in range(10)]
    assert lrs[:3] == pytest.approx([5e-4, 1e-3, 1e-3]) and lrs[-1] == pytest.approx(1e-4)
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:]))  # decays after the warmup
    halfway = TrainConfig(model={}, steps=11, lr=1e-3, lr_schedule="cosine", min_lr_ratio=0.0).lr_at(5)
    assert halfway == pytest.approx(5e-4)  # cos(pi/2): half the way down
    assert TrainConfig(model={}, steps=4, lr=1e-3, warmup_steps=4).lr_at(3) == 1e-3  # constant once warm


SCHEDULE = ("--steps", "4", "--lr", "3e-4", "--lr-schedule", "cosine", "--warmup-steps", "2")  # the default peak


@pytest.fixture(scope="module")
def scheduled(tiny):
    """One process's run under a warmed-up cosine schedule."""
    return _train_json(tiny, "--nproc", "1", *SCHEDULE)["result"]


def test_the_schedule_sets_each_steps_learning_rate(scheduled, single_process_losses):
    """Each step's learning rate is the schedule's, on the optimizer: the losses follow the default constant rate's
    (the peak here) for the first step and leave it from the second (the first update was at half the rate)."""
    assert scheduled["lrs"] == pytest.approx([1.5e-4, 3e-4, 3e-4, 3e-5])
    assert scheduled["losses"][0] == single_process_losses[0] and scheduled["losses"][1] != single_process_losses[1]


@pytest.mark.slow  # CI time: the data-parallel trainer's path is the one-process run's
def test_the_schedule_is_the_same_under_ddp_and_on_a_mesh(tiny, scheduled):
    for layout in ((), ("--tp", "2")):
        run = _train_json(tiny, *layout, *SCHEDULE)["result"]
        assert run["lrs"] == scheduled["lrs"] and run["losses"] == pytest.approx(scheduled["losses"], rel=1e-5), layout


@pytest.mark.slow  # CI time: the mechanisms against torch's clipping are in tests/parallel/test_zero.py and test_mesh.py
def test_clipping_under_zero_and_on_a_mesh_follows_one_process_and_its_norm_goes_on_the_wire(tiny):
    """--clip-grad-norm: one process clips with torch's clip_grad_norm_, ZeRO-2 from its shards and TP 2 from its
    pieces (one all-reduce of the squared norm, in the wire table as predict counts it); all report each step's norm
    and the same losses."""
    clip = ("--steps", "3", "--lr", "1e-2", "--clip-grad-norm", "0.5")
    single = _train_json(tiny, "--nproc", "1", *clip)["result"]
    assert min(single["grad_norms"]) > 0.5  # every step clipped
    for layout, op in ((("--strategy", "zero2"), "all_reduce"), (("--tp", "2"), "gradient_norm")):
        run = _train_json(tiny, *layout, *clip)
        # torch's clip_grad_norm_ takes each tensor's norm with vector_norm in fp32, which over millions of elements
        # is off by up to ~5e-5 (a sum of squares is within 1e-8 here): the norms agree to that, not to the float
        assert run["result"]["grad_norms"] == pytest.approx(single["grad_norms"], rel=1e-4), layout
        assert run["result"]["losses"] == pytest.approx(single["losses"], rel=1e-5), layout
        norm = run["predicted_vs_measured"]["wire_bytes_per_step"][op]
        assert norm["measured"] == norm["predicted"] == 4, layout  # one fp32, ring all-reduce over 2 ranks


@pytest.mark.slow
def test_a_scheduled_run_resumes_where_its_schedule_was(tiny, tmp_path):
    whole = _train_json(tiny, *SCHEDULE, "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "2")["result"]
    shutil.rmtree(tmp_path / "step_00000004")
    resumed = _train_json(tiny, *SCHEDULE, "--checkpoint-dir", str(tmp_path), "--resume")["result"]
    assert resumed["first_step"] == 2 and resumed["lrs"] == whole["lrs"][2:] and resumed["losses"] == whole["losses"][2:]


def test_llama_catalog_model_that_nn_cannot_build_is_refused(capsys, monkeypatch):
    code, _, err = run(capsys, monkeypatch, "train", "--model", "gpt2")
    assert code == 2 and "norm" in err


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun starts its ranks in sessions of their own)."""
    children: dict = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, frontier = [], [pid]
    while frontier:
        for child in children.get(frontier.pop(), []):
            found.append(child)
            frontier.append(child)
    return found


def _train_json(tiny, *args):
    """`mlsys train --json` run in this process: its ranks are processes of their own as ever, forked from this
    process's fork server (already running, with torch imported, after the earlier tests), and the command's own
    imports are already here. Its stderr goes to pytest's capture, shown when a test fails."""
    report = io.StringIO()
    argv = ["mlsys", "train", "--model-spec", str(tiny), "--nproc", "2", "--global-batch", "4", "--seq", "32", "--json",
            *args]
    with mock.patch.object(sys, "argv", argv), contextlib.redirect_stdout(report):
        try:
            main()
        except SystemExit as done:
            assert not done.code, f"mlsys train exited {done.code}: its stderr is in the captured output"
    return json.loads(report.getvalue())


def test_sigkill_then_resume_reproduces_the_losses_bitwise(tiny, tmp_path, capfd, monkeypatch):
    steps = "8"
    reference = _train_json(tiny, "--strategy", "zero2", "--steps", steps)["result"]["losses"]
    directory = tmp_path / "checkpoints"
    command = [sys.executable, "-m", "mlsyslab", "train", "--model-spec", str(tiny), "--nproc", "2", "--global-batch",
               "4", "--seq", "32", "--strategy", "zero2", "--steps", steps, "--checkpoint-dir", str(directory),
               "--checkpoint-every", "2", "--json"]
    killed = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                              env={**os.environ, "TMPDIR": str(tmp_path)})  # its temporary files outlive SIGKILL
    deadline = time.time() + 240
    while time.time() < deadline and not (directory / "step_00000004").is_dir() and killed.poll() is None:
        time.sleep(0.05)
    for pid in [killed.pid, *_descendants(killed.pid)]:  # the launcher and every rank, mid-training
        os.kill(pid, signal.SIGKILL)
    killed.wait()
    completed = sorted(p.name for p in directory.glob("step_*") if not p.name.endswith(".partial"))
    assert completed and completed[-1] != "step_00000008", completed  # really killed before the end
    code, _, err = run(capfd, monkeypatch, *command[3:-1], "--strategy", "ddp", "--resume")  # it keeps ZeRO-2's shards
    assert code == 2 and "resume=\"strategy='ddp'\"" in err and "'zero2'" in err, err
    resumed = _train_json(tiny, "--strategy", "zero2", "--steps", steps, "--checkpoint-dir", str(directory), "--resume")
    first = resumed["result"]["first_step"]
    assert 0 < first < 8
    assert resumed["result"]["losses"] == reference[first:]  # bitwise: same floats


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_a_stopped_train_leaves_no_rank_running(tiny, tmp_path, signum):
    """A signal to `mlsys train` alone, mid-run (`timeout` and job schedulers send SIGTERM): every rank, and the
    server they are forked from, stop with it. Under SIGTERM torchrun's agent stops the ranks, exit 128 + 15; under
    SIGKILL no handler runs: the server sees `mlsys` gone and exits, and the ranks' parent-death signal stops them."""
    command = [sys.executable, "-m", "mlsyslab", "train", "--model-spec", str(tiny), "--nproc", "2", "--global-batch",
               "4", "--seq", "32", "--steps", "1000000"]
    run = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "TMPDIR": str(tmp_path)}, start_new_session=True)
    deadline, ranks = time.time() + 240, []
    try:
        while time.time() < deadline and len(ranks) < 2 and run.poll() is None:
            time.sleep(0.2)
            servers = [p for p in _descendants(run.pid) if b"multiprocessing.forkserver" in _cmdline(p)]
            # forks of the server that imported torch (not whatever a rank may start: those run other commands)
            ranks = [p for server in servers for p in _descendants(server) if p in servers]
        assert len(ranks) == 2, run.stderr.read() if run.poll() is not None else f"ranks found: {ranks}"
    except BaseException:  # a million-step run must not outlive a failed check
        for pid in [*_descendants(run.pid), run.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        raise
    everything = _descendants(run.pid)
    os.kill(run.pid, signum)
    code = run.wait(timeout=120)
    deadline = time.time() + 60
    while time.time() < deadline and [p for p in everything if _cmdline(p)]:
        time.sleep(0.2)
    assert not [p for p in everything if _cmdline(p)], "a rank or its server outlived mlsys train"
    if signum == signal.SIGTERM:
        assert code == 128 + signal.SIGTERM and "stopped by SIGTERM" in run.stderr.read()
        assert not list(tmp_path.glob("mlsys-ranks-*"))  # the directory of the ranks' errors removed


def _cmdline(pid: int) -> bytes:
    """The process's command line; empty once it has exited (or is a zombie)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


@pytest.mark.parametrize("layout", [["--nproc", "2", "--pp", "2", "--strategy", "zero3"],  # CI time: 2 ranks
                                    pytest.param(["--nproc", "4", "--pp", "2", "--tp", "2", "--dp", "1"],
                                                 marks=pytest.mark.slow)])
def test_mesh_checkpoint_resumes_bitwise(tiny, tmp_path, layout, capfd, monkeypatch):
    """On a device mesh every rank saves its own stages, shards and optimizer state (ZeRO-3's on PP2;
    plain AdamW's on PP2 × TP2 with -m slow): a run resumed from step 2 of 4 gives the uninterrupted
    run's last two losses, bitwise. (Leaving out ZeRO's optimizer state makes the 4th differ.) A ZeRO-3
    checkpoint from before the mesh gathered a layer a unit (its run.json without `zero3_unit`) is refused
    before launch, by name."""
    directory = tmp_path / "checkpoints"
    args = ("--global-batch", "8", "--micro-batch", "1", *layout, "--steps", "4",
            "--checkpoint-dir", str(directory), "--checkpoint-every", "2")
    reference = _train_json(tiny, *args)["result"]["losses"]
    shutil.rmtree(directory / "step_00000004")  # as if killed between the two checkpoints
    resumed = _train_json(tiny, *args, "--resume")["result"]
    assert resumed["first_step"] == 2 and resumed["losses"] == reference[2:]
    if "zero3" in layout:
        written = directory / "step_00000004" / "run.json"
        fields = json.loads(written.read_text())
        assert fields.pop("zero3_unit") == "decoder layer"
        written.write_text(json.dumps(fields))
        code, _, err = run(capfd, monkeypatch, "train", "--model-spec", str(tiny), *args, "--resume")
        assert code == 2 and "zero3_unit" in err and "step_00000004" in err, err
    if "--tp" in layout:  # -m slow: resumed at the last step, nothing runs, and it says so (once silently no timeline)
        again = mlsys("train", "--model-spec", str(tiny), "--nproc", "2", "--global-batch", "4", "--seq", "32", *args,
                      "--resume", "--timeline", str(tmp_path / "timeline.png"))
        assert again.returncode == 0 and "nothing to do" in again.stdout and "no timeline written" in again.stdout, \
            again.stdout + again.stderr


@pytest.mark.parametrize("strategy, extra", [  # CI time: DDP's and ZeRO-1's bytes also in tests/parallel/
    pytest.param("ddp", [], marks=pytest.mark.slow), pytest.param("zero1", [], marks=pytest.mark.slow),
    pytest.param("ddp", ["--bf16"], marks=pytest.mark.slow),  # bf16 moments, no master (once predicted as ZeRO's)
    ("zero3", ["--offload"]), ("zero2", ["--bf16"])])
def test_report_holds_states_and_wire_equal_to_predict(tiny, strategy, extra):
    report = _train_json(tiny, "--strategy", strategy, "--steps", "2", *extra)["predicted_vs_measured"]
    for category in ("weights", "gradients", "optimizer", "host_offload"):
        pair = report["memory_bytes"][category]
        assert pair["measured"] == pair["predicted"], (category, pair)
    held = report["memory_bytes"]["activations"]  # what nn/ saves, to the byte (ZeRO-3's units count theirs too)
    assert held["measured"] == held["predicted"], held
    for op, pair in report["wire_bytes_per_step"].items():
        assert pair["measured"] == pytest.approx(pair["predicted"]), (op, pair)
    assert report["step_s"]["measured"] > 0


@pytest.fixture(scope="module")
def single_process_losses(tiny):
    """The tiny model's first 3 losses on one process: the reference of the mesh runs."""
    return _train_json(tiny, "--nproc", "1", "--steps", "3")["result"]["losses"]


def assert_states_are_predicted(report: dict) -> None:
    """Rank 0 of a mesh run, and the rank holding the most (the planner's memory per GPU prices predict's heaviest),
    hold the parameters predict counts after TP, PP and EP, and the weights, gradients, optimizer state and
    host-offloaded bytes predict states for them, to the byte."""
    comparison = report["predicted_vs_measured"]
    for held in (comparison, comparison["heaviest_rank"]):
        assert held["parameters"]["measured"] == held["parameters"]["predicted"], held["parameters"]
        for category in ("weights", "gradients", "optimizer", "host_offload"):
            pair = held["memory_bytes"][category]
            assert pair["measured"] == pair["predicted"], (category, pair)
        assert held["memory_bytes"]["weights"]["measured"] > 0


def assert_stage_activations_are_predicted(report: dict) -> None:
    """Under PP, the stage holding the most activations at once (measured on every rank: here the last, whose loss
    keeps fp32 log-probabilities of the whole vocabulary) holds what predict counts for it through its own order of
    actions, to the byte."""
    most = report["predicted_vs_measured"]["heaviest_activations"]
    assert most["measured"] == most["predicted"] and most["stage"] == most["predicted_stage"], most


@pytest.mark.parametrize("layouts", [
    # (TP 2 with sequence parallelism: the Qwen runs below, through the pipeline, and beside ZeRO-3)
    pytest.param([["--tp", "2"], ["--pp", "2", "--microbatches", "4", "--timeline"], ["--cp", "2"]], id="2-ranks"),
    pytest.param([["--nproc", "4", "--cp", "2", "--tp", "2", "--sequence-parallel"],  # CI time: the same compositions'
                  ["--nproc", "4", "--cp", "2", "--pp", "2", "--microbatches", "4", "--timeline"]],  # losses are also
                 marks=pytest.mark.slow, id="4-ranks"),  # in tests/parallel/test_mesh.py
])
def test_mesh_training_follows_the_single_process_run_and_predicted_bytes(tiny, single_process_losses, tmp_path, layouts):
    """--tp 2, --pp 2 (tied embeddings across the stages), --cp 2, and (-m slow) --cp 2 with --tp 2 and sequence
    parallelism or with --pp 2 reproduce one process's losses; TP (with SP, the norms' summed gradients too), PP and
    CP bytes on the wire equal the prediction, and PP reports its executed bubble (and, below it, the schedule's at
    the executed actions' times) and draws it."""
    reference = single_process_losses
    chart = tmp_path / "timeline.png"
    for layout in layouts:
        args = layout + [str(chart)] if layout[-1] == "--timeline" else layout
        report = _train_json(tiny, "--steps", "3", *args)
        assert report["result"]["losses"] == pytest.approx(reference, rel=1e-5), args
        wire = report["predicted_vs_measured"]["wire_bytes_per_step"]
        if "--tp" in args:
            assert wire["tensor_parallel"]["measured"] == pytest.approx(wire["tensor_parallel"]["predicted"])
        if "--pp" in args:
            assert wire["pipeline_p2p"]["measured"] == pytest.approx(wire["pipeline_p2p"]["predicted"])
            bubble = report["predicted_vs_measured"]["bubble"]
            assert bubble["predicted"] == pytest.approx(1 / 5) and 0 < bubble["measured"] < 1
            # the last stage also computes the 49,152-word head: simulated on the split's costs, a larger bubble
            assert report["predicted_vs_measured"]["bubble_on_split"]["predicted"] > 0.3
            # the schedule at the step's own action times leaves the waits for data out: never above the executed
            replayed = report["predicted_vs_measured"]["bubble_replayed"]
            assert 0 < replayed["predicted"] <= replayed["measured"] + 1e-9 and replayed["measured"] == bubble["measured"]
            assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and chart.stat().st_size > 5000
            layers = report["predicted_vs_measured"]["stage_layers"]  # predict splits as the pipeline does
            assert layers["measured"] == layers["predicted"], layers
            assert_stage_activations_are_predicted(report)
        if "--cp" in args:  # K/V around the ring and the weights' gradients summed over the CP group
            assert wire["context_parallel"]["measured"] == pytest.approx(wire["context_parallel"]["predicted"])
        activations = report["predicted_vs_measured"]["memory_bytes"]["activations"]  # what nn/ saves, to the byte
        assert activations["measured"] == activations["predicted"], (args, activations)
        assert_states_are_predicted(report)  # PP: only the rank's own stage (the rest once stayed on every rank)


@pytest.mark.parametrize("family", [pytest.param("qkv_bias", marks=pytest.mark.slow), "qk_norm"])  # CI time
def test_qwen_models_train_under_tensor_parallelism_as_on_one_process(tmp_path, family):
    """A Qwen2-shaped model (biases on Q, K and V) and a Qwen3-shaped one (query and key head norms) under TP 2 with
    sequence parallelism: one process's losses, the parameters and bytes rank 0 holds (predict once split the head
    norms over TP too), and TP bytes equal to predict's (Qwen3's: each microbatch's backward
    sums the head norms' gradients over TP, besides SP's norms)."""
    spec = tmp_path / "qwen.yaml"
    spec.write_text(TINY.replace("family: llama", "family: qwen") + f"{family}: true\n")
    reference = _train_json(spec, "--nproc", "1", "--steps", "3")["result"]["losses"]
    report = _train_json(spec, "--steps", "3", "--tp", "2", "--sequence-parallel")
    assert report["result"]["losses"] == pytest.approx(reference, rel=1e-5)
    assert_states_are_predicted(report)  # the biases split with their heads, the head norms whole on each rank
    wire = report["predicted_vs_measured"]["wire_bytes_per_step"]["tensor_parallel"]
    assert wire["measured"] == pytest.approx(wire["predicted"])


def test_sequence_parallel_through_the_pipeline(tiny, single_process_losses):
    """TP 2 × PP 2 with sequence parallelism: activations cross the pipeline as [b, s/2, h] and rope still sees
    every position; the losses are one process's, and rank 0's TP bytes (its stage's layers, the entries' regathers
    in backward, its norms' summed gradients) and pipeline bytes are predict's; it holds the activations predict
    says (each entry keeps only its shard of the gathered input), less than predict says without SP."""
    layout = ("--nproc", "4", "--tp", "2", "--pp", "2", "--dp", "1", "--microbatches", "2", "--steps", "3")
    report = _train_json(tiny, *layout, "--sequence-parallel")
    assert report["result"]["losses"] == pytest.approx(single_process_losses, rel=1e-5)
    layers = report["predicted_vs_measured"]["stage_layers"]
    assert layers["measured"] == layers["predicted"], layers
    for name in ("tensor_parallel", "pipeline_p2p"):
        pair = report["predicted_vs_measured"]["wire_bytes_per_step"][name]
        assert pair["measured"] == pytest.approx(pair["predicted"]), (name, pair)
    held = report["predicted_vs_measured"]["memory_bytes"]["activations"]
    assert held["measured"] == held["predicted"], held
    assert_states_are_predicted(report)  # its stage's layers and the embedding, each split over TP
    assert_stage_activations_are_predicted(report)  # the last stage's head input: its shard under SP
    without = TrainConfig(**{**report["config"], "sequence_parallel": False})  # predicted as measured in the 2-rank runs
    assert held["measured"] < 0.85 * compare_mesh_training(without, report["result"])["memory_bytes"]["activations"]["predicted"]


def test_clipping_under_pipedream_is_refused_before_launch(untied, capsys, monkeypatch):
    """Its stages step after every microbatch's backward: there is no whole-step gradient to clip."""
    code, _, err = run(capsys, monkeypatch, "train", "--model-spec", str(untied), "--pp", "2", "--schedule", "pipedream",
                       "--clip-grad-norm", "1")
    assert code == 2 and "clip_grad_norm" in err and "pipedream" in err
    code, _, err = run(capsys, monkeypatch, "train", "--model-spec", str(untied), "--pp", "2", "--schedule", "pipedream",
                       "--steps", "0")
    assert code == 2 and "steps" in err  # the same run without clipping passes that check (and stops at the next)


def test_pipeline_schedules_hold_the_activations_predict_says(untied, tmp_path):
    """The first stage's activations held at once, measured from what autograd saves: GPipe keeps all m = 4
    microbatches, 1F1B p = 2 of them — exactly twice the bytes — and each as predict.memory states it, to the byte;
    interleaved too, where the cost-balanced split leaves rank 0's two chunks unequal (8 layers and a large output
    layer: 2 + 3 of its 5), which the twin follows through rank 0's order."""
    held = {}
    for schedule in ("gpipe", "1f1b"):
        report = _train_json(untied, "--pp", "2", "--microbatches", "4", "--schedule", schedule, "--steps", "2")
        held[schedule] = report["predicted_vs_measured"]["memory_bytes"]["activations"]
        assert held[schedule]["measured"] == held[schedule]["predicted"], (schedule, held[schedule])
        assert_stage_activations_are_predicted(report)
    assert held["gpipe"]["measured"] == pytest.approx(2 * held["1f1b"]["measured"], rel=0.01)
    assert held["gpipe"]["predicted"] == pytest.approx(2 * held["1f1b"]["predicted"])
    eight = tmp_path / "eight.yaml"
    eight.write_text(untied.read_text().replace("layers: 2", "layers: 8"))
    report = _train_json(eight, "--pp", "2", "--microbatches", "4", "--schedule", "interleaved", "--interleave", "2",
                         "--steps", "1")
    assert report["predicted_vs_measured"]["stage_layers"]["measured"] == 5
    interleaved = report["predicted_vs_measured"]["memory_bytes"]["activations"]
    assert interleaved["measured"] == interleaved["predicted"], interleaved
    assert_stage_activations_are_predicted(report)


@pytest.fixture(scope="module")
def untied(tmp_path_factory) -> Path:
    """The tiny model with its own output layer: PipeDream cannot keep a tied embedding's two copies in step."""
    path = tmp_path_factory.mktemp("spec") / "untied.yaml"
    path.write_text(TINY.replace("tied_embeddings: true", "tied_embeddings: false"))
    return path


def test_pipedream_updates_after_every_backward_and_resumes_bitwise(untied, tmp_path):
    """--schedule pipedream: with updates the first step's loss already moves from the same run's at lr 0 (later
    microbatches run on weights updated within the step, which a flushed schedule never does); its pipeline bytes are
    predict's; a run resumed from step 2 of 4 gives the uninterrupted run's last two losses, bitwise (the stashes are
    empty at a step's end). The stashed weights against a one-process replay: tests/parallel/test_pipeline.py."""
    pipeline = ("--pp", "2", "--microbatches", "4", "--steps", "4")
    frozen = _train_json(untied, *pipeline, "--schedule", "pipedream", "--lr", "0")["result"]["losses"]
    directory = tmp_path / "checkpoints"
    args = (*pipeline, "--schedule", "pipedream", "--lr", "1e-2", "--checkpoint-dir", str(directory),
            "--checkpoint-every", "2")
    trace = tmp_path / "pipedream.json"
    report = _train_json(untied, *args, "--timeline", str(trace))
    events = json.loads(trace.read_text())["traceEvents"]  # the last step: each stage's 4 forwards and 4 backwards
    for stage in (0, 1):
        assert sorted(e["name"] for e in events if e["tid"] == stage) == sorted(f"{k}{i}" for k in "FB" for i in range(4))
    losses = report["result"]["losses"]
    assert losses[0] != pytest.approx(frozen[0], rel=1e-4) and losses[-1] < frozen[-1]
    wire = report["predicted_vs_measured"]["wire_bytes_per_step"]["pipeline_p2p"]
    assert wire["measured"] == pytest.approx(wire["predicted"])
    assert_states_are_predicted(report)  # the weights: live, and the stash's peak of 2 versions (m = 4, p = 2)
    shutil.rmtree(directory / "step_00000004")
    resumed = _train_json(untied, *args, "--resume")["result"]
    assert resumed["first_step"] == 2 and resumed["losses"] == losses[2:]


@pytest.mark.parametrize("args", [["--nproc", "4", "--dp", "2"], ["--nproc", "4", "--tp", "2", "--dp", "1"],
                                  ["--strategy", "zero1"]])
def test_pipedream_is_refused_beside_what_reduces_once_a_step(untied, args, capsys, monkeypatch):
    code, _, err = run(capsys, monkeypatch, "train", "--model-spec", str(untied), "--pp", "2", "--schedule", "pipedream",
                       "--global-batch", "8", *args)
    assert code == 2 and "schedule='pipedream'" in err and "untied" in err


def test_expert_parallel_training_equals_data_parallel_and_sends_the_routed_tokens(moe, moe_ddp_losses):
    """An MoE model on 2 ranks: with --ep 2 each rank holds 2 of the 4 experts and the routed tokens
    cross over, and the losses equal plain DP's (each rank's tokens routed the same way either way);
    the all-to-all bytes are predict's balanced-routing estimate up to the actual routing."""
    report = _train_json(moe, "--ep", "2", "--steps", "3")
    assert report["result"]["losses"] == pytest.approx(moe_ddp_losses, rel=1e-6)
    assert_states_are_predicted(report)  # 2 of each layer's 4 experts
    wire = report["predicted_vs_measured"]["wire_bytes_per_step"]["expert_parallel"]
    assert wire["predicted"] > 0 and 0.5 < wire["measured"] / wire["predicted"] < 1.5, wire


@pytest.mark.slow  # CI time (two 4-rank runs); DP2 (EP2) x CP2 losses stay in the default run (tests/parallel/test_mesh.py)
def test_moe_with_context_parallel_sends_what_predict_says(moe):
    """An MoE model on DP2 × CP2: the same losses with the experts split over EP2 (each rank routes the
    same tokens either way); CP and DP bytes equal predict's, EP bytes (routing metadata included)
    predict's balanced estimate up to the actual routing."""
    layout = ("--nproc", "4", "--dp", "2", "--cp", "2", "--steps", "3")
    reference = _train_json(moe, *layout)
    report = _train_json(moe, *layout, "--ep", "2")
    assert report["result"]["losses"] == pytest.approx(reference["result"]["losses"], rel=1e-6)
    wire = report["predicted_vs_measured"]["wire_bytes_per_step"]
    for dimension in ("context_parallel", "data_parallel"):
        assert wire[dimension]["measured"] == pytest.approx(wire[dimension]["predicted"])
    assert 0.5 < wire["expert_parallel"]["measured"] / wire["expert_parallel"]["predicted"] < 1.5, wire


@pytest.mark.slow  # CI time (two runs); DP2 (EP2) x TP2 losses stay in the default run (tests/parallel/test_mesh.py)
def test_moe_with_tensor_parallel_equals_one_process(moe):
    """An MoE model on TP2: every expert split over the two ranks, the losses of one process (which
    routes the same tokens), and the TP bytes predict states: the dense layers' plus each MoE layer's
    routing-weight gradient, predicted for every routed copy (copies dropped over capacity send nothing).
    With --ep as well: test_moe_with_tensor_and_expert_parallel_sends_what_predict_says. With --sequence-parallel
    too: the router keeps only its shard of the gathered tokens and gathers them again in backward (one more
    all-gather a layer, in predict's bytes)."""
    reference = _train_json(moe, "--nproc", "1", "--steps", "3")["result"]["losses"]
    for extra in ([], ["--sequence-parallel"]):
        report = _train_json(moe, "--nproc", "2", "--tp", "2", "--steps", "3", *extra)
        assert report["result"]["losses"] == pytest.approx(reference, rel=1e-5), extra
        wire = report["predicted_vs_measured"]["wire_bytes_per_step"]["tensor_parallel"]
        assert wire["measured"] <= wire["predicted"] and wire["measured"] == pytest.approx(wire["predicted"], rel=1e-2), wire


@pytest.mark.slow  # CI time (a 4-rank run); DP2 (EP2) x TP2 losses stay in the default run (tests/parallel/test_mesh.py)
def test_moe_with_tensor_and_expert_parallel_sends_what_predict_says(moe):
    """An MoE model on DP2 (EP2) x TP2, each TP slice of the experts spread over EP: the TP bytes of
    TP alone per rank, and EP bytes predict's balanced-routing estimate up to the actual routing."""
    wires = _train_json(moe, "--nproc", "4", "--tp", "2", "--dp", "2", "--ep", "2", "--steps", "3"
                        )["predicted_vs_measured"]["wire_bytes_per_step"]
    tp, ep = wires["tensor_parallel"], wires["expert_parallel"]
    assert tp["measured"] <= tp["predicted"] and tp["measured"] == pytest.approx(tp["predicted"], rel=1e-2), tp
    assert ep["predicted"] > 0 and 0.5 < ep["measured"] / ep["predicted"] < 1.5, ep


def test_zero_for_an_moe_model_equals_its_ddp_run(moe, moe_ddp_losses):
    """ZeRO-3 on an MoE model (every rank holds every expert: ep = 1): DDP's losses, and the DP bytes
    predict states. (An expert no token reached still gets a zero gradient, so every rank reduces the
    same buckets in the same order.)"""
    report = _train_json(moe, "--steps", "3", "--strategy", "zero3")
    assert report["result"]["losses"] == pytest.approx(moe_ddp_losses, rel=1e-6)
    wire = report["predicted_vs_measured"]["wire_bytes_per_step"]["data_parallel"]
    assert wire["measured"] == pytest.approx(wire["predicted"])


@pytest.mark.slow  # CI time (a 4-rank run); the losses of ZeRO with EP stay in the default run (tests/parallel/test_mesh.py)
def test_zero_with_expert_parallelism_sends_what_predict_says(moe):
    """With --ep 2 on DP4, ZeRO-2 shards the dense weights over the 4 ranks and each expert over the 2
    that hold it: the DP bytes predict states for the two groups, reduce-scattered for each of the two
    microbatches."""
    report = _train_json(moe, "--nproc", "4", "--global-batch", "8", "--dp", "4", "--ep", "2", "--steps", "3",
                         "--micro-batch", "1", "--strategy", "zero2")
    assert_states_are_predicted(report)  # the dense weights' shards of 4, the experts' of 2
    wire = report["predicted_vs_measured"]["wire_bytes_per_step"]
    assert wire["data_parallel"]["measured"] == pytest.approx(wire["data_parallel"]["predicted"])
    assert 0.5 < wire["expert_parallel"]["measured"] / wire["expert_parallel"]["predicted"] < 1.5, wire


@pytest.mark.parametrize("strategy", [pytest.param("zero1", marks=pytest.mark.slow),  # CI time: zero3 is the new path
                                      pytest.param("zero2", marks=pytest.mark.slow), "zero3"])
def test_zero_with_pipeline_parallelism(tiny, single_process_losses, strategy):
    """DP2 × PP2 (tied embeddings across the stages) with ZeRO-1, -2 and -3: one process's losses. ZeRO-2
    and -3 reduce-scatter every microbatch's gradients inside the pipeline's backwards, so the tied
    embedding (a bucket, or a unit, of its own on both stages) is summed over the pipeline slice by slice:
    half the bytes. ZeRO-3 gathers each unit's weights for every microbatch's forward and backward.
    Pipeline bytes equal predict's; DP bytes too, up to predict pricing the heaviest stage where rank 0
    holds the first (the final norm's 128 bytes, per reduction)."""
    report = _train_json(tiny, "--nproc", "4", "--pp", "2", "--dp", "2", "--micro-batch", "1", "--strategy", strategy,
                         "--steps", "3")
    assert report["result"]["losses"] == pytest.approx(single_process_losses, rel=1e-5)
    wire = report["predicted_vs_measured"]["wire_bytes_per_step"]
    assert wire["pipeline_p2p"]["measured"] == pytest.approx(wire["pipeline_p2p"]["predicted"])
    assert wire["data_parallel"]["measured"] == pytest.approx(wire["data_parallel"]["predicted"], rel=1e-4)


@pytest.mark.parametrize("strategy, other", [  # CI time: ZeRO-1, ZeRO-2 and ZeRO-3 with TP alone or CP run with -m slow
    # (ZeRO-2's reduce-scatter a microbatch: the bf16 pipeline's run below; ZeRO-1 and -2 beside TP: tests/parallel)
    pytest.param("zero1", ("--tp",), marks=pytest.mark.slow), pytest.param("zero2", ("--tp",), marks=pytest.mark.slow),
    pytest.param("zero2", ("--tp", "--sequence-parallel"), marks=pytest.mark.slow),
    pytest.param("zero3", ("--tp",), marks=pytest.mark.slow), ("zero3", ("--tp", "--sequence-parallel")),
    pytest.param("zero1", ("--cp",), marks=pytest.mark.slow), pytest.param("zero2", ("--cp",), marks=pytest.mark.slow),
    pytest.param("zero3", ("--cp",), marks=pytest.mark.slow)])  # CI time: ZeRO-3 on DP2 x CP2 in the bf16 run below
def test_zero_along_data_parallel_inside_the_mesh(tiny, single_process_losses, strategy, other):
    """DP2 × TP2 (with and without sequence parallelism) and DP2 × CP2 on 4 ranks with ZeRO, two microbatches a
    rank: one process's losses, and the bytes predict states (ZeRO-1 reduce-scatters the gradients once per step,
    ZeRO-2 once per microbatch, then the updated weights are all-gathered; ZeRO-3 gathers the weights for every
    microbatch's forward and backward instead; under SP each microbatch's backward sums the norms' gradients over
    TP before ZeRO reduces them, and ZeRO-3 gathers a decoder layer at a time). Under CP, ZeRO shards over the 4 DP × CP
    ranks (they hold the same weights) and the CP ring carries only K/V."""
    reference = single_process_losses
    report = _train_json(tiny, "--nproc", "4", other[0], "2", *other[1:], "--dp", "2", "--micro-batch", "1",
                         "--strategy", strategy, "--steps", "3")
    assert report["result"]["losses"] == pytest.approx(reference, rel=1e-5)
    assert_states_are_predicted(report)
    wire = report["predicted_vs_measured"]["wire_bytes_per_step"]
    for dimension in ("tensor_parallel" if other[0] == "--tp" else "context_parallel", "data_parallel"):
        assert wire[dimension]["predicted"] > 0
        assert wire[dimension]["measured"] == pytest.approx(wire[dimension]["predicted"])


@pytest.mark.parametrize("layout", [  # CI time: TP (pure bf16 under DDP) with -m slow
    ("--pp", "2", "--micro-batch", "1", "--strategy", "zero2", "--offload"),
    pytest.param(("--tp", "2"), marks=pytest.mark.slow),
    ("--cp", "2", "--strategy", "zero3", "--offload")])
def test_bf16_inside_the_mesh_sends_what_predict_says(tiny, single_process_losses, layout):
    """--bf16 on DP2 × PP2 (ZeRO-2, its master weights and Adam state offloaded), DP2 × TP2 and DP2 × CP2
    (ZeRO-3, offloaded): one fp32 process's losses to bf16's rounding, and every dimension's bytes equal
    predict's at the run's dtype: 2-byte activations, K/V and gradients, with CP's gradient accumulators
    in fp32 (DP bytes under PP: up to predict pricing the heaviest stage)."""
    report = _train_json(tiny, "--nproc", "4", "--dp", "2", *layout, "--bf16", "--steps", "3")
    assert report["result"]["losses"] == pytest.approx(single_process_losses, rel=1e-4)
    wire = report["predicted_vs_measured"]["wire_bytes_per_step"]
    for dimension in ({"--pp": "pipeline_p2p", "--tp": "tensor_parallel", "--cp": "context_parallel"}[layout[0]],
                      "data_parallel"):
        assert wire[dimension]["predicted"] > 0
        assert wire[dimension]["measured"] == pytest.approx(wire[dimension]["predicted"], rel=1e-4)
    held = report["predicted_vs_measured"]["memory_bytes"]["activations"]  # bf16 layers, fp32 norms and loss
    assert held["measured"] == held["predicted"], held
    assert_states_are_predicted(report)  # bf16 working weights and gradients; fp32 masters and Adam offloaded


def test_the_default_micro_batch_leaves_a_pipeline_enough_microbatches():
    """Without --micro-batch or --microbatches, --pp 4 on 8 sequences runs 4 microbatches of 2 (the default once took
    4-sequence microbatches whatever pp, and the layout was refused for having 2 < pp)."""
    from mlsyslab.train.trainer import default_micro_batch

    assert default_micro_batch(8, 1) == 4 and default_micro_batch(8, 1, pp=4) == 2
    assert default_micro_batch(8, 2, pp=2) == 2 and default_micro_batch(8, 1, pp=16) == 1  # as many as there are
