"""Drives `kvstore serve` with the official `openai` Python client through a tool loop:
the client executes the tools. Turn 1 names a function (streamed), turn 2 requires a call
(streamed), turn 3 asks for a `json_schema` document, validated with `jsonschema`. Then bad
input: an unknown function in tool_choice, a malformed schema, too many tools.
Used by tests/tests/openai_client.rs (the venv comes from scripts/setup.sh).

Usage: openai_tools.py BASE_URL MODEL
Prints one JSON object per turn (name, arguments, prompt_tokens, cached_tokens, valid) and
one per bad request (status, error type, param).
"""

import json
import sys

import jsonschema
import openai
from openai import OpenAI

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The local time in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 20}},
            "required": ["city"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ANSWER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20},
    "temperature": {"type": "integer", "minimum": -50, "maximum": 60},
    "sunny": {"type": "boolean"}},
    "required": ["city", "temperature", "sunny"], "additionalProperties": False}


def run_tool(name, args):
    if name == "get_weather":
        return json.dumps({"city": args["city"], "temperature": 21, "sky": "sunny"})
    return json.dumps({"city": args["city"], "time": "14:05"})


def streamed_call(client, model, messages, tool_choice):
    stream = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice=tool_choice,
        parallel_tool_calls=False, stream=True, max_tokens=48, temperature=0,
        stream_options={"include_usage": True})
    calls, usage, finish = {}, None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        if chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        for d in chunk.choices[0].delta.tool_calls or []:
            c = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            c["id"] += d.id or ""
            if d.function is not None:
                c["name"] += d.function.name or ""
                c["arguments"] += d.function.arguments or ""
    return [calls[i] for i in sorted(calls)], usage, finish


def main():
    base_url, model = sys.argv[1], sys.argv[2]
    client = OpenAI(base_url=base_url, api_key="unused")
    messages = [{"role": "user", "content": "What is the weather in Paris, and what time is it there?"}]
    for choice in [{"type": "function", "function": {"name": "get_weather"}}, "required"]:
        calls, usage, finish = streamed_call(client, model, messages, choice)
        call = calls[0]
        args = json.loads(call["arguments"])
        valid = True
        try:
            jsonschema.validate(args, SCHEMAS[call["name"]])
        except jsonschema.ValidationError:
            valid = False
        print(json.dumps({"name": call["name"], "arguments": args, "calls": len(calls),
                          "finish": finish, "prompt_tokens": usage.prompt_tokens,
                          "cached_tokens": usage.prompt_tokens_details.cached_tokens,
                          "valid": valid}), flush=True)
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": call["id"], "type": "function",
             "function": {"name": call["name"], "arguments": call["arguments"]}}]})
        messages.append({"role": "tool", "tool_call_id": call["id"],
                         "content": run_tool(call["name"], args)})
    r = client.chat.completions.create(
        model=model, messages=messages, max_tokens=64, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}})
    doc = json.loads(r.choices[0].message.content)
    jsonschema.validate(doc, ANSWER)
    print(json.dumps({"name": "answer", "arguments": doc, "finish": r.choices[0].finish_reason,
                      "prompt_tokens": r.usage.prompt_tokens,
                      "cached_tokens": r.usage.prompt_tokens_details.cached_tokens,
                      "valid": True}), flush=True)
    bad = [
        dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "launch"}}),
        dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "banana"}}}}}], tool_choice="required"),
        dict(tools=[{"type": "function", "function": {"name": f"f{i}"}} for i in range(200)]),
    ]
    for extra in bad:
        try:
            client.chat.completions.create(model=model, messages=messages[:1], max_tokens=4,
                                           **extra)
            print(json.dumps({"status": 200}), flush=True)
        except openai.BadRequestError as e:
            err = e.body if isinstance(e.body, dict) else {}
            print(json.dumps({"status": e.status_code, "type": err.get("type"),
                              "param": err.get("param"), "message": err.get("message")}),
                  flush=True)


if __name__ == "__main__":
    main()
