"""The suite's name for ``bench._checkpoints`` (small random Hugging Face checkpoints), which
``python -m bench.make_checkpoint`` also uses outside the tests."""

from bench._checkpoints import (  # noqa: F401
    CHATML,
    CORPUS,
    KINDS,
    SPECIALS,
    VLLM_CPU_SHAPE,
    VLLM_ONLY_KINDS,
    build_checkpoint,
    train_tokenizer,
)
