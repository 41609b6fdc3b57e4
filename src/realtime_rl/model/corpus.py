"""A generated text corpus for training the tokenizer: Python code, English instructions, and agent
transcripts in our chat format with tool calls and tool responses. Deterministic by seed.

It covers what the tokenizer will see (identifiers, indentation, operators, JSON, ChatML) so that BPE
merges are spent on it; the pre-training corpus of agent episodes is built elsewhere (train/).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

from realtime_rl.model.chat import render_messages

_NOUNS = ["items", "values", "words", "numbers", "scores", "names", "lines", "records", "text", "data", "nums", "xs"]
_VERBS = ["count", "sum", "filter", "find", "sort", "reverse", "merge", "split", "join", "clean", "scale", "pick"]
_PREDICATES = [
    ("x % 2 == 0", "even"), ("x > 0", "positive"), ("x < {k}", "smaller than {k}"), ("len(x) > {k}", "longer than {k}"),
    ("x.isupper()", "upper case"), ("x != {k}", "different from {k}"), ("x >= {k}", "at least {k}"),
]
_MAPS = [("x * {k}", "multiplied by {k}"), ("x + {k}", "plus {k}"), ("x.strip()", "stripped"),
         ("x.lower()", "lower-cased"), ("x[::-1]", "reversed"), ("abs(x)", "made absolute"), ("x ** 2", "squared")]
_REDUCERS = [("sum({v})", "the sum"), ("len({v})", "how many remain"), ("max({v}, default=0)", "the largest"),
             ("sorted({v})", "them sorted"), ("list({v})", "them as a list"), ("min({v}, default=0)", "the smallest")]
_TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
    {"type": "function", "function": {"name": "write_file", "description": "Write a file.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                    "required": ["path", "content"]}}},
    {"type": "function", "function": {"name": "run_tests", "description": "Run the visible tests.",
     "parameters": {"type": "object", "properties": {}}}},
]


def _function(rng: random.Random) -> tuple[str, str, str]:
    """(name, source, english description) of a small list-processing function."""
    k = rng.randint(0, 9)
    noun = rng.choice(_NOUNS)
    name = f"{rng.choice(_VERBS)}_{noun}"
    pred, pred_en = (s.format(k=k) for s in rng.choice(_PREDICATES))
    fn, fn_en = (s.format(k=k) for s in rng.choice(_MAPS))
    red, red_en = rng.choice(_REDUCERS)
    if rng.random() < 0.5:
        body = f"    result = [{fn} for x in {noun} if {pred}]\n    return {red.format(v='result')}\n"
    else:
        body = (f"    result = []\n    for x in {noun}:\n        if {pred}:\n            result.append({fn})\n"
                f"    return {red.format(v='result')}\n")
    source = f"def {name}({noun}):\n{body}"
    english = f"Write `{name}({noun})`: keep the elements that are {pred_en}, {fn_en}, and return {red_en}."
    return name, source, english


def _test(name: str, rng: random.Random) -> str:
    args = [rng.randint(-9, 9) for _ in range(rng.randint(0, 5))]
    return f"from solution import {name}\n\n\ndef test_{name}():\n    assert {name}({args!r}) is not None\n"


def _transcript(rng: random.Random) -> str:
    name, source, english = _function(rng)
    passed = rng.random() < 0.5
    messages = [
        {"role": "system", "content": "You are a careful coding agent. Use the tools, then submit."},
        {"role": "user", "content": english},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_0", "type": "function", "function": {
            "name": "write_file", "arguments": json.dumps({"path": "solution.py", "content": source})}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "wrote solution.py"},
        {"role": "assistant", "content": "Now the tests.", "tool_calls": [{"id": "call_1", "type": "function",
                                                                          "function": {"name": "run_tests", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1",
         "content": "1 passed in 0.01s" if passed else f"FAILED test_solution.py::test_{name} - AssertionError"},
        {"role": "assistant", "content": "All tests pass." if passed else "A test fails; let me read the file."},
    ]
    return render_messages(messages, tools=_TOOLS)


def generate_corpus(num_documents: int, seed: int = 0) -> Iterator[str]:
    """Yield `num_documents` documents: a third code, a third code with tests, a third transcripts."""
    rng = random.Random(seed)
    for i in range(num_documents):
        kind = i % 3
        if kind == 0:
            yield _function(rng)[1]
        elif kind == 1:
            name, source, english = _function(rng)
            yield f'"""{english}"""\n\n\n{source}\n\n{_test(name, rng)}'
        else:
            yield _transcript(rng)
