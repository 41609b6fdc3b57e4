"""The base of every config (StrictModel) and TOML loading with `--set` overrides."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError


class StrictModel(BaseModel):
    """Base for every config: unknown keys are an error, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


T = TypeVar("T", bound=BaseModel)


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` strings to a nested dict (in place) and return it."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set expects key=value, got {item!r}")
        *parents, leaf = key.strip().split(".")
        node = data
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(f"--set {key}: {part!r} is a value, not a table")
            node = child
        node[leaf] = _parse_value(raw.strip())
    return data


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    """Build `cls` from a TOML recipe (or defaults) plus `--set` overrides; raises ValueError on bad input."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"config file not found: {path}")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{path}: invalid TOML: {e}") from None
    apply_overrides(data, overrides or [])
    try:
        return cls.model_validate(_onto_defaults(cls, data))
    except ValidationError as e:
        where = f"{path}: " if path is not None else ""
        raise ValueError(where + format_validation_error(e)) from None


def _onto_defaults(cls: type[BaseModel], data: dict[str, Any]) -> dict[str, Any]:
    """A table that configures a nested model is applied onto that field's default, not onto the nested
    class's defaults: `--set loop.cycles=5` keeps every other setting of the demo's own loop."""
    try:
        defaults = cls()
    except ValidationError:  # a root with required fields: nothing to merge onto
        return data

    def merge(model: BaseModel, table: dict[str, Any]) -> dict[str, Any]:
        out = model.model_dump(mode="json")
        for key, value in table.items():
            sub = getattr(model, key, None)
            out[key] = merge(sub, value) if isinstance(sub, BaseModel) and isinstance(value, dict) else value
        return out

    return {key: merge(sub, value) if isinstance(sub := getattr(defaults, key, None), BaseModel)
            and isinstance(value, dict) else value for key, value in data.items()}


def format_validation_error(e: ValidationError) -> str:
    """One line per problem, joined: `model.num_experts: Input should be greater than or equal to 0`."""
    return "; ".join(
        f"{'.'.join(str(p) for p in err['loc']) or '(root)'}: {err['msg']}" for err in e.errors()
    )
