"""The run config: schema (schema.py), the Colossal-AI form (colossalai.py), loading with `--set` overrides
(load.py), rendering the resolved config (render.py), and the config's own words for shard strategies
(strategy.py) and dtypes (dtypes.py). `from zerogpt.config import X` works for all of them."""
from zerogpt.config.colossalai import ColossalZeroConfig, zero_config
from zerogpt.config.load import (Config, RunConfig, data_config, engine_config, lr_scheduler_config, parallel_config,
                                 train_config)
from zerogpt.config.schema import (OPTIMIZER_NAMES, DataConfig, EngineConfig, EngineKeys, HostConfig, LossScaleConfig,
                                   LRSchedulerConfig, OffloadConfig, ParallelConfig, TensorParallelConfig, TrainConfig,
                                   WandbConfig, ZeroConfig, optimizer_class)
from zerogpt.config.strategy import BucketTensorShardStrategy, ShardStrategy, TensorShardStrategy

__all__ = [
    "Config", "RunConfig", "OffloadConfig", "LossScaleConfig", "ZeroConfig", "ColossalZeroConfig", "HostConfig",
    "EngineConfig", "EngineKeys", "TrainConfig", "WandbConfig", "LRSchedulerConfig", "DataConfig", "engine_config",
    "train_config", "lr_scheduler_config", "data_config", "parallel_config", "ParallelConfig", "TensorParallelConfig",
    "zero_config", "optimizer_class", "OPTIMIZER_NAMES", "ShardStrategy", "TensorShardStrategy",
    "BucketTensorShardStrategy",
]
