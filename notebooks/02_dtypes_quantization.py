# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     notebook_metadata_filter: -jupytext.text_representation.jupytext_version
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 2. Data types and quantization
#
# A model's memory is its number of parameters times the bytes of each one. Chapter 1 counted the
# parameters; this chapter is about the bytes. We look at what 32, 16 and 8 bits can and cannot hold, watch
# the 16-bit formats fail in front of us, and then write by hand the four int8 quantization schemes that
# chapter 5 of the Korean LLM book ([Heo (2024)](https://gpu-efficient-training.github.io/book/book/references.html)) describes (absmax, zero-point, block-wise, quantile), measuring the error of each. Finally we use the
# production versions in bitsandbytes and transformers, [LLM.int8()](https://gpu-efficient-training.github.io/book/book/glossary.html#llm-int8) and 4-bit [NF4](https://gpu-efficient-training.github.io/book/book/glossary.html#nf4), on a layer and on the
# whole 1.3B model, and hold their memory against the expected bytes per parameter.
#
# **What you will learn**
#
# - the bit layout, range and precision of [fp32](https://gpu-efficient-training.github.io/book/book/glossary.html#fp32), [tf32](https://gpu-efficient-training.github.io/book/book/glossary.html#tf32), [fp16](https://gpu-efficient-training.github.io/book/book/glossary.html#fp16), [bf16](https://gpu-efficient-training.github.io/book/book/glossary.html#bf16), [fp8](https://gpu-efficient-training.github.io/book/book/glossary.html#fp8) and int8, and how to read them off
#   `torch.finfo`;
# - why fp16 training needs [loss scaling](https://gpu-efficient-training.github.io/book/book/glossary.html#loss-scaling) and why long sums are accumulated in fp32;
# - how absmax, zero-point, block-wise and quantile quantization work, what each costs, and how outliers
#   break the simple ones;
# - what LLM.int8() and NF4 (with and without [double quantization](https://gpu-efficient-training.github.io/book/book/glossary.html#double-quantization)) store, how close they stay to bf16, and
#   what they cost in speed.
#
# **Prerequisites:** [chapter 1](https://gpu-efficient-training.github.io/book/notebooks/01_memory_anatomy.html) (bytes per parameter, the allocator's numbers).

# %%
import sys

if "google.colab" in sys.modules:  # Colab only. pip adds what Colab lacks (bitsandbytes, the book's helpers)
    # and upgrades transformers to the 5.x the book needs: nothing has imported it yet in this kernel, so no
    # restart is needed. Colab's torch already meets the book's floor and is kept (see the setup page).
    # %pip install -q --no-warn-conflicts "gpu-efficient-training @ git+https://github.com/gpu-efficient-training/book"

from helpers import env

env.quiet()  # warnings without file paths, no progress bars: outputs that read the same everywhere

import math
import tempfile

import bitsandbytes as bnb
import matplotlib.pyplot as plt
import pandas as pd
import torch
import torch.nn.functional as F
from IPython.display import Markdown, display
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, GemmaConfig, MistralConfig

from helpers import accounting, cleanup, gpus, models, plots, run_profile, timing
from helpers.measure import GIB, MIB

prof = env.start("{:,.4g}")  # plot style, number format, run profile; the table below names hardware and versions
baseline_mib = torch.cuda.memory_allocated() / MIB if prof.on_gpu else 0.0  # checked in the last cell

# %% [markdown]
# ## 2.1 Formats: sign, exponent, mantissa
#
# A floating-point number is $(-1)^{s} \times 1.m \times 2^{e - \text{bias}}$: a sign bit, an exponent that
# sets the *range* and a mantissa (fraction) that sets the *precision*. Fewer exponent bits means a smaller
# range; fewer mantissa bits means coarser steps. `torch.finfo` knows every format PyTorch has; the mantissa
# width follows from the machine epsilon ($\epsilon = 2^{-m}$, the gap between 1 and the next number).
# TF32 has no dtype of its own: it is a mode of NVIDIA's [tensor cores](https://gpu-efficient-training.github.io/book/book/glossary.html#tensor-cores) (Ampere and later) that multiplies
# fp32 inputs with a 10-bit mantissa, and we add its row by hand. This table is the same on every machine,
# so CI checks it against the committed one.

# %%
# NBVAL_CHECK_OUTPUT
FLOATS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
          "fp8 e4m3": torch.float8_e4m3fn, "fp8 e5m2": torch.float8_e5m2}


def describe(dtype):
    fi = torch.finfo(dtype)
    mantissa = round(-math.log2(fi.eps))
    return {"bits": fi.bits, "exponent bits": fi.bits - 1 - mantissa, "mantissa bits": mantissa,
            "max": fi.max, "smallest normal": fi.tiny, "smallest subnormal": fi.tiny * fi.eps, "epsilon": fi.eps}


formats = {name: describe(dt) for name, dt in FLOATS.items()}
formats["tf32 (matmul mode)"] = {**formats["fp32"], "bits": 19, "mantissa bits": 10, "epsilon": 2.0**-10,
                                  "smallest subnormal": float("nan")}
ii = torch.iinfo(torch.int8)
formats["int8"] = {"bits": 8, "exponent bits": 0, "mantissa bits": 7, "max": ii.max, "smallest normal": 1,
                   "smallest subnormal": float("nan"), "epsilon": 1}
table = pd.DataFrame(formats).T
table[["bits", "exponent bits", "mantissa bits"]] = table[["bits", "exponent bits", "mantissa bits"]].astype(int)
print(table.map(lambda v: ("—" if math.isnan(v) else f"{v:.4g}") if isinstance(v, float) else v)
      .to_string())  # text: identical everywhere; "—": the format has no such number

# %% [markdown]
# fp16 and bf16 spend their 16 bits differently: fp16 keeps 10 mantissa bits and only 5 exponent bits (largest
# value 65,504), bf16 keeps fp32's 8 exponent bits (the same range as fp32) and only 7 mantissa bits
# ([Kalamkar et al. (2019)](https://gpu-efficient-training.github.io/book/book/references.html)). The two fp8 formats make the same trade at 8 bits. int8 has no exponent at
# all: 256 evenly spaced values, which is why quantizing to it needs a *scale*. The layouts, drawn to scale:

# %%
LAYOUT = {"fp32": (8, 23), "tf32": (8, 10), "fp16": (5, 10), "bf16": (8, 7),
          "fp8 e4m3": (4, 3), "fp8 e5m2": (5, 2), "int8": (0, 7)}
colors = {"sign": "#C44E52", "exponent": "#4C72B0", "mantissa": "#55A868"}
fig, ax = plt.subplots(figsize=(9, 3.6))
for row, (name, (e, m)) in enumerate(LAYOUT.items()):
    parts = ["sign"] + ["exponent"] * e + ["mantissa"] * m
    for i, part in enumerate(parts):
        ax.add_patch(plt.Rectangle((i, -row - 0.4), 0.92, 0.8, color=colors[part]))
    ax.text(-0.6, -row, name, ha="right", va="center", fontsize=9)
    stored = " (stored in 32)" if name == "tf32" else ""  # TF32 is fp32 in memory; the tensor cores read 19 bits
    ax.text(len(parts) + 0.4, -row, f"{len(parts)} bits{stored}", va="center", fontsize=8)
for part, color in colors.items():
    ax.bar(0, 0, color=color, label=part)
ax.set_xlim(-6, 40)
ax.set_ylim(-len(LAYOUT) + 0.4, 0.6)
ax.axis("off")
ax.legend(loc="lower right", ncols=3)
ax.set_title("Bit layouts: exponent bits buy range, mantissa bits buy precision (int8: value bits)")
fig.tight_layout()

# %% [markdown]
# What happens to three numbers in each format: 0.1 (not exact in binary), 65,504 (fp16's largest) and
# $10^{-8}$ (a typical small gradient). The bits are shown as sign | exponent | mantissa.

# %%
BITS_AS = {8: torch.uint8, 16: torch.int16, 32: torch.int32}


def bit_string(value, dtype):
    """The stored bits of ``value`` in ``dtype``, split as sign | exponent | mantissa."""
    fi = torch.finfo(dtype)
    raw = torch.tensor(value, dtype=torch.float64).to(dtype).view(BITS_AS[fi.bits]).item() & (2**fi.bits - 1)
    bits = format(raw, f"0{fi.bits}b")
    e = fi.bits - 1 - round(-math.log2(fi.eps))
    return f"{bits[0]}|{bits[1:1 + e]}|{bits[1 + e:]}"


rows = []
for value in (0.1, 65504.0, 1e-8):
    for name, dt in FLOATS.items():
        stored = torch.tensor(value, dtype=torch.float64).to(dt).to(torch.float64).item()
        rows.append({"value": value, "format": name, "bits": bit_string(value, dt), "stored as": f"{stored:.8g}",
                     "relative error": f"{abs(stored - value) / value:.2e}" if math.isfinite(stored) else "overflow"})
pd.DataFrame(rows).set_index(["value", "format"])

# %% [markdown]
# 0.1 is off by at most $2^{-(m+1)}$ of its value in every format, as it should be: rounding moves a number by at
# most half the gap to its neighbour, and that gap is $2^{-m}$ of a number whose mantissa starts at 1. 65,504 is exact in fp16 and fp32, but bf16
# rounds it to 65,536, and fp8 e5m2 overflows to infinity. $10^{-8}$ survives in bf16 (fp32's range) but is
# **zero** in fp16 and both fp8 formats. fp8 e4m3 is the odd one: it has no infinity at all (its largest code
# is kept for NaN), so what does a cast beyond its largest value, 448, give? The answer has changed between
# PyTorch versions, so we ask this run's PyTorch, on the CPU and, where there is one, on the GPU:

# %%
out_of_range = [449.0, 500.0, 65504.0, float("inf")]
fp8_cast = {"CPU": torch.tensor(out_of_range).to(torch.float8_e4m3fn).float().tolist()}
if prof.on_gpu:
    fp8_cast["GPU"] = torch.tensor(out_of_range, device="cuda").to(torch.float8_e4m3fn).float().cpu().tolist()
e4m3 = fp8_cast["CPU"][out_of_range.index(65504.0)]
pd.DataFrame(fp8_cast, index=[f"{v:g}" for v in out_of_range]).rename_axis("fp32 value cast to e4m3")

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (2.1 Formats)
def cast_behaviour(values):
    v = values[out_of_range.index(65504.0)]
    if math.isnan(v):
        return "gives NaN"
    if v == 448.0:
        return "saturates to 448, the largest finite value"
    return f"gives {v:g}"


cast_txt = "; ".join(f"on the {where}, casting 65,504 {cast_behaviour(vals)}" for where, vals in fp8_cast.items())
display(Markdown(
    f"In this run's PyTorch ({torch.__version__.split('+')[0]}), {cast_txt}. Earlier or later versions may do the "
    "other thing (NaN and saturation are both allowed for a format without infinity). Code that casts to fp8 "
    "scales its tensors into range first and clamps, and never relies on either behaviour."
))

# %% [markdown]
# ## 2.2 Range and precision, failing in front of you
#
# Small arithmetic first: overflow, underflow, and a step too small to register.

# %%
h, b = torch.float16, torch.bfloat16
failures = {
    "fp16: 65504 + 32": (torch.tensor(65504.0, dtype=h) + 32).item(),
    "fp16: 300 x 300": (torch.tensor(300.0, dtype=h) * 300).item(),
    "bf16: 300 x 300": (torch.tensor(300.0, dtype=b) * 300).item(),
    "fp16: 1e-8": torch.tensor(1e-8, dtype=h).item(),
    "fp16: 1e-8 x 65536 (scaled first)": torch.tensor(1e-8 * 65536, dtype=h).item(),
    "bf16: 1 + 2**-8": (torch.tensor(1.0, dtype=b) + 2.0**-8).item(),
    "bf16: 1 + 2**-7": (torch.tensor(1.0, dtype=b) + 2.0**-7).item(),
}
pd.Series(failures, name="result").map("{:.8g}".format)

# %% [markdown]
# fp16 overflows past 65,504 where bf16 merely rounds (90,000 becomes 90,112). Underflow is the subtler
# danger in training: gradients that small do occur, and fp16 flushes them to zero, silently. That is why fp16
# [mixed precision](https://gpu-efficient-training.github.io/book/book/glossary.html#mixed-precision) multiplies the loss by a large factor before `backward()` (*loss scaling*,
# [Micikevicius et al. (2018)](https://gpu-efficient-training.github.io/book/book/references.html)): every gradient of the backward pass is scaled by the
# same factor and lands inside fp16's range, and the optimizer divides the weight gradients back in fp32. bf16
# needs no scaling, but its steps are coarse: $1 + 2^{-8}$ is exactly 1.
#
# What loss scaling protects are the gradients that the backward pass computes *in fp16*: under fp16
# [autocast](https://gpu-efficient-training.github.io/book/book/glossary.html#autocast), the gradient of every matrix product's output (an *activation gradient*) is an fp16 tensor, and
# it is what the next layer down multiplies with. We run one backward pass of bert-large (the tiny twin on a
# CPU) three times on the same batch, in eval mode so that no dropout differs: in fp32, under fp16 autocast,
# and under fp16 autocast with the loss multiplied by $2^{16}$. A hook on the output of every linear layer
# counts the entries of its gradient that are exactly zero and those that are not finite. Some entries are
# zero in every run, by the model's structure: the classifier reads only the first token of the last layer,
# so the last layer's outputs at the other tokens get no gradient at all. The fp32 run counts those; what fp16
# adds on top of them is underflow.

# %%
model = models.build("bert-large-uncased", head="sequence-classification").eval()  # eval: no dropout
ids = torch.randint(100, 30000, (4, prof.pick(tiny=64, full=512)), generator=torch.Generator().manual_seed(0))
labels = torch.tensor([0, 1, 0, 1], device=prof.device)
autocast_device = "cuda" if prof.on_gpu else "cpu"


def activation_grad_counts(fp16, loss_scale=1.0):
    """One backward pass; zero and non-finite entries of the gradients of all linear layers' outputs."""
    counts = {"entries": 0, "zero": 0, "non-finite": 0, "dtype": None}

    def count(grad):
        counts["entries"] += grad.numel()
        counts["zero"] += (grad == 0).sum().item()
        counts["non-finite"] += (~torch.isfinite(grad)).sum().item()
        counts["dtype"] = str(grad.dtype).removeprefix("torch.")

    def on_output(module, args, output):
        output.register_hook(count)

    handles = [m.register_forward_hook(on_output) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    try:
        with torch.autocast(autocast_device, dtype=torch.float16, enabled=fp16):
            loss = model(input_ids=ids.to(prof.device), labels=labels).loss
        (loss * loss_scale).backward()
    finally:
        for handle in handles:
            handle.remove()
        model.zero_grad(set_to_none=True)
    return counts


act_grads = pd.DataFrame({
    "fp32": activation_grad_counts(fp16=False),
    "fp16 autocast, no scaling": activation_grad_counts(fp16=True),
    "fp16 autocast, loss x 2**16": activation_grad_counts(fp16=True, loss_scale=2.0**16),
}).T
act_grads["zero (%)"] = 100 * act_grads["zero"] / act_grads["entries"]
act_grads["non-finite (%)"] = 100 * act_grads["non-finite"] / act_grads["entries"]
underflow_pct = act_grads.loc["fp16 autocast, no scaling", "zero (%)"] - act_grads.loc["fp32", "zero (%)"]
cleanup.free(globals(), "model")
act_grads[["dtype", "entries", "zero (%)", "non-finite (%)"]].style.format(
    {"entries": "{:,}", "zero (%)": "{:.4f}", "non-finite (%)": "{:.4f}"}, na_rep="—")

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (2.2 Range and precision, failing in front of you)
z32, z16, z16s = (act_grads.loc[k, "zero (%)"] for k in act_grads.index)
nonfinite_scaled = act_grads.loc["fp16 autocast, loss x 2**16", "non-finite (%)"]
text = (f"In this run {z32:.4f} % of the activation-gradient entries of the fp32 backward pass were zero (the "
        f"structural zeros); under fp16 autocast without scaling, {z16:.4f} %")
if z16 - z16s > 0.001:
    text += (f". With the loss multiplied by $2^{{16}}$ the same fp16 backward pass has {z16s:.4f} % zero entries, so "
             f"about {z16 - z16s:.4f} % of the entries had underflowed to zero without scaling: those are the smallest "
             "gradients, lost silently, and loss scaling brings them back into fp16's range")
else:
    text += (f", and {z16s:.4f} % with the loss multiplied by $2^{{16}}$: at this initialisation and batch, hardly any "
             "activation gradient is below fp16's range, so scaling changed little here. Gradients shrink as "
             "training lowers the loss, which is when the scale matters")
text += (f"; {nonfinite_scaled:.4f} % of the scaled entries overflowed." if nonfinite_scaled > 0 else
         "; none of the scaled entries overflowed.")
text += (" Real training adjusts the scale as it goes (`torch.amp.GradScaler` halves it when an overflow appears "
         "and grows it again after a run of clean steps); chapter 5 measures it.")
display(Markdown(text))

# %% [markdown]
# **Long sums.** Adding many small numbers in a low-precision accumulator stops working once the running sum's
# spacing exceeds twice the addend. We add 0.01 ten thousand times (exact answer: 100) with the accumulator
# in each format, one addition at a time as a naive loop would, and compare with `torch.sum`, whose kernels
# accumulate 16-bit inputs in fp32.

# %%
n_terms = 10_000
runs = {}
for name, dt in [("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)]:
    step, total, trace = torch.tensor(0.01, dtype=dt), torch.tensor(0.0, dtype=dt), []
    for _ in range(n_terms):
        total = total + step
        trace.append(total.item())
    runs[f"{name} accumulator"] = trace
sums = pd.DataFrame(runs, index=range(1, n_terms + 1))
final = sums.iloc[-1].to_dict() | {
    "torch.sum of fp16 values": torch.full((n_terms,), 0.01, dtype=torch.float16).sum().item(),
}
fig = plots.lines(sums.iloc[::50].reset_index(names="terms"), x="terms", ys=list(runs),
                  title=f"Adding 0.01 ten thousand times: fp16 stalls at {final['fp16 accumulator']:g}, "
                        f"bf16 at {final['bf16 accumulator']:g}", xlabel="terms added",
                  ylabel="running sum", styles=["-", "-", "-"])
fig.axes[0].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
fig.tight_layout()
pd.Series(final, name="sum of 10,000 x 0.01 (exact: 100)")

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (2.2 Range and precision, failing in front of you)
exact_sum = pd.Series(0.01 * sums.index.to_numpy(), index=sums.index)
ahead = sums["fp16 accumulator"] - exact_sum
display(Markdown(
    f"The fp16 accumulator stalls at {final['fp16 accumulator']:g} and the bf16 one at {final['bf16 accumulator']:g}: "
    "past those values a step of 0.01 is less than half the gap to the next representable number and rounds away. "
    + (f"Before it stalls, the fp16 sum runs *ahead* of the exact one, by up to {ahead.max():.2f} (after "
       f"{ahead.idxmax():,} terms): just below the stall, the gap between neighbours lies between 0.01 and 0.02, so "
       "each addition of 0.01 rounds up to a whole gap. " if ahead.max() > 0.05 else "")
    + f"`torch.sum` over the same fp16 values gives {final['torch.sum of fp16 values']:g}"
    + (", right to fp16's precision, because it accumulates in fp32." if abs(final["torch.sum of fp16 values"] - 100) < 0.5
       else ", not 100: this build does not accumulate fp16 sums in fp32.")
))

# %% [markdown]
# Matrix multiplications on tensor cores accumulate in fp32 too: 16-bit inputs, fp32 accumulation. Mostly: PyTorch
# also lets cuBLAS round the partial sums of a product that it splits across thread blocks to 16 bits
# (`torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction` and its fp16 twin, both on by default),
# and whether a kernel does so depends on the shape. So we measure it, against an fp64 reference: for
# each format, the error of the product computed in that format, and the error of an exact product of the
# same inputs rounded to that format. If the two agree, the whole error comes from rounding the inputs.

# %%
torch.manual_seed(0)
n = prof.pick(tiny=256, full=4096)
A64 = torch.randn(n, n, dtype=torch.float64, device=prof.device)
B64 = torch.randn(n, n, dtype=torch.float64, device=prof.device)
C64 = A64 @ B64
cap = gpus.capability()  # None on a CPU
modes = [("fp32", torch.float32, False), ("fp16", torch.float16, False)]
if cap is None or cap.bf16:
    modes.insert(1, ("bf16", torch.bfloat16, False))
else:
    print(f"bf16 skipped: the {cap.name} (compute capability {cap.major}.{cap.minor}) has no bf16 tensor cores")
if cap is None:
    print("tf32 skipped on CPU: TF32 is a tensor-core mode of NVIDIA GPUs")
elif cap.tf32:
    modes.insert(1, ("tf32", torch.float32, True))
else:
    print(f"tf32 skipped: TF32 needs compute capability 8.0; the {cap.name} has {cap.major}.{cap.minor}")


def round_to_tf32(x):
    """fp32 -> the nearest value with a 10-bit mantissa (what TF32 tensor cores read), kept as fp32."""
    bits = x.view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


matmul_err = {}
for name, dt, tf32 in modes:
    torch.backends.cuda.matmul.allow_tf32 = tf32
    A, B = A64.to(dt), B64.to(dt)
    C = (A @ B).to(torch.float64)
    rounded = (round_to_tf32(A), round_to_tf32(B)) if tf32 else (A, B)
    inputs_only = rounded[0].to(torch.float64) @ rounded[1].to(torch.float64)
    matmul_err[name] = {
        "relative error of the product": ((C - C64).norm() / C64.norm()).item(),
        "from rounding the inputs alone": ((inputs_only - C64).norm() / C64.norm()).item(),
    }
torch.backends.cuda.matmul.allow_tf32 = False
matmul_err = pd.DataFrame(matmul_err).T
cleanup.free(globals(), "A64", "B64", "C64", "A", "B", "C", "inputs_only", "rounded")
matmul_err

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (2.2 Range and precision, failing in front of you)
if prof.on_gpu:
    err = matmul_err["relative error of the product"]
    low = [k for k in ("tf32", "fp16", "bf16") if k in err.index]
    near_inputs = all(err[k] < 3 * matmul_err.loc[k, "from rounding the inputs alone"] for k in low)
    display(Markdown(
        f"For a {n:,} x {n:,} product on this GPU, "
        + ", ".join(f"{k} is off by {err[k]:.1e}" for k in low) + ". "
        + ("That is within a factor of 3 of the error of rounding their inputs to $m$ mantissa bits (at most "
           "$2^{-(m+1)}$ per element), "
           "plus, for fp16 and bf16, rounding the output back to 16 bits: accumulating "
           f"{n:,} products adds little, because it happens in fp32. " if near_inputs else
           "At least one of them is well above the error of rounding its inputs: its accumulation adds error. ")
        + f"In fp32 the picture reverses: rounding the inputs costs only "
        f"{matmul_err.loc['fp32', 'from rounding the inputs alone']:.1e}, and the {err['fp32']:.1e} that remain are "
        "the accumulation itself, in fp32 arithmetic."
    ))
else:
    print("skipped on CPU: a CPU's matrix products accumulate differently from a GPU's tensor cores")

# %% [markdown]
# ## 2.3 Model size by data type
#
# Size is parameters times bytes. A popular shortcut: a 7B model in 16 bits is "7 x 2 = 14 GB". We build
# each registry model on PyTorch's `meta` device (structure without memory) in each dtype, and count the bytes
# its parameters would take. Two more models sold as "7B" join them, built the same way from the values of
# their published `config.json` (typed here; nothing is downloaded): Mistral-7B-v0.1 (grouped-query
# attention, a wider MLP) and Gemma-7B (a 256,000-token vocabulary, head dimension 256). int8 and 4-bit
# columns are the ideal 1 and 0.5 bytes per parameter; section 2.5 measures the real thing.

# %%
MORE_7B = {  # from the models' config.json on the Hugging Face hub
    "Mistral-7B-v0.1": MistralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
    "gemma-7b": GemmaConfig(vocab_size=256000, hidden_size=3072, intermediate_size=24576, num_hidden_layers=28,
                            num_attention_heads=16, num_key_value_heads=16, head_dim=256, tie_word_embeddings=True),
}


def meta_model_of(name, dt):
    if name in MORE_7B:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(MORE_7B[name], dtype=dt)
    head = "causal-lm" if "causal-lm" in models.spec(name).heads else "sequence-classification"
    return models.build(name, profile="full", head=head, dtype=dt, device="meta")


size_rows = {}
for name in [*models.REGISTRY, *MORE_7B]:
    row = {}
    for label, dt in [("fp32", torch.float32), ("bf16", torch.bfloat16)]:
        meta_model = meta_model_of(name, dt)
        row["parameters (B)"] = models.n_params(meta_model) / 1e9
        row[f"{label} (GiB)"] = accounting.param_bytes(meta_model) / GIB
    row["int8, ideal (GiB)"] = row["parameters (B)"] * 1e9 / GIB
    row["4-bit, ideal (GiB)"] = row["parameters (B)"] * 0.5e9 / GIB
    row["bf16 (GB = 1e9 B)"] = row["bf16 (GiB)"] * GIB / 1e9
    size_rows[name] = row
del meta_model
sizes = pd.DataFrame(size_rows).T
sizes

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (2.3 Model size by data type)
seven = sizes.loc[["llama-2-7b", *MORE_7B]]
over = seven[seven["bf16 (GB = 1e9 B)"] > 14]
under = seven[seven["bf16 (GB = 1e9 B)"] <= 14]


def fmt(frame):
    return ", ".join(f"{k} ({r['parameters (B)']:.2f} B parameters, {r['bf16 (GB = 1e9 B)']:.1f} GB)"
                     for k, r in frame.iterrows())


text = (f"The Llama-2-7B shape has {sizes.loc['llama-2-7b', 'parameters (B)']:.2f} billion parameters: "
        f"{sizes.loc['llama-2-7b', 'bf16 (GB = 1e9 B)']:.1f} GB in bf16, or {sizes.loc['llama-2-7b', 'bf16 (GiB)']:.2f} "
        "GiB, the unit a GPU's memory is really sold in. ")
if len(over):
    text += (f"The \"7 x 2 = 14 GB\" rule holds for {fmt(under) if len(under) else 'none of them'}, but not for "
             f"{fmt(over)}: a model's name rounds its parameter count, sometimes down. Count the parameters (or "
             "read them off the model card) instead of trusting the name.")
else:
    text += "All three \"7B\" models stay under 14 GB in bf16 here, so the rule holds for them."
text += " On the GPU we check one row for real: the 1.3B model built in bf16 occupies exactly its parameter bytes."
display(Markdown(text))

# %%
if run_profile.cuda_or_skip("the allocator's numbers exist only on a GPU"):
    before = torch.cuda.memory_allocated()
    bf16_model = models.build("polyglot-ko-1.3b", head="causal-lm", dtype=torch.bfloat16)
    built_gib = (torch.cuda.memory_allocated() - before) / GIB
    print(f"allocated by the bf16 model: {built_gib:.3f} GiB; table: {sizes.loc['polyglot-ko-1.3b', 'bf16 (GiB)']:.3f} GiB")
    assert abs(built_gib - sizes.loc["polyglot-ko-1.3b", "bf16 (GiB)"]) < 0.01, "the allocator disagrees with the count"
    cleanup.free(globals(), "bf16_model")


# %% [markdown]
# ## 2.4 Quantization by hand
#
# Quantization maps each number to one of a few integer codes plus a little metadata (a scale), and back.
# The four schemes of the Korean LLM book's chapter 5, written out. Each function returns what would be stored; each
# `dequantize` rebuilds an approximation. All of them are a few lines of PyTorch.

# %%
def absmax_quantize(x):
    """Symmetric int8: one scale for the whole tensor, the largest |x| maps to 127."""
    scale = x.abs().max() / 127
    return torch.round(x / scale).clamp(-127, 127).to(torch.int8), scale


def absmax_dequantize(q, scale):
    return q.float() * scale


def zeropoint_quantize(x):
    """Asymmetric int8: [min, max] maps onto all 256 codes [-128, 127] via a scale and a zero point."""
    scale = (x.max() - x.min()) / 255
    zero = torch.round(-128 - x.min() / scale)
    return torch.round(x / scale + zero).clamp(-128, 127).to(torch.int8), scale, zero


def zeropoint_dequantize(q, scale, zero):
    return (q.float() - zero) * scale


def blockwise_quantize(x, block=64):
    """Absmax per block of ``block`` consecutive values: an outlier only spoils its own block."""
    flat = x.flatten()
    blocks = F.pad(flat, (0, (-flat.numel()) % block)).view(-1, block)
    scale = (blocks.abs().amax(dim=1, keepdim=True) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.round(blocks / scale).clamp(-127, 127).to(torch.int8), scale


def blockwise_dequantize(q, scale, like):
    return (q.float() * scale).flatten()[: like.numel()].view(like.shape)


def quantile_quantize(x, n_codes=256):
    """Equal-population bins: code k holds the k-th 1/256 of the sorted values, stored as their mean."""
    flat = x.flatten()
    order = flat.argsort()  # the expensive part: a full sort
    codes = torch.empty_like(order)
    codes[order] = torch.arange(flat.numel()) * n_codes // flat.numel()
    table = torch.zeros(n_codes).scatter_reduce_(0, codes, flat, "mean", include_self=False)
    return (codes - n_codes // 2).to(torch.int8).view(x.shape), table


def quantile_dequantize(q, table):
    return table[q.long() + len(table) // 2]


# %% [markdown]
# A fixed small array through each scheme (checked by CI against this output). Note how one large value
# (10.0) sets the absmax scale and squeezes everything else into a few codes, and how blocks of 3 keep it in
# its own block.

# %%
# NBVAL_CHECK_OUTPUT
x_demo = torch.tensor([-1.5, -0.2, 0.0, 0.3, 2.0, 10.0])
q_abs, s_abs = absmax_quantize(x_demo)
q_zp, s_zp, z_zp = zeropoint_quantize(x_demo)
q_blk, s_blk = blockwise_quantize(x_demo, block=3)
demo = pd.DataFrame({
    "x": x_demo,
    "absmax code": q_abs, "absmax x'": absmax_dequantize(q_abs, s_abs),
    "zero-point code": q_zp, "zero-point x'": zeropoint_dequantize(q_zp, s_zp, z_zp),
    "block-3 code": q_blk.flatten(), "block-3 x'": blockwise_dequantize(q_blk, s_blk, x_demo),
})
print(demo.map(lambda v: f"{v:.4f}" if isinstance(v, float) else v).to_string())

# %% [markdown]
# Now the errors, on three kinds of data of about a million values each: (a) standard normal, (b) the same with
# 0.1 % outliers of magnitude 50 (LLM [activations](https://gpu-efficient-training.github.io/book/book/glossary.html#activations) and some weights have such features), (c) a weight matrix of
# our 1.3B GPT-NeoX (its MLP input projection; the weights are freshly initialised, normal with standard
# deviation 0.02, so (c) behaves like (a): trained weights have heavier tails). For each scheme: mean squared
# error, worst error, how many of the 256 codes are used, and the storage per value including the metadata.

# %%
gen = torch.Generator().manual_seed(0)
normal = torch.randn(1 << 20, generator=gen)
outliers = normal.clone()
where = torch.randperm(normal.numel(), generator=gen)[: normal.numel() // 1000]
outliers[where] = 50.0 * torch.sign(torch.randn(where.numel(), generator=gen))
weight = models.build("polyglot-ko-1.3b", head="causal-lm", num_hidden_layers=1, device="cpu").gpt_neox.layers[0].mlp.dense_h_to_4h.weight.detach()
weight = weight.flatten()[: 1 << 20].clone()
datasets = {"(a) normal": normal, "(b) normal + outliers": outliers, "(c) model weight": weight}


def run_schemes(x):
    """Quantize -> dequantize ``x`` with every scheme; return the codes and the reconstruction of each."""
    q, s = absmax_quantize(x)
    out = {"absmax": (q, absmax_dequantize(q, s), 1 + 4 / x.numel())}
    q, s, z = zeropoint_quantize(x)
    out["zero-point"] = (q, zeropoint_dequantize(q, s, z), 1 + 8 / x.numel())
    q, s = blockwise_quantize(x, 64)
    out["block-wise, 64"] = (q, blockwise_dequantize(q, s, x), 1 + 4 / 64)
    q, t = quantile_quantize(x)
    out["quantile"] = (q, quantile_dequantize(q, t), 1 + 4 * 256 / x.numel())
    return out


err_rows, codes_seen = [], {}
for data_name, x in datasets.items():
    for scheme, (q, x_hat, bytes_per_value) in run_schemes(x).items():
        err = (x_hat - x).abs()
        err_rows.append({"data": data_name, "scheme": scheme, "MSE": (err**2).mean().item(),
                         "max error": err.max().item(), "codes used (of 256)": q.unique().numel(),
                         "bytes per value": bytes_per_value})
        codes_seen[(data_name, scheme)] = q
errors = pd.DataFrame(err_rows).set_index(["data", "scheme"])
errors

# %% [markdown]
# And what each costs to compute, timed on the CPU (where these tensors live) for the normal data, with
# `timing.time_it` (chapter 8): a warm-up call, then ten timed calls, the median with its interquartile range.
# The one comparison the text draws, quantile against absmax, is timed with `timing.interleaved` (chapter 8):
# the two run in alternating rounds, and the median of the per-round ratios comes with a 95% interval:

# %%
quantizers = {"absmax": absmax_quantize, "zero-point": zeropoint_quantize, "block-wise, 64": blockwise_quantize,
              "quantile": quantile_quantize}
quantize_t = {name: timing.time_it(lambda f=f: f(normal), device="cpu", warmup=1, repeat=10)
              for name, f in quantizers.items()}
quantize_ms = pd.DataFrame({name: {"median (ms)": t.wall.median * 1e3, "IQR (ms)": t.wall.iqr * 1e3}
                            for name, t in quantize_t.items()}).T.rename_axis("quantize 2**20 values, CPU")
quantile_vs_absmax = timing.interleaved(lambda: absmax_quantize(normal), lambda: quantile_quantize(normal),
                                        device="cpu", names=("absmax", "quantile"), warmup=1)
quantize_ms

# %% [markdown]
# Each scheme's promise, as assertions that fail if the code is wrong: absmax and block-wise absmax are never
# off by more than half a step of their scale (plus float32 rounding, allowed as 1/10,000 of a step);
# zero-point likewise inside its range. Quantile quantization uses every code, but that holds by
# construction (each code is given 1/256 of the sorted values), so that line checks the code, not the data.
# Two lessons are checked on the data, and either could fail on other data: with outliers, block-wise
# quantization is far more accurate than one scale for the whole tensor; and on normal data, using every code
# does not make quantile bins more accurate than absmax.

# %%
x = outliers
q, s = absmax_quantize(x)
assert (absmax_dequantize(q, s) - x).abs().max() <= s * (0.5 + 1e-4)  # half a step, plus float rounding
q, s, z = zeropoint_quantize(x)
assert (zeropoint_dequantize(q, s, z) - x).abs().max() <= s * (0.5 + 1e-4)
q, s = blockwise_quantize(x, 64)
per_block_err = (blockwise_dequantize(q, s, x) - x).abs().flatten()
per_block_err = F.pad(per_block_err, (0, (-x.numel()) % 64)).view(-1, 64).amax(dim=1)
assert (per_block_err <= s.squeeze(1) * (0.5 + 1e-4)).all()
assert errors.loc[("(b) normal + outliers", "quantile"), "codes used (of 256)"] == 256  # by construction
mse = errors["MSE"]
assert mse[("(b) normal + outliers", "block-wise, 64")] < mse[("(b) normal + outliers", "absmax")] / 10
assert mse[("(a) normal", "quantile")] > mse[("(a) normal", "absmax")]
print("all quantizer checks passed")

# %% [markdown]
# The codes each scheme actually uses, as histograms (log scale): the Korean LLM book's "wasted codes"
# argument, counted.

# %%
fig, axes = plt.subplots(1, 4, figsize=(12, 3), sharey=True)
for ax, (data_name, scheme) in zip(axes, [("(a) normal", "absmax"), ("(b) normal + outliers", "absmax"),
                                          ("(b) normal + outliers", "block-wise, 64"),
                                          ("(b) normal + outliers", "quantile")], strict=True):
    ax.hist(codes_seen[(data_name, scheme)].flatten().float().numpy(), bins=256, range=(-128, 128), log=True)
    ax.set_title(f"{scheme}\n{data_name}", fontsize=9)
    ax.set_xlabel("int8 code")
axes[0].set_ylabel("values per code")
codes_used = errors["codes used (of 256)"]
fig.suptitle(f"Codes used of 256: absmax {codes_used[('(a) normal', 'absmax')]} on normal data, "
             f"{codes_used[('(b) normal + outliers', 'absmax')]} with outliers; with outliers, blocks of 64 use "
             f"{codes_used[('(b) normal + outliers', 'block-wise, 64')]}, quantiles "
             f"{codes_used[('(b) normal + outliers', 'quantile')]}", y=1.02, fontsize=10)
fig.tight_layout()

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (2.4 Quantization by hand)
mse_normal = mse.xs("(a) normal", level="data")
rank = int((mse_normal < mse_normal["quantile"]).sum())  # how many schemes beat quantile on normal data
worst = "the *worst* of the four" if rank == 3 else f"worse than {rank} of the other three"


def times(x):
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def times_as_long(c):
    """'took 758 times as long as absmax (95% interval 700–800 times, 15 interleaved rounds)': b against a."""
    if c.verdict != "slower":
        return f"took about as long as {c.a_name} ({c.phrase()})"
    return (f"took {times(1 / c.speedup)} times as long as {c.a_name} (95% interval {times(1 / c.hi)}–"
            f"{times(1 / c.lo)} times, {c.rounds} interleaved rounds)")


display(Markdown(
    f"On normal data absmax uses {codes_used[('(a) normal', 'absmax')]} of the 256 codes: the largest of a million "
    "normal values sits near 5 standard deviations, so most values crowd the middle codes. With outliers it uses only "
    f"{codes_used[('(b) normal + outliers', 'absmax')]}: one value of 50 sets the scale, and the normal bulk collapses "
    "into a handful of codes around zero. Block-wise quantization with blocks of 64 uses "
    f"{codes_used[('(b) normal + outliers', 'block-wise, 64')]} codes and cuts the mean squared error by a factor of "
    f"{mse[('(b) normal + outliers', 'absmax')] / mse[('(b) normal + outliers', 'block-wise, 64')]:,.0f}, for 4 extra "
    "bytes per 64 values.\n\n"
    f"Quantile quantization uses every code, and yet its error is {worst}: on normal data its mean squared error is "
    f"{mse_normal['quantile']:.1e} against absmax's {mse_normal['absmax']:.1e}. Equal-population bins are narrow "
    "where the data is dense and very wide in the tails, and a bin reconstructs all its values as one number. With "
    "outliers the top and bottom bins mix the values of 50 with the largest normal values, and both are "
    f"reconstructed badly (worst error {errors.loc[('(b) normal + outliers', 'quantile'), 'max error']:.1f}). Using "
    "every code is not the same as using them well: the argument counts codes, the error counts distances. "
    f"Quantile quantization also {times_as_long(quantile_vs_absmax)} here (a full sort) and stores a 256-entry "
    "table per tensor. NF4, "
    "below, keeps the good half of the idea: fixed levels at the quantiles of a *normal* distribution, combined "
    "with block-wise absmax scaling.\n\n"
    "How large should the blocks be? Smaller blocks isolate outliers better but store more scales:"
))

# %%
block_rows = []
for block in [16, 32, 64, 128, 256, 1024, 4096, 1 << 16, outliers.numel()]:
    q, s = blockwise_quantize(outliers, block)
    block_rows.append({"block": block, "MSE": ((blockwise_dequantize(q, s, outliers) - outliers) ** 2).mean().item(),
                       "metadata bytes per value": 4 / block})
blocks = pd.DataFrame(block_rows)
fig, ax = plt.subplots()
ax.plot(blocks.block, blocks.MSE, "o-", label="MSE (left axis)")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("block size (values per scale)")
ax.set_ylabel("mean squared error")
ax2 = ax.twinx()
ax2.plot(blocks.block, blocks["metadata bytes per value"], "s--", color="grey", label="scale bytes per value (right axis)")
ax2.set_yscale("log")
ax2.set_ylabel("bytes of scales per value")
ax2.grid(False)
fig.legend(loc="lower center", ncols=2, bbox_to_anchor=(0.5, 0.0))
smallest, whole_tensor = blocks.iloc[0], blocks.iloc[-1]
ax.set_title(f"Outlier data: blocks of {smallest.block:,} cut the MSE {whole_tensor.MSE / smallest.MSE:,.0f}x against one "
             f"scale,\nfor {smallest['metadata bytes per value']:.2f} bytes of scales per value", fontsize=10)
fig.tight_layout(rect=(0, 0.08, 1, 1))
blocks

# %% [markdown]
# bitsandbytes uses blocks of 64 for 4-bit weights and 256 for 8-bit [optimizer states](https://gpu-efficient-training.github.io/book/book/glossary.html#optimizer-states): a few percent
# of metadata for most of the accuracy. The last point of the plot is one block for the whole tensor, plain
# absmax.
#
# ## 2.5 The production versions: bitsandbytes
#
# **LLM.int8()** ([Dettmers et al. (2022)](https://gpu-efficient-training.github.io/book/book/references.html), *LLM.int8()*) stores weights in int8 with one absmax
# scale per output row and, at run time, splits the input: the few feature columns with values above a
# threshold (6.0 by default) are multiplied in 16 bits, the rest in int8 with per-token scales. **NF4**
# ([Dettmers et al. (2023)](https://gpu-efficient-training.github.io/book/book/references.html)) stores 4-bit codes whose 16 levels are quantiles of a
# normal distribution (so they suit normally distributed weights), with an fp32 absmax per block of 64;
# **double quantization** quantizes those absmax values themselves to 8 bits, in blocks of 256. **FP4** is a
# 4-bit floating-point format: its 16 codes are a sign, exponent and mantissa grid like every float's, spaced by
# powers of two rather than by the shape of a normal distribution. With so few bits that grid is *not* dense near
# zero, as the printed levels show. Both level sets, as bitsandbytes stores them (scaled to $[-1, 1]$):

# %%
# NBVAL_CHECK_OUTPUT
import bitsandbytes.functional as bnb_f

levels = pd.DataFrame({kind: sorted(bnb_f.get_4bit_type(kind, device="cpu").tolist()) for kind in ("nf4", "fp4")})
print(levels.T.to_string(float_format="{:.4f}".format, header=False))  # text: identical on every machine

# %% [markdown]
# The same levels on a number line, and the share of a normally distributed block of 64 weights (divided by the
# block's absmax, as bitsandbytes does) that falls where FP4 has no level:

# %%
fp4_positive = sorted({v for v in levels["fp4"] if v > 0})
hole = (fp4_positive[0], fp4_positive[1])  # FP4's smallest positive level and the next one
normal_blocks = torch.randn(4096, 64, generator=torch.Generator().manual_seed(0))
scaled = (normal_blocks / normal_blocks.abs().amax(dim=1, keepdim=True)).abs()
in_hole = ((scaled > hole[0]) & (scaled < hole[1])).float().mean().item()
fig, ax = plt.subplots(figsize=(9, 2.4))
for y, kind in ((1, "nf4"), (0, "fp4")):
    ax.plot(levels[kind], [y] * len(levels), "|", ms=22, mew=2, label=kind.upper())
for sign in (1, -1):
    ax.axvspan(sign * hole[0], sign * hole[1], color="grey", alpha=0.25, lw=0)
ax.set_yticks([0, 1], ["FP4", "NF4"])
ax.set_ylim(-0.7, 1.7)
ax.set_xlabel("level (scaled to [-1, 1])")
ax.set_title(f"16 codes each. FP4 has no level between ±{hole[0]:.4f} and ±{hole[1]:.4f} (shaded);\n"
             f"{in_hole:.0%} of a normal block's scaled weights fall there", fontsize=10)
fig.tight_layout()

# %% [markdown]
# The grids differ most where most weights are, near zero. NF4 has seven or eight levels on each side of zero, with gaps
# that grow smoothly towards the tails, following the normal distribution. FP4 spends a code on one tiny value
# next to zero (±0.0052) and then leaves a hole up to its next level (±0.1667), about as wide as its gaps around
# ±0.5; apart from that first tiny step, its finest spacing (from ±0.1667 through ±0.2500 to ±0.3333) lies further
# out, where fewer weights are (bitsandbytes' FP4 also has a positive and a negative zero, so it has only 15
# distinct values). Every weight in the hole is rounded to almost zero or to the hole's
# edge: that, more than the powers of two, is why FP4 should lose to NF4 on normal weights. We build each format from the same
# 16-bit weight matrix at a realistic shape (bf16, or fp16 on a GPU below compute capability 8.0), and compare
# storage, output error against the 16-bit layer, and speed.

# %%
amp = gpus.amp_dtype()
REF = {torch.bfloat16: "bf16", torch.float16: "fp16"}[amp]
d_in = d_out = prof.pick(tiny=256, full=4096)
tokens = prof.pick(tiny=64, full=4096)
torch.manual_seed(0)
reference = torch.nn.Linear(d_in, d_out, bias=False, dtype=amp)
x_in = torch.randn(tokens, d_in, dtype=amp, device=prof.device)


def int8_layer(threshold):
    layer = bnb.nn.Linear8bitLt(d_in, d_out, bias=False, has_fp16_weights=False, threshold=threshold)
    layer.load_state_dict(reference.state_dict())
    return layer.to(prof.device)  # quantized on the move to the device


def four_bit_layer(quant_type, double_quant):
    layer = bnb.nn.Linear4bit(d_in, d_out, bias=False, compute_dtype=amp, quant_type=quant_type,
                              compress_statistics=double_quant)
    layer.weight = bnb.nn.Params4bit(reference.weight.data.clone(), requires_grad=False, quant_type=quant_type,
                                     compress_statistics=double_quant)
    return layer.to(prof.device)


SCALED = ("weight", "weight.absmax", "weight.nested_absmax", "SCB")  # entries that grow with the weight


def stored_bytes(layer):
    """What the layer saves: (codes and scales, which grow with the weight; fixed-size tables and state)."""
    entries = {k: t.numel() * t.element_size() for k, t in layer.state_dict().items() if torch.is_tensor(t)}
    return (sum(v for k, v in entries.items() if k in SCALED), sum(v for k, v in entries.items() if k not in SCALED))


layers = {
    REF: reference.to(prof.device),
    "LLM.int8(), threshold 6": int8_layer(6.0),
    "NF4": four_bit_layer("nf4", False),
    "NF4 + double quant": four_bit_layer("nf4", True),
    "FP4": four_bit_layer("fp4", False),
}
with torch.no_grad():
    y_ref = layers[REF](x_in).float()
    layer_rows = {}
    for name, layer in layers.items():
        y = layer(x_in).float()
        scaled, fixed = stored_bytes(layer)
        layer_rows[name] = {"bits per weight (codes + scales)": 8 * scaled / (d_in * d_out),
                            "fixed tables (bytes)": fixed,
                            "relative output error": ((y - y_ref).norm() / y_ref.norm()).item()}
del y
layer_table = pd.DataFrame(layer_rows).T
layer_table

# %% [markdown]
# Storage matches the papers' accounting: int8 is one byte plus an fp32 scale per row; NF4 is half a byte plus
# an fp32 absmax per 64 weights, $32/64 = 0.5$ extra bits per weight, which double quantization brings down to
# $8/64 + 32/(64 \cdot 256) \approx 0.127$ bits, the [QLoRA](https://gpu-efficient-training.github.io/book/book/glossary.html#qlora) paper's number. On top come a few fixed tables per
# tensor (NF4's 16 levels, the 256-entry map of the double quantization, the serialized state): bytes, not
# bits per weight. We assert the per-weight parts, measured from what each layer's `state_dict` holds:

# %%
bits = layer_table["bits per weight (codes + scales)"]
assert abs(bits["NF4"] - (4 + 32 / 64)) < 1e-3, bits["NF4"]
assert abs(bits["NF4 + double quant"] - (4 + 8 / 64 + 32 / (64 * 256))) < 1e-3, bits["NF4 + double quant"]
assert abs(bits["LLM.int8(), threshold 6"] - (8 + 32 / d_in)) < 1e-3, bits["LLM.int8(), threshold 6"]
print("storage matches the formulas")

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (2.5 The production versions)
err = layer_table["relative output error"]
display(Markdown(
    f"The relative output error against the {REF} layer is {err['LLM.int8(), threshold 6']:.4f} for LLM.int8(), "
    f"{err['NF4']:.3f} for NF4 and {err['FP4']:.3f} for FP4 on these normally distributed weights"
    + (": with the same 16 codes, levels placed at a normal distribution's quantiles beat a floating-point grid, "
       "as the QLoRA paper argues." if err["NF4"] < err["FP4"] else
       ": here FP4's floating-point grid did as well as NF4's normal quantiles or better.")
))

# %% [markdown]
# LLM.int8()'s threshold matters when the *input* has outlier features. We give 4 of the input's features a
# magnitude of 20 (as large models develop) and compare the threshold 6.0 (outlier columns in 16 bits) with
# threshold 0 (everything in int8):

# %%
x_out = x_in.clone()
x_out[:, :4] *= 20
with torch.no_grad():
    y_ref_out = layers[REF](x_out).float()
    outlier_err = {f"threshold {t}": ((int8_layer(t)(x_out).float() - y_ref_out).norm() / y_ref_out.norm()).item()
                   for t in (0.0, 6.0)}
pd.Series(outlier_err, name="relative output error with outlier features")

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (2.5 The production versions)
t0, t6 = outlier_err["threshold 0.0"], outlier_err["threshold 6.0"]
if t0 > 1.5 * t6:
    display(Markdown(
        f"With every feature in int8 (threshold 0) the outliers stretch the per-token scales and the error grows to "
        f"{t0:.3f}; with the default threshold the four outlier columns go through a 16-bit product and the error "
        f"stays at {t6:.4f}."))
else:
    display(Markdown(
        f"Here the two thresholds give nearly the same error ({t0:.3f} and {t6:.3f})"
        + (": on a CPU, bitsandbytes' int8 path does not decompose the outlier columns." if not prof.on_gpu else
           ": this bitsandbytes did not route the outlier columns differently.")))

# %% [markdown]
# Speed is the other side of the bargain. On a GPU we time a forward pass of each layer at this shape against
# the 16-bit layer with `timing.interleaved` (chapter 8): the two layers run in alternating rounds, each sample
# ten calls back to back (as a model's layers run, so the GPU stays busy and the time is the kernels' own),
# and the speed-up is the median of the per-round ratios with its 95% interval. A layer counts as faster or
# slower only when the whole interval lies beyond ±3%:

# %%
if run_profile.cuda_or_skip("kernel timings are only meaningful on the GPU"):
    with torch.no_grad():
        vs_ref = {name: timing.interleaved(lambda: layers[REF](x_in), lambda layer=layer: layer(x_in), device="cuda",
                                           names=(REF, name), loop=10)
                  for name, layer in layers.items() if name != REF}
    speed = pd.DataFrame({name: c.row() for name, c in vs_ref.items()}).T
    display(speed)

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title The quantized layers' time against the 16-bit layer's, from interleaved comparisons
def layer_speed_sentence(cmps, ref, tokens, d_in):
    """The quantized layers' time against the 16-bit layer's, from interleaved comparisons."""
    def said(name):
        c = cmps[name]
        if c.verdict == "slower":
            return (f"{name} takes {1 / c.speedup:.2f} times as long as {ref} (95% interval {1 / c.hi:.2f}–"
                    f"{1 / c.lo:.2f} times, {c.rounds} interleaved rounds)")
        return f"{name} against {ref}: {c.phrase()}"

    base = cmps[next(iter(cmps))].a
    regime = ("so these are the kernels' own costs" if base.verdict == "GPU-bound" else
              "so part of these times is the host's, and a faster CPU would show the kernels' costs more clearly")
    return (f"At {tokens:,} tokens x {d_in:,} features, "
            + "; ".join(said(n) for n in ("LLM.int8(), threshold 6", "NF4") if n in cmps)
            + f". The {ref} product is {base.verdict} ({base.evidence}), {regime}. ")


if prof.on_gpu:
    display(Markdown(
        layer_speed_sentence(vs_ref, REF, tokens, d_in)
        + ("Quantized layers save memory, not time: " if all(c.verdict == "slower" for c in vs_ref.values()) else
           "Quantized layers are not meant to save time: ")
        + "the 4-bit weights are dequantized to 16 bits before a regular "
        "matrix product (for many tokens), and LLM.int8() pays for its outlier decomposition and scaling. Where the "
        "weights are read once per token (generation with a small batch), memory bandwidth dominates and the smaller "
        "weights can win; training and prefill are not that case."
    ))
else:
    print("skipped on CPU: kernel timings are only meaningful on the GPU")

# %% [markdown]
# **A whole model.** The real `from_pretrained` path: we save the 1.3B GPT-NeoX in 16 bits to a local folder
# and load it three ways, in 16 bits, in 8 bits and in 4-bit NF4 with double quantization, through
# transformers' `BitsAndBytesConfig`. For each: memory, bytes per parameter, and how far its logits are from
# the 16-bit model's.

# %%
checkpoint = models.save_checkpoint(models.build("polyglot-ko-1.3b", head="causal-lm", dtype=amp),
                                    tempfile.mkdtemp(prefix="ckpt_polyglot_"))
cleanup.free(globals())
configs = {
    REF: None,
    "int8 (LLM.int8())": BitsAndBytesConfig(load_in_8bit=True),
    "4-bit NF4 + double quant": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                   bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=amp),
}
probe = torch.randint(100, 30000, (2, 128), generator=torch.Generator().manual_seed(1)).to(prof.device)
n_total = models.n_params(models.build("polyglot-ko-1.3b", head="causal-lm", device="meta"))
whole, logits = {}, {}
for name, qconfig in configs.items():
    before = torch.cuda.memory_allocated() if prof.on_gpu else 0
    qmodel = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=amp, quantization_config=qconfig,
                                                  device_map=prof.device)
    row = {"get_memory_footprint (GiB)": qmodel.get_memory_footprint() / GIB}
    if prof.on_gpu:
        row["allocated (GiB)"] = (torch.cuda.memory_allocated() - before) / GIB
    row["bytes per parameter"] = row.get("allocated (GiB)", row["get_memory_footprint (GiB)"]) * GIB / n_total
    with torch.no_grad():
        logits[name] = qmodel(probe).logits.float().cpu()
    whole[name] = row
    del qmodel
    cleanup.free(globals())
whole = pd.DataFrame(whole).T
for name in configs:
    whole.loc[name, f"logits: relative difference from {REF}"] = ((logits[name] - logits[REF]).norm() / logits[REF].norm()).item()
    whole.loc[name, f"same top-1 token as {REF}"] = (logits[name].argmax(-1) == logits[REF].argmax(-1)).float().mean().item()
whole

# %% [markdown]
# Not every parameter is quantized. bitsandbytes replaces only `nn.Linear` layers, so the embeddings and the layer
# norms stay in 16 bits; and transformers leaves the output head out of the replacement too (it is a linear
# layer, but transformers keeps a causal LM's head unquantized for numerical stability, and
# `llm_int8_skip_modules` lets you choose). So the expected size is
# the linear layers' weights at 1 or ~0.52 bytes plus the rest at 2 bytes:

# %%
meta = models.build("polyglot-ko-1.3b", head="causal-lm", device="meta")
head = meta.get_output_embeddings()
linear_params = sum(m.weight.numel() for m in meta.modules() if isinstance(m, torch.nn.Linear) and m is not head)
other_params = models.n_params(meta) - linear_params
nf4_dq_bytes = (4 + 8 / 64 + 32 / (64 * 256)) / 8
expected = {
    REF: (linear_params + other_params) * 2,
    "int8 (LLM.int8())": linear_params * 1 + other_params * 2,
    "4-bit NF4 + double quant": linear_params * nf4_dq_bytes + other_params * 2,
}
whole["expected (GiB)"] = pd.Series(expected) / GIB
linear_share = linear_params / models.n_params(meta)
del meta, head
whole[[c for c in ["allocated (GiB)", "expected (GiB)", "get_memory_footprint (GiB)", "bytes per parameter"] if c in whole]]

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (2.5 The production versions)
if prof.is_full and prof.on_gpu:
    nf4, int8 = whole.loc["4-bit NF4 + double quant"], whole.loc["int8 (LLM.int8())"]
    as_expected = all(abs(whole.loc[k, "allocated (GiB)"] - whole.loc[k, "expected (GiB)"]) < 0.05 * whole.loc[k, "expected (GiB)"]
                      for k in whole.index)
    footprint_txt = (
        f"One trap: transformers' `get_memory_footprint()` reports {nf4['get_memory_footprint (GiB)']:.3f} GiB for the "
        f"4-bit model, less than the {nf4['allocated (GiB)']:.3f} GiB it occupies, because it adds up parameters and "
        "buffers and the 4-bit layers keep their block statistics (absmax values) outside both. "
        if nf4["get_memory_footprint (GiB)"] < nf4["allocated (GiB)"] - 0.005 else
        f"transformers' `get_memory_footprint()` agrees with the allocator for the 4-bit model "
        f"({nf4['get_memory_footprint (GiB)']:.3f} GiB). ")
    display(Markdown(
        f"Measured by the allocator, the model shrinks from {whole.loc[REF, 'allocated (GiB)']:.2f} GiB to "
        f"{int8['allocated (GiB)']:.2f} GiB in 8 bits and {nf4['allocated (GiB)']:.2f} GiB in 4 bits, "
        + ("as predicted: " if as_expected else "not quite as predicted (see the expected column): ")
        + f"{int8['bytes per parameter']:.2f} and {nf4['bytes per parameter']:.2f} bytes per parameter, not the ideal 1 "
        f"and 0.5, because only {linear_share:.0%} of this model's parameters sit in quantized linear layers; its two "
        "30,080 x 2048 embedding matrices stay in 16 bits. Larger models have a larger linear share and get closer to "
        f"the ideal. {footprint_txt}The logits move by {int8[f'logits: relative difference from {REF}']:.3f} (8-bit) "
        f"and {nf4[f'logits: relative difference from {REF}']:.3f} (4-bit) relative to {REF}. These weights are random, "
        "so these numbers say how much noise each format adds, not how a trained model's quality changes; the QLoRA "
        "paper measures that on real models."
    ))
else:
    print("skipped on CPU: bitsandbytes' quantized layers store and compute differently on a CPU; the allocator's "
          "numbers need a GPU")

# %% [markdown]
# ## 2.6 A preview: 8-bit optimizer states
#
# The same block-wise idea shrinks AdamW's two states ([Dettmers et al. (2022)](https://gpu-efficient-training.github.io/book/book/references.html), *8-bit Optimizers via Block-wise Quantization*):
# bitsandbytes' `AdamW8bit` keeps them as uint8 codes with a dynamic quantization map and a scale per block of
# 256 values (tensors under 4096 elements keep fp32 states). We count the state bytes after one step on
# bert-large.

# %%
state_bytes = {}
for name, make in [("torch.optim.AdamW", torch.optim.AdamW), ("bnb.optim.AdamW8bit", bnb.optim.AdamW8bit)]:
    model = models.build("bert-large-uncased", head="sequence-classification")
    optimizer = make(model.parameters(), lr=1e-5)
    model(input_ids=ids.to(prof.device), labels=labels).loss.backward()
    optimizer.step()
    state_bytes[name] = accounting.optimizer_state_bytes(optimizer) / models.n_params(model)
    cleanup.free(globals(), "model", "optimizer")
state_bytes = pd.Series(state_bytes, name="optimizer-state bytes per parameter")
state_bytes

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (2.6 A preview)
display(Markdown(
    f"{state_bytes['torch.optim.AdamW']:.2f} bytes per parameter for AdamW's fp32 states, "
    f"{state_bytes['bnb.optim.AdamW8bit']:.2f} for the 8-bit version: the rule's 8 and 2, plus, for the 8-bit one, "
    "the block scales and the small tensors kept in fp32. Chapter 5 measures whether training converges the same way."
))

# %% [markdown]
# ## Summary
#
# - Exponent bits set the range, mantissa bits the precision: fp16 overflows at 65,504 and rounds gradients
#   below $2^{-25} \approx 3 \times 10^{-8}$ (half its smallest positive number) to zero (hence loss scaling); bf16 has fp32's range and a coarse 8-bit
#   significand; sums and matrix products are accumulated in fp32 for that reason (check it where it matters:
#   cuBLAS may round split partial sums to 16 bits).
# - Size = parameters x bytes, and the parameters are worth counting: "7B x 2 = 14 GB" fits Llama-2-7B but not
#   Mistral-7B (7.24 B parameters) or Gemma-7B (8.54 B); and 1 GB (10⁹ bytes) is 7 % less than 1 GiB.
# - Loss scaling protects the gradients an fp16 backward pass computes (activation gradients), which would
#   otherwise underflow to zero.
# - One absmax scale per tensor wastes most int8 codes when there are outliers; block-wise scales fix it for a
#   few percent of metadata; quantile bins use every code, at the price of a sort and not with a lower error.
# - bitsandbytes' NF4 stores 4.5 bits per weight, 4.127 with double quantization; a whole quantized model
#   also keeps embeddings and head in 16 bits. NF4's levels follow a normal distribution; FP4's float grid
#   has a hole next to zero, where many weights are.
#   Quantized layers save memory, not time: section 2.5 measures what they cost on your GPU.
#
# ## Use it in your own script
#
# Inspect a format and load a model in 4 bits with plain transformers and bitsandbytes (a CUDA GPU is needed for
# the quantized load).
#
# ```python
# import torch
# from transformers import AutoModelForCausalLM, BitsAndBytesConfig
#
# print(torch.finfo(torch.float16), torch.finfo(torch.bfloat16), sep="\n")
# nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
#                          bnb_4bit_compute_dtype=torch.bfloat16)
# model = AutoModelForCausalLM.from_pretrained(checkpoint_dir, quantization_config=nf4)
# print(f"{model.get_memory_footprint() / 2**30:.2f} GiB")  # load_in_8bit=True for LLM.int8()
# ```
#
# ## Exercises
#
# Each exercise has a hint and an answer (or the range to expect) behind a click. Where an exercise asks for a
# number, the line under it checks yours without giving the answer away (it says right, close, or what to look at).
#
# 1. In section 2.4 change the outlier magnitude from 50 to 5. By what factor does per-tensor absmax's step
#    shrink? And which scheme's error falls most?
#    `from helpers import exercises; exercises.check("2.1", your_factor)`
#
#    <details><summary>Hint</summary>
#
#    An absmax scale is the largest magnitude divided by 127: the outlier sets the step between codes for every other value, as long as it is the largest value. Then look at what the quantile scheme's end bins hold.
#
#    </details>
#
#    <details><summary>Answer</summary>
#
#    The step shrinks tenfold: the largest of the million normal values stays below 5, so the outliers still set the scale, at a tenth of the size, and absmax's mean squared error, which goes with the step squared, falls about a hundredfold. But all three fall. The quantile scheme falls most, by several hundred times: its end bins no longer average values of 50 with the largest normal values near 4 or 5. Block-wise falls about twentyfold: only the blocks that hold an outlier change, about 6% of them ($1 - 0.999^{64}$).
#
#    </details>
#
# 2. Rerun the block-size sweep with blocks of 8. How many bytes of scales does each value carry then, and is
#    that worth it? `from helpers import exercises; exercises.check("2.2", your_bytes_per_value)`
#
#    <details><summary>Hint</summary>
#
#    Metadata per value is the bytes of one scale divided by the number of values that share it.
#
#    </details>
#
#    <details><summary>Answer</summary>
#
#    The error keeps falling roughly in proportion to the block size, as it does from one row of the sweep to the next, but an fp32 scale per 8 values adds $4/8 = 0.5$ bytes to every 1-byte value (against $4/64 \approx 0.06$ at 64): rarely worth it, which is why bitsandbytes uses blocks of 64 or more.
#
#    </details>
#
# 3. Add fp8 to the matrix-product comparison: round `A64` and `B64` to `torch.float8_e4m3fn` and back to
#    bf16 before multiplying. What relative error of the product do you get?
#    `from helpers import exercises; exercises.check("2.3", your_error)`
#
#    <details><summary>Hint</summary>
#
#    e4m3 keeps 3 mantissa bits: each element's relative rounding error is at most $2^{-4}$, and usually less; in a dot product of thousands of terms the errors partly cancel.
#
#    </details>
#
#    <details><summary>Answer</summary>
#
#    About 4%, between $2^{-5}$ and $2^{-4}$: the product's error is an average of the elements' rounding errors, well below the worst case of one element ($2^{-4}$), and more than ten times the bf16 row, whose 7 mantissa bits are 16 times finer.
#
#    </details>
#
# 4. In section 2.5, give 16 input features the outlier magnitude instead of 4, and compare thresholds 3, 6 and
#    100. First predict: in 4,096 tokens of standard normal inputs, how many values of an ordinary (not outlier)
#    column reach 3? `from helpers import exercises; exercises.check("2.4", your_count)`
#
#    <details><summary>Hint</summary>
#
#    LLM.int8() sends an input column through the 16-bit product if *any* token's value in it reaches the threshold, and quantizes the rest. For a standard normal, $P(|z| \ge 3) = 0.27\%$.
#
#    </details>
#
#    <details><summary>Answer</summary>
#
#    About 11 per column ($4{,}096 \times 0.0027$). So at threshold 3 practically *every* column takes the 16-bit path: the int8 product has almost nothing left to do, the error falls towards what the int8 weights alone cause, and the time rises towards a 16-bit product plus the decomposition's overhead. At 6 (the default) only the 16 outlier columns go to 16 bits ($20 \cdot N(0,1)$ reaches 6 in about three rows of four), and the error stays near the 4-column case, at more 16-bit work. To quantize the outliers you need a threshold above their largest values (one column's largest of 4,096 is typically 70 to 80, the largest of all 16 columns near 90): at 100 nothing is decomposed and the error grows, as it did for threshold 0 with four outlier columns.
#
#    </details>
#
# ## References
#
# - [Kalamkar et al. (2019)](https://gpu-efficient-training.github.io/book/book/references.html): the bf16 format.
# - [Micikevicius et al. (2018)](https://gpu-efficient-training.github.io/book/book/references.html): mixed precision and loss scaling.
# - [Dettmers et al. (2022)](https://gpu-efficient-training.github.io/book/book/references.html), *LLM.int8()*: vector-wise quantization and outlier decomposition.
# - [Dettmers et al. (2023)](https://gpu-efficient-training.github.io/book/book/references.html), *QLoRA*: NF4 and double quantization.
# - [Dettmers et al. (2022)](https://gpu-efficient-training.github.io/book/book/references.html), *8-bit Optimizers via Block-wise Quantization*: 8-bit optimizers.
# - [Heo (2024)](https://gpu-efficient-training.github.io/book/book/references.html), chapter 5 (in Korean): the data types and the four quantization schemes of sections 2.1-2.4.
#
# All of them, with links, are on the [references page](https://gpu-efficient-training.github.io/book/book/references.html).

# %% [markdown]
# The chapter ends where it began: we free what is left on the GPU, release cuBLAS's workspaces (PyTorch keeps
# one per thread that ran a matrix product) and check that allocated memory is back at the baseline taken in
# the setup cell.

# %%
cleanup.free(globals(), "layers", "layer", "reference", "x_in", "x_out", "y_ref", "y_ref_out", "labels", "probe", "logits")
if prof.on_gpu:  # cleanup.back_at_baseline: collect, release cuBLAS's workspaces, compare; LeakError if not back
    display(pd.Series(cleanup.back_at_baseline(baseline_mib)).to_frame("value"))
else:
    print("skipped on CPU: no GPU memory to check")
