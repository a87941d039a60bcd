"""Settings from a TOML file, the environment and flags, in rising order of precedence, and
`btnode config show`, which prints the effective settings of a command with where each came from.

The file has one table per command, keyed by flag names without the dashes, plus a shared
[model] table for the swarm-wide shape, which every command that takes those flags reads:

    [model]                     # swarm-wide: hashed into the run fingerprint
    d-model = 128
    blocks = 3

    [join]
    role = "worker"
    peer = "aggregator.example.org:7070"
    metrics-listen = "0.0.0.0:9701"

Environment: BTNODE_<COMMAND>_<FLAG>, upper case, dashes as underscores, e.g.
BTNODE_JOIN_PEER=agg:7070 or BTNODE_JOIN_D_MODEL=256 (click's auto_envvar_prefix). The file is
--config PATH (before the command) or BTNODE_CONFIG. Under the hood the file becomes click's
default_map, so click's own order applies: command line, then environment, then file, then default.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from btnode.errors import ConfigError
from btnode.model.config import ModelConfig
from btnode.settings import declared, param_of

MODEL_TABLE = "model"
SECURITY_TABLE = "security"  # read by the root command: token-file, tls-cert, tls-key, tls-ca, tls-client-auth, tls-server-name
SECURITY_KEYS = ("token-file", "tls-cert", "tls-key", "tls-ca", "tls-client-auth", "tls-server-name", "identity")
SWARM_WIDE = tuple(d.flag.param for d in declared(ModelConfig) if d.flag.swarm_wide)  # the fingerprint's flags
# swarm-wide, but only on the commands that run or check a swarm (join, swarm, simulate, doctor)
KIND_FLAGS = (param_of(ModelConfig, "kind"), param_of(ModelConfig, "ar_layers"))
ENV_PREFIX = "BTNODE"


# typer vendors its own click, so commands and parameters are handled by duck typing here.
def _is_option(p: Any) -> bool:
    return getattr(p, "param_type_name", "") == "option"


def _flag_names(cmd: Any) -> dict[str, str]:
    """flag name without dashes ("steps-per-round") → parameter name ("steps_per_round")."""
    out = {}
    for p in cmd.params:
        if _is_option(p):
            for opt in p.opts:
                if opt.startswith("--"):
                    out[opt[2:]] = p.name or ""
        elif p.name:
            out[p.name.replace("_", "-")] = p.name
    return out


def default_map(group: Any, ctx: Any, path: Path) -> dict[str, dict[str, Any]]:
    """Read the TOML file into a click default_map; unknown tables or keys are errors."""
    try:
        doc = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read the configuration file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"configuration file {path} is not valid TOML: {exc}") from None
    commands = {name: group.get_command(ctx, name) for name in group.list_commands(ctx)}
    unknown = sorted(set(doc) - set(commands) - {MODEL_TABLE, SECURITY_TABLE})
    if unknown:
        raise ConfigError(f"{path}: unknown table(s) {unknown}; use [{MODEL_TABLE}], [{SECURITY_TABLE}] or one of "
                          f"{sorted(commands)}")
    for table, values in doc.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: {table!r} must be a table ([{table}]), not a single value")
    model = doc.get(MODEL_TABLE, {})
    bad = sorted(k for k in model if k.replace("-", "_") not in SWARM_WIDE)
    if bad:
        raise ConfigError(f"{path}: [{MODEL_TABLE}] takes only the swarm-wide shape "
                          f"({', '.join(s.replace('_', '-') for s in SWARM_WIDE)}), not {bad}")
    out: dict[str, dict[str, Any]] = {}
    for name, cmd in commands.items():
        if cmd is None:
            continue
        flags = _flag_names(cmd)
        section = doc.get(name, {})
        wrong = sorted(k for k in section if k.replace("_", "-") not in flags)
        if wrong:
            raise ConfigError(f"{path}: [{name}] has unknown setting(s) {wrong}; `btnode {name} --help` lists them")
        entry = {flags[k.replace("_", "-")]: _as_flag_value(v) for k, v in model.items() if k.replace("_", "-") in flags}
        entry.update({flags[k.replace("_", "-")]: _as_flag_value(v) for k, v in section.items()})
        if entry:
            out[name] = entry
    return out


def security_table(path: Path) -> dict[str, Any]:
    """The [security] table (already validated as TOML by default_map)."""
    table = tomllib.loads(path.read_text()).get(SECURITY_TABLE, {})
    bad = sorted(set(table) - set(SECURITY_KEYS))
    if bad:
        raise ConfigError(f"{path}: [{SECURITY_TABLE}] has unknown setting(s) {bad}; it takes {list(SECURITY_KEYS)}")
    return table


def configure_security(ctx: Any, file: dict[str, Any], **given: Any) -> None:
    """Flags and BTNODE_TLS_* / BTNODE_TOKEN_FILE beat the file's [security] table; the token itself
    comes from BTNODE_TOKEN or the token file (never a flag: it would show in `ps`)."""
    from btnode.rpc.security import Security, configure

    def pick(name: str) -> Any:
        src = ctx.get_parameter_source(name)
        if src is not None and src.name in ("COMMANDLINE", "ENVIRONMENT"):
            return given[name]
        return file.get(name.replace("_", "-"), given[name])

    token_file = pick("token_file")
    token = os.environ.get("BTNODE_TOKEN", "")
    if token_file:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read the token file {token_file}: {exc.strerror or exc}") from None
        if not token:
            raise ConfigError(f"the token file {token_file} is empty")
    def path(name: str) -> Path | None:
        value = pick(name)
        return Path(value) if value else None

    sec = Security(token=token, cert=path("tls_cert"), key=path("tls_key"), ca=path("tls_ca"),
                   client_auth=bool(pick("tls_client_auth")), server_name=pick("tls_server_name") or "")
    identity, code = path("identity"), given["join_code"]
    if identity is not None or code:
        sec = _enrolled(sec, identity, code)
    configure(sec)


def _enrolled(sec: Any, folder: Path | None, code_text: str) -> Any:
    """This node's identity in the swarm: the one in `folder`, or (none there yet) the one a join code
    is traded for now (btnode/rpc/enroll.py)."""
    from btnode.rpc import enroll

    if sec.cert is not None:
        raise ConfigError("--identity/--join-code and --tls-cert are two ways to name this node: give one")
    code = enroll.JoinCode.parse(code_text) if code_text else None
    if folder is None:
        assert code is not None
        folder = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "btnode" / code.code_id
    if not enroll.enrolled(folder):
        if code is None:
            raise ConfigError(f"no identity in {folder}: give the join code from the swarm's operator "
                              f"(--join-code or BTNODE_JOIN_CODE) to enroll once")
        enroll.enroll(code, folder)
    return enroll.identity_security(folder, sec.token)


def _as_flag_value(v: Any) -> Any:
    """TOML lists become the comma-separated form the flags take (segments = [1, 16] → "1,16")."""
    return ",".join(str(x) for x in v) if isinstance(v, list) else v


def show(ctx: typer.Context,
         command: Annotated[str, typer.Argument(help="The command whose settings to show.")] = "join",
         args: Annotated[Optional[list[str]], typer.Argument(help="Its flags, as you would run it (after --).")] = None) -> None:
    """Print the effective settings of a command (file, environment and flags applied), where each
    came from, which are swarm-wide, and the run fingerprint they make.

        btnode --config /etc/btnode/btnode.toml config show join -- --role worker --block 2"""
    root = ctx.find_root()
    group = root.command
    cmd = group.get_command(root, command)
    if cmd is None:
        raise ConfigError(f"no command {command!r}; one of {group.list_commands(root)}")
    sub = cmd.make_context(command, list(args or []), parent=root, resilient_parsing=True)
    rows = []
    for p in getattr(cmd, "role_params", lambda _: cmd.params)(sub):  # join: the role's settings only
        if not _is_option(p) or p.name is None or p.hidden:
            continue
        source = sub.get_parameter_source(p.name)
        where = {"COMMANDLINE": "flag", "ENVIRONMENT": "env", "DEFAULT_MAP": "file", "DEFAULT": "default"}.get(
            source.name if source else "DEFAULT", "default")
        flag = next((o for o in p.opts if o.startswith("--")), p.name)
        value = sub.params.get(p.name)
        rows.append((flag, "" if value is None else str(getattr(value, "value", value)), where,
                     "swarm-wide" if p.name in SWARM_WIDE else ""))
    width = max(len(r[0]) for r in rows)
    vwidth = min(40, max(len(r[1]) for r in rows))
    typer.echo(f"btnode {command}: effective settings (precedence: flag > env {ENV_PREFIX}_{command.upper()}_* > "
               f"file > default)")
    for flag, value, where, scope in rows:
        typer.echo(f"  {flag:<{width}}  {value:<{vwidth}}  {where:<7}  {scope}".rstrip())
    if all(name in sub.params for name in SWARM_WIDE if name not in KIND_FLAGS):
        shape = {name: sub.params.get(name) for name in SWARM_WIDE}
        if shape["model"] != "ar":  # plan's and train-ar's --ar-layers is a depth of their own
            shape["ar_layers"] = None
        typer.echo(f"run fingerprint: {ModelConfig.from_flags(shape).fingerprint()}")


def register(app: typer.Typer) -> None:
    config_app = typer.Typer(help="Inspect settings from the configuration file, the environment and flags.",
                             no_args_is_help=True)
    config_app.command("show", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})(show)
    app.add_typer(config_app, name="config")
