"""The Llama family in one implementation: RMSNorm, RoPE (its scalings in ``models.rope``),
SwiGLU, grouped-query attention, optional q/k bias (Qwen2) and q/k RMSNorm (Qwen3), tied
embeddings (SmolLM2). Sliding-window attention is not implemented: ``ModelConfig.sliding_window``
records a window that some layer uses, and the loader refuses it where it would matter.

The model runs on a flat batch of tokens ``[T]`` (every request's scheduled tokens back to back)
and leaves attention over the paged KV cache to an ``AttentionBackend``; it never sees requests.

On CPU in float32, ``pack_cpu_weights()`` moves every projection and the LM head to oneDNN's
packed weight layout; ``models/cpu_linear.py`` runs them there, at a bounded set of row counts.
A packed model pads the flat batch once, with zero tokens at position 0, to
``padded_rows(T)`` rows: every op but attention runs on them, attention sees the first T rows
only (it writes no K/V for the padding), and the hidden states returned are the first T rows.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ferryman.attention.base import AttentionBackend
from ferryman.models import cpu_linear
from ferryman.models.config import SUPPORTED_ARCHITECTURES as SUPPORTED_ARCHITECTURES
from ferryman.models.config import ModelConfig as ModelConfig
from ferryman.models.ops import Ops, RMSNorm, TorchOps
from ferryman.models.rope import rope_parameters
from ferryman.models.tensor_parallel import Shard, TensorParallel, embed, our_name, shard_of, shard_tensor


class Linear(nn.Linear):
    """``nn.Linear`` whose weight can move to oneDNN's packed layout (``pack()``; CPU float32).
    Packing frees the plain weight: a packed layer is for inference only. On CUDA, ``skinny``
    (set by ``worker/gemm_choice.py``) maps row counts to the skinny GEMM kernel's launcher."""

    packed: torch.Tensor | None = None
    skinny: dict[int, Callable[..., torch.Tensor]] | None = None

    def reset_parameters(self) -> None:
        """Nothing: weights always come from a checkpoint. (On the meta device, where models are
        built, torch's first init op costs ~1 s of lazy imports at start-up; measured.)"""

    def pack(self) -> None:
        self.packed = cpu_linear.pack(self.weight)
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.skinny is not None and x.dim() == 2 and x.stride(1) == 1:
            run = self.skinny.get(x.shape[0])
            if run is not None:
                return run(x, self.weight, self.bias)
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return cpu_linear.packed_linear(x, self.packed, self.bias)


class Embedding(nn.Embedding):
    """``nn.Embedding`` without an initialisation (see ``Linear.reset_parameters``)."""

    def reset_parameters(self) -> None:
        pass


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """float32 inverse RoPE frequencies of ``cfg`` (``models.rope`` computes every scaling)."""
    return rope_for(cfg)[0]


def rope_for(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse RoPE frequencies and the cos/sin scale (YaRN's attention factor, else 1)."""
    return rope_parameters(
        cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings, cfg.rope_freq_factors
    )


# Projections that read the same input run as one GEMM over their stacked weights: three GEMVs
# fewer per layer on a GPU (not yet measured there). On CPU it is neutral end to end (5-7% less
# projection time in a microbenchmark, within noise in a whole decode step; README). Checkpoints
# keep the separate names and the loader stacks them; one that holds a stacked tensor under the
# model's own name (the GGUF conversion cache) gives it as is.
FUSED_PROJECTIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _checkpoint_names(key: str) -> list[str]:
    """The checkpoint tensors behind one of our state-dict keys (the parts of a stacked one)."""
    *prefix, name, kind = key.split(".")
    parts = FUSED_PROJECTIONS.get(name, (name,))
    return [".".join([*prefix, part, kind]) for part in parts]


class DecoderLayer(nn.Module):
    """One layer, or one rank's slice of it (``s``; ``tp`` sums the row-parallel outputs)."""

    def __init__(self, cfg: ModelConfig, idx: int, s: Shard, tp: TensorParallel) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.idx, self.nq, self.nkv, self.d, self.tp = idx, s.num_heads, s.num_kv_heads, d, tp
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        b = cfg.attention_bias
        self.qkv_proj = Linear(h, (self.nq + 2 * self.nkv) * d, bias=b)  # q, k, v stacked by rows
        self.o_proj = Linear(self.nq * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.inter = s.intermediate_size
        self.gate_up_proj = Linear(h, 2 * self.inter, bias=False)  # gate, then up
        self.down_proj = Linear(self.inter, h, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: object,
        attn: AttentionBackend,
        t: int,
        ops: Ops,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[n, hidden]``: the step's ``t`` tokens, then ``n - t`` padding rows; with
        ``residual``, the layer's input is ``residual + x`` (added inside the first norm: one
        kernel with ``FlashInferOps``). Returns the MLP's output and the residual stream, whose
        sum is the layer's output."""
        n = x.shape[0]
        if residual is None:
            h, residual = ops.rmsnorm(x, self.input_layernorm), x
        else:
            h, residual = ops.add_rmsnorm(x, residual, self.input_layernorm)
        q, k, v = self.qkv_proj(h).split([self.nq * self.d, self.nkv * self.d, self.nkv * self.d], dim=-1)
        q, k, v = q.view(n, self.nq, self.d), k.view(n, self.nkv, self.d), v.view(n, self.nkv, self.d)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = ops.rope(q, k, rope)
        o = attn.forward(self.idx, q[:t], k[:t], v[:t]).reshape(t, self.nq * self.d)
        if n > t:
            o = F.pad(o, (0, 0, 0, n - t))
        h, residual = ops.add_rmsnorm(
            self.tp.all_reduce(self.o_proj(o)), residual, self.post_attention_layernorm
        )
        out: torch.Tensor = self.tp.all_reduce(self.down_proj(ops.silu_and_mul(self.gate_up_proj(h))))
        return out, residual


class LlamaForCausalLM(nn.Module):
    """Weights use Hugging Face's names minus the ``model.`` / ``self_attn.`` / ``mlp.`` levels;
    ``load_hf_state_dict`` maps them. With ``tp``, this rank's slice (``tensor_parallel.py``):
    the KV heads it holds are ``shard.num_kv_heads``, and logits come back whole on every rank."""

    inv_freq: torch.Tensor

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.cfg, self.tp = cfg, tp or TensorParallel()
        self.shard = s = shard_of(cfg, self.tp)
        self.embed_tokens = Embedding(s.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, s, self.tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, s.vocab_size, bias=False)
        self._tied_head_packed: torch.Tensor | None = None
        self.pad_rows = False  # packed: the forward runs at cpu_linear.padded_rows(T) rows
        # on the CPU even inside the meta-device context models are built in: on meta, torch runs
        # these ops through Python references whose first use imports torch._dynamo (~2 s)
        with torch.device("cpu"):
            inv_freq, self.rope_scale = rope_for(cfg)  # rope_scale: YaRN's cos/sin factor, else 1
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @classmethod
    def from_tensors(
        cls,
        cfg: ModelConfig,
        tensors: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        tp: TensorParallel | None = None,
        sliced: bool = False,
    ) -> LlamaForCausalLM:
        """The model (or ``tp``'s rank's slice of it) in eval mode on ``device``, built without
        initialising weights and loaded from Hugging Face-named ``tensors``; the RoPE
        frequencies stay float32. ``sliced``: the tensors are that rank's slices already.

        A given tensor already contiguous, in ``dtype`` and on ``device`` becomes the parameter
        itself, not a copy (a memory-mapped checkpoint stays mapped: its file must not change
        while the model lives); projections stacked here are new tensors."""
        head, embed = tensors.get("lm_head.weight"), tensors.get("model.embed_tokens.weight")
        if cfg.tie_word_embeddings and head is not None and embed is not None and not _same(head, embed):
            # transformers' rule: a checkpoint's own lm_head that differs is kept, not tied over
            warnings.warn("tie_word_embeddings, but lm_head differs from the embedding: untied", stacklevel=2)
            cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
        with torch.device("meta"):
            model = cls(cfg, tp)
        model.load_hf_state_dict(tensors, sliced)
        model = model.to(device=device, dtype=dtype)  # copies only what is elsewhere or in another dtype
        model.inv_freq = rope_inv_freq(cfg).to(device)  # not a checkpoint tensor: still on meta
        # inference only: a CUDA graph captured outside inference mode would otherwise keep an
        # autograd graph of its activations alive in the graphs' memory pool
        return model.eval().requires_grad_(False)

    @classmethod
    def random(
        cls, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0
    ) -> LlamaForCausalLM:
        """The model with random weights (``load_format="dummy"``): norms 1, everything else
        N(0, 0.02²) from a generator seeded with ``seed``, so the same config, dtype and device
        give the same weights."""
        with torch.device("meta"):
            model = cls(cfg).to(dtype)  # in dtype before any memory exists (not float32 first)
        model = model.to_empty(device=device)
        g = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.requires_grad_(False)  # inference only
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02, generator=g)
        model.inv_freq = rope_inv_freq(cfg).to(device)
        return model.eval()

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend, ops: Ops | None = None
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of a flat token batch; ``ops``: the elementwise kernels
        (``models/ops.py``; default the torch reference)."""
        ops = ops or TorchOps(self.inv_freq, self.rope_scale)
        t = input_ids.shape[0]
        pad = cpu_linear.padded_rows(t) - t if self.pad_rows else 0
        if pad:
            input_ids, positions = F.pad(input_ids, (0, pad)), F.pad(positions, (0, pad))
        x = embed(input_ids, self.embed_tokens.weight, self.shard, self.tp)
        rope = ops.rope_state(positions, x.dtype)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            x, residual = layer(x, residual, rope, attn, t, ops)
        assert residual is not None, "a model has at least one layer"
        out, _ = ops.add_rmsnorm(x, residual, self.norm)
        return out[:t]

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits ``[S, vocab]`` of the rows to sample; into ``out`` (float32, that
        shape) when given, cast in the copy, with no float32 temporary (the decode graphs'
        shared logits buffer)."""
        if self.lm_head is not None:
            raw: torch.Tensor = self.lm_head(hidden)
        elif self._tied_head_packed is not None:
            raw = cpu_linear.packed_linear(hidden, self._tied_head_packed, None)
        else:
            raw = F.linear(hidden, self.embed_tokens.weight)
        if self.tp.world > 1:  # every rank's vocabulary slice, without the padding rows
            raw = self.tp.gather_last(raw)[:, : self.cfg.vocab_size]
        return raw.float() if out is None else out.copy_(raw)

    def pack_cpu_weights(self) -> bool:
        """Packs every projection and the LM head for oneDNN (see the module docstring); False,
        and nothing changed, where that does not apply (not CPU float32, or no oneDNN)."""
        w = self.embed_tokens.weight
        if not cpu_linear.can_pack(w.device, w.dtype):
            return False
        for m in self.modules():
            if isinstance(m, Linear) and m.packed is None:
                m.pack()
        if self.lm_head is None:
            self._tied_head_packed = cpu_linear.pack(w)  # the embedding keeps its plain weight for lookups
        self.pad_rows = True
        return True

    def load_hf_state_dict(self, tensors: dict[str, torch.Tensor], sliced: bool = False) -> None:
        """Takes weights named as in a Hugging Face checkpoint as the parameters (assigned, not
        copied: a tensor shared with the caller stays shared); names every missing tensor."""
        own = self.state_dict()
        given = {our_name(name): t for name, t in tensors.items()}
        # extra tensors are refused below, but for a tied model's lm_head and rotary buffers
        if self.tp.world > 1 and not sliced:
            given = {n: shard_tensor(n, t, self.cfg, self.shard) for n, t in given.items()}
        sources = {key: [key] if key in given else _checkpoint_names(key) for key in own}
        missing = sorted(n for names in sources.values() for n in names if n not in given)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:5]}")
        used = {n for names in sources.values() for n in names}
        unused = sorted(n for n in given if n not in used and "rotary_emb" not in n and n != "lm_head.weight")
        if unused:  # e.g. biases the model does not add: refused, not dropped (other tokens)
            raise ValueError(
                f"checkpoint has {len(unused)} tensors this model does not use, e.g. {unused[:5]}"
            )
        mapped = {
            key: (given[names[0]] if len(names) == 1 else torch.cat([given[n] for n in names])).contiguous()
            for key, names in sources.items()
        }
        for key, t in mapped.items():
            if tuple(t.shape) != tuple(own[key].shape):
                raise ValueError(
                    f"tensor {key}: checkpoint shape {tuple(t.shape)} != {tuple(own[key].shape)}"
                )
        self.load_state_dict(mapped, strict=True, assign=True)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.equal(a, b.to(a.dtype)))
