# GPT-2 medium (345M in Megatron's count) with a 2-stage pipeline: the seed's Megatron-LM run
# (pretrain_gpt_distributed_with_mp.sh, --pipeline-model-parallel-size 2) as a zerogpt config, fp16.
#   zerogpt run --nproc-per-node 2 train_gpt.py --config configs/gpt2_medium_pp2.py
# Layout: P=2 stages of 12 blocks each (embedding on the first, head on the last), so D = world / (T x P) =
# 2 / 2 = 1 data-parallel rank; with more GPUs D grows and ZeRO (stages 0-2; not 3) shards over it.
# Tokens/step: GLOBAL_BATCH_SIZE 8 seqs x 1024 = 8,192 (2 micro-batches of 4 seqs through the pipeline x D=1).
from model_zoo.gpt import gpt2_medium

BATCH_SIZE = 4                 # --micro-batch-size 4
GLOBAL_BATCH_SIZE = 8          # --global-batch-size 8: micro-batches per step = 8 / (4 x D)
SEQ_LEN = 1024                 # --seq-length 1024 (and --max-position-embeddings 1024: gpt2_medium's)
precision = "fp16"             # --fp16: fp32 masters, dynamic loss scale from 2^32 as Megatron's
clip_grad_norm = 1.0

parallel = dict(tensor=dict(size=1), pipeline=2)
zero = dict(stage=1, loss_scale=dict(initial_scale=2.0**32))   # at D > 1, Megatron's --use-distributed-optimizer
model = dict(type=gpt2_medium, dropout=0.1)                    # Megatron's default hidden/attention dropout
optimizer = dict(type="AdamW", lr=1.5e-4, weight_decay=0.01)   # Adam betas (0.9, 0.999), eps 1e-8: both defaults
lr_scheduler = dict(type="cosine", warmup_steps=3200, min_lr=1e-5, total_steps=320_000)  # warmup .01 x decay iters

data = dict(path="data/webtext/webtext_text_document", tokenizer="data/webtext/tokenizer", split="949,50,1")
train = dict(max_steps=500_000, log_interval=100, eval_interval=1000, eval_iters=10, save_interval=10_000,
             output_dir="runs/gpt2_medium_pp2")
