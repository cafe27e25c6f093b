"""Run the pipeline's stages as sharded tasks on datatrove's executors (local, Ray, Slurm).

A stage is a list of `Job`s: a function `fn(rank, world, **kwargs)` run as `tasks` datatrove
tasks. Each job has its own logging folder under WORKDIR/.tasks/, where datatrove writes a
completion marker per finished task: a killed run that is re-run skips finished tasks, and
`--force` deletes the folder. Jobs run in order; each waits for all the tasks of the one before
(on Slurm, as a job array with an `afterok` dependency; a re-run while a stage's jobs are still
queued is refused rather than submitting them twice). bench/README.md says why datatrove.

    python -m data_pipeline all --urls urls.txt --workdir data/webtext                   # local
    python -m data_pipeline all --urls urls.txt --workdir data/webtext --executor ray    # local Ray
    python -m data_pipeline all ... --executor ray --ray-address ray://head:10001        # a cluster
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from datatrove.pipeline.base import PipelineStep

from data_pipeline.files import abspath, remove_tree

EXECUTORS = ("local", "ray", "slurm")


@dataclass
class Job:
    """`tasks` runs of `fn(rank, tasks, **kwargs)`; `name` is its folder under the stage's task dir."""
    name: str
    fn: Callable[..., Any]
    tasks: int
    kwargs: dict = field(default_factory=dict)
    rss_dir: str | None = None  # where each task records its peak RSS (bench, memory test)


class TaskStep(PipelineStep):
    """A datatrove pipeline step that runs one zerogpt task function for its rank.

    The stages read and write their own files (JSONL, sorted signature files), so the step
    neither takes nor yields datatrove Documents.
    """
    name = "zerogpt task"
    type = "zerogpt"

    def __init__(self, job: Job) -> None:
        super().__init__()
        self.job = job
        self.name = job.name

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        with self.track_time():
            self.job.fn(rank, world_size, **self.job.kwargs)
        if self.job.rss_dir:
            import resource

            from data_pipeline.shards import write_json

            kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            write_json(os.path.join(self.job.rss_dir, self.job.name, f"{rank:05d}.json"), {"kb": kb})
        return iter(())


def add_executor_args(p: argparse.ArgumentParser, single_stage: bool = False) -> None:
    """The executor flags of `all` and, with `single_stage`, of each CPU stage's own command.

    A single stage runs in this process (its --workers processes) unless --executor is given: that
    path needs no task folder and is the reference the task path is tested against.
    """
    p.add_argument("--executor", choices=EXECUTORS, default=None if single_stage else "local",
                   help="where the CPU stages' tasks run: local processes, Ray, or Slurm job arrays" +
                        (" (default: none, the stage runs in this process)" if single_stage else ""))
    p.add_argument("--ray-address", help="Ray cluster to join (e.g. ray://head:10001 or auto); "
                                         "without it --executor ray starts a local Ray")
    p.add_argument("--tasks", type=int, help="shards per stage (default: input size / --shard-size, "
                                             "at least --workers)")
    p.add_argument("--shard-size", default="256M", help="target input bytes per task; bounds a task's memory")
    p.add_argument("--slurm-partition", help="--executor slurm: partition for the job arrays")
    p.add_argument("--slurm-time", default="4:00:00", help="--executor slurm: time limit per task")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="show the tasks' own output (datatrove's logs, each task's counts) on the console; by "
                        "default it goes to WORKDIR/logs/STAGE.log and a stage shows one progress line and a summary")
    if not single_stage:
        return
    p.add_argument("--workdir", help="with --executor: task files go to WORKDIR/.tasks/STAGE "
                                     "(default: the output's folder)")
    # stages that have their own --workers / --force keep them
    with contextlib.suppress(argparse.ArgumentError):
        p.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                       help="with --executor: tasks run at once (local and Ray)")
    with contextlib.suppress(argparse.ArgumentError):
        p.add_argument("--force", action="store_true", help="with --executor: redo finished tasks too")


def num_tasks(args: argparse.Namespace, input_size: int) -> int:
    """--tasks, or enough shards of --shard-size for the input, and at least --workers."""
    from data_pipeline.cli_args import parse_size

    if args.tasks is not None:
        if args.tasks < 1:
            raise ValueError(f"--tasks must be >= 1, got {args.tasks}")
        return args.tasks
    return max(args.workers, -(-input_size // parse_size(args.shard_size)), 1)


@contextlib.contextmanager
def executor_session(args: argparse.Namespace) -> Iterator[None]:
    """For --executor ray: join --ray-address, or start a local Ray for the block and stop it after."""
    if args.executor != "ray":
        yield
        return
    import ray

    from data_pipeline.console import ray_init_kwargs

    started = not ray.is_initialized()
    quiet = ray_init_kwargs(getattr(args, "verbose", False))
    if started and args.ray_address:
        ray.init(address=args.ray_address, **quiet)
    elif started:
        ray.init(num_cpus=args.workers, include_dashboard=False, **quiet)
    try:
        yield
    finally:
        if started:
            ray.shutdown()


def slurm_job_name(stage_dir: str, job: Job) -> str:
    """zerogpt-STAGE-JOB-TAG, TAG from the stage's folder: a re-run finds its own queued jobs by name."""
    tag = hashlib.sha1(abspath(stage_dir).encode()).hexdigest()[:8]
    return f"zerogpt-{os.path.basename(stage_dir.rstrip('/'))}-{job.name}-{tag}"


def check_not_queued(args: argparse.Namespace, stage_dir: str, jobs: list[Job]) -> None:
    """ValueError when Slurm jobs of this stage are still queued or running: datatrove's completion
    markers only know finished tasks, so submitting again would run the pending ones twice."""
    from datatrove.utils.jobs import get_running_slurm_jobs

    if not args.slurm_partition:
        raise ValueError("--executor slurm needs --slurm-partition")
    queued = set(get_running_slurm_jobs(args.slurm_partition)) & {slurm_job_name(stage_dir, j) for j in jobs}
    if queued:
        raise ValueError(f"Slurm jobs {sorted(queued)} of {stage_dir} are still queued or running (squeue --me); "
                         f"re-run when they are done (finished tasks are skipped), or scancel them first")


def _executor(args: argparse.Namespace, job: Job, stage_dir: str, depends=None):
    logging_dir = os.path.join(stage_dir, "logs", job.name)
    pipeline = [TaskStep(job)]
    if args.executor == "local":
        from datatrove.executor import LocalPipelineExecutor

        # fork: tasks inherit the loaded modules; datatrove's default forkserver re-imports them per task
        return LocalPipelineExecutor(pipeline, tasks=job.tasks, workers=min(args.workers, job.tasks),
                                     logging_dir=logging_dir, start_method="fork")
    if args.executor == "ray":
        from datatrove.executor import RayPipelineExecutor

        return RayPipelineExecutor(pipeline, tasks=job.tasks, workers=min(args.workers, job.tasks),
                                   logging_dir=logging_dir, cpus_per_task=1, mem_per_cpu_gb=1)
    from datatrove.executor import SlurmPipelineExecutor

    return SlurmPipelineExecutor(pipeline, tasks=job.tasks, time=args.slurm_time, partition=args.slurm_partition,
                                 logging_dir=logging_dir, depends=depends, job_name=slurm_job_name(stage_dir, job),
                                 venv_path=os.environ.get("VIRTUAL_ENV"))


def run_jobs(args: argparse.Namespace, stage_dir: str, jobs: list[Job]) -> None:
    """Run `jobs` in order under `stage_dir`; finished tasks of an earlier run are skipped.

    Local and Ray wait for each job and raise if a task failed (datatrove's own `depends` would
    wait forever on a failed task); Slurm submits the chain as dependent arrays and returns.
    """
    if args.executor == "slurm":
        check_not_queued(args, stage_dir, jobs)
    if getattr(args, "force", False):
        remove_tree(stage_dir)
    from data_pipeline.console import stage_log, stage_output
    from data_pipeline.files import local_path

    stage = os.path.basename(stage_dir.rstrip("/"))
    workdir = local_path(os.path.dirname(os.path.dirname(stage_dir.rstrip("/"))))
    log = stage_log(workdir, stage) if workdir else None   # a remote --workdir: the output stays on the console
    quiet = log is not None and args.executor != "slurm" and not getattr(args, "verbose", False)
    completions = [os.path.join(stage_dir, "logs", job.name, "completions") for job in jobs]
    previous = None
    with stage_output(log, not quiet, sum(job.tasks for job in jobs), completions, f"[{stage}]"):
        for job in jobs:
            job.rss_dir = job.rss_dir or os.path.join(stage_dir, "rss")
            executor = _executor(args, job, stage_dir, depends=previous)
            if args.executor == "slurm":
                previous = executor
                continue
            executor.run()
            failed = executor.get_incomplete_ranks()
            if failed:
                raise RuntimeError(f"{job.name}: tasks {failed[:10]} failed (logs in {stage_dir}/logs/{job.name}/logs"
                                   + (f" and {log}" if quiet else "") + "); re-run to retry them, finished tasks are "
                                   "skipped")
    if previous is not None:
        previous.run()
