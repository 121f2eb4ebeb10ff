"""Service configuration: one frozen dataclass per service, every field a flag and an env var.

A service declares its settings as a flat frozen dataclass with an attribute docstring under
each field, and validates in ``__post_init__`` with :func:`check`::

    @dataclass(frozen=True)
    class PrefillConfig:
        max_num_seqs: int = 64
        \"\"\"Most sequences running at once.\"\"\"

        def __post_init__(self) -> None:
            check(self.max_num_seqs > 0, "max_num_seqs", "must be > 0")

    config = config_or_exit(PrefillConfig, argv, "prefill")

Field ``max_num_seqs`` becomes the flag ``--max-num-seqs`` and the environment variable
``EPD_PREFILL_MAX_NUM_SEQS`` (what Helm sets). A flag beats the environment, which beats the
default. Supported field types: ``int``, ``float``, ``str``, ``bool`` (``--x`` / ``--no-x``; the
environment takes 1/0, true/false, yes/no), ``X | None`` ("none" or "" is None) and
``tuple[X, ...]`` (comma-separated, or the flag repeated). Every error names both spellings::

    --max-num-seqs / EPD_PREFILL_MAX_NUM_SEQS: must be > 0 (got 0)
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import logging
import os
import sys
import textwrap
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

C = TypeVar("C")

_TRUE = ("1", "true", "yes")
_FALSE = ("0", "false", "no")
_SCALARS = (int, float, str, bool)
_EXPECTED = {int: "an integer", float: "a number", str: "a string",
             bool: "true/false, 1/0 or yes/no"}


class ConfigError(ValueError):
    """A setting is missing, malformed or out of range; ``field`` names it (None: unknown)."""

    def __init__(self, message: str, field: str | None = None, why: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.why = why if why is not None else message


def check(ok: bool, field: str, why: str) -> None:
    """Validation for ``__post_init__``: raise :class:`ConfigError` for ``field`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{field}: {why}", field=field, why=why)


@dataclasses.dataclass(frozen=True)
class _Option:
    """How one dataclass field is spelled and parsed."""

    name: str
    flag: str
    env: str
    kind: type
    """The scalar type: int, float, str or bool (the element type for tuples)."""
    is_optional: bool
    is_tuple: bool
    default: Any
    """``dataclasses.MISSING`` for a required field."""
    doc: str

    @property
    def spellings(self) -> str:
        return f"{self.flag} / {self.env}"


def env_prefix(service: str) -> str:
    return f"EPD_{service.upper().replace('-', '_')}_"


def build_parser(cls: type, service: str, prog: str | None = None) -> argparse.ArgumentParser:
    """The argparse parser for ``cls``; values come back as text that parse_config converts."""
    parser = _Parser(
        prog=prog or f"python -m services.{service}",
        description=_docstrings(cls).get("", None),
        epilog=f"Every flag can also be set as the environment variable"
               f" {env_prefix(service)}<FIELD>; a flag beats the environment, which beats the"
               " default.",
        argument_default=argparse.SUPPRESS, allow_abbrev=False)
    for opt in _options(cls, service):
        default = '""' if opt.default in ("", ()) else _text(opt.default)
        shown = "required" if opt.default is dataclasses.MISSING else f"default {default}"
        help_text = f"{opt.doc} [env {opt.env}; {shown}]".strip().replace("%", "%%")
        if opt.kind is bool and not opt.is_tuple:
            parser.add_argument(opt.flag, dest=opt.name, action=argparse.BooleanOptionalAction,
                                help=help_text)
        elif opt.is_tuple:
            parser.add_argument(opt.flag, dest=opt.name, action="append", help=help_text,
                                metavar=f"{opt.kind.__name__.upper()},...")
        else:
            parser.add_argument(opt.flag, dest=opt.name, help=help_text,
                                metavar=opt.kind.__name__.upper())
    return parser


def parse_config(cls: type[C], argv: list[str] | None, service: str,
                 env: Mapping[str, str] | None = None) -> C:
    """Build ``cls`` from flags (``argv``; None is ``sys.argv[1:]``), then ``env``, then defaults.

    Raises :class:`ConfigError` with a message naming the flag and the env var; ``--help`` prints
    and raises ``SystemExit(0)`` as argparse does.
    """
    env = os.environ if env is None else env
    options = _options(cls, service)
    parsed = vars(build_parser(cls, service).parse_args(argv))
    _warn_unknown_env(env, service, options)
    values: dict[str, Any] = {}
    for opt in options:
        if opt.name in parsed:
            values[opt.name] = _convert(opt, parsed[opt.name])
        elif opt.env in env:
            values[opt.name] = _convert(opt, env[opt.env])
        elif opt.default is dataclasses.MISSING:
            raise ConfigError(f"{opt.spellings}: is required", field=opt.name, why="is required")
    try:
        return cls(**values)
    except ConfigError as e:
        opt = next((o for o in options if o.name == e.field), None)
        if opt is None:
            raise
        value = values.get(opt.name, opt.default)
        raise ConfigError(f"{opt.spellings}: {e.why} (got {value!r})", e.field, e.why) from None


def config_or_exit(cls: type[C], argv: list[str] | None, service: str,
                   env: Mapping[str, str] | None = None, prog: str | None = None) -> C:
    """:func:`parse_config` for a ``main()``: on a bad setting print usage and the error, exit 2."""
    try:
        return parse_config(cls, argv, service, env)
    except ConfigError as e:
        parser = build_parser(cls, service, prog)
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def to_argv(config: Any, defaults_too: bool = False) -> list[str]:
    """Flags that rebuild ``config`` (the launcher passes them to child processes).

    An optional tuple that is empty (not None) cannot be spelled, since "" means None there.
    """
    argv: list[str] = []
    for opt in _options(type(config), "unused"):  # env names play no part here
        value = getattr(config, opt.name)
        if not defaults_too and opt.default is not dataclasses.MISSING and value == opt.default:
            continue
        if isinstance(value, bool) and not opt.is_tuple:
            argv.append(opt.flag if value else "--no-" + opt.flag[2:])
        else:
            argv += [opt.flag, _text(value)]
    return argv


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:  # argparse would exit; let callers decide
        raise ConfigError(message)


@functools.cache
def _options(cls: type, service: str) -> tuple[_Option, ...]:
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    hints = typing.get_type_hints(cls)
    docs = _docstrings(cls)
    options = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        kind, is_optional, is_tuple = _parse_type(hints[f.name], f"{cls.__name__}.{f.name}")
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        options.append(_Option(f.name, "--" + f.name.replace("_", "-"),
                               env_prefix(service) + f.name.upper(), kind, is_optional, is_tuple,
                               default, docs.get(f.name, "")))
    return tuple(options)


def _parse_type(annotation: Any, where: str) -> tuple[type, bool, bool]:
    """``(scalar type, is_optional, is_tuple)`` for a field annotation."""
    is_optional = False
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            annotation, is_optional = rest[0], True
    if typing.get_origin(annotation) is tuple:
        args = typing.get_args(annotation)
        if len(args) == 2 and args[1] is Ellipsis and args[0] in _SCALARS:
            return args[0], is_optional, True
    elif annotation in _SCALARS:
        return annotation, is_optional, False
    raise TypeError(f"{where}: config fields are int, float, str, bool, X | None or tuple[X, ...];"
                    f" not {annotation!r}")


def _docstrings(cls: type) -> dict[str, str]:
    """Attribute docstrings of ``cls`` and its dataclass bases; "" maps to the class docstring."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue  # builtins, or a class made where its source is not on disk
        node = tree.body[0]
        if not isinstance(node, ast.ClassDef):
            continue
        if (doc := ast.get_docstring(node)) is not None:
            docs[""] = doc
        for field, after in zip(node.body, node.body[1:]):
            if (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                docs[field.target.id] = " ".join(after.value.value.split())
    return docs


def _convert(opt: _Option, raw: str | list[str] | bool) -> Any:
    """Text from a flag or the environment to the field's type (flag bools arrive as bool)."""
    if isinstance(raw, bool):
        return raw
    if opt.is_optional:
        whole = raw if isinstance(raw, str) else ",".join(raw)
        if whole.strip().lower() in ("", "none"):
            return None
    if opt.is_tuple:
        chunks = [raw] if isinstance(raw, str) else raw
        items = [item.strip() for chunk in chunks for item in chunk.split(",") if item.strip()]
        return tuple(_scalar(opt, item) for item in items)
    assert isinstance(raw, str)
    return _scalar(opt, raw)


def _scalar(opt: _Option, text: str) -> Any:
    try:
        if opt.kind is bool:
            if text.strip().lower() in _TRUE + _FALSE:
                return text.strip().lower() in _TRUE
            raise ValueError(text)
        return opt.kind(text.strip()) if opt.kind is not str else text
    except ValueError:
        why = f"expected {_EXPECTED[opt.kind]}"
        raise ConfigError(f"{opt.spellings}: {why} (got {text!r})", opt.name, why) from None


def _text(value: Any) -> str:
    """A value as a flag or env var spells it."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return ",".join(_text(v) for v in value)
    return str(value)


def _warn_unknown_env(env: Mapping[str, str], service: str, options: tuple[_Option, ...]) -> None:
    """A misspelled variable would otherwise be ignored in silence."""
    known = {opt.env for opt in options}
    for name in sorted(k for k in env if k.startswith(env_prefix(service)) and k not in known):
        logger.warning("ignoring %s: %s has no such setting", name, service)
