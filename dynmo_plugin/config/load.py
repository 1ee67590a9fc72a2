"""Resolving a `RunConfig`: dataclass defaults, then the YAML file, then the flags given.

The YAML file (`--dynmo-config PATH`) holds the plugin's sections at its top level and
the launcher's `model:` section; a flag wins over the file. Every value is type-checked
and field-checked as it is set, then `config.checks` runs once across fields. Every
problem is a `ConfigError` line naming where the value came from, the key in dotted
form and what was expected, e.g.
``configs/x.yaml: rebalance.interval: expected a positive integer, got -3``.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import os
import re
from typing import Any, Callable, Optional

import yaml

from dynmo_plugin.config.checks import check_run, check_transformer_impl
from dynmo_plugin.config.fields import ConfigError
from dynmo_plugin.config.flags import flag_of, leaf_fields
from dynmo_plugin.config.megatron_flags import apply_megatron_compat
from dynmo_plugin.config.schema import DynmoConfig, ModelArgs, RunConfig

__all__ = ["load_config"]


def _expect_type(f: dataclasses.Field, value: Any) -> tuple[Any, Optional[str]]:
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    if f.metadata.get("kind") == "layouts":
        return _layouts(value)
    if value is None and t.startswith("Optional"):
        return None, None
    base = t.replace("Optional[", "").rstrip("]")
    if base == "bool":
        return value, None if isinstance(value, bool) else "true or false"
    if base == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
        if ok and not -2**63 <= value < 2**63:  # torch, numpy and the seeds take 64-bit integers
            return value, "an integer of 64 bits (below 2**63)"
        return value, None if ok else "an integer"
    if base == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok and not math.isfinite(value):  # inf/nan: `nan > 0` fails a check, `inf > 0` passes
            return value, "a finite number"
        return (float(value) if ok else value), None if ok else "a number"
    if base == "str":
        return value, None if isinstance(value, str) else "a string"
    raise TypeError(f"unsupported config field type {t}")


def _layouts(value: Any) -> tuple[Any, Optional[str]]:
    """Forced layouts: a YAML mapping {iteration: layout} or the flag form '5:Ett|ttL;9:...'."""
    if isinstance(value, str):
        pairs = [p.split(":", 1) for p in value.split(";") if p.strip()]
        if any(len(p) != 2 for p in pairs):
            return value, "ITER:LAYOUT pairs separated by ';'"
        value = {k.strip(): v.strip() for k, v in pairs}
    if not isinstance(value, dict):
        return value, "a mapping of iteration to layout string"
    out = {}
    for k, v in value.items():
        text = k.strip() if isinstance(k, str) else k
        if isinstance(k, bool) or not (isinstance(k, int) or (isinstance(text, str) and text.isdecimal() and text.isascii())):
            return value, f"integer iterations as keys (got {k!r})"  # not 1e3, 2.5 or inf
        it = int(text)
        if it <= 0 or not isinstance(v, str):
            return value, "positive iterations mapped to layout strings"
        out[it] = v
    return out, None


def _apply(obj: Any, key: str, f: dataclasses.Field, value: Any, where: str, name: str) -> None:
    """Set `key` (dotted, relative to `obj`) after its type and check; errors name the
    setting as `name`, its full dotted key (model.num_layers, rebalance.interval)."""
    value, problem = _expect_type(f, value)
    if problem is None and value is not None and f.metadata.get("check"):
        problem = f.metadata["check"](value)
    if problem:
        raise ConfigError(f"{where}: {name}: expected {problem}, got {value!r}")
    target = obj
    for part in key.split(".")[:-1]:
        target = getattr(target, part)
    setattr(target, f.name, value)


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error
    (PyYAML keeps the last silently: two `model:` sections would drop the first)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, (str, int, float, bool)):
                continue  # an unhashable key: PyYAML's own error names it
            if key in seen:
                mark = key_node.start_mark
                raise ConfigError(f"{self.name}:{mark.line + 1}:{mark.column + 1}: key {key!r} "
                                  f"given twice (first on line {seen[key]}); keep one")
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


# YAML 1.2's floats: PyYAML resolves YAML 1.1's, whose exponent form needs a dot, so a
# learning rate written `3e-4` (as on the command line) was read as a string
_UniqueKeyLoader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"""^(?:
     [-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
    |[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?)$""", re.X), list("-+0123456789."))


_MAX_CONFIG_BYTES = 1 << 20  # the largest shipped config is ~2 KB


def _read_yaml(path: str) -> dict:
    """The YAML file as a dict; every way it can be unusable is one ConfigError line."""
    if os.path.isdir(path):
        raise ConfigError(f"{path}: cannot read the config file: it is a directory; give the "
                          "YAML file (e.g. configs/demo.yaml)")
    if not os.path.exists(path):
        raise ConfigError(f"{path}: cannot read the config file: no such file")
    try:
        with open(path, "rb") as fh:  # bounded: a device such as /dev/zero never ends
            raw = fh.read(_MAX_CONFIG_BYTES + 1)
        if len(raw) > _MAX_CONFIG_BYTES:
            raise ConfigError(f"{path}: larger than {_MAX_CONFIG_BYTES >> 20} MiB, not a config "
                              "file; give the YAML file (e.g. configs/demo.yaml)")
        text = raw.decode("utf-8-sig")
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config file: {e.strerror}") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}: {e.object[e.start]:#04x}); "
                          "save the config file as UTF-8") from e
    loader = None
    try:
        loader = _UniqueKeyLoader(text)  # checks the characters: may raise already
        loader.name = path
        data = loader.get_single_data()
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        at = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        what = " ".join(x for x in (e.context, e.problem) if x)
        raise ConfigError(f"{path}{at}: not valid YAML: {what}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {str(e).splitlines()[0]}") from e
    finally:
        if loader is not None:
            loader.dispose()
    if data is None:  # an empty file, or only comments: most likely the wrong file
        raise ConfigError(f"{path}: the config file holds no settings (it is empty or only "
                          "comments); give the YAML with your settings, or drop --dynmo-config")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level, got {type(data).__name__}")
    return data


def _flatten(data: dict, known: dict, path: str, prefix: str = "") -> dict:
    """{dotted key: value} for a nested YAML mapping; unknown keys, dotted spellings and
    sections given as plain values are errors naming the key in dotted form."""
    flat = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        section = any(n.startswith(key + ".") for n in known)
        if isinstance(k, str) and "." in k:
            parts = key.split(".")
            nested = "".join(f"{p}: {{" for p in parts[:-1]) + f"{parts[-1]}: ...{'}' * (len(parts) - 1)}"
            raise ConfigError(f"{path}: {key}: dotted key names are not read; nest the key "
                              f"instead: {nested}")
        if key in known:
            flat[key] = v
        elif section and v is None:
            continue  # `rebalance:` with every key commented out: an empty section
        elif section and isinstance(v, dict):
            flat.update(_flatten(v, known, path, key + "."))
        elif section:
            children = sorted({n[len(key) + 1:].split(".")[0] for n in known if n.startswith(key + ".")})
            raise ConfigError(f"{path}: {key}: expected a section (a mapping of "
                              f"{', '.join(children)}), got {v!r}")
        else:
            siblings = sorted({n[len(prefix):].split(".")[0] for n in known if n.startswith(prefix)})
            raise ConfigError(f"{path}: {key}: unknown key; {_did_you_mean(str(k), prefix, siblings, known)}"
                              f"expected one of {', '.join(siblings)}")
    return flat


def _did_you_mean(name: str, prefix: str, siblings: list[str], known: dict) -> str:
    """The likely key, before the ~45 a section holds: a near spelling here
    (`num_layer`), or the same name in another section (`data:` is `model.data`)."""
    close = difflib.get_close_matches(name, siblings, n=1, cutoff=0.75)
    if close:
        return f"did you mean {prefix}{close[0]}? "
    if name in {n.split(".")[0] for n in known}:  # `profiling:` nested under `model:`
        return f"{name} is a top-level section, not under {prefix.rstrip('.')}; "
    elsewhere = sorted({".".join(parts[:i + 1]) for parts in (n.split(".") for n in known)
                        for i, part in enumerate(parts) if part == name})
    return f"{name} is {' or '.join(elsewhere[:2])}; " if elsewhere else ""


def load_config(args: argparse.Namespace, world_size: int | None = None, *,
                te_problem: Callable[[], Optional[str]],
                cuda_devices: Callable[[], int]) -> RunConfig:
    """Resolve defaults <- YAML <- flags into a validated `RunConfig`.

    `cuda_devices` and `te_problem` ask the machine (how many CUDA GPUs are visible; why
    Transformer Engine does not import, None if it does) to choose model.transformer_impl;
    they are called last, only when the answer matters. Both are the caller's to give:
    config/ never asks the machine itself (`dynmo_plugin.megatron.training.machine.load_run_config`
    passes this machine's; torchrun's pre-spawn check a `te_problem` that imports nothing).

    Raises:
        ConfigError: on any unknown key, wrong type, out-of-range or inconsistent value.
    """
    apply_megatron_compat(args)
    cfg = RunConfig(config_path=getattr(args, "dynmo_config", None))
    known = {f"model.{k}": (f, d) for k, f, d in leaf_fields(ModelArgs)}
    known.update({k: (f, d) for k, f, d in leaf_fields(DynmoConfig)})
    given: dict[str, str] = {}  # key -> where it was set
    if cfg.config_path:
        path = cfg.config_path
        for key, value in _flatten(_read_yaml(path), known, path).items():
            f, _ = known[key]
            _apply(cfg.model if key.startswith("model.") else cfg.dynmo,
                   key.removeprefix("model."), f, value, path, key)
            given[key] = path
    for key, (f, dest) in known.items():
        value = getattr(args, dest, None)
        if value is None or (value is False and f.type == "bool"):
            continue
        if key == "model.pipeline_model_parallel_layout" and not isinstance(value, str):
            value = str(value)  # Megatron-LM's args hold a parsed PipelineParallelLayerLayout
        _apply(cfg.model if key.startswith("model.") else cfg.dynmo,
               key.removeprefix("model."), f, value, f"flag {flag_of(f)}", key)
        given[key] = f"flag {flag_of(f)}"
    check_run(cfg, given, cfg.config_path or "command line", world_size)
    check_transformer_impl(cfg, given, cuda_devices(), te_problem)
    return cfg

