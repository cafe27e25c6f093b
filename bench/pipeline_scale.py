"""Benchmark: the pipeline's CPU stages as sharded tasks, at 1 and 2 workers, on each executor.

On bench/dedup.py's labelled corpus (real text + edited copies), runs cleanup and
find-duplicates + group-duplicates three ways:

  mp        today's stage commands (`python -m data_pipeline cleanup ... --workers W`): one
            process with a multiprocessing pool
  local     the same stages as datatrove tasks on LocalPipelineExecutor (what `all` runs)
  ray       the same tasks on RayPipelineExecutor, on a local Ray with W CPUs

and, as the engine trial of bench/README.md, cleanup as a Ray Data `map_batches` over the same
lines. Reports docs/s per worker, the peak RSS of a task, and the dedup pairs' F1 against the
exact labels (and whether they equal the single-process pairs).

    python bench/pipeline_scale.py --sources 1500 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time

# the repository root instead of bench/, whose tokenize.py would shadow the stdlib module Ray needs
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from bench.dedup import build_corpus, components, exact_pairs, score  # noqa: E402
from data_pipeline import dist_stages  # noqa: E402
from data_pipeline.__main__ import main as pipeline  # noqa: E402
from data_pipeline.find_duplicates import shingle_hashes  # noqa: E402
from data_pipeline.files import atomic_write  # noqa: E402

CLEANUP = ["--lang", "en", "--min-tokens", "20"]


def stage_args(stage: str, argv: list[str]) -> argparse.Namespace:
    from data_pipeline.__main__ import load_stage

    parser = argparse.ArgumentParser()
    load_stage(stage).add_parser(parser.add_subparsers(dest="stage"))
    return parser.parse_args([stage, *argv])


def run_mp(corpus: str, work: str, workers: int) -> dict:
    w = ["--workers", str(workers)]
    times = {}
    t0 = time.perf_counter()
    assert pipeline(["cleanup", corpus, "--output", f"{work}/clean.jsonl", *CLEANUP, *w]) == 0
    times["cleanup"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    assert pipeline(["find-duplicates", corpus, "--output", f"{work}/pairs.jsonl", *w]) == 0
    assert pipeline(["group-duplicates", f"{work}/pairs.jsonl", "--output", f"{work}/groups.jsonl"]) == 0
    times["dedup"] = time.perf_counter() - t0
    # the pool's workers are this process's children (at 1 worker the stage runs in this process)
    who = resource.RUSAGE_CHILDREN if workers > 1 else resource.RUSAGE_SELF
    return {"seconds": times, "peak_rss_mb": resource.getrusage(who).ru_maxrss / 1024}


def run_tasks(corpus: str, work: str, workers: int, executor: str) -> dict:
    args = argparse.Namespace(workdir=work, executor=executor, tasks=None, workers=workers, force=False,
                              shard_size="1M", ray_address=None, slurm_partition=None, slurm_time="1:00:00")
    times, peaks = {}, {}
    t0 = time.perf_counter()
    peaks.update(dist_stages.run_stage("cleanup", stage_args("cleanup", [corpus, "--output", f"{work}/clean.jsonl",
                                                                         *CLEANUP]), args))
    times["cleanup"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    peaks.update(dist_stages.run_stage("find-duplicates", stage_args("find-duplicates", [
        corpus, "--output", f"{work}/pairs.jsonl"]), args))
    dist_stages.run_stage("group-duplicates", stage_args("group-duplicates", [
        f"{work}/pairs.jsonl", "--output", f"{work}/groups.jsonl"]), args)
    times["dedup"] = time.perf_counter() - t0
    return {"seconds": times, "peak_rss_mb": max(peaks.values()) / 1024, "peak_rss_mb_by_job": {
        k: round(v / 1024) for k, v in peaks.items()}}


def run_ray_data(corpus: str, workers: int) -> dict:
    """cleanup's per-document work as a Ray Data map over the lines (kept count only)."""
    import ray

    from data_pipeline import cleanup

    def clean_batch(batch: dict) -> dict:
        cleanup._init_worker(None)
        lines = [(i, t.encode()) for i, t in enumerate(batch["text"])]
        kept = [r for r in cleanup._process_batch((lines, "en", 20, False)) if r[1] == "keep"]
        return {"kept": [len(kept)]}

    t0 = time.perf_counter()
    ds = ray.data.read_text(corpus).map_batches(clean_batch, batch_size=256, concurrency=workers)
    kept = sum(r["kept"] for r in ds.iter_rows())
    return {"seconds": {"cleanup": time.perf_counter() - t0}, "kept": kept}


def pairs_of(path: str) -> list[tuple[int, int]]:
    with open(path) as f:
        return [(p["a"]["line"] - 1, p["b"]["line"] - 1) for p in map(json.loads, f)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sources", type=int, default=1500, help="original documents (bench/dedup.py's corpus)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()

    texts, _ = build_corpus(args.sources, 0.4, args.seed)
    truth = components(len(texts), exact_pairs([shingle_hashes(t) for t in texts], 0.7))
    results = {"machine": f"{os.cpu_count()} CPU cores", "docs": len(texts), "runs": {}}
    root = tempfile.mkdtemp()
    try:
        corpus = os.path.join(root, "corpus.jsonl")
        with open(corpus, "w") as f:
            for i, t in enumerate(texts):
                f.write(json.dumps({"text": t, "url": f"doc{i}"}) + "\n")
        results["corpus_mb"] = round(os.path.getsize(corpus) / 2**20, 1)
        import ray

        ray.init(num_cpus=2, include_dashboard=False)
        reference = None
        for workers in (1, 2):
            for path in ("mp", "local", "ray", "ray-data"):
                work = os.path.join(root, f"{path}{workers}")
                os.makedirs(work)
                if path == "mp":
                    r = run_mp(corpus, work, workers)
                elif path == "ray-data":
                    r = run_ray_data(corpus, workers)
                else:
                    r = run_tasks(corpus, work, workers, path)
                for stage, s in r["seconds"].items():
                    r.setdefault("docs_per_s_per_worker", {})[stage] = round(len(texts) / s / workers, 1)
                r["seconds"] = {k: round(v, 2) for k, v in r["seconds"].items()}
                if path != "ray-data":
                    pairs = pairs_of(f"{work}/pairs.jsonl")
                    reference = reference or pairs
                    r["pairs_equal_single_process"] = pairs == reference
                    r["dedup_f1"] = round(score(components(len(texts), pairs), truth)["f1"], 4)
                results["runs"][f"{path}, {workers} worker{'s' if workers > 1 else ''}"] = r
                print(f"{path} x{workers}: {json.dumps(r)}", file=sys.stderr)
        ray.shutdown()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(f"\n{results['docs']} docs, {results['corpus_mb']} MB, {results['machine']}\n")
    print("| path | cleanup docs/s/worker | dedup docs/s/worker | peak RSS per task MB | pairs = 1-process | F1 |")
    print("|---|---|---|---|---|---|")
    for name, r in results["runs"].items():
        d = r["docs_per_s_per_worker"]
        print(f"| {name} | {d['cleanup']} | {d.get('dedup', '-')} | {r.get('peak_rss_mb', 0):.0f} "
              f"| {r.get('pairs_equal_single_process', '-')} | {r.get('dedup_f1', '-')} |")
    if args.json:
        with atomic_write(args.json) as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
