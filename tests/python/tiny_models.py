"""Tiny random Llama-family checkpoints written with transformers into a temp folder (no
downloads). Weights get a wide spread so that greedy choices are not near-ties. Also the dense
causal attention the paged paths are checked against, and the tests' tokenizers: byte-level BPE
(GPT-2 / Qwen style) and SentencePiece-style with byte fallback (Llama-2 style)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention over a whole sequence; q [L, Hq, D], k/v [L, Hkv, D] (GQA)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    )
    return o.transpose(0, 1)


def build(kind: str, root: Path, seed: int = 0, tokenizer: bool = False, **overrides: int) -> Path:
    """With ``tokenizer``, the model gets a byte-level BPE tokenizer (256 byte tokens, no merges,
    three specials, a ChatML template) and a vocabulary of 259 to match. ``overrides`` replace
    config fields (e.g. ``hidden_size=256`` for a head size FlashInfer compiles)."""
    import transformers as tf

    common = dict(
        vocab_size=259 if tokenizer else 96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    common.update(overrides)
    if kind == "llama":
        cfg = tf.LlamaConfig(**common, tie_word_embeddings=False)
        model_cls = tf.LlamaForCausalLM
    elif kind == "qwen2":
        cfg = tf.Qwen2Config(**common, tie_word_embeddings=True)
        model_cls = tf.Qwen2ForCausalLM
    elif kind == "qwen3":
        cfg = tf.Qwen3Config(**common, head_dim=24, tie_word_embeddings=False)
        model_cls = tf.Qwen3ForCausalLM
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = model_cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    out = root / kind
    model.save_pretrained(out)
    if tokenizer:
        save_byte_tokenizer(out)
    return out


def save_byte_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>", unk_token="<|endoftext|>"
    )
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def sentencepiece_tokenizer(**kwargs: Any) -> Any:
    """Llama-2's decoder pipeline: "▁" for spaces, <0xNN> byte tokens, a leading space stripped
    (a transformers tokenizer; ``kwargs`` go to it)."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁", "h", "e", "l", "o", "w", "r", "d", "▁the", "▁a", "ll", "é", "東"]:
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", **kwargs
    )
