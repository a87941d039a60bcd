"""The command line every benchmark shares, declared once: where the result JSON goes, --quick and what
it shrinks, the model shape (a ModelConfig, handed to the nodes a bench starts by `shape_flags`), and
the run settings most benches take (seeds, held-out windows, batch, local steps, rounds)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.report import result_path
from btnode.model.config import ModelConfig

# The model the swarm benchmarks train (the project's default), and the tiny one of --quick runs
SHAPE = ModelConfig()
QUICK_SHAPE = ModelConfig(d_model=32, n_heads=2, n_layers=1, n_blocks=3, context=32, segments=(1, 8))


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(k) for k in text.split(","))


# The shape fields a bench's own command line may set: field → (flag, argparse dest, parse). The flags
# are the ones ModelConfig.to_flags() writes, so a bench takes a shape the way `btnode` does.
_SHAPE_FLAGS: dict[str, tuple[str, str, Callable[[str], Any]]] = {
    "d_model": ("--d-model", "d_model", int), "n_heads": ("--heads", "heads", int),
    "n_layers": ("--layers", "layers", int), "n_blocks": ("--blocks", "blocks", int),
    "context": ("--context", "context", int), "segments": ("--segments", "segments", _ints),
    "ada_rank": ("--ada-rank", "ada_rank", int), "ctx_head": ("--ctx-head", "ctx_head", int)}
_ALWAYS_SHOWN = {flag for name, (flag, _, _) in _SHAPE_FLAGS.items() if name not in ("ada_rank", "ctx_head")}


def _pairs(flags: list[str]) -> list[tuple[str, str]]:
    return list(zip(flags[::2], flags[1::2]))


def shape_flags(cfg: ModelConfig) -> list[str]:
    """cfg.to_flags() less the flags that only repeat a default (--target-seed 0, --model block, …), so
    that the commands a bench runs and shows are the ones a user would type."""
    default = dict(_pairs(ModelConfig().to_flags()))
    same = {"--ctx-head"} if cfg.kind == "ar" else set()  # an AR run has no clean head: 0 whatever is said
    return [x for flag, value in _pairs(cfg.to_flags()) if flag not in same
            and (flag in _ALWAYS_SHOWN or default.get(flag) != value) for x in (flag, value)]


class BenchParser(argparse.ArgumentParser):
    """A benchmark's argument parser: its docstring as the help, plus the shared flags it opts into.
    After parsing, `args.shape` is the ModelConfig (when `shape` was called) and `args.results` the
    record's path (when `result` was called); under --quick the values given to `quick` replace the
    parsed ones."""

    def __init__(self, doc: str | None, **kwargs: Any):
        spec = getattr(sys.modules["__main__"], "__spec__", None)
        if spec is not None:  # run as `python -m bench.NAME`: usage lines say so
            kwargs.setdefault("prog", f"python -m {spec.name}")
        super().__init__(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)
        self._section: str | None = None
        self._quick: dict[str, Any] | None = None
        self._shape: tuple[ModelConfig, Sequence[str]] | None = None

    def result(self, bench: str, flag: str = "--out") -> None:
        """Where the run is recorded: `flag` DIR (a results folder, default bench/results) and --setting
        NAME give DIR/<bench>/<NAME>.json; only the default folder's records make BENCHMARKS.md."""
        self._section = bench
        self.add_argument(flag, dest="results_dir", type=Path, metavar="DIR",
                          help="the results folder the run is appended to (default bench/results; any other "
                               "folder leaves BENCHMARKS.md alone)")
        self.add_argument("--setting", default="default", metavar="NAME",
                          help=f"which of {bench}'s settings this run is (runs compare within one; default: default)")

    def quick(self, help: str = "a smoke run", **values: Any) -> None:
        """--quick: a smoke run that sets each of `values` (dest → value; `shape` → a ModelConfig)."""
        self._quick = values
        self.add_argument("--quick", action="store_true", help=help)

    def shape(self, default: ModelConfig, *fields: str, hidden: bool = False) -> None:
        """The model shape: `default`, with a flag for each of `fields` (ModelConfig field names) that
        a user may set; no fields, no flags."""
        self._shape = (default, fields)
        for name in fields:
            flag, dest, _ = _SHAPE_FLAGS[name]
            value = getattr(default, name)
            self.add_argument(flag, dest=dest, default=",".join(map(str, value)) if name == "segments" else value,
                              type=str if name == "segments" else _SHAPE_FLAGS[name][2],
                              help=argparse.SUPPRESS if hidden else f"ModelConfig.{name}")

    def seeds(self, default: int, help: str = "seeds of the sampler's noise (SCE-S)") -> None:
        self.add_argument("--seeds", type=int, default=default, help=help)

    def windows(self, default: int | None, help: str = "held-out windows scored") -> None:
        self.add_argument("--windows", type=int, default=default, help=help)

    def batch(self, default: int, help: str = "windows per optimizer step") -> None:
        self.add_argument("--batch", type=int, default=default, help=help)

    def rounds(self, *, rounds: int | None = None, h: int | None = None, batch: int | None = None,
               h_help: str = "local steps per round") -> None:
        """A swarm run's per-worker training: --rounds, --h (local steps per round) and --batch, each
        where a default is given."""
        if rounds is not None:
            self.add_argument("--rounds", type=int, default=rounds, help="rounds per worker")
        if h is not None:
            self.add_argument("--h", type=int, default=h, help=h_help)
        if batch is not None:
            self.batch(batch)

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        ns = super().parse_args(args, namespace)
        quick = self._quick is not None and ns.quick
        if self._shape is not None:
            default, fields = self._shape
            given = {name: _SHAPE_FLAGS[name][2](str(getattr(ns, _SHAPE_FLAGS[name][1]))) for name in fields}
            ns.shape = dataclasses.replace(default, **given)
        for dest, value in (self._quick or {}).items() if quick else ():
            setattr(ns, dest, value)
        if self._section is not None:
            ns.results = result_path(self._section, ns.setting, quick=quick, results=ns.results_dir)
        return ns
