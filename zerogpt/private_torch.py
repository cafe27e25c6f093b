"""The private torch APIs zerogpt uses, in one list: where each is used and why no public API does the job.

tests/test_private_torch.py checks that every entry exists in the installed torch (a torch upgrade that removes
one fails there, by name, instead of inside a model's initialisation or a step), and that no zerogpt module
imports or names a private torch attribute (`torch._x`, `from torch.a._b import c`) missing from this list.
Attributes read on objects (`tensor._version`) cannot be found that way: add them here by hand.

PRIVATE_TORCH_BEHAVIOURS lists the rest: protocols zerogpt relies on that no attribute of torch's names, so the
test cannot look them up (an attribute torch itself sets on an instance, the way torch reads a dict). Each
says what would break where, should torch change it.
"""
from __future__ import annotations

PRIVATE_TORCH_APIS: tuple[tuple[str, str, str], ...] = (
    # (owner: a module, or a dotted path to a class or object in one; attribute; where zerogpt uses it: why)
    # ZeroInitContext: record the ops that build a model on meta, replay them per shard (zero/init_*.py).
    # Dispatch modes and pytree have no public home in torch.
    ("torch.utils._python_dispatch", "TorchDispatchMode", "zero/init_modes.py: record every op on a meta storage"),
    ("torch.utils._python_dispatch", "_get_current_dispatch_mode_stack",
     "zero/init_ctx.py: detect a recording in progress"),
    ("torch.utils._pytree", "tree_map", "zero/init_modes.py, init_record.py: encode and decode op arguments"),
    ("torch.utils._pytree", "tree_flatten", "zero/init_modes.py, init_record.py: the tensors among an op's "
                                            "arguments and outputs"),
    ("torch.ops.aten.add.Tensor", "_schema", "zero/init_modes.py: which arguments an op writes (`Tensor(a!)`)"),
    ("torch.ops.aten", "_local_scalar_dense", "zero/init_modes.py: a value read (x.item()) answered by a replay"),
    ("torch.ops.aten", "_to_copy", "zero/init_modes.py: a copy to the CPU answered by a replay"),
    ("torch.Tensor", "_version", "zero/init_modes.py, init_record.py, init_ctx.py: a tensor changed in place after "
                                 "it was recorded"),
    # Stage 3 (zero/gather_hooks.py): a saved view of a parameter is kept as (parameter, size, stride, offset).
    ("torch.Tensor", "_base", "zero/gather_hooks.py: the parameter a saved view was taken from; zero/chunk.py "
                              "add_param_grad: a gradient that is no view becomes its chunk's buffer"),
    ("torch.utils._pytree", "tree_map_only", "zero/gather_hooks.py: wrap the tensors of a module's output"),
    # Tensor parallelism: a chunk slot becomes a DTensor Parameter's local values. DTensor.from_local would build
    # a new Parameter, and the optimizer, tied modules and hooks hold the old one.
    ("torch.distributed.tensor.DTensor", "_local_tensor",
     "zero/chunk.py bind_param: point a DTensor Parameter's local values at its chunk slot"),
    # ... and its wrapper's storage offset made the slot's, as DTensor.from_local makes it (torch.compile checks it).
    ("torch.Tensor", "_dtensor__new__", "zero/chunk.py _match_wrapper_offset: a data-less wrapper storage of the "
                                        "slot's offset and size"),
    ("torch.distributed.tensor.DTensor", "_spec", "zero/chunk.py _match_wrapper_offset: the parameter's placement"),
    # A Llama's first block under TP takes the embedding's output as an AsyncCollectiveTensor (a pending
    # all-reduce); dynamo would trace a second graph for it, whose backward fails. There is no public wait.
    ("torch.distributed._functional_collectives", "AsyncCollectiveTensor",
     "compile.py: recognise a pending collective's result among a compiled block's inputs"),
    ("torch.distributed._functional_collectives", "wait_tensor",
     "compile.py: wait on it (on the wrapper itself, so autograd keeps the embedding's gradient)"),
    # The shared-memory transport's exit: a tensor's C++ references (gloo's work among them); Python's are not counted.
    ("torch.Tensor", "_use_count", "zero/shm.py close: wait until gloo's worker no longer holds the transport's "
                                   "barrier tensor (its Python object must not be freed there at exit)"),
    # Multi-tensor kernels, as torch.optim uses them (there is no public torch.foreach): cpu_adam.py's per-slot
    # weight decay (decay_slices, which zero/chunk_state.py calls for any optimizer) and its Adam without bias
    # correction (torch's Adam kernels always correct).
    ("torch", "_foreach_mul_", "optim/cpu_adam.py: decoupled weight decay (decay_slices); Adam's v"),
    ("torch", "_foreach_add_", "optim/cpu_adam.py: L2 weight decay (decay_slices); Adam's step counts"),
    ("torch", "_foreach_add", "optim/cpu_adam.py: L2-decayed gradients, Adam's denominator"),
    ("torch", "_foreach_div", "optim/cpu_adam.py: the engine's clip factor (unscale) in that Adam, on device params"),
    ("torch", "_foreach_lerp_", "optim/cpu_adam.py: Adam's m"),
    ("torch", "_foreach_addcmul_", "optim/cpu_adam.py: Adam's v"),
    ("torch", "_foreach_sqrt", "optim/cpu_adam.py: Adam's denominator"),
    ("torch", "_foreach_addcdiv_", "optim/cpu_adam.py: the Adam update"),
)

PRIVATE_TORCH_BEHAVIOURS: tuple[tuple[str, str, str], ...] = (
    # (torch's owner, what zerogpt relies on, where zerogpt relies on it: why)
    ("torch.optim fused Adam/AdamW/SGD/Adagrad step()", "instance attributes `found_inf` and `grad_scale` (set and "
     "deleted around one step by torch.amp.GradScaler.step), read as the fused kernel's skip flag and the divisor "
     "of each gradient, applied before its weight decay",
     "zero/chunk_state.py _fused_step: a non-finite gradient norm skips a torch fused optimizer's step on the "
     "device, with no host sync, and the clip factor is applied in the kernel's own read of the gradient; the "
     "step takes no such arguments"),
    ("torch.optim.Optimizer", "step() reads a param group only with group[key] / group.get (never copies it into "
     "a dict, never checks its type)",
     "zero/chunk_state.py chunk_optimizer: each chunk's optimizer group is a ChainMap(own params and defaults, the "
     "user's group), so an LR scheduler's change to the user's group is seen with no copy"),
    ("torch.optim.lr_scheduler.LRScheduler", "state_dict() is its __dict__, `_last_lr` among the keys",
     "trainer/trainer.py Trainer.load_state_dict: a saved schedule holding its rates (torch's) against one an "
     "import wrote with its position only (zerogpt_tools/import_megatron.py)"),
)
