"""The tiny local model: deterministic bytes, offline loading by transformers, and its CLI."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvfleet.cli import main  # noqa: E402
from kvfleet.worker.model.tiny import MANIFEST_NAME, TinyModelError, make_tiny  # noqa: E402

FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    MANIFEST_NAME,
}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny") / "model")


def _contents(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in directory.iterdir()}


def test_same_seed_same_bytes_other_seed_other_weights(tiny_dir: Path, tmp_path: Path) -> None:
    again = make_tiny(tmp_path / "again", seed=0)
    assert set(_contents(tiny_dir)) == FILES
    assert _contents(again) == _contents(tiny_dir)
    other = make_tiny(tmp_path / "other", seed=1)
    assert (other / "model.safetensors").read_bytes() != (tiny_dir / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (tiny_dir / "tokenizer.json").read_bytes()


def test_second_call_leaves_the_directory_alone(tiny_dir: Path) -> None:
    before = {path.name: path.stat().st_mtime_ns for path in tiny_dir.iterdir()}
    assert make_tiny(tiny_dir) == tiny_dir
    assert {path.name: path.stat().st_mtime_ns for path in tiny_dir.iterdir()} == before


def test_refuses_a_directory_holding_something_else(tiny_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(TinyModelError, match="seed"):
        make_tiny(tiny_dir, seed=7)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(TinyModelError, match="not empty"):
        make_tiny(tmp_path / "busy")
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"
    # A damaged model is not taken for the real one.
    broken = make_tiny(tmp_path / "broken")
    (broken / "model.safetensors").write_bytes(b"")
    with pytest.raises(TinyModelError):
        make_tiny(broken)


def test_transformers_loads_it_offline(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    assert len(tokenizer) == 2048
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 0)
    ids = tokenizer("The KV cache of every request")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == "The KV cache of every request"
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<s>user: hi\nassistant:"

    model = transformers.LlamaForCausalLM.from_pretrained(tiny_dir)
    config = model.config
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (256, 2, 4)
    assert (config.num_key_value_heads, config.head_dim, config.vocab_size) == (2, 64, 2048)
    assert not config.tie_word_embeddings
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 2048)
    assert torch.isfinite(logits).all()


def test_cli_writes_and_refuses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "cli-model"
    assert main(["model", "make-tiny", str(target), "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert str(target) in out and "model.safetensors" in out
    assert set(_contents(target)) == FILES
    assert main(["model", "make-tiny", str(target), "--seed", "4"]) == 2
    err = capsys.readouterr().err
    assert "remove it or choose another directory" in err
