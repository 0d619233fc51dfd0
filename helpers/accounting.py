"""Device-independent memory accounting: count the bytes that tensors hold, on any device.

These numbers need no GPU, so the same cells give the same breakdown on a CPU (CI) and on a GPU,
where they are cross-checked against the allocator.

- ``param_bytes`` / ``grad_bytes`` / ``optimizer_state_bytes`` / ``model_state_bytes``: the model
  states, under the same names as ``estimates`` uses (``weights``, ``gradients``,
  ``optimizer_states``). Sharded tensors (FSDP2's ``DTensor``) count by the shard this process
  holds, and wrapped optimizers (accelerate's, ``ZeroRedundancyOptimizer``) by the states this
  process keeps, so the same calls measure one rank of a distributed run.
- ``SavedTensorMeter``: the bytes autograd keeps for the backward pass (the "activations"),
  counted with ``torch.autograd.graph.saved_tensors_hooks``. Each storage is counted once (a
  tensor saved by several ops, or a view of it, is one piece of memory), and the model's own
  parameters are not counted (they are already in ``param_bytes``).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn

# The model states, by the names used everywhere in the book (accounting, estimates, the ZeRO formula).
MODEL_STATES = ("weights", "gradients", "optimizer_states")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This process's part of ``t``: the local shard of a ``DTensor``, the tensor itself otherwise.

    Introduced in chapter 7, section 7.4.
    """
    to_local = getattr(t, "to_local", None)
    if not callable(to_local):
        return t
    with torch.no_grad():  # no autograd record of the DTensor -> local view
        return to_local()


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of a tensor's elements (``numel * element_size``); a ``DTensor`` counts its local shard.

    Introduced in chapter 1, section 1.1.
    """
    t = local_tensor(t)
    return t.numel() * t.element_size()


def _unique_params(model: nn.Module, trainable_only: bool = False) -> list[nn.Parameter]:
    return list({id(p): p for p in model.parameters() if p.requires_grad or not trainable_only}.values())


def param_bytes(model: nn.Module, *, trainable_only: bool = False) -> int:
    """Bytes of the model's parameters (each shared parameter once; a sharded one by its local shard).

    Introduced in chapter 1, section 1.1.
    """
    return sum(tensor_bytes(p) for p in _unique_params(model, trainable_only))


def grad_bytes(model: nn.Module) -> int:
    """Bytes of the gradients currently held in ``param.grad``.

    Introduced in chapter 1, section 1.3.
    """
    return sum(tensor_bytes(p.grad) for p in _unique_params(model) if p.grad is not None)


def inner_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this process's states: unwraps accelerate and ``ZeroRedundancyOptimizer``.

    Introduced in chapter 7, section 7.4.
    """
    for _ in range(8):
        inner = getattr(optimizer, "optimizer", None)  # accelerate's AcceleratedOptimizer
        if not (isinstance(inner, torch.optim.Optimizer) and inner is not optimizer):
            inner = getattr(optimizer, "optim", None)  # torch's ZeroRedundancyOptimizer: the local one
        if not (isinstance(inner, torch.optim.Optimizer) and inner is not optimizer):
            break
        optimizer = inner
    return optimizer


def optimizer_state_bytes(optimizer: torch.optim.Optimizer, *, include_scalars: bool = False) -> int:
    """Bytes of the optimizer's state tensors (AdamW: ``exp_avg`` and ``exp_avg_sq``).

    Zero-dimensional tensors (AdamW's per-parameter ``step`` counter) are left out unless
    ``include_scalars`` is set: they are a few bytes each and would blur the bytes-per-parameter rules.
    States appear only after the first ``optimizer.step()``. A wrapped optimizer counts the states
    this process keeps (``inner_optimizer``).

    Introduced in chapter 1, section 1.3.
    """
    total = 0
    for state in inner_optimizer(optimizer).state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and (include_scalars or value.dim() > 0):
                total += tensor_bytes(value)
    return total


def unsharded_param_bytes(model: nn.Module) -> int:
    """Bytes of the parameters that are whole tensors in this process (not ``DTensor`` shards).

    All of them without sharding (and under DDP); under FSDP2, the parameters that are gathered at
    the moment of the call (between forward and backward with ``reshard_after_forward=False``), none
    at rest.

    Introduced in chapter 7, section 7.4.
    """
    return sum(tensor_bytes(p) for p in _unique_params(model) if local_tensor(p) is p)


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


def _top_hooks() -> tuple[Any, Any] | None:
    """The (pack, unpack) pair autograd applies to a tensor saved now, or None."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


# Saved-tensor hooks that torch.utils.checkpoint pushes inside a checkpointed region: they store nothing
# for backward (the region is recomputed), so a meter around the region rightly sees nothing saved there.
_CHECKPOINT_HOOKS = ("_checkpoint_hook", "_recomputation_hook")


class SavedTensorMeter:
    """Count bytes saved for backward while a forward pass runs.

    >>> meter = SavedTensorMeter(model)
    >>> with meter:
    ...     loss = model(**batch).loss
    >>> meter.total_bytes                  # activations kept for backward
    >>> meter.bytes_by_group               # the same, split by the groups given to ``group``

    ``group`` maps names to submodules (for example each transformer layer); bytes are attributed
    to the innermost group whose forward is running when a tensor is first saved, or to
    ``"other"`` (embeddings, head, loss). Tensors that share a storage with a parameter are skipped.

    The meter only observes: autograd saves exactly what it would save without it.

    - Inside another saved-tensor hook (``with torch.autograd.graph.save_on_cpu(), meter:``) it
      counts each tensor and hands it on to that hook, so offloading still happens. ``total_bytes``
      is what the operations saved; ``kept_bytes("cuda")`` is what stays on the GPU after the outer
      hook has packed it (nothing, under ``save_on_cpu``) and ``kept_bytes("cpu")`` what went to
      the host.
    - A hook entered *inside* the meter would hide every tensor from it, so the meter refuses: the
      next module forward raises ``RuntimeError``. Gradient checkpointing's own hooks are the
      exception: a checkpointed region keeps nothing for backward (it is recomputed), and the
      meter, rightly, counts nothing there.

    Introduced in chapter 1, section 1.3.
    """

    def __init__(self, model: nn.Module | None = None, *, group: dict[str, nn.Module] | None = None):
        self._param_keys: set[tuple[str, int]] = set()
        if model is not None:
            self._param_keys = {_storage_key(p) for p in model.parameters()}
        self._groups = group or {}
        self._seen: set[tuple[str, int]] = set()
        self._stack: list[str] = []
        self.bytes_by_group: dict[str, int] = defaultdict(int)
        self._kept: dict[tuple[str, int], tuple[torch.device, int]] = {}
        self.n_saved = 0
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._outer: tuple[Any, Any] | None = None

    @property
    def total_bytes(self) -> int:
        """Bytes the operations saved for backward (each storage once, parameters left out)."""
        return sum(self.bytes_by_group.values())

    def kept_bytes(self, device: str | torch.device | None = None) -> int:
        """Bytes autograd stores for backward on ``device`` (all devices if None), after any outer hook.

        Without an outer saved-tensor hook this equals ``total_bytes`` on the device the model runs on.
        """
        want = None if device is None else torch.device(device)
        return sum(
            nbytes for dev, nbytes in self._kept.values()
            if want is None or (dev.type == want.type and (want.index is None or dev.index == want.index))
        )

    def _note_kept(self, packed: Any) -> None:
        if isinstance(packed, torch.Tensor):
            if packed.layout == torch.strided and packed.device.type != "meta":
                key = _storage_key(packed)
                self._kept.setdefault(key, (packed.device, packed.untyped_storage().nbytes()))
        elif isinstance(packed, (tuple, list)):
            for item in packed:
                self._note_kept(item)

    def _pack(self, t: torch.Tensor) -> Any:
        self.n_saved += 1
        counted = t.layout == torch.strided and t.device.type != "meta"
        is_param = counted and _storage_key(t) in self._param_keys
        if counted and not is_param:
            key = _storage_key(t)
            if key not in self._seen:
                self._seen.add(key)
                where = self._stack[-1] if self._stack else "other"
                self.bytes_by_group[where] += t.untyped_storage().nbytes()
        if self._outer is not None:  # hand the tensor on: the outer hook decides what is stored
            packed = self._outer[0](t)
        else:
            # Return a detached alias, never ``t`` itself: when ``t`` is an op's output, keeping it (with
            # its grad_fn) inside that grad_fn's saved variables is a reference cycle that not even
            # gc.collect() breaks if no backward runs. Detaching loses nothing: autograd restores the
            # grad_fn on unpack.
            packed = t.detach()
        if not is_param:
            self._note_kept(packed)
        return packed

    def _unpack(self, packed: Any) -> torch.Tensor:
        return self._outer[1](packed) if self._outer is not None else packed

    def _check_innermost(self, _module, _args) -> None:
        top = _top_hooks()
        pack = top[0] if top is not None else None
        if pack is None or pack == self._pack or isinstance(getattr(pack, "__self__", None), SavedTensorMeter):
            return
        if any(name in getattr(pack, "__qualname__", "") for name in _CHECKPOINT_HOOKS):
            return
        raise RuntimeError(
            "SavedTensorMeter must be the innermost saved-tensor hook: a hook entered inside it "
            f"({getattr(pack, '__qualname__', pack)!r}) hides every saved tensor from the meter. "
            "Enter the meter last, e.g. `with torch.autograd.graph.save_on_cpu(), SavedTensorMeter(model):`"
        )

    def _register_groups(self) -> None:
        for name, module in self._groups.items():

            def enter(_mod, _args, name=name):
                self._stack.append(name)

            def leave(_mod, _args, _out):
                self._stack.pop()

            self._handles.append(module.register_forward_pre_hook(enter))
            self._handles.append(module.register_forward_hook(leave))

    def __enter__(self) -> SavedTensorMeter:
        self._outer = _top_hooks()
        self._register_groups()
        self._handles.append(nn.modules.module.register_module_forward_pre_hook(self._check_innermost))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._stack.clear()


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Weights, gradients and optimizer states of a model, in bytes (the keys of ``MODEL_STATES``).

    The same keys as ``estimates.model_state_bytes`` and ``estimates.zero_model_state_bytes``, so a
    measurement and its rule line up. In a distributed run: the bytes this process holds.

    >>> model_state_bytes(model, optimizer)["optimizer_states"] / param_bytes(model)   # 2.0 for AdamW

    Introduced in chapter 1, section 1.3.
    """
    return {
        "weights": param_bytes(model),
        "gradients": grad_bytes(model),
        "optimizer_states": optimizer_state_bytes(optimizer) if optimizer is not None else 0,
    }
