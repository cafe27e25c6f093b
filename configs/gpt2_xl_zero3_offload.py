# GPT-2 XL (1.56B) on ONE GPU: ZeRO-3 with parameters and Adam state in CPU RAM (16 bytes x 1.56B = 25 GB
# of host RAM; pinned), only the chunks in flight on the GPU, activation checkpointing per block.
#   python train_gpt.py --config configs/gpt2_xl_zero3_offload.py
#   (or torchrun --standalone --nproc_per_node 1 ...; more GPUs shard the host state N ways)
# Tokens/step: 4 seqs x 1024 x 16 accumulation x 1 GPU = 65,536.
# With Adam state on disk instead: --set zero.offload_optimizer.device=disk --set zero.offload_optimizer.path=/nvme/x
from model_zoo.gpt import gpt2_xl
from zerogpt.optim import HybridAdam
from zerogpt.zero import BucketTensorShardStrategy

BATCH_SIZE = 4
GRADIENT_ACCUMULATION = 16
SEQ_LEN = 1024
precision = "bf16"
clip_grad_norm = 1.0

zero = dict(stage=3, shard_strategy=BucketTensorShardStrategy(bucket_mb=64), prefetch=2,
            offload_param=dict(device="cpu"), offload_optimizer=dict(device="cpu"))
model = dict(type=gpt2_xl, checkpoint=True)
optimizer = dict(type=HybridAdam, lr=2e-4, betas=(0.9, 0.95), weight_decay=0.1)
lr_scheduler = dict(type="cosine", warmup_steps=200, min_lr=2e-5)

data = dict(path="data/webtext/webtext_text_document", tokenizer="data/webtext/tokenizer")
train = dict(max_steps=5000, log_interval=5, eval_interval=250, eval_iters=10, save_interval=250,
             keep_last=2, output_dir="runs/gpt2_xl_zero3_offload")
