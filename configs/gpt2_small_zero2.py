# GPT-2 small (124M) with ZeRO-2 on 8 GPUs, bf16: gradients and Adam state sharded, weights replicated.
#   zerogpt run --nproc-per-node 8 train_gpt.py --config configs/gpt2_small_zero2.py
# Tokens/step: GLOBAL_BATCH_SIZE 512 seqs x 1024 = 524,288 (~0.5M, as GPT-3 small); on 8 GPUs that is
# 16 seqs x 4 accumulation per rank, and the accumulation adapts if the GPU count changes.
# 20,000 steps = 10.5B tokens. Data: python -m data_pipeline all ... then train-tokenizer and tokenize.
from model_zoo.gpt import gpt2_small

BATCH_SIZE = 16                # micro-batch per GPU (~40 GB activations at bf16 without checkpointing)
GLOBAL_BATCH_SIZE = 512        # sequences per optimizer step, all ranks together
SEQ_LEN = 1024
precision = "bf16"
clip_grad_norm = 1.0

zero = dict(stage=2)
model = dict(type=gpt2_small)
optimizer = dict(type="AdamW", lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
lr_scheduler = dict(type="cosine", warmup_steps=700, min_lr=6e-5)

data = dict(path="data/webtext/webtext_text_document", tokenizer="data/webtext/tokenizer")
train = dict(max_steps=20_000, log_interval=10, eval_interval=500, eval_iters=20, save_interval=1000,
             output_dir="runs/gpt2_small_zero2")
