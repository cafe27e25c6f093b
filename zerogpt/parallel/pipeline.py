"""Pipeline parallelism: a model_zoo GPT or Llama-family model split into contiguous stages, run by torch's 1F1B
schedule around a ZeRO engine.

`split_stage` cuts the model from outside (its family's module names, families.py): stage r of P keeps blocks
[r*L/P, (r+1)*L/P) in a ModuleDict keyed by layer index (parameter names stay those of the whole model, which
checkpoints and HF export are keyed by), the embeddings on the first stage and the final norm + lm_head on the
last. A tied head (GPT's; a Llama with tie_word_embeddings) becomes on the last stage its own Parameter with the
embedding's values; after every backward the two gradients are summed over a two-rank "tied" group, so both
copies take the same update and stay equal. An untied head is the last stage's own. `Pipeline` runs one optimizer
step's micro-batches (GRADIENT_ACCUMULATION of them) through `torch.distributed.pipelining.Schedule1F1B` (fewer
than P: `ScheduleGPipe`, the order 1F1B would take) inside the engine's `scheduled_backward`, which reduces each
chunk once after the last micro-batch; `engine.step()` follows as at P=1. The Trainer takes it as its schedule
(`Trainer(engine, pipeline=...)`). ZeRO-3 is refused by ParallelDims.check_zero_stage.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from zerogpt.parallel.families import HEAD, family_of
from zerogpt.parallel.mesh import ParallelDims


def stage_layers(n_layer: int, stage: int, stages: int) -> range:
    """The block indices stage `stage` of `stages` holds (contiguous, equal counts)."""
    per = n_layer // stages
    return range(stage * per, (stage + 1) * per)


def split_stage(model: nn.Module, stage: int, stages: int) -> nn.Module:
    """Keep, in place, the modules of pipeline stage `stage` of `stages` of a model_zoo GPT or Llama-family
    model; return it.

    stages == 1 leaves the model untouched. Build the whole model with the same seed on every rank first (or
    on meta): the stages then start from the values one process would have, and a tied head from the
    embedding's.
    """
    if stages == 1:
        return model
    family = family_of(model)
    ParallelDims(pp=stages).check_config(model.config)
    layers = model.get_submodule(family.layers)
    _replace(model, family.layers, nn.ModuleDict({str(i): layers[i]
                                                  for i in stage_layers(len(layers), stage, stages)}))
    if stage == stages - 1:
        if family.tied(model.config):  # untie: its own Parameter, kept equal to the embedding by summing the grads
            embedding = model.get_submodule(family.embedding)
            model.lm_head.weight = nn.Parameter(embedding.weight.detach().clone())
    else:
        _replace(model, family.final_norm, None)
        model.lm_head = None
    if stage > 0:
        for path in family.first_stage:
            _replace(model, path, None)
    return model


def _replace(model: nn.Module, path: str, module: nn.Module | None) -> None:
    """Set submodule `path` to `module`; None deletes it (the model's forward skips what a stage lacks)."""
    parent, _, name = path.rpartition(".")
    owner = model.get_submodule(parent)
    if module is None:
        delattr(owner, name)
    else:
        setattr(owner, name, module)


def tied_copies(model: nn.Module, stage: int, stages: int) -> dict[str, str]:
    """alias -> canonical: the last stage's own copy of a tied head (ParallelModel.tied_copies); {} otherwise."""
    family = family_of(model)
    if stages > 1 and stage == stages - 1 and family.tied(model.config):
        return {HEAD: family.embedding_weight}
    return {}


def tied_group(mesh: Any) -> dist.ProcessGroup | None:
    """The two-rank group of the first and last stage at this rank's (dp, tp) coordinate (None off them).

    Every rank creates every such group, in the same order (torch's new_group is collective).
    """
    ranks = mesh.mesh  # (pp, dp, tp) global ranks
    mine = None
    for d in range(ranks.size(1)):
        for t in range(ranks.size(2)):
            pair = [int(ranks[0, d, t]), int(ranks[-1, d, t])]
            group = dist.new_group(pair)
            if dist.get_rank() in pair:
                mine = group
    return mine


class Pipeline:
    """One stage's 1F1B schedule around its engine (built from the ParallelModel): `train_step` and `eval_loss`;
    the Trainer drives it.

    Every rank of a pipeline reads the same batches (the data loader is per data-parallel rank); the first
    stage feeds the inputs, the last computes `criterion(logits, labels)`.
    """

    def __init__(self, engine: Any, criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None):
        mesh = engine.ctx.mesh
        if mesh is None:
            raise ValueError("Pipeline needs the engine's context on a (pp, dp, tp) mesh: "
                             "initialize(..., ctx=ctx.with_mesh(dims.build_mesh(device_type)))")
        pp = mesh["pp"]
        self.engine, self.criterion = engine, criterion or engine.criterion
        if self.criterion is None:
            raise ValueError("Pipeline needs a criterion(logits, labels): pass one or initialize(criterion=...)")
        self.stage, self.stages, self.group = pp.get_local_rank(), pp.size(), pp.get_group()
        self.is_first, self.is_last = self.stage == 0, self.stage == self.stages - 1
        self.device = engine.ctx.device
        family = family_of(engine.module)
        tied = family.tied(engine.module.config)  # an untied head needs no group: nothing to keep equal
        self.tied_group = tied_group(mesh) if tied else None
        params = dict(engine.module.named_parameters())
        ends = tied and (self.is_first or self.is_last)
        self.tied_param = params.get(family.embedding_weight if self.is_first else HEAD) if ends else None
        self._micro_losses: list[torch.Tensor] = []
        stage = PipelineStage(engine.module, self.stage, self.stages, self.device, group=self.group)
        # torch's 1F1B refuses fewer micro-batches than stages; with M < P, 1F1B's warm-up (Megatron's:
        # min(P - 1 - r, M) forwards) runs every forward before any backward anyway, which is GPipe's order.
        schedule = Schedule1F1B if engine.gradient_accumulation >= self.stages else ScheduleGPipe
        # The engine scales the loss (1/accumulation, fp16's scale) so gradients mean what they mean at P=1.
        self.schedule = schedule(stage, engine.gradient_accumulation, loss_fn=self._train_loss, scale_grads=False)
        self._eval_schedule: ScheduleGPipe | None = None  # one micro-batch per call, built at the first eval

    def _train_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = self.criterion(logits, labels)
        self._micro_losses.append(loss.detach())
        return self.engine.scale_loss(loss)

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Forward and backward of one optimizer step's (inputs, labels) micro-batches; gradients reduced.

        Returns the mean loss over the micro-batches on the last stage, zero elsewhere (a device tensor:
        no host sync). Call `engine.step()` next.
        """
        if len(micro_batches) != self.engine.gradient_accumulation:
            raise ValueError(f"a pipeline step takes GRADIENT_ACCUMULATION={self.engine.gradient_accumulation} "
                             f"micro-batches (the schedule's n_microbatches), got {len(micro_batches)}")
        inputs = torch.cat([x for x, _ in micro_batches])  # the schedule splits it back into the micro-batches
        labels = torch.cat([y for _, y in micro_batches])
        self._micro_losses = []
        with self.engine.scheduled_backward(before_reduce=self._sum_tied_grads), self.engine.loss_context():
            self._feed(self.schedule.step, inputs, labels, return_outputs=False)
        # The schedule's first step also calls the loss once on its shape-inference pass: keep the real ones.
        return self._mean(self._micro_losses[-len(micro_batches):])

    def _sum_tied_grads(self) -> None:
        """The embedding's gradient (first stage) and the tied head's (last stage) summed: the tied weight's whole
        gradient."""
        if self.tied_param is not None:
            dist.all_reduce(self.engine.local_grad(self.tied_param), group=self.tied_group)

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Forward only through the stages: `criterion` of one batch on the last stage, zero elsewhere."""
        if self._eval_schedule is None:
            stage = PipelineStage(self.engine.module, self.stage, self.stages, self.device, group=self.group)
            self._eval_schedule = ScheduleGPipe(stage, 1, loss_fn=self.criterion, scale_grads=False)
            # (a second stage object: the training one inferred its buffers for the training micro-batch)
        losses: list[torch.Tensor] = []
        with self.engine.loss_context():
            self._feed(self._eval_schedule.eval, inputs, labels, losses=losses)
        return self._mean(losses)

    def _feed(self, run: Callable[..., Any], inputs: torch.Tensor, labels: torch.Tensor, **last: Any) -> None:
        """Call a schedule's `run` as this stage takes it: the inputs on the first stage, the labels (and
        `last`) on the last, nothing in between (the activations come from the neighbours)."""
        if self.is_first:
            run(inputs)
        elif self.is_last:
            run(target=labels, **last)
        else:
            run()

    def _mean(self, losses: list[torch.Tensor]) -> torch.Tensor:
        if not self.is_last:
            return torch.zeros((), dtype=torch.float32, device=self.device)
        return torch.stack(losses).float().mean()

    def from_last_stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """In place: the last stage's value on every stage (a loss is computed there only)."""
        dist.broadcast(tensor, group=self.group, group_src=self.stages - 1)
        return tensor
