"""Drives `kvstore serve` with the official `anthropic` Python SDK: messages.create and
messages.stream with tools and cache_control, a tool round trip, count_tokens, a cached
breakpoint read back within its TTL before and after other traffic forced evictions, and an
error. Used by tests/tests/anthropic_client.rs (the venv comes from scripts/setup.sh).

Usage: anthropic_messages.py BASE_URL API_KEY
Prints one JSON object with what each step saw; the Rust test asserts on it.
"""

import json
import sys

import anthropic

TOOLS = [{
    "name": "get_weather",
    "description": "The weather of a city today.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}]

PINNED_SYSTEM = (
    "You are the assistant of a weather desk. You answer questions about the weather of "
    "European cities in one short sentence. When you need today's data you call the "
    "get_weather tool with the city's name. You never invent figures, you never give advice "
    "about travel, and you always name the city you are talking about. "
) * 3

# Another client's long prompt, without a breakpoint: nothing protects it from eviction.
UNPINNED_SYSTEM = (
    "You are a librarian who recommends one novel per question, naming its author and the "
    "year it appeared, and explaining in one sentence why it fits the reader's request. "
) * 4


# Greedy decoding. SDK 2.x no longer takes sampling arguments (newer models fix them); the
# server still does, as Anthropic's API documents them.
SAMPLING = {"temperature": 0}


def usage(u):
    return {
        "input_tokens": u.input_tokens,
        "cache_creation_input_tokens": u.cache_creation_input_tokens,
        "cache_read_input_tokens": u.cache_read_input_tokens,
        "output_tokens": u.output_tokens,
    }


def pinned_system():
    return [{"type": "text", "text": PINNED_SYSTEM, "cache_control": {"type": "ephemeral", "ttl": "5m"}}]


def main():
    base_url, api_key = sys.argv[1], sys.argv[2]
    client = anthropic.Anthropic(base_url=base_url, api_key=api_key, max_retries=0)
    out = {}
    model = "claude-kvstore"

    # 1. messages.create with tools and a breakpoint after the system prompt.
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.messages.create(
        model=model, max_tokens=8, extra_body=SAMPLING, system=pinned_system(), tools=TOOLS,
        messages=question,
    )
    out["create"] = {
        "type": first.type, "role": first.role, "stop_reason": first.stop_reason,
        "content_types": [b.type for b in first.content], "usage": usage(first.usage),
    }
    out["count_tokens"] = client.messages.count_tokens(
        model=model, system=pinned_system(), tools=TOOLS, messages=question,
    ).input_tokens

    # 2. messages.stream, another question after the same system prompt and tools.
    with client.messages.stream(
        model=model, max_tokens=8, extra_body=SAMPLING, system=pinned_system(), tools=TOOLS,
        messages=[{"role": "user", "content": "And in Rome?"}],
    ) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    out["stream"] = {
        "events": events, "stop_reason": final.stop_reason,
        "text": "".join(b.text for b in final.content if b.type == "text"),
        "usage": usage(final.usage),
    }

    # 3. A tool round trip: the call and its result sent back, with the top-level
    #    cache_control (a breakpoint after the last block).
    turn = client.messages.create(
        cache_control={"type": "ephemeral"},
        model=model, max_tokens=8, extra_body=SAMPLING, system=pinned_system(), tools=TOOLS,
        messages=question + [
            {"role": "assistant", "content": [
                {"type": "text", "text": "Let me check."},
                {"type": "tool_use", "id": "toolu_client_1", "name": "get_weather", "input": {"city": "Paris"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_client_1", "content": "18 C and sunny"},
            ]},
        ],
    )
    out["tool_round_trip"] = {"stop_reason": turn.stop_reason, "usage": usage(turn.usage)}

    # 4. Other traffic: the unpinned prompt, then enough different prompts to push both out
    #    of every tier; then both again.
    def unpinned(q):
        return client.messages.create(
            model=model, max_tokens=4, extra_body=SAMPLING, system=UNPINNED_SYSTEM,
            messages=[{"role": "user", "content": q}],
        )
    out["unpinned_first"] = usage(unpinned("A novel about the sea?").usage)
    out["unpinned_again"] = usage(unpinned("A novel about the sea?").usage)
    for i in range(int(sys.argv[3]) if len(sys.argv) > 3 else 8):
        client.messages.create(
            model=model, max_tokens=4, extra_body=SAMPLING,
            system=f"Traffic {i}: " + ("filler words that share nothing with anyone %d " % i) * 30,
            messages=[{"role": "user", "content": f"Question {i}?"}],
        )
    out["unpinned_after"] = usage(unpinned("A novel about the sea?").usage)
    again = client.messages.create(
        model=model, max_tokens=8, extra_body=SAMPLING, system=pinned_system(), tools=TOOLS,
        messages=[{"role": "user", "content": "And in Madrid?"}],
    )
    out["pinned_after"] = usage(again.usage)

    # 5. An error in Anthropic's shape.
    try:
        client.messages.create(
            model=model, max_tokens=8, tools=TOOLS, tool_choice={"type": "tool", "name": "no_such_tool"},
            messages=question,
        )
        out["error"] = None
    except anthropic.BadRequestError as e:
        out["error"] = {"status": e.status_code, "type": e.body["error"]["type"], "message": e.body["error"]["message"]}

    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
