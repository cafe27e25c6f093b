# CPU demo: GPT-2 tiny on the bundled Python-docs corpus, ZeRO-2 over 2 CPU ranks, about 2 minutes.
#   zerogpt run --nproc-per-node 2 train_gpt.py --config configs/demo_cpu.py
# The first run trains a 2,048-token BPE tokenizer on data_pipeline/assets/sample/ and tokenizes it into
# .cache/demo/ (504k tokens, 95% for training). Tokens/step: 8 seqs x 128 tokens x 1 accumulation x 2 ranks
# = 2,048; 300 steps = 614k tokens, 1.3 passes over the training split.
from model_zoo.gpt import gpt2_tiny

BATCH_SIZE = 8                 # sequences per rank per micro-batch
SEQ_LEN = 128
precision = "fp32"             # CPUs have no fast fp16; bf16 works too but is slower than fp32 here
clip_grad_norm = 1.0

zero = dict(stage=2)           # shard gradients + optimizer state across the 2 ranks
model = dict(type=gpt2_tiny, n_layer=4, n_head=4, n_embd=128, max_position_embeddings=SEQ_LEN)  # ~1.1M params
optimizer = dict(type="AdamW", lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
lr_scheduler = dict(type="cosine", warmup_steps=30, min_lr=3e-4)

data = dict(path=".cache/demo/stdlib_docs", tokenizer=".cache/demo/tokenizer", split="949,50,1")
train = dict(max_steps=300, log_interval=20, eval_interval=50, eval_iters=8, save_interval=150,
             keep_last=2, output_dir="runs/demo_cpu", seed=1337)
