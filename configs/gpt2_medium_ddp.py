# GPT-2 medium (355M) as plain data parallelism (ZeRO stage 0 = DDP: every rank holds all of the model
# state, 16 bytes x 355M = 5.7 GB, gradients all-reduced). The baseline the ZeRO stages are measured against.
#   zerogpt run --nproc-per-node 8 train_gpt.py --config configs/gpt2_medium_ddp.py
# Tokens/step: GLOBAL_BATCH_SIZE 512 seqs x 1024 = 524,288 (8 seqs x 8 accumulation x 8 GPUs).
from model_zoo.gpt import gpt2_medium

BATCH_SIZE = 8
GLOBAL_BATCH_SIZE = 512
SEQ_LEN = 1024
precision = "bf16"
clip_grad_norm = 1.0

zero = dict(stage=0)
model = dict(type=gpt2_medium)
optimizer = dict(type="AdamW", lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
lr_scheduler = dict(type="cosine", warmup_steps=1000, min_lr=3e-5)

data = dict(path="data/webtext/webtext_text_document", tokenizer="data/webtext/tokenizer")
train = dict(max_steps=40_000, log_interval=10, eval_interval=1000, eval_iters=20, save_interval=2000,
             output_dir="runs/gpt2_medium_ddp")
