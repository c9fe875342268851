"""Each provider's own Python SDK, pointed at the gateway as its README says, for tests/sdks.rs.

    python clients.py <family> <gateway base URL> <tenant>

Runs one call that streams and one that does not (one embedding call for `embeddings`), then
prints one JSON line per call: the hold tollgate made (`x-sim-reserved-tokens`, echoed by the
stand-in backend), its reservation, and what the SDK read back; or, for a refused call, the
exception the SDK raised, as the SDK shows it. Nothing here retries on its own: what retries is
the SDK's own policy, left as shipped unless a line says otherwise.
"""

import json
import sys

import httpx

FAMILY, BASE, TENANT = sys.argv[1], sys.argv[2].rstrip("/"), sys.argv[3]
HEADERS = {"x-tenant-id": TENANT}
PROMPT = "Say something about admission control. " * 4

seen = []


def remember(response: httpx.Response) -> None:
    """An httpx event hook: the headers of every response, for the hold it echoes."""
    seen.append(dict(response.headers))


# The rate-limit headers a call's answer carried, OpenAI's and Anthropic's, by name.
RATE_HEADERS = ("x-ratelimit-remaining-tokens", "x-ratelimit-remaining-requests",
                "anthropic-ratelimit-tokens-remaining", "anthropic-ratelimit-requests-remaining",
                "anthropic-ratelimit-requests-reset", "retry-after", "x-should-retry")


def rate_headers(headers) -> dict:
    return {name: headers.get(name) for name in RATE_HEADERS if headers.get(name) is not None}


def report(call: str, headers: dict, text: str = "") -> None:
    print(json.dumps({
        "call": call,
        "reservation": headers.get("x-sim-reservation"),
        "reserved_tokens": int(headers.get("x-sim-reserved-tokens", "-1")),
        "text_bytes": len(text),
        "rate": rate_headers(headers),
        "soft_limit": headers.get("x-tollgate-soft-limit"),
    }), flush=True)


def refused(call: str, e: Exception, **shown) -> None:
    print(json.dumps({"call": call, "error": type(e).__name__, "shown": str(e), **shown}), flush=True)


def gemini(vertex: bool) -> None:
    from google import genai
    from google.genai import errors, types

    options = types.HttpOptions(base_url=BASE, headers=HEADERS, client_args={"event_hooks": {"response": [remember]}})
    if vertex:
        from google.oauth2.credentials import Credentials

        client = genai.Client(vertexai=True, project="p", location="us-central1",
                              credentials=Credentials(token="test"), http_options=options)
    else:
        client = genai.Client(api_key="test", http_options=options)
    config = types.GenerateContentConfig(max_output_tokens=40)
    try:
        r = client.models.generate_content(model="gemini-2.0-flash", contents=PROMPT, config=config)
        report("generate", seen[-1], r.text or "")
        text = "".join(c.text or "" for c in client.models.generate_content_stream(
            model="gemini-2.0-flash", contents=PROMPT, config=config))
        report("stream", seen[-1], text)
    except errors.APIError as e:
        refused("generate", e, code=e.code, status=e.status, message=e.message)


def bedrock() -> None:
    import boto3
    from botocore.exceptions import ClientError

    client = boto3.client("bedrock-runtime", endpoint_url=BASE, region_name="us-east-1",
                          aws_access_key_id="test", aws_secret_access_key="test")

    def tenant(request, **_):
        request.headers["x-tenant-id"] = TENANT

    client.meta.events.register("before-send.bedrock-runtime.*", tenant)
    model = "amazon.nova-lite-v1:0"
    messages = [{"role": "user", "content": [{"text": PROMPT}]}]
    call = "generate"
    try:
        r = client.converse(modelId=model, messages=messages, inferenceConfig={"maxTokens": 40})
        report("generate", r["ResponseMetadata"]["HTTPHeaders"], r["output"]["message"]["content"][0]["text"])
        call = "stream"
        r = client.converse_stream(modelId=model, messages=messages, inferenceConfig={"maxTokens": 40})
        text = "".join(e["contentBlockDelta"]["delta"]["text"] for e in r["stream"] if "contentBlockDelta" in e)
        report("stream", r["ResponseMetadata"]["HTTPHeaders"], text)
        # InvokeModel with a Meta Llama body: Bedrock reports its counts in headers (and, streamed,
        # in the last chunk's invocation metrics), not in a body tollgate reads.
        llama = "meta.llama3-8b-instruct-v1:0"
        body = json.dumps({"prompt": PROMPT, "max_gen_len": 40})
        call = "invoke"
        r = client.invoke_model(modelId=llama, body=body)
        report("invoke", r["ResponseMetadata"]["HTTPHeaders"], json.loads(r["body"].read())["generation"])
        call = "invoke-stream"
        r = client.invoke_model_with_response_stream(modelId=llama, body=body)
        text = "".join(json.loads(e["chunk"]["bytes"])["generation"] for e in r["body"] if "chunk" in e)
        report("invoke-stream", r["ResponseMetadata"]["HTTPHeaders"], text)
    except ClientError as e:
        error, meta = e.response["Error"], e.response["ResponseMetadata"]
        refused(call, e, code=error.get("Code"), message=error.get("Message"), status=meta["HTTPStatusCode"],
                attempts=meta.get("RetryAttempts"), rate=rate_headers(meta.get("HTTPHeaders", {})))


def ollama_client() -> None:
    import ollama

    client = ollama.Client(host=BASE, headers=HEADERS, event_hooks={"response": [remember]})
    try:
        r = client.chat(model="llama3.2", messages=[{"role": "user", "content": PROMPT}],
                        options={"num_predict": 40}, stream=False)
        report("generate", seen[-1], r.message.content or "")
        text = "".join(c.message.content or "" for c in client.chat(
            model="llama3.2", messages=[{"role": "user", "content": PROMPT}], options={"num_predict": 40}, stream=True))
        report("stream", seen[-1], text)
    except ollama.ResponseError as e:
        refused("generate", e, status=e.status_code, message=e.error)


def azure() -> None:
    import openai

    client = openai.AzureOpenAI(azure_endpoint=BASE, api_key="test", api_version="2024-10-21",
                                default_headers=HEADERS, max_retries=0)
    messages = [{"role": "user", "content": PROMPT}]
    try:
        raw = client.chat.completions.with_raw_response.create(model="my-gpt4o", messages=messages, max_tokens=40)
        report("generate", dict(raw.headers), raw.parse().choices[0].message.content or "")
        raw = client.chat.completions.with_raw_response.create(
            model="my-gpt4o", messages=messages, max_tokens=40, stream=True, stream_options={"include_usage": True})
        text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
        report("stream", dict(raw.headers), text)
    except openai.APIStatusError as e:
        refused("generate", e, status=e.status_code, message=e.message)


def openai_client() -> None:
    import openai

    client = openai.OpenAI(base_url=BASE + "/v1", api_key="test", default_headers=HEADERS, max_retries=0,
                           http_client=httpx.Client(event_hooks={"response": [remember]}))
    messages = [{"role": "user", "content": PROMPT}]
    call = "generate"
    try:
        r = client.chat.completions.create(model="gpt-4o", messages=messages, max_tokens=40)
        report(call, seen[-1], r.choices[0].message.content or "")
        call = "stream"
        chunks = client.chat.completions.create(model="gpt-4o", messages=messages, max_tokens=40, stream=True,
                                                stream_options={"include_usage": True})
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        report(call, seen[-1], text)
    except openai.APIStatusError as e:
        error = e.body if isinstance(e.body, dict) else {}
        refused(call, e, status=e.status_code, message=e.message, type=error.get("type"), code=error.get("code"),
                rate=rate_headers(e.response.headers))


def flood() -> None:
    """FLOOD callers at once, each one non-streaming call with the SDK's retries as shipped (two,
    waiting the retry-after-ms it is sent): one JSON line each, with every answer it got."""
    import os
    import threading
    import time

    import openai

    count = int(os.environ.get("FLOOD", "8"))
    results = [None] * count
    ready = threading.Barrier(count)

    def one(i: int) -> None:
        answers = []
        began = time.monotonic()

        def hook(response: httpx.Response) -> None:
            answers.append({"status": response.status_code, "at_ms": int((time.monotonic() - began) * 1000),
                            "retry_after_ms": response.headers.get("retry-after-ms"),
                            "reason": response.headers.get("x-tollgate-reason")})

        client = openai.OpenAI(base_url=BASE + "/v1", api_key="test", default_headers=HEADERS,
                               http_client=httpx.Client(event_hooks={"response": [hook]}))
        ready.wait()
        began = time.monotonic()
        try:
            client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": PROMPT}],
                                           max_tokens=40)
            results[i] = {"admitted": True, "answers": answers}
        except openai.APIStatusError as e:
            results[i] = {"admitted": False, "answers": answers, "message": e.message}

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        print(json.dumps(r), flush=True)


def anthropic_client() -> None:
    import anthropic

    # (Its HTTP client is its own, not httpx's: the headers come from its raw responses.) A spent
    # budget is tried with the SDK's own retries on: it would sleep through a long retry-after,
    # until midnight, past the test's timeout, were the refusal not marked x-should-retry: false.
    retries = 2 if TENANT == "broke" else 0
    client = anthropic.Anthropic(base_url=BASE, api_key="test", default_headers=HEADERS, max_retries=retries)
    messages = [{"role": "user", "content": PROMPT}]
    call = "generate"
    try:
        raw = client.messages.with_raw_response.create(model="claude-sonnet-4", max_tokens=40, messages=messages)
        report(call, dict(raw.headers), "".join(b.text for b in raw.parse().content if b.type == "text"))
        call = "stream"
        raw = client.messages.with_raw_response.create(model="claude-sonnet-4", max_tokens=40, messages=messages,
                                                       stream=True)
        text = "".join(e.delta.text for e in raw.parse()
                       if e.type == "content_block_delta" and e.delta.type == "text_delta")
        report(call, dict(raw.headers), text)
    except anthropic.APIStatusError as e:
        error = e.body.get("error", {}) if isinstance(e.body, dict) else {}
        refused(call, e, status=e.status_code, message=e.message, type=error.get("type"),
                rate=rate_headers(e.response.headers))


def embeddings() -> None:
    import openai

    client = openai.OpenAI(base_url=BASE + "/v1", api_key="test", default_headers=HEADERS, max_retries=0)
    try:
        raw = client.embeddings.with_raw_response.create(model="text-embedding-3-small", input="five tokens of input")
        report("embed", dict(raw.headers))
    except openai.APIStatusError as e:
        refused("embed", e, status=e.status_code, message=e.message)


{
    "gemini": lambda: gemini(vertex=False),
    "vertex": lambda: gemini(vertex=True),
    "bedrock": bedrock,
    "ollama": ollama_client,
    "azure": azure,
    "openai": openai_client,
    "anthropic": anthropic_client,
    "embeddings": embeddings,
    "flood": flood,
}[FAMILY]()
