"""ZeRO: chunked sharding of parameters, gradients and optimizer state."""
from zerogpt.zero.strategy import BucketTensorShardStrategy, ShardStrategy, TensorShardStrategy

__all__ = ["ShardStrategy", "TensorShardStrategy", "BucketTensorShardStrategy"]
