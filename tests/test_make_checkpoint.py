"""``python -m bench.make_checkpoint DIR``: the README's one command for a checkpoint to try writes
one that both engines accept, and never writes into a directory that holds something."""

from __future__ import annotations

import pytest

from bench import make_checkpoint
from cachecore.model.checkpoint import inspect_checkpoint


def test_make_checkpoint_writes_a_checkpoint_both_engines_accept(tmp_path, capsys):
    target = tmp_path / "ckpt"
    assert make_checkpoint.main([str(target)]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {
        p.name for p in target.iterdir()}
    assert f"STRATA_DEMO_MODEL={target}" in capsys.readouterr().out
    for engine in ("strata", "vllm"):
        info = inspect_checkpoint(target, engine=engine)
        assert info.config.model.n_layers == 2 and info.config.model.head_dim == 64


def test_make_checkpoint_refuses_a_directory_that_is_not_empty(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit) as exit_:
        make_checkpoint.main([str(tmp_path)])
    assert exit_.value.code == 2 and [p.name for p in tmp_path.iterdir()] == ["keep.txt"]
