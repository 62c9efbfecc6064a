"""Model configuration of the Llama-style decoder, and the named presets.

``canonical()`` lists every architectural field; weight digests and the cache namespace are built
from it, so two configs that differ anywhere never share weights or cached KV. The switches that
Hugging Face checkpoints need (explicit head size, q/k/v and output biases, Qwen3's q/k norm, RoPE
scaling) appear in ``canonical()`` only when set, so the presets' digests and namespaces are the same
as before the switches existed. ``cachecore.model.hf_config`` builds a config from ``config.json``.

Plain Python (the control plane reads presets and configs without torch): the RoPE tensors these
fields describe are computed by the decoder (``cachecore.model.llama.rope_inv_freq``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from cachecore.layout import DTYPE_BYTES, KVLayout

# RoPE flavour implemented by llama.py: rotate the two halves of each head (GPT-NeoX / HF Llama
# convention), not interleaved pairs. Part of the namespace: the two give different K.
ROPE_STYLE = "half"
ROPE_SCALINGS = ("linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as Hugging Face defines it: ``linear`` divides every inverse frequency by
    ``factor``; ``llama3`` (Llama 3.1+) divides the low frequencies by ``factor``, keeps the high ones
    and interpolates between, using ``low_freq_factor``, ``high_freq_factor`` and
    ``original_max_position_embeddings``. Validated when built (``ValueError``)."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ROPE_SCALINGS:
            raise ValueError(f"rope scaling {self.kind!r} is not supported; supported: {', '.join(ROPE_SCALINGS)}")
        if not self.factor > 0:
            raise ValueError(f"rope scaling factor must be positive, got {self.factor!r}")
        if self.kind == "llama3" and not (
            0 < self.low_freq_factor < self.high_freq_factor and self.original_max_position_embeddings > 0
        ):
            raise ValueError("llama3 rope scaling needs 0 < low_freq_factor < high_freq_factor and "
                             "original_max_position_embeddings > 0")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of the decoder. Validated when built (``ValueError`` on any bad field)."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    max_seq_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    dtype: str = "float32"
    head_dim_override: int | None = None  # when the head size is not dim // n_heads (Mistral Nemo, Qwen3)
    qkv_bias: bool = False  # q/k/v projections carry a bias (Qwen2; Llama's attention_bias)
    o_bias: bool = False  # the output projection carries a bias (Llama's attention_bias)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)
    rope_scaling: RopeScaling | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.head_dim_override is not None and (
            isinstance(self.head_dim_override, bool) or not isinstance(self.head_dim_override, int)
            or self.head_dim_override <= 0
        ):
            raise ValueError(f"ModelConfig.head_dim_override must be a positive int, got {self.head_dim_override!r}")
        if self.head_dim_override is None and self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")
        if not self.rope_theta > 0 or not self.norm_eps > 0:
            raise ValueError("rope_theta and norm_eps must be positive")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.dim // self.n_heads

    def kv_layout(self, block_size: int = 16) -> KVLayout:
        """The KV layout this model writes into pages."""
        return KVLayout(
            num_layers=self.n_layers,
            num_kv_heads=self.n_kv_heads,
            head_dim=self.head_dim,
            block_size=block_size,
            dtype=self.dtype,
        )

    def rope_canonical(self) -> dict[str, int | float | str]:
        """Position-encoding fields for the namespace (anything that changes K for a given position)."""
        out: dict[str, int | float | str] = {
            "kind": "rope", "style": ROPE_STYLE, "theta": float(self.rope_theta), "dim": self.head_dim,
        }
        if self.rope_scaling is not None:
            s = self.rope_scaling
            out.update({"scaling": s.kind, "factor": float(s.factor), "low_freq_factor": float(s.low_freq_factor),
                        "high_freq_factor": float(s.high_freq_factor),
                        "original_max_position_embeddings": s.original_max_position_embeddings})
        return out

    def canonical(self) -> dict[str, object]:
        """Every field, plain JSON-able values (float fields as floats). The checkpoint switches are
        listed only when set (see the module docstring)."""
        out = asdict(self)
        out["rope_theta"] = float(self.rope_theta)
        out["norm_eps"] = float(self.norm_eps)
        for name in ("head_dim_override", "rope_scaling"):
            if out[name] is None:
                del out[name]
        for name in ("qkv_bias", "o_bias", "qk_norm"):
            if not out[name]:
                del out[name]
        if self.rope_scaling is not None:
            out["rope_scaling"]["factor"] = float(self.rope_scaling.factor)
        return out


# vocab_size 260 = ByteTokenizer: 256 bytes + BOS, EOS, <|im_start|>, <|im_end|>.
PRESETS: dict[str, ModelConfig] = {
    # Fast enough for unit tests: a forward over a few hundred tokens takes milliseconds.
    "tiny": ModelConfig(
        vocab_size=260, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=1024
    ),
    # Default demo model: grouped-query attention (8 query heads share 2 KV heads); prefill of a
    # 2,048-token prompt takes about one second in fp32 on a 2-core CPU.
    "small": ModelConfig(
        vocab_size=260, dim=512, n_layers=12, n_heads=8, n_kv_heads=2, ffn_dim=1408, max_seq_len=4096
    ),
}


def preset(name: str) -> ModelConfig:
    """Return the preset config ``name``; unknown names raise ``ValueError`` listing the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None
