"""Shared code for the GPU-Efficient Training book.

Module map, one job each. A module imports only modules listed above it (the tests check this), so the
package reads from the top down and has no import cycles. Each public function's docstring names the
chapter and section that introduce it.

Foundations
- ``gpus``        facts about GPUs by name or compute capability: memory, peak FLOP/s, bandwidth, bf16/TF32/flash
- ``run_profile`` which sizes to run (``tiny`` on a CPU, ``full`` on a GPU) and GPU-only guards
- ``measure``     the one reader of GPU memory (NVML, torch's allocator), peaks, phases, budgets; out of memory

Counting and formulas (no GPU needed)
- ``accounting``  bytes of weights, gradients, optimizer states (sharded too) and saved activations
- ``estimates``   the rules and formulas measurements are held against: ZeRO's memory and traffic among them
- ``flops``       FLOPs per token, throughput and MFU (against the peaks of ``gpus``)

Models, data, training
- ``models``      offline model registry (full size and tiny twins), local checkpoints
- ``data``        datasets that need no download (random tokens, a Markov chain, keywords, tokenising), batches
- ``packing``     variable-length documents into batches: padding, length grouping, packing with position ids
- ``steps``       the book's training step: a batch on the device, one step with its phases marked

Memory management
- ``cleanup``     drop objects (IPython's output cache included) and give memory back
- ``batching``    find the largest batch that fits: try, catch out-of-memory, free, back off

Several processes
- ``distributed`` inside a launched script: join the process group, fail all ranks together
- ``launching``   start ``torchrun`` / ``accelerate launch`` from a notebook, stop them cleanly

Time and memory over time (chapter 8)
- ``profiler``    ``torch.profiler`` reduced to a category table, GPU-busy, phases, a timeline; the one trace reader and interval algebra; communication kernels and their overlap with compute
- ``timing``      timing GPU work honestly: wall, CUDA-event and host clocks, spread, GPU-busy, a verdict
- ``memsnap``     the allocator's history: memory over time by origin, its peak, the survivors of a step

Communication (chapter 7)
- ``collectives`` collectives timed in launched processes (nccl-tests' bus bandwidth)

Planning (chapter 10)
- ``plan``        a package: predict a training step's peak memory by term and phase, suggest changes, measure, CLI (``helpers/plan/__init__.py`` maps its modules)

Showing results
- ``plots``       one figure style, stacked memory bars, line series
- ``prose``       phrase helpers for the sentences that quote a run: listings, units, ``say``

Exercises
- ``exercises``   check a reader's numeric answer to an exercise: right, close, or a nudge (never the answer)

A chapter's first cell
- ``env``         quiet warnings; ``start``: plot style, run profile, the report every chapter prints first; Colab; NVLink
"""

__version__ = "0.1.0"
