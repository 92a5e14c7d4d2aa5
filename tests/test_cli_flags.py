"""clef-systemone's flags: two help levels (``--help`` the common flags, ``--help-all`` every one) and
``--config FILE`` (YAML or JSON) read before the command line (clef_vllm/server/flags.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from clef_vllm.server.cli import build_parser, main
from clef_vllm.server.flags import BASIC, SECTIONS, config_args, with_config
from clef_vllm.testing.server import LiveServer

#: The ceiling on the flags ``--help`` lists (-h itself included).
MOST_FLAGS = 30


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clef_vllm.server.cli", *args], capture_output=True, text=True,
                          timeout=120)


def refused(monkeypatch, capsys, *args: str) -> subprocess.CompletedProcess:
    """``clef-systemone ARGS`` run in this process, for flags it refuses before it starts anything (no interpreter
    and torch start-up a call), reported as :func:`run_cli` reports it. Flags it accepts stop the test where the
    server would begin to start."""
    def accepted():
        raise AssertionError(f"clef-systemone {' '.join(args)}: accepted")

    monkeypatch.setattr("clef_vllm.util.heap.bound_native_caches", accepted)   # main's first step after its flags
    try:
        code = main(list(args))
    except SystemExit as exit_:
        code = exit_.code
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["clef-systemone", *args], code, out.out, out.err)


def listed_flags(text: str) -> list[str]:
    """The first option string of each flag line of a help text."""
    return re.findall(r"^  (-{1,2}[a-z][a-z0-9-]*)", text, flags=re.M)


def every_flag() -> set[str]:
    return {a.option_strings[0] for a in build_parser()._actions if a.option_strings}


def test_help_lists_the_common_flags_only_grouped():
    done = run_cli("--help")
    assert done.returncode == 0, done.stderr
    flags = listed_flags(done.stdout)
    assert len(flags) <= MOST_FLAGS, flags
    for needed in ("--model", "--host", "--port", "--dialect", "--max-model-len", "--api-key", "--log-format",
                   "--data-parallel-size", "--headless", "--gpu-memory-utilization", "--max-num-seqs",
                   "--state-cache", "--help-all", "--config"):
        assert needed in flags, needed
    for tuning in ("--gemm-warmup", "--prefill-graph-buckets", "--header-timeout", "--step-graph-split",
                   "--engines-per-gpu", "--max-batch-size"):
        assert tuning not in flags, tuning
    titles = re.findall(r"^([a-zA-Z][^\n]*):\n", done.stdout, flags=re.M)
    assert titles[1:] == ["model and backend", "serving", "limits and admission control", "auth and browsers",
                          "logs and metrics", "parallelism: vLLM data parallelism (docs/deploy.md)",
                          "GPU memory and state reuse"], titles
    assert "--help-all" in done.stdout and "every flag" in done.stdout


def test_help_all_lists_every_flag_once_in_its_section():
    done = run_cli("--help-all")
    assert done.returncode == 0, done.stderr
    flags = listed_flags(done.stdout)
    assert set(flags) == every_flag()
    assert len(flags) == len(set(flags))
    for _key, title in SECTIONS:
        assert f"\n{title}:\n" in done.stdout, title
    assert len(flags) > MOST_FLAGS


def test_help_levels_do_not_change_defaults():
    """A tuning flag left out of --help keeps its default; every common flag's destination exists."""
    parser = build_parser()
    dests = {a.dest for a in parser._actions}
    assert BASIC <= dests | {"help", "help_all", "version"}
    args = parser.parse_args([])
    assert args.gc_freeze is True and args.header_timeout == 10.0 and args.max_bulk_lines == 100_000
    assert not hasattr(args, "gemm_warmup")        # backend flags: absent unless given (the backend's default)


def test_config_file_yaml_fills_flags_and_the_command_line_wins(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("port: 8123\nmax_model_len: 4096\ngc-freeze: false\napi-key: [a, b]\nno-warmup: true\n"
                    "state-cache: off\nheadless: false\n")
    parser = build_parser()
    argv = with_config(parser, ["--config", str(path), "--port", "9", "--api-key", "c"])
    args = parser.parse_args(argv)
    assert args.port == 9 and args.max_model_len == 4096 and args.gc_freeze is False
    assert args.api_key == ["a", "b", "c"]            # a repeatable flag adds to the file's values
    assert args.warmup is False and args.state_cache is False
    assert not getattr(args, "headless", False)


def test_config_file_json(tmp_path):
    path = tmp_path / "serve.json"
    path.write_text(json.dumps({"dialect": "workers-ai", "max-in-flight": 3, "prefill_graphs": True}))
    parser = build_parser()
    args = parser.parse_args(with_config(parser, [f"--config={path}"]))
    assert args.dialect == "workers-ai" and args.max_in_flight == 3 and args.prefill_graphs is True


@pytest.mark.parametrize("text, message", [
    ("bogus: 1\n", "unknown key 'bogus' (no flag --bogus"),
    ("port: [1, 2]\n", "'port' takes one value"),
    ("headless: yes please\n", "'headless' is a switch: give true or false"),
    ("- port\n", "must hold a mapping of flag names to values, got a list"),
    ("port: [\n", "is not valid YAML"),
    ("help-all: true\n", "unknown key 'help-all'"),
])
def test_config_file_errors_exit_2_naming_the_key(tmp_path, monkeypatch, capsys, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    done = refused(monkeypatch, capsys, "--config", str(path))
    assert done.returncode == 2
    assert "--config: " in done.stderr and message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_config_file_missing_exits_2(tmp_path, monkeypatch, capsys):
    done = refused(monkeypatch, capsys, "--config", str(tmp_path / "nope.yaml"))
    assert done.returncode == 2 and "cannot read" in done.stderr and "Traceback" not in done.stderr


def test_config_value_of_the_wrong_type_is_refused_by_its_flag(tmp_path, monkeypatch, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("max-queue: many\n")
    done = refused(monkeypatch, capsys, "--config", str(path))
    assert done.returncode == 2 and "--max-queue: invalid _non_negative_int value: 'many'" in done.stderr


def test_config_args_spell_keys_either_way():
    parser = build_parser()
    assert config_args(parser, {"max_model_len": 5, "max-model-len": 6}, "f") == \
        ["--max-model-len", "5", "--max-model-len", "6"]


def test_a_server_started_from_a_config_file(tmp_path):
    """A real server reads its names and limits from the file (the port stays the command line's)."""
    path = tmp_path / "serve.yaml"
    path.write_text("model: demo\nbackend: reference\nserved-model-name: [from-file]\nmax-in-flight: 3\n")
    server = LiveServer(["--config", str(path)]).wait_ready()
    try:
        status, text = server.call("/v1/models")
        assert status == 200 and [m["id"] for m in json.loads(text)["data"]] == ["from-file"]
        status, text = server.call("/metrics")
        assert status == 200 and re.search(r"^clef_max_in_flight 3(\.0)?$", text, flags=re.M), text[:2000]
    finally:
        server.stop()
