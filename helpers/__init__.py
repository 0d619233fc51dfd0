"""Shared code for the GPU-Efficient Training book.

Modules, one job each:

- ``profiles``   which sizes to run (``tiny`` on a CPU, ``full`` on a GPU) and GPU-only guards
- ``env``        the environment report every chapter prints first; Colab detection
- ``measure``    NVML and torch-allocator memory, a phase recorder, timing with warm-up and medians
- ``accounting`` device-independent bytes: parameters, gradients, optimizer states, saved activations
- ``flops``      FLOPs per token, peak FLOP/s by GPU, throughput and MFU
- ``estimates``  the rules and formulas the measurements are held against
- ``models``     offline model registry (full size and tiny twins), local checkpoints
- ``data``       the seeds' dummy dataset and small learnable tasks
- ``train``      a plain training loop for loss curves
- ``batching``   find the largest batch that fits: try, catch out-of-memory, free, back off
- ``distributed`` the ZeRO memory formula, per-rank accounting of sharded models, launching torchrun
- ``cleanup``    drop objects and give memory back
- ``plots``      one figure style, stacked memory bars, line series
- ``glue``       glue numbers into the book's prose
"""

__version__ = "0.1.0"
