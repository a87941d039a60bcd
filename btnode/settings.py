"""Flag declarations on the config dataclasses: a field that a command-line flag fills says so once,
in its metadata (`flag(...)`: the flag, its help, swarm-wide or local). The CLI's options, the TOML
keys, the argv `btnode swarm` hands its nodes and `ModelConfig.to_flags` are derived from them.

Standard library only, below every layer, so any config module can declare its flags here."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import MISSING, dataclass, field
from typing import Any

from btnode.errors import ConfigError

KEY = "btnode.flag"  # the field metadata key that holds a Flag


@dataclass(frozen=True)
class Flag:
    """How a command line sets one config field."""

    names: str  # "--d-model"; a switch with an off form: "--memory-check/--no-memory-check"
    help: str
    param: str  # the Python parameter name (and so BTNODE_<COMMAND>_<PARAM>)
    swarm_wide: bool = False  # must agree across the swarm: hashed into the run fingerprint
    value: type | None = None  # the flag's type where it is not the field's (--segments: str)
    parse: Callable[[Any], Any] | None = None  # flag value → field value; a ValueError becomes a ConfigError
    format: Callable[[Any], Any] | None = None  # field value → flag value (parse's inverse); None: leave the flag out
    optional: bool = False  # no default on the command line: absent means the config decides (--outer-lr)
    min: float | None = None

    @property
    def name(self) -> str:
        return self.names.split("/")[0]

    def outward(self, value: Any) -> Any:
        """A field value as the flag's value."""
        return self.format(value) if self.format is not None and value is not None else value

    def tokens(self, value: Any) -> list[str]:
        """The argv that gives this flag `value` (a flag value, after format)."""
        if value is None:
            return []
        if isinstance(value, bool):
            on, _, off = self.names.partition("/")
            return [on] if value else [off] if off else []
        return [self.name, str(value)]


def flag(names: str, help: str, *, default: Any = MISSING, param: str = "", swarm_wide: bool = False,
         value: type | None = None, parse: Callable[[Any], Any] | None = None,
         format: Callable[[Any], Any] | None = None, optional: bool = False, min: float | None = None) -> Any:
    """A dataclass field that the flag `names` fills (use it as the field's default)."""
    decl = Flag(names, help, param or names.split("/")[0].lstrip("-").replace("-", "_"), swarm_wide, value, parse,
                format, optional, min)
    return field(default=default, metadata={KEY: decl})


def same_flag(cls: type, name: str, *, default: Any = MISSING) -> Any:
    """A field filled by the flag that `cls.name` declares: one flag, two configs (--block names a
    worker's block and a stage's), declared once."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return field(default=f.default if default is MISSING else default, metadata=f.metadata)


@dataclass(frozen=True)
class Declared:
    """One declared flag of a config class, where it sits (nested configs included)."""

    owner: type  # the dataclass whose field it is
    path: tuple[str, ...]  # field names from the outer config: ("round", "deadline_s")
    flag: Flag
    default: Any  # the field's default, MISSING for a required field

    @property
    def cli_default(self) -> Any:
        """What the flag holds when it is not given."""
        if self.flag.optional or self.default is MISSING:
            return None
        return self.flag.outward(self.default)


def declared(cls: type, path: tuple[str, ...] = ()) -> Iterator[Declared]:
    """Every flag `cls` declares, in field order; a field holding a config (AggregatorConfig.round)
    contributes that config's flags."""
    for f in dataclasses.fields(cls):
        decl = f.metadata.get(KEY)
        if decl is not None:
            yield Declared(cls, (*path, f.name), decl, f.default)
        elif dataclasses.is_dataclass(f.default):
            yield from declared(type(f.default), (*path, f.name))


def param_of(cls: type, name: str) -> str:
    """The parameter name of the flag that fills field `name` of `cls`."""
    return next(d.flag.param for d in declared(cls) if d.path == (name,))


@dataclass(frozen=True)
class Section:
    """A config class as one command takes it: all its flags, or `only` some, less `omit`, with
    this command's own defaults and help where they differ (keyed by parameter name)."""

    cls: type
    only: tuple[str, ...] | None = None
    omit: tuple[str, ...] = ()
    defaults: Mapping[str, Any] = field(default_factory=dict)
    helps: Mapping[str, str] = field(default_factory=dict)

    def flags(self) -> list[Declared]:
        return [d for d in declared(self.cls) if d.flag.param not in self.omit
                and (self.only is None or d.flag.param in self.only)]


def section(spec: Section | type) -> Section:
    return spec if isinstance(spec, Section) else Section(spec)


def fill(cls: type, values: Mapping[str, Any], *, base: Any = None, **given: Any) -> Any:
    """`cls` from flag values keyed by parameter name. A flag that is absent or None leaves its field
    at `base`'s value (or the default); a required field stays None for the role to resolve
    (WorkerConfig.block); `given` fields are set as they are."""
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in given:
            continue
        decl = f.metadata.get(KEY)
        if decl is None:
            if dataclasses.is_dataclass(f.default) and base is None:
                kwargs[f.name] = build(type(f.default), values)
            continue
        v = values.get(decl.param)
        if v is None:
            if f.default is MISSING and f.default_factory is MISSING and base is None:
                kwargs[f.name] = None
            continue
        try:
            kwargs[f.name] = decl.parse(v) if decl.parse else v
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    kwargs.update(given)
    return dataclasses.replace(base, **kwargs) if base is not None else cls(**kwargs)


def build(cls: type, values: Mapping[str, Any]) -> Any:
    """`cls` from flag values: its own `from_flags` where it has rules across fields
    (ModelConfig, OuterConfig), else `fill`."""
    hook = getattr(cls, "from_flags", None)
    return hook(values) if hook is not None else fill(cls, values)


def to_flags(config: Any, *, omit: tuple[str, ...] = ()) -> list[str]:
    """The argv that builds `config` back: every declared field, at its value. ConfigError for a field
    no flag sets (or one `omit`ted) away from its default: flags could not carry it."""
    out: list[str] = []
    fixed: list[str] = []
    for f in dataclasses.fields(config):
        value, decl = getattr(config, f.name), f.metadata.get(KEY)
        if decl is not None and decl.param not in omit:
            out += decl.tokens(decl.outward(value))
        elif decl is None and dataclasses.is_dataclass(f.default):
            out += to_flags(value, omit=omit)
        elif value != _default(f):
            fixed.append(f.name)
    if fixed:
        raise ConfigError(f"no command-line flag sets {', '.join(fixed)}; this configuration cannot be passed as flags")
    return out


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not MISSING else f.default


def parse_ints(text: str, what: str) -> tuple[int, ...]:
    """"1,16" → (1, 16), for flags that take a comma-separated list of integers."""
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise ConfigError(f"{what} must be comma-separated integers, got {text!r}") from exc
    if not values:
        raise ConfigError(f"{what} is empty")
    return values


def join_ints(values: tuple[int, ...]) -> str:
    return ",".join(map(str, values))
