"""Stage `merge-tokenizers`: extend tokenizer A with the vocabulary of B, keeping every id of A.

Two kinds, as models ship them; A and B must be the same kind (their pieces are spelled differently):
- byte-level BPE tokenizer.json (GPT-2, Llama-3, Qwen2/2.5/3): A's vocabulary, added/special tokens
  (`<|begin_of_text|>`, `<|im_end|>`, ...) and merge order are kept exactly; B's regular tokens that A lacks get
  ids after A's largest id (added tokens included), in B's id order; B's merges that A lacks are appended after
  A's, so they apply only where A's merges leave pieces B knows how to join; B's added tokens that A lacks follow.
- sentencepiece tokenizer.model (Llama-2, Mistral v0.1): the model protos are merged as Chinese-LLaMA's
  `merge_tokenizers.py` does it: B's normal pieces that A lacks are appended as NORMAL pieces with score 0
  (user-defined ones stay USER_DEFINED); B's control, byte and unknown pieces are not copied (A has its own).
  Score 0 ranks B's pieces first in sentencepiece's own BPE, while transformers' conversion of tokenizer.model
  orders merges by id, B's last; so the two may split a text differently (both decode to it, A's ids unchanged).
The output keeps A's tokenizer_config.json and special_tokens_map.json (class, bos/eos/unk, chat template), so
`transformers.AutoTokenizer.from_pretrained(DIR)` and `data_pipeline.load_tokenizer(DIR)` load it and A's eos stays
the eos. Grow the model's embedding to the new size with `python -m zerogpt_tools.extend_vocab`.

    python -m data_pipeline merge-tokenizers runs/tok_web runs/tok_code --out runs/tok_web_code
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import time

from data_pipeline.files import atomic_dir
from data_pipeline.stats import write_stats
from data_pipeline.tokenizer import load_backend, save_tokenizer_dir

BPE, SENTENCEPIECE = "byte-level BPE tokenizer.json", "sentencepiece tokenizer.model"
_CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")


def tokenizer_kind(path: str) -> str:
    """SENTENCEPIECE for a .model file or a directory with a tokenizer.model (Llama-2 ships it beside a derived
    tokenizer.json, which is then ignored), else BPE (a tokenizer.json file or directory, or vocab.json +
    merges.txt)."""
    return SENTENCEPIECE if os.path.isfile(_model_file(path)) else BPE


def _model_file(path: str) -> str:
    """The sentencepiece model of `path`: the file itself (spm_train's PREFIX.model), or DIR/tokenizer.model."""
    return path if os.path.isfile(path) and path.endswith(".model") else os.path.join(path, "tokenizer.model")


# ------------------------------------------------------------------------------------------------
# byte-level BPE (tokenizer.json)


def _bpe_json(path: str) -> dict:
    """tokenizer.json of `path` as a dict; ValueError unless it is a byte-level BPE.

    The file itself when there is one (so A's ids, added tokens and post-processor are the ones written back),
    else the backend `load_backend` builds (GPT-2 style vocab.json + merges.txt)."""
    json_file = path if os.path.isfile(path) else os.path.join(path, "tokenizer.json")
    if os.path.isfile(json_file):
        try:
            with open(json_file, encoding="utf-8") as f:
                spec = json.load(f)
        except ValueError as e:
            raise ValueError(f"tokenizer {json_file} is not valid JSON ({e})") from None
    else:
        backend, _, _ = load_backend(path, require_eod=False)
        spec = json.loads(backend.to_str())
    model = spec.get("model") if isinstance(spec, dict) else None
    if not isinstance(model, dict):  # a JSONL line, a config.json: JSON, but no tokenizer
        raise ValueError(f"tokenizer {path} is JSON but no tokenizer.json (it has no \"model\" section); pass a "
                         f"tokenizer directory or its tokenizer.json (or a sentencepiece tokenizer.model)")
    if model.get("type") != "BPE":
        raise ValueError(f"tokenizer {path} is a {model.get('type')} model; merge-tokenizers merges byte-level "
                         "BPE tokenizer.json (GPT-2, Llama-3, Qwen) or sentencepiece tokenizer.model tokenizers")
    if "ByteLevel" not in json.dumps(spec.get("pre_tokenizer")):
        raise ValueError(f"tokenizer {path} has no ByteLevel pre-tokenizer ({spec.get('pre_tokenizer')}); "
                         "merge-tokenizers merges byte-level BPE tokenizer.json (GPT-2, Llama-3, Qwen) or "
                         "sentencepiece tokenizer.model tokenizers")
    return spec


def _pairs(merges: list) -> list[tuple[str, str]]:
    """Merges as (left, right) pairs; tokenizer.json stores either "a b" strings or [a, b] lists."""
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else (m[0], m[1]) for m in merges]


def merge_specs(spec_a: dict, spec_b: dict) -> tuple[dict, dict]:
    """Merge two byte-level BPE tokenizer.json dicts (A's ids first). Returns (merged spec, counts)."""
    vocab_a: dict[str, int] = spec_a["model"]["vocab"]
    vocab_b: dict[str, int] = spec_b["model"]["vocab"]
    added_a = {t["content"]: t["id"] for t in spec_a.get("added_tokens", [])}
    # Llama-3's and Qwen's special tokens sit past the model vocabulary (ids 128000+), and B's tokens go after
    # them. They join the model vocabulary at their ids: tokenizers numbers an added token the model lacks from
    # the model's size on, which would move them past B's tokens.
    vocab = {**{t: i for t, i in added_a.items() if t not in vocab_a}, **vocab_a}
    next_id = max([*vocab.values(), -1]) + 1
    new_tokens = 0
    for token, _ in sorted(vocab_b.items(), key=lambda kv: kv[1]):
        if token not in vocab and token not in added_a:
            vocab[token] = next_id
            next_id += 1
            new_tokens += 1

    merges = _pairs(spec_a["model"]["merges"])
    known = set(merges)
    new_merges = 0
    for pair in _pairs(spec_b["model"]["merges"]):
        if pair not in known and all(p in vocab for p in (pair[0], pair[1], pair[0] + pair[1])):
            # B's vocab holds both pieces and their join, and all of B's regular vocab is now in `vocab`
            # (a piece is missing only where it is one of A's added tokens, which never take part in merges).
            merges.append(pair)
            known.add(pair)
            new_merges += 1

    added = [dict(t) for t in spec_a.get("added_tokens", [])]
    for t in spec_b.get("added_tokens", []):
        if t["content"] in added_a:
            continue
        token_id = vocab.get(t["content"])
        if token_id is None:  # an added token outside B's model vocab: the next free id, in the vocabulary too
            token_id, next_id = next_id, next_id + 1
            vocab[t["content"]] = token_id
            new_tokens += 1
        added.append({**t, "id": token_id})

    merged = json.loads(json.dumps(spec_a))
    merged["model"]["vocab"] = vocab
    merged["model"]["merges"] = [list(p) for p in merges]
    merged["added_tokens"] = sorted(added, key=lambda t: t["id"])
    counts = {"vocab_a": len(vocab_a) + len(set(added_a) - set(vocab_a)), "vocab_b": len(vocab_b),
              "new_tokens": new_tokens, "new_merges": new_merges, "vocab": next_id}
    return merged, counts


def _merge_bpe(a: str, b: str, out_dir: str) -> dict:
    """Merge two byte-level BPE tokenizers and write the result (A's configuration files kept). Returns counts."""
    from tokenizers import Tokenizer

    spec_a = _bpe_json(a)
    merged, counts = merge_specs(spec_a, _bpe_json(b))
    backend = Tokenizer.from_str(json.dumps(merged))
    if not os.path.isfile(os.path.join(a, "tokenizer_config.json")):
        save_tokenizer_dir(backend, out_dir)  # a bare tokenizer.json or vocab.json + merges.txt: GPT-2 defaults
        return counts
    with atomic_dir(out_dir) as tmp:
        backend.save(os.path.join(tmp, "tokenizer.json"))
        added_a = {t["content"] for t in spec_a.get("added_tokens", [])}
        _copy_configs(a, tmp, added=[t for t in merged["added_tokens"] if t["content"] not in added_a])
        if os.path.isfile(os.path.join(a, "vocab.json")):  # tools that read GPT-2's files see the merged ones
            backend.model.save(tmp)
    return counts


def _copy_configs(a: str, out_dir: str, added: list[dict]) -> None:
    """A's tokenizer_config.json, special_tokens_map.json and chat template into `out_dir`; B's added tokens are
    appended to the config's added_tokens_decoder (transformers reads them from tokenizer.json as well)."""
    for name in ("chat_template.jinja", "chat_template.json"):  # transformers 5 keeps the template beside the config
        if os.path.isfile(os.path.join(a, name)):
            shutil.copy(os.path.join(a, name), os.path.join(out_dir, name))
    for name in _CONFIG_FILES:
        src = os.path.join(a, name)
        if not os.path.isfile(src):
            continue
        with open(src, encoding="utf-8") as f:
            config = json.load(f)
        decoder = config.get("added_tokens_decoder")
        if name == "tokenizer_config.json" and isinstance(decoder, dict):
            for t in added:
                decoder.setdefault(str(t["id"]), {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip",
                                                                     "single_word", "special") if k in t})
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)


# ------------------------------------------------------------------------------------------------
# sentencepiece (tokenizer.model)


def _read_proto(path: str):
    """The sentencepiece ModelProto of `path` (a .model file, or a directory's tokenizer.model)."""
    from google.protobuf.message import DecodeError
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    model_file = _model_file(path)
    with open(model_file, "rb") as f:
        try:
            proto.ParseFromString(f.read())
        except DecodeError as e:
            raise ValueError(f"{model_file} is not a sentencepiece model ({e})") from None
    return proto


def merge_protos(proto_a, proto_b) -> dict:
    """Append proto_b's NORMAL and USER_DEFINED pieces that proto_a lacks to proto_a, score 0 (in place, as
    Chinese-LLaMA's merge_tokenizers.py does). Returns counts."""
    from sentencepiece import sentencepiece_model_pb2

    piece = sentencepiece_model_pb2.ModelProto.SentencePiece
    have = {p.piece for p in proto_a.pieces}
    new_tokens = skipped = 0
    for p in proto_b.pieces:
        if p.piece in have:
            continue
        if p.type not in (piece.NORMAL, piece.USER_DEFINED):
            skipped += 1  # B's own <s>, </s>, <unk>, <0xNN> byte pieces: A has its own, or no byte fallback
            continue
        new = proto_a.pieces.add()
        new.piece, new.score, new.type = p.piece, 0.0, p.type
        have.add(p.piece)
        new_tokens += 1
    vocab_a = len(proto_a.pieces) - new_tokens
    proto_a.trainer_spec.vocab_size = len(proto_a.pieces)
    return {"vocab_a": vocab_a, "vocab_b": len(proto_b.pieces), "new_tokens": new_tokens,
            "skipped_b_pieces": skipped, "vocab": len(proto_a.pieces)}


def _added_past(path: str, n_pieces: int) -> list[tuple[str, int]]:
    """(token, id) of tokens that directory `path`'s transformers files add past the sentencepiece pieces."""
    added: dict[str, int] = {}
    for name in ("added_tokens.json", "tokenizer_config.json"):
        try:
            with open(os.path.join(path, name), encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        if name == "added_tokens.json":
            added.update({t: int(i) for t, i in data.items()})
        else:
            decoder = data.get("added_tokens_decoder") or {}
            added.update({(t.get("content") if isinstance(t, dict) else str(t)): int(i) for i, t in decoder.items()})
    return sorted(((t, i) for t, i in added.items() if i >= n_pieces), key=lambda ti: ti[1])


def _merge_sentencepiece(a: str, b: str, out_dir: str) -> dict:
    """Merge two sentencepiece models; write tokenizer.model and A's configuration files. Returns counts."""
    if not os.path.isfile(os.path.join(a, "tokenizer_config.json")):
        raise ValueError(f"tokenizer {a}: the base of a sentencepiece merge must be a model's tokenizer directory "
                         f"(tokenizer.model + tokenizer_config.json), whose class and special tokens the merged one "
                         f"keeps; B may be a bare .model file")
    proto_a, proto_b = _read_proto(a), _read_proto(b)
    types = {proto.trainer_spec.model_type for proto in (proto_a, proto_b)}
    if len(types) != 1:
        names = [type(proto_a.trainer_spec).ModelType.Name(p.trainer_spec.model_type) for p in (proto_a, proto_b)]
        raise ValueError(f"tokenizer {a} is a sentencepiece {names[0]} model and {b} a {names[1]} one; their piece "
                         f"scores mean different things, so merge-tokenizers merges models of the same type only")
    beyond = _added_past(a, len(proto_a.pieces))
    if beyond:
        raise ValueError(f"tokenizer {a} adds tokens past its {len(proto_a.pieces)} sentencepiece pieces "
                         f"({beyond[:3]}, in tokenizer_config.json/added_tokens.json); B's pieces would take their "
                         f"ids, so add them to tokenizer.model as user-defined pieces first, or drop them")
    counts = merge_protos(proto_a, proto_b)
    with atomic_dir(out_dir) as tmp:
        with open(os.path.join(tmp, "tokenizer.model"), "wb") as f:
            f.write(proto_a.SerializeToString())
        _copy_configs(a, tmp, added=[])
    return counts


# ------------------------------------------------------------------------------------------------


def merge_tokenizers(a: str, b: str, out_dir: str) -> dict:
    """Merge tokenizer `b` into `a`, save at `out_dir` (atomically); returns stats (also `out_dir.stats.json`).

    Args:
        a: the model's tokenizer directory (its ids stay): byte-level BPE tokenizer.json (or vocab.json +
            merges.txt), or sentencepiece tokenizer.model, with its tokenizer_config.json.
        b: a tokenizer of the same kind whose new tokens are appended.
    Raises:
        ValueError naming the tokenizer when one is missing, of another kind, or not mergeable.
    Example:
        >>> merge_tokenizers("runs/tok_web", "runs/tok_code", "runs/tok_both")["counts"]["vocab"]   # doctest: +SKIP
        58112
    """
    started = time.time()
    for path in (a, b):
        if not os.path.exists(path):
            raise ValueError(f"tokenizer {path} does not exist; pass a tokenizer directory (tokenizer.json, "
                             f"tokenizer.model, or vocab.json + merges.txt)")
    kind_a, kind_b = tokenizer_kind(a), tokenizer_kind(b)
    if kind_a != kind_b:
        raise ValueError(f"tokenizer {a} is a {kind_a} and {b} a {kind_b}: their pieces are spelled differently "
                         f"(byte-level 'Ġ' vs sentencepiece '▁', byte fallback), so merge two of the same kind")
    out_dir = os.path.abspath(out_dir.rstrip("/"))
    counts = (_merge_sentencepiece if kind_a == SENTENCEPIECE else _merge_bpe)(a, b, out_dir)
    # Loaded back as training and extend_vocab will load it: the size counts the added tokens.
    _, _, size = load_backend(out_dir, require_eod=False)
    return write_stats(out_dir, "merge-tokenizers", counts, started=started, kind=kind_a,
                       tokenizers=[os.path.abspath(a), os.path.abspath(b)], vocab_size=size)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("merge-tokenizers", help="merge tokenizer vocabularies",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", help="base tokenizer directory: its ids stay unchanged")
    p.add_argument("b", help="tokenizer directory (same kind) whose new tokens are appended")
    p.add_argument("--out", required=True, help="merged tokenizer directory to write")
    return p


def run(args: argparse.Namespace) -> int:
    stats = merge_tokenizers(args.a, args.b, args.out)
    c = stats["counts"]
    merges = f", +{c['new_merges']} merges" if "new_merges" in c else ""
    print(f"[merge-tokenizers] {c['vocab_a']} + {c['new_tokens']} new tokens{merges} "
          f"-> vocab {stats['vocab_size']} at {args.out}")
    return 0
