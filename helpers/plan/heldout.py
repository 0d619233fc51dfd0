"""The planner's frozen held-out set: setups none of its terms was counted, corrected or fitted on.

Chapter 10, section 10.2 measures these on a GPU with the same code as the in-sample rows
(``helpers.plan.check.measure``) and prints their error *before* the in-sample error. The rules of the set:

- it was written down (committed alone, 2026-11-27) before the planner learned grouped-query attention, a
  ``use_cache`` setting or a reserved-memory margin, and before any of these rows ran on a GPU;
- none of its model families is in ``VALIDATION_SETUPS`` (BERT and GPT-NeoX): Llama-, Mistral- and
  Qwen2-shaped configs, all with grouped-query attention, built from the config (nothing downloaded; the
  7B/8B shapes keep only a few blocks, so that the whole set measures in about a minute and a half on an
  H100);
- it covers what the in-sample rows do not: ``use_cache`` on and off, sequence lengths up to 4096, QLoRA
  through peft's ``prepare_model_for_kbit_training``, 8-bit and paged 8-bit AdamW, Adafactor,
  accumulation, checkpointing, eager attention, pure 16-bit weights, fp16 autocast with a GradScaler, tied
  and untied embeddings, biases in the attention projections (Qwen2);
- do not edit a row to make the planner look better: add a new row (and say so in the chapter) instead.
  ``tests/test_plan_heldout.py`` pins a digest of this data, so an edit is a visible, deliberate act.

``torch.compile`` is not in the set: the planner does not model it (it over-predicts compiled steps by
about 8%, chapter 10, section 10.3), and compiling would cost most of the set's time budget.

Each row: ``name`` (short, unique), ``family`` (the Hugging Face architecture it is shaped after),
``config`` (a key of ``CONFIGS``), ``setup`` (the ``helpers.plan.Setup`` fields besides the model; a
``use_cache`` of None is the model's default, on for a causal LM without checkpointing), ``why`` (what the row
tests).
"""

from __future__ import annotations

# Config fields of real checkpoints' config.json files (the shapes; weights are random), with the layer
# count cut where the real model would not fit the set's time budget.
CONFIGS: dict[str, dict] = {
    # Meta-Llama-3-8B: 32 query heads, 8 key/value heads; 2 of its 32 blocks
    "llama3-8b-shape-2l": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
                               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                               max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                               tie_word_embeddings=False),
    # Llama-3.2-1B: 16 blocks, 32/8 heads, tied embeddings (a 128k vocabulary)
    "llama3.2-1b-shape": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                              num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                              max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                              tie_word_embeddings=True),
    # TinyLlama-1.1B: 22 blocks, 32 query heads, 4 key/value heads, 32k vocabulary
    "tinyllama-1.1b-shape": dict(model_type="llama", hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                                 num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                                 max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False),
    # Mistral-7B-v0.3: 32/8 heads, 32k vocabulary; 4 of its 32 blocks
    "mistral-7b-shape-4l": dict(model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=4,
                                num_attention_heads=32, num_key_value_heads=8, vocab_size=32768,
                                max_position_embeddings=32768, rope_theta=1000000.0, sliding_window=None,
                                rms_norm_eps=1e-5, tie_word_embeddings=False),
    # Qwen2.5-0.5B: 24 blocks, 14 query heads, 2 key/value heads, biases on q/k/v, tied 152k vocabulary
    "qwen2.5-0.5b-shape": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                               num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                               max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                               tie_word_embeddings=True, use_sliding_window=False),
    # Qwen2.5-1.5B: 28 blocks, 12 query heads, 2 key/value heads, tied 152k vocabulary
    "qwen2.5-1.5b-shape": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                               num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                               max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                               tie_word_embeddings=True, use_sliding_window=False),
}

_LLAMA_ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

HELDOUT: list[dict] = [
    # --- Llama-3-8B shape, 2 blocks ----------------------------------------------------------------------
    dict(name="l8b-amp-cache", family="llama", config="llama3-8b-shape-2l",
         setup=dict(batch=2, seq=2048, precision="bf16-autocast", optimizer="adamw-fused", use_cache=None),
         why="GQA 32/8 under autocast with the generation cache on (the model's default)"),
    dict(name="l8b-amp-nocache", family="llama", config="llama3-8b-shape-2l",
         setup=dict(batch=2, seq=2048, precision="bf16-autocast", optimizer="adamw-fused", use_cache=False),
         why="the same with use_cache=False"),
    dict(name="l8b-amp-ckpt-4k", family="llama", config="llama3-8b-shape-2l",
         setup=dict(batch=1, seq=4096, precision="bf16-autocast", optimizer="adamw", checkpointing="full",
                    use_cache=False),
         why="4096 tokens, full checkpointing, multi-tensor AdamW"),
    dict(name="l8b-bf16-8bit", family="llama", config="llama3-8b-shape-2l",
         setup=dict(batch=4, seq=1024, precision="bf16", optimizer="adamw8bit", use_cache=False),
         why="pure bf16 weights with 8-bit AdamW"),
    # --- Llama-3.2-1B shape ------------------------------------------------------------------------------
    dict(name="l1b-amp-nocache", family="llama", config="llama3.2-1b-shape",
         setup=dict(batch=4, seq=1024, precision="bf16-autocast", optimizer="adamw-fused", use_cache=False),
         why="a whole 1B GQA model with tied embeddings, fp32 master weights"),
    dict(name="l1b-paged-ckpt-4k", family="llama", config="llama3.2-1b-shape",
         setup=dict(batch=2, seq=4096, precision="bf16-autocast", optimizer="paged-adamw8bit",
                    checkpointing="full", use_cache=False),
         why="paged 8-bit states (outside the allocator), checkpointing, 4096 tokens"),
    dict(name="l1b-bf16-accum", family="llama", config="llama3.2-1b-shape",
         setup=dict(batch=4, seq=512, precision="bf16", optimizer="adamw", grad_accum=4, use_cache=None),
         why="pure bf16, accumulation over 4 micro-batches, cache on"),
    dict(name="l1b-eager-sgd", family="llama", config="llama3.2-1b-shape",
         setup=dict(batch=2, seq=1024, precision="bf16-autocast", optimizer="sgd-momentum", attention="eager",
                    use_cache=False),
         why="eager attention (s x s scores per query head) with SGD momentum"),
    # --- TinyLlama-1.1B shape ----------------------------------------------------------------------------
    dict(name="tl-adafactor-cache", family="llama", config="tinyllama-1.1b-shape",
         setup=dict(batch=4, seq=2048, precision="bf16-autocast", optimizer="adafactor", use_cache=None),
         why="GQA 32/4, Adafactor, cache on at 2048 tokens"),
    dict(name="tl-fp16amp-every2", family="llama", config="tinyllama-1.1b-shape",
         setup=dict(batch=8, seq=1024, precision="fp16-autocast", optimizer="adamw-fused", checkpointing=2,
                    use_cache=False),
         why="fp16 autocast with a GradScaler, every 2nd block checkpointed"),
    # --- Mistral-7B shape, 4 blocks ----------------------------------------------------------------------
    dict(name="m7b-qlora-peft-recipe", family="mistral", config="mistral-7b-shape-4l",
         setup=dict(batch=2, seq=2048, precision="bf16", optimizer="paged-adamw8bit", lora_rank=16,
                    lora_targets=_LLAMA_ALL, qlora=True, checkpointing="full", use_cache=False),
         why="peft's standard QLoRA recipe: prepare_model_for_kbit_training (fp32 upcasts, checkpointing), "
             "r=16 on every linear, paged 8-bit AdamW"),
    dict(name="m7b-qlora-nockpt-cache", family="mistral", config="mistral-7b-shape-4l",
         setup=dict(batch=2, seq=1024, precision="bf16", optimizer="adamw8bit", lora_rank=8,
                    lora_targets=("q_proj", "v_proj"), qlora=True, use_cache=None),
         why="QLoRA without checkpointing, cache on over the fp32 residual stream"),
    dict(name="m7b-lora-bf16", family="mistral", config="mistral-7b-shape-4l",
         setup=dict(batch=4, seq=2048, precision="bf16", optimizer="adamw-fused", lora_rank=16,
                    lora_targets=_LLAMA_ALL, use_cache=False),
         why="LoRA on a bf16 base (autocast, fp32 adapters)"),
    dict(name="m7b-fp32-sdpa", family="mistral", config="mistral-7b-shape-4l",
         setup=dict(batch=1, seq=1024, precision="fp32", optimizer="adamw-fused", use_cache=None),
         why="fp32 without autocast, cache on"),
    # --- Qwen2.5 shapes ----------------------------------------------------------------------------------
    dict(name="q05-amp-cache", family="qwen2", config="qwen2.5-0.5b-shape",
         setup=dict(batch=4, seq=1024, precision="bf16-autocast", optimizer="adamw", use_cache=None),
         why="GQA 14/2, q/k/v biases, tied 152k vocabulary, cache on"),
    dict(name="q05-amp-accum-nocache", family="qwen2", config="qwen2.5-0.5b-shape",
         setup=dict(batch=8, seq=512, precision="bf16-autocast", optimizer="adamw-fused", grad_accum=2,
                    use_cache=False),
         why="accumulation with the cache off"),
    dict(name="q05-8bit-ckpt-4k", family="qwen2", config="qwen2.5-0.5b-shape",
         setup=dict(batch=4, seq=4096, precision="bf16-autocast", optimizer="adamw8bit", checkpointing="full",
                    use_cache=False),
         why="4096 tokens with a 152k vocabulary: the loss's logits dominate"),
    dict(name="q15-lora-nocache", family="qwen2", config="qwen2.5-1.5b-shape",
         setup=dict(batch=4, seq=1024, precision="bf16", optimizer="adamw-fused", lora_rank=8,
                    lora_targets=("q_proj", "v_proj"), use_cache=False),
         why="LoRA r=8 on q and v of a bf16 base"),
    dict(name="q15-qlora-peft-recipe", family="qwen2", config="qwen2.5-1.5b-shape",
         setup=dict(batch=4, seq=1024, precision="bf16", optimizer="paged-adamw8bit", lora_rank=16,
                    lora_targets=_LLAMA_ALL, qlora=True, checkpointing="full", use_cache=False),
         why="peft's standard QLoRA recipe on a whole 1.5B model with tied embeddings"),
]
