# The Colossal-AI GPT-2 ZeRO tutorial config (DESIGN §4), kept verbatim: zerogpt must load it unchanged.
from model_zoo.gpt import gpt2_small
from zerogpt.zero import TensorShardStrategy
from zerogpt.optim import HybridAdam

BATCH_SIZE = 2
NUM_EPOCHS = 60
SEQ_LEN = 1024

zero = dict(
    model_config=dict(
        offload_config=dict(device="cpu"),
        shard_strategy=TensorShardStrategy()
    ),
    optimizer_config=dict(
        cpu_offload=True,
    )
)

optimizer = dict(
    type=HybridAdam,
    lr=0.00015,
    weight_decay=1e-2,
)

model = dict(
    type=gpt2_small,
    checkpoint=True,
)
