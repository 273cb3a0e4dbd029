"""Tools in a chat request: what the template is given, the grammar that forces a call, and
whether the answer is read for calls.

tool_choice:
- `none` (the default without tools): tools are not offered; the answer is plain content;
- `auto` (the default with tools): tools are offered; the `--tool-call-parser` reads calls out of
  the answer;
- `required` / a named function: the answer is constrained by a grammar to one call (or several,
  one per line, with parallel_tool_calls) in the Hermes format, whose arguments follow the
  function's parameters schema, with no property it does not declare unless the schema says
  otherwise (additionalProperties); it is read back with the Hermes parser, and a call cut by
  max_tokens is still reported, its arguments as far as they came.

A template that renders `tools` itself gets them as Hugging Face passes them. Otherwise (the
default model's template has no tools) the fallback below is used: the tools are described in
the system message with how to call them, past calls are written into the assistant messages
in the same format, and tool results go back as user messages wrapped in `<tool_response>`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gapless.frontend.api.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice, Tool
from gapless.frontend.api.schema_rules import closed_objects, strict_problem
from gapless.frontend.api.structured import Grammars
from gapless.frontend.http.errors import bad_request, too_deep
from gapless.frontend.http.json_depth import deeper_than

FALLBACK_PROMPT = """You can call functions to help answer. To call one, write
<tool_call>{{"name": "FUNCTION NAME", "arguments": {{ARGUMENTS AS A JSON OBJECT}}}}</tool_call>
{how_many} The result of a call comes back to you inside <tool_response></tool_response>. When no function helps, answer in plain text.
The functions, one JSON description per line:
<tools>
{tools}
</tools>"""
ONE_CALL = "Make at most one call per answer."
MANY_CALLS = "Several calls may follow one another, one per line."


@dataclass
class ToolPlan:
    offered: list[dict[str, Any]] | None  # the tools as the template sees them; None: not offered
    grammar: str | None  # forces a call (required, named)
    read_calls: bool  # read the answer for calls


async def plan_tools(body: ChatCompletionRequest, grammars: Grammars, tenant: str = "") -> ToolPlan:
    tools, choice = body.tools or [], body.tool_choice
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools hold two functions with the same name", param="tools")
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return ToolPlan(None, None, False)
    if not tools:
        raise bad_request(f"tool_choice {_choice_name(choice)} needs tools", param="tool_choice")
    offered = [_tool_dict(t) for t in tools]
    if choice == "auto":
        return ToolPlan(offered, None, True)
    forced = tools
    if isinstance(choice, NamedToolChoice):
        forced = [t for t in tools if t.function.name == choice.function.name]
        if not forced:
            raise bad_request(
                f"tool_choice names {choice.function.name!r}, which is not among the tools",
                param="tool_choice.function.name",
            )
    parallel = body.parallel_tool_calls is not False and not isinstance(choice, NamedToolChoice)
    grammar = await grammars.checked(_calls_grammar(forced, parallel), "tools", tenant)
    return ToolPlan(offered, grammar, True)


def _choice_name(choice: object) -> str:
    return choice if isinstance(choice, str) else "with a named function"


def _tool_dict(tool: Tool) -> dict[str, Any]:
    f = tool.function
    function: dict[str, Any] = {"name": f.name}
    if f.description is not None:
        function["description"] = f.description
    function["parameters"] = f.parameters if f.parameters is not None else {"type": "object"}
    return {"type": "function", "function": function}


def _calls_grammar(tools: list[Tool], parallel: bool) -> str:
    """A Lark grammar (llguidance) for Hermes-format calls of these tools, compact JSON. Each
    function's arguments are a %json rule of their own, so `$ref`s in its parameters resolve
    against its parameters; their objects are closed (schema_rules.closed_objects)."""
    import llguidance

    rules = []
    for i, tool in enumerate(tools):
        rules += _function_rules(tool, f"fn{i}")
    calls = " | ".join(f"fn{i}" for i in range(len(tools)))
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    lark = "\n".join([start, f'call: "<tool_call>" ({calls}) "</tool_call>"', *rules])
    return llguidance.LLMatcher.grammar_from_lark(lark + "\n")


def _function_rules(tool: Tool, rule: str) -> list[str]:
    """`{"name":NAME,"arguments":ARGS}` of one function, ARGS a %json of its parameters."""
    f = tool.function
    params = f.parameters if f.parameters is not None else {"type": "object"}
    where = f"function {f.name!r}"
    try:
        if f.strict and (problem := strict_problem(params)) is not None:
            raise bad_request(
                f"tools cannot be used: {where} is strict, and keyword {problem} of its "
                "parameters is not enforced by the grammar engine",
                param="tools",
            )
        schema = {
            **closed_objects(params),
            "x-guidance": {"whitespace_flexible": False, "lenient": not f.strict},
        }
        args = json.dumps(schema)
    except RecursionError:
        raise bad_request(
            f"tools: the parameters of {where} nest too deeply", param="tools"
        ) from None
    return [
        f'{rule}: "{{\\"name\\":" {rule}_name ",\\"arguments\\":" {rule}_args "}}"',
        f"{rule}_name: %json {json.dumps({'const': f.name})}",
        f"{rule}_args: %json {args}",
    ]


def template_messages(
    messages: list[ChatMessage], plan: ToolPlan, takes_tools: bool, parallel: bool
) -> list[dict[str, Any]]:
    """The messages as the template sees them (dicts), with the fallback applied when the
    template does not render tools itself."""
    out = [_message_dict(m, takes_tools, f"messages[{i}]") for i, m in enumerate(messages)]
    if takes_tools or plan.offered is None:
        return out
    lines = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in plan.offered)
    prompt = FALLBACK_PROMPT.format(how_many=MANY_CALLS if parallel else ONE_CALL, tools=lines)
    if out and out[0]["role"] == "system":
        out[0]["content"] = f"{out[0]['content']}\n\n{prompt}"
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out


def _message_dict(message: ChatMessage, takes_tools: bool, at: str) -> dict[str, Any]:
    content = message.content
    if content is None:
        content = ""
    elif not isinstance(content, str):
        content = "\n".join(part.text for part in content)
    role = "system" if message.role == "developer" else message.role
    out: dict[str, Any] = {"role": role, "content": content}
    if message.name is not None:
        out["name"] = message.name
    calls = message.tool_calls or []
    arguments = [
        _arguments(c.function.arguments, f"{at}.tool_calls[{j}].function.arguments")
        for j, c in enumerate(calls)
    ]
    if takes_tools:
        if message.tool_call_id is not None:
            out["tool_call_id"] = message.tool_call_id
        if calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": args},
                }
                for c, args in zip(calls, arguments, strict=True)
            ]
        return out
    if calls:  # the fallback: calls written as the model is asked to write them
        written = [
            "<tool_call>"
            + json.dumps({"name": c.function.name, "arguments": args}, ensure_ascii=False)
            + "</tool_call>"
            for c, args in zip(calls, arguments, strict=True)
        ]
        out["content"] = "\n".join([content, *written] if content else written)
    if role == "tool":
        out = {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    return out


def _arguments(text: str, param: str) -> Any:
    """Arguments as an object for the template (they travel as JSON text); text that is not
    JSON goes as it is, JSON nested past the bound is a 400 (json_depth.py)."""
    if deeper_than(text):
        raise too_deep(param, param)
    try:
        return json.loads(text)
    except ValueError:
        return text
