"""Typer options derived from the flags the config dataclasses declare (btnode/settings.py): a
command names the configs it takes (`@takes(ModelConfig, ...)`) and receives their flags' values;
`settings.build` turns those into the frozen configs. Nothing here declares a flag of its own."""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any, Optional, TypeVar

import typer

from btnode.model.config import ModelConfig
from btnode.node.settings import HostConfig
from btnode.settings import Declared, Section, declared, parse_ints, section

__all__ = ["Device", "device", "model_config", "options", "parse_ints", "takes", "typed"]

F = TypeVar("F", bound=Callable[..., Any])


def _flag_type(d: Declared) -> Any:
    """The Python type typer converts the flag to: the declared one, else the field's without None."""
    if d.flag.value is not None:
        return d.flag.value
    hint = typing.get_type_hints(d.owner)[d.path[-1]]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def typed(d: Declared, *, help: str | None = None, panel: str | None = None) -> Any:
    """Annotated[T, typer.Option(...)] for a declared flag, as a hand-written command would spell it."""
    text = help or d.flag.help + (" (swarm-wide)" if d.flag.swarm_wide else "")  # a command's own help says its own
    t = _flag_type(d)
    return Annotated[Optional[t] if d.cli_default is None else t,  # typer reads Optional
                     typer.Option(d.flag.names, help=text, min=d.flag.min, rich_help_panel=panel)]


def options(*specs: Section | type, panel: Callable[[Declared], str | None] = lambda d: None) -> list[inspect.Parameter]:
    """One keyword parameter per flag of the configs, each flag once (configs may share a declaration:
    --seed fills TrainConfig.seed and the aggregator's). Two declarations of one flag are a bug."""
    out: dict[str, tuple[Declared, inspect.Parameter]] = {}
    for spec in map(section, specs):
        for d in spec.flags():
            name = d.flag.param
            if name in out:
                if out[name][0].flag is not d.flag:
                    raise TypeError(f"{d.flag.name} is declared twice ({out[name][0].owner.__name__} and "
                                    f"{d.owner.__name__}); declare it once and reuse it with same_flag")
                continue
            default = spec.defaults.get(name, d.cli_default)
            out[name] = d, inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                             annotation=typed(d, help=spec.helps.get(name), panel=panel(d)))
    return [p for _, p in out.values()]


def takes(*specs: Section | type, panel: Callable[[Declared], str | None] = lambda d: None) -> Callable[[F], F]:
    """A command that takes these configs' flags: they arrive in its **flags, keyed by parameter name.
    typer reads a command's options from `inspect.signature`, so the signature is synthesised (the
    command's own options, then the derived ones): every option then converts, shows its help and
    reads BTNODE_<COMMAND>_<PARAM> exactly as a hand-written typer option would."""
    def wrap(fn: F) -> F:
        own = [p for p in inspect.signature(fn, eval_str=True).parameters.values()
               if p.kind is not inspect.Parameter.VAR_KEYWORD]
        fn.__signature__ = inspect.Signature([*own, *options(*specs, panel=panel)])  # type: ignore[attr-defined]
        return fn
    return wrap


def model_config(**values: Any) -> ModelConfig:
    """The model shape from its flags' values (d_model=…, heads=…, model=…, ar_layers=…)."""
    return ModelConfig.from_flags(values)


def _host(name: str) -> Declared:
    return next(d for d in declared(HostConfig) if d.path == (name,))


Device = typed(_host("device"))  # for a command that takes one host setting (generate)


def device(name: str):  # -> torch.device
    from btnode.device import resolve_device

    return resolve_device(name)
