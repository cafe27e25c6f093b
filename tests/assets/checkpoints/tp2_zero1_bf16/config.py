# Resolved zerogpt config (zerogpt.config.Config.to_python); load with Config.from_file.
# source: <dict>
from zerogpt.config.strategy import BucketTensorShardStrategy

zero = dict(
    stage=1,
    shard_strategy=BucketTensorShardStrategy(bucket_mb=0.01),
)
precision = 'bf16'
GRADIENT_ACCUMULATION = 1
