"""Model configuration of the reference Llama-style decoder, and the named presets.

``canonical()`` lists every architectural field; weight digests and the cache namespace are built
from it, so two configs that differ anywhere never share weights or cached KV.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from cachecore.layout import DTYPES, KVLayout

# RoPE flavour implemented by llama.py: rotate the two halves of each head (GPT-NeoX / HF Llama
# convention), not interleaved pairs. Part of the namespace: the two give different K.
ROPE_STYLE = "half"


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

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")
        if not self.rope_theta > 0 or not self.norm_eps > 0:
            raise ValueError("rope_theta and norm_eps must be positive")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

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
        return {"kind": "rope", "style": ROPE_STYLE, "theta": float(self.rope_theta), "dim": self.head_dim}

    def canonical(self) -> dict[str, int | float | str]:
        """Every field, plain JSON-able values (float fields as floats)."""
        out = asdict(self)
        out["rope_theta"] = float(self.rope_theta)
        out["norm_eps"] = float(self.norm_eps)
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
