#!/usr/bin/env python3
"""One phase of bench/prefix_restart.sh: requests against a running cluster
with the official `openai` client, printing one JSON line per request.

A request is a chat completion whose system message is one of the benchmark's
long system prompts (deterministic text, ~3,000 tokens each) and whose user
message is a question; it is streamed with usage, and TTFT is the time from
sending the request to the first content chunk.

usage: prefix_restart.py BASE_URL MODEL PHASE PREFIXES QUESTION_SEED
"""
import json
import sys
import time

import openai
from openai import OpenAI

TOPICS = ["astronomy", "botany", "chemistry", "geology", "history", "linguistics", "music",
          "oceanography", "physics", "zoology", "architecture", "medicine"]


def system_prompt(i: int, words: int = 1530) -> str:
    """A long, deterministic system prompt (about 3,000 SmolLM2 tokens)."""
    topic = TOPICS[i % len(TOPICS)]
    lines = [f"You are the reference assistant of library {i} on {topic}. "
             f"Answer briefly. The catalogue below is authoritative."]
    n = 0
    k = 0
    while n < words:
        line = (f"Entry {k} of shelf {i}: volume {k * 7 + i} on {topic} was catalogued in "
                f"year {1800 + (k * 13 + i) % 220}, holds {(k * 37 + 11 * i) % 900 + 100} pages, "
                f"and sits in room {(k * 5 + i) % 40}.")
        lines.append(line)
        n += len(line.split())
        k += 1
    return "\n".join(lines)


def question(seed: int, i: int) -> str:
    return f"Question {seed}: in which year was volume {(seed * 3 + i) % 50 * 7 + i} catalogued?"


def main() -> int:
    base, model, phase, prefixes, seed = sys.argv[1], sys.argv[2], sys.argv[3], int(
        sys.argv[4]), int(sys.argv[5])
    client = OpenAI(base_url=base, api_key="unused", timeout=900, max_retries=0)
    for i in range(prefixes):
        # A 503 ("no decode worker has room") right after the previous request:
        # the coordinator's view of the decode pool is refreshed by heartbeats.
        # Retry after a second; TTFT counts from the attempt that was served.
        retries = 0
        while True:
            t0 = time.perf_counter()
            ttft = None
            usage = None
            text = []
            try:
                stream = client.chat.completions.create(
                    model=model,
                    messages=[{"role": "system", "content": system_prompt(i)},
                              {"role": "user", "content": question(seed, i)}],
                    max_tokens=8, temperature=0, stream=True,
                    stream_options={"include_usage": True})
            except openai.InternalServerError as e:
                if e.status_code == 503 and retries < 30:
                    retries += 1
                    time.sleep(1.0)
                    continue
                raise
            break
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        total = time.perf_counter() - t0
        cached = 0
        if usage is not None and usage.prompt_tokens_details is not None:
            cached = usage.prompt_tokens_details.cached_tokens or 0
        print(json.dumps({
            "phase": phase, "prefix": i, "ttft_s": ttft if ttft is not None else total,
            "total_s": total, "prompt_tokens": usage.prompt_tokens if usage else None,
            "cached_tokens": cached, "retries_503": retries, "text": "".join(text)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
