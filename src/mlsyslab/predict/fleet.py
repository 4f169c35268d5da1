"""Fleet reliability: failures, checkpoints and goodput (Young 1974; Daly 2006; Dubey et al. 2024).

A cluster fails when any component fails: with independent exponential failures the rates add,
λ = Σ count_i / MTTF_i, and the cluster's mean time between failures is 1/λ. A checkpoint of the
full training state (bf16 weights + fp32 master and Adam moments: 14 bytes per parameter, plus 2 for
gradients only if asked) takes δ = bytes / write bandwidth. Checkpointing every τ loses δ per
interval and, per failure, on average τ/2 of recomputation plus the restart time R. Young–Daly's
optimum is τ* = sqrt(2·δ·M) (first order, δ ≪ M); the fraction of wall-clock that is useful work is
goodput = (1 − δ/τ) · (1 − (τ/2 + R)/M), floored at 0. The multi-tenant queue (jobs waiting for the
cluster) is M/M/c with Erlang C (Kleinrock 1975). Every function broadcasts over numpy arrays.
"""

from dataclasses import dataclass

import numpy as np

from mlsyslab.errors import InvalidValue

HOUR = 3600.0


@dataclass(frozen=True)
class FailureRates:
    """Mean time to failure of each component, in hours (defaults from Meta's Llama 3 report and
    field studies: ~50,000 h per GPU; node hosts, NICs and switches fail more rarely)."""

    gpu_mttf_h: float = 50_000.0
    host_mttf_h: float = 200_000.0  # CPU, memory, PSU, disk of one node
    nic_mttf_h: float = 500_000.0  # per NIC (one per GPU on rail-optimised nodes)
    switch_mttf_h: float = 1_000_000.0  # per leaf/spine switch
    gpus_per_switch: float = 32.0  # leaf switch radix used per GPU (switches ≈ gpus / this)


@dataclass(frozen=True)
class Fleet:
    mtbf_s: np.ndarray  # the cluster's mean time between failures
    checkpoint_bytes: np.ndarray
    checkpoint_s: np.ndarray  # δ: time to write one checkpoint
    optimal_interval_s: np.ndarray  # Young–Daly τ*
    interval_s: np.ndarray  # the interval evaluated (τ* unless given)
    goodput: np.ndarray  # useful fraction of wall-clock time
    lost_per_failure_s: np.ndarray  # τ/2 + restart
    failures_per_day: np.ndarray


def cluster_mtbf_s(gpus, gpus_per_node=8, rates: FailureRates = FailureRates()):
    """1 / Σ λ_i over GPUs, hosts, NICs and switches."""
    gpus = np.asarray(gpus, dtype=float)
    nodes = np.ceil(gpus / gpus_per_node)
    rate = (gpus / rates.gpu_mttf_h + nodes / rates.host_mttf_h + gpus / rates.nic_mttf_h
            + np.ceil(gpus / rates.gpus_per_switch) / rates.switch_mttf_h)
    return HOUR / rate


def checkpoint_bytes(parameters, bytes_per_parameter: float = 14.0):
    """Full training state: bf16 weights (2) + fp32 master, m and v (12) per parameter."""
    return np.asarray(parameters, dtype=float) * bytes_per_parameter


def young_daly_interval_s(checkpoint_s, mtbf_s):
    """τ* = sqrt(2·δ·M)."""
    return np.sqrt(2 * np.asarray(checkpoint_s, dtype=float) * np.asarray(mtbf_s, dtype=float))


def goodput(interval_s, checkpoint_s, mtbf_s, restart_s):
    """(1 − δ/τ)·(1 − (τ/2 + R)/M), each factor clipped to [0, 1]: 0 where checkpoints (δ ≥ τ) or failures
    (τ/2 + R ≥ M) take all the time — the product of two such negative factors is not a goodput."""
    interval_s, checkpoint_s, mtbf_s, restart_s = (np.asarray(x, dtype=float) for x in (interval_s, checkpoint_s, mtbf_s, restart_s))
    between_checkpoints = np.clip(1 - checkpoint_s / interval_s, 0.0, 1.0)
    between_failures = np.clip(1 - (interval_s / 2 + restart_s) / mtbf_s, 0.0, 1.0)
    return between_checkpoints * between_failures


def predict_fleet(gpus, parameters, storage_write_bw, gpus_per_node=8, restart_s=600.0, interval_s=None,
                  rates: FailureRates = FailureRates(), bytes_per_parameter: float = 14.0) -> Fleet:
    """Reliability of a training job on `gpus` writing checkpoints at `storage_write_bw` bytes/s."""
    if np.any(np.asarray(storage_write_bw) <= 0):
        raise InvalidValue("storage_write_bw", storage_write_bw, "> 0 bytes/s")
    mtbf = cluster_mtbf_s(gpus, gpus_per_node, rates)
    size = checkpoint_bytes(parameters, bytes_per_parameter)
    delta = size / np.asarray(storage_write_bw, dtype=float)
    optimum = young_daly_interval_s(delta, mtbf)
    tau = optimum if interval_s is None else np.asarray(interval_s, dtype=float)
    return Fleet(mtbf_s=mtbf, checkpoint_bytes=size, checkpoint_s=delta, optimal_interval_s=optimum, interval_s=tau,
                 goodput=goodput(tau, delta, mtbf, restart_s), lost_per_failure_s=tau / 2 + restart_s,
                 failures_per_day=86_400.0 / mtbf)


def erlang_c(servers, load):
    """Probability an arrival waits in M/M/c with c servers and offered load a = λ/μ (< c)."""
    servers = np.asarray(servers, dtype=float)
    load = np.asarray(load, dtype=float)
    # Iterate the Erlang B recursion B(k) = a·B(k−1)/(k + a·B(k−1)) up to the largest c (vectorised).
    blocking = np.ones(np.broadcast(servers, load).shape)
    for k in range(1, int(np.max(servers)) + 1):
        step = load * blocking / (k + load * blocking)
        blocking = np.where(k <= servers, step, blocking)
    rho = load / servers
    return np.where(rho < 1, blocking / (1 - rho * (1 - blocking)), 1.0)


def queue_wait_s(arrival_rate, service_s, servers):
    """Mean wait in M/M/c: C(c, a) / (c·μ − λ); infinite when the queue is unstable (λ ≥ c·μ)."""
    arrival_rate, service_s, servers = (np.asarray(x, dtype=float) for x in (arrival_rate, service_s, servers))
    load = arrival_rate * service_s
    stable = load < servers
    spare = np.where(stable, servers / service_s - arrival_rate, 1.0)
    return np.where(stable, erlang_c(servers, np.where(stable, load, 0.0)) / spare, np.inf)


def queue_wait_quantile_s(arrival_rate, service_s, servers, quantile=0.99):
    """The `quantile` of the M/M/c waiting time: P(W > t) = C·exp(−(cμ − λ)t)."""
    arrival_rate, service_s, servers = (np.asarray(x, dtype=float) for x in (arrival_rate, service_s, servers))
    load = arrival_rate * service_s
    stable = load < servers
    waiting = erlang_c(servers, np.where(stable, load, 0.0))
    spare = np.where(stable, servers / service_s - arrival_rate, 1.0)
    tail = 1 - np.asarray(quantile, dtype=float)
    wait = np.where(waiting > tail, np.log(np.maximum(waiting, 1e-300) / tail) / spare, 0.0)
    return np.where(stable, wait, np.inf)
