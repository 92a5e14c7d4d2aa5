"""``clef-systemone``'s command line (clef_vllm/server/cli.py) without starting a server: API keys from flags
or the environment, and a flag that would have no effect refused at start-up, naming the flag."""

from __future__ import annotations

import pytest


def test_api_keys_come_from_flags_or_the_environment():
    from clef_vllm.server.cli import api_keys, build_parser

    parse = build_parser().parse_args
    assert api_keys(parse([]), {"CLEF_API_KEY": "key-a, key-b,"}) == ("key-a", "key-b")
    assert api_keys(parse(["--api-key", "x", "--api-key", "y,z"]), {"CLEF_API_KEY": "key-a"}) == ("x", "y", "z")
    assert api_keys(parse([]), {}) == ()
    with pytest.raises(SystemExit):
        parse(["--max-in-flight", "0"])
    assert parse([]).cpu_inline_bytes == 4096 and parse(["--cpu-inline-bytes", "0"]).cpu_inline_bytes == 0
    with pytest.raises(SystemExit):
        parse(["--cpu-inline-bytes", "-1"])


@pytest.mark.parametrize("argv,flag", [(["--body-timeout", "0", "--min-body-rate", "1000"], "--min-body-rate:"),
                                       (["--auth-health-metrics"], "--auth-health-metrics:")])
def test_a_flag_that_would_have_no_effect_is_a_start_up_error_not_ignored(argv, flag, capsys, monkeypatch):
    """--body-timeout 0 turns the pause and the rate rule off, so a rate given with it would be ignored;
    --auth-health-metrics without any API key would protect nothing (and the operator meant it to)."""
    from clef_vllm.server.cli import API_KEY_ENV, main

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    with pytest.raises(SystemExit) as exit_:
        main(["--model", "demo", *argv])
    assert exit_.value.code == 2 and flag in capsys.readouterr().err


def test_a_sub_option_without_its_switch_is_a_cli_error_naming_the_flag(tiny_release, capsys):
    from clef_vllm.server.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--model", str(tiny_release), "--backend", "vllm", "--prefill-graph-buckets", "64,100"])
    assert exit_.value.code == 2
    assert "--prefill-graph-buckets:" in capsys.readouterr().err

    with pytest.raises(SystemExit) as exit_:
        main(["--model", str(tiny_release), "--backend", "vllm", "--head-graphs", "off", "--head-graph-records", "4"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--head-graph-records:" in err and "no effect with 'head_graphs' off" in err
