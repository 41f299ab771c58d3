"""A canary stream: one client thread that keeps a greedy request streaming (a new one as each
ends) and records the longest wait between two tokens, so a test can show that whatever it does
to the server leaves a neighbouring stream undisturbed.

CanaryProcess runs it in a process of its own (`python -m tests.helpers.canary ADDRESS`): a test
that sends big messages from its own threads would otherwise hold the canary's GIL while it
builds or copies them, and charge its own pauses to the server.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from clients import Client
from clients.errors import SplitserveError

PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]


@dataclass(slots=True)
class CanaryStats:
    tokens: int = 0
    requests_done: int = 0
    longest_gap_s: float = 0.0
    # Outputs that differ from the first request's (greedy: every request must give the same).
    mismatches: int = 0
    errors: list[str] = field(default_factory=list)


class Canary:
    def __init__(self, address: str, max_tokens: int = 48, **client_options: object) -> None:
        self._address = address
        self._max_tokens = max_tokens
        self._client_options = client_options
        self._lock = threading.Lock()
        self._stats = CanaryStats()
        self._expected: list[int] | None = None
        self._last_token_at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="canary", daemon=True)

    def __enter__(self) -> Canary:
        self.start()
        self.wait_for_tokens(1, timeout_s=60)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def stats(self) -> CanaryStats:
        with self._lock:
            return CanaryStats(
                self._stats.tokens,
                self._stats.requests_done,
                self._stats.longest_gap_s,
                self._stats.mismatches,
                list(self._stats.errors),
            )

    def reset_gap(self) -> None:
        """Starts measuring the longest gap afresh (from the next token)."""
        with self._lock:
            self._stats.longest_gap_s = 0.0
            self._last_token_at = None

    def wait_for_tokens(self, more: int, timeout_s: float = 30.0) -> CanaryStats:
        """Waits until the canary has streamed `more` tokens beyond now; AssertionError if not."""
        return _wait_for_tokens(self.stats, more, timeout_s)

    def _run(self) -> None:
        with Client(self._address, **self._client_options) as client:
            while not self._stop.is_set():
                tokens: list[int] = []
                try:
                    for delta in client.stream(
                        prompt_token_ids=PROMPT, max_tokens=self._max_tokens, temperature=0, ignore_eos=True
                    ):
                        tokens.extend(delta.token_ids)
                        self._saw_tokens(len(delta.token_ids))
                except SplitserveError as error:
                    with self._lock:
                        self._stats.errors.append(str(error))
                    return
                self._finished(tokens)

    def _saw_tokens(self, count: int) -> None:
        now = time.monotonic()
        with self._lock:
            if self._last_token_at is not None:
                self._stats.longest_gap_s = max(self._stats.longest_gap_s, now - self._last_token_at)
            self._last_token_at = now
            self._stats.tokens += count

    def _finished(self, tokens: list[int]) -> None:
        with self._lock:
            if self._expected is None:
                self._expected = tokens
            elif tokens != self._expected:
                self._stats.mismatches += 1
            self._stats.requests_done += 1


REPO_ROOT = Path(__file__).resolve().parents[2]


def _wait_for_tokens(stats_now: Callable[[], CanaryStats], more: int, timeout_s: float) -> CanaryStats:
    target = stats_now().tokens + more
    deadline = time.monotonic() + timeout_s
    while (stats := stats_now()).tokens < target:
        assert not stats.errors, stats.errors
        assert time.monotonic() < deadline, f"the canary stalled at {stats.tokens} tokens"
        time.sleep(0.01)
    return stats


class CanaryProcess:
    """Canary's methods, answered by a canary in a child process over its stdin and stdout
    (one command a line: stats or reset; one JSON line back for each)."""

    def __init__(self, address: str, max_tokens: int = 48) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.canary", address, str(max_tokens)],
            cwd=REPO_ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._lock = threading.Lock()

    def __enter__(self) -> CanaryProcess:
        self.wait_for_tokens(1, timeout_s=60)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._process.stdin is not None
        self._process.stdin.close()
        try:
            self._process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def stats(self) -> CanaryStats:
        return CanaryStats(**json.loads(self._ask("stats")))

    def reset_gap(self) -> None:
        self._ask("reset")

    def wait_for_tokens(self, more: int, timeout_s: float = 30.0) -> CanaryStats:
        """As Canary.wait_for_tokens."""
        return _wait_for_tokens(self.stats, more, timeout_s)

    def _ask(self, command: str) -> str:
        assert self._process.stdin is not None and self._process.stdout is not None
        with self._lock:
            self._process.stdin.write(command + "\n")
            self._process.stdin.flush()
            answer = self._process.stdout.readline()
        assert answer, f"the canary process exited (status {self._process.poll()})"
        return answer


def _serve(address: str, max_tokens: int) -> None:
    """The child's side: a canary, asked for its stats until stdin closes."""
    canary = Canary(address, max_tokens)
    canary.start()
    for command in sys.stdin:
        if command.strip() == "reset":
            canary.reset_gap()
        sys.stdout.write(json.dumps(dataclasses.asdict(canary.stats())) + "\n")
        sys.stdout.flush()
    canary.stop()


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]))
