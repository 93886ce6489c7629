"""``maskkv serve`` as a user runs it: its help, an address in use, and a bounded load test on the real command in its
own process (200 requests from 16 concurrent clients on the embedded model), whose memory must come back to idle."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from serving import NEEDLE_ANSWER, QUESTION, corpus, health, upload, wait_for
from typer.testing import CliRunner

from maskkv_cli.cli import app

runner = CliRunner()

REQUESTS = 200
CLIENTS = 16
QUEUE = 4
ATTEMPTS = 50
LOAD_KEY = "load-key-51c2"
# Memory allowed above idle after the load. Idle is read after 20 warm-up requests one at a time and 32 from 16
# clients at once (the first ones allocate what every later one reuses: with requests running together, each
# worker thread's allocations and the batched steps' buffers). Between idle and after, the server's resident set
# moved by 0.4-0.6 MiB in six runs one request at a time, 0.3-2.4 MiB in three with five at once; keeping every answer
# of the load (its tokens, statistics and per-layer records, ~50 KiB each) moved it by 9.6 MiB, and a kept prompt
# cache would add ~260 KiB per request. 8 MiB is well above that noise and below the smallest leak.
RSS_SLACK = 8 << 20


def test_serve_help_shows_examples_and_the_limits():
    result = runner.invoke(app, ["serve", "--help"], terminal_width=120)
    assert result.exit_code == 0
    for words in ("maskkv serve --model", "--api-key", "MASKKV_API_KEY", "--queue", "--max-upload-mb",
                  "curl -F file=@report.pdf", "docs/server.md"):
        assert words in result.output, words


def test_an_unbounded_size_limit_is_refused_as_a_usage_error():
    """--max-body-mb inf (or 1e400) stopped serve with "error: OverflowError: cannot convert float infinity to
    integer"."""
    for option in ("--max-body-mb", "--max-upload-mb"):
        result = runner.invoke(app, ["serve", option, "inf", "--port", "0"])
        assert result.exit_code == 2 and "less than or equal to" in result.output and "Overflow" not in result.output


def test_an_address_in_use_fails_in_one_line_before_the_model_loads():
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        port = taken.getsockname()[1]
        start = time.monotonic()
        result = runner.invoke(app, ["serve", "--port", str(port)])
        assert result.exit_code == 1
        assert re.fullmatch(rf"error: cannot listen on 127\.0\.0\.1:{port} \(.+\); choose another --port or "
                            r"--host, or stop what uses it\n", result.stderr), result.stderr
        assert time.monotonic() - start < 5  # no model was loaded for nothing
    finally:
        taken.close()


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


class ServeProcess:
    """``maskkv serve --port 0`` in a process of its own; its URL read from its first line; always stopped."""

    def __init__(self, home: Path, *args: str) -> None:
        env = {**os.environ, "MASKKV_HOME": str(home), "MASKKV_API_KEY": LOAD_KEY, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "maskkv_cli", "serve", "--port", "0", *args],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     env=env, text=True)
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.reader = threading.Thread(target=self.read, daemon=True)
        self.reader.start()
        if not self.ready.wait(120):
            self.stop()
            raise AssertionError(f"maskkv serve did not start: {self.lines}")
        self.url = re.search(r"at (http://127\.0\.0\.1:\d+)/ ", next(x for x in self.lines if " at http" in x))[1]

    def read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:  # drained to the end, so that the process never blocks on a full pipe
            self.lines.append(line.rstrip("\n"))
            if " at http://" in line:
                self.ready.set()
        self.ready.set()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # Ctrl-C: uvicorn's graceful shutdown
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.reader.join(10)
        return self.proc.returncode


def test_a_bounded_load_is_answered_or_refused_and_memory_returns_to_idle(tmp_path):
    openai = pytest.importorskip("openai", reason="the openai client is not installed: pip install -e '.[dev]'")
    server = ServeProcess(tmp_path / "home", "--queue", str(QUEUE), "--quiet")
    try:
        text = corpus("bees.txt")[:300] + " The special magic number for harbor is 4821. " + corpus("bees.txt")[300:600]
        document = upload(server.url, "short.txt", text.encode(), key=LOAD_KEY).json()["id"]
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=LOAD_KEY, max_retries=0, timeout=60)
        ask = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": QUESTION}],
               "extra_body": {"maskkv": {"documents": [document], "budget": 32}}}

        def one(seed: int) -> tuple[str, int]:
            """One request, sent again after a 429 (sooner than Retry-After, to keep the queue full) up to
            ATTEMPTS times: its outcome, and the 429s it met."""
            wait = random.Random(seed)
            for attempt in range(ATTEMPTS):
                try:
                    answer = client.chat.completions.create(**ask)
                except openai.RateLimitError as exc:
                    assert int(exc.response.headers["retry-after"]) >= 1
                    time.sleep(wait.uniform(0.02, 0.2))
                    continue
                text = answer.choices[0].message.content
                return ("ok" if text == NEEDLE_ANSWER else f"wrong answer {text!r}"), attempt
            return "429", ATTEMPTS

        for i in range(20):  # warm: the first requests allocate what every later one reuses
            assert one(i) == ("ok", 0)
        with ThreadPoolExecutor(CLIENTS) as pool:  # and requests in flight together: every worker thread's
            assert all(outcome == "ok" for outcome, _ in pool.map(one, range(1000, 1000 + 2 * CLIENTS)))  # share
        time.sleep(0.5)
        idle = rss_bytes(server.proc.pid)
        before = health(server.url)["queue"]

        start = time.monotonic()
        with ThreadPoolExecutor(CLIENTS) as pool:
            outcomes = list(pool.map(one, range(REQUESTS)))
        wall = time.monotonic() - start
        wait_for(lambda: (q := health(server.url)["queue"])["running"] == q["waiting"] == 0, what="an idle queue")
        time.sleep(0.5)
        after = rss_bytes(server.proc.pid)
        counts = health(server.url)["queue"]

        answered = sum(1 for outcome, _ in outcomes if outcome == "ok")
        refused = sum(1 for outcome, _ in outcomes if outcome == "429")  # 429 at every attempt
        refusals = sum(n for _, n in outcomes)  # every 429 answered
        print(f"\nload: {REQUESTS} requests from {CLIENTS} clients, queue {QUEUE}: {answered} answered, {refused} "
              f"refused in the end, {refusals} 429s on the way, {wall:.1f} s; server RSS idle {idle / 2**20:.1f} "
              f"MiB, after {after / 2**20:.1f} MiB")
        assert answered + refused == REQUESTS, [o for o, _ in outcomes if o not in ("ok", "429")][:3]
        assert refusals > 0 and answered >= REQUESTS // 2  # the limit was met, and the queue worked through it
        assert counts["answered"] - before["answered"] == answered  # none lost: each counted once, either way
        assert counts["refused"] - before["refused"] == refusals
        assert counts["failed"] == counts["cancelled"] == counts["timed_out"] == 0
        assert wall < 60
        assert after <= idle + RSS_SLACK, (idle, after)
    finally:
        code = server.stop()
    assert code == 0, server.lines[-10:]
