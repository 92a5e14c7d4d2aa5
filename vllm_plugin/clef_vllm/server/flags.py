"""How ``clef-systemone``'s flags are shown and where else they may come from.

* **Sections**: every flag belongs to one section (:data:`SECTIONS`, in the order ``--help`` prints them), named
  by its destination in :data:`SECTION_OF` (flags not named there go to the section their group was made for).
* **Two help levels**: ``--help`` lists the flags most servers need (:data:`BASIC`: model, serving, limits,
  auth, logs, parallelism, memory); ``--help-all`` lists every flag, the tuning ones included. A tuning flag
  works the same whether it is listed or not, and its default does not depend on the help level.
* **A config file**: ``--config FILE`` (YAML or JSON, one mapping of flag names to values, as ``vllm serve
  --config``) is read before the command line; a flag given on the command line wins over the file, a
  repeatable flag (``--api-key``…) adds to the file's values. An unknown key or a value of the wrong type is
  refused with exit status 2, naming the key.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

#: Sections in the order the help prints them: (key, title).
SECTIONS = (
    ("model", "model and backend"),
    ("serving", "serving"),
    ("limits", "limits and admission control"),
    ("security", "auth and browsers"),
    ("logs", "logs and metrics"),
    ("parallel", "parallelism: vLLM data parallelism (docs/deploy.md)"),
    ("memory", "GPU memory and state reuse"),
    ("connections", "connections and slow clients"),
    ("engine", "vLLM engine: kernels and speed features (docs/latency.md)"),
    ("reference", "reference backend"),
)

#: Destinations of the flags ``--help`` lists (``--help-all`` lists every flag).
BASIC = frozenset({
    "model", "served_model_name", "backend", "dtype", "device", "text_only",
    "host", "port", "dialect",
    "max_model_len", "over_length", "max_body_bytes", "max_in_flight", "max_queue", "request_timeout",
    "api_key", "cors_origins",
    "log_level", "log_format",
    "data_parallel_size", "data_parallel_size_local", "data_parallel_address", "headless",
    "gpu_memory_utilization", "max_num_seqs", "state_cache",
    "help", "help_all", "version", "config",
})

#: The section of each backend option's flag (by destination); the rest of the vLLM backend's go to ``engine``,
#: the rest of the reference backend's to ``reference``.
SECTION_OF = {
    "device": "model", "head_dtype": "model", "load_format": "model", "quantization": "model",
    "data_parallel_size": "parallel", "data_parallel_size_local": "parallel", "data_parallel_address": "parallel",
    "data_parallel_rpc_port": "parallel", "data_parallel_start_rank": "parallel",
    "data_parallel_backend": "parallel", "headless": "parallel", "rank_watchdog_s": "parallel",
    "engines_per_gpu": "parallel",
    "gpu_memory_utilization": "memory", "max_num_seqs": "memory", "max_num_batched_tokens": "memory",
    "nvfp4_kernel": "memory", "state_cache": "memory", "state_cache_admit": "memory",
    "state_cache_match": "memory", "reference_state_cache_mb": "memory", "state_cache_mb": "memory",
    "engine_core": "serving", "warmup": "serving",
}


class Sections:
    """The parser's argument groups, made in :data:`SECTIONS`' order."""

    def __init__(self, parser: argparse.ArgumentParser):
        self.groups = {key: parser.add_argument_group(title) for key, title in SECTIONS}

    def __getitem__(self, key: str):
        return self.groups[key]

    def for_option(self, name: str, default: str):
        """The group of a backend option's flag: :data:`SECTION_OF`, else ``default``."""
        return self.groups[SECTION_OF.get(name, default)]


def mark_tuning(parser: argparse.ArgumentParser) -> None:
    """Every flag of ``parser`` so far that is not in :data:`BASIC` is a tuning flag (``--help`` leaves it out);
    flags added later (another command's own, e.g. ``clef-serve-ray``'s) are listed."""
    parser.clef_tuning = frozenset(a.dest for a in parser._actions if a.dest not in BASIC)


class BasicHelp(argparse.Action):
    """``-h`` / ``--help``: the help without the tuning flags (:func:`mark_tuning`), then exit 0."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        tuning = getattr(parser, "clef_tuning", frozenset())
        hidden = [a for a in parser._actions if a.dest in tuning and a.help is not argparse.SUPPRESS]
        saved = [a.help for a in hidden]
        for action in hidden:
            action.help = argparse.SUPPRESS
        try:
            parser.print_help()
        finally:
            for action, text in zip(hidden, saved):
                action.help = text
        parser.exit()


class FullHelp(argparse.Action):
    """``--help-all``: every flag, then exit 0."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.print_help()
        parser.exit()


def add_help_flags(parser: argparse.ArgumentParser) -> None:
    """``-h/--help``, ``--help-all`` and ``--config`` (the parser must be made with ``add_help=False``), and a short
    usage line (the full one would list every flag in every error message)."""
    parser.usage = "%(prog)s [--model DIR] [FLAG ...]  (-h: the flags most servers need; --help-all: every flag)"
    parser.add_argument("-h", "--help", action=BasicHelp, help="show the flags most servers need and exit")
    parser.add_argument("--help-all", action=FullHelp, help="show every flag, the tuning ones included, and exit")
    parser.add_argument("--config", metavar="FILE", default=None,
                        help="read flags from a YAML or JSON file (a mapping: flag name without '--' -> value); "
                             "flags on the command line win over the file")


# --------------------------------------------------------------------------- --config FILE


def config_path(argv: list[str]) -> str | None:
    """The ``--config`` value in ``argv`` (the last one given), else ``None``."""
    found = None
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            found = argv[i + 1]
        elif arg.startswith("--config="):
            found = arg.split("=", 1)[1]
    return found


def read_config(path: str) -> dict[str, Any]:
    """The mapping in a YAML or JSON file; ValueError saying what is wrong."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        if path.endswith(".json"):
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as exc:  # noqa: BLE001 - yaml and json raise their own errors; the message says which line
        raise ValueError(f"{path} is not valid {'JSON' if path.endswith('.json') else 'YAML'}: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a mapping of flag names to values, got a {type(data).__name__}")
    return data


def config_args(parser: argparse.ArgumentParser, data: dict[str, Any], path: str) -> list[str]:
    """The file's mapping as command-line arguments of ``parser``; ValueError naming an unknown or ill-typed key.

    A key is a flag name without its dashes, with ``-`` or ``_`` (``max-model-len``, ``max_model_len``). A
    switch (``--headless``, ``--no-warmup``) takes ``true`` / ``false``; an on/off flag takes a boolean or
    ``on`` / ``off``; a repeatable flag takes a value or a list; any other flag one scalar value."""
    out: list[str] = []
    for key, value in data.items():
        if not isinstance(key, str) or not key.strip("-"):
            raise ValueError(f"{path}: key {key!r} is not a flag name")
        flag = "--" + key.strip("-").replace("_", "-")
        action = parser._option_string_actions.get(flag)
        if action is None or action.dest in ("help", "help_all", "config", "version"):
            raise ValueError(f"{path}: unknown key {key!r} (no flag {flag}; --help-all lists them)")
        out += _as_args(flag, action, value, path, key)
    return out


def _as_args(flag: str, action: argparse.Action, value: Any, path: str, key: str) -> list[str]:
    where = f"{path}: {key!r}"
    if action.nargs == 0:                                   # store_true / store_false switches
        if not isinstance(value, bool):
            raise ValueError(f"{where} is a switch: give true or false, got {value!r}")
        return [flag] if value else []
    if isinstance(action, argparse._AppendAction):
        values = value if isinstance(value, list) else [value]
        for v in values:
            _scalar(where, v)
        return [a for v in values for a in (flag, _text(v))]
    if isinstance(value, bool) and action.metavar == "{on,off}":
        return [flag, "on" if value else "off"]
    _scalar(where, value)
    return [flag, _text(value)]


def _scalar(where: str, value: Any) -> None:
    if isinstance(value, (dict, list)) or value is None:
        raise ValueError(f"{where} takes one value, got {value!r}")


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def with_config(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``argv`` with the arguments of its ``--config`` file in front (the command line's own come after and
    win); exits with status 2 and the reason when the file cannot be used."""
    path = config_path(argv)
    if path is None:
        return argv
    try:
        return config_args(parser, read_config(path), path) + argv
    except ValueError as exc:
        parser.error(f"--config: {exc}")
