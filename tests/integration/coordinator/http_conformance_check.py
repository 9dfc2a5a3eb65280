"""HTTP/1.1 conformance of a kvrelay coordinator, with h11 as the client.

usage: http_conformance_check.py PORT MODEL API_KEY CONTEXT_TOKENS

h11 enforces message framing (RFC 9112): a response to HEAD, a 1xx, 204 or
304 that carried content, a wrong Content-Length or chunk, or a keep-alive
response the server then closes, makes the next event on the connection fail.
So every route and every error path runs over ONE keep-alive connection, and
each path that must close the connection runs on a connection of its own and
checks that the server closed it (and said Connection: close) - and no other
does.

The server under test (tests/integration/coordinator/http_conformance_test.cc)
runs with max_running 2 / max_queue 0, max_prompt_tokens 512, a 64 KiB body
and 8 KiB header limit, one API key, a KV pool of ~2,900 tokens, and a backend
whose faults are chosen by the request's seed (the SEED_* constants below).

Prints {"checks": N, "failures": [...], "statuses": [...]} and exits 1 when a
check failed.
"""
import json
import socket
import sys
import time

import h11

SEED_SUBMIT_INTERNAL = 4242001
SEED_SUBMIT_UNAVAILABLE = 4242002
SEED_FAIL_AFTER_TWO_TOKENS = 4242003
SEED_MARK_UNHEALTHY = 4242004
SEED_MARK_HEALTHY = 4242005

PORT, MODEL, KEY, CONTEXT = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
AUTH = [("Authorization", "Bearer " + KEY)]
JSON = [("Content-Type", "application/json")]

checks = 0
failures = []
statuses = set()


def check(cond, what):
    global checks
    checks += 1
    if not cond:
        failures.append(what)
    return cond


class Response:
    def __init__(self, status, headers, body, informational, closed):
        self.status = status
        self.headers = headers  # name (lower case) -> value; repeated names joined by ", "
        self.body = body
        self.informational = informational
        self.closed = closed  # the server closed the connection after this response

    def json(self):
        try:
            return json.loads(self.body)
        except ValueError:
            return None


class Conn:
    """One HTTP/1.1 connection driven by h11."""

    def __init__(self):
        self.sock = socket.create_connection(("127.0.0.1", PORT), timeout=120)
        self.h = h11.Connection(h11.CLIENT)
        self.is_closed = False

    def send_request(self, method, target, headers=(), body=None, chunked=False):
        hs = [("Host", "127.0.0.1:%d" % PORT)] + list(headers)
        if chunked:
            hs.append(("Transfer-Encoding", "chunked"))
        elif body is not None:
            hs.append(("Content-Length", str(len(body))))
        self.sock.sendall(self.h.send(h11.Request(method=method, target=target, headers=hs)))
        if body:
            if chunked:  # two chunks, to exercise the server's chunked reader
                half = len(body) // 2
                self.sock.sendall(self.h.send(h11.Data(data=body[:half])))
                self.sock.sendall(self.h.send(h11.Data(data=body[half:])))
            else:
                self.sock.sendall(self.h.send(h11.Data(data=body)))
        self.sock.sendall(self.h.send(h11.EndOfMessage()))

    def read_response(self, on_data=None):
        informational, response, body = [], None, bytearray()
        while True:
            ev = self.h.next_event()
            if ev is h11.NEED_DATA:
                self.h.receive_data(self.sock.recv(65536))
                continue
            if isinstance(ev, h11.InformationalResponse):
                informational.append(ev.status_code)
                continue
            if isinstance(ev, h11.Response):
                response = ev
                continue
            if isinstance(ev, h11.Data):
                body += ev.data
                if on_data is not None and not on_data(bytes(body)):
                    return None
                continue
            if isinstance(ev, h11.EndOfMessage):
                break
            raise AssertionError("unexpected h11 event %r" % (ev,))
        headers = {}
        for name, value in response.headers:
            n = name.decode().lower()
            headers[n] = headers[n] + ", " + value.decode() if n in headers else value.decode()
        closed = False
        if self.h.their_state is h11.MUST_CLOSE:
            # The server said it closes (Connection: close): it must, now.
            self.sock.settimeout(10)
            try:
                tail = self.sock.recv(1)
            except (ConnectionResetError, socket.timeout) as e:
                tail = None if isinstance(e, socket.timeout) else b""
            check(tail == b"", "server sent Connection: close but did not close (%r)" % (tail,))
            closed = True
            self.close()
        else:
            self.h.start_next_cycle()
        statuses.add(response.status_code)
        return Response(response.status_code, headers, bytes(body), informational, closed)

    def call(self, method, target, headers=(), body=None, chunked=False):
        self.send_request(method, target, headers, body, chunked)
        return self.read_response()

    def close(self):
        if not self.is_closed:
            self.is_closed = True
            self.sock.close()


def chat(content, **kw):
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": 8, "temperature": 0}
    body.update(kw)
    return json.dumps(body).encode()


def completion(prompt, **kw):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    body.update(kw)
    return json.dumps(body).encode()


def sse_events(body):
    events = []
    for block in body.decode().split("\n\n"):
        for line in block.split("\n"):
            if line.startswith("data: "):
                events.append(line[6:])
    return events


def expect_error(r, status, what, code=None, param=None):
    check(r.status == status, "%s: status %d, want %d (%r)" % (what, r.status, status, r.body[:200]))
    check(r.headers.get("content-type") == "application/json", what + ": error content-type")
    e = (r.json() or {}).get("error")
    if not check(isinstance(e, dict) and isinstance(e.get("message"), str) and "type" in e,
                 what + ": body is not an OpenAI error object: %r" % (r.body[:200],)):
        return
    if code is not None:
        check(e.get("code") == code, "%s: code %r, want %r" % (what, e.get("code"), code))
    if param is not None:
        check(e.get("param") == param, "%s: param %r, want %r" % (what, e.get("param"), param))
    check(not r.closed, what + ": the server closed a keep-alive connection")


def expect_head_like_get(conn, target, headers=(), same_length=True):
    get = conn.call("GET", target, headers)
    head = conn.call("HEAD", target, headers)
    what = "HEAD " + target
    check(head.status == get.status, "%s: status %d, GET had %d" % (what, head.status, get.status))
    check(head.body == b"", what + ": carried content")
    check(sorted(head.headers) == sorted(get.headers),
          "%s: header names %r, GET had %r" % (what, sorted(head.headers), sorted(get.headers)))
    for k, v in get.headers.items():
        if k == "content-length" and not same_length:
            continue
        check(head.headers.get(k) == v, "%s: %s is %r, GET had %r" % (what, k, head.headers.get(k), v))
    check(not head.closed and not get.closed, what + ": closed the connection")
    return get


def raw_exchange(data, method="POST"):
    """Sends raw bytes on a new connection and reads the one response with h11."""
    sock = socket.create_connection(("127.0.0.1", PORT), timeout=30)
    h = h11.Connection(h11.CLIENT)
    # h11 needs to know what it asked for to frame the answer; the bytes that
    # go out are `data`, not these.
    h.send(h11.Request(method=method, target="/", headers=[("Host", "x"), ("Content-Length", "0")]))
    h.send(h11.EndOfMessage())
    sock.sendall(data)
    response, body = None, bytearray()
    while True:
        ev = h.next_event()
        if ev is h11.NEED_DATA:
            try:
                h.receive_data(sock.recv(65536))
            except ConnectionResetError:
                h.receive_data(b"")
            continue
        if isinstance(ev, h11.Response):
            response = ev
        elif isinstance(ev, h11.Data):
            body += ev.data
        elif isinstance(ev, h11.EndOfMessage):
            break
        else:
            raise AssertionError("unexpected h11 event %r" % (ev,))
    headers = {n.decode().lower(): v.decode() for n, v in response.headers}
    # Nothing may follow: no second response (a smuggled request answered).
    sock.settimeout(10)
    try:
        rest = sock.recv(65536)
    except ConnectionResetError:
        rest = b""
    sock.close()
    statuses.add(response.status_code)
    return response.status_code, headers, bytes(body), rest


def expect_closing_error(data, status, what, method="POST"):
    code, headers, body, rest = raw_exchange(data, method)
    check(code == status, "%s: status %d, want %d (%r)" % (what, code, status, body[:200]))
    check(headers.get("connection", "").lower() == "close", what + ": no Connection: close")
    check(rest == b"", "%s: more bytes after the response: %r" % (what, rest[:200]))
    if method != "HEAD" and body:
        check("error" in json.loads(body), what + ": not an error object")


def running_requests(conn):
    for line in conn.call("GET", "/metrics").body.decode().splitlines():
        if line.startswith("kvrelay_running_requests{") or line.startswith("kvrelay_running_requests "):
            return float(line.rsplit(" ", 1)[1])
    return -1


def main():
    conn = Conn()

    # --- GET routes, and HEAD on each with the GET's status and headers ---
    health = expect_head_like_get(conn, "/health")
    check(health.status == 200 and health.json()["status"] == "ok", "GET /health")
    metrics = expect_head_like_get(conn, "/metrics", same_length=False)
    check(metrics.status == 200 and b"kvrelay_queue_depth" in metrics.body, "GET /metrics")
    check(metrics.headers.get("content-type", "").startswith("text/plain"), "metrics content-type")
    models = expect_head_like_get(conn, "/v1/models", AUTH)
    check(models.status == 200 and models.json()["data"][0]["id"] == MODEL, "GET /v1/models")
    one = expect_head_like_get(conn, "/v1/models/" + MODEL, AUTH)
    check(one.status == 200 and one.json().get("id") == MODEL and one.json().get("object") == "model",
          "GET /v1/models/{id}: %r" % (one.body[:200],))
    missing = expect_head_like_get(conn, "/v1/models/no-such-model", AUTH)
    expect_error(missing, 404, "GET /v1/models/no-such-model", code="model_not_found")
    nothing = expect_head_like_get(conn, "/no/such/path")
    expect_error(nothing, 404, "GET /no/such/path", code="not_found")

    # --- authentication ---
    for headers, what in (((), "no key"), ([("Authorization", "Bearer sk-wrong")], "wrong key")):
        r = conn.call("GET", "/v1/models", headers)
        expect_error(r, 401, "401 " + what, code="invalid_api_key")
        check(r.headers.get("www-authenticate") == "Bearer", "401 %s: WWW-Authenticate" % what)
        r = conn.call("POST", "/v1/chat/completions", list(headers) + JSON, chat("hi"))
        expect_error(r, 401, "401 POST " + what, code="invalid_api_key")

    # --- methods: 405 with Allow (no content for HEAD), OPTIONS 204 ---
    for method, target, allow in (("DELETE", "/health", "GET, HEAD, OPTIONS"),
                                  ("POST", "/metrics", "GET, HEAD, OPTIONS"),
                                  ("PUT", "/v1/models", "GET, HEAD, OPTIONS"),
                                  ("GET", "/v1/chat/completions", "POST, OPTIONS"),
                                  ("HEAD", "/v1/completions", "POST, OPTIONS")):
        r = conn.call(method, target, AUTH, b"" if method in ("POST", "PUT", "DELETE") else None)
        what = "%s %s" % (method, target)
        check(r.status == 405, "%s: status %d, want 405" % (what, r.status))
        check(r.headers.get("allow") == allow, "%s: Allow %r, want %r" % (what, r.headers.get("allow"), allow))
        if method == "HEAD":
            check(r.body == b"", what + ": 405 to HEAD carried content")
        else:
            expect_error(r, 405, what, code="method_not_allowed")
    for target, allow in (("/v1/chat/completions", "POST, OPTIONS"), ("/health", "GET, HEAD, OPTIONS")):
        r = conn.call("OPTIONS", target)
        check(r.status == 204, "OPTIONS %s: status %d" % (target, r.status))
        check(r.body == b"" and "content-length" not in r.headers,
              "OPTIONS %s: 204 with content or Content-Length" % target)
        check(r.headers.get("allow") == allow, "OPTIONS %s: Allow %r" % (target, r.headers.get("allow")))

    # --- request validation: 400 / 404 / 413 on a connection that stays open ---
    post = lambda target, body, extra=(): conn.call("POST", target, AUTH + JSON + list(extra), body)
    expect_error(post("/v1/chat/completions", b'{"model": '), 400, "malformed JSON")
    expect_error(post("/v1/chat/completions", b"[1, 2]"), 400, "body not an object")
    expect_error(post("/v1/chat/completions", chat("hi", temperature="hot")), 400, "bad type",
                 param="temperature")
    expect_error(post("/v1/chat/completions", json.dumps({"model": MODEL}).encode()), 400,
                 "missing messages", param="messages")
    expect_error(post("/v1/completions", completion("x", logprobs=2, echo=True)), 400,
                 "echo with logprobs", param="echo")
    expect_error(post("/v1/completions", completion("x", logprobs=21)), 400, "logprobs > 20",
                 param="logprobs")
    expect_error(post("/v1/chat/completions", chat("hi", model="gpt-4")), 404, "unknown model",
                 code="model_not_found", param="model")
    expect_error(post("/v1/chat/completions", chat("word " * 600)), 400, "prompt over max_prompt_tokens",
                 code="context_length_exceeded")
    expect_error(post("/v1/completions", completion("x", suffix="y")), 400, "suffix", param="suffix")
    expect_error(post("/v1/chat/completions", chat("x", logit_bias={"1": 500})), 400, "logit_bias",
                 param="logit_bias")
    expect_error(post("/v1/chat/completions", chat("x", response_format={
        "type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "string",
                                                                       "pattern": "a"}}})),
                 400, "unsupported schema keyword", param="response_format.json_schema.schema")
    # #42: unknown fields are ignored (with a warning in the log), as vLLM and llama-server do.
    r = post("/v1/chat/completions", chat("x", max_tokens=2, frobnicate=1, prediction={}))
    check(r.status == 200, "unknown fields ignored: %d %r" % (r.status, r.body[:200]))
    expect_error(post("/v1/completions", completion("hi", max_tokens=4096, ignore_eos=True)), 400,
                 "prompt + max_tokens that can never fit the KV pool", code="context_length_exceeded")
    expect_error(post("/v1/completions", completion("x", max_tokens=-1)), 400, "max_tokens < 1",
                 param="max_tokens")

    # --- completions: non-streaming, chunked request body, 100-continue, n = 2 ---
    plain = post("/v1/chat/completions", chat("What is the capital of France?", max_tokens=12))
    check(plain.status == 200, "chat: %d %r" % (plain.status, plain.body[:200]))
    text = plain.json()["choices"][0]["message"]["content"]
    check(bool(text), "chat: empty answer")
    r = conn.call("POST", "/v1/chat/completions", AUTH + JSON,
                  chat("What is the capital of France?", max_tokens=12), chunked=True)
    check(r.status == 200 and r.json()["choices"][0]["message"]["content"] == text,
          "chunked request body: %d %r" % (r.status, r.body[:200]))
    r = conn.call("POST", "/v1/completions", AUTH + JSON + [("Expect", "100-continue")],
                  completion("The capital of France is"))
    check(r.informational == [100], "Expect: 100-continue: interim %r" % (r.informational,))
    check(r.status == 200 and r.json()["object"] == "text_completion", "completion after 100-continue")
    r = post("/v1/chat/completions", chat("Hi", max_tokens=4, n=2))
    check(r.status == 200 and [c["index"] for c in r.json()["choices"]] == [0, 1],
          "n = 2: %d %r" % (r.status, r.body[:200]))

    # --- SSE: finished normally, stopped by a stop string (the server cancels), failed ---
    r = post("/v1/chat/completions", chat("What is the capital of France?", max_tokens=12,
                                          stream=True, stream_options={"include_usage": True}))
    check(r.status == 200 and r.headers.get("content-type") == "text/event-stream", "stream header")
    check(r.headers.get("transfer-encoding") == "chunked" and "content-length" not in r.headers,
          "stream framing: %r" % (r.headers,))
    events = sse_events(r.body)
    check(events and events[-1] == "[DONE]" and events.count("[DONE]") == 1, "stream ends with one [DONE]")
    chunks = [json.loads(e) for e in events[:-1]]
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    check(streamed == text, "stream equals non-stream: %r vs %r" % (streamed, text))
    check(any(c["choices"] and c["choices"][0]["finish_reason"] for c in chunks), "stream finish_reason")
    check(chunks[-1].get("usage", {}).get("completion_tokens", 0) >= 1, "stream usage chunk")
    if len(text) > 3:
        stop = text[2:4]
        r = post("/v1/chat/completions", chat("What is the capital of France?", max_tokens=12,
                                              stream=True, stop=[stop]))
        events = sse_events(r.body)
        chunks = [json.loads(e) for e in events[:-1]]
        got = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        check(r.status == 200 and events[-1] == "[DONE]" and stop not in got and text.startswith(got),
              "stop-string stream: %r (stop %r)" % (got, stop))
        check(chunks[-1]["choices"][0]["finish_reason"] == "stop", "stop-string finish_reason")
    r = post("/v1/completions", completion("Once upon a time", max_tokens=32, ignore_eos=True,
                                           stream=True, seed=SEED_FAIL_AFTER_TWO_TOKENS))
    events = sse_events(r.body)
    check(r.status == 200 and events[-1] == "[DONE]", "failed stream: framing %r" % (events[-2:],))
    check(len(events) >= 2 and "error" in json.loads(events[-2]), "failed stream: error event %r" % (events[-2:],))
    check(sum(1 for e in events[:-2] if "choices" in json.loads(e)) == 2, "failed stream: 2 tokens first")
    r = post("/v1/completions", json.dumps({"model": MODEL, "prompt": [10 ** 6], "max_tokens": 4,
                                            "stream": True}).encode())
    if r.status == 200:  # the engine refuses the token id after the stream began
        events = sse_events(r.body)
        check(events[-1] == "[DONE]" and "error" in json.loads(events[-2]), "out-of-vocabulary stream")
    else:
        expect_error(r, 400, "out-of-vocabulary token id")
    r = post("/v1/completions", completion("Once upon a time", max_tokens=32, ignore_eos=True,
                                           seed=SEED_FAIL_AFTER_TWO_TOKENS))
    expect_error(r, 500, "failure mid-generation, not streaming")

    # --- 5xx ---
    expect_error(post("/v1/completions", completion("x", seed=SEED_SUBMIT_INTERNAL)), 500, "backend failure")
    r = post("/v1/completions", completion("x", seed=SEED_SUBMIT_UNAVAILABLE))
    expect_error(r, 503, "backend unavailable", code="no_capacity")
    check(r.headers.get("retry-after", "").isdigit(), "503: Retry-After")
    check(post("/v1/completions", completion("x", seed=SEED_MARK_UNHEALTHY)).status == 200, "mark unhealthy")
    sick = expect_head_like_get(conn, "/health")
    check(sick.status == 503 and sick.json()["status"] == "unavailable", "unhealthy /health: %d" % sick.status)
    check(post("/v1/completions", completion("x", seed=SEED_MARK_HEALTHY)).status == 200, "mark healthy")
    check(conn.call("GET", "/health").status == 200, "healthy again")

    # --- 429: another connection's stream (n = 2) holds both slots; then it is cancelled ---
    side = Conn()
    side.send_request("POST", "/v1/completions", AUTH + JSON,
                      completion("Once upon a time", max_tokens=1000, ignore_eos=True, stream=True, n=2))
    got_token = side.read_response(on_data=lambda b: b"data: " not in b)  # stop at the first event
    check(got_token is None, "side stream produced no event")
    r = post("/v1/chat/completions", chat("hi"))
    expect_error(r, 429, "admission queue full", code="queue_full")
    check(r.headers.get("retry-after", "").isdigit(), "429: Retry-After")
    side.close()  # the client leaves mid-stream: the server cancels the request
    deadline = time.monotonic() + 60
    while running_requests(conn) != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    check(running_requests(conn) == 0, "the cancelled stream's slot came back")
    check(post("/v1/chat/completions", chat("hi", max_tokens=2)).status == 200, "served after the cancel")

    # --- the keep-alive connection ends when the client asks ---
    r = conn.call("GET", "/health", [("Connection", "close")])
    check(r.status == 200 and r.headers.get("connection") == "close" and r.closed,
          "Connection: close asked by the client: %r" % (r.headers,))

    # --- paths that must close the connection, each on its own ---
    conn2 = Conn()
    r = conn2.call("POST", "/v1/chat/completions", AUTH + JSON, chat("x" * (70 << 10)))
    check(r.status == 413 and r.closed and r.headers.get("connection") == "close",
          "413 body over the limit closes: %d %r" % (r.status, r.headers))
    conn3 = Conn()
    r = conn3.call("GET", "/health", [("X-Filler", "y" * (9 << 10))])
    check(r.status == 431 and r.closed, "431 headers over the limit closes: %d" % r.status)
    for te in ("gzip", "xchunked", "chunked, identity", "identity", "chunked, gzip"):
        smuggled = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
        expect_closing_error(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: " +
                             te.encode() + b"\r\n\r\n" + smuggled, 400, "Transfer-Encoding: " + te)
    expect_closing_error(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
                         b"Content-Length: 7\r\n\r\nhello", 400, "conflicting Content-Length")
    expect_closing_error(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400, "Content-Length + chunked")
    expect_closing_error(b"GET /health HTTP/1.1\r\n\r\n", 400, "missing Host", method="GET")
    expect_closing_error(b"GET /health HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400, "two Host", method="GET")
    expect_closing_error(b"GET /health HTTP/1.1\r\nHost: x\r\nExpect: something\r\n\r\n", 417,
                         "unsupported Expect", method="GET")
    expect_closing_error(b"\x16\x03\x01 not http\r\n\r\n", 400, "not HTTP at all", method="GET")
    # HTTP/1.0 without keep-alive: answered, then closed (no Connection header needed).
    code, headers, body, rest = raw_exchange(b"GET /health HTTP/1.0\r\n\r\n", method="GET")
    check(code == 200 and rest == b"", "HTTP/1.0 request: %d %r" % (code, rest[:100]))

    want = {200, 204, 400, 401, 404, 405, 413, 417, 429, 431, 500, 503}
    check(want <= statuses, "statuses not exercised: %r" % sorted(want - statuses))
    print(json.dumps({"checks": checks, "failures": failures, "statuses": sorted(statuses)}, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
