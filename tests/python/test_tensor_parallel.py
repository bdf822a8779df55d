"""Tensor parallelism of the model (``models/tensor_parallel.py``, issue: scale-out, item 1, its
first part): 2 and 4 ranks over gloo, one process each, give the logits of one rank on tiny Llama
/ Qwen2 (q/k/v bias, tied embeddings) / Qwen3 (q/k norms, head_dim 24) checkpoints, including
fewer KV heads than ranks (4 ranks, 2 KV heads: replicated). Attention here is a dense causal
reference over one sequence, so the check is the split and the collectives alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file
from tiny_models import build

from ferryman.models.config import ModelConfig
from ferryman.models.llama import LlamaForCausalLM
from ferryman.models.tensor_parallel import TensorParallel, shard_of

TOKENS = [3, 17, 42, 5, 88, 61, 7, 29, 30, 2, 55, 90]


class DenseCausal:
    """Attention over the batch's own tokens, one sequence, no cache."""

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
        )
        return out.transpose(0, 1)


def logits(path: Path, tp: TensorParallel) -> torch.Tensor:
    cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    tensors = load_file(str(path / "model.safetensors"))
    model = LlamaForCausalLM.from_tensors(cfg, tensors, torch.float32, torch.device("cpu"), tp)
    with torch.no_grad():
        ids = torch.tensor(TOKENS)
        hidden = model(ids, torch.arange(len(TOKENS)), DenseCausal())  # type: ignore[arg-type]
        return model.compute_logits(hidden)


def _rank(rank: int, world: int, path: str, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        got = logits(Path(path), TensorParallel(rank, world))
        torch.save(got, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("kind", "world"), [("llama", 2), ("llama", 4), ("qwen2", 2), ("qwen3", 2)])
def test_ranks_give_the_logits_of_one(tmp_path: Path, kind: str, world: int) -> None:
    path = build(kind, tmp_path / "m")
    want = logits(path, TensorParallel())
    out = str(tmp_path / "logits")
    mp.spawn(_rank, args=(world, str(path), f"file://{tmp_path / 'rendezvous'}", out), nprocs=world)
    for r in range(world):
        got = torch.load(f"{out}.{r}")
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # a sum's order differs


def test_shards_cover_the_model_once() -> None:
    cfg = ModelConfig.from_hf(
        {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 259}
    )  # fmt: skip
    shards = [shard_of(cfg, TensorParallel(r, 4)) for r in range(4)]
    assert [list(s.q_heads) for s in shards] == [[0], [1], [2], [3]]
    assert [list(s.kv_heads) for s in shards] == [[0], [0], [1], [1]]  # replicated: 2 heads, 4 ranks
    assert shards[-1].vocab.stop == 260 and all(s.vocab_size == 65 for s in shards)
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        shard_of(cfg, TensorParallel(0, 3))
