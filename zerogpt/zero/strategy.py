"""Where the resolved config.py of runs written before the shard strategies became the config's own words
(zerogpt/config/strategy.py) imports them from: render.py names a class by its module, and those files say
`from zerogpt.zero.strategy import BucketTensorShardStrategy`. New code imports them from zerogpt.config or
zerogpt.zero; nothing in zerogpt imports this module."""
from zerogpt.config.strategy import BucketTensorShardStrategy, ShardStrategy, TensorShardStrategy

__all__ = ["ShardStrategy", "TensorShardStrategy", "BucketTensorShardStrategy"]
