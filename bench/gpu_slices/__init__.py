"""The slices of bench/gpu_check.py: GPU measurements cut to fit one lent machine's 15 minutes (issue 42).

Each slice is one module with a `run(args, budget, result)` that fills its part of the result and saves it as it
goes: verify.py (the CUDA paths: `pytest -m gpu`, the shipped config through train_gpt.py, device syncs per step),
offload.py (zerogpt against DeepSpeed ZeRO-Offload), largest.py (Llama-3.1-8B's shape, everything offloaded),
compute.py (MFU without offload). runner.py owns the processes, the clock and the installs; record.py owns the
result files, which slice is next, and the goals table of bench/README.md.
"""

SLICES = ("verify", "offload", "largest", "compute")
"""In the order the issue gives them: the order of first measurement, and of ties."""
