"""Stage `group-duplicates`: union-find the verified pairs of find-duplicates into groups.

Pairs below --threshold are ignored (so one find run at a low threshold serves several group
thresholds). The keeper of a group is its first document in input order, (source order, line):
deterministic, unlike Megatron's tool where the survivor depended on Python set order. Group
sizes go to the stats. Does not read texts; remove-duplicates applies the groups.

    python -m data_pipeline group-duplicates pairs.jsonl --output groups.jsonl --threshold 0.7
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import Counter, defaultdict

from data_pipeline.cli_args import add_common_args, add_output_arg, check_input
from data_pipeline.files import atomic_write
from data_pipeline.jsonl import BadLineReporter, dumps, iter_jsonl
from data_pipeline.stats import read_stats, write_stats
from data_pipeline.workers import progress


class UnionFind:
    """Disjoint sets over hashable keys; the root of a set is always its smallest key."""

    def __init__(self) -> None:
        self.parent: dict = {}

    def find(self, x):
        parent = self.parent
        root = parent.setdefault(x, x)
        while parent[root] != root:
            root = parent[root]
        while parent[x] != root:  # path compression
            parent[x], x = root, parent[x]
        return root

    def union(self, a, b) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            # the smaller key becomes the root: the root is the group's keeper
            lo, hi = (ra, rb) if ra < rb else (rb, ra)
            self.parent[hi] = lo


def _doc_key(ref) -> tuple[int, int]:
    """(src, line) of a document reference; ValueError if it is not one."""
    if not isinstance(ref, dict) or not isinstance(ref.get("src"), int) or not isinstance(ref.get("line"), int):
        raise ValueError("document reference needs integer 'src' and 'line'")
    return ref["src"], ref["line"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("group-duplicates", help="union-find duplicate pairs into groups",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("pairs", help="JSONL of pairs from find-duplicates")
    add_output_arg(p, "JSONL, one group per line: {keep, remove, size}")
    p.add_argument("--threshold", type=float, default=0.7, help="ignore pairs with a lower Jaccard")
    add_common_args(p)
    return p


def run(args: argparse.Namespace) -> int:
    started = time.time()
    check_input(args.pairs)
    pair_stats = read_stats(args.pairs) or {}
    find_threshold = (pair_stats.get("params") or {}).get("threshold")
    if isinstance(find_threshold, (int, float)) and args.threshold < find_threshold:
        print(f"warning: --threshold {args.threshold} is below the find-duplicates threshold {find_threshold}; "
              f"pairs between them were never written, so groups are those of {find_threshold}", file=sys.stderr)
    counts: Counter = Counter(pairs=0, below_threshold=0, malformed=0)
    report = BadLineReporter(args.pairs, args.strict)
    uf, refs = UnionFind(), {}
    for lineno, rec, _ in progress(iter_jsonl(args.pairs, counts, args.strict, text_key=None),
                                   desc="group-duplicates", unit="pair"):
        try:
            a, b, j = _doc_key(rec.get("a")), _doc_key(rec.get("b")), rec.get("jaccard")
            if not isinstance(j, (int, float)) or isinstance(j, bool):
                raise ValueError(f"'jaccard' must be a number, got {j!r}")
        except ValueError as e:
            counts["malformed"] += 1
            report(lineno, f"not a pair record ({e})")
            continue
        counts["pairs"] += 1
        if j < args.threshold:
            counts["below_threshold"] += 1
            continue
        refs.setdefault(a, rec["a"])
        refs.setdefault(b, rec["b"])
        uf.union(a, b)

    members = defaultdict(list)
    for key in refs:
        members[uf.find(key)].append(key)
    sizes: Counter = Counter()
    with atomic_write(args.output) as out:
        for root in sorted(members):
            group = sorted(members[root])
            assert group[0] == root, f"keeper {root} is not the first of {group[:3]}"
            out.write(dumps({"keep": refs[root], "remove": [refs[k] for k in group[1:]], "size": len(group)}))
            sizes[len(group)] += 1
    counts["groups"] = len(members)
    counts["docs_in_groups"] = len(refs)
    counts["to_remove"] = len(refs) - len(members)
    write_stats(args.output, "group-duplicates", counts, args, [args.pairs], started,
                group_sizes={str(k): v for k, v in sorted(sizes.items())},
                max_group_size=max(sizes, default=0))
    return 0
