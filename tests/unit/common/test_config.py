"""Every config field is a flag and an env var; errors name both; to_argv inverts parse_config."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.common.config import (ConfigError, build_parser, check, config_or_exit, parse_config,
                                    to_argv)

ROOT = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class DemoConfig:
    """A demo service."""

    max_num_seqs: int = 64
    """Most sequences running at once (100% of them)."""
    kv_cache_gib: float = 2.0
    """Memory for the KV block pool."""
    model: str | None = None
    """Model name or path."""
    max_model_len: int | None = 4096
    """Context limit."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks across requests."""
    stop: tuple[str, ...] = ()
    """Stop strings."""
    ports: tuple[int, ...] = (1, 2)
    """Peer ports."""
    name: str = "demo"

    def __post_init__(self) -> None:
        check(self.max_num_seqs > 0, "max_num_seqs", "must be > 0")
        check(self.max_model_len is None or self.max_model_len > 1, "max_model_len", "must be > 1")


def parse(argv: list[str], **env: str) -> DemoConfig:
    return parse_config(DemoConfig, argv, "prefill", env)


def test_defaults():
    assert parse([]) == DemoConfig()


def test_flag_beats_env_beats_default():
    assert parse([], EPD_PREFILL_MAX_NUM_SEQS="8").max_num_seqs == 8
    assert parse(["--max-num-seqs", "4"], EPD_PREFILL_MAX_NUM_SEQS="8").max_num_seqs == 4
    assert parse(["--kv-cache-gib=0.5"]).kv_cache_gib == 0.5
    assert parse([], EPD_DECODE_MAX_NUM_SEQS="8").max_num_seqs == 64  # another service's


@pytest.mark.parametrize("text, value", [
    ("1", True), ("0", False), ("true", True), ("FALSE", False), ("Yes", True), ("no", False)])
def test_bool_env_forms(text, value):
    assert parse([], EPD_PREFILL_ENABLE_PREFIX_CACHING=text).enable_prefix_caching is value


def test_bool_flags():
    assert parse(["--no-enable-prefix-caching"]).enable_prefix_caching is False
    assert parse(["--enable-prefix-caching"], EPD_PREFILL_ENABLE_PREFIX_CACHING="0"
                 ).enable_prefix_caching is True


def test_optional():
    assert parse(["--model", "m.gguf"]).model == "m.gguf"
    assert parse(["--max-model-len", "none"]).max_model_len is None
    assert parse([], EPD_PREFILL_MAX_MODEL_LEN="").max_model_len is None
    assert parse([], EPD_PREFILL_MAX_MODEL_LEN="None").max_model_len is None
    assert parse(["--max-model-len", "100"], EPD_PREFILL_MAX_MODEL_LEN="none").max_model_len == 100


def test_tuples():
    assert parse(["--stop", "a,b", "--stop", "c"]).stop == ("a", "b", "c")
    assert parse([], EPD_PREFILL_STOP="x, y").stop == ("x", "y")
    assert parse([], EPD_PREFILL_PORTS="").ports == ()
    assert parse(["--ports", "7,8"]).ports == (7, 8)


@pytest.mark.parametrize("argv, env, message", [
    (["--max-num-seqs", "abc"], {},
     "--max-num-seqs / EPD_PREFILL_MAX_NUM_SEQS: expected an integer (got 'abc')"),
    ([], {"EPD_PREFILL_KV_CACHE_GIB": "lots"},
     "--kv-cache-gib / EPD_PREFILL_KV_CACHE_GIB: expected a number (got 'lots')"),
    ([], {"EPD_PREFILL_ENABLE_PREFIX_CACHING": "maybe"},
     "--enable-prefix-caching / EPD_PREFILL_ENABLE_PREFIX_CACHING: expected true/false, 1/0 or"
     " yes/no (got 'maybe')"),
    (["--ports", "1,x"], {}, "--ports / EPD_PREFILL_PORTS: expected an integer (got 'x')"),
    (["--max-num-seqs", "0"], {}, "--max-num-seqs / EPD_PREFILL_MAX_NUM_SEQS: must be > 0 (got 0)"),
    ([], {"EPD_PREFILL_MAX_MODEL_LEN": "1"},
     "--max-model-len / EPD_PREFILL_MAX_MODEL_LEN: must be > 1 (got 1)"),
])
def test_errors_name_flag_and_env(argv, env, message):
    with pytest.raises(ConfigError) as info:
        parse(argv, **env)
    assert str(info.value) == message


def test_error_carries_field_and_direct_construction_names_the_field():
    with pytest.raises(ConfigError) as info:
        parse(["--max-num-seqs", "-1"])
    assert info.value.field == "max_num_seqs" and info.value.why == "must be > 0"
    with pytest.raises(ConfigError, match=r"^max_num_seqs: must be > 0$"):
        DemoConfig(max_num_seqs=0)


def test_unknown_flag_and_abbreviation_are_errors():
    with pytest.raises(ConfigError, match="unrecognized arguments: --bogus"):
        parse(["--bogus", "1"])
    with pytest.raises(ConfigError, match="unrecognized arguments: --max-num"):
        parse(["--max-num", "1"])


def test_required_field():
    @dataclass(frozen=True)
    class Needs:
        model: str
        """The model."""

    assert parse_config(Needs, [], "x", {"EPD_X_MODEL": "m"}).model == "m"
    with pytest.raises(ConfigError, match="^--model / EPD_X_MODEL: is required$"):
        parse_config(Needs, [], "x", {})


def test_unsupported_type_is_a_bug():
    @dataclass(frozen=True)
    class Bad:
        mapping: dict = dataclasses.field(default_factory=dict)

    with pytest.raises(TypeError, match="Bad.mapping"):
        parse_config(Bad, [], "x", {})


def test_help_shows_docstrings_env_names_and_defaults():
    text = build_parser(DemoConfig, "prefill").format_help()
    assert "A demo service." in text
    assert "Most sequences running at once (100% of them)." in text
    assert "EPD_PREFILL_MAX_NUM_SEQS" in text and "default 64" in text
    assert "--no-enable-prefix-caching" in text and 'default ""' in text


def test_help_exits_zero(capsys):
    with pytest.raises(SystemExit) as info:
        parse(["--help"])
    assert info.value.code == 0
    assert "EPD_PREFILL_KV_CACHE_GIB" in capsys.readouterr().out


def test_config_or_exit_prints_the_message_and_exits_2(capsys):
    with pytest.raises(SystemExit) as info:
        config_or_exit(DemoConfig, ["--max-num-seqs", "0"], "prefill", {})
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m services.prefill")
    assert err.endswith("error: --max-num-seqs / EPD_PREFILL_MAX_NUM_SEQS: must be > 0 (got 0)\n")


def test_from_a_main_no_traceback():
    code = ("from tests.unit.common.test_config import DemoConfig;"
            "from services.common.config import config_or_exit;"
            "config_or_exit(DemoConfig, None, 'prefill')")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={"EPD_PREFILL_MAX_NUM_SEQS": "0", "PATH": "/usr/bin:/bin"},
                          timeout=60)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "--max-num-seqs / EPD_PREFILL_MAX_NUM_SEQS: must be > 0 (got 0)" in done.stderr


@pytest.mark.parametrize("config", [
    DemoConfig(),
    DemoConfig(max_num_seqs=3, kv_cache_gib=0.25, model="a b.gguf", max_model_len=None,
               enable_prefix_caching=False, stop=("x", "y z"), ports=(), name=""),
])
def test_to_argv_round_trip(config):
    assert parse(to_argv(config)) == config
    assert parse(to_argv(config, defaults_too=True)) == config


def test_to_argv_spells_only_what_differs():
    assert to_argv(DemoConfig()) == []
    assert to_argv(DemoConfig(max_num_seqs=3, enable_prefix_caching=False, model="m")) == [
        "--max-num-seqs", "3", "--model", "m", "--no-enable-prefix-caching"]
    assert to_argv(DemoConfig(), defaults_too=True)[:4] == [
        "--max-num-seqs", "64", "--kv-cache-gib", "2.0"]


def test_misspelled_env_var_is_logged(caplog):
    parse([], EPD_PREFILL_MAX_NUM_SEQ="3")
    assert "ignoring EPD_PREFILL_MAX_NUM_SEQ" in caplog.text
