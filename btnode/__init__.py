"""btnode: BlockTrain, decentralised block-local pre-training of a byte-level language model."""

__version__ = "0.1.0"
