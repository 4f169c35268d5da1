"""Options shared by commands, and resolving them into specs (model, hardware, assumptions)."""

from pathlib import Path
from typing import Annotated, Optional

import typer

from mlsyslab.errors import InvalidValue
from mlsyslab.predict.assumptions import Assumptions
from mlsyslab.predict.hardware import Hardware
from mlsyslab.specs import catalog
from mlsyslab.specs.schema import DTYPES

ModelName = Annotated[Optional[str], typer.Option("--model", "-m", help="catalog model name or alias (mlsys zoo models)")]
ModelSpec = Annotated[Optional[Path], typer.Option("--model-spec", help="YAML file with a custom model")]
HardwareName = Annotated[Optional[str], typer.Option("--hardware", "-H", help="accelerator or system (mlsys zoo hardware)")]
HardwareSpec = Annotated[Optional[Path], typer.Option("--hardware-spec", help="YAML file with keys accelerator and system")]
Json = Annotated[bool, typer.Option("--json", help="print one JSON object to stdout")]
Explain = Annotated[bool, typer.Option("--explain", help="print every assumption used and its value")]
Assume = Annotated[Optional[list[str]], typer.Option("--assume", help="override an assumption: NAME=VALUE (repeatable)")]
Dtype = Annotated[str, typer.Option("--dtype", help=f"compute dtype: {', '.join(DTYPES)}")]


def resolve_model(name: str | None, spec: Path | None):
    if spec is not None:
        return catalog.model_from_file(str(spec))
    if not name:
        raise InvalidValue("--model", name, "a catalog model (mlsys zoo models) or --model-spec FILE")
    return catalog.model(name)


def resolve_hardware(name: str | None, spec: Path | None, dtype: str) -> tuple[Hardware, dict]:
    """The hardware, and the assumptions measured for it (a calibrated spec carries its own)."""
    if dtype not in DTYPES:
        raise InvalidValue("--dtype", dtype, ", ".join(DTYPES))
    if spec is None and name == "local":
        if not catalog.LOCAL_HARDWARE.is_file():
            raise InvalidValue("--hardware", name, "a catalog name, or run `mlsys calibrate` first to measure this machine")
        spec = catalog.LOCAL_HARDWARE
    overrides: dict = {}
    if spec is not None:
        system, chip, overrides = catalog.hardware_from_file(str(spec))
        known = Assumptions().explain()
        stale = sorted(set(overrides) - set(known))
        if stale:  # written by an older version (a renamed assumption): say so before any work
            again = "; `mlsys calibrate` writes it afresh" if spec == catalog.LOCAL_HARDWARE else ""
            raise InvalidValue(f"{spec}: assumptions", ", ".join(stale), ", ".join(known) + again,
                               reason="unknown assumption")
    elif name:
        system, chip = catalog.hardware(name)
    else:
        raise InvalidValue("--hardware", name, "a catalog accelerator or system (mlsys zoo hardware), local, or --hardware-spec FILE")
    return Hardware.of(system, chip, dtype), overrides


def resolve_assumptions(pairs: list[str] | None, measured: dict | None = None) -> Assumptions:
    """Defaults, then what was measured for the hardware, then the user's --assume NAME=VALUE."""
    values = dict(measured or {})
    for pair in pairs or []:
        if "=" not in pair:
            raise InvalidValue("--assume", pair, "NAME=VALUE, e.g. matmul_efficiency_max=0.7")
        name, value = pair.split("=", 1)
        values[name.strip()] = value.strip()
    return Assumptions().override(values)


def resolve(model: str | None, model_spec: Path | None, hardware: str | None, hardware_spec: Path | None,
            dtype: str, assume: list[str] | None):
    """(model, hardware, assumptions) from a command's options, all checked before any work."""
    spec = resolve_model(model, model_spec)
    hw, measured = resolve_hardware(hardware, hardware_spec, dtype)
    return spec, hw, resolve_assumptions(assume, measured)


def check_positive(**values):
    """Each option (named by its python name) must be >= 1 when given."""
    for name, value in values.items():
        check_range("--" + name.replace("_", "-"), value, 1)


def check_greater_than_zero(**values):
    """Each real-valued option (named by its python name) must be > 0 when given."""
    for name, value in values.items():
        if value is not None and not value > 0:
            raise InvalidValue("--" + name.replace("_", "-"), value, "> 0")


def check_range(field: str, value, low, high=None):
    if value is None:
        return
    if not (value >= low and (high is None or value <= high)):  # so written, NaN is refused too
        valid = f">= {low}" if high is None else f"{low}..{high}"
        raise InvalidValue(field, value, valid)
