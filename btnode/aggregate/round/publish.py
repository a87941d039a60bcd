"""`Publisher`: the root's `RoundSink`. A closed round becomes version v+1, tensor by tensor (so that
the close's temporaries are one tensor, not one block): the mean of the kept updates, the outer
step, encode it with the publish codec, decode it again and add it to θ^v exactly as every worker
will; then hash the result, write it durably, and only then announce it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from btnode.aggregate.round.rounds import Update
from btnode.aggregate.sums.spill import Spill
from btnode.codec.codecs import Codec, decode, encode
from btnode.codec.sparse import keep_of
from btnode.protocol import Outcome, PushHeader, VersionInfo
from btnode.store.files import Streamed, state_sha256
from btnode.store.theta import Applied

if TYPE_CHECKING:
    from btnode.aggregate.round.block import BlockAggregator

EF_PREFIX = "ef."  # publish-codec error feedback, stored with the outer state


class Publisher:
    """The root's rounds: each close publishes a version; an update is always welcome in the open round."""

    durable = False  # an in-process update is held as it came; a pushed one's codec bytes are spilled

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
        mean_of, rule = block.combiner(ups)
        # Tensor by tensor: a round's close is the aggregator's memory peak (bench/scale.py measures
        # it), and a unit may be large; each temporary is one tensor, dropped as soon as it is used.
        codec = block.cfg.publish_codec
        keep = keep_of(block.cfg.publish_density)
        in_file = block.theta_in_file
        raw, made, residual = {}, {}, dict(block.residual)
        for n in block.spec:
            step = block.outer.step({n: mean_of(n)})[n]
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
                          meta=block.meta(info, rule), delta_raw=raw, delta_codec=codec, outer=outer_state)
        del raw
        if in_file:
            params = block.store.theta(info.version)
        block.published(info, params, residual, ups, dropped)
        return info
