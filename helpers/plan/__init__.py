"""The memory planner: predict the peak allocated memory of a training step, term by term.

A ``Setup`` names the model (a registry name, a ``config.json`` path or a config object) and the recipe
(batch, sequence length, precision, optimizer, accumulation, checkpointing, attention kernel, LoRA/QLoRA,
ZeRO). ``predict`` returns a ``Plan``: the bytes of each component and of each phase of a steady-state
step, which phase holds the peak, and the chapter that measured each term. ``suggest`` lists the
cheapest changes that make a setup fit a budget, ``measure`` runs the step on a device and reads the
allocator, ``baselines`` gives what five published estimators say for the same setup (``baseline_domains``: the
rows each claims to cover).

>>> from helpers import plan
>>> p = plan.predict(plan.Setup(model="gpt-neox-1.3b", batch=4, seq=256, precision="bf16-autocast"))
>>> p.peak_gib, p.peak_phase
>>> print(p.table().to_string(na_rep="—"))

Command line: ``python -m helpers.plan --model gpt-neox-1.3b --batch 4 --seq 256 --gpu T4``.

Its modules, one job each; a module imports only modules listed above it (the tests check this):

- ``setup``     the input: ``Setup``, ``validate``, the model's ``shape`` counted on the meta device
- ``terms``     the bytes of each term: weights, gradients, optimizer states, activations, copies, temporaries
- ``predict``   the phase walk: ``predict`` and the ``Plan`` it returns
- ``suggest``   the cheapest changes that make a setup fit a budget
- ``heldout``   the frozen held-out set: setups none of the planner's terms was fitted to (data only)
- ``check``     ``measure`` on a device, the validation set, the held-out set's table and sentence, the
  published ``baselines``, the error table
- ``__main__``  the command line

Everything a chapter calls is importable from ``helpers.plan`` itself (``plan.predict``, ``plan.Setup``,
...); the GPU facts it compares with live in ``helpers.gpus``. The function names ``predict`` and ``suggest`` are also the names
of their modules: ``plan.predict`` is the function; the module is ``sys.modules["helpers.plan.predict"]``.
"""

from __future__ import annotations

from collections.abc import Sequence

from helpers.plan.check import (
    BASELINE_NAMES,
    HELDOUT_GOAL,
    MIXED_PRECISION_ADAMW,
    PLAYBOOK,
    VALIDATION_SETUPS,
    baseline_domains,
    baselines,
    describe_heldout,
    error_summary,
    error_table,
    heldout_config,
    heldout_setups,
    heldout_summary,
    heldout_table,
    in_mixed_precision_adamw_domain,
    measure,
    playbook_bytes,
)
from helpers.plan.predict import GIB, PHASES, Plan, predict
from helpers.plan.setup import (
    ALIASES,
    ATTENTIONS,
    DEFAULT_LORA_TARGETS,
    OPTIMIZERS,
    PRECISIONS,
    Param,
    Setup,
    Shape,
    shape,
    validate,
)
from helpers.plan.suggest import suggest
from helpers.plan.terms import (
    ACT_COEF_CPU,
    BNB_MIN_8BIT,
    BNB_OPT_BLOCK,
    COMPONENTS,
    DQ_BLOCK,
    NF4_BLOCK,
    SOURCES,
    autocast_copy_bytes,
    gradient_bytes,
    kv_cache_bytes,
    layer_activation_bytes,
    lora_trainable_params,
    optimizer_state_bytes,
    other_activation_bytes,
    weight_bytes,
)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (``python -m helpers.plan``), callable from Python: ``plan.main(["--model", ...])``.

    Prints the breakdown, the peak phase, the verdict and, if needed, suggestions. Exits with status 2 and
    a message for unknown models, impossible settings and bad numbers; 1 when the setup does not fit the
    budget; 0 when it fits (or no budget was given). The code is ``helpers/plan/__main__.py``, imported here
    only when called, so that ``python -m helpers.plan`` runs it once, as the program.

    Introduced in chapter 10, section 10.1.
    """
    from helpers.plan.__main__ import main as _main

    return _main(argv)


__all__ = [
    "ACT_COEF_CPU", "ALIASES", "BASELINE_NAMES", "HELDOUT_GOAL", "MIXED_PRECISION_ADAMW", "PLAYBOOK",
    "baseline_domains", "in_mixed_precision_adamw_domain", "playbook_bytes", "describe_heldout", "heldout_config", "heldout_setups",
    "heldout_summary", "heldout_table", "ATTENTIONS", "BNB_MIN_8BIT", "BNB_OPT_BLOCK", "COMPONENTS",
    "DEFAULT_LORA_TARGETS", "DQ_BLOCK", "GIB", "NF4_BLOCK", "OPTIMIZERS", "PHASES",
    "PRECISIONS", "SOURCES", "VALIDATION_SETUPS", "Param", "Plan", "Setup", "Shape", "autocast_copy_bytes",
    "baselines", "error_summary", "error_table", "gradient_bytes", "kv_cache_bytes", "layer_activation_bytes",
    "lora_trainable_params", "main", "measure", "optimizer_state_bytes", "other_activation_bytes", "predict",
    "shape", "suggest", "validate", "weight_bytes",
]
