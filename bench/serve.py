"""`kvexport serve` beside llama.cpp's `llama-server` on SmolLM2-135M (F32),
under the same streamed chat load, in one command:

    python bench/serve.py [--package PKG] [--requests 64] [--clients 16 | --rate R] [--distinct]
                          [--prefix-turns] [--conversations 3] [--omp-passive]
    python bench/serve.py --soak SECONDS [--package PKG]
    python bench/serve.py --speculative lookup|draft [--draft PKG] [--package PKG]
    python bench/serve.py --compare-weights [--package PKG]

What it starts, one server at a time (each is killed at the end, Ctrl-C too):

- `kvexport serve PKG --port 0 --max-sessions 16` on an fp32 aoti package of
  smollm2-135m with the off-graph cell pool (`kvexport export smollm2-135m
  --use-offgraph-kv-cache --backend aoti`, exported once into kvexport's cache
  directory under a key of that recipe and of kvexport's code, so a change to
  the code exports it again; `--package` takes another);
- `llama-server -m F32.gguf -np 16 -c 16*2048 --cont-batching -t THREADS
  -ctk f32 -ctv f32` (an F32 cache like the package's; built, with the F32 GGUF
  of the same weights, by bench/llamacpp.py).

The load (a stdlib client: threads and http.client, loopback only): N
requests (--requests, default 64), each the same ~200-token system prompt and
a short question of its own, `max_tokens` 64, temperature 0, `ignore_eos`
(both servers honour it: every request then decodes exactly 64 tokens, the
same work on both), streamed with `stream_options.include_usage`; with
`--distinct` each request's system prompt opens with a line of its own, so
no prefix is shared and every request prefills its ~220 tokens. By default
16 clients each send one request after another (closed loop: both servers
have 16 requests in flight, each at its own speed; a fixed Poisson rate suits
one server and swamps or starves the other); `--rate R` sends open loop
instead, Poisson arrivals at R requests/s. Everything stops at a global
deadline (--deadline).

It prints, per server: requests ok/failed, aggregate output tokens/s (output
tokens over the wall time from the first send to the last [DONE]), time to
first token and inter-token latency p50/p99 in ms (the client's clock: the
first content chunk, and the gaps between content chunks), and the
kvexport/llama-server throughput ratio; the engine's own time as a fraction of
a step (kvexport_engine_overhead_seconds over it plus kvexport_step_seconds,
from /metrics, over the main load only); the CPU, the thread count and the
load average (other work on the machine skews every figure). Then the JSON
via `emit`, like the other bench scripts.

`--speculative MODE` (with `--draft PKG` for `draft`) compares kvexport serve
with itself instead of with llama-server: the same load with speculation off
and on, at `--clients` clients and at one (`--single-requests` requests),
`--rounds` times (3) in turn, keeping each one's best run, and prints the
aggregate throughput ratio on/off and the single client's inter-token
latency and request time ratios off/on. `--compare-weights` does the same
with `--weights mapped` against `--weights auto` (serve's default: the
weights copied onto huge pages where they take at most half the memory
available), auto in the place of "on".

`--prefix-turns` adds conversations (3, --conversations) whose second turn
carries a ~1,500-token history, one request at a time on fresh servers: turn
2's time to first token (median) on kvexport with its prefix cache on and
with `--prefix-cache-cells 0`, and their ratio; llama-server's (its own
prompt cache on) beside them.

`--soak SECONDS` runs only kvexport, as a user would (prefix cache on): 32
clients, random prompt lengths (log-uniform, up to ~1,450 tokens) and
max_tokens (1-128), a quarter of the requests dropped mid-stream (the socket
closed); every 10 s the server's RSS (/proc/PID/status VmRSS), the cells in
use and those only the prefix cache holds, and over the last 10 s the mean
cells a step attended over and the model's time per step token. No request
starts after SECONDS; those in flight have 300 s more. At the end it checks
that every cell in use is one the prefix cache keeps (a leaked session's are
not), that the RSS is within 5% of its value after the cell pool last grew (it
doubles when the cells in use outgrow it and never shrinks: a step is the
pool, a creep after its last step a leak), that the model's time per step token in the last minute of load is
within 1.5x of the second minute's (in the first, cold prompts prefill whole;
when every step attended over every cell the cache kept, it went from 9.5 to
19.9 ms by the fifth minute), and that every response read to its end was
well-formed (JSON chunks, a finish_reason, usage that agrees with it, [DONE]).

`--omp-passive` sets OMP_WAIT_POLICY=passive for both servers: on a machine
other work keeps busy, OpenMP threads that spin at barriers collapse
(llama-server fell from ~60 to ~8 tokens/s here beside a parallel test run).
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import itertools
import json
import math
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from common import code_digest, cpu_model, drop_older, emit
from llamacpp import llama_f32, run

from kvexport.exporter.sources.models import cache_dir

MODEL = "smollm2-135m"
RECIPE = ("--use-offgraph-kv-cache", "--backend", "aoti")
SLOTS = 16  # sessions each server runs at once
CONTEXT_PER_SLOT = 2048  # llama-server splits -c among its slots: room for the 1,500-token history
MAX_TOKENS = 64
READY_SECONDS = 900  # loading an aoti package and rerunning its probes on a busy 2-core machine

SYSTEM_PROMPT = (
    "You are Quill, the help desk assistant of the Northwind public library. You answer questions from visitors "
    "about opening hours, borrowing rules, the reading rooms, the children's corner, printing and scanning, the "
    "local history archive and the events calendar. Opening hours are Monday to Friday from nine in the morning "
    "to eight in the evening, Saturday from ten to five, and the library is closed on Sundays and public holidays. "
    "Members may borrow up to twelve items at a time for three weeks, and renew each item twice online or at the "
    "desk unless another member has reserved it. Late returns cost twenty cents a day per item, capped at five "
    "dollars. The quiet reading room is on the second floor; group study rooms can be booked for two hours a day. "
    "Printing costs ten cents a page in black and white and fifty cents in colour. Be brief, friendly and exact, "
    "answer in plain English, and when you do not know something, say so and suggest asking a librarian at the desk."
)
TOPICS = ("renewing a loan", "the archive", "printing a poster", "the children's corner", "a lost card",
          "study rooms", "late fees", "Saturday hours", "e-books", "donating books", "the events calendar",
          "scanning old photos", "a reservation", "wifi", "parking", "accessibility")


# ------------------------------------------------------------------ servers
def package(path: str | None) -> Path:
    """--package, or the recipe's export in kvexport's cache directory (made once:
    an aoti export compiles every method, minutes)."""
    if path is not None:
        return Path(path)
    key = hashlib.sha256(json.dumps([MODEL, *RECIPE]).encode()).hexdigest()[:12]
    out = cache_dir() / "bench-packages" / f"{MODEL}-{key}-{code_digest()}"
    if not (out / "manifest.json").exists():
        partial = out.with_name(out.name + ".partial")  # renamed when complete: an interrupted export is redone
        run([sys.executable, "-m", "kvexport.cli.main", "export", MODEL, "-o", str(partial), "--overwrite", *RECIPE],
            capture=False)
        partial.rename(out)
        drop_older(out)
    return out


class Server:
    """One server process for the bench, stopped on leaving the with block
    (SIGTERM, then SIGKILL): a failed run or Ctrl-C leaves none behind."""

    def __init__(self, name: str, command: list[str], url: str | None = None, env: dict | None = None):
        self.name, self.command, self.url, self.env = name, command, url, env
        self.log = Path(tempfile.mkstemp(prefix=f"bench-serve-{name}-", suffix=".log")[1])
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> "Server":
        print("+", " ".join(self.command), file=sys.stderr, flush=True)
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=self.env)
        try:
            self._wait_ready()
        except BaseException:
            self.close(report_death=False)  # the error carries the log's tail
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close(report_death=True)

    def close(self, report_death: bool) -> None:
        """Stops the server and removes its log (shown first if the server died on its own)."""
        if report_death and self.process is not None and self.process.poll() is not None:
            print(f"{self.name} died (exit status {self.process.returncode}):\n{self.tail()}", file=sys.stderr, flush=True)
        self.stop()
        self.log.unlink(missing_ok=True)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.tail()}")
            if self.url is None:  # kvexport serve --port 0 says where it listens
                found = re.search(r"serving .* on (http://\S+)", self.log.read_text(errors="replace"))
                self.url = found.group(1) if found else None
            if self.url is not None and get(self.url, "/health")[0] == 200:
                return
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} was not ready in {READY_SECONDS} s:\n{self.tail()}")

    def tail(self, lines: int = 20) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def rss_mb(self) -> float:
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def kvexport_server(pkg: Path, args: argparse.Namespace, *extra: str) -> Server:
    command = [sys.executable, "-m", "kvexport.cli.main", "serve", str(pkg), "--port", "0",
               "--max-sessions", str(SLOTS), *(["--trust-native-code"] if args.trust_native_code else []), *extra]
    return Server("kvexport", command, env=server_env(args))


def llama_server(binaries: Path, gguf: Path, args: argparse.Namespace) -> Server:
    port = free_port()
    command = [str(binaries / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
               "-np", str(SLOTS), "-c", str(SLOTS * CONTEXT_PER_SLOT), "--cont-batching", "-t", str(args.threads),
               "-ctk", "f32", "-ctv", "f32"]
    return Server("llama-server", command, url=f"http://127.0.0.1:{port}", env=server_env(args))


def server_env(args: argparse.Namespace) -> dict:
    # both servers' OpenMP threads spin at barriers by default: on a busy machine a
    # descheduled thread stalls the spinning ones (llama-server fell from ~60 to ~8 tokens/s so)
    return {**os.environ, "OMP_WAIT_POLICY": "passive"} if args.omp_passive else dict(os.environ)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ client
def get(url: str, path: str) -> tuple[int, str]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read().decode()
    except (OSError, http.client.HTTPException):  # not listening yet, or gone
        return 0, ""
    finally:
        conn.close()


def scrape(url: str) -> dict[str, float]:
    """GET /metrics as {series with its labels: value}."""
    status, text = get(url, "/metrics")
    samples = {}
    for line in text.splitlines() if status == 200 else []:
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


@dataclass
class Outcome:
    """One streamed request as the client saw it."""

    ok: bool = False
    error: str = ""
    dropped: bool = False  # the client closed the socket mid-stream on purpose
    timed_out: bool = False  # no byte came for the rest of the deadline
    max_tokens: int = 0
    sent: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrivals of chunks that carry content
    done: float = 0.0
    text: str = ""
    finish: str | None = None
    usage: dict | None = None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.sent if self.chunk_times else None

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.chunk_times)]

    @property
    def completion_tokens(self) -> int:
        return (self.usage or {}).get("completion_tokens", 0)


def chat(url: str, messages: list[dict], max_tokens: int, deadline: float, ignore_eos: bool = True,
         drop_after: int | None = None) -> Outcome:
    """POSTs one streamed chat completion and reads its SSE lines to [DONE]
    (or closes the socket after `drop_after` content chunks)."""
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
    host, port = url.removeprefix("http://").rsplit(":", 1)
    out = Outcome(max_tokens=max_tokens, sent=time.perf_counter())
    if time.monotonic() >= deadline:
        out.error = "not sent: past the deadline"
        return out
    conn = http.client.HTTPConnection(host, int(port), timeout=max(deadline - time.monotonic(), 1))
    try:
        conn.connect()
        sock = conn.sock  # kept: http.client lets go of it when a response will close the connection
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            out.error = f"HTTP {response.status}: {response.read()[:200]!r}"
            return out
        read_events(response, out, drop_after, sock)
    except TimeoutError:
        out.timed_out, out.error = True, "timed out: nothing came before the deadline"
    except (OSError, http.client.HTTPException) as e:
        out.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    return out


def read_events(response: http.client.HTTPResponse, out: Outcome, drop_after: int | None, sock: socket.socket) -> None:
    """Fills `out` from the stream; ok only for a well-formed one: JSON chunks
    with choices, a finish_reason, usage, then [DONE]."""
    while line := response.readline():
        now = time.perf_counter()
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            out.done = now
            out.ok, out.error = check_finished(out)
            return
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            out.error = f"a data line is not JSON: {data[:80]!r}"
            return
        if "error" in chunk or not isinstance(chunk.get("choices"), list):
            out.error = f"an error or malformed chunk: {data[:200]!r}"
            return
        out.usage = chunk.get("usage") or out.usage
        for choice in chunk["choices"]:
            content = (choice.get("delta") or {}).get("content")
            if content:
                out.text += content
                out.chunk_times.append(now)
            out.finish = choice.get("finish_reason") or out.finish
        if drop_after is not None and len(out.chunk_times) >= drop_after:
            out.dropped = True
            sock.shutdown(socket.SHUT_RDWR)  # the server sees the client leave mid-stream
            return
    out.error = "the stream ended before [DONE]"


def check_finished(out: Outcome) -> tuple[bool, str]:
    """Whether a stream read to [DONE] finished as its usage says."""
    if out.finish not in ("stop", "length"):
        return False, f"finish_reason {out.finish!r}"
    tokens = out.completion_tokens
    if out.usage is None or not 1 <= tokens <= out.max_tokens or (out.finish == "length" and tokens != out.max_tokens):
        return False, f"finish_reason {out.finish!r} with usage {out.usage!r} (max_tokens {out.max_tokens})"
    return True, ""


def question(i: int, distinct: bool = False) -> list[dict]:
    """Request i's messages: the shared system prompt and a question, or
    (distinct) the system prompt opened by a line of the request's own, so
    that no two requests share a prefix past their first tokens."""
    topic = TOPICS[i % len(TOPICS)]
    opening = f"Desk {i}, shift {i * 7919 % 1000}. " if distinct else ""
    return [{"role": "system", "content": opening + SYSTEM_PROMPT},
            {"role": "user", "content": f"Visitor {i} asks about {topic}: what should they know?"}]


def drive(url: str, requests: int, clients: int, rate: float | None, deadline: float,
          distinct: bool = False) -> tuple[list[Outcome], float]:
    """Sends `requests` questions (see `question`): `clients` threads one
    after another, or (rate) open loop at Poisson arrivals; returns the
    outcomes and the wall time."""
    outcomes: list[Outcome] = [Outcome() for _ in range(requests)]

    def send(i: int) -> None:
        outcomes[i] = chat(url, question(i, distinct), MAX_TOKENS, deadline)

    began = time.perf_counter()
    if rate is None:
        numbers = iter(range(requests))
        lock = threading.Lock()

        def client() -> None:
            while True:
                with lock:
                    i = next(numbers, None)
                if i is None:
                    return
                send(i)

        threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    else:
        arrivals = itertools.accumulate(random.Random(0).expovariate(rate) for _ in range(requests))

        def arriving(i: int, at: float) -> None:
            time.sleep(max(began + at - time.perf_counter(), 0))
            send(i)

        threads = [threading.Thread(target=arriving, args=(i, at), daemon=True) for i, at in enumerate(arrivals)]
    for t in threads:  # daemons: Ctrl-C leaves no client behind
        t.start()
    for t in threads:
        t.join()
    last = max((o.done for o in outcomes if o.ok), default=time.perf_counter())
    return outcomes, last - began


# ------------------------------------------------------------------ figures
def percentile(values: list[float], q: float) -> float | None:
    """Nearest rank: the smallest value with at least q of them at or below it."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(math.ceil(q * len(ordered)) - 1, 0)]


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def summary(outcomes: list[Outcome], wall: float) -> dict:
    ok = [o for o in outcomes if o.ok]
    ttfts = [o.ttft for o in ok if o.ttft is not None]
    gaps = [g for o in ok for g in o.gaps]
    tokens = sum(o.completion_tokens for o in ok)
    errors = sorted({o.error for o in outcomes if not o.ok})
    return {"requests_ok": len(ok), "requests_failed": len(outcomes) - len(ok), "errors": errors[:5],
            "output_tokens": tokens, "wall_s": round(wall, 2), "output_tokens_per_s": round(tokens / wall, 1) if wall else 0,
            "mean_prompt_tokens": round(statistics.mean((o.usage or {}).get("prompt_tokens", 0) for o in ok), 1) if ok else None,
            "ttft_ms_p50": ms(percentile(ttfts, 0.5)), "ttft_ms_p99": ms(percentile(ttfts, 0.99)),
            "itl_ms_p50": ms(percentile(gaps, 0.5)), "itl_ms_p99": ms(percentile(gaps, 0.99))}


def engine_share(before: dict[str, float], after: dict[str, float]) -> dict:
    """The engine's own time per step (scheduling, detokenizing, events) beside
    the model's, over what the load added to the histograms."""
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    steps = delta("kvexport_step_seconds_count")
    model, own = delta("kvexport_step_seconds_sum"), delta("kvexport_engine_overhead_seconds_sum")
    if not steps:
        return {}
    return {"steps": int(steps), "model_ms_per_step": round(model / steps * 1000, 2),
            "engine_ms_per_step": round(own / steps * 1000, 2), "engine_fraction_of_step": round(own / (model + own), 3)}


def measure(server: Server, args: argparse.Namespace) -> dict:
    chat(server.url, question(-1), 8, time.monotonic() + 120)  # warm-up, not counted
    before = scrape(server.url)
    load = os.getloadavg()[0]
    outcomes, wall = drive(server.url, args.requests, args.clients, args.rate, time.monotonic() + args.deadline,
                           args.distinct)
    result = {**summary(outcomes, wall), "load_average_before": round(load, 2)}
    after = scrape(server.url)
    share = engine_share(before, after)
    if share:  # kvexport: what the engine did, and the cells its prefix cache kept once the load was over
        result["engine"] = {**share, "cells_in_use_after": after.get("kvexport_cells_in_use")}
    return result


# ------------------------------------------------------------------ prefix turns
def history(conversation: int) -> str:
    """~1,200 tokens of notes (with the system prompt and a reply, turn 2 carries ~1,500),
    different from the first line in every conversation."""
    rng = random.Random(conversation)
    colours, things = ("red", "green", "grey", "blue", "amber"), ("atlas", "ledger", "map", "diary", "folio", "score")
    notes = [f"Note {conversation}.{k}: the {rng.choice(colours)} {rng.choice(things)} from shelf {rng.randint(1, 99)} "
             f"was returned on day {rng.randint(1, 365)} with {rng.randint(0, 9)} pages marked." for k in range(42)]
    return "Here are the archive's notes for this week.\n" + "\n".join(notes)


def prefix_turns(url: str, conversations: int, deadline: float) -> dict:
    """Time to first token of each turn of `conversations` two-turn chats, one at a time."""
    turns: dict[str, list] = {"turn1_ttft": [], "turn2_ttft": [], "turn2_prompt_tokens": [], "turn2_cached_tokens": []}
    for c in range(conversations):
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": history(c)}]
        first = chat(url, messages, MAX_TOKENS, deadline, ignore_eos=False)
        messages += [{"role": "assistant", "content": first.text},
                     {"role": "user", "content": "Which of these notes mention a blue atlas?"}]
        second = chat(url, messages, MAX_TOKENS, deadline, ignore_eos=False)
        if not (first.ok and second.ok):
            raise RuntimeError(f"a prefix-turn request failed: {first.error or second.error}")
        turns["turn1_ttft"].append(first.ttft)
        turns["turn2_ttft"].append(second.ttft)
        turns["turn2_prompt_tokens"].append(second.usage.get("prompt_tokens"))
        turns["turn2_cached_tokens"].append((second.usage.get("prompt_tokens_details") or {}).get("cached_tokens"))
    return {"turn1_ttft_ms_median": ms(statistics.median(turns["turn1_ttft"])),
            "turn2_ttft_ms_median": ms(statistics.median(turns["turn2_ttft"])),
            "turn2_ttft_ms": [ms(t) for t in turns["turn2_ttft"]],
            "turn2_prompt_tokens": turns["turn2_prompt_tokens"], "turn2_cached_tokens": turns["turn2_cached_tokens"]}


def prefix_comparison(pkg: Path, binaries: Path, gguf: Path, args: argparse.Namespace) -> dict:
    """prefix_turns on fresh servers (a cache that the main load filled would
    slow kvexport's every step: each attends over every cell in use): kvexport
    with its prefix cache, without it, and llama-server."""
    servers = {"kvexport_cache_on": kvexport_server(pkg, args),
               "kvexport_cache_off": kvexport_server(pkg, args, "--prefix-cache-cells", "0"),
               "llama-server": llama_server(binaries, gguf, args)}
    out = {}
    for name, server in servers.items():
        with server:
            chat(server.url, question(-1), 8, time.monotonic() + 120)  # warm-up, not counted
            out[name] = prefix_turns(server.url, args.conversations, time.monotonic() + args.deadline)
    on, off = out["kvexport_cache_on"]["turn2_ttft_ms_median"], out["kvexport_cache_off"]["turn2_ttft_ms_median"]
    return {**out, "ttft_ratio_off_over_on": round(off / on, 2)}


# ------------------------------------------------------------------ soak
SOAK_CLIENTS, SAMPLE_SECONDS, DROP_SHARE = 32, 10, 0.25
SOAK_DRAIN_SECONDS = 300  # after SECONDS no request starts; those in flight have this long to finish


def soak_client(url: str, seed: int, until: float, outcomes: list[Outcome]) -> None:
    """Requests of random length one after another until `until`; some dropped mid-stream."""
    rng = random.Random(seed)
    filler = history(1000 + seed).split()
    while time.monotonic() < until:
        words = int(len(filler) ** rng.random())  # log-uniform: mostly short, some ~1,250 tokens beyond the system prompt
        messages = question(rng.randrange(1000))
        messages[1]["content"] += " " + " ".join(filler[:words])
        max_tokens = rng.randint(1, 128)
        drop = rng.randint(1, max(max_tokens // 2, 1)) if rng.random() < DROP_SHARE else None
        outcomes.append(chat(url, messages, max_tokens, until + SOAK_DRAIN_SECONDS, ignore_eos=rng.random() < 0.5,
                             drop_after=drop))


def soak(server: Server, seconds: float) -> dict:
    url, began = server.url, time.monotonic()
    until = began + seconds
    outcomes: list[Outcome] = []
    clients = [threading.Thread(target=soak_client, args=(url, i, until, outcomes), daemon=True) for i in range(SOAK_CLIENTS)]
    for t in clients:
        t.start()
    samples, last = [], scrape(url)
    while any(t.is_alive() for t in clients):
        wait_until(lambda: not any(t.is_alive() for t in clients), SAMPLE_SECONDS)
        now = scrape(url)
        samples.append({"t_s": round(time.monotonic() - began), "rss_mb": round(server.rss_mb(), 1),
                        "cells_in_use": now.get("kvexport_cells_in_use"), "cells_allocated": now.get("kvexport_cells_allocated"),
                        "prefix_cache_cells": now.get("kvexport_prefix_cache_cells"), **step_figures(last, now)})
        last = now
        print(f"soak: {samples[-1]}", file=sys.stderr, flush=True)
    # a dropped request's cells return at the engine's next step: give it a moment
    wait_until(lambda: (m := scrape(url)).get("kvexport_running_requests") == 0
               and m.get("kvexport_cells_in_use") == m.get("kvexport_prefix_cache_cells"), 30)
    return soak_figures(server, outcomes, samples, seconds)


def step_figures(before: dict[str, float], after: dict[str, float]) -> dict:
    """Over what happened between two scrapes: steps, the mean cells a step
    attended over, and the model's time per step token."""
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    steps = delta("kvexport_step_seconds_count")
    if not steps:
        return {"steps": 0}
    return {"steps": int(steps), "cells_read_mean": round(delta("kvexport_step_cells_read_sum") / steps, 1),
            "model_ms_per_token": round(delta("kvexport_step_seconds_sum") * 1000 / delta("kvexport_step_tokens_sum"), 3)}


def window_ms_per_token(samples: list[dict]) -> float | None:
    """Steps' model time per token over samples, weighted by their steps."""
    timed = [s for s in samples if s.get("steps")]
    steps = sum(s["steps"] for s in timed)
    return round(sum(s["model_ms_per_token"] * s["steps"] for s in timed) / steps, 3) if steps else None


def soak_figures(server: Server, outcomes: list[Outcome], samples: list[dict], seconds: float) -> dict:
    metrics = scrape(server.url)
    # the cell pool doubles when the cells in use outgrow it (runtime/cell_cache.py) and never
    # shrinks: the RSS steps up with it; from its last growth on, a creep is a leak
    grown = max((i for i, s in enumerate(samples) if s["cells_allocated"] != samples[0]["cells_allocated"]), default=0)
    reference = samples[min(grown + 1, len(samples) - 1)]
    rss_end = server.rss_mb()
    completed = [o for o in outcomes if not (o.dropped or o.timed_out)]
    malformed = [o for o in completed if not o.ok]
    cells, cached = metrics.get("kvexport_cells_in_use"), metrics.get("kvexport_prefix_cache_cells")
    rss_drift = (rss_end - reference["rss_mb"]) / reference["rss_mb"]
    # the second minute of load against its last (not the drain after it): in the first,
    # cold prompts prefill whole (cheap tokens)
    first = window_ms_per_token([s for s in samples if 60 < s["t_s"] <= 120])
    last = window_ms_per_token([s for s in samples if seconds - 60 < s["t_s"] <= seconds])
    slowdown = round(last / first, 2) if first and last else None
    return {"requests": len(outcomes), "completed": len(completed), "dropped": sum(o.dropped for o in outcomes),
            "timed_out": sum(o.timed_out for o in outcomes),
            "malformed": len(malformed), "malformed_errors": sorted({o.error for o in malformed})[:5],
            "output_tokens": sum(o.completion_tokens for o in completed),
            "cancelled_by_server": metrics.get("kvexport_requests_cancelled"),
            "cells_in_use_end": cells, "prefix_cache_cells_end": cached, "cells_allocated_end": metrics.get("kvexport_cells_allocated"),
            "rss_reference_t_s": reference["t_s"], "rss_mb_reference": reference["rss_mb"], "rss_mb_end": round(rss_end, 1),
            "rss_drift": round(rss_drift, 4), "samples": samples,
            "model_ms_per_token_second_minute": first, "model_ms_per_token_last_minute": last, "slowdown_last_over_first": slowdown,
            "checks": {"cells_in_use_are_the_prefix_caches": cells == cached,
                       "rss_within_5_percent_since_the_pool_last_grew": abs(rss_drift) <= 0.05,
                       "steps_no_slower_than_1.5x": slowdown is not None and slowdown <= 1.5,
                       "every_completed_response_well_formed": not malformed}}


def wait_until(condition: Callable[[], bool], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not condition():
        time.sleep(0.2)


# ------------------------------------------------------------------ comparisons
def comparison(pkg: Path, args: argparse.Namespace, modes: dict[str, list[str]], on: str, off: str) -> dict:
    """The same load on kvexport serve under each of `modes`' flags, at
    args.clients clients and at one, the modes in turn for args.rounds
    rounds, each one's best round kept; ratios of mode `on` over `off`."""
    out: dict = {"mode": on, "off": off, "rounds": args.rounds, "modes": modes}
    for label, clients, requests in (("loaded", args.clients, args.requests), ("single", 1, args.single_requests)):
        load = argparse.Namespace(**{**vars(args), "clients": clients, "requests": requests, "rate": None})
        for _ in range(args.rounds):
            for mode, flags in modes.items():
                with kvexport_server(pkg, args, *flags) as server:
                    got = measure(server, load)
                best = out.get(f"{label}_{mode}")
                if best is None or got["output_tokens_per_s"] > best["output_tokens_per_s"]:
                    out[f"{label}_{mode}"] = got
    loaded_on, loaded_off = out[f"loaded_{on}"], out[f"loaded_{off}"]
    single_on, single_off = out[f"single_{on}"], out[f"single_{off}"]
    out["throughput_ratio_on_over_off"] = round(loaded_on["output_tokens_per_s"] / loaded_off["output_tokens_per_s"], 3)
    # one client, every request 64 tokens: its rate is the inverse of a request's time
    out["single_request_time_ratio_off_over_on"] = round(single_on["output_tokens_per_s"] / single_off["output_tokens_per_s"], 3)
    out["single_itl_p50_ratio_off_over_on"] = (round(single_off["itl_ms_p50"] / single_on["itl_ms_p50"], 3)
                                               if single_on["itl_ms_p50"] else None)
    return out


def speculation_comparison(pkg: Path, args: argparse.Namespace) -> dict:
    """kvexport serve with speculation off and on."""
    modes = {"off": ["--speculative", "off"],
             args.speculative: ["--speculative", args.speculative, *(["--draft", args.draft] if args.draft else [])]}
    return {"draft": args.draft, **comparison(pkg, args, modes, args.speculative, "off")}


def weights_comparison(pkg: Path, args: argparse.Namespace) -> dict:
    """kvexport serve with the weights mapped from the file and held
    `--weights auto` (copied onto huge pages where they fit easily)."""
    modes = {"mapped": ["--weights", "mapped"], "auto": ["--weights", "auto"]}
    return comparison(pkg, args, modes, "auto", "mapped")


# ------------------------------------------------------------------ report
def show(result: dict) -> None:
    """The figures a reader wants first, on stderr (stdout carries the JSON)."""
    lines = [f"CPU: {result['cpu']}, {result['threads']} threads"]
    for name in ("kvexport", "llama-server"):
        r = result.get(name)
        if r:
            lines.append(f"{name:>12}: {r['output_tokens_per_s']:7.1f} tok/s  TTFT p50/p99 {r['ttft_ms_p50']}/{r['ttft_ms_p99']} ms  "
                         f"ITL p50/p99 {r['itl_ms_p50']}/{r['itl_ms_p99']} ms  ok {r['requests_ok']} failed {r['requests_failed']}  "
                         f"(load average {r['load_average_before']})")
    if "throughput_ratio_kvexport_over_llama" in result:
        lines.append(f"throughput kvexport/llama-server: {result['throughput_ratio_kvexport_over_llama']}")
    engine = result.get("kvexport", {}).get("engine")
    if engine:
        lines.append(f"kvexport engine: {engine['engine_ms_per_step']} ms of {engine['engine_ms_per_step'] + engine['model_ms_per_step']:.2f} "
                     f"ms per step ({engine['engine_fraction_of_step']:.1%}) over {engine['steps']} steps; "
                     f"{engine['cells_in_use_after']} cells in use after the load (the prefix cache's)")
    if "prefix" in result:
        p = result["prefix"]
        lines.append(f"turn-2 TTFT (1,500-token history): cache on {p['kvexport_cache_on']['turn2_ttft_ms_median']} ms, "
                     f"off {p['kvexport_cache_off']['turn2_ttft_ms_median']} ms: off/on {p['ttft_ratio_off_over_on']}; "
                     f"llama-server {p.get('llama-server', {}).get('turn2_ttft_ms_median')} ms")
    for what in ("speculation", "weights"):
        if what not in result:
            continue
        c = result[what]
        on, off = c["mode"], c["off"]
        for key in (f"loaded_{off}", f"loaded_{on}", f"single_{off}", f"single_{on}"):
            r = c[key]
            lines.append(f"{key:>16}: {r['output_tokens_per_s']:7.1f} tok/s  ITL p50/p99 {r['itl_ms_p50']}/{r['itl_ms_p99']} ms  "
                         f"ok {r['requests_ok']} failed {r['requests_failed']}")
        lines.append(f"{what} {on}: throughput {on}/{off} {c['throughput_ratio_on_over_off']} at {result['clients']} clients; "
                     f"one client's request time {off}/{on} {c['single_request_time_ratio_off_over_on']}, "
                     f"ITL p50 {off}/{on} {c['single_itl_p50_ratio_off_over_on']}")
    if "soak" in result:
        s = result["soak"]
        lines.append(f"soak: {s['requests']} requests ({s['completed']} completed, {s['dropped']} dropped, {s['timed_out']} timed out, "
                     f"{s['malformed']} malformed), cells in use at the end {s['cells_in_use_end']}, the prefix cache's "
                     f"{s['prefix_cache_cells_end']}; RSS at {s['rss_reference_t_s']} s (after the pool last grew) "
                     f"{s['rss_mb_reference']} MiB, at the end {s['rss_mb_end']}; model ms per step token, second minute "
                     f"{s['model_ms_per_token_second_minute']}, last {s['model_ms_per_token_last_minute']}; checks {s['checks']}")
    print("\n".join(lines), file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--package", help="a kvexport package to serve (default: the recipe's aoti export, made once)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--clients", type=int, default=SLOTS, help="closed loop: clients sending one request after another")
    parser.add_argument("--rate", type=float, help="open loop instead: Poisson arrivals at this many requests/s")
    parser.add_argument("--deadline", type=float, default=900, help="seconds the load of one server may take in all")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama-server's -t")
    parser.add_argument("--distinct", action="store_true",
                        help="every request its own system prompt (no shared prefix: each one prefills ~220 tokens)")
    parser.add_argument("--prefix-turns", action="store_true", help="also time turn 2 of long conversations, prefix cache on and off")
    parser.add_argument("--conversations", type=int, default=3)
    parser.add_argument("--soak", type=float, metavar="SECONDS", help="only the soak of kvexport serve, this long")
    parser.add_argument("--trust-native-code", action="store_true", help="passed to kvexport serve (a --package not trusted here)")
    parser.add_argument("--speculative", choices=["lookup", "draft"], help="compare kvexport serve with this speculation against it off")
    parser.add_argument("--draft", help="the draft package for --speculative draft")
    parser.add_argument("--compare-weights", action="store_true",
                        help="compare kvexport serve with --weights mapped and auto (its default), as --speculative does")
    parser.add_argument("--single-requests", type=int, default=8, help="requests of the one-client half of --speculative or --compare-weights")
    parser.add_argument("--rounds", type=int, default=3,
                        help="--speculative, --compare-weights: each load this many times, the two in turn, keeping each one's best "
                             "(the order requests arrive in, and so the steps, differs from run to run)")
    parser.add_argument("--omp-passive", action="store_true",
                        help="OMP_WAIT_POLICY=passive for both servers: on a shared machine spinning threads collapse")
    args = parser.parse_args()
    # SIGTERM (and Ctrl-C) unwind through the with blocks, which stop the servers
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    pkg = package(args.package)
    result: dict = {"cpu": cpu_model(), "threads": args.threads, "omp_passive": args.omp_passive, "package": str(pkg),
                    "clients": args.clients}
    if args.speculative or args.compare_weights:
        if args.speculative:
            result["speculation"] = speculation_comparison(pkg, args)
        else:
            result["weights"] = weights_comparison(pkg, args)
        show(result)
        emit(result)
        return
    if args.soak is not None:
        with kvexport_server(pkg, args) as server:
            result["soak"] = soak(server, args.soak)
        show(result)
        emit(result)
        return
    binaries, gguf = llama_f32(MODEL)
    with kvexport_server(pkg, args) as server:
        result["kvexport"] = measure(server, args)
    with llama_server(binaries, gguf, args) as server:
        result["llama-server"] = measure(server, args)
    llama_rate = result["llama-server"]["output_tokens_per_s"]
    result["throughput_ratio_kvexport_over_llama"] = round(result["kvexport"]["output_tokens_per_s"] / llama_rate, 3) if llama_rate else None
    if args.prefix_turns:
        result["prefix"] = prefix_comparison(pkg, binaries, gguf, args)
    show(result)
    emit(result)


if __name__ == "__main__":
    main()
