"""Tiny model configs shared by the JAX side, the torch ranks and the tests (plain dicts: the
JAX side reads them without importing transformers; the torch side builds HF configs from them)."""
from __future__ import annotations

import numpy as np

#: LlamaForCausalLM; 8 heads and 4 kv heads so that 4 tensor-parallel ranks hold whole heads.
LLAMA = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=4, head_dim=8, rms_norm_eps=1e-6, max_position_embeddings=64,
             tie_word_embeddings=False, rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
#: GPT2LMHeadModel (tied head); dropout off so train-mode and eval-mode forwards agree.
GPT2 = dict(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, layer_norm_epsilon=1e-5, bos_token_id=0, eos_token_id=0)
TRAIN_STEPS = 3
SEQ = 16
#: The ids every side computes logits on.
EVAL_IDS = np.random.default_rng(99).integers(0, 256, (2, SEQ)).astype(np.int32)
