"""A worker process that joins, starts a push, sends its header and one chunk, then stalls
forever: the test kills it with SIGKILL in the middle of the push."""

import json
import sys
import time

import torch

from btnode.codec.codecs import Codec
from btnode.codec.frames import encode_frames, iter_chunks
from btnode.model.config import ModelConfig
from btnode.protocol import PushHeader, RoundSize
from btnode.rpc import convert
from btnode.rpc.client import SwarmClient
from btnode.store.models import init_block
from btnode.train.config import TrainConfig
from btnode.train.terms import TrainingTerms
from btnode.v2 import swarm_pb2 as pb

address, worker = sys.argv[1], sys.argv[2]
cfg = ModelConfig.from_dict(json.loads(sys.argv[3]))
client = SwarmClient(address)
client.join(worker, 0, cfg.fingerprint(), json.dumps(cfg.to_dict()),  # trains with the default settings
            training_json=TrainingTerms(TrainConfig(), RoundSize().steps_per_round).to_json())
delta = {n: torch.zeros_like(t) for n, t in init_block(cfg, 0, 0).state_dict().items()}
header = PushHeader(worker_id=worker, block=0, base_version=0, samples=32.0, loss=0.0, codec=Codec.FP32,
                    update_id="stalled", steps=(0,))


def messages():
    yield pb.PushRequest(header=convert.push_header_to_pb(header))
    yield pb.PushRequest(chunk=convert.chunk_to_pb(next(iter(iter_chunks(encode_frames(delta, Codec.FP32))))))
    print("pushing", flush=True)
    while True:
        time.sleep(60)


client.stub.Push(messages())
