"""The run config: schema (schema.py), the Colossal-AI form (colossalai.py), loading with `--set` overrides
(load.py) and rendering the resolved config (render.py). `from zerogpt.config import X` works for all of them."""
from zerogpt.config.colossalai import ColossalZeroConfig, zero_config
from zerogpt.config.load import (Config, RunConfig, data_config, engine_config, lr_scheduler_config, parallel_config,
                                 train_config)
from zerogpt.config.schema import (OPTIMIZER_NAMES, DataConfig, EngineConfig, HostConfig, LossScaleConfig, LRSchedulerConfig,
                                   OffloadConfig, ParallelConfig, TensorParallelConfig, TrainConfig, WandbConfig,
                                   ZeroConfig, optimizer_class)

__all__ = [
    "Config", "RunConfig", "OffloadConfig", "LossScaleConfig", "ZeroConfig", "ColossalZeroConfig", "HostConfig", "EngineConfig",
    "TrainConfig", "WandbConfig", "LRSchedulerConfig", "DataConfig", "engine_config", "train_config", "lr_scheduler_config",
    "data_config", "parallel_config", "ParallelConfig", "TensorParallelConfig", "zero_config", "optimizer_class", "OPTIMIZER_NAMES",
]
