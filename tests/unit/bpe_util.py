"""Shared by the BPE tokenizer tests: a tiny byte-level BPE (GPT-2's kind) trained with Hugging
Face `tokenizers` on a seeded corpus, and a tiny GPT2LMHeadModel over its vocabulary.

The corpus mixes ASCII words with accented, CJK and emoji characters; with ~400 tokens most
multi-byte characters stay split over several tokens, so a token may hold half a character."""

from __future__ import annotations

import random
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

END = "<|endoftext|>"
WORDS = ["the", "quick", "brown", "fox", "über", "straße", "東京", "ünïcödé", "hello", "world"]
WORDS += ["déjà", "vu", "ﬁn", "€", "λ", "Ωmega"]
CHARS = "abcdefghijklmnopqrstuvwxyzéèàçñøßæœ日本語東京大阪🙂🚀€λΩ"


def train_bpe(vocab: int = 400) -> Tokenizer:
    rng = random.Random(0)
    lines = []
    for _ in range(600):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 10))]
        words.append("".join(rng.choice(CHARS) for _ in range(rng.randint(1, 6))))
        lines.append(" ".join(words))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer)
    return tok


def tiny_gpt2(vocab: int, end: int, seed: int = 0) -> transformers.GPT2LMHeadModel:
    """Weights of std 0.3 (LayerNorms kept): at GPT-2's init a random model repeats one token,
    these make its greedy outputs vary with the context (as tests/unit/generate_util.widen)."""
    config = transformers.GPT2Config(
        vocab_size=vocab,
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=end,
        eos_token_id=end,
    )
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln_" not in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model


def save_hf(model: transformers.GPT2LMHeadModel, tok: Tokenizer, folder: Path) -> Path:
    model.save_pretrained(folder)  # config.json + model.safetensors
    tok.save(str(folder / "tokenizer.json"))
    return folder
