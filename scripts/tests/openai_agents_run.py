"""Runs a 3-tool agent of the OpenAI Agents SDK (openai-agents) against `kvstore serve`
through its Chat Completions model, with a forced tool choice: every model turn must call a
tool, and the run finishes after the third call. Used by tests/tests/openai_client.rs.

Usage: openai_agents_run.py BASE_URL MODEL
Prints one JSON object per model turn (input_tokens, cached_tokens, tool calls) and a
final one with the tools that ran and the final output.
"""

import asyncio
import json
import sys

from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, RunConfig, Runner,
                    ToolsToFinalOutputResult, function_tool, set_tracing_disabled)
from openai import AsyncOpenAI

RAN = []


@function_tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    RAN.append("get_weather")
    return f"Sunny, 21 C in {city}."


@function_tool
def get_time(city: str) -> str:
    """The local time in a city."""
    RAN.append("get_time")
    return f"It is 14:05 in {city}."


@function_tool
def get_population(city: str) -> str:
    """The population of a city."""
    RAN.append("get_population")
    return f"{city} has about two million people."


def after_tools(context, results):
    # Finish after the third tool call, whatever the model would do next.
    if len(RAN) >= 3:
        return ToolsToFinalOutputResult(is_final_output=True,
                                        final_output="; ".join(str(r.output) for r in results))
    return ToolsToFinalOutputResult(is_final_output=False, final_output=None)


async def main():
    base_url, model_name = sys.argv[1], sys.argv[2]
    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=base_url, api_key="unused")
    model = OpenAIChatCompletionsModel(model=model_name, openai_client=client)
    agent = Agent(
        name="city facts",
        instructions="Answer questions about a city with the tools.",
        tools=[get_weather, get_time, get_population],
        model=model,
        model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                     temperature=0, max_tokens=48),
        tool_use_behavior=after_tools,
        reset_tool_choice=False,
    )
    result = await Runner.run(agent, "Tell me the weather, time and population of Paris.",
                              max_turns=6, run_config=RunConfig(tracing_disabled=True))
    for r in result.raw_responses:
        u = r.usage
        details = getattr(u, "input_tokens_details", None)
        print(json.dumps({"input_tokens": u.input_tokens,
                          "cached_tokens": getattr(details, "cached_tokens", None)}), flush=True)
    print(json.dumps({"ran": RAN, "final_output": str(result.final_output)}), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
