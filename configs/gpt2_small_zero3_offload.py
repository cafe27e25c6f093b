# GPT-2 small with ZeRO-3 and CPU offload of parameters and optimizer state (the direct form of the seed
# config): each GPU holds only the chunks in flight, host RAM holds 1/N of 16 bytes x 124M = 2 GB / N.
#   zerogpt run --nproc-per-node 4 train_gpt.py --config configs/gpt2_small_zero3_offload.py
# Tokens/step: 8 seqs x 1024 x 4 accumulation x 4 ranks = 131,072; 10,000 steps = 1.3B tokens.
from model_zoo.gpt import gpt2_small
from zerogpt.optim import HybridAdam
from zerogpt.zero import BucketTensorShardStrategy

BATCH_SIZE = 8
GRADIENT_ACCUMULATION = 4
SEQ_LEN = 1024
precision = "bf16"
clip_grad_norm = 1.0

zero = dict(stage=3, shard_strategy=BucketTensorShardStrategy(bucket_mb=25), prefetch=2,
            offload_param=dict(device="cpu"), offload_optimizer=dict(device="cpu"))
model = dict(type=gpt2_small, checkpoint=True)       # activation checkpointing per block
optimizer = dict(type=HybridAdam, lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
lr_scheduler = dict(type="cosine", warmup_steps=500, min_lr=6e-5)

data = dict(path="data/webtext/webtext_text_document", tokenizer="data/webtext/tokenizer")
train = dict(max_steps=10_000, log_interval=10, eval_interval=500, eval_iters=20, save_interval=1000,
             output_dir="runs/gpt2_small_zero3_offload")
