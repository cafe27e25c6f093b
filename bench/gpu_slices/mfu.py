"""Model FLOPs and the figures the goals read from a compute table (no torch: record.py uses it for --status).

`llama_flops_per_token` is the PaLM count (appendix B) for a Llama-family shape given as its config.json keys:
the head's matmul counted at the full (real) vocabulary, the k/v projections at their GQA width. The compute
slices (compute.py, compute_llama.py) turn their rows into a table; `table_figures` turns a table into the
figures the goals table holds (best MFU per stage, chunked loss and FP8 speed ratios, the batch that fit), and
record.py applies it to a recorded compute table that predates a figure, so an older record still feeds a new goal.
"""
from __future__ import annotations

from typing import Any, Mapping


def llama_params_in_matmuls(shape: Mapping[str, Any]) -> int:
    """Parameters a token's forward multiplies by (PaLM's N): every layer, the final norm and the head.

    The input embedding is a lookup, not a matmul: left out when the head is untied; a tied head is the embedding,
    counted once as the head. Args: `shape` with Hugging Face's LlamaConfig keys (vocab_size, hidden_size,
    intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim or None)."""
    C, L, V = shape["hidden_size"], shape["num_hidden_layers"], shape["vocab_size"]
    q_heads = shape["num_attention_heads"]
    kv_heads = shape.get("num_key_value_heads") or q_heads
    head_dim = shape.get("head_dim") or C // q_heads
    attention = C * q_heads * head_dim + 2 * C * kv_heads * head_dim + q_heads * head_dim * C  # q, k, v, o
    mlp = 3 * C * shape["intermediate_size"]  # SwiGLU: gate, up, down
    norms = 2 * C
    return L * (attention + mlp + norms) + C + V * C  # + final norm + head


def llama_flops_per_token(shape: Mapping[str, Any], seq: int) -> int:
    """Training FLOPs per token (forward + backward), PaLM appendix B: 6 N + 12 L H Q T, with N from
    llama_params_in_matmuls (GQA's narrower k/v, the whole vocabulary's head), H the query heads, Q their width
    and T the sequence (attention's two matmuls per query head, forward and backward).

    Example (Llama-3.2-1B at 2048 tokens): 6 x 1,235,814,400 + 12 x 16 x 32 x 64 x 2048 = 8,220,192,768."""
    q_heads = shape["num_attention_heads"]
    head_dim = shape.get("head_dim") or shape["hidden_size"] // q_heads
    return 6 * llama_params_in_matmuls(shape) + 12 * shape["num_hidden_layers"] * q_heads * head_dim * seq


# -------------------------------------------------------------------------------------------------
# figures from a compute table: rows dict(system, stage, variant, mfu, tokens_per_s, batch, ...)

def _ok(rows: list[dict]) -> list[dict]:
    return [r for r in rows if not r.get("error") and r.get("tokens_per_s")]


def best_mfu(rows: list[dict], stage: int | None = None) -> tuple[float | None, str | None]:
    """The best zerogpt MFU (at `stage`, or any) and the row it comes from."""
    rows = [r for r in _ok(rows) if r["system"] == "zerogpt" and r.get("mfu") and stage in (None, r["stage"])]
    if not rows:
        return None, None
    best = max(rows, key=lambda r: r["mfu"])
    return best["mfu"], f"stage {best['stage']}, {best['variant']}" + (f", b{best['batch']}" if best.get("batch")
                                                                         else "")


def speed_ratio(rows: list[dict], pairs: list[tuple[str, str]]) -> tuple[float | None, str | None]:
    """The smallest zerogpt tokens/s ratio `variant / baseline` over the stages and the (variant, baseline) pairs
    measured at one batch: the goal holds only if every measured pair meets it."""
    by = {(r["stage"], r["variant"], r.get("batch")): r for r in _ok(rows) if r["system"] == "zerogpt"}
    ratios = []
    for (stage, variant, batch), r in by.items():
        for new, base in pairs:
            if variant == new and (stage, base, batch) in by:
                ratios.append((r["tokens_per_s"] / by[(stage, base, batch)]["tokens_per_s"],
                               f"{new} / {base}, stage {stage}"))
    return min(ratios) if ratios else (None, None)


CHUNKED_PAIRS = [("chunked loss", "eager"), ("compile+chunked loss", "compile")]
FP8_PAIRS = [("fp8+compile", "compile")]


def table_figures(prefix: str, table: list[dict]) -> dict:
    """The goal figures of one model's compute table, each under `prefix` ("gpt2xl", "llama1b", "llama3b"):
    best MFU at stage 0 and 3 and overall (each with `_what`), the chunked loss's and FP8 + compile's smallest
    speed ratio against their plain twins (`_what` names the pair), plain PyTorch's MFU, the batch measured."""
    out: dict = {}
    for stage in (0, 3, None):
        key = f"{prefix}_mfu_" + ("best" if stage is None else f"stage{stage}")
        out[key], out[key + "_what"] = best_mfu(table, stage)
    out[f"{prefix}_chunked_ratio"], out[f"{prefix}_chunked_ratio_what"] = speed_ratio(table, CHUNKED_PAIRS)
    out[f"{prefix}_fp8_ratio"], out[f"{prefix}_fp8_ratio_what"] = speed_ratio(table, FP8_PAIRS)
    torch_rows = [r for r in _ok(table) if r["system"] == "torch" and r.get("mfu")]
    out[f"{prefix}_torch_mfu"] = max((r["mfu"] for r in torch_rows), default=None)
    batches = [r.get("batch") for r in _ok(table) if r["system"] == "zerogpt" and r["variant"] == "eager"]
    out[f"{prefix}_batch"] = min((b for b in batches if b), default=None)
    return out
