"""`Publisher`: the root's `RoundSink`, and the version a block starts from (`resume`). A closed round becomes version v+1, tensor by tensor (so that
the close's temporaries are one tensor, not one block): the mean of the kept updates, the outer
step, encode it with the publish codec, decode it again and add it to θ^v exactly as every worker
will; then hash the result, write it durably, and only then announce it."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from btnode.aggregate.round.config import info_from_meta, version_meta
from btnode.aggregate.round.rounds import Update
from btnode.aggregate.sums.averaging import OuterOptimizer
from btnode.aggregate.sums.spill import Spill
from btnode.codec.codecs import Codec, decode, encode
from btnode.protocol import Outcome, PushHeader, VersionInfo
from btnode.store.files import Streamed, state_sha256
from btnode.errors import MalformedInput
from btnode.store.theta import Applied, FileTheta
from btnode.store.versions import VersionStore

if TYPE_CHECKING:
    from btnode.aggregate.round.block import BlockAggregator

EF_PREFIX = "ef."  # publish-codec error feedback, stored with the outer state
log = logging.getLogger(__name__)


def resume(store: VersionStore, initial: Mapping[str, torch.Tensor], outer: OuterOptimizer, *, in_file: bool,
           name: str) -> tuple[VersionInfo, Mapping[str, torch.Tensor], dict[str, torch.Tensor], dict[str, tuple[int, ...]]]:
    """The version a block starts from: the newest in its store (hash-checked, with the outer
    optimizer's state loaded into `outer`), or version 0, `initial`, written first: its info, its θ, the
    publish codec's error feedback and θ's shapes, in θ's order. `in_file`: θ is read from its version
    file as needed, not held."""
    stored = store.latest(in_file=in_file)
    if stored is None:
        params = {n: t.detach().clone().float() for n, t in initial.items()}
        info = VersionInfo(block=store.block, version=0, base_version=0, sha256=state_sha256(params))
        store.write(0, params, meta=version_meta(info))
        return info, store.theta(0) if in_file else params, {}, {n: tuple(t.shape) for n, t in params.items()}
    info = info_from_meta(stored.meta)
    state = stored.outer
    outer.load_state_dict({n: t for n, t in state.items() if not n.startswith(EF_PREFIX)})
    residual = {n[len(EF_PREFIX):]: t for n, t in state.items() if n.startswith(EF_PREFIX)}
    if state_sha256(stored.params) != info.sha256:
        raise MalformedInput("checksum", f"{name} version {info.version} on disk fails its hash")
    log.info("%s resumed at version %d (%s)", name, info.version, info.sha256[:12])
    params = stored.params
    spec = params.shapes if isinstance(params, FileTheta) else {n: tuple(t.shape) for n, t in params.items()}
    return info, params, residual, spec


class Publisher:
    """The root's rounds: each close publishes a version; an update is always welcome in the open round."""

    durable = False  # an in-process update is held as it came; a pushed one's codec bytes are spilled
    amends = False  # a published version is final: the root waits for the children of a relay that went away

    def spill(self, block: BlockAggregator, now: float) -> Spill:
        """An unnamed file (sums/spill.py): nothing of a round survives the process."""
        return Spill(block.store.folder)

    def took(self, block: BlockAggregator, update: Update) -> None:
        pass

    def refuses(self, block: BlockAggregator, header: PushHeader) -> str:
        return ""

    def due(self, block: BlockAggregator) -> bool:
        return True

    def member(self, block: BlockAggregator, worker_id: str, here: bool) -> None:
        pass

    def close(self, block: BlockAggregator, reason: str, ups: list[Update],
              dropped: list[tuple[str, str]]) -> VersionInfo:
        mean_of, rule = block.tally.combiner(ups)
        # Tensor by tensor: a round's close is the aggregator's memory peak (bench/scale.py measures
        # it), and a unit may be large; each temporary is one tensor, dropped as soon as it is used.
        codec = block.cfg.publish_codec
        keep = block.cfg.warmup.keep(block.cfg.publish_density, block.info.version)  # codec/warmup.py
        in_file = block.theta_in_file
        raw, made, residual = {}, {}, dict(block.residual)
        for n in block.spec:
            step = block.outer.step({n: mean_of(n)})[n]
            if n in block.correction:  # a repair's Σ (step' − step) of its rounds (round/repairs.py)
                step = step + block.correction[n]
            if codec is not Codec.FP32:  # error feedback on the published step
                step = step + residual.get(n, 0)
            raw[n] = encode(codec, step, keep=keep)
            decoded = decode(codec, raw[n], block.spec[n])
            if codec is not Codec.FP32:
                residual[n] = step - decoded
            del step
            if not in_file:
                made[n] = block.params[n] + decoded
            del decoded
        # θ in its file: θ^{v+1} is made a tensor at a time from θ^v's file and the delta, the same
        # float operations as above, twice (hashed in sorted order, then written in the file's order)
        params = Applied(block.params, raw, codec, block.spec) if in_file else made
        counts = block.round.counts
        info = VersionInfo(block=block.block, version=block.info.version + 1, base_version=block.info.version,
                           sha256=state_sha256(params), delta_codec=codec, accepted=len(ups),
                           late=counts[Outcome.LATE], stale=counts[Outcome.STALE],
                           rejected=counts[Outcome.REJECTED] + len(dropped),
                           mean_loss=sum(u.loss for u in ups) / len(ups), closed_by=reason,
                           included=tuple(i for u in ups for i in u.included))
        outer_state = {**block.outer.buffers, **{EF_PREFIX + n: r for n, r in residual.items()}}  # read, not copied
        block.store.write(info.version, Streamed(block.spec, params.items) if in_file else params,
                          meta=version_meta(info, rule), delta_raw=raw, delta_codec=codec, outer=outer_state)
        del raw
        if in_file:
            params = block.store.theta(info.version)
        block.published(info, params, residual, ups, dropped)
        return info
