"""Config loading: ``--config grpo/<name>`` resolves to a shipped YAML unless a file of that
name exists, ``key=value`` overrides work as in torchtune, and ``inherit: NAME`` merges a
config over another (a node with another ``_component_`` replaces the inherited one).
"""

from __future__ import annotations

import argparse
import functools
import importlib.resources
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from torchtune_grpo.config.validation import ConfigError
from torchtune_grpo.errors import one_line, reported_as_one_line

#: Package holding the shipped configs (``configs/`` in the source tree).
CONFIG_PACKAGE = "torchtune_grpo.configs"


# ---------------------------------------------------------------------------- lookup
def shipped_config_dir() -> Path:
    """Folder holding ``grpo/<name>.yaml``: the source checkout's ``configs/`` when this module
    runs from one (beside ``pyproject.toml``), else the installed ``torchtune_grpo.configs``.
    """
    root = Path(__file__).resolve().parents[2]
    source = root / "configs"
    if (root / "pyproject.toml").is_file() and (source / "__init__.py").is_file():
        return source
    return Path(str(importlib.resources.files(CONFIG_PACKAGE)))


def list_shipped_configs() -> list[str]:
    """``grpo/<name>`` of every shipped config, sorted."""
    root = shipped_config_dir()
    return sorted(str(p.relative_to(root).with_suffix("")) for p in root.glob("*/*.yaml"))


def resolve_config_path(name: str | Path) -> Path:
    """Path of the config ``name``: an existing file, else a shipped config.

    Args:
        name: a path, or a shipped name (``grpo/<name>`` or ``<name>``, with or without
            ``.yaml``).

    Returns:
        The path of the file to load.

    Raises:
        FileNotFoundError: neither a file nor a shipped config; lists the shipped ones.
    """
    path = Path(name).expanduser()
    if path.is_file():
        return path
    stem = str(name)[:-5] if str(name).endswith(".yaml") else str(name)
    candidates = [stem, f"grpo/{stem}"]
    for candidate in candidates:
        shipped = shipped_config_dir() / f"{candidate}.yaml"
        if shipped.is_file():
            return shipped
    raise FileNotFoundError(
        f"config {str(name)!r} is neither a file nor a shipped config. Shipped configs: "
        + ", ".join(list_shipped_configs())
    )


def load_config(config: str | Path, overrides: list[str] | None = None) -> DictConfig:
    """Load a config (path or shipped name) and apply ``key=value`` overrides.

    Args:
        config: a path or shipped name (:func:`resolve_config_path`); its ``inherit:`` chain
            is merged first.
        overrides: ``key=value`` (or ``~key``) strings, as on the command line.

    Returns:
        The merged config, not yet validated.

    Raises:
        FileNotFoundError: the config (or one it inherits from) does not exist.
        ConfigError: a file is not valid YAML (file, line and column named), an override is
            malformed or names a path not in the config, or the ``inherit:`` chain is circular.
    """
    from torchtune.config._utils import _merge_yaml_and_cli_args

    yaml_cfg = _load_with_inheritance(resolve_config_path(config), seen=())
    for item in overrides or []:
        if "=" not in item and not item.startswith("~"):
            raise ConfigError(
                f"override {item!r} is not of the form key=value (use --config for the file)"
            )
    plain, direct = _split_overrides(yaml_cfg, list(overrides or []))
    namespace = argparse.Namespace(**OmegaConf.to_container(yaml_cfg, resolve=False))
    try:
        cfg = _merge_yaml_and_cli_args(namespace, plain)
    except Exception as exc:  # omegaconf's grammar errors on a malformed key=value
        raise ConfigError(f"overrides {' '.join(plain)}: {one_line(str(exc))}") from None
    for key, raw in direct:
        _set_path(cfg, key, raw)
    return cfg


def _split_overrides(cfg: DictConfig, overrides: list[str]) -> tuple[list[str], list[tuple]]:
    """Overrides torchtune's parser handles, and ``(key, value)`` pairs it gets wrong: a list
    index (``rewards.0.weight=0.5``) and ``null`` for a whole node (``eval_dataset=null``).
    """
    plain, direct = [], []
    for item in overrides:
        key, eq, raw = item.partition("=")
        parts = key.split(".")
        is_null = raw.strip() in ("null", "None", "~")
        if eq and not key.startswith("~") and (
                any(p.isdigit() for p in parts)
                or (is_null and isinstance(OmegaConf.select(cfg, key, default=None),
                                           DictConfig))):
            direct.append((key, raw))
        else:
            plain.append(item)
    return plain, direct


def _set_path(cfg: DictConfig, key: str, raw: str) -> None:
    """Set ``key`` (dotted, list indices allowed) to the YAML value ``raw``; a missing path is a
    :class:`ConfigError`.
    """
    import yaml

    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {key}={raw}: the value is not valid YAML "
                          f"({getattr(exc, 'problem', None) or exc})") from None
    parts = key.split(".")
    node: Any = cfg
    for depth, part in enumerate(parts[:-1]):
        where = ".".join(parts[: depth + 1])
        if isinstance(node, ListConfig):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"override {key}={raw}: {'.'.join(parts[:depth]) or 'config'} "
                                 f"is a list of {len(node)} entries; {part!r} is not an index "
                                 "of it")
            node = node[int(part)]
        elif isinstance(node, DictConfig) and part in node and node[part] is not None:
            node = node[part]
        else:
            raise ConfigError(f"override {key}={raw}: {where} is not in the config")
    last = parts[-1]
    if isinstance(node, ListConfig):
        if not last.isdigit() or int(last) >= len(node):
            raise ConfigError(f"override {key}={raw}: the list has {len(node)} entries; "
                             f"{last!r} is not an index of it")
        node[int(last)] = value
    else:
        node[last] = value


#: Top-level key naming a config this one starts from (merged first, this file on top).
INHERIT_KEY = "inherit"


def _read_yaml(path: Path) -> Any:
    """``path`` loaded by OmegaConf; a YAML error is a :class:`ConfigError` naming file, line and
    column (from 1).
    """
    import yaml

    try:
        return OmegaConf.load(path)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = (f"{path}" if mark is None
                 else f"{path}, line {mark.line + 1}, column {mark.column + 1}")
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"config {where}: not valid YAML ({problem})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config {path} is not a text file ({exc.reason})") from None


def _load_with_inheritance(path: Path, seen: tuple[Path, ...]) -> DictConfig:
    """Load ``path``; when it has ``inherit: NAME``, merge it over that config."""
    if path.resolve() in seen:
        raise ConfigError(f"config {path}: circular '{INHERIT_KEY}' chain")
    cfg = _read_yaml(path)
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"config {path} must be a mapping of keys to values")
    parent = cfg.pop(INHERIT_KEY, None)
    if parent is None:
        return cfg
    base = _load_with_inheritance(resolve_config_path(str(parent)), (*seen, path.resolve()))
    # a node given with a new _component_ replaces the inherited node instead of merging into it
    for key in list(cfg.keys()):
        node = cfg[key]
        if (isinstance(node, DictConfig) and "_component_" in node and key in base
                and isinstance(base[key], DictConfig)
                and base[key].get("_component_") != node["_component_"]):
            base.pop(key)
    return OmegaConf.merge(base, cfg)


def parse(recipe_main: Callable[[DictConfig], Any]) -> Callable[[], Any]:
    """Decorator for a recipe's ``main``: ``--config NAME [key=value ...]`` from ``sys.argv``.

    A user mistake prints one line and exits 2, an interruption before anything was saved exits
    130 (:func:`~torchtune_grpo.errors.reported_as_one_line`).

    Args:
        recipe_main: the recipe's entry point, called with the loaded config.

    Returns:
        A function of no arguments that parses ``sys.argv``, runs ``recipe_main`` and exits
        with its return value.
    """

    @functools.wraps(recipe_main)
    def wrapper() -> Any:
        parser = argparse.ArgumentParser(description=recipe_main.__doc__)
        parser.add_argument("--config", required=True, help="config path or shipped name")
        args, overrides = parser.parse_known_args()
        flags = [o for o in overrides if o.startswith("--")]
        if flags:
            parser.error(f"unsupported flags {flags}: use --config and key=value overrides")
        with reported_as_one_line():
            sys.exit(recipe_main(load_config(args.config, overrides)))

    return wrapper
