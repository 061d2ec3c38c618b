"""An HTTP proxy on 127.0.0.1 in front of the local S3 server (moto) that makes some requests fail, as a real object
store does now and then: a 500 or 503 answer, a slow answer, an answer cut off part way (the connection closed
after some of its bytes). Each request meets a fault with probability `rate`, drawn from a seeded generator; the
kinds are drawn evenly from `kinds`. A 500/503 never reaches the server; a slow answer is the server's, late; a cut
answer is the server's too (the request was carried out, the client cannot know it was).

    proxy = FaultProxy("http://127.0.0.1:5000", rate=0.05, seed=0)   # then AWS_ENDPOINT_URL=proxy.url
    proxy.set(rate=1.0, kinds=("503",))                              # an outage
    proxy.counts                                                     # requests seen, faults by kind
"""

import http.client
import http.server
import random
import threading
import time
from urllib.parse import urlparse

KINDS = ("500", "503", "slow", "cut")
_ERRORS = {"500": ("InternalError", "We encountered an internal error. Please try again."),
           "503": ("SlowDown", "Please reduce your request rate.")}
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}


class FaultProxy:
    def __init__(self, upstream: str, *, rate: float = 0.0, kinds=KINDS, seed: int = 0, slow_s: float = 0.5):
        parsed = urlparse(upstream)
        self.upstream = (parsed.hostname, parsed.port)
        self.slow_s = slow_s
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self.counts: dict[str, int] = {"requests": 0, **{kind: 0 for kind in KINDS}}
        self.set(rate=rate, kinds=kinds)
        proxy = self

        class Handler(_Handler):
            owner = proxy

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def set(self, *, rate: float | None = None, kinds=None) -> None:
        """Changes the fault rate and/or kinds from the next request on."""
        with self._lock:
            if rate is not None:
                self.rate = float(rate)
            if kinds is not None:
                unknown = set(kinds) - set(KINDS)
                assert not unknown, f"unknown fault kinds {sorted(unknown)}; known: {KINDS}"
                self.kinds = tuple(kinds)

    def faults(self) -> int:
        return sum(self.counts[kind] for kind in KINDS)

    def _draw(self) -> str | None:
        """The fault of the next request (None: none), counted."""
        with self._lock:
            self.counts["requests"] += 1
            if self._random.random() >= self.rate:
                return None
            kind = self._random.choice(self.kinds)
            self.counts[kind] += 1
            return kind

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> "FaultProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Handler(http.server.BaseHTTPRequestHandler):
    owner: FaultProxy
    protocol_version = "HTTP/1.1"  # keep-alive, and "Expect: 100-continue" answered as clients expect

    def log_message(self, *args):  # quiet
        pass

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _forward(self, body: bytes):
        """The server's answer to this request: (status, reason, headers, body)."""
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP | {"content-length"}}
        if body or self.command in ("PUT", "POST"):
            headers["Content-Length"] = str(len(body))
        connection = http.client.HTTPConnection(*self.owner.upstream, timeout=60)
        try:
            connection.request(self.command, self.path, body=body, headers=headers)
            response = connection.getresponse()
            content = response.read()
            return response.status, response.reason, response.getheaders(), content
        finally:
            connection.close()

    def _send(self, status: int, reason: str, headers, content: bytes, *, cut: bool = False) -> None:
        self.send_response_only(status, reason)
        length = None
        for key, value in headers:
            if key.lower() in _HOP_BY_HOP:
                continue
            if key.lower() == "content-length":
                length = value
                continue
            self.send_header(key, value)
        if self.command == "HEAD":
            self.send_header("Content-Length", length if length is not None else "0")
        else:
            self.send_header("Content-Length", str(len(content)))
        self.end_headers()
        if self.command == "HEAD":
            content = b""
        if cut:  # half the body, then the connection goes
            self.wfile.write(content[:len(content) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(content)

    def _handle(self) -> None:
        body = self._body()
        fault = self.owner._draw()
        if fault in _ERRORS:
            code, message = _ERRORS[fault]
            content = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}'
                       f'</Message><RequestId>fault-proxy</RequestId></Error>').encode()
            self.close_connection = True
            self._send(int(fault), "Internal Server Error" if fault == "500" else "Service Unavailable",
                       [("Content-Type", "application/xml"), ("Connection", "close")], content)
            return
        if fault == "slow":
            time.sleep(self.owner.slow_s)
        status, reason, headers, content = self._forward(body)
        if fault == "cut" and (not content or self.command == "HEAD"):
            self.close_connection = True  # no answer at all: the connection closes after the request was served
            return
        self._send(status, reason, headers, content, cut=fault == "cut")

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle
