# CPU demo, Llama family, step 1 of 3: model_zoo's llama_tiny, widened to 4 layers x 128, pretrained from scratch
# on the bundled sample (the demo's data and 2,048-token tokenizer), ZeRO-2 over 2 CPU ranks:
#   zerogpt run --nproc-per-node 2 train_gpt.py --config configs/llama_tiny_cpu.py
#   python -m zerogpt_tools.export runs/llama_tiny_cpu --out exports/llama_tiny     # step 2: a Hugging Face Llama
#   zerogpt run --nproc-per-node 2 train_gpt.py --config configs/llama_continue_cpu.py   # step 3
# Tokens/step: 8 seqs x 128 tokens x 1 accumulation x 2 ranks = 2,048; 300 steps = 614k tokens.
from model_zoo.llama import llama_tiny

BATCH_SIZE = 8                 # sequences per rank per micro-batch
SEQ_LEN = 128
precision = "fp32"             # CPUs have no fast fp16
clip_grad_norm = 1.0

zero = dict(stage=2)           # shard gradients + optimizer state across the 2 ranks
# GQA (4 q / 2 kv heads), SwiGLU 352 (~8/3 x 128), untied head; vocab 2,048 from the data: 1.26M params
model = dict(type=llama_tiny, hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=SEQ_LEN)
optimizer = dict(type="AdamW", lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
lr_scheduler = dict(type="cosine", warmup_steps=30, min_lr=3e-4)

data = dict(path=".cache/demo/stdlib_docs", tokenizer=".cache/demo/tokenizer", split="949,50,1")
train = dict(max_steps=300, log_interval=20, eval_interval=50, eval_iters=8, save_interval=150,
             keep_last=2, output_dir="runs/llama_tiny_cpu", seed=1337)
