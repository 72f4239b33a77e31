"""Loading the config tree: YAML files, presets, ``key.sub=value`` overrides, type coercion, saving.

Resolution order: dataclass defaults <- YAML file (``configs/experiments/*.yaml``) <- ``key.sub=value``
overrides from the command line, then ``validate.validate``.

In YAML a section may be given as a preset name (``model: debug`` loads ``configs/model/debug.yaml``), as a
path to a YAML file, or as a mapping of fields. A mapping may name a preset too (``model: {preset: debug,
hidden_size: 96}``): the preset is applied first, then the other keys.

``build`` is the one dict -> dataclass builder of the schema's types: every value is converted to its
field's type (``_coerce``) or a :class:`~roformer_dist.errors.ConfigError` names the key.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from data_pipeline.atomic import atomic_write_text
from roformer_dist.config.schema import Config, choice_error
from roformer_dist.config.validate import validate
from roformer_dist.errors import ConfigError

CONFIGS_DIR = Path(__file__).resolve().parent.parent.parent / "configs"
"""Where presets live (the repository's ``configs/``). Overridable with ROFORMER_CONFIGS for installed copies."""
if os.environ.get("ROFORMER_CONFIGS"):
    CONFIGS_DIR = Path(os.environ["ROFORMER_CONFIGS"])

PRESET_DIRS = {
    "model": "model",
    "curriculum": "curriculum",
    "deepspeed": "deepspeed",
    "slurm": "cluster",
}
"""Sections that can be given as a preset name: section -> configs/<dir>/<name>.yaml."""

_YAML_KEYS = {"from_": "from", "async_": "async"}
"""Fields whose YAML key is a Python keyword: field name -> the key written and read (the field name is
read too)."""
_FIELD_OF = {v: k for k, v in _YAML_KEYS.items()}


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Convert a YAML/CLI value to the field type ``tp`` or raise naming ``key``."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if _is_dataclass_type(tp):
        return _build(tp, value, key)
    if origin is Literal:
        return _coerce_choice(value, args, key)
    if origin is Union:
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ValueError:
                continue
        names = " or ".join(_type_name(a) for a in args)
        raise ConfigError(f"{key}: expected {names}, got {value!r}")
    if origin is tuple:
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            value = [value] if value not in (None, "") else []
        inner = args[0] if args else Any
        return tuple(_coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        inner = args[1] if len(args) == 2 else str
        return {str(k): _coerce(v, inner, f"{key}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, (int, str, float)):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        try:
            f = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected an integer, got {value!r}") from None
        if not f.is_integer():
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return int(f)
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return "" if value is None else str(value)
    return value


def _coerce_choice(value: Any, allowed: tuple, key: str) -> Any:
    """A value of a choice type: converted to the choices' type (``zero_stage="2"`` -> 2), then checked."""
    kinds = {type(a) for a in allowed}
    if isinstance(value, bool) and kinds != {bool}:
        raise choice_error(key, allowed, value)
    if len(kinds) == 1 and not isinstance(value, tuple(kinds)):
        try:
            value = _coerce(value, next(iter(kinds)), key)
        except ConfigError:
            raise choice_error(key, allowed, value) from None
    if value not in allowed:
        raise choice_error(key, allowed, value)
    return value


def _load_yaml(path: Path, key: str) -> dict:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{key}: file not found: {path}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{key}: {path} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{key}: {path} must hold a mapping, got {type(data).__name__}")
    return data


def _preset_path(section: str, name: str) -> Path:
    p = Path(name)
    if p.suffix in (".yaml", ".yml") or p.exists():
        return p
    return CONFIGS_DIR / PRESET_DIRS[section] / f"{name}.yaml"


def _expand_preset(section: str, value: Any) -> Any:
    """``debug`` / ``path.yaml`` / ``{preset: debug, ...}`` -> a plain mapping."""
    if section not in PRESET_DIRS:
        return value
    if isinstance(value, str):
        path = _preset_path(section, value)
        if not path.exists():
            available = sorted(p.stem for p in (CONFIGS_DIR / PRESET_DIRS[section]).glob("*.yaml"))
            raise ConfigError(f"{section}: no preset {value!r} (looked for {path}); available: {available}")
        return _load_yaml(path, section)
    if isinstance(value, dict) and "preset" in value:
        rest = {k: v for k, v in value.items() if k != "preset"}
        return _merge(_expand_preset(section, value["preset"]), rest)
    return value


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def _build(cls: type, data: Any, prefix: str = "") -> Any:
    if isinstance(data, cls):
        return data
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    data = {(_FIELD_OF[k] if _FIELD_OF.get(k) in names else k): v for k, v in data.items()}
    unknown = sorted(set(data) - names)
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(
            f"unknown config key {where}{unknown[0]}"
            f" (known keys{' of ' + prefix if prefix else ''}: {', '.join(sorted(names))})"
        )
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        if cls is Config:
            value = _expand_preset(name, value)
        kwargs[name] = _coerce(value, hints[name], key)
    return cls(**kwargs)


def build(cls: type, data: Any, where: str = "", error: type[Exception] = ConfigError) -> Any:
    """A dataclass of the schema from a plain mapping (a YAML file, a saved config, the model config of
    a weights file), every value checked against its field's type. The one builder of these types:
    a :class:`ConfigError` names the key; with ``where`` (a file) the error is ``error`` and names it."""
    try:
        return _build(cls, data)
    except ConfigError as e:
        if not where:
            raise
        raise error(f"{where}: {e}") from None


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        nxt = node.get(part)
        if not isinstance(nxt, dict):
            nxt = {} if nxt is None else _expand_preset(part, nxt) if node is tree else nxt
            if not isinstance(nxt, dict):
                raise ConfigError(f"{dotted}: {part} is not a section")
            node[part] = nxt
        node = nxt
    node[parts[-1]] = value


def _check_override_key(dotted: str) -> Any:
    """Fail early on a key that does not exist, naming its first unknown part; returns the key's type."""
    cls: Any = Config
    path = []
    for part in dotted.split("."):
        if not _is_dataclass_type(cls):
            raise ConfigError(f"unknown config key {dotted}: {'.'.join(path)} has no sub-keys")
        hints = typing.get_type_hints(cls)
        part = _FIELD_OF.get(part, part)
        if part not in hints:
            raise ConfigError(f"unknown config key {'.'.join(path + [part])} (in override {dotted})")
        path.append(part)
        cls = hints[part]
    return cls


def fork_overrides(parent: str | None, decay: int | None = None, decay_shape: str | None = None) -> list[str]:
    """The overrides of ``--fork PARENT [--decay STEPS [--decay-shape SHAPE]]`` (roformer-train, roformer-submit):
    ``init.from`` (an absolute path), and for a decay branch ``init.decay_steps`` and ``optim.decay_shape``."""
    if parent is None:
        if decay is not None or decay_shape is not None:
            raise ConfigError("--decay/--decay-shape: a decay branch needs --fork PARENT (the checkpoint to decay "
                              "from)")
        return []
    if decay_shape is not None and decay is None:
        raise ConfigError("--decay-shape: only with --decay STEPS (a decay branch)")
    if decay is not None and decay < 1:
        raise ConfigError(f"--decay: expected a positive number of steps, got {decay}")
    out = [f"init.from={Path(parent).expanduser().resolve()}"]
    if decay is not None:
        out.append(f"init.decay_steps={decay}")
    if decay_shape is not None:
        out.append(f"optim.decay_shape={decay_shape}")
    return out


def parse_overrides(items: list[str]) -> dict:
    """``["a.b=1", "c=x"]`` -> nested mapping with YAML-parsed values (a string key's value is taken as
    written: ``run_dir_mode=0770`` is not the YAML integer 504)."""
    tree: dict = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key.sub=value")
        key, raw = item.split("=", 1)
        key = key.strip()
        try:
            value = raw if _check_override_key(key) is str else yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        _set_dotted(tree, key, value)
    return tree


def load_config(path: Optional[str | os.PathLike] = None, overrides: list[str] = ()) -> Config:
    """Defaults <- YAML file <- overrides, then ``validate``."""
    data: dict = {}
    if path is not None:
        data = _load_yaml(Path(path), str(path))
    data = {k: _expand_preset(k, v) for k, v in data.items()}
    if overrides:
        data = _merge(data, {k: _expand_preset(k, v) for k, v in parse_overrides(list(overrides)).items()})
    cfg = _build(Config, data)
    validate(cfg)
    return cfg


def from_dict(data: dict) -> Config:
    """A saved config (``to_dict`` output, e.g. from a checkpoint) -> validated ``Config``."""
    cfg = _build(Config, data)
    validate(cfg)
    return cfg


def to_dict(cfg: Any) -> Any:
    if dataclasses.is_dataclass(cfg):
        return {_YAML_KEYS.get(f.name, f.name): to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, tuple):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, allow_unicode=True)


def save_config(cfg: Config, path: str | os.PathLike) -> None:
    """Write the resolved config atomically (temporary file, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, dump_yaml(cfg))


def replace(cfg: Any, **changes: Any) -> Any:
    """``dataclasses.replace`` that accepts dotted keys: replace(cfg, **{"model.vocab_size": 8000})."""
    nested: dict[str, dict] = {}
    flat = {}
    for k, v in changes.items():
        head, _, rest = k.partition(".")
        if rest:
            nested.setdefault(head, {})[rest] = v
        else:
            flat[head] = v
    for head, sub in nested.items():
        flat[head] = replace(getattr(cfg, head), **sub)
    return dataclasses.replace(cfg, **flat)
