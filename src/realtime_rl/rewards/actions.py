"""What a completion choice did, in four kinds: the unit the reward rules and the monitors count.

    classify(choice) -> "malformed" | "edit" | "question" | "other"

The rule, first match wins:
  1. "malformed": the parser rejected at least one tool call (`choice.tool_call_errors`). The gateway
     then answered the whole text as content, so whatever else the text held never reached the client.
  2. tool calls the client received (finish_reason "tool_calls"):
     "edit" if any is write_file or edit_file; else "question" if any is ask_user; else "other".
  3. no tool calls: "question" if the content, trailing whitespace removed, ends with "?"; else "other".

The tool names are environments/tools.py's EDIT_TOOLS and QUESTION_TOOL, written out here so that this
library does not load the environments package (and torch) to read three strings; a test checks they agree.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, get_args

from realtime_rl.collect import ChoiceRecord

Action = Literal["edit", "question", "malformed", "other"]
ACTIONS: tuple[str, ...] = get_args(Action)
EDIT_TOOLS = frozenset({"write_file", "edit_file"})
QUESTION_TOOL = "ask_user"


def classify_reply(tool_names: Iterable[str], malformed: int, content: str) -> Action:
    """The rule above on the parts of a reply: the names of its well-formed tool calls, how many calls the
    parser rejected, and its text outside tool calls. The agent loop records these of its first turn, so an
    evaluation episode is classified exactly as the same reply served to a user would be."""
    if malformed:
        return "malformed"
    names = set(tool_names)
    if names:
        if names & EDIT_TOOLS:
            return "edit"
        return "question" if QUESTION_TOOL in names else "other"
    return "question" if content.rstrip().endswith("?") else "other"


def classify(choice: ChoiceRecord) -> Action:
    calls = choice.tool_calls if choice.finish_reason == "tool_calls" else []
    return classify_reply((call.function.name for call in calls), len(choice.tool_call_errors), choice.content or "")
