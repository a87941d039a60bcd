"""Test and lab tools, kept out of the installed package: cheating workers and relays (cheats,
relay_cheats), fuzzers (fuzz) and WAN emulation (netlab). tests/ and bench/ import them from the
repository root; nothing in btnode imports them (pyproject's import contract)."""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def lab_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """env (default: this process's) with the repository root first on PYTHONPATH: `lab` is not
    installed, so a child started as `python -m lab...` from any folder finds it there."""
    out = dict(os.environ if env is None else env)
    out["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [out.get("PYTHONPATH")])])
    return out
