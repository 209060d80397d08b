"""What the served soak (benchmarks/soak/) sends, and the clients that send it.

- `Workload`: seeded multi-turn conversations on a few shared system prompts, as token ids
  (the tiny model has no tokenizer). A conversation is replayed as recorded: each turn's
  prompt is the system prompt, the earlier turns (user message + a fixed assistant reply)
  and the new user message, so every prompt is known in advance and the baseline computes
  each distinct one once. `sessions(n)` lists conversations, replayed in a seeded order,
  for exactly `n` requests.
- `Clients`: a bounded number of threads sending the turns of a few conversations in
  progress at once, interleaved: a conversation's next turn waits behind the others' (greedy,
  temperature 0, a fixed seed). Nothing waits unbounded.
  `pause()` holds new requests back (and `wait_idle` waits until none is in flight);
  with `retry=True` a failed request is sent again once the server answers (SIGTERM window).
- `RssSampler`: the resident memory of a server's process tree, once a second.

Thread-safety: `Clients` and `RssSampler` own their threads; their results are read after `join`/`stop`.
"""

from __future__ import annotations

import http.client
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field

__all__ = ["Clients", "Outcome", "RssSampler", "Workload", "baseline_outputs", "fresh_tokens"]

# token ids the tiny Llama knows, special ids left out
_VOCAB = (3, 8192)


@dataclass(frozen=True)
class Workload:
    num_conversations: int = 16
    num_system_prompts: int = 4
    system_tokens: int = 512
    turns: int = 4
    user_tokens: tuple[int, int] = (64, 192)
    reply_tokens: tuple[int, int] = (24, 48)
    max_tokens: int = 8
    # the conversations (each soak run has its own)
    seed: int = 0
    # the system prompts (shared by every run, as a deployment's are)
    system_seed: int = 1000

    def conversations(self) -> list[list[tuple[int, ...]]]:
        """Per conversation, the prompt of each turn."""
        rng = random.Random(self.system_seed)
        systems = [_tokens(rng, self.system_tokens) for _ in range(self.num_system_prompts)]
        rng = random.Random(self.seed)
        convs = []
        for i in range(self.num_conversations):
            history = list(systems[i % len(systems)])
            prompts = []
            for _ in range(self.turns):
                history += _tokens(rng, rng.randint(*self.user_tokens))
                prompts.append(tuple(history))
                # the recorded reply
                history += _tokens(rng, rng.randint(*self.reply_tokens))
            convs.append(prompts)
        return convs

    def sessions(self, num_requests: int, seed: int) -> list[list[tuple[int, ...]]]:
        """Conversations in a seeded order, repeated, cut to exactly `num_requests` prompts."""
        convs = self.conversations()
        rng = random.Random(seed)
        out = []
        left = num_requests
        while left > 0:
            order = list(range(len(convs)))
            rng.shuffle(order)
            for i in order:
                if left <= 0:
                    break
                out.append(convs[i][:left])
                left -= len(out[-1])
        return out

    def distinct_prompts(self) -> int:
        return self.num_conversations * self.turns


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*_VOCAB) for _ in range(n)]


def fresh_tokens(n: int, seed: int) -> list[int]:
    """A prompt no workload holds (for probes that only keep the server stepping)."""
    return _tokens(random.Random(f"probe-{seed}-{time.monotonic_ns()}"), n)


@dataclass
class Outcome:
    """One request: its prompt, what came back (None: it failed), how many tries it took."""

    prompt: tuple[int, ...]
    token_ids: list[int] | None = None
    # vLLM's prompt_tokens_details: its own prefix cache + kvtier's hits
    cached_tokens: int = 0
    error: str | None = None
    attempts: int = 0
    seconds: float = 0.0
    # time.monotonic()
    ended_at: float = 0.0


@dataclass
class Clients:
    """`concurrency` threads sending `sessions` to `server` (anything with `post` and `url`).

    `active` conversations are in progress at once, taking turns: a conversation's next turn
    queues behind the other conversations' (as users' turns interleave on a busy server), so
    the engine's own cache has evicted much of its history by then; when one ends, the next
    session starts.
    """

    server: object
    sessions: list[list[tuple[int, ...]]]
    concurrency: int
    max_tokens: int
    active: int = 8
    # resend a failed request once the server answers again (bounded)
    retry: bool = False
    request_timeout_s: float = 300.0
    retry_for_s: float = 600.0
    outcomes: list[Outcome] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Condition()
        # (session, turn) ready to send
        self._queue: deque[tuple[int, int]] = deque()
        self._next_session = 0
        self._in_flight = 0
        self._paused = False
        for _ in range(min(self.active, len(self.sessions))):
            self._start_session()
        self._threads = [
            threading.Thread(target=self._run, name=f"soak-client-{i}", daemon=True)
            for i in range(self.concurrency)
        ]

    @property
    def num_done(self) -> int:
        with self._lock:
            return len(self.outcomes)

    def start(self) -> Clients:
        for thread in self._threads:
            thread.start()
        return self

    def join(self, timeout_s: float) -> bool:
        """Wait for every session (bounded); False if some thread was still sending at the end."""
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in self._threads)

    def wait_done(self, num: int, timeout_s: float) -> bool:
        """Until `num` requests have ended (or all have); False at the timeout."""
        with self._lock:
            return self._lock.wait_for(
                lambda: len(self.outcomes) >= num or self._all_done(), timeout_s
            )

    def pause(self) -> None:
        with self._lock:
            self._paused = True

    def resume(self) -> None:
        with self._lock:
            self._paused = False
            self._lock.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        with self._lock:
            return self._lock.wait_for(lambda: self._in_flight == 0, timeout_s)

    def _all_done(self) -> bool:
        return not self._queue and self._in_flight == 0 and self._next_session >= len(self.sessions)

    def _start_session(self) -> None:
        if self._next_session < len(self.sessions):
            self._queue.append((self._next_session, 0))
            self._next_session += 1

    def _take(self) -> tuple[int, int] | None:
        """The next turn to send; None when every session has ended (or nothing moved for too long)."""
        deadline = time.monotonic() + self.request_timeout_s + self.retry_for_s
        with self._lock:
            while self._paused or not self._queue:
                if self._all_done() or time.monotonic() > deadline:
                    return None
                self._lock.wait(1.0)
            self._in_flight += 1
            return self._queue.popleft()

    def _run(self) -> None:
        while (item := self._take()) is not None:
            session, turn = item
            outcome = self._send(self.sessions[session][turn])
            with self._lock:
                self.outcomes.append(outcome)
                self._in_flight -= 1
                if turn + 1 < len(self.sessions[session]):
                    self._queue.append((session, turn + 1))
                else:
                    self._start_session()
                self._lock.notify_all()

    def _send(self, prompt: tuple[int, ...]) -> Outcome:
        outcome = Outcome(prompt)
        started = time.monotonic()
        while True:
            # a paused client waits, a retrying one too (bounded: resume always follows)
            with self._lock:
                self._lock.wait_for(lambda: not self._paused, self.retry_for_s)
            outcome.attempts += 1
            self._try(outcome)
            if (
                outcome.token_ids is not None
                or not self.retry
                or time.monotonic() - started > self.retry_for_s
            ):
                outcome.ended_at = time.monotonic()
                outcome.seconds = outcome.ended_at - started
                return outcome
            # the server is going down or coming back up
            time.sleep(1.0)

    def _try(self, outcome: Outcome) -> None:
        body = {
            "model": "tiny",
            "prompt": list(outcome.prompt),
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "seed": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        try:
            status, reply = self.server.post(
                "/v1/completions", body, timeout=self.request_timeout_s
            )
        # refused, reset, timed out
        except (OSError, http.client.HTTPException) as exc:
            outcome.error = f"{type(exc).__name__}: {exc}"
            return
        if status != 200:
            outcome.error = f"HTTP {status}: {str(reply)[:200]}"
            return
        choice = reply["choices"][0]
        if choice.get("finish_reason") != "length" or len(choice["token_ids"]) != self.max_tokens:
            # e.g. "abort": the server stopped while generating; the reply is not the request's answer
            reason = choice.get("finish_reason")
            num = len(choice["token_ids"])
            outcome.error = f"incomplete: finish_reason={reason}, {num} tokens"
            return
        outcome.token_ids = list(choice["token_ids"])
        outcome.error = None
        details = reply.get("usage", {}).get("prompt_tokens_details") or {}
        outcome.cached_tokens = int(details.get("cached_tokens") or 0)


def baseline_outputs(
    server, workload: Workload, concurrency: int, timeout_s: float = 1800.0
) -> dict[tuple[int, ...], list[int]]:
    """Every distinct prompt of `workload`, sent once (conversations in order) to `server`."""
    clients = Clients(
        server, workload.conversations(), concurrency, workload.max_tokens, active=concurrency
    ).start()
    if not clients.join(timeout_s):
        raise RuntimeError(f"the baseline server did not answer every prompt in {timeout_s:.0f} s")
    failed = [o.error for o in clients.outcomes if o.token_ids is None]
    if failed:
        raise RuntimeError(f"{len(failed)} baseline request(s) failed, e.g. {failed[0]}")
    return {o.prompt: o.token_ids for o in clients.outcomes}


class RssSampler:
    """Samples the resident memory of `server`'s processes every `interval_s` on a thread of its
    own, while it is ready (not while it starts or stops)."""

    def __init__(self, server, interval_s: float = 1.0):
        self.server = server
        self.interval_s = interval_s
        # (seconds since start, server start number, {"<comm>:<pid>": bytes})
        self.samples: list[tuple[float, int, dict[str, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-rss", daemon=True)
        self._t0 = time.monotonic()

    def start(self) -> RssSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            rss = self.server.rss_by_process() if self.server.ready else {}
            if rss:
                self.samples.append((time.monotonic() - self._t0, self.server.num_starts, rss))
