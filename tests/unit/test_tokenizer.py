"""The tokenizer: trained locally, special tokens atomic, and transformers renders our chat identically."""

from __future__ import annotations

import json

import pytest
from tokenizers import AddedToken

from realtime_rl.model import SPECIAL_TOKENS, Tokenizer, render_messages

TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "start": {"type": "integer"}},
                    "required": ["path"]}}},
    {"type": "function", "function": {"name": "run_tests", "description": "Run tests. Ünïcödé ok.",
     "parameters": {"type": "object", "properties": {}}}},
]
CONVERSATIONS = [
    [{"role": "user", "content": "hello"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Fix `f(x)`:\n\tdef f(x): return x+1"}],
    [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "Make the tests pass."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_0", "type": "function",
             "function": {"name": "read_file", "arguments": json.dumps({"path": "a.py", "start": 1})}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "def f():\n    return 1\n"},
        {"role": "assistant", "content": "Running both.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "run_tests", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "b.py"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1 failed"},
        {"role": "tool", "tool_call_id": "c2", "content": "x = 2"},
        {"role": "assistant", "content": "Done: 日本語 ✓"},
        {"role": "user", "content": "thanks"},
    ],
    # None content, which ChatMessage allows: ours rendered "", transformers' Jinja raised a TypeError
    [{"role": "system", "content": None}, {"role": "user", "content": None},
     {"role": "assistant", "content": None, "tool_calls": [
         {"id": "c", "type": "function", "function": {"name": "run_tests", "arguments": "{}"}}]},
     {"role": "tool", "tool_call_id": "c", "content": None}],
]


def test_special_tokens_are_single_ids_after_the_learned_vocabulary(tokenizer):
    ids = [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS]
    assert None not in ids and len(set(ids)) == len(ids)
    assert min(ids) == tokenizer.vocab_size - len(SPECIAL_TOKENS)
    for t, i in zip(SPECIAL_TOKENS, ids):
        assert tokenizer.encode(t) == [i]
        inside = tokenizer.encode(f"x = 1{t}def")
        assert inside.count(i) == 1 and tokenizer.decode(inside) == f"x = 1{t}def"


def test_encode_decode_round_trips_any_text(tokenizer):
    for text in ["def f(x):\n    return [y for y in x if y % 2 == 0]\n", "naïve café 日本 🙂 \t\r\n", ""]:
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_skip_special_tokens_keeps_tool_tags(tokenizer):
    text = '<|im_start|>assistant\n<tool_call>\n{"name": "x", "arguments": {}}\n</tool_call><|im_end|>'
    decoded = tokenizer.decode(tokenizer.encode(text), skip_special_tokens=True)
    assert "<tool_call>" in decoded and "<|im_start|>" not in decoded and "<|im_end|>" not in decoded


def test_training_is_deterministic():
    from realtime_rl.model import generate_corpus

    a = Tokenizer.train(generate_corpus(300, seed=3), vocab_size=600)
    b = Tokenizer.train(generate_corpus(300, seed=3), vocab_size=600)
    assert a.hf.to_str() == b.hf.to_str()


def test_too_small_vocab_is_rejected():
    with pytest.raises(ValueError, match="too small"):
        Tokenizer.train(["x"], vocab_size=100)


@pytest.mark.parametrize("use_tools", [False, True], ids=["no_tools", "tools"])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("gen_prompt", [False, True], ids=["no_gen", "gen"])
def test_transformers_apply_chat_template_matches_ours(tmp_path, tokenizer, use_tools, conv, gen_prompt):
    transformers = pytest.importorskip("transformers", reason="transformers is a dev dependency")
    tokenizer.save(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    messages, tools = CONVERSATIONS[conv], (TOOLS if use_tools else None)
    ours_text = render_messages(messages, tools, add_generation_prompt=gen_prompt)
    hf_text = hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen_prompt)
    assert hf_text == ours_text
    hf_ids = hf.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=gen_prompt,
                                    return_dict=False)
    assert list(hf_ids) == tokenizer.encode_chat(messages, tools, add_generation_prompt=gen_prompt)


def test_transformers_sees_the_same_special_tokens(tmp_path, tokenizer):
    transformers = pytest.importorskip("transformers", reason="transformers is a dev dependency")
    tokenizer.save(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf.eos_token_id == tokenizer.eos_token_id
    assert hf.pad_token_id == tokenizer.pad_token_id
    text = "x = 1<|im_end|>\n<tool_response>\nok\n</tool_response>"
    assert hf.encode(text, add_special_tokens=False) == tokenizer.encode(text)


def test_a_qwen3_style_tokenizer_json_loads_through_the_same_path(tmp_path, tokenizer):
    """A tokenizer.json laid out as Qwen3's: the ChatML tokens among extra added tokens at high ids.

    (No real Qwen3 file can be fetched here; this reproduces its structure: NFC, the Qwen split regex,
    byte-level BPE, and added tokens that include <think>, vision markers and the tool tags.)
    """
    data = json.loads(tokenizer.hf.to_str())
    extra = ["<|object_ref_start|>", "<|vision_start|>", "<think>", "</think>", "<|fim_prefix|>"]
    hf = tokenizer.hf.__class__.from_str(json.dumps(data))
    hf.add_tokens([AddedToken(t, special=t.startswith("<|"), normalized=False) for t in extra])
    hf.save(str(tmp_path / "tokenizer.json"))
    loaded = Tokenizer.from_dir(tmp_path)
    assert loaded.im_end_id == tokenizer.im_end_id
    assert loaded.encode("<think>")[0] == loaded.token_to_id("<think>")
    assert loaded.encode_chat(CONVERSATIONS[2], TOOLS) == tokenizer.encode_chat(CONVERSATIONS[2], TOOLS)


def test_a_tokenizer_without_chatml_tokens_is_rejected(tmp_path):
    from tokenizers import Tokenizer as HF, models

    HF(models.BPE()).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="ChatML"):
        Tokenizer.from_dir(tmp_path)


def test_a_number_is_split_whole_with_its_leading_space(tokenizer):
    """Up to three digits and the space before them are one piece (Qwen splits single digits and leaves the
    space alone): a constant the model copies is then keyed on the word before it, not on a space."""
    pieces = [p for p, _ in tokenizer.hf.pre_tokenizer.pre_tokenize_str("keep the first 12 of 1234, x7 -2")]
    assert [p.replace("\u0120", " ") for p in pieces] == [
        "keep", " the", " first", " 12", " of", " 123", "4", ",", " x", "7", " -", "2"]


def test_token_bytes_are_the_bytes_each_token_stands_for(tokenizer):
    """Concatenated, the tokens' bytes are the text's, characters split between tokens included (decode()
    of one such token is U+FFFD, whose bytes are not the token's)."""
    from realtime_rl.model.chat import IM_END

    text = f"def f():\n    return 'héllo 😀 中文 ünï'  # ok{IM_END}"
    ids = tokenizer.encode(text)
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == text.encode()
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # some token holds part of a character
    for i in range(tokenizer.vocab_size):  # every id maps (the byte-level table covers the vocabulary)
        assert tokenizer.token_bytes(i)
    past = tokenizer.vocab_size + 5  # a padded model row (Qwen3 has more rows than tokens): no token, no bytes
    assert tokenizer.token_bytes(past) == b"" and tokenizer.decode([past]) == ""
