"""The tool-call parser: well-formed calls come out in the OpenAI shape; malformed ones are reported."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from realtime_rl.model import parse_assistant, render_messages
from realtime_rl.types import ChatMessage

TOOLS = [
    {"type": "function", "function": {"name": "edit_file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}, "old": {"type": "string"}, "new": {"type": "string"}},
        "required": ["path", "old", "new"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "submit", "parameters": {"type": "object", "properties": {}}}},
]


def call(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


def test_content_and_several_calls():
    text = "I will edit it.\n" + call('{"name": "edit_file", "arguments": {"path": "a.py", "old": "x", "new": "y"}}') \
        + "\n" + call('{"name": "submit", "arguments": {}}')
    parsed = parse_assistant(text, TOOLS)
    assert parsed.ok and parsed.content == "I will edit it."
    assert [c.function.name for c in parsed.tool_calls] == ["edit_file", "submit"]
    assert json.loads(parsed.tool_calls[0].function.arguments) == {"path": "a.py", "old": "x", "new": "y"}
    assert len({c.id for c in parsed.tool_calls}) == 2


def test_plain_text_has_no_calls():
    parsed = parse_assistant("Just an answer.", TOOLS)
    assert parsed.ok and parsed.content == "Just an answer." and parsed.tool_calls == []


@pytest.mark.parametrize("text, kind, fragment", [
    (call('{"name": "submit", "arguments": {}'), "bad_json", "not valid JSON"),
    (call('["submit"]'), "not_an_object", "JSON object"),
    (call('{"arguments": {}}'), "missing_name", '"name"'),
    (call('{"name": "delete_repo", "arguments": {}}'), "unknown_tool", "unknown tool 'delete_repo'"),
    (call('{"name": "submit"}'), "missing_arguments", '"arguments"'),
    (call('{"name": "edit_file", "arguments": {"path": "a.py"}}'), "missing_arguments", "old, new"),
    (call('{"name": "edit_file", "arguments": [1]}'), "bad_arguments", "must be an object"),
    (call('{"name": "edit_file", "arguments": {"path": "a", "old": "b", "new": "c", "force": true}}'),
     "bad_arguments", "force"),
    ('<tool_call>\n{"name": "submit", "arguments": {}}', "unclosed", "never closed"),
    ('text </tool_call>', "unopened", "without a matching"),
])
def test_malformed_calls_are_reported_precisely(text, kind, fragment):
    parsed = parse_assistant(text, TOOLS)
    assert not parsed.ok and parsed.tool_calls == []
    assert parsed.errors[0].kind == kind
    assert fragment in parsed.errors[0].message


@pytest.mark.parametrize("body, kind", [
    ("[" * 5000, "bad_json"),
    ('{"name": "submit", "arguments": {"n": ' + "1" * 5000 + "}}", "bad_json"),
    (json.dumps({"name": "submit", "arguments": "[" * 5000}), "bad_arguments"),
    (json.dumps({"name": "submit", "arguments": '{"n": ' + "1" * 5000 + "}"}), "bad_arguments"),
])
def test_json_too_deep_or_too_long_for_python_is_reported_not_raised(body, kind):
    """Python's json raises RecursionError on deep nesting and ValueError on an integer past 4300 digits;
    the gateway and the agent loop parse model output, so these must be errors, not exceptions."""
    parsed = parse_assistant(call(body), TOOLS)
    assert parsed.tool_calls == [] and [e.kind for e in parsed.errors] == [kind]


@pytest.mark.parametrize("arguments, kind", [
    ('{"path": "a", "old": "b", "new": "P\\ud800"}', "bad_json"),  # a lone surrogate: no UTF-8 to send it in
    ('{"path": "a", "old": "b", "new": NaN}', "bad_json"), ('{"path": "a", "old": "b", "new": 1e999}', "bad_json"),
    (json.dumps('{"path": "a", "old": "b", "new": Infinity}'), "bad_arguments"),
])
def test_json_that_cannot_go_back_out_as_json_is_reported(arguments, kind):
    """A call the gateway could not serialize (to its client, or into the store) is malformed, not a 500."""
    parsed = parse_assistant(call(f'{{"name": "edit_file", "arguments": {arguments}}}'), TOOLS)
    assert parsed.tool_calls == [] and [e.kind for e in parsed.errors] == [kind]
    parsed.model_dump_json()  # the errors themselves serialize
    pair = '{"path": "a", "old": "b", "new": "\\ud83d\\ude00"}'  # a surrogate pair is one character
    ok = parse_assistant(call(f'{{"name": "edit_file", "arguments": {pair}}}'), TOOLS)
    assert ok.ok and json.loads(ok.tool_calls[0].function.arguments)["new"] == "\N{GRINNING FACE}"


def test_a_bad_call_does_not_hide_a_good_one():
    text = call("{oops") + call('{"name": "submit", "arguments": {}}')
    parsed = parse_assistant(text, TOOLS)
    assert [e.index for e in parsed.errors] == [0]
    assert parsed.tool_calls[0].function.name == "submit" and parsed.tool_calls[0].id == "call_1"


def test_arguments_given_as_a_json_string_are_accepted():
    parsed = parse_assistant(call('{"name": "submit", "arguments": "{}"}'), TOOLS)
    assert parsed.ok and parsed.tool_calls[0].function.arguments == "{}"


def test_without_tools_any_name_is_accepted():
    parsed = parse_assistant(call('{"name": "anything", "arguments": {"a": 1}}'))
    assert parsed.ok and parsed.tool_calls[0].function.name == "anything"


@pytest.mark.parametrize("name", ['a"b', "two words", "x" * 65, "tab\tname"])
def test_a_name_no_function_can_have_is_refused_even_without_tools(name):
    """Rendered back unescaped in every later prompt, a name with a quote broke the JSON of the call."""
    parsed = parse_assistant(call(json.dumps({"name": name, "arguments": {}})))
    assert not parsed.ok and parsed.errors[0].kind == "missing_name"
    assert parse_assistant(call('{"name": "pkg.tool-v2_x", "arguments": {}}')).ok


def test_render_then_parse_round_trips_an_assistant_turn():
    msg = ChatMessage.model_validate({"role": "assistant", "content": "Editing.", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "edit_file",
         "arguments": json.dumps({"path": "a.py", "old": "1", "new": "2"})}}]})
    text = render_messages([msg])
    body = text.removeprefix("<|im_start|>assistant\n").removesuffix("<|im_end|>\n")
    parsed = parse_assistant(body, TOOLS)
    assert parsed.ok and parsed.content == "Editing."
    assert parsed.tool_calls == msg.tool_calls


_PIECES = ["<tool_call>", "</tool_call>", "{", "}", '"name"', ":", '"arguments"', "[", '"', "x", "\n", " ", "submit"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=40).map("".join) | st.text(max_size=80))
def test_parser_never_raises_on_garbage(text):
    parsed = parse_assistant(text, TOOLS)
    assert len(parsed.tool_calls) + len(parsed.errors) <= text.count("<tool_call>") + text.count("</tool_call>")
