"""ZeRO: chunked sharding of parameters, gradients and optimizer state.

The shard strategies are the config's words (zerogpt/config/strategy.py); they are importable from here too, as
the Colossal-AI tutorial's configs import them (`from zerogpt.zero import TensorShardStrategy`)."""
from zerogpt.config.strategy import BucketTensorShardStrategy, ShardStrategy, TensorShardStrategy

__all__ = ["ShardStrategy", "TensorShardStrategy", "BucketTensorShardStrategy"]
