"""Tokenizer loading, left padding, decoding and chat templates, on a tokenizer built here."""

import json

import numpy as np
import pytest

from genjax.errors import CheckpointError, InputError
from genjax.io import tokenizer as T
from genjax.testing import tiny_bpe_tokenizer

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CORPUS = ["def fibonacci(n):\n    return n", "hello world, hello tokens"] * 20


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from tokenizers import processors

    backend = tiny_bpe_tokenizer(CORPUS)
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    path = tmp_path_factory.mktemp("tok")
    backend.save(str(path / "tokenizer.json"))
    config = {
        "bos_token": "<s>",
        "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True},
        "pad_token": "<pad>",
        "chat_template": TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def test_encode_left_pads_and_decodes_back(folder):
    tok = T.from_pretrained(folder)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    batch = tok(["hello", "def fibonacci(n):"])
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert ids.dtype == np.int32 and ids.shape == mask.shape
    short = int(mask[0].sum())
    assert short < ids.shape[1]
    np.testing.assert_array_equal(ids[0, : ids.shape[1] - short], 0)  # left padding
    np.testing.assert_array_equal(mask[0], [0] * (ids.shape[1] - short) + [1] * short)
    assert ids[0, -short] == 1 and ids[1, 0] == 1  # BOS first, from the post-processor
    assert tok.batch_decode(ids, skip_special_tokens=True) == ["hello", "def fibonacci(n):"]


def test_chat_template_renders_and_tokenizes_without_extra_specials(folder):
    tok = T.from_pretrained(folder)
    chat = [{"role": "user", "content": "hello"}]
    text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert text == "<|user|>hello</s>\n<|assistant|>"
    ids = tok.apply_chat_template(chat, add_generation_prompt=True)
    assert ids == tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text


def test_chat_template_is_sandboxed_and_errors_are_clear(folder, tmp_path):
    tok = T.from_pretrained(folder)
    escape = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(Exception, match="unsafe|access"):
        tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template=escape)
    with pytest.raises(InputError, match="does not parse"):
        tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template="{% if %}")
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        T.from_pretrained(tmp_path)


def test_truncated_files_are_named_in_one_clear_error(folder, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        copy = tmp_path / name.replace(".", "_")
        copy.mkdir()
        for source in folder.iterdir():
            (copy / source.name).write_bytes(source.read_bytes())
        text = (copy / name).read_bytes()
        (copy / name).write_bytes(text[: len(text) // 2])  # an interrupted download
        with pytest.raises(CheckpointError) as info:
            T.from_pretrained(copy)
        assert str(copy / name) in str(info.value)
        assert "truncated" in str(info.value) or "not valid JSON" in str(info.value)


@pytest.mark.parity
def test_matches_transformers(folder):
    from transformers import AutoTokenizer

    ours = T.from_pretrained(folder)
    theirs = AutoTokenizer.from_pretrained(folder)
    theirs.padding_side = "left"
    texts = ["hello", "def fibonacci(n):\n    return n"]
    expected = theirs(texts, padding=True, return_tensors="np")
    got = ours(texts)
    np.testing.assert_array_equal(got["input_ids"], expected["input_ids"])
    np.testing.assert_array_equal(got["attention_mask"], expected["attention_mask"])
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    for prompt in (True, False):
        assert ours.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=False) == (
            theirs.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=False)
        )
