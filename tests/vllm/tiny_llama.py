"""A tiny random Llama and its tokenizer, built offline (no download): vLLM's CPU test model.

hidden 128, 4 heads / 2 KV heads (head_dim 32: vLLM's CPU attention needs >= 32),
2 layers, vocab 1024, untied ``lm_head`` (so that changing it changes the output
alone). The tokenizer is a byte-level BPE trained by ``tokenizers`` on generated
text and padded with reserved tokens to exactly the model's vocabulary, so every id
the model can emit decodes. Token 0 is an ordinary token (``<unk>`` is 1, ``</s>``
2), so a zeroed ``lm_head`` makes greedy decoding emit 0 everywhere.

Run as a script to build one: ``python tests/vllm/tiny_llama.py DIR``.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

VOCAB = 1024
CONFIG = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": VOCAB,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "bos_token_id": 3,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}
PROMPTS = ("the quick brown fox", "hello world", "memory moves between phases")


def _corpus(seed: int) -> list[str]:
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(800)]
    words += " ".join(PROMPTS).split()
    return [" ".join(rng.choice(words) for _ in range(12)) for _ in range(3000)]


def build_tokenizer(directory: Path, seed: int = 0) -> None:
    """Train a byte-level BPE of exactly ``VOCAB`` tokens and save it in HF format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    # Token 0 is an ordinary token: a zeroed lm_head then emits it, and it is no EOS.
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 8,
        special_tokens=["<pad0>", "<unk>", "</s>", "<s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(seed), trainer=trainer)
    reserved = [f"<reserved_{i}>" for i in range(VOCAB - tokenizer.get_vocab_size())]
    tokenizer.add_tokens(reserved)
    assert tokenizer.get_vocab_size() == VOCAB, tokenizer.get_vocab_size()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", eos_token="</s>", bos_token="<s>"
    )
    fast.save_pretrained(str(directory))


def build(directory: str | Path, seed: int = 0) -> Path:
    """Write the model (safetensors, float32) and its tokenizer into ``directory``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    model.save_pretrained(str(path), safe_serialization=True)
    build_tokenizer(path, seed)
    (path / "hybridmem_tiny.json").write_text(json.dumps({"seed": seed}))
    return path


if __name__ == "__main__":
    print(build(sys.argv[1]))
