"""Tests for the stages as sharded datatrove tasks (dist_stages.py, dist_dedup.py, executor.py, shards.py):
each gives the single-process stage's output, a killed stage resumes without redoing finished
tasks, task memory does not grow with the corpus, and Ray gives the local executor's output."""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
import tracemalloc

import pytest

try:  # the shared corpus helpers (rootdir-relative or package import); the `site` fixture is in conftest.py
    from dedup_docs import edit, real_docs, write_docs
except ImportError:  # pragma: no cover - when tests/data_pipeline becomes a package
    from tests.data_pipeline.dedup_docs import edit, real_docs, write_docs

from data_pipeline import dist_dedup, dist_stages
from data_pipeline.__main__ import load_stage, main
from data_pipeline.shards import count_lines, iter_shard

pytestmark = pytest.mark.timeout(120)


def stage_args(stage: str, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    load_stage(stage).add_parser(parser.add_subparsers(dest="stage"))
    return parser.parse_args([stage, *argv])


def executor_args(workdir, executor="local", tasks=None, workers=2, shard_size="256M",
                  force=False, verbose=False) -> argparse.Namespace:
    return argparse.Namespace(workdir=str(workdir), executor=executor, tasks=tasks, workers=workers, force=force,
                              shard_size=shard_size, ray_address=None, slurm_partition=None, slurm_time="1:00:00",
                              verbose=verbose)


def dup_corpus(path, n: int = 40, seed: int = 0):
    """Originals, near copies, exact copies and hard negatives, shuffled so that a document and its
    copies land in different shards; plus an empty-after-normalisation and a broken line."""
    rng = random.Random(seed)
    docs = real_docs(n)
    texts = list(docs)
    for i in range(0, n, 4):
        texts += [edit(docs[i], 0.02, rng), docs[i + 1], edit(docs[i + 2], 0.25, rng)]
    texts.append(docs[5])
    rng.shuffle(texts)
    texts.insert(len(texts) // 2, "!!! ... ???")
    write_docs(path, texts)
    with open(path, "a") as f:
        f.write("{broken json\n")
    return path


def read_lines(path) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return f.read().splitlines()


def test_the_stage_registry_names_the_stages_that_run_as_tasks():
    """stages.DIST_JOBS (what the CLI and `all` send to an executor) is dist_stages.JOBS's keys."""
    from data_pipeline.stages import DIST_JOBS

    assert set(DIST_JOBS) == set(dist_stages.JOBS)


def test_shards_cover_every_line_once(tmp_path):
    path = tmp_path / "x.jsonl"
    lines = [f"{i}" * (i % 7 + 1) + "\n" for i in range(100)]
    path.write_text("".join(lines) + "no newline at the end")
    for world in (1, 3, 7, 150):
        got = [raw.decode() for rank in range(world) for raw in iter_shard(str(path), rank, world)]
        assert got == lines + ["no newline at the end"], world
    assert sum(count_lines(r, 7, str(path), str(tmp_path)) for r in range(7)) == 101


def test_dedup_tasks_give_the_single_process_pairs_and_groups(tmp_path):
    """The same pairs (in the same order, with the same references and Jaccards), groups and kept
    documents as find/group/remove-duplicates in one process, over 7 shards."""
    docs = str(dup_corpus(tmp_path / "docs.jsonl"))
    one, many = tmp_path / "one", tmp_path / "many"
    assert main(["find-duplicates", docs, "--output", str(one / "pairs.jsonl"), "--workers", "1"]) == 0
    assert main(["group-duplicates", str(one / "pairs.jsonl"), "--output", str(one / "groups.jsonl")]) == 0
    assert main(["remove-duplicates", str(one / "groups.jsonl"), docs, "--output", str(one / "dedup.jsonl")]) == 0
    args = executor_args(many, tasks=7)
    for stage, argv in [("find-duplicates", [docs, "--output", str(many / "pairs.jsonl")]),
                        ("group-duplicates", [str(many / "pairs.jsonl"), "--output", str(many / "groups.jsonl")]),
                        ("remove-duplicates", [str(many / "groups.jsonl"), docs, "--output",
                                               str(many / "dedup.jsonl")])]:
        dist_stages.run_stage(stage, stage_args(stage, argv), args)
    pairs = read_lines(one / "pairs.jsonl")
    assert len(pairs) >= 15 and read_lines(many / "pairs.jsonl") == pairs
    for name in ("groups.jsonl", "dedup.jsonl"):
        assert read_lines(many / name) == read_lines(one / name), name
    counts = [json.loads((d / "pairs.jsonl.stats.json").read_text())["counts"] for d in (one, many)]
    assert counts[1] == counts[0] and counts[0]["exact_duplicates"] > 0 and counts[0]["rejected_candidates"] > 0
    assert not (many / ".tasks").exists() or not os.listdir(many / ".tasks")  # task files are removed


def test_shuffle_tasks_are_the_single_process_shuffle(tmp_path):
    docs = str(dup_corpus(tmp_path / "docs.jsonl"))
    one = tmp_path / "one.jsonl"
    assert main(["shuffle", docs, "--output", str(one), "--seed", "7"]) == 0
    for tasks, limit in [(1, "1G"), (5, "8K"), (3, "20K")]:
        out = tmp_path / f"many{tasks}.jsonl"
        dist_stages.run_stage("shuffle", stage_args("shuffle", [docs, "--output", str(out), "--seed", "7",
                                                                 "--memory-limit", limit]),
                              executor_args(tmp_path / f"w{tasks}", tasks=tasks))
        assert out.read_bytes() == one.read_bytes(), (tasks, limit)
        stats = json.loads((tmp_path / f"many{tasks}.jsonl.stats.json").read_text())
        assert stats["counts"]["malformed"] == 1 and (stats["buckets"] > 1) == (limit != "1G")
    dist_stages.run_stage("shuffle", stage_args("shuffle", [docs, "--output", str(out), "--seed", "8"]),
                          executor_args(tmp_path / "w8", tasks=2))
    assert out.read_bytes() != one.read_bytes() and sorted(read_lines(out)) == sorted(read_lines(one))


def test_blacklist_tasks_give_the_single_process_urls_and_rejects(tmp_path):
    urls = tmp_path / "urls"
    urls.mkdir()
    (urls / "a.txt").write_text("# comment\n" + "".join(f"https://site{i % 7}.org/page/{i % 11}\n" for i in range(60)) +
                                "\nnot a url\nhttps://www.youtube.com/watch?v=1\nftp://x.org/f\n")
    (urls / "b.txt").write_bytes(b"https://site1.org/page/1\nhttps://e.org/paper.pdf\n\xff\xfe\n"
                                 b"https://new.org/a\nhttps://site2.org/page/2")
    one, many = tmp_path / "one", tmp_path / "many"
    assert main(["blacklist", str(urls), "--output", str(one / "urls.txt")]) == 0
    dist_stages.run_stage("blacklist", stage_args("blacklist", [str(urls), "--output", str(many / "urls.txt")]),
                          executor_args(many, tasks=4))
    for name in ("urls.txt", "urls.txt.rejected.jsonl"):
        assert (many / name).read_bytes() == (one / name).read_bytes(), name
    counts = [json.loads((d / "urls.txt.stats.json").read_text())["counts"] for d in (one, many)]
    assert counts[0] == counts[1] and counts[0]["duplicate"] > 0 and counts[0]["malformed"] > 0


def test_cleanup_and_tokenize_tasks_give_the_single_process_outputs(tmp_path):
    from data_pipeline.tokenizer import save_tokenizer_dir
    from data_pipeline.train_tokenizer import train_byte_level_bpe

    docs = str(dup_corpus(tmp_path / "docs.jsonl"))
    save_tokenizer_dir(train_byte_level_bpe(real_docs(20), vocab_size=300), str(tmp_path / "tok"))
    one, many = tmp_path / "one", tmp_path / "many"
    one.mkdir()
    assert main(["cleanup", docs, "--output", str(one / "c.jsonl"), "--min-tokens", "100", "--workers", "1"]) == 0
    assert main(["tokenize", docs, "--tokenizer", str(tmp_path / "tok"), "--output-prefix", str(one / "t"),
                 "--workers", "1"]) == 0
    args = executor_args(many, tasks=4)
    dist_stages.run_stage("cleanup", stage_args("cleanup", [docs, "--output", str(many / "c.jsonl"),
                                                            "--min-tokens", "100"]), args)
    dist_stages.run_stage("tokenize", stage_args("tokenize", [docs, "--tokenizer", str(tmp_path / "tok"),
                                                              "--output-prefix", str(many / "t")]), args)
    for name in ("c.jsonl", "c.jsonl.rejected.jsonl", "t.bin", "t.idx"):
        assert (many / name).read_bytes() == (one / name).read_bytes(), name
    assert read_lines(many / "c.jsonl.rejected.jsonl")  # the corpus has rejects, with their input line
    for name in ("c.jsonl", "t"):
        counts = [json.loads((d / f"{name}.stats.json").read_text())["counts"] for d in (one, many)]
        assert counts[0] == counts[1], name


def test_tokenize_tasks_write_the_single_process_stats(tmp_path):
    """The merge's P.stats.json is the in-process stage's (vocab_size and eod_id included), so a GPTDataset of
    `all`'s output takes its EOD and vocabulary from it as it does from `tokenize`'s."""
    from data_pipeline.dataset import GPTDataset
    from data_pipeline.tokenizer import save_tokenizer_dir
    from data_pipeline.train_tokenizer import train_byte_level_bpe

    docs = str(write_docs(tmp_path / "docs.jsonl", real_docs(12)))
    save_tokenizer_dir(train_byte_level_bpe(real_docs(20), vocab_size=300), str(tmp_path / "tok"))
    assert main(["tokenize", docs, "--tokenizer", str(tmp_path / "tok"), "--output-prefix", str(tmp_path / "one"),
                 "--workers", "1"]) == 0
    dist_stages.run_stage("tokenize", stage_args("tokenize", [docs, "--tokenizer", str(tmp_path / "tok"),
                                                              "--output-prefix", str(tmp_path / "many")]),
                          executor_args(tmp_path / "w", tasks=3))
    where = {"output", "output_signatures", "seconds", "tokens_per_s", "workers", "shards"}  # paths, timing
    one, many = (json.loads((tmp_path / f"{name}.stats.json").read_text()) for name in ("one", "many"))
    assert {k: v for k, v in many.items() if k not in where} == {k: v for k, v in one.items() if k not in where}
    assert many["shards"] == 3 and many["vocab_size"] == 300
    ds = GPTDataset(str(tmp_path / "many"), seq_len=16, splits="1,0,0", loss_mask=True, vocab_size=300)
    assert ds.eod_id == one["eod_id"] and ds[0]["loss_mask"].shape == (16,)


def test_single_stage_commands_on_the_local_executor_give_todays_output(tmp_path):
    """`python -m data_pipeline STAGE ... --executor local` runs the stage as tasks (one shared flag
    set and dispatch) and writes what the stage's default in-process run writes."""
    docs = str(dup_corpus(tmp_path / "docs.jsonl"))
    one, many = tmp_path / "one", tmp_path / "many"
    (tmp_path / "groups.jsonl").write_text(json.dumps({"remove": [{"source": "docs.jsonl", "line": 7}]}) + "\n")
    for d, extra in ((one, ["--workers", "1"]), (many, ["--executor", "local", "--tasks", "3", "--workers", "2"])):
        assert main(["cleanup", docs, "--output", str(d / "c.jsonl"), "--min-tokens", "100", *extra]) == 0
        assert main(["shuffle", docs, "--output", str(d / "s.jsonl"), "--seed", "5", *extra]) == 0
        assert main(["remove-duplicates", str(tmp_path / "groups.jsonl"), docs, "--output", str(d / "r.jsonl"),
                     *extra]) == 0
    for name in ("c.jsonl", "c.jsonl.rejected.jsonl", "s.jsonl", "r.jsonl"):
        assert (many / name).read_bytes() == (one / name).read_bytes(), name
    assert len(read_lines(many / "r.jsonl")) == len(read_lines(docs)) - 2  # the removed line and the broken one
    stats = json.loads((many / "c.jsonl.stats.json").read_text())
    assert stats["shards"] == 3 and "executor" not in stats["params"]  # where it ran is not a parameter
    assert not os.listdir(many / ".tasks")  # task files (in the output's folder) are removed


def test_stage_outputs_and_workdir_may_be_fsspec_urls(tmp_path, capsys):
    """With --executor, inputs, outputs and task files may be fsspec URLs (memory:// here: one
    worker, so the tasks share this process's memory filesystem; file:// with two processes), and
    give the local files' bytes; paths that must be local are refused naming their flag."""
    import fsspec

    docs = str(dup_corpus(tmp_path / "docs.jsonl"))
    (tmp_path / "groups.jsonl").write_text(json.dumps({"remove": [{"source": "docs.jsonl", "line": 4}]}) + "\n")
    fs = fsspec.filesystem("memory")
    fs.pipe("/in/docs.jsonl", open(docs, "rb").read())
    remote = {"memory": ("memory://in/docs.jsonl", "memory://out", ["--workers", "1", "--workdir", "memory://work"]),
              "file": ("file://" + docs, "file://" + str(tmp_path / "url"),
                       ["--workers", "2", "--workdir", "file://" + str(tmp_path / "w")])}
    for kind, (src, out, extra) in remote.items():
        for d, inp, more in ((str(tmp_path / "one"), docs, []), (out, src, ["--executor", "local", "--tasks", "3",
                                                                             *extra])):
            assert main(["cleanup", inp, "--output", f"{d}/c.jsonl", "--min-tokens", "100", "--workers", "1",
                         *more]) == 0
            assert main(["shuffle", inp, "--output", f"{d}/s.jsonl", "--seed", "2", *more]) == 0
            assert main(["remove-duplicates", str(tmp_path / "groups.jsonl"), inp, "--output", f"{d}/r.jsonl",
                         *more]) == 0
        for name in ("c.jsonl", "c.jsonl.rejected.jsonl", "s.jsonl", "r.jsonl"):
            with fsspec.open(f"{out}/{name}", "rb") as f:
                assert f.read() == (tmp_path / "one" / name).read_bytes(), (kind, name)
        with fsspec.open(f"{out}/c.jsonl.stats.json") as f:
            stats = json.load(f)
        assert stats["complete"] and stats["inputs"][0]["size"] == os.path.getsize(docs)
    assert not [p for p in fs.find("/") if p.endswith(".tmp")]  # atomic writes left no temporary file
    capsys.readouterr()
    for argv, flag in [(["tokenize", docs, "--tokenizer", "t", "--output-prefix", "memory://out/t"], "--output-prefix"),
                       (["find-duplicates", docs, "--output", "memory://out/p.jsonl"], "--workdir"),
                       (["all", "--urls", docs, "--workdir", "memory://w"], "--workdir")]:
        assert main([*argv, "--executor", "local"]) == 2
        assert f"{flag} 'memory://" in capsys.readouterr().err, argv


def _peak_bytes(fn, *args, **kwargs) -> int:
    tracemalloc.start()
    try:
        fn(*args, **kwargs)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _dedup_task_peaks(tmp_path, copies: int, shard_docs: int = 60) -> tuple[dict[str, int], int]:
    """Peak traced memory of each dedup task kind on a corpus `copies` times the base size (other
    documents, the same kinds of duplicates), with a shard per `shard_docs` documents."""
    path = dup_corpus(tmp_path / f"c{copies}.jsonl", n=100 * copies)
    rows = read_lines(path)
    work, shards = str(tmp_path / f"w{copies}"), -(-len(rows) // shard_docs)
    bands, _ = dist_dedup.bands_rows(0.7, 128)
    for r in range(shards):
        count_lines(r, shards, str(path), work)
    peaks = {"signatures": max(_peak_bytes(dist_dedup.signatures_task, r, shards, input=str(path), work=work,
                                           text_key="text", ngram=5, unit="char", num_perm=128, seed=1,
                                           threshold=0.7, strict=False) for r in range(shards))}
    peaks["buckets"] = max(_peak_bytes(dist_dedup.band_pairs, b, work=work, shards=shards, partitions=shards)
                           for b in range(bands))
    peaks["verify"] = max(_peak_bytes(dist_dedup.verify_task, p, shards, work=work, shards=shards, bands=bands,
                                      threshold=0.7, source="c.jsonl") for p in range(shards))
    return peaks, shards


@pytest.mark.timeout(300)
def test_dedup_task_memory_does_not_grow_with_the_corpus(tmp_path, monkeypatch):
    """4x the corpus in 4x the shards: no task's peak memory grows with the documents (one that held
    a band, all pairs or every shard's index would grow 4x). A k-way merge keeps a small buffer per
    shard file; that is allowed for (PER_FILE bytes per extra shard)."""
    monkeypatch.setattr(dist_dedup, "MERGE_RECORDS", 64)  # what a merge buffers, over all its files
    (small, n_small), (large, n_large) = _dedup_task_peaks(tmp_path, 1), _dedup_task_peaks(tmp_path, 4)
    per_file = 8 << 10
    for kind in small:
        assert large[kind] < 1.3 * small[kind] + per_file * (n_large - n_small), (kind, small, large)


def _run_cleanup_in_subprocess(workdir, docs, tasks, force=False, **popen):
    code = ("import sys; from data_pipeline import dist_stages as d; from tests.data_pipeline.test_dist_stages "
            "import stage_args, executor_args; "
            f"d.run_stage('cleanup', stage_args('cleanup', [{docs!r}, '--output', {str(workdir / 'c.jsonl')!r}, "
            f"'--min-tokens', '100']), executor_args({str(workdir)!r}, tasks={tasks}, workers=1, force={force}, "
            f"verbose=True))")  # -v: datatrove's lines on stderr, where this counts the tasks that ran
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-c", code], cwd=root, env=env, start_new_session=True,
                            stderr=subprocess.PIPE, text=True, **popen)


@pytest.mark.timeout(240)
def test_killed_stage_resumes_without_redoing_finished_tasks(tmp_path):
    docs = str(dup_corpus(tmp_path / "docs.jsonl", n=80))
    work = tmp_path / "w"
    done = work / ".tasks" / "cleanup" / "logs" / "clean" / "completions"
    proc = _run_cleanup_in_subprocess(work, docs, tasks=8)
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None and len(os.listdir(done) if done.exists() else []) < 2:
        time.sleep(0.05)
    assert proc.poll() is None, f"finished before it could be killed: {proc.stderr.read()[-2000:]}"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    finished = sorted(os.listdir(done))
    assert 2 <= len(finished) < 8 and not (work / "c.jsonl").exists()

    proc = _run_cleanup_in_subprocess(work, docs, tasks=8)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:]
    assert f"Skipping {len(finished)} already completed tasks" in err  # datatrove's completion markers
    # only the unfinished clean tasks and the merge ran: no line-count task, no finished task again
    assert err.count("Launching pipeline for rank=") == 8 - len(finished) + 1, err[-3000:]
    one = tmp_path / "one.jsonl"
    assert main(["cleanup", docs, "--output", str(one), "--min-tokens", "100", "--workers", "1"]) == 0
    assert (work / "c.jsonl").read_bytes() == one.read_bytes()

    proc = _run_cleanup_in_subprocess(work, docs, tasks=8, force=True)  # --force: every task again
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 0 and err.count("Launching pipeline for rank=") == 8 + 8 + 1, err[-3000:]


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False)
    yield ray
    ray.shutdown()


@pytest.mark.timeout(400)
def test_all_on_ray_gives_the_local_executors_documents(tmp_path, site, ray_cluster):
    """The whole chain on a local Ray cluster (num_cpus=2) writes what the local executor writes."""
    base, _ = site
    (tmp_path / "urls.txt").write_text("".join(f"{base}/article/{i}\n" for i in range(6)) +
                                       f"{base}/dup/0\n{base}/article/1?copy=1\n{base}/german\n")
    outputs = {}
    for executor in ("local", "ray"):
        work = tmp_path / executor
        assert main(["all", "--urls", str(tmp_path / "urls.txt"), "--workdir", str(work), "--allow-private",
                     "--min-tokens", "50", "--timeout", "5", "--extract-workers", "1", "--workers", "2",
                     "--tasks", "2", "--executor", executor, "--seed", "3"]) == 0
        outputs[executor] = {name: (work / name).read_bytes() for name in
                             ("clean.jsonl", "pairs.jsonl", "groups.jsonl", "dedup.jsonl", "webtext.jsonl")}
    assert outputs["ray"] == outputs["local"]
    assert len(outputs["ray"]["webtext.jsonl"].splitlines()) == 6


def test_single_stage_on_ray_gives_the_in_process_output(tmp_path, ray_cluster):
    docs = str(dup_corpus(tmp_path / "docs.jsonl"))
    assert main(["shuffle", docs, "--output", str(tmp_path / "one.jsonl"), "--seed", "9"]) == 0
    assert main(["shuffle", docs, "--output", str(tmp_path / "ray.jsonl"), "--seed", "9", "--executor", "ray",
                 "--tasks", "2", "--workers", "2", "--workdir", str(tmp_path / "w")]) == 0
    assert (tmp_path / "ray.jsonl").read_bytes() == (tmp_path / "one.jsonl").read_bytes()
    assert ray_cluster.is_initialized()  # a Ray the command did not start is left running


def test_slurm_stage_is_a_datatrove_job_array_chain(tmp_path, monkeypatch):
    """--executor slurm submits a stage's jobs as sbatch arrays, each after the one before (sbatch
    is faked: no Slurm here)."""
    from datatrove.executor import slurm

    arrays = []  # (job name, --array, --dependency) of each job array submitted

    def fake_sbatch(contents, job_id_retriever, *args):
        if "launch_pickled_pipeline" in contents:  # not datatrove's stats-merging job
            field = {k: v for k, _, v in (line.removeprefix("#SBATCH --").partition("=") for line in
                                         contents.splitlines() if line.startswith("#SBATCH --"))}
            dep = next((a.removeprefix("--dependency=") for a in args if a.startswith("--dependency=")), None)
            arrays.append((field["job-name"], field["array"], field["partition"], dep))
        return str(100 + len(arrays))

    from datatrove.utils import jobs

    queue = []  # job names squeue lists as pending or running
    monkeypatch.setattr(slurm, "launch_slurm_job", fake_sbatch)
    monkeypatch.setattr(jobs, "get_running_slurm_jobs", lambda partition=None: list(queue))
    docs = str(dup_corpus(tmp_path / "docs.jsonl"))
    args = executor_args(tmp_path / "w", executor="slurm", tasks=3)
    with pytest.raises(ValueError, match="--slurm-partition"):
        dist_stages.run_stage("find-duplicates", stage_args("find-duplicates", [docs, "--output", "p"]), args)
    args.slurm_partition = "cpu"
    dist_stages.run_stage("find-duplicates", stage_args("find-duplicates", [docs, "--output", "p"]), args)
    names = [a[0] for a in arrays]
    assert [a[1:3] for a in arrays] == [(f"0-{n - 1}", "cpu") for n in (3, 3, 3, 3, 1)]
    assert [n.rsplit("-", 1)[0] for n in names] == [f"zerogpt-find-duplicates-{job}" for job in
                                                    ("lines", "signatures", "buckets", "verify", "merge")]
    # each array waits for the one before it
    assert arrays[0][3] is None and [a[3] for a in arrays[1:]] == [f"afterok:{101 + i}" for i in range(4)]
    queue += names[2:] + ["zerogpt-find-duplicates-lines-0000beef"]  # another folder's job: not ours
    with pytest.raises(ValueError, match="still queued or running"):  # a re-run now would submit them twice
        dist_stages.run_stage("find-duplicates", stage_args("find-duplicates", [docs, "--output", "p"]), args)
    assert len(arrays) == 5


def test_a_tokenizer_retrained_at_the_same_path_makes_finished_tasks_stale(tmp_path):
    """A killed sharded tokenize, re-run after its tokenizer was retrained in place, must not keep the shards the old
    tokenizer made: the tokenizer's files are part of the tasks' identity."""
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": {"a": 0}}}')
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "a"}\n')
    sargs = argparse.Namespace(input=str(corpus), tokenizer=str(tok), output_prefix=str(tmp_path / "out"),
                               json_key="text")
    before = dist_stages.task_identity(sargs)
    (tok / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": {"b": 0}}}')  # same size, new tokens
    os.utime(tok, ns=(os.stat(tok).st_atime_ns, os.stat(tok).st_mtime_ns))
    os.utime(tok / "tokenizer.json", ns=(1, 10**18))
    assert dist_stages.task_identity(sargs) != before
