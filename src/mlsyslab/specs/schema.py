"""Pydantic schemas of the catalog: accelerators, systems (node + cluster) and transformer models.

Quantities may be written with human units in YAML ("80 GB", "3.35 TB/s", "989 TFLOP/s", "700 W");
they are stored in SI units (bytes, bytes/s, FLOP/s, watts). Peak FLOP/s are dense (no 2:4
sparsity). A dtype a chip lacks is simply absent from `peak_flops`.
"""

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from mlsyslab.errors import UnsupportedDtype
from mlsyslab.specs.units import parse_quantity

DTYPES = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8", "int8", "int4")
DTYPE_BYTES = {"fp64": 8.0, "fp32": 4.0, "tf32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}


def _quantity(kind: str):
    return BeforeValidator(lambda v: None if v is None else parse_quantity(v, kind))


# physical quantities: finite and >= 0 (a field that must be > 0 says so)
Bytes = Annotated[float, _quantity("bytes"), Field(ge=0, allow_inf_nan=False)]
BytesPerSecond = Annotated[float, _quantity("bytes/s"), Field(ge=0, allow_inf_nan=False)]
FlopsPerSecond = Annotated[float, _quantity("FLOP/s"), Field(gt=0, allow_inf_nan=False)]
Watts = Annotated[float, _quantity("watts"), Field(ge=0, allow_inf_nan=False)]


class Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    aliases: list[str] = []
    source: str = Field(min_length=4, description="where the numbers come from (datasheet, paper, URL)")
    notes: str = ""


class Accelerator(Spec):
    vendor: str
    kind: Literal["gpu", "tpu", "npu", "wafer", "lpu", "cpu"] = "gpu"
    launch_year: int = Field(ge=1940, le=2100)
    peak_flops: dict[Literal[DTYPES], FlopsPerSecond] = Field(min_length=1)  # dense, per chip
    hbm_bytes: Bytes  # off-chip memory capacity (HBM/GDDR); 0 for SRAM-only chips
    hbm_bw: BytesPerSecond = Field(gt=0)  # the memory roof (an SRAM-only chip's: its SRAM's or its streaming's)
    sram_bytes: Bytes  # on-chip SRAM (L2 / shared memory / CMEM / wafer SRAM)
    scale_up_bw: BytesPerSecond  # per direction, per chip (NVLink, Infinity Fabric, ICI, ...); 0 if none
    tdp_w: Watts = Field(gt=0)
    price_usd: float | None = Field(default=None, ge=0, allow_inf_nan=False)  # list price where public

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s for `dtype`; an error, never a fallback, if the chip lacks it."""
        if dtype not in self.peak_flops:
            raise UnsupportedDtype(self.name, dtype, sorted(self.peak_flops))
        return self.peak_flops[dtype]


class System(Spec):
    """A node of accelerators and how it connects: the scale-up domain and the scale-out NICs."""

    accelerator: str
    accelerators_per_node: int = Field(ge=1)
    scale_up_domain: int = Field(ge=1)  # accelerators sharing the scale-up fabric (8 for NVL8, 72 for NVL72)
    scale_up_name: str = ""
    scale_out_bw: BytesPerSecond = Field(gt=0)  # per accelerator, per direction (InfiniBand / RoCE / DCN)
    host_memory_bytes: Bytes = 0.0  # per node
    pcie_bw: BytesPerSecond = 0.0  # host <-> accelerator, per accelerator, per direction
    topology: Literal["fat-tree", "rail-optimized", "torus", "dragonfly", "single-node"] = "fat-tree"
    oversubscription: float = Field(default=1.0, ge=1.0, allow_inf_nan=False)  # scale-out bisection taper
    power_overhead_w: Watts = 0.0  # per node, beyond the accelerators (CPUs, NICs, fans)


class MixtureOfExperts(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    experts: int = Field(ge=1)
    experts_per_token: int = Field(ge=1)
    expert_ffn_hidden: int = Field(ge=1)
    shared_experts: int = 0
    dense_layers: int = 0  # the first `dense_layers` layers use a dense MLP of `ffn_hidden`
    router_bias: bool = False

    @model_validator(mode="after")
    def _check(self):
        if self.experts_per_token > self.experts:
            raise ValueError(f"experts_per_token={self.experts_per_token} exceeds experts={self.experts}")
        return self


class LatentAttention(BaseModel):
    """Multi-head latent attention (DeepSeek-V2/V3): low-rank compressed K/V (and Q)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    q_lora_rank: int = 0  # 0: queries are not compressed
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


class Model(Spec):
    """A decoder-only transformer as its config file states it."""

    family: str
    hidden: int = Field(ge=1)
    layers: int = Field(ge=1)
    heads: int = Field(ge=1)
    kv_heads: int | None = None  # None: multi-head attention (kv_heads = heads)
    head_dim: int | None = None  # None: hidden / heads
    ffn_hidden: int = Field(ge=1)
    gated_mlp: bool = True  # SwiGLU / GeGLU: three matrices instead of two
    vocab: int = Field(ge=1)
    tied_embeddings: bool = False
    max_seq: int = Field(ge=1)
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    linear_bias: bool = False  # biases on every linear (GPT-2, OPT)
    qkv_bias: bool = False  # biases on Q, K, V only (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on Q and K (Qwen3)
    learned_positions: int = 0  # rows of a learned absolute position table (GPT-2: 1024, OPT: 2050)
    moe: MixtureOfExperts | None = None
    mla: LatentAttention | None = None
    extra_params: int = 0  # parameters outside the stack counted by the publisher (e.g. DeepSeek MTP)
    published_params: float = Field(gt=0, allow_inf_nan=False)  # the count the publisher states (total, for MoE)
    published_active_params: float | None = None
    active_count_excludes_input_embedding: bool = False  # the publisher's convention (DeepSeek's)

    @model_validator(mode="after")
    def _check(self):
        kv = self.kv_heads or self.heads
        if self.heads % kv:
            raise ValueError(f"heads={self.heads} is not a multiple of kv_heads={kv}")
        if self.head_dim is None and self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} is not a multiple of heads={self.heads} (or give head_dim)")
        return self

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def attention_head_dim(self) -> int:
        return self.head_dim or self.hidden // self.heads


class Grid(Spec):
    """Where a data centre runs: its grid's carbon intensity, a representative PUE and water use."""

    grid_gco2_per_kwh: float = Field(ge=0)  # operational emissions of the electricity
    pue: float = Field(ge=1.0)  # facility energy / IT energy
    water_l_per_kwh: float = Field(ge=0)  # on-site water (WUE) per kWh of IT energy
