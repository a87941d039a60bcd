"""Identity commands (docs/security.md, "Identities"): `btnode ca init` makes the swarm CA,
`btnode admit` signs a peer's certificate with it, `btnode revoke` tells a live aggregator to
refuse an identity from now on."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from btnode.aggregate.trust.identities import Role

ca = typer.Typer(help="The swarm's certificate authority.", no_args_is_help=True)


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
    app.command("admit")(admit)
    app.command("revoke")(revoke)
