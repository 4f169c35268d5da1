"""A parallel layout (or a batch of them): every field is a numpy array, so one call evaluates many.

Conventions (Megatron-Core): gpus = dp · tp · pp · cp; expert parallelism borrows from data
parallelism (ep divides dp; each expert is replicated over dp/ep ranks). ZeRO shards over dp (for
expert weights, over dp/ep). recompute: 0 none, 1 selective, 2 full. schedule: 0 GPipe, 1 1F1B,
2 interleaved 1F1B with `interleave` virtual stages per rank, 3 PipeDream (1F1B's order, each stage updating
after every backward and stashing the weight versions its microbatches still owe a backward to).
"""

from dataclasses import dataclass, fields

import numpy as np

from mlsyslab.errors import InvalidValue

RECOMPUTE = ("none", "selective", "full")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "pipedream")


@dataclass(frozen=True)
class Layout:
    dp: np.ndarray
    tp: np.ndarray
    pp: np.ndarray
    cp: np.ndarray
    ep: np.ndarray
    zero: np.ndarray  # 0..3
    micro_batch: np.ndarray  # sequences per microbatch
    global_batch: np.ndarray  # sequences per optimizer step
    seq: np.ndarray  # tokens per sequence
    recompute: np.ndarray  # index into RECOMPUTE
    schedule: np.ndarray  # index into SCHEDULES
    interleave: np.ndarray  # virtual stages per rank (1 unless interleaved)
    sequence_parallel: np.ndarray  # bool
    offload: np.ndarray  # bool: optimizer state and step on the CPU (ZeRO-Offload)

    @classmethod
    def of(cls, **values) -> "Layout":
        """Build from scalars or arrays (broadcast together); omitted fields take their defaults."""
        defaults = dict(dp=1, tp=1, pp=1, cp=1, ep=1, zero=0, micro_batch=1, global_batch=None, seq=2048,
                        recompute=0, schedule=1, interleave=1, sequence_parallel=False, offload=False)
        unknown = set(values) - set(defaults)
        if unknown:
            raise InvalidValue("layout", sorted(unknown), ", ".join(defaults))
        merged = {**defaults, **{k: v for k, v in values.items() if v is not None}}
        if merged["global_batch"] is None:
            merged["global_batch"] = np.asarray(merged["dp"]) * np.asarray(merged["micro_batch"])
        for name, names in (("recompute", RECOMPUTE), ("schedule", SCHEDULES)):
            if isinstance(merged[name], str):
                if merged[name] not in names:
                    raise InvalidValue(name, merged[name], ", ".join(names))
                merged[name] = names.index(merged[name])
        arrays = np.broadcast_arrays(*(np.asarray(merged[f.name]) for f in fields(cls)))
        return cls(*(np.array(a) for a in arrays))

    @property
    def gpus(self):
        return self.dp * self.tp * self.pp * self.cp

    @property
    def microbatches(self):
        """Microbatches per pipeline per step: global batch / (dp · micro batch)."""
        return self.global_batch / (self.dp * self.micro_batch)

    @property
    def size(self) -> int:
        return int(self.dp.size)

    def row(self, i: int) -> dict:
        """The i-th layout as plain Python values with names (for printing and JSON)."""
        out = {f.name: getattr(self, f.name).reshape(-1)[i].item() for f in fields(self)}
        out["recompute"] = RECOMPUTE[int(out["recompute"])]
        out["schedule"] = SCHEDULES[int(out["schedule"])]
        out["sequence_parallel"] = bool(out["sequence_parallel"])
        out["offload"] = bool(out["offload"])
        return out

    def take(self, index) -> "Layout":
        return Layout(*(getattr(self, f.name).reshape(-1)[index] for f in fields(self)))
