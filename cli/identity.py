"""Identity commands (docs/security.md, "Identities"): `btnode ca init` makes the swarm CA,
`btnode admit` signs a peer's certificate with it, `btnode revoke` tells a live aggregator to
refuse an identity from now on."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from btnode.aggregate.trust.identities import Role

ca = typer.Typer(help="The swarm's certificate authority.", no_args_is_help=True)
codes = typer.Typer(help="Single-use join codes: each becomes one identity (on the aggregator's host).",
                    no_args_is_help=True)
StateDir = Annotated[Path, typer.Option("--state-dir", help="The aggregator's --state-dir (it holds the swarm's CA).")]


@codes.command("mint")
def codes_mint(state_dir: StateDir,
               role: Annotated[Role, typer.Option("--role", help="What the identity may do: worker, relay, stage or "
                                                                 "operator.")] = Role.WORKER,
               name: Annotated[str, typer.Option("--name", help="The identity's name (a worker's id); default "
                                                                "ROLE-ID. With --count, NAME-1, NAME-2, ...")] = "",
               count: Annotated[int, typer.Option("--count", min=1, help="How many codes.")] = 1,
               hours: Annotated[float, typer.Option("--hours", help="Hours a code stays valid unused.")] = 168.0,
               host: Annotated[str, typer.Option("--host", help="Host nodes reach the aggregator's enrollment port "
                                                                "at (default: its --listen host, or this host's "
                                                                "name).")] = "") -> None:
    """Print single-use join codes: give one to each node (`btnode --join-code CODE join ...` or
    BTNODE_JOIN_CODE), which trades it once for its identity."""
    from btnode.rpc.enroll import SwarmAuthority

    auth = SwarmAuthority(state_dir)
    for i in range(count):
        code, rec = auth.mint(role=role, name=f"{name}-{i + 1}" if name and count > 1 else name, ttl_s=hours * 3600,
                              host=host or None)
        typer.echo(f"{rec.name}\t{code}")


@codes.command("list")
def codes_list(state_dir: StateDir) -> None:
    """The swarm's codes: name, role, and whether each is open, used or expired (never the secrets)."""
    import time

    from btnode.rpc.enroll import SwarmAuthority

    now = time.time()
    for r in SwarmAuthority(state_dir).records():
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(r.used_at or r.expires))
        typer.echo(f"{r.code_id}  {r.role:<8} {r.name:<24} {r.state(now):<7} "
                   f"{'used' if r.used_by else 'expires'} {when}")


@codes.command("open")
def codes_open(state_dir: StateDir, host: Annotated[str, typer.Option("--host")] = "") -> None:
    """The code anyone may enroll with when the aggregator runs --open (publish it)."""
    from btnode.rpc.enroll import SwarmAuthority

    typer.echo(str(SwarmAuthority(state_dir).open_code(host or None)))


@ca.command("init")
def ca_init(out: Annotated[Path, typer.Option("--out", help="Folder for ca.key (keep it offline) and ca.pem.")],
            days: Annotated[int, typer.Option("--days", help="Days the CA is valid.")] = 3650) -> None:
    """Make the swarm CA: every certificate it signs is an identity the aggregator admits."""
    from btnode.rpc.certs import init_ca

    issued = init_ca(out, days=days)
    typer.echo(f"swarm CA: {issued.cert} (give it to every node as --tls-ca); its key {issued.key} signs admissions")


def admit(ca_dir: Annotated[Path, typer.Option("--ca", help="Folder of the swarm CA (btnode ca init).")],
          name: Annotated[str, typer.Option("--name", help="The identity: a worker's --worker-id, or an operator's name.")],
          out: Annotated[Path, typer.Option("--out", help="Folder for NAME.pem (and NAME.key).")],
          role: Annotated[Role, typer.Option("--role", help="What it may do.")] = Role.WORKER,
          days: Annotated[int, typer.Option("--days", help="Days the certificate is valid.")] = 365,
          host: Annotated[Optional[list[str]], typer.Option("--host", help="DNS name or IP others dial it at (an "
                                                                           "aggregator's or stage's server certificate); repeatable.")] = None,
          csr: Annotated[Optional[Path], typer.Option("--csr", help="The peer's certificate request (PEM): it keeps "
                                                                    "its key; without one a key is made here.")] = None) -> None:
    """Admit a peer to the swarm: sign a certificate naming it (CN and btnode:ROLE/NAME)."""
    from btnode.errors import InputError
    from btnode.rpc.certs import admit as sign

    try:
        request = csr.read_bytes() if csr is not None else None
    except OSError as exc:
        raise InputError(f"cannot read the certificate request {csr}: {exc.strerror or exc}") from None
    issued = sign(ca_dir, name, role=role, out=out, days=days, hosts=tuple(host or ()), csr=request)
    typer.echo(f"admitted {role.value} {name}: certificate {issued.cert}" + (f", key {issued.key}" if issued.key else ""))


def revoke(peer: Annotated[str, typer.Option("--peer", help="HOST:PORT of the aggregator.")],
           name: Annotated[str, typer.Argument(help="The identity to refuse from now on.")]) -> None:
    """Revoke an identity at a live aggregator (run with an operator's certificate: --tls-cert/--tls-key)."""
    import time

    from btnode.rpc.client import SwarmClient

    client = SwarmClient(peer, timeout_s=15)
    try:
        at = client.revoke(name)
    finally:
        client.close()
    typer.echo(f"revoked {name} at {peer} ({time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(at))})")


def register(app: typer.Typer) -> None:
    app.add_typer(ca, name="ca")
    app.add_typer(codes, name="codes")
    app.command("admit")(admit)
    app.command("revoke")(revoke)
