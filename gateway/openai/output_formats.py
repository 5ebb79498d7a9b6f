"""Which tool-call and reasoning formats a served model writes, read once at start-up.

Picked from the model's chat template (the tags it renders are the tags the model was
trained to write), unless the ``tool_call_parser`` / ``reasoning_parser`` settings
name one: ``auto`` (the default) detects, ``none`` turns parsing off.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.openai.output_parsing import REASONING_END, REASONING_START
from gateway.openai.tool_parsers import MISTRAL_TOOL_CALLS, PARSERS, PYTHON_TAG, TOOL_CALL_START

AUTO = "auto"
NONE = "none"
THINK = "think"
REASONING_PARSERS = (THINK,)

_TEMPLATE_MARKS = (
    (TOOL_CALL_START, "hermes"),
    (MISTRAL_TOOL_CALLS, "mistral"),
    (PYTHON_TAG, "llama3_json"),
)
"""A tag the chat template renders -> the format the model writes (first match wins)."""


@dataclass(frozen=True, slots=True)
class OutputFormats:
    tool_calls: str | None = None
    """A :data:`gateway.openai.tool_parsers.PARSERS` name; None: no known tool-call format."""
    reasoning: bool = False
    """The model thinks in ``<think>...</think>`` before it answers."""
    source: str = "no chat template was read"
    """Where the tool-call format came from (for the 400 of ``tool_choice: "auto"``)."""


NO_FORMATS = OutputFormats()


def detect(template: str | None, tool_call_parser: str, reasoning_parser: str) -> OutputFormats:
    """The formats of a model with chat template ``template``, or as the settings say."""
    if tool_call_parser not in (AUTO, NONE, *PARSERS):
        raise ValueError(
            f"tool_call_parser {tool_call_parser!r} is not one of auto, none, " + ", ".join(PARSERS)
        )
    if reasoning_parser not in (AUTO, NONE, *REASONING_PARSERS):
        raise ValueError(f"reasoning_parser {reasoning_parser!r} is not one of auto, none, think")
    tools, source = _tool_format(template or "", tool_call_parser)
    if reasoning_parser == AUTO:
        reasoning = REASONING_START in (template or "") or REASONING_END in (template or "")
    else:
        reasoning = reasoning_parser == THINK
    return OutputFormats(tools, reasoning, source)


def _tool_format(template: str, setting: str) -> tuple[str | None, str]:
    if setting == NONE:
        return None, "the tool_call_parser setting is none"
    if setting != AUTO:
        return setting, "the tool_call_parser setting"
    for mark, name in _TEMPLATE_MARKS:
        if mark in template:
            return name, f"its chat template renders {mark}"
    return None, "its chat template renders no known tool-call tags"
