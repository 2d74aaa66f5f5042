"""A tiny causal LM and tokenizer, built locally and deterministically from a seed.

No hub access: a byte-level BPE tokenizer is trained on a small built-in corpus and a 2-layer
Qwen2 is initialised from a config. ``build_tiny_model`` writes a normal Hugging Face model
folder (``model.safetensors``, ``config.json``, tokenizer files, chat template) that
``AutoModelForCausalLM.from_pretrained`` and TRL load like any other model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from posttrain.datasets.toy import TOY_WORDS, toy_prompt_rows, write_toy_jsonl

__all__ = ["build_tiny_model", "build_tiny_tokenizer", "toy_prompt_rows", "write_toy_jsonl"]

PAD_TOKEN = "<|endoftext|>"
BOS_OF_TURN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, BOS_OF_TURN, EOS_TOKEN]

# ChatML, the layout Qwen models use; `add_generation_prompt` opens the assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _corpus() -> list[str]:
    """Text the tokenizer learns from: chat turns, arithmetic and the words of the toy tasks."""
    lines = []
    for a in range(12):
        for b in range(12):
            lines.append(f"What is {a} + {b}? Answer with a number. {a + b}")
    for w in TOY_WORDS:
        lines.append(f"Repeat the word {w}. {w}")
    lines += [
        "system\nYou are a helpful assistant.",
        "user\nSay hello.\nassistant\nHello!",
        "The quick brown fox jumps over the lazy dog.",
        "Count to ten: 1 2 3 4 5 6 7 8 9 10",
    ]
    return lines


def build_tiny_tokenizer(vocab_size: int = 512):
    """A byte-level BPE ``PreTrainedTokenizerFast`` with ChatML specials and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        padding_side="left",  # GRPOTrainer requires left padding for generation
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


def build_tiny_model(
    out_dir: str | Path,
    seed: int = 0,
    dtype: Literal["float32", "bfloat16"] = "float32",
    *,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int | None = None,
    tie_word_embeddings: bool = True,
) -> Path:
    """Build the tiny model and tokenizer and save them as a Hugging Face folder at ``out_dir``.

    The same ``seed`` gives byte-identical weights. Returns ``out_dir`` as a Path.

    ``num_kv_heads`` defaults to ``max(1, num_heads // 2)``. With ``tie_word_embeddings=False``
    the LM head is a separate matrix, saved as ``lm_head.weight``. vLLM's CPU build needs a
    head_dim (``hidden_size // num_heads``) of 32, 64, 80, ... (not the default 16) and an
    untied model for in-place weight reloads: e.g. ``hidden_size=128, num_heads=4,
    tie_word_embeddings=False``.
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tiny_tokenizer(vocab_size)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads if num_kv_heads is not None else max(1, num_heads // 2),
        max_position_embeddings=512,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG state alone
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model = model.to(getattr(torch, dtype))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
