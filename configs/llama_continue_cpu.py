# CPU demo, Llama family, step 3 of 3: continue pretraining the Hugging Face Llama that steps 1-2 wrote, as one
# continues Llama / Qwen / Mistral weights, ZeRO-3 over 2 CPU ranks (each rank reads only its shards' rows):
#   zerogpt run --nproc-per-node 2 train_gpt.py --config configs/llama_tiny_cpu.py
#   python -m zerogpt_tools.export runs/llama_tiny_cpu --out exports/llama_tiny
#   zerogpt run --nproc-per-node 2 train_gpt.py --config configs/llama_continue_cpu.py
# Tokens/step: 8 seqs x 128 tokens x 1 accumulation x 2 ranks = 2,048; 200 steps = 410k tokens.
BATCH_SIZE = 8                 # sequences per rank per micro-batch
SEQ_LEN = 128                  # <= the checkpoint's max_position_embeddings (128)
precision = "fp32"
clip_grad_norm = 1.0

zero = dict(stage=3)           # parameters sharded too: filled from the safetensors files, shard by shard
# config.json names LlamaForCausalLM: model_zoo's native Llama, built on the meta device, weights streamed
model = dict(type="hf", path="exports/llama_tiny")
# a third of step 1's peak LR, with a warmup: the weights are trained, Adam's moments start at zero
optimizer = dict(type="AdamW", lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
lr_scheduler = dict(type="cosine", warmup_steps=20, min_lr=1e-4)

# The data step 1 tokenized; its tokenizer is the one the export ships (exports/llama_tiny/tokenizer.json)
data = dict(path=".cache/demo/stdlib_docs", tokenizer=".cache/demo/tokenizer", split="949,50,1")
train = dict(max_steps=200, log_interval=20, eval_interval=50, eval_iters=8, save_interval=100,
             keep_last=2, output_dir="runs/llama_continue_cpu", seed=1337)
