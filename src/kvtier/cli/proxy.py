"""`kvtier proxy`: one OpenAI-compatible address in front of separate prefill and decode engines.

    kvtier proxy --prefill http://10.0.0.1:8100 [URL ...] --decode http://10.0.0.2:8200 [URL ...]
                 [--host 127.0.0.1] [--port 8000] [--connect-timeout 10] [--timeout 600]

The prefill engines run `kvtier serve ... --kv-role kv_producer`, the decode engines
`kvtier serve ... --kv-role kv_consumer`, all with the same shared tier (`--redis-url`, an S3
bucket or a shared `--disk-path`). Clients talk to the proxy as to one vLLM server. For each
POST /v1/completions or /v1/chat/completions it

1. sends a copy of the request to the next prefill engine (round-robin) with `max_tokens=1`
   (and `max_completion_tokens=1` for chat), `stream=false`, without `stream_options`,
   `min_tokens` and `min_completion_tokens` (vLLM refuses them beside those), and with
   `kv_transfer_params` = the client's own (if any) merged with vLLM's remote-decode marker
   `{"do_remote_decode": true, "do_remote_prefill": false}`;
2. puts the `kv_transfer_params` of the prefill's JSON answer, whole, into the client's request
   (in place of the client's own), otherwise unchanged, and sends that to the next decode engine
   (a round-robin of its own). A prefill answer without them (a connector that promises
   nothing) leaves the client's request exactly as sent, and is logged once per prefill engine;
3. streams the decode engine's answer back as it arrives: the SSE stream when the client asked
   `stream: true`, else the JSON, byte for byte, with the decode engine's status.

Both halves get the same `X-Request-Id` (the client's, or a new one) and the client's
`Authorization` header. GET /v1/models is the first decode engine's that answers (each tried
once); GET /health is 200 when every engine's /health is, else 503, with each engine's status.

Errors are the client's answer: an engine's own error (status >= 300) reaches the client with
its status and body, and the request goes no further; an engine that cannot be reached gives a
502, one that does not answer within the timeouts a 504, both as an OpenAI-style JSON error that
names the side ("prefill" or "decode") and the engine. Nothing is retried. The timeouts bound
the connection (`--connect-timeout`) and every wait for an engine's next bytes (`--timeout`,
generous: a long prompt's prefill is one wait). A decode stream that breaks after its first
bytes cannot change the status the client already has: the proxy closes the connection, so the
client sees a truncated answer, never a complete-looking one.

How it relates to vLLM's own: vLLM ships its disaggregation proxies as examples and test
fixtures, not as an installed command (`tests/v1/kv_connector/nixl_integration/
toy_proxy_server.py`, `examples/online_serving/disaggregated_serving/`, on FastAPI + httpx).
This module keeps their conventions (the marker, `max_tokens=1`, the prefill's params copied
whole into the decode request, one request id for both halves, independent round-robins) and
differs where a proxy in front of users must: finite timeouts instead of none, engine errors
returned to the client instead of a 500 with a traceback, and no vLLM import (it runs on
aiohttp, which vLLM depends on, so a proxy host needs no engine installed).

Concurrency: one asyncio event loop; the round-robins and the "already logged" set are touched
only from it.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import urllib.parse
import uuid
from dataclasses import dataclass
from typing import Any

from kvtier.errors import ConfigError

try:
    # a dependency of vLLM's: kvtier itself does not require it
    from aiohttp import (
        ClientError,
        ClientResponse,
        ClientSession,
        ClientTimeout,
        TCPConnector,
        web,
    )
except ImportError:
    web = None

__all__ = ["REMOTE_DECODE", "ProxySettings", "add_proxy_flags", "make_app", "proxy_main"]

logger = logging.getLogger(__name__)

# vLLM's convention for "prefill here, decode elsewhere" (its NIXL and Mooncake connectors read it)
REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False}
# request fields vLLM refuses beside `max_tokens=1` and `stream=false`: kept for the decode only
PREFILL_DROPPED = ("stream_options", "min_tokens", "min_completion_tokens")
# a long prompt of token ids is megabytes of JSON: aiohttp's default limit (1 MiB) would refuse
# requests that vLLM serves
MAX_BODY_BYTES = 256 * 2**20
# headers of the client's that both engines get
FORWARDED_HEADERS = ("Authorization",)
REQUEST_ID_HEADER = "X-Request-Id"
# seconds in-flight answers get to finish at SIGINT / SIGTERM
SHUTDOWN_GRACE_S = 5.0


@dataclass(frozen=True, slots=True)
class ProxySettings:
    """Where the engines are and how long the proxy waits for them.

    prefill_urls / decode_urls: base URLs of the engines ("http://host:port"), one or more each.
    connect_timeout_s: seconds to open a connection to an engine.
    read_timeout_s: seconds to wait for an engine's next bytes (a prefill's whole answer is one wait).
    """

    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        for side, urls in (("--prefill", self.prefill_urls), ("--decode", self.decode_urls)):
            if not urls:
                raise ConfigError(f"kvtier proxy needs at least one {side} URL")
            for url in urls:
                parts = urllib.parse.urlsplit(url)
                if (
                    parts.scheme not in ("http", "https")
                    or not parts.netloc
                    or (parts.path, parts.query, parts.fragment) != ("", "", "")
                ):
                    raise ConfigError(
                        f"{side} {url!r}: give the engine's base URL, e.g. http://10.0.0.1:8100"
                    )
        if self.connect_timeout_s <= 0 or self.read_timeout_s <= 0:
            raise ConfigError("kvtier proxy: --connect-timeout and --timeout must be > 0 seconds")


def prefill_body(body: dict[str, Any], is_chat: bool) -> dict[str, Any]:
    """The prefill engine's copy of client request `body`: one token, not streamed, marked.

    Raises:
        ValueError: the client's `kv_transfer_params` is not a JSON object.
    """
    params = body.get("kv_transfer_params") or {}
    if not isinstance(params, dict):
        raise ValueError("kv_transfer_params must be a JSON object")
    prefill = {key: value for key, value in body.items() if key not in PREFILL_DROPPED}
    prefill["max_tokens"] = 1
    if is_chat:
        prefill["max_completion_tokens"] = 1
    prefill["stream"] = False
    prefill["kv_transfer_params"] = {**params, **REMOTE_DECODE}
    return prefill


def decode_body(body: dict[str, Any], params: dict[str, Any] | None) -> dict[str, Any]:
    """The decode engine's request: the client's `body`, with the prefill's `params` if it gave any."""
    if not params:
        return body
    return {**body, "kv_transfer_params": params}


class _Failure(Exception):
    """What the client gets instead of a completion (an engine's error, or the proxy's 4xx/5xx)."""

    def __init__(self, response: web.Response):
        super().__init__(response.status)
        self.response = response


def error_response(status: int, message: str, **fields: str) -> web.Response:
    """An OpenAI-style JSON error: `{"error": {"message", "type", "code", **fields}}`."""
    kinds = {400: "BadRequestError", 502: "BadGateway", 504: "GatewayTimeout"}
    error = {"message": message, "type": kinds.get(status, "Error"), "code": status, **fields}
    return web.json_response({"error": error}, status=status)


def _unreachable(side: str, url: str, exc: BaseException) -> _Failure:
    if isinstance(exc, TimeoutError):
        message = f"{side} engine {url} did not answer in time"
        return _Failure(error_response(504, message, side=side, engine=url))
    message = f"{side} engine {url} is unreachable: {exc}"
    return _Failure(error_response(502, message, side=side, engine=url))


def _copy_of(upstream: ClientResponse, data: bytes) -> web.Response:
    """Engine answer `upstream`, its body `data`, as the proxy's: its status, body, content type."""
    content_type = upstream.headers.get("Content-Type", "application/json")
    return web.Response(status=upstream.status, body=data, headers={"Content-Type": content_type})


async def _read(upstream: ClientResponse, side: str, url: str) -> bytes:
    """The whole body of engine `url`'s answer `upstream`."""
    try:
        return await upstream.read()
    except (ClientError, TimeoutError) as exc:
        raise _unreachable(side, url, exc) from exc


class Proxy:
    """The routes' state: the engines' round-robins and one HTTP client session for all of them."""

    def __init__(self, settings: ProxySettings):
        self.settings = settings
        self._prefills = itertools.cycle(settings.prefill_urls)
        self._decodes = itertools.cycle(settings.decode_urls)
        # prefill engines already logged for answering without kv_transfer_params
        self._logged_unmarked: set[str] = set()
        self._session: ClientSession | None = None

    async def open(self, app: web.Application) -> None:
        timeout = ClientTimeout(
            total=None,
            sock_connect=self.settings.connect_timeout_s,
            sock_read=self.settings.read_timeout_s,
        )
        # no connection limit of its own (aiohttp's default is 100): the engines queue requests, and
        # a request waiting for a pooled connection would not be waiting for an engine
        self._session = ClientSession(timeout=timeout, connector=TCPConnector(limit=0))

    async def close(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._relay(request, "/v1/completions", is_chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._relay(request, "/v1/chat/completions", is_chat=True)

    async def _relay(self, request: web.Request, path: str, is_chat: bool) -> web.StreamResponse:
        """Prefill on one engine, decode on another, the decode's answer streamed to the client."""
        headers = _upstream_headers(request)
        try:
            body = await _client_body(request)
            prefill = _prefill_request(body, is_chat)
            prefill_url = next(self._prefills)
            params = await self._prefill(prefill_url, path, prefill, headers)
            decode_url = next(self._decodes)
            return await self._decode(request, decode_url, path, decode_body(body, params), headers)
        except _Failure as failure:
            return failure.response

    async def _prefill(
        self, url: str, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> dict[str, Any] | None:
        """The `kv_transfer_params` of prefill engine `url`'s answer (None: it gave none)."""
        upstream = await self._post("prefill", url, path, body, headers)
        async with upstream:
            data = await _read(upstream, "prefill", url)
        if upstream.status >= 300:
            raise _Failure(_copy_of(upstream, data))
        try:
            answer = json.loads(data)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            message = f"prefill engine {url} answered with something other than a JSON object"
            raise _Failure(error_response(502, message, side="prefill", engine=url))
        params = answer.get("kv_transfer_params")
        if not params and url not in self._logged_unmarked:
            self._logged_unmarked.add(url)
            logger.warning(
                "prefill engine %s answered without kv_transfer_params: decode engines get the "
                "client's request unchanged (is its connector a kv_producer?)",
                url,
            )
        return params or None

    async def _decode(
        self,
        request: web.Request,
        url: str,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
    ) -> web.StreamResponse:
        """Decode engine `url`'s answer to `body`, copied to the client as its bytes arrive."""
        upstream = await self._post("decode", url, path, body, headers)
        async with upstream:
            if upstream.status >= 300:
                return _copy_of(upstream, await _read(upstream, "decode", url))
            return await _stream(request, upstream, url)

    async def _post(
        self, side: str, url: str, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> ClientResponse:
        """Engine `url`'s answer, once its status and headers are in (the body is the caller's)."""
        try:
            return await self._session.post(
                url + path, json=body, headers=headers, allow_redirects=False
            )
        except (ClientError, TimeoutError) as exc:
            raise _unreachable(side, url, exc) from exc

    async def models(self, request: web.Request) -> web.Response:
        """GET /v1/models: the first decode engine's answer (each tried once, in order)."""
        failure = None
        for url in self.settings.decode_urls:
            try:
                async with self._session.get(url + "/v1/models") as upstream:
                    return _copy_of(upstream, await upstream.read())
            except (ClientError, TimeoutError) as exc:
                failure = _unreachable("decode", url, exc)
        return failure.response

    async def health(self, request: web.Request) -> web.Response:
        """GET /health: 200 when every engine's /health is 200, else 503; each engine's status.
        Each engine has the connect timeout for its whole answer."""
        sides = {"prefill": self.settings.prefill_urls, "decode": self.settings.decode_urls}
        checks = {
            (side, url): self._engine_health(url) for side, urls in sides.items() for url in urls
        }
        results = await asyncio.gather(*checks.values())
        report: dict[str, dict[str, str]] = {"prefill": {}, "decode": {}}
        for (side, url), result in zip(checks, results, strict=True):
            report[side][url] = result
        is_healthy = all(result == "ok" for result in results)
        return web.json_response(report, status=200 if is_healthy else 503)

    async def _engine_health(self, url: str) -> str:
        timeout = ClientTimeout(total=self.settings.connect_timeout_s)
        try:
            async with self._session.get(url + "/health", timeout=timeout) as upstream:
                return "ok" if upstream.status == 200 else f"status {upstream.status}"
        except (ClientError, TimeoutError) as exc:
            return f"unreachable: {type(exc).__name__}"


async def _client_body(request: web.Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.read())
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise _Failure(error_response(400, "the request body must be a JSON object"))
    return body


def _prefill_request(body: dict[str, Any], is_chat: bool) -> dict[str, Any]:
    try:
        return prefill_body(body, is_chat)
    except ValueError as exc:
        raise _Failure(error_response(400, str(exc), param="kv_transfer_params")) from exc


def _upstream_headers(request: web.Request) -> dict[str, str]:
    headers = {name: request.headers[name] for name in FORWARDED_HEADERS if name in request.headers}
    headers[REQUEST_ID_HEADER] = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
    return headers


async def _stream(request: web.Request, upstream: ClientResponse, url: str) -> web.StreamResponse:
    """Copy `upstream`'s body to the client chunk by chunk, with its status and content type."""
    response = web.StreamResponse(status=upstream.status)
    response.headers["Content-Type"] = upstream.headers.get("Content-Type", "application/json")
    try:
        await response.prepare(request)
        await _copy_body(request, upstream, response, url)
    except ConnectionError:
        # leaving the upstream's context closes its connection: vLLM aborts the request
        logger.info("a client of decode engine %s went away before the answer's end", url)
    return response


async def _copy_body(
    request: web.Request, upstream: ClientResponse, response: web.StreamResponse, url: str
) -> None:
    """Engine answer `upstream`'s body into client answer `response`, prepared.

    Raises:
        ConnectionError: the client went away.
    """
    while True:
        try:
            chunk = await upstream.content.readany()
        except (ClientError, TimeoutError) as exc:
            # the status is sent already: a closed connection is the only error the client can see
            logger.warning("decode engine %s broke off its answer: %s", url, exc)
            if request.transport is not None:
                request.transport.close()
            return
        if not chunk:
            break
        await response.write(chunk)
    await response.write_eof()


def make_app(settings: ProxySettings) -> web.Application:
    """The proxy's aiohttp application (its client session opens and closes with the app)."""
    if web is None:
        raise ConfigError(
            "kvtier proxy runs on aiohttp, which vLLM installs: pip install aiohttp (or kvtier[vllm])"
        )
    proxy = Proxy(settings)
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app.on_startup.append(proxy.open)
    app.on_cleanup.append(proxy.close)
    app.router.add_post("/v1/completions", proxy.completions)
    app.router.add_post("/v1/chat/completions", proxy.chat_completions)
    app.router.add_get("/v1/models", proxy.models)
    app.router.add_get("/health", proxy.health)
    return app


def add_proxy_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prefill",
        nargs="+",
        required=True,
        metavar="URL",
        help="Prefill engines' base URLs (kvtier serve --kv-role kv_producer), round-robin.",
    )
    parser.add_argument(
        "--decode",
        nargs="+",
        required=True,
        metavar="URL",
        help="Decode engines' base URLs (kvtier serve --kv-role kv_consumer), round-robin.",
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="Address to listen on (default: 127.0.0.1)."
    )
    parser.add_argument("--port", type=int, default=8000, help="Port to listen on (default: 8000).")
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="Seconds to connect to an engine before answering 504 (default: 10).",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="Seconds to wait for an engine's next bytes (a whole prefill is one wait) before "
        "answering 504 (default: 600).",
    )


def proxy_main(args: argparse.Namespace) -> int:
    """Serve until SIGINT / SIGTERM.

    Raises:
        ConfigError: no engine URL of a side, a URL that is not a base URL, a timeout <= 0.
    """
    settings = ProxySettings(
        prefill_urls=tuple(url.rstrip("/") for url in args.prefill),
        decode_urls=tuple(url.rstrip("/") for url in args.decode),
        connect_timeout_s=args.connect_timeout,
        read_timeout_s=args.timeout,
    )
    app = make_app(settings)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logger.info(
        "kvtier proxy on http://%s:%d: prefill %s, decode %s",
        args.host,
        args.port,
        " ".join(settings.prefill_urls),
        " ".join(settings.decode_urls),
    )
    web.run_app(
        app,
        host=args.host,
        port=args.port,
        shutdown_timeout=SHUTDOWN_GRACE_S,
        print=None,
        access_log=None,
    )
    return 0
