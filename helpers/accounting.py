"""Device-independent memory accounting: count the bytes that tensors hold, on any device.

These numbers need no GPU, so the same cells give the same breakdown on a CPU (CI) and on a GPU,
where they are cross-checked against the allocator.

- ``param_bytes`` / ``grad_bytes`` / ``optimizer_state_bytes``: the model states.
- ``SavedTensorMeter``: the bytes autograd keeps for the backward pass (the "activations"),
  counted with ``torch.autograd.graph.saved_tensors_hooks``. Each storage is counted once (a
  tensor saved by several ops, or a view of it, is one piece of memory), and the model's own
  parameters are not counted (they are already in ``param_bytes``).
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of a tensor's elements (``numel * element_size``)."""
    return t.numel() * t.element_size()


def param_bytes(model: nn.Module, *, trainable_only: bool = False) -> int:
    """Bytes of the model's parameters (each shared parameter once)."""
    params = {id(p): p for p in model.parameters() if p.requires_grad or not trainable_only}
    return sum(tensor_bytes(p) for p in params.values())


def grad_bytes(model: nn.Module) -> int:
    """Bytes of the gradients currently held in ``param.grad``."""
    params = {id(p): p for p in model.parameters()}
    return sum(tensor_bytes(p.grad) for p in params.values() if p.grad is not None)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer, *, include_scalars: bool = False) -> int:
    """Bytes of the optimizer's state tensors (AdamW: ``exp_avg`` and ``exp_avg_sq``).

    Zero-dimensional tensors (AdamW's per-parameter ``step`` counter) are left out unless
    ``include_scalars`` is set: they are a few bytes each and would blur the bytes-per-parameter rules.
    States appear only after the first ``optimizer.step()``.
    """
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and (include_scalars or value.dim() > 0):
                total += tensor_bytes(value)
    return total


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


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
    The meter only observes: the saved tensors are returned to autograd unchanged.
    """

    def __init__(self, model: nn.Module | None = None, *, group: dict[str, nn.Module] | None = None):
        self._param_keys: set[tuple[str, int]] = set()
        if model is not None:
            self._param_keys = {_storage_key(p) for p in model.parameters()}
        self._groups = group or {}
        self._seen: set[tuple[str, int]] = set()
        self._stack: list[str] = []
        self.bytes_by_group: dict[str, int] = defaultdict(int)
        self.n_saved = 0
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_group.values())

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        # Return a detached alias, never ``t`` itself: when ``t`` is an op's output, keeping it (with
        # its grad_fn) inside that grad_fn's saved variables is a reference cycle that not even
        # gc.collect() breaks if no backward runs. Detaching loses nothing: autograd restores the
        # grad_fn on unpack.
        self.n_saved += 1
        if t.layout == torch.strided and t.device.type != "meta":
            key = _storage_key(t)
            if key not in self._param_keys and key not in self._seen:
                self._seen.add(key)
                where = self._stack[-1] if self._stack else "other"
                self.bytes_by_group[where] += t.untyped_storage().nbytes()
        return t.detach()

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def _register_groups(self) -> None:
        for name, module in self._groups.items():

            def enter(_mod, _args, name=name):
                self._stack.append(name)

            def leave(_mod, _args, _out):
                self._stack.pop()

            self._handles.append(module.register_forward_pre_hook(enter))
            self._handles.append(module.register_forward_hook(leave))

    def __enter__(self) -> SavedTensorMeter:
        self._register_groups()
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


def model_state_bytes(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, int]:
    """Parameters, gradients and optimizer states of a model, in bytes."""
    return {
        "parameters": param_bytes(model),
        "gradients": grad_bytes(model),
        "optimizer_states": optimizer_state_bytes(optimizer) if optimizer is not None else 0,
    }
