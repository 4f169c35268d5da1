"""The catalog: YAML data under `data/`, looked up by case-insensitive name or alias.

`hardware(name)` resolves an accelerator or a system name to a (System, Accelerator) pair: an
accelerator name brings its default system (the first system listed for it). Custom specs come
from a user's YAML file with the same schema (`--model-spec FILE`, `--hardware-spec FILE`).
"""

from functools import lru_cache
from pathlib import Path

import yaml
from pydantic import ValidationError

from mlsyslab.errors import InvalidValue, MlsysError, UnknownName
from mlsyslab.specs.schema import Accelerator, Grid, Model, System

DATA = Path(__file__).parent / "data"
LOCAL_HARDWARE = Path.home() / ".cache" / "mlsyslab" / "hardware" / "local.yaml"  # written by `mlsys calibrate`


def _key(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-")


def _parse(kind, entries: list[dict], origin: str) -> list:
    specs = []
    for entry in entries:
        try:
            specs.append(kind(**entry))
        except ValidationError as error:
            first = error.errors()[0]
            field = ".".join(str(p) for p in first["loc"]) or kind.__name__
            given = f" (given: {first['input']!r})" if first["type"] != "missing" and not isinstance(first["input"], dict) \
                else ""
            raise MlsysError(f"{origin}: {entry.get('name', '?')}: {field}: {first['msg']}{given}") from None
    return specs


def _index(specs: list) -> dict:
    index = {}
    for spec in specs:
        for name in [spec.name, *spec.aliases]:
            index.setdefault(_key(name), spec)
    return index


@lru_cache(maxsize=None)
def _load(filename: str, kind) -> tuple[list, dict]:
    path = DATA / filename
    specs = _parse(kind, yaml.safe_load(path.read_text()), str(path.name))
    return specs, _index(specs)


def accelerators() -> list[Accelerator]:
    return _load("accelerators.yaml", Accelerator)[0]


def systems() -> list[System]:
    return _load("systems.yaml", System)[0]


def models() -> list[Model]:
    return _load("models.yaml", Model)[0]


def grids() -> list[Grid]:
    return _load("grids.yaml", Grid)[0]


def grid(name: str) -> Grid:
    found = _load("grids.yaml", Grid)[1].get(_key(name))
    if found is None:
        raise UnknownName("grid", name, list(_load("grids.yaml", Grid)[1]), "mlsys predict ops --list-regions")
    return found


def accelerator(name: str) -> Accelerator:
    found = _load("accelerators.yaml", Accelerator)[1].get(_key(name))
    if found is None:
        raise UnknownName("accelerator", name, list(_load("accelerators.yaml", Accelerator)[1]), "mlsys zoo hardware")
    return found


def model(name: str) -> Model:
    found = _load("models.yaml", Model)[1].get(_key(name))
    if found is None:
        raise UnknownName("models", name, list(_load("models.yaml", Model)[1]))
    return found


def hardware(name: str) -> tuple[System, Accelerator]:
    """A system by name, or an accelerator by name with its default system."""
    system = _load("systems.yaml", System)[1].get(_key(name))
    if system is None:
        chip = _load("accelerators.yaml", Accelerator)[1].get(_key(name))
        if chip is None:
            known = list(_load("systems.yaml", System)[1]) + list(_load("accelerators.yaml", Accelerator)[1])
            raise UnknownName("hardware", name, known)
        system = next((s for s in systems() if s.accelerator == chip.name), None)
        if system is None:
            raise MlsysError(f"hardware={name!r}: the catalog has no system (node) for {chip.name}")
        return system, chip
    return system, accelerator(system.accelerator)


def model_from_file(path: str) -> Model:
    """One model from a YAML file holding a mapping (or a one-element list) in the catalog's schema."""
    return _single(path, Model, "--model-spec")


def hardware_from_file(path: str) -> tuple[System, Accelerator, dict]:
    """A YAML file with keys `accelerator` and `system` (mappings; the system's `accelerator` defaults to
    it) and optionally `assumptions` (overrides measured for this hardware, as `mlsys calibrate` writes)."""
    data = _read(path, "--hardware-spec")
    if not isinstance(data, dict) or not all(isinstance(data.get(key), dict) for key in ("accelerator", "system")):
        raise InvalidValue("--hardware-spec", path, "a YAML mapping with keys 'accelerator' and 'system', each a mapping")
    chip = _parse(Accelerator, [data["accelerator"]], path)[0]
    system_entry = {"accelerator": chip.name, **data["system"]}
    if system_entry["accelerator"] != chip.name:
        raise InvalidValue(f"{path}: system.accelerator", system_entry["accelerator"],
                           f"the file's accelerator, {chip.name!r} (or left out)")
    assumptions = data.get("assumptions") or {}
    if not isinstance(assumptions, dict):
        raise InvalidValue("--hardware-spec", path, "'assumptions' as a mapping of NAME: VALUE")
    return _parse(System, [system_entry], path)[0], chip, assumptions


def _read(path: str, flag: str):
    file = Path(path)
    if not file.is_file():
        raise InvalidValue(flag, path, "the path of an existing YAML file")
    try:
        return yaml.safe_load(file.read_text())
    except yaml.YAMLError as error:
        raise InvalidValue(flag, path, "valid YAML", reason=str(error).splitlines()[0]) from None


def _single(path: str, kind, flag: str):
    data = _read(path, flag)
    if isinstance(data, list) and len(data) == 1:
        data = data[0]
    if not isinstance(data, dict):
        raise InvalidValue(flag, path, f"a YAML mapping with the fields of a {kind.__name__}")
    return _parse(kind, [data], path)[0]
