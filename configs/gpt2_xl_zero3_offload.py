# GPT-2 XL (1.56B) on ONE GPU: ZeRO-3 with the fp32 master, gradient and Adam state in CPU RAM (16 bytes x 1.56B
# = 25 GB, pinned), the bf16 parameters on the GPU (3 GB), activation checkpointing per block.
#   python train_gpt.py --config configs/gpt2_xl_zero3_offload.py
#   (or zerogpt run --nproc-per-node 1 ...; more GPUs shard the host state N ways)
# Tokens/step: 64 seqs x 1024 x 1 GPU = 65,536, in one micro-batch: the host step (CPU Adam) costs the same per
# step however the tokens are split, so one large micro-batch amortises it; 4 x 16 accumulation ran 7.6x slower.
# Measured on one H100 80GB (bench/results/spec_zxl64.json, bench/gpu_measure.py at baad7cf, 2026-11-24): this
# model, micro-batch and offload: 28,812 tokens/s, GPU peak 49.8 GiB, host 41.3 GiB; with the params offloaded
# too, 25,801. Through train_gpt.py with this file: not yet measured (bench/gpu_check.py's shipped_config phase).
# GPU smaller than ~60 GB: --set BATCH_SIZE=16 --set GRADIENT_ACCUMULATION=4, or add offload_param=dict(device="cpu").
# With Adam state on disk instead: --set zero.offload_optimizer.device=disk --set zero.offload_optimizer.path=/nvme/x
from model_zoo.gpt import gpt2_xl
from zerogpt.optim import HybridAdam
from zerogpt.zero import BucketTensorShardStrategy

BATCH_SIZE = 64
GRADIENT_ACCUMULATION = 1
SEQ_LEN = 1024
precision = "bf16"
clip_grad_norm = 1.0

zero = dict(stage=3, shard_strategy=BucketTensorShardStrategy(bucket_mb=64), prefetch=2,
            offload_optimizer=dict(device="cpu"))
model = dict(type=gpt2_xl, checkpoint=True)
optimizer = dict(type=HybridAdam, lr=2e-4, betas=(0.9, 0.95), weight_decay=0.1)
lr_scheduler = dict(type="cosine", warmup_steps=200, min_lr=2e-5)

data = dict(path="data/webtext/webtext_text_document", tokenizer="data/webtext/tokenizer")
train = dict(max_steps=5000, log_interval=5, eval_interval=250, eval_iters=10, save_interval=250,
             keep_last=2, output_dir="runs/gpt2_xl_zero3_offload")
