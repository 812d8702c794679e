"""Ready mappings from JAX parameter layouts to Hugging Face ``transformers`` models.

Each preset is a function of a model config (a ``transformers`` config object or a plain dict
with the same field names) that returns a :class:`bridges.mapping.Mapping` from the JAX
checkpoint (source, ``/`` paths) to the torch state dict ``{"model": model.state_dict(),
"optim": optimizer state}`` (target). Load with ``bridges.torch.load(url, target, mapping=m)``;
save torch -> JAX with ``bridges.torch.save(url, state, mapping=m)``; restore a torch checkpoint
into JAX with ``bridges.jax.restore(url, target, mapping=m.inverse())``. The library ships no
model definitions: the presets name the layout a JAX model must have (tables below).

* :func:`hf_llama_from_nnx`: ``LlamaForCausalLM`` (and ``MistralForCausalLM``,
  ``Qwen2ForCausalLM``: sliding windows and the like do not change weights; Qwen2's q/k/v biases
  do) from a Flax NNX decoder whose per-layer parameters are stacked on axis 0 (``nnx.vmap`` to
  build, ``nnx.scan`` to run), attention as ``nnx.LinearGeneral`` kernels.
* :func:`hf_llama_from_maxtext`: the same HF models from MaxText's scanned parameter tree;
  :func:`hf_qwen3_from_maxtext`, :func:`hf_gemma2_from_maxtext`, :func:`hf_mixtral_from_maxtext`
  likewise for MaxText's Qwen3, Gemma 2 (local/global layer pairs) and Mixtral (the facts they
  rely on: ``bridges/presets/_maxtext.py``). MaxText has no Qwen2-MoE.
* :func:`hf_qwen3_from_nnx`: ``Qwen3ForCausalLM`` (the Llama layout plus per-head q/k RMSNorms).
* :func:`hf_gemma2_from_nnx`: ``Gemma2ForCausalLM`` (tied head, four norms per layer);
  :func:`hf_gemma3_from_nnx`: ``Gemma3ForCausalLM`` (the same plus per-head q/k norms).
* :func:`hf_mixtral_from_nnx`, :func:`hf_qwen2_moe_from_nnx`: ``MixtralForCausalLM`` and
  ``Qwen2MoeForCausalLM`` (shared expert) from experts stacked ``(L, E, ...)``, into the models'
  fused expert tensors or the one-tensor-per-expert files of the hub and ``save_pretrained``.
* :func:`hf_qwen3_moe_from_nnx`: ``Qwen3MoeForCausalLM`` (Qwen3's attention with per-head q/k
  norms, Qwen2-MoE's routed experts, no shared expert).
* :func:`hf_gpt_oss_from_nnx`: ``GptOssForCausalLM`` (q/k/v/o biases, attention sinks, a biased
  router, fused experts with gate and up interleaved, stored (in, out)).
* :func:`hf_deepseek_v3_from_nnx`: ``DeepseekV3ForCausalLM`` (multi-head latent attention, dense
  first layers, then routed experts with a correction bias and shared experts).
* :func:`hf_llama4_from_nnx`: ``Llama4ForCausalLM`` (text: dense and MoE layers alternating,
  experts stored (in, out), a shared expert, interleaved rotary).
* :func:`hf_gpt2_from_nnx`: ``GPT2LMHeadModel`` (Conv1D weights stored (in, out), fused
  ``c_attn``) from a Flax NNX GPT-2 with separate q/k/v.

* :func:`hf_llama_from_torchtitan`, :func:`hf_qwen3_from_torchtitan`: ``LlamaForCausalLM`` and
  ``Qwen3ForCausalLM`` from a torchtitan checkpoint (its own names, its flattened AdamW state;
  ``bridges.torchtitan`` saves one through ckptfmt; facts relied on: ``bridges/presets/_torchtitan.py``).

Adam moments (optax ``mu``/``nu`` -> torch AdamW ``exp_avg``/``exp_avg_sq``) follow their
parameters through the same transforms; optax's one ``count`` (int32) feeds every torch ``step``
(float32) through a ``Cast``, and a torch save writes it back as the int32 ``count`` and, by an
``also`` copy, as NNX's ``optimizer/step`` (uint32), so JAX -> torch -> JAX gives back every leaf
of ``nnx.Optimizer(model, optax.adamw(...))`` bit for bit.

MaxText facts relied on (read from AI-Hypercomputer/maxtext):

* ``MaxText/layers/attentions.py``: ``query`` is ``DenseGeneral(features=(num_query_heads,
  head_dim), kernel_axes=("embed", "heads", "kv"))``: kernel (embed, heads, head_dim); ``key`` /
  ``value`` (embed, kv_heads, head_dim); ``out`` ``DenseGeneral(axis=(-2, -1))``: kernel (heads,
  head_dim, embed). ``query_init`` divides the kernel init by ``sqrt(head_dim)`` and
  ``qk_product`` applies no ``1/sqrt(head_dim)``: the query kernel is pre-scaled. The default
  ``RotaryEmbedding`` rotates split halves (``jnp.split(inputs, 2, axis=-1)``);
  ``LLaMARotaryEmbedding`` (``MaxText/layers/embeddings.py``), chosen when ``model_name`` or
  ``rope_type`` starts with ``llama3.1``, rotates interleaved pairs.
* ``MaxText/llama_or_mistral_ckpt.py``: the parameter names (``decoder/layers/self_attention/
  {query,key,value,out}/kernel``, ``decoder/layers/mlp/{wi_0,wi_1,wo}/kernel``,
  ``decoder/layers/{pre,post}_self_attention_layer_norm/scale``, ``decoder/decoder_norm/scale``,
  ``decoder/logits_dense/kernel``, ``token_embedder/embedding``); scanned layers stacked on axis
  1 (query ``(embed, layer, q, head_dim)``, out ``(heads, layer, head_dim, embed)``, mlp ``wi_*``
  ``(embed, layer, mlp)``, ``wo`` ``(mlp, layer, embed)``, norms ``(embed, layer)``); the query
  kernel divided by ``sqrt(head_dim)``; ``permute_to_match_maxtext_rope`` (evens then odds); and
  ``TrainState(params={"params": weights})``, so key paths read ``params/params/decoder/...``.
* ``src/MaxText/utils/ckpt_conversion/strategies/llama.py`` (``LlamaMapper``, Llama 3.1 <-> HF):
  ``scale_query_layer`` multiplies by ``sqrt(head_dim)`` in float32 to HF; ``adjust_rope`` turns
  MaxText's interleaved q/k rows into HF's halves (evens, then odds); ``reshape_kernel``
  transposes and reshapes. MaxText's tests of its HF loader use ``param_scan_axis=1``.

Subpackage ``bridges.presets`` owns the presets for Hugging Face models: one registry
(``_registry``) and the name tables (``_base``, ``_maxtext``, ``_moe``, ``_gpt_oss``, ``_deepseek``, ``_llama4``, ``_torchtitan``). May import:
``bridges.mapping``, and no framework (tests/test_layering.py).
"""
from __future__ import annotations

from bridges.presets._registry import Preset as Preset
from bridges.presets._registry import Source as Source
from bridges.presets._registry import NNX as NNX
from bridges.presets._registry import MAXTEXT as MAXTEXT
from bridges.presets._registry import REGISTRY as REGISTRY
from bridges.presets._registry import MIXTRAL_NNX_NAMES as MIXTRAL_NNX_NAMES
from bridges.presets._registry import QWEN2_MOE_NNX_NAMES as QWEN2_MOE_NNX_NAMES
from bridges.presets._registry import llama_dims as llama_dims
from bridges.presets._registry import LLAMA_NNX_NAMES as LLAMA_NNX_NAMES
from bridges.presets._registry import MAXTEXT_LLAMA_NAMES as MAXTEXT_LLAMA_NAMES
from bridges.presets._registry import MAXTEXT_QWEN3_NAMES as MAXTEXT_QWEN3_NAMES
from bridges.presets._registry import MAXTEXT_GEMMA2_NAMES as MAXTEXT_GEMMA2_NAMES
from bridges.presets._registry import MAXTEXT_MIXTRAL_NAMES as MAXTEXT_MIXTRAL_NAMES
from bridges.presets._registry import GPT2_NNX_NAMES as GPT2_NNX_NAMES
from bridges.presets._registry import QWEN3_NNX_NAMES as QWEN3_NNX_NAMES
from bridges.presets._registry import GEMMA2_NNX_NAMES as GEMMA2_NNX_NAMES
from bridges.presets._registry import GEMMA3_NNX_NAMES as GEMMA3_NNX_NAMES
from bridges.presets._registry import NAME_TABLES as NAME_TABLES
from bridges.presets._registry import TORCHTITAN as TORCHTITAN
from bridges.presets._registry import QWEN3_MOE_NNX_NAMES as QWEN3_MOE_NNX_NAMES
from bridges.presets._registry import GPT_OSS_NNX_NAMES as GPT_OSS_NNX_NAMES
from bridges.presets._registry import DEEPSEEK_V3_NNX_NAMES as DEEPSEEK_V3_NNX_NAMES
from bridges.presets._registry import LLAMA4_NNX_NAMES as LLAMA4_NNX_NAMES
from bridges.presets._registry import TORCHTITAN_LLAMA3_NAMES as TORCHTITAN_LLAMA3_NAMES
from bridges.presets._registry import TORCHTITAN_QWEN3_NAMES as TORCHTITAN_QWEN3_NAMES
from bridges.presets._registry import names_markdown as names_markdown
from bridges.presets._registry import hf_llama_from_nnx as hf_llama_from_nnx
from bridges.presets._registry import hf_llama_from_maxtext as hf_llama_from_maxtext
from bridges.presets._registry import hf_gpt2_from_nnx as hf_gpt2_from_nnx
from bridges.presets._registry import hf_qwen3_from_nnx as hf_qwen3_from_nnx
from bridges.presets._registry import hf_gemma2_from_nnx as hf_gemma2_from_nnx
from bridges.presets._registry import hf_mixtral_from_nnx as hf_mixtral_from_nnx
from bridges.presets._registry import hf_qwen2_moe_from_nnx as hf_qwen2_moe_from_nnx
from bridges.presets._registry import hf_gemma3_from_nnx as hf_gemma3_from_nnx
from bridges.presets._registry import hf_qwen3_from_maxtext as hf_qwen3_from_maxtext
from bridges.presets._registry import hf_gemma2_from_maxtext as hf_gemma2_from_maxtext
from bridges.presets._registry import hf_mixtral_from_maxtext as hf_mixtral_from_maxtext
from bridges.presets._registry import hf_qwen3_moe_from_nnx as hf_qwen3_moe_from_nnx
from bridges.presets._registry import hf_gpt_oss_from_nnx as hf_gpt_oss_from_nnx
from bridges.presets._registry import hf_deepseek_v3_from_nnx as hf_deepseek_v3_from_nnx
from bridges.presets._registry import hf_llama4_from_nnx as hf_llama4_from_nnx
from bridges.presets._registry import hf_llama_from_torchtitan as hf_llama_from_torchtitan
from bridges.presets._registry import hf_qwen3_from_torchtitan as hf_qwen3_from_torchtitan

__all__ = ["Preset", "Source", "NNX", "MAXTEXT", "REGISTRY", "MIXTRAL_NNX_NAMES", "QWEN2_MOE_NNX_NAMES", "llama_dims", "LLAMA_NNX_NAMES", "MAXTEXT_LLAMA_NAMES", "MAXTEXT_QWEN3_NAMES", "MAXTEXT_GEMMA2_NAMES", "MAXTEXT_MIXTRAL_NAMES", "GPT2_NNX_NAMES", "QWEN3_NNX_NAMES", "GEMMA2_NNX_NAMES", "GEMMA3_NNX_NAMES", "NAME_TABLES", "names_markdown", "hf_llama_from_nnx", "hf_llama_from_maxtext", "hf_gpt2_from_nnx", "hf_qwen3_from_nnx", "hf_gemma2_from_nnx", "hf_mixtral_from_nnx", "hf_qwen2_moe_from_nnx", "hf_gemma3_from_nnx", "hf_qwen3_from_maxtext", "hf_gemma2_from_maxtext", "hf_mixtral_from_maxtext", "TORCHTITAN", "TORCHTITAN_LLAMA3_NAMES", "TORCHTITAN_QWEN3_NAMES", "QWEN3_MOE_NNX_NAMES", "GPT_OSS_NNX_NAMES", "DEEPSEEK_V3_NNX_NAMES", "LLAMA4_NNX_NAMES", "hf_qwen3_moe_from_nnx", "hf_gpt_oss_from_nnx", "hf_deepseek_v3_from_nnx", "hf_llama4_from_nnx", "hf_llama_from_torchtitan", "hf_qwen3_from_torchtitan"]
