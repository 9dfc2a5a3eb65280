"""Drives a kvrelay coordinator with the official `openai` Python client.

usage: openai_client_check.py BASE_URL MODEL
Prints one JSON object with what each call returned; exits non-zero (with the
reason on stderr) when a call does not behave as the client library expects.
"""
import json
import sys

import openai


def main() -> int:
    base_url, model = sys.argv[1], sys.argv[2]
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)
    out = {}

    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12, temperature=0)
    out["chat"] = {
        "id": chat.id, "object": chat.object, "content": chat.choices[0].message.content,
        "role": chat.choices[0].message.role, "finish_reason": chat.choices[0].finish_reason,
        "prompt_tokens": chat.usage.prompt_tokens, "completion_tokens": chat.usage.completion_tokens,
        "cached_tokens": chat.usage.prompt_tokens_details.cached_tokens,
    }

    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True})
    pieces, finish, usage, chunks = [], None, None, 0
    for chunk in stream:
        chunks += 1
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
            if choice.finish_reason:
                finish = choice.finish_reason
    out["chat_stream"] = {
        "content": "".join(pieces), "chunks": chunks, "finish_reason": finish,
        "completion_tokens": usage.completion_tokens if usage else None,
        "cached_tokens": usage.prompt_tokens_details.cached_tokens if usage else None,
    }

    comp = client.completions.create(model=model, prompt="The capital of France is",
                                     max_tokens=8, temperature=0)
    out["completion"] = {"text": comp.choices[0].text, "finish_reason": comp.choices[0].finish_reason,
                         "object": comp.object, "prompt_tokens": comp.usage.prompt_tokens}

    cstream = client.completions.create(model=model, prompt="The capital of France is",
                                        max_tokens=8, temperature=0, stream=True)
    out["completion_stream"] = {"text": "".join(c.choices[0].text for c in cstream if c.choices)}

    out["models"] = [m.id for m in client.models.list().data]

    multi = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=4, temperature=0, n=2)
    out["n_choices"] = {"indexes": [c.index for c in multi.choices],
                        "same": multi.choices[0].message.content == multi.choices[1].message.content,
                        "completion_tokens": multi.usage.completion_tokens}

    # #18: logprobs / top_logprobs, non-streamed and streamed, and logit_bias.
    question = [{"role": "user", "content": "What is the capital of France?"}]
    lp = client.chat.completions.create(model=model, messages=question, max_tokens=6,
                                        temperature=0, logprobs=True, top_logprobs=2)
    content = lp.choices[0].logprobs.content
    out["chat_logprobs"] = {
        "text": lp.choices[0].message.content, "completion_tokens": lp.usage.completion_tokens,
        "tokens": [c.token for c in content], "logprobs": [c.logprob for c in content],
        "top_sizes": [len(c.top_logprobs) for c in content],
        "top_first": [c.top_logprobs[0].logprob for c in content],
        "bytes_ok": all(bytes(c.bytes).decode("utf-8", "replace") == c.token for c in content),
    }
    tokens, logprobs = [], []
    for chunk in client.chat.completions.create(model=model, messages=question, max_tokens=6,
                                                temperature=0, logprobs=True, top_logprobs=2,
                                                stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.content:
                tokens += [c.token for c in choice.logprobs.content]
                logprobs += [c.logprob for c in choice.logprobs.content]
    out["chat_logprobs_stream"] = {"tokens": tokens, "logprobs": logprobs}
    clp = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8,
                                    temperature=0, logprobs=3)
    out["completion_logprobs"] = {"tokens": clp.choices[0].logprobs.tokens,
                                  "top_sizes": [len(t) for t in clp.choices[0].logprobs.top_logprobs],
                                  "text": clp.choices[0].text}
    biased = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4,
                                       temperature=0, logit_bias={"28": 100})
    out["logit_bias"] = {"text": biased.choices[0].text,
                         "completion_tokens": biased.usage.completion_tokens}

    # #18: tools. A named and a required tool_choice are grammar-constrained:
    # the call's arguments are valid JSON for the function's parameters.
    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 24},
            "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}
    clock = {"type": "function", "function": {
        "name": "get_time", "parameters": {"type": "object", "properties": {
            "timezone": {"type": "string", "maxLength": 24}}, "required": ["timezone"]}}}
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = client.chat.completions.create(
        model=model, messages=ask, max_tokens=64, temperature=0, tools=[weather, clock],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = named.choices[0].message.tool_calls[0]
    args = json.loads(call.function.arguments)
    out["tool_named"] = {"finish_reason": named.choices[0].finish_reason,
                         "content": named.choices[0].message.content, "name": call.function.name,
                         "id": call.id, "type": call.type, "args": args}
    required = client.chat.completions.create(
        model=model, messages=ask, max_tokens=64, temperature=0, tools=[weather, clock],
        tool_choice="required")
    rcall = required.choices[0].message.tool_calls[0]
    out["tool_required"] = {"name": rcall.function.name,
                            "args": json.loads(rcall.function.arguments)}
    streamed_name, streamed_args, sfinish = None, "", None
    for chunk in client.chat.completions.create(
            model=model, messages=ask, max_tokens=64, temperature=0, tools=[weather, clock],
            tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True):
        for choice in chunk.choices:
            for tc in choice.delta.tool_calls or []:
                streamed_name = tc.function.name or streamed_name
                streamed_args += tc.function.arguments or ""
            sfinish = choice.finish_reason or sfinish
    out["tool_stream"] = {"name": streamed_name, "args": json.loads(streamed_args),
                          "finish_reason": sfinish}
    # The call and its result in the history render (role tool, assistant tool_calls).
    followup = client.chat.completions.create(
        model=model, max_tokens=16, temperature=0, tools=[weather], tool_choice="none",
        messages=ask + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.id, "type": "function",
                 "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}])
    out["tool_followup"] = {"content": followup.choices[0].message.content,
                            "tool_calls": followup.choices[0].message.tool_calls}

    # #18: structured output through the client (strict json_schema), whole and streamed.
    schema = {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}, "population": {"type": "integer"}},
        "required": ["city", "population"], "additionalProperties": False}
    rf = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}
    ask_city = [{"role": "user", "content": "Name a large city and its population as JSON."}]
    so = client.chat.completions.create(model=model, messages=ask_city, max_tokens=48,
                                        temperature=0, response_format=rf)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=model, messages=ask_city, max_tokens=48, temperature=0, response_format=rf,
        stream=True) if c.choices)
    out["structured"] = {"parsed": json.loads(so.choices[0].message.content),
                         "finish_reason": so.choices[0].finish_reason,
                         "stream_equal": streamed == so.choices[0].message.content}
    # #18: a prompt array on /v1/completions: one choice per prompt, in order.
    batch = client.completions.create(model=model, prompt=["The capital of France is", "1, 2, 3,"],
                                      max_tokens=6, temperature=0)
    solo = client.completions.create(model=model, prompt="1, 2, 3,", max_tokens=6, temperature=0)
    out["prompt_array"] = {"indices": [c.index for c in batch.choices],
                           "second_equals_solo": batch.choices[1].text == solo.choices[0].text,
                           "prompt_tokens": batch.usage.prompt_tokens}

    try:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
        out["unknown_model"] = "accepted"
    except openai.NotFoundError as e:
        out["unknown_model"] = {"status": e.status_code, "code": e.code}
    try:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=-1)
        out["bad_max_tokens"] = "accepted"
    except openai.BadRequestError as e:
        out["bad_max_tokens"] = {"status": e.status_code, "param": e.param}

    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
