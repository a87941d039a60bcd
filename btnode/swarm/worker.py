"""`BlockWorker` (design §3.2): join with the run fingerprint, pull the block, then per round
train H local steps with a persistent inner AdamW, push the encoded delta (with error feedback)
against its base version, wait for the next version on the server stream, apply the published
delta and check its hash, falling back to a full pull when behind or on a mismatch.

It talks to the aggregator only through an AggregatorLink, so the same loop runs over gRPC or
in-process. Every transfer is counted (raw and wire bytes) for the benchmarks.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import zstandard

from btnode.codec.codecs import Codec, decode
from btnode.codec.frames import ZSTD_LEVEL, Frame, encode_raw, frame_from_raw
from btnode.data.windows import WindowSampler
from btnode.errors import BtnodeError, MalformedInput, PeerUnavailable
from btnode.model.config import ModelConfig
from btnode.model.targets import target_table
from btnode.protocol import AggregatorLink, Judgement, Outcome, PushHeader, VersionInfo
from btnode.store.files import state_sha256
from btnode.store.models import init_block
from btnode.train.config import TrainConfig
from btnode.train.trainers import BlockTrainer

log = logging.getLogger(__name__)
Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class WorkerConfig:
    """Local settings of one worker (never part of the fingerprint)."""

    worker_id: str
    block: int
    steps_per_round: int = 50  # H: local steps between pushes
    codec: Codec = Codec.INT8
    error_feedback: bool = True  # carry the codec's rounding error into the next update
    rounds: int | None = None  # stop after this many pushes (None: until stopped)
    wait_timeout_s: float = 600.0  # give up waiting for a version after this long
    push_retries: int = 5  # re-push (same update id) after UNAVAILABLE


@dataclass
class WorkerStats:
    pushes: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    bytes_pushed_raw: int = 0
    bytes_pushed_wire: int = 0
    bytes_pulled_wire: int = 0
    full_pulls: int = 0
    delta_fetches: int = 0
    train_seconds: float = 0.0
    started: float = field(default_factory=time.perf_counter)
    losses: list[float] = field(default_factory=list)
    version: int = -1  # the version the worker holds now, and its hash
    sha256: str = ""


class BlockWorker:
    def __init__(self, cfg: ModelConfig, tc: TrainConfig, wcfg: WorkerConfig, link: AggregatorLink, corpus: bytes,
                 *, device: torch.device):
        self.cfg, self.tc, self.wcfg, self.link = cfg, tc, wcfg, link
        self.sampler = WindowSampler(corpus, cfg.context)
        model = init_block(cfg, wcfg.block, tc.seed)
        self.spec = {n: tuple(t.shape) for n, t in model.state_dict().items()}
        self.trainer = BlockTrainer(model, tc, block=wcfg.block, table=target_table(cfg), device=device)
        self.base: Tensors = {}
        self.info: VersionInfo | None = None
        self.residual: Tensors = {}
        self.stats = WorkerStats()
        self._announced: queue.Queue[VersionInfo | BaseException] = queue.Queue()
        self._newest: VersionInfo | None = None

    # -- versions ----------------------------------------------------------------------------
    def _adopt(self, info: VersionInfo, params: Tensors) -> None:
        """Make θ^version the base and the model's parameters; the inner optimizer state stays."""
        self.info, self.base = info, {n: t.clone() for n, t in params.items()}
        self.stats.version, self.stats.sha256 = info.version, state_sha256(params)
        with torch.no_grad():
            for name, p in self.trainer.model.state_dict().items():
                p.copy_(params[name])

    def _pull(self) -> None:
        pulled = self.link.pull(self.wcfg.block, self.wcfg.worker_id, self.spec)
        self.stats.full_pulls += 1
        self.stats.bytes_pulled_wire += pulled.transfer.wire
        if state_sha256(pulled.tensors) != pulled.info.sha256:
            raise MalformedInput("checksum", f"pulled block {self.wcfg.block} v{pulled.info.version} fails its hash")
        self._adopt(pulled.info, pulled.tensors)

    def _catch_up(self, target: VersionInfo) -> None:
        """Reach `target`: apply its delta when it builds on our base, else pull in full."""
        assert self.info is not None
        if target.base_version == self.info.version:
            try:
                got = self.link.fetch_delta(self.wcfg.block, target.version, self.spec)
                self.stats.delta_fetches += 1
                self.stats.bytes_pulled_wire += got.transfer.wire
                params = {n: self.base[n] + got.tensors[n] for n in self.base}  # exactly as the aggregator adds
                if state_sha256(params) == target.sha256 == got.info.sha256:
                    self._adopt(target, params)
                    return
                log.warning("block %d v%d: delta result fails the published hash; pulling in full",
                            self.wcfg.block, target.version)
            except BtnodeError as exc:
                log.warning("block %d v%d: delta unavailable (%s); pulling in full", self.wcfg.block, target.version, exc)
        self._pull()

    def _watch(self, stop: threading.Event) -> None:
        """Feed announcements from the server stream into a queue; reconnect when it breaks."""
        while not stop.is_set():
            try:
                for info in self.link.watch(self.wcfg.block, self.wcfg.worker_id):
                    self._announced.put(info)
                    if stop.is_set():
                        return
            except PeerUnavailable as exc:
                log.warning("watch stream lost (%s); reconnecting", exc)
            except BaseException as exc:  # noqa: BLE001 - handed to the main loop
                self._announced.put(exc)
                return
            stop.wait(1.0)

    def _wait_newer(self, version: int, stop: threading.Event) -> VersionInfo | None:
        deadline = time.monotonic() + self.wcfg.wait_timeout_s
        while not stop.is_set():
            if self._newest is not None and self._newest.version > version:
                return self._newest
            try:
                item = self._announced.get(timeout=min(0.5, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() >= deadline:
                    raise PeerUnavailable(f"no version after {version} within {self.wcfg.wait_timeout_s:.0f} s")
                continue
            if isinstance(item, BaseException):
                raise item
            if self._newest is None or item.version > self._newest.version:
                self._newest = item
        return None

    # -- rounds ------------------------------------------------------------------------------
    def _train(self) -> tuple[float, int]:
        t0 = time.perf_counter()
        ces = []
        for _ in range(self.wcfg.steps_per_round):
            x = self.sampler.batch(self.tc.seed, self.wcfg.worker_id, self.trainer.step, self.tc.batch)
            ces.append(self.trainer.train_step(x, self.wcfg.worker_id).ce)
        self.stats.train_seconds += time.perf_counter() - t0
        return sum(ces) / len(ces), self.wcfg.steps_per_round * self.tc.batch

    def _encode(self) -> dict[str, bytes]:
        """The codec's raw bytes of Δ (+ residual); keeps the new residual (error feedback)."""
        params = self.trainer.model.state_dict()
        delta = {n: params[n].detach().cpu() - self.base[n] for n in self.spec}
        if self.wcfg.error_feedback:
            delta = {n: d + self.residual[n] if n in self.residual else d for n, d in delta.items()}
        raw = encode_raw(delta, self.wcfg.codec)
        if self.wcfg.error_feedback:
            self.residual = {n: delta[n] - decode(self.wcfg.codec, raw[n], self.spec[n]) for n in self.spec}
        return raw

    def _frames(self, raw: dict[str, bytes]) -> Iterator[Frame]:
        """Compressed lazily, as gRPC sends: counted as they go (a re-push counts again)."""
        compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
        for n in self.spec:
            frame = frame_from_raw(n, self.spec[n], self.wcfg.codec, raw[n], compressor)
            self.stats.bytes_pushed_raw += frame.header.raw_bytes
            self.stats.bytes_pushed_wire += frame.header.payload_bytes
            yield frame

    def _push(self, raw: dict[str, bytes], loss: float, samples: int) -> Judgement:
        assert self.info is not None
        header = PushHeader(worker_id=self.wcfg.worker_id, block=self.wcfg.block, base_version=self.info.version,
                            samples=float(samples), loss=loss, codec=self.wcfg.codec, update_id=uuid.uuid4().hex)
        for attempt in range(self.wcfg.push_retries + 1):
            try:
                j = self.link.push(header, self._frames(raw))
                break
            except PeerUnavailable as exc:
                if attempt == self.wcfg.push_retries:
                    raise
                log.warning("push unavailable (%s); re-pushing the same update", exc)
                time.sleep(min(5.0, 0.5 * 2**attempt))
        self.stats.pushes += 1
        self.stats.outcomes[j.outcome.value] = self.stats.outcomes.get(j.outcome.value, 0) + 1
        return j

    def run(self, stop: threading.Event | None = None) -> WorkerStats:
        stop = stop or threading.Event()
        w = self.wcfg
        joined = self.link.join(w.worker_id, w.block, self.cfg.fingerprint(), json.dumps(self.cfg.to_dict()))
        if w.codec not in joined.codecs:
            raise MalformedInput("codec", f"the aggregator does not accept {w.codec.name} updates")
        self._pull()
        watcher = threading.Thread(target=self._watch, args=(stop,), daemon=True, name="watch")
        watcher.start()
        log.info("worker %s: block %d at version %d", w.worker_id, w.block, self.info.version if self.info else -1)
        try:
            while not stop.is_set() and (w.rounds is None or self.stats.pushes < w.rounds):
                loss, samples = self._train()
                self.stats.losses.append(loss)
                j = self._push(self._encode(), loss, samples)
                assert self.info is not None
                log.info("worker %s: block %d round %d: %s%s (CE %.4f)", w.worker_id, w.block, self.info.version,
                         j.outcome.value, f": {j.reason}" if j.reason else "", loss)
                if j.outcome is not Outcome.ACCEPTED:
                    self.residual = {}  # the delta was not applied: its rounding error means nothing
                newer = self._wait_newer(self.info.version, stop)
                if newer is None:
                    break
                self._catch_up(newer)
        finally:
            stop.set()
            try:
                self.link.leave(w.worker_id, w.block)
            except BtnodeError:
                pass
        return self.stats
