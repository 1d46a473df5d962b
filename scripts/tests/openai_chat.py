"""Drives `kvstore serve` with the official `openai` Python client: a multi-turn streaming
chat. Used by tests/tests/openai_client.rs (the venv comes from scripts/setup.sh).

Usage: openai_chat.py BASE_URL MODEL TURNS
Prints one JSON object per turn: chunks with text, the text, cached_tokens, prompt_tokens.
"""

import json
import sys

from openai import OpenAI


def main():
    base_url, model, turns = sys.argv[1], sys.argv[2], int(sys.argv[3])
    client = OpenAI(base_url=base_url, api_key="unused")
    messages = [{"role": "system", "content": "You are a terse assistant that answers in one line."}]
    questions = [
        "Name a colour of the sky at dusk and explain why in a few words.",
        "Now name a colour of the sea at noon.",
        "And the colour of a lemon?",
        "Which of these three colours is warmest?",
    ]
    for t in range(turns):
        messages.append({"role": "user", "content": questions[t % len(questions)]})
        stream = client.chat.completions.create(
            model=model, messages=messages, stream=True, max_tokens=12, temperature=0,
            stream_options={"include_usage": True},
        )
        pieces, usage = [], None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        text = "".join(pieces)
        details = usage.prompt_tokens_details if usage is not None else None
        print(json.dumps({
            "chunks": len(pieces),
            "text": text,
            "prompt_tokens": usage.prompt_tokens if usage is not None else None,
            "cached_tokens": details.cached_tokens if details is not None else None,
        }), flush=True)
        messages.append({"role": "assistant", "content": text})


if __name__ == "__main__":
    main()
