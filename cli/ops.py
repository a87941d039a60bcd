"""Operator commands: `btnode status` (the swarm as an aggregator sees it), `btnode doctor` (is
this host ready to join?) and `btnode plan` (memory and traffic of a model shape)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from btnode.model.config import ModelConfig
from btnode.node.settings import HostConfig
from btnode.settings import Section, build
from btnode.train.config import TrainConfig
from btnode_cli.options import takes

Peer = Annotated[str, typer.Option("--peer", help="HOST:PORT of the aggregator.")]
Json = Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")]


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def status(peer: Peer, rounds: Annotated[int, typer.Option("--rounds", help="Recent rounds to show per block.")] = 5,
           json_out: Json = False) -> None:
    """The aggregator's build, then blocks, versions, replicas and the outcomes of the last rounds, from a live
    aggregator."""
    from btnode.errors import ConfigError, PeerUnavailable
    from btnode.rpc.client import SwarmClient
    from btnode.rpc.security import identity_hint

    client = SwarmClient(peer, timeout_s=15)
    try:
        st = client.status_dict()
    except PeerUnavailable:
        if hint := identity_hint(peer):  # a swarm with identities, and no --identity here
            raise ConfigError(f"{hint}; on the aggregator's host: --identity STATE/swarm/operator") from None
        raise
    finally:
        client.close()
    if json_out:
        typer.echo(json.dumps(st, indent=1))
        return
    cfg = st["config"]
    ar = f"ar ({cfg['ar_layers']} layers)" if cfg.get("kind") == "ar" else None  # a DiLoCo run's one unit

    def unit(block: object) -> str:
        return ar or f"block {block}"

    shape = ar or f"B={cfg['n_blocks']} L={cfg['n_layers']}"
    typer.echo(f"swarm at {peer} (btnode {st['node_version']}): fingerprint {st['fingerprint'][:16]}…, d={cfg['d_model']} {shape} "
               f"N={cfg['context']} K={cfg['segments']}; data {st['data_id'] or 'not stated yet'}")
    for b in st["blocks"]:
        typer.echo(f"{unit(b['block'])}: version {b['version']} ({b['sha256'][:12]}), {len(b['replicas'])} replicas "
                   f"[{', '.join(b['replicas'])}], round open {b['round_age_s']:.1f} s with {b['accepted_in_round']} "
                   f"in it")
        if b["data_keys"]:
            typer.echo("    data keys: " + ", ".join(f"{w} {k}" for w, k in b["data_keys"].items()))
        for r in b.get("relays", []):
            typer.echo(f"    relay {r['name']}: children [{', '.join(r['children'])}]; last combined push on v"
                       f"{r['last_version']} (weight {r['last_weight']:g}); {r['pushes']} accepted, {r['refused']} refused")
        for r in b["recent"][-rounds:]:
            inc = f"; {len(r['included'])} updates included" if r.get("included") else ""
            typer.echo(f"    v{r['version']}: {r['accepted']} accepted, {r['late']} late, {r['stale']} stale, "
                       f"{r['rejected']} rejected; closed by {r['closed_by']}; loss {r['mean_loss']:.4f}{inc}")
    for r in st["identities"]:
        state = "REVOKED" if r["revoked_at_unix"] else "admitted"
        refused_by = ", ".join(f"{k} {v}" for k, v in r["refused"].items()) or "none"
        dropped_by = ", ".join(f"{k} {v}" for k, v in r.get("dropped", {}).items()) or "none"
        typer.echo(f"identity {r['name']} ({r['role']}, {r['fingerprint'][:12]}): {state}; joined "
                   f"{r['joined'] or 'nothing'}; {r['accepted']} taken into rounds, {r.get('applied', 0)} applied, "
                   f"dropped: {dropped_by}; refused: {refused_by}; {r['audited']} audited, {r['failed']} failed; "
                   f"verified {r.get('verified', 0)} of others' rounds ({r.get('verify_seconds', 0.0):.1f} s)")
    refused = [c for c in st["counters"]
               if c["labels"].get("outcome") in ("rejected", "stale", "dropped") and c["value"]]
    for c in refused:
        typer.echo(f"refused: {unit(c['labels'].get('block'))} {c['labels']['outcome']} "
                   f"({c['labels'].get('reason') or '-'}): {int(c['value'])}")


@takes(HostConfig, ModelConfig)
def doctor(peer: Annotated[Optional[str], typer.Option("--peer", help="HOST:PORT of the aggregator to join.")] = None,
           listen: Annotated[Optional[str], typer.Option("--listen", help="HOST:PORT this node will serve on (aggregator, stage).")] = None,
           state_dir: Annotated[Path, typer.Option("--state-dir", help="Where the node keeps its state.")] = Path("."),
           json_out: Json = False, **flags: Any) -> None:
    """Check this host before it joins: peer reachable and its gRPC Health SERVING, port free, clock
    skew, disk, the --data it trains on, torch threads and devices, and the run fingerprint against
    the swarm's. Each problem comes with a fix."""
    from btnode.node.doctor import run_checks

    cfg = build(ModelConfig, flags)
    findings = run_checks(cfg, peer=peer, listen=listen, state_dir=state_dir, host=build(HostConfig, flags))
    if json_out:
        typer.echo(json.dumps([f.__dict__ for f in findings], indent=1))
    else:
        for f in findings:
            typer.echo(f"[{f.level:>4}] {f.check}: {f.detail}")
            if f.fix:
                typer.echo(f"       fix: {f.fix}")
    if any(f.level == "FAIL" for f in findings):
        raise typer.Exit(1)


@takes(Section(TrainConfig, only=("batch",), helps={"batch": "Windows per training step."}),
       Section(HostConfig, only=("data", "data_cache", "data_cache_gb")),
       Section(ModelConfig, omit=("model",), helps={"ar_layers": "Depth of the AR model of the end-to-end column "
                                                                 "(default B·L; a --model ar worker's replica)."}))
def plan(json_out: Json = False, **flags: Any) -> None:
    """Peak memory of a worker training one block against a process training the whole model end to
    end (the AR model: --ar-layers, default B·L; a DiLoCo worker's replica), part by part, and bytes
    per round per codec, for a model shape.
    Activations and the runtime are measured by running small real steps; nothing of full size is built."""
    from btnode.codec.codecs import Codec
    from btnode.train.plan import ar_memory, block_bytes, block_memory, runtime_bytes, swarm_worker_peak_bytes

    ar_layers, batch = flags.pop("ar_layers"), flags["batch"]  # the AR column's depth, not a swarm's kind
    cfg = build(ModelConfig, flags)
    t0 = time.perf_counter()
    runtime = runtime_bytes()
    worker = block_memory(cfg, batch, runtime=runtime)
    if ar_layers is not None and ar_layers < 1:
        raise typer.BadParameter("--ar-layers must be ≥ 1")
    n_ar = ar_layers or cfg.n_blocks * cfg.n_layers
    e2e = ar_memory(cfg, batch, n_ar, runtime=runtime)
    traffic = block_bytes(cfg)
    data = build(HostConfig, flags).load_corpus()  # after the measurements: they are of the model alone
    held = data.train.in_memory()
    data_line = f"data: {data.source}; the training split is " + (
        f"held in memory ({mib(held)})" if held else "read from disk as windows need it (page cache, not in the peak)")
    swarm = {"swarm_worker_peak_bytes": swarm_worker_peak_bytes(worker, Codec.INT8)}  # what `join --role worker` checks
    swarm_e2e = {"swarm_worker_peak_bytes": swarm_worker_peak_bytes(e2e, Codec.INT8)}  # a --model ar worker's
    if json_out:
        typer.echo(json.dumps({"config": cfg.to_dict(), "batch": batch, "worker": {**worker.to_dict(), **swarm},
                               "end_to_end": {**e2e.to_dict(), **swarm_e2e, "n_layers": n_ar},
                               "block_bytes_by_codec": traffic,
                               "data": {"source": data.source, "train_in_memory_bytes": held}}, indent=1))
        return
    typer.echo(f"model: d={cfg.d_model}, {cfg.n_heads} heads, L={cfg.n_layers} layers per block, B={cfg.n_blocks} "
               f"blocks, N={cfg.context}; batch {batch} (fp32; measured in {time.perf_counter() - t0:.1f} s)")
    typer.echo(data_line)
    typer.echo(f"{'':30}{'worker (1 block)':>18}{f'end to end (AR, {n_ar} layers)':>30}")
    for label, key in (("runtime (python, torch)", "runtime_bytes"), ("parameters", "param_bytes"),
                       ("gradients", "grad_bytes"), ("AdamW state", "adam_bytes"),
                       ("saved activations", "activation_bytes"), ("AdamW step temporary", "step_bytes"),
                       ("kept in the heap (glibc)", "retained_bytes"), ("checkpoint write", "checkpoint_bytes"),
                       ("peak, training steps", "train_peak_bytes"), ("peak, with checkpoints", "peak_bytes")):
        w, e = worker.to_dict()[key], e2e.to_dict()[key]
        typer.echo(f"{label:30}{mib(w):>18}{mib(e):>30}")
    typer.echo(f"{'peak, swarm worker (int8)':30}{mib(swarm['swarm_worker_peak_bytes']):>18}"
               f"{mib(swarm_e2e['swarm_worker_peak_bytes']):>30}")
    typer.echo(f"{'parameter count':30}{worker.parameters:>18,}{e2e.parameters:>30,}")
    typer.echo("peak = runtime + parameters, gradients and AdamW state + the larger of activations and the step")
    typer.echo("temporary + heap kept; train-local and train-ar also write checkpoints, a swarm worker does not;")
    typer.echo("a swarm worker (join --role worker; --model ar for the end-to-end column) adds its copies of")
    typer.echo("the unit (base version, residual, the exchange's: 36 bytes per parameter) and its encoded update,")
    typer.echo("and refuses to start when that exceeds its cgroup's limit, MemAvailable or --memory-limit.")
    typer.echo("bytes per round per worker, before zstd: the pushed update in the worker's --codec, plus the")
    typer.echo("published delta pulled back in the aggregator's --publish-codec (fp32 by default):")
    for codec, n in traffic.items():
        typer.echo(f"  {codec:5} {mib(n):>12}")
    typer.echo(f"  e.g. int8 updates with fp32 publishing: {mib(traffic['int8'] + traffic['fp32'])} per round")


def register(app: typer.Typer) -> None:
    app.command("status")(status)
    app.command("doctor")(doctor)
    app.command("plan")(plan)
