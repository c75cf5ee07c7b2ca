"""weightsync: storage and replication of model weights for RL post-training."""

__version__ = "0.1.0"
