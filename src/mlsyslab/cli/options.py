"""Options shared by commands, and resolving them into specs (model, hardware, assumptions)."""

import math
import os
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
    if spec is not None and name:
        raise InvalidValue("--hardware", name, "omitted with --hardware-spec (the file is the hardware)")
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
    values, given = dict(measured or {}), set()
    for pair in pairs or []:
        if "=" not in pair:
            raise InvalidValue("--assume", pair, "NAME=VALUE, e.g. matmul_efficiency_max=0.7")
        name, value = pair.split("=", 1)
        if name.strip() in given:
            raise InvalidValue("--assume", pair, f"one value per assumption ({name.strip()} is given twice)")
        given.add(name.strip())
        values[name.strip()] = value.strip()
    return Assumptions().override(values)


def resolve(model: str | None, model_spec: Path | None, hardware: str | None, hardware_spec: Path | None,
            dtype: str, assume: list[str] | None):
    """(model, hardware, assumptions) from a command's options, all checked before any work."""
    spec = resolve_model(model, model_spec)
    hw, measured = resolve_hardware(hardware, hardware_spec, dtype)
    return spec, hw, resolve_assumptions(assume, measured)


MAX_COUNT = 2**31 - 1  # counts beyond any real job (and past which numpy's int64 products overflow)
MAX_ACCELERATORS = 2**24  # 16.7 M, a hundred times today's largest clusters (the planner's search grows with it)


def check_positive(high: int = MAX_COUNT, **values):
    """Each count (named by its python name) must be 1..`high` when given."""
    for name, value in values.items():
        check_range("--" + name.replace("_", "-"), value, 1, high)


def check_model_shape(spec, tp: int = 1, tokens: int = 0, tokens_field: str = "--prompt-tokens + --output-tokens",
                      tp_field: str = "--tp") -> None:
    """TP must divide the model's attention heads, and a sequence of `tokens` fit its context; `tokens_field` names
    the options `tokens` adds up (an error once printed the sum as --prompt-tokens' value)."""
    if spec.heads % tp:
        raise InvalidValue(tp_field, tp, f"a divisor of the {spec.heads} attention heads of {spec.name}")
    if tokens > spec.max_seq:
        raise InvalidValue(tokens_field, tokens, f"<= the {spec.max_seq}-token context of {spec.name}")


def check_unused(why: str, *options: tuple) -> None:
    """Refuse an option (flag, value, default) given a value other than its default where it has no effect: `why`
    says when it does (an ignored option would be a silent surprise)."""
    for flag, value, default in options:
        if value != default:
            raise InvalidValue(flag, value, why)


def check_directory(flag: str, path: Path | None) -> None:
    """`path` (if given) must be a directory this process can create and write, before any work."""
    if path is None:
        return
    try:
        path.mkdir(parents=True, exist_ok=True)
        writable = os.access(path, os.W_OK)
    except OSError as error:
        raise InvalidValue(flag, str(path), f"a directory this process can create and write ({error.strerror})") from None
    if not writable:
        raise InvalidValue(flag, str(path), "a directory this process can write")


def check_output_file(flag: str, path: Path, suffixes: tuple[str, ...]) -> None:
    """`path` must end in one of `suffixes` and be a file this process can write (checked by opening it for appending,
    which leaves an existing file as it was and removes a new one), before any work."""
    valid = f"a {' or '.join(suffixes)} file this process can write"
    if path.suffix not in suffixes or path.is_dir():
        raise InvalidValue(flag, str(path), valid)
    existed = path.exists()
    try:
        with open(path, "a"):
            pass
    except OSError as error:
        raise InvalidValue(flag, str(path), f"{valid} ({error.strerror})") from None
    if not existed:
        path.unlink()


def check_greater_than_zero(**values):
    """Each real-valued option (named by its python name) must be finite and > 0 when given."""
    for name, value in values.items():
        if value is not None and not (_finite(value) and value > 0):  # NaN too
            raise InvalidValue("--" + name.replace("_", "-"), value, "a finite number > 0")


def check_range(field: str, value, low, high=None):
    """`value` (when given) finite, >= low and, with `high`, <= high."""
    if value is None:
        return
    if not (_finite(value) and value >= low and (high is None or value <= high)):  # NaN too
        valid = f"a finite number >= {low}" if high is None else f"{low}..{high}"
        raise InvalidValue(field, value, valid)


def _finite(value) -> bool:
    return isinstance(value, int) or math.isfinite(value)  # (an int of any size: math.isfinite overflows past 1e308)
