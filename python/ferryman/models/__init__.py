"""Model implementations: the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2)."""

from ferryman.models.llama import LlamaForCausalLM, ModelConfig

__all__ = ["LlamaForCausalLM", "ModelConfig"]
