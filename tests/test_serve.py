"""`kvexport serve` as clients use it: the official openai client and raw
HTTP against live servers on 127.0.0.1 (subprocesses, as a user starts
them), exactness against the runtime alone, the prefix cache, cancellation,
overload and shutdown."""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from helpers import prompt_of
from kvexport.runtime import generate, load
from test_models import save_tokenizer
from test_tokenizer_safety import fix_checksums

KEY = "test-key"
BODY_LIMIT = 65536


@pytest.fixture(scope="session")
def chat_package(tiny_package, tmp_path_factory):
    """A tiny package with a word-level tokenizer and chat template, and a
    pool large enough for 24 requests at once."""
    pkg = tmp_path_factory.mktemp("serve") / "pkg"
    shutil.copytree(tiny_package("tiny-llama", max_cells=4096), pkg)
    save_tokenizer(pkg / "tokenizer")
    manifest = json.loads((pkg / "manifest.json").read_text())
    manifest["tokenizer"] = {"dir": "tokenizer", "chat_template": True}
    (pkg / "manifest.json").write_text(json.dumps(manifest))
    fix_checksums(pkg)
    return pkg


class Server:
    """`kvexport serve PKG --port 0 ...` in a subprocess, until stop()."""

    def __init__(self, package: Path, *flags: str, ready: bool = True):
        command = [sys.executable, "-m", "kvexport.cli.main", "serve", str(package), "--port", "0", *flags]
        self.process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.log: list[str] = []
        found = threading.Event()
        self.url = None

        def drain() -> None:
            for line in self.process.stderr:
                self.log.append(line)
                match = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
                if match and self.url is None:
                    self.url = match.group(1)
                    found.set()

        threading.Thread(target=drain, daemon=True).start()
        if not found.wait(60):
            self.stop()
            raise AssertionError("the server did not start:\n" + "".join(self.log))
        if ready:
            self.wait_ready()

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status, _, _ = self.get("/health")
            if status == 200:
                return
            assert self.process.poll() is None, "the server exited:\n" + "".join(self.log)
            time.sleep(0.2)
        raise AssertionError("not ready in time:\n" + "".join(self.log))

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None, timeout: float = 60):
        host, port = self.url.rsplit("//", 1)[1].split(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=timeout)
        try:
            connection.request(method, path, body=body, headers=headers or {})
            response = connection.getresponse()
            return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
        finally:
            connection.close()

    def get(self, path: str):
        try:
            return self.request("GET", path, timeout=5)
        except OSError:
            return 0, {}, b""

    def post(self, path: str, body, key: str | None = KEY, raw: bool = False, timeout: float = 60):
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        return self.request("POST", path, body if raw else json.dumps(body).encode(), headers, timeout)

    def metric(self, name: str) -> float:
        _, _, text = self.get("/metrics")
        match = re.search(rf"^{name} ([0-9.e+-]+)$", text.decode(), re.M)
        assert match, f"{name} not in /metrics"
        return float(match.group(1))

    def client(self, key: str = KEY, timeout: float = 60) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=timeout)

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout)


@pytest.fixture(scope="session")
def server(chat_package):
    server = Server(chat_package, "--api-key", KEY, "--max-body-bytes", str(BODY_LIMIT), "--max-step-tokens", "32")
    yield server
    assert server.stop() == 0, "".join(server.log)


@pytest.fixture(scope="session")
def reference(chat_package):
    """prompt ids, max_tokens -> the runtime's greedy ids for that prompt alone."""
    runtime = load(chat_package)
    text = runtime.package.tokenizer()
    return lambda prompt, n: text.decode(generate(runtime, [prompt], n)[0]), text


# ------------------------------------------------------------- the client
def test_models_and_health(server):
    status, _, body = server.get("/health")
    assert status == 200 and json.loads(body)["status"] == "ready"
    assert [m.id for m in server.client().models.list().data] == ["pkg"]


def test_chat_streamed_and_not_give_the_same_text(server, reference):
    expect, text = reference
    messages = [{"role": "system", "content": "the moon is red " * 5}, {"role": "user", "content": "is the moon red"}]
    prompt = text.encode_chat(messages)
    client = server.client()
    reply = client.chat.completions.create(model="pkg", messages=messages, max_tokens=12, temperature=0)
    assert reply.choices[0].message.content == expect(prompt, 12)
    assert reply.usage.prompt_tokens == len(prompt) and reply.usage.completion_tokens == 12
    assert reply.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(model="pkg", messages=messages, max_tokens=12, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again: a prefix-cache hit


def test_completion_with_token_ids_and_logprobs(server, reference):
    expect, _ = reference
    prompt = prompt_of(10, seed=3)
    reply = server.client().completions.create(model="pkg", prompt=prompt, max_tokens=6, temperature=0, logprobs=2)
    choice = reply.choices[0]
    assert choice.text == expect(prompt, 6)
    assert len(choice.logprobs.tokens) == 6 and all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    for chosen, top, lp in zip(choice.logprobs.tokens, choice.logprobs.top_logprobs, choice.logprobs.token_logprobs):
        assert len(top) == 2 and max(top.values()) == pytest.approx(lp, abs=1e-5)  # greedy picks the most likely


def test_stop_strings_are_matched_across_tokens(server, reference):
    expect, _ = reference
    prompt = prompt_of(8, seed=11)
    full = expect(prompt, 10)
    words = full.split(" ")
    stop = words[3][-1] + " " + words[4][:2]  # the end of one token, the space, the start of the next
    reply = server.client().completions.create(model="pkg", prompt=prompt, max_tokens=10, temperature=0, stop=[stop, "zzz"])
    assert reply.choices[0].text == full[: full.index(stop)] and reply.choices[0].finish_reason == "stop"
    streamed = server.client().completions.create(model="pkg", prompt=prompt, max_tokens=10, temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == reply.choices[0].text


def test_n_choices_share_the_prompt_and_seeds_repeat(server):
    client = server.client()
    prompt = prompt_of(12, seed=5)
    first = client.completions.create(model="pkg", prompt=prompt, max_tokens=8, temperature=1.0, seed=7, n=3)
    again = client.completions.create(model="pkg", prompt=prompt, max_tokens=8, temperature=1.0, seed=7, n=3)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) > 1  # each choice samples with its own seed
    assert first.usage.completion_tokens == 24


def test_twenty_four_concurrent_requests_equal_each_alone(server, reference):
    """Mixed lengths and arrival times (later ones join running decodes),
    half sharing a long prefix (prefix-cache hits): every greedy answer is
    the runtime's for that prompt alone."""
    expect, _ = reference
    shared = prompt_of(40, seed=99)
    prompts = [(shared if i % 2 else []) + prompt_of(3 + (i * 7) % 50, seed=i) for i in range(24)]
    budgets = [4 + (i * 5) % 37 for i in range(24)]
    client = server.client()

    def ask(i: int) -> str:
        time.sleep(0.03 * i)
        return client.completions.create(model="pkg", prompt=prompts[i], max_tokens=budgets[i], temperature=0).choices[0].text

    with ThreadPoolExecutor(24) as pool:
        answers = list(pool.map(ask, range(24)))
    assert answers == [expect(p, n) for p, n in zip(prompts, budgets)]
    assert server.metric("kvexport_prefix_cache_hits") > 0


# --------------------------------------------------------------- errors
@pytest.mark.parametrize("body, needle", [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    ({"prompt": "hello", "temperature": "hot"}, "'temperature' must be a number"),
    ({"prompt": "hello", "max_tokens": 0}, "'max_tokens' must be at least 1"),
    ({"prompt": [5, 99999]}, "outside the vocabulary"),
    ({"prompt": "hello", "max_tokens": 5000}, "context of 1024"),
    ({"prompt": "hello", "logit_bias": {"5": 3}}, "'logit_bias' is not supported"),
])
def test_bad_requests_get_400_naming_the_problem(server, body, needle):
    raw = isinstance(body, bytes)
    status, _, answer = server.post("/v1/completions", body, raw=raw)
    assert status == 400, answer
    error = json.loads(answer)["error"]
    assert needle in error["message"] and error["type"] == "invalid_request_error"


def test_the_client_raises_the_right_exceptions(server):
    with pytest.raises(openai.AuthenticationError):
        server.client("wrong").models.list()
    status, _, _ = server.post("/v1/completions", {"prompt": "hello"}, key=None)
    assert status == 401
    with pytest.raises(openai.BadRequestError, match="context"):
        server.client().chat.completions.create(model="pkg", messages=[{"role": "user", "content": "hello " * 1100}], max_tokens=5)
    with pytest.raises(openai.APIStatusError) as error:
        server.client().completions.create(model="pkg", prompt="hello " * (BODY_LIMIT // 5), max_tokens=5)
    assert error.value.status_code == 413
    status, _, body = server.request("GET", "/v1/nothing")
    assert status == 404 and "error" in json.loads(body)


def test_metrics_report_tokens_and_latencies(server):
    _, headers, body = server.get("/metrics")
    text = body.decode()
    for name in ("kvexport_requests_total", "kvexport_generation_tokens_total", "kvexport_queue_depth", "kvexport_cells_in_use",
                 "kvexport_prefix_cache_hits", "kvexport_step_seconds_bucket", "kvexport_time_to_first_token_seconds_bucket",
                 "kvexport_inter_token_latency_seconds_bucket", "kvexport_engine_overhead_seconds_bucket",
                 "kvexport_step_cells_read_bucket", "kvexport_cells_allocated"):
        assert name in text, name
    assert server.metric("kvexport_generation_tokens_total") > 0
    # once nothing runs, every cell in use is one the prefix cache keeps
    assert wait_for(lambda: server.metric("kvexport_running_requests") == 0)
    assert wait_for(lambda: server.metric("kvexport_prefix_cache_cells") == server.metric("kvexport_cells_in_use") > 0)


# ------------------------------------------- cancellation, overload, SIGTERM
@pytest.fixture(scope="module")
def small_server(chat_package):
    """Two sessions at a time, one waiting, no prefix cache, 8-token steps:
    prompts prefill over several steps, and cells in use drop to 0 when idle.
    The module's last test stops it with SIGTERM."""
    server = Server(chat_package, "--max-sessions", "2", "--max-queue", "1", "--prefix-cache-cells", "0",
                    "--max-step-tokens", "8", "--no-verify", "--grace-seconds", "60")
    yield server
    assert server.stop() == 0, "".join(server.log)


def wait_for(condition, timeout: float = 20) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def open_stream(server: Server, body: dict) -> http.client.HTTPConnection:
    host, port = server.url.rsplit("//", 1)[1].split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    connection.request("POST", "/v1/completions", json.dumps({**body, "stream": True}).encode(), {"Content-Type": "application/json"})
    return connection


@pytest.mark.parametrize("where", ["prefill", "decode"])
def test_a_client_that_leaves_frees_its_cells(small_server, where):
    cancelled = small_server.metric("kvexport_requests_cancelled")
    prompt = prompt_of(900 if where == "prefill" else 4, seed=1)
    connection = open_stream(small_server, {"prompt": prompt, "max_tokens": 100 if where == "prefill" else 1000,
                                            "temperature": 0, "ignore_eos": True})
    response = connection.getresponse()
    if where == "decode":
        assert response.readline().startswith(b"data: ")  # decoding has begun
    else:
        assert wait_for(lambda: small_server.metric("kvexport_cells_in_use") > 0)
    connection.sock.close()
    connection.close()
    assert wait_for(lambda: small_server.metric("kvexport_requests_cancelled") == cancelled + 1)
    assert wait_for(lambda: small_server.metric("kvexport_cells_in_use") == 0)
    status, _, _ = small_server.post("/v1/completions", {"prompt": [5, 6], "max_tokens": 2}, key=None)
    assert status == 200  # the pool serves the next request


def test_a_full_queue_answers_429_with_retry_after(small_server):
    """Eight long requests at once on a server of two sessions and a queue of
    one: those past the queue get 429 (raw and through the client alike).
    The three let in decode 1000 tokens each, one after another for the
    queued one: on a machine shared with other work that took over 60 s."""
    client = small_server.client(timeout=300)
    long = {"prompt": prompt_of(4, seed=2), "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
    start = threading.Barrier(8)

    def raw():
        start.wait()
        return small_server.post("/v1/completions", long, key=None, timeout=300)

    def through_the_client():
        start.wait()
        try:
            client.completions.create(model="pkg", prompt=long["prompt"], max_tokens=1000, temperature=0,
                                      extra_body={"ignore_eos": True})
            return "ok"
        except openai.RateLimitError:
            return "429"

    with ThreadPoolExecutor(8) as pool:
        answers = [pool.submit(raw) for _ in range(4)] + [pool.submit(through_the_client) for _ in range(4)]
        raws, clients = [a.result() for a in answers[:4]], [a.result() for a in answers[4:]]
    refused = [(headers, body) for status, headers, body in raws if status == 429]
    assert len(refused) + clients.count("429") >= 5  # 2 run, 1 waits: each kind has 4 and at most 3 get in
    assert all(headers.get("retry-after") == "1" and json.loads(body)["error"]["type"] == "rate_limit_error"
               for headers, body in refused)
    assert refused and "429" in clients
    idle = ("kvexport_running_requests", "kvexport_queue_depth", "kvexport_cells_in_use")
    assert wait_for(lambda: all(small_server.metric(name) == 0 for name in idle))


def test_sigterm_finishes_in_flight_requests_and_exits_0(small_server):
    """Runs last in this module: it stops the small server."""
    body = {"prompt": prompt_of(6, seed=4), "max_tokens": 120, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(2) as pool:
        replies = [pool.submit(small_server.post, "/v1/completions", body, None) for _ in range(2)]
        assert wait_for(lambda: small_server.metric("kvexport_running_requests") >= 1)  # in flight
        small_server.process.send_signal(signal.SIGTERM)
        results = [r.result() for r in replies]
    assert small_server.process.wait(60) == 0, "".join(small_server.log)
    for status, _, answer in results:
        assert status == 200 and json.loads(answer)["usage"]["completion_tokens"] == 120
    with pytest.raises(OSError):
        small_server.request("GET", "/health", timeout=2)


def test_a_package_that_cannot_be_served_exits_1_with_its_reason(tiny_package, tmp_path):
    single = tiny_package("tiny-llama", contract="ingraph_kv", use_offgraph_kv_cache=False, max_step_tokens=16, max_context_len=128)
    result = subprocess.run([sys.executable, "-m", "kvexport.cli.main", "serve", str(single), "--port", "0"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "--use-offgraph-kv-cache" in result.stderr and "Traceback" not in result.stderr
