"""A GCS API server on a loopback port for the tests (gcp-storage-emulator, in this process's
threads): everything the project writes is pointed at it by STORAGE_EMULATOR_HOST alone, the
variable Google's clients read. `refusing()` makes it answer every write with 403, as a
bucket without write permission does; `stock()` takes the generations away (below).

The emulator (2026.7.19) ignores GCS's generation preconditions (ifGenerationMatch,
ifGenerationNotMatch) and sends no x-goog-generation header with an object's bytes; GCS does
both, and tensorstore's OCDBT (how Orbax writes checkpoints) depends on them to commit its
manifest safely ("Malformed StorageGeneration" without the header; lost writes without the
preconditions). _with_generations() adds them to the emulator's router, as GCS documents them
(https://cloud.google.com/storage/docs/request-preconditions)."""
from __future__ import annotations

import contextlib
import json
import os
import socket
from urllib.parse import parse_qs, unquote, urlparse

BUCKET = "supo-test"
_REFUSE = {"on": False}
_STOCK = {"on": False}     # stock(): the emulator as released, without generations
UPLOADED = {"bytes": 0}    # request body bytes the server received (POST, PUT, PATCH)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_OBJECT = ("/storage/v1/b/", "/download/storage/v1/b/", "/b/")


def _target(path: str, query: dict):
    """(bucket, object) a request names: an upload's ?name=, or the path's /b/B/o/OBJECT."""
    for prefix in ("/upload/storage/v1/b/", *_OBJECT):
        if path.startswith(prefix):
            rest = path[len(prefix):]
            bucket, _, tail = rest.partition("/")
            if tail == "o" and "name" in query:
                return bucket, query["name"][0]
            if tail.startswith("o/"):
                return bucket, unquote(tail[2:])
    return None, None


def _with_generations(srv) -> None:
    state = {"generation": None}
    handle, close = srv.Router.handle, srv.Response.close

    def generation(storage, bucket, name) -> str:
        try:
            return str(storage.get_file_obj(bucket, name)["generation"])
        except Exception:   # noqa: BLE001  (NotFound: generation 0, as GCS says)
            return "0"

    def send(h, code: int, message: str) -> None:
        body = json.dumps({"error": {"code": code, "message": message}}).encode()
        h.send_response(code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def data(self):      # read once per request: the precondition check may read it first
        h = self._request_handler
        if not hasattr(h, "_supo_data"):
            h._supo_data = srv._read_data(h, self._query)
        return h._supo_data
    srv.Request.data = property(data)

    def guarded(self, method):
        if _STOCK["on"]:
            state["generation"] = None
            return handle(self, method)
        h = self._request_handler
        url = urlparse(h.path)
        q = parse_qs(url.query)
        bucket, name = _target(url.path, q)
        if (bucket is None and method == "POST" and url.path.startswith("/upload/")
                and q.get("uploadType") == ["multipart"]
                and ("ifGenerationMatch" in q or "ifGenerationNotMatch" in q)):
            # a multipart upload names its object in its body's metadata part
            body = srv.Request(h, method).data
            if isinstance(body, dict) and "meta" in body:
                bucket, name = url.path.split("/b/", 1)[1].split("/", 1)[0], body["meta"]["name"]
        state["generation"] = None
        if bucket is not None and "/copyTo/" not in url.path and "/rewriteTo/" not in url.path:
            cur = generation(h.storage, bucket, name)
            if "ifGenerationMatch" in q and q["ifGenerationMatch"][0] != cur:
                return send(h, 412, "Precondition Failed")
            if "ifGenerationNotMatch" in q and q["ifGenerationNotMatch"][0] == cur:
                if method == "GET":
                    h.send_response(304)
                    h.end_headers()
                    return None
                return send(h, 412, "Precondition Failed")
            if method == "GET" and cur != "0":
                state["generation"] = cur
        return handle(self, method)

    def closing(self):
        if state["generation"] is not None:
            self["x-goog-generation"] = state["generation"]
            state["generation"] = None
        return close(self)

    srv.Router.handle, srv.Response.close = guarded, closing


def start():
    """(server, host URL): the emulator serving BUCKET, kept in memory."""
    from gcp_storage_emulator import server as srv

    if not getattr(srv.RequestHandler, "_supo_patched", False):
        for name in ("do_POST", "do_PUT", "do_DELETE", "do_PATCH"):
            orig = getattr(srv.RequestHandler, name, None)
            if orig is None:
                continue

            def refusing_or(self, _orig=orig):
                UPLOADED["bytes"] += int(self.headers.get("Content-Length") or 0)
                if _REFUSE["on"]:
                    body = b'{"error": {"code": 403, "message": "write access denied"}}'
                    self.send_response(403)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return None
                return _orig(self)
            setattr(srv.RequestHandler, name, refusing_or)
        _with_generations(srv)
        srv.RequestHandler._supo_patched = True
    port = _free_port()
    server = srv.create_server("127.0.0.1", port, in_memory=True, default_bucket=BUCKET)
    server._api.daemon = True   # a test that fails before stop() does not hold its process
    server.start()
    return server, f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def refusing():
    _REFUSE["on"] = True
    try:
        yield
    finally:
        _REFUSE["on"] = False


@contextlib.contextmanager
def stock():
    """The emulator as released: generation preconditions ignored, no x-goog-generation."""
    _STOCK["on"] = True
    try:
        yield
    finally:
        _STOCK["on"] = False


def env(host: str) -> dict:
    """The environment of a process that should use the emulator: STORAGE_EMULATOR_HOST only."""
    e = {k: v for k, v in os.environ.items() if k != "TENSORSTORE_GCS_HTTP_URL"}
    return {**e, "STORAGE_EMULATOR_HOST": host}
