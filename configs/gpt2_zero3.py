# The seed tutorial's config as written (Colossal-AI's GPT-2 ZeRO example), on GPT-2 small: a zero dict
# without `stage` is ZeRO-3; parameters and Adam state rest in CPU RAM, stepped by HybridAdam.
#   zerogpt run --nproc-per-node 4 train_gpt.py --config configs/gpt2_zero3.py \
#       --set data.path=data/webtext/webtext_text_document --set data.tokenizer=data/webtext/tokenizer
# (or --set data.mock=True for random tokens). Tokens/step: 2 seqs x 1024 x 4 ranks = 8,192.
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
