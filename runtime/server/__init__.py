"""`kvexport serve`: an OpenAI-compatible HTTP server over one package.

    serve("pkg", port=8000)     # blocks; SIGTERM stops it gracefully, exit 0

engine.py steps every request through one cell pool (continuous batching,
chunked prefill, prefix caching in prefix_cache.py); app.py is the HTTP side;
openai_api.py the API's bodies; metrics.py what GET /metrics reports.
"""

from __future__ import annotations

import logging
import signal
import socket
from pathlib import Path
from typing import Callable

from kvexport.contract.errors import KvexportError

log = logging.getLogger(__name__)


def serve(
    package: Path | str,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    api_key: str | None = None,
    model_name: str | None = None,
    max_sessions: int = 32,
    max_queue: int = 256,
    max_step_tokens: int = 256,
    prefix_cache_cells: int | None = None,
    max_cells: int | None = None,
    max_body_bytes: int = 4 << 20,
    grace_seconds: float = 10.0,
    trust_native_code: bool = False,
    expect_digest: str | None = None,
    verify: bool = True,
    state_dir: Path | str | None = None,
    speculative: str | None = None,
    draft: Path | str | None = None,
    max_draft: int = 8,
    weights: str = "auto",
    on_listening: Callable[[str], None] | None = None,
) -> None:
    """Serves `package` until SIGTERM or SIGINT. The socket is bound first
    (so a taken port fails at once, and port 0 picks a free one); the package
    loads and verifies in the background while /health answers 503."""
    import uvicorn

    from kvexport.contract.package import WEIGHTS_MEMORY
    from kvexport.runtime.server.app import ServerState, create_app, start_loading
    from kvexport.runtime.server.engine import Engine
    from kvexport.runtime.speculative import resolve_mode

    if grace_seconds < 0:
        raise KvexportError(f"--grace-seconds must be >= 0, got {grace_seconds}")
    if max_body_bytes < 1024:
        raise KvexportError(f"--max-body-bytes must be at least 1024, got {max_body_bytes}")
    if weights not in WEIGHTS_MEMORY:
        raise KvexportError(f"--weights must be one of {', '.join(WEIGHTS_MEMORY)}, got {weights!r}")
    engine_options = dict(max_sessions=max_sessions, max_queue=max_queue, max_step_tokens=max_step_tokens,
                          prefix_cache_cells=prefix_cache_cells)
    Engine.check_options(**engine_options)
    speculative = resolve_mode(speculative, draft is not None, max_draft)
    sock = _bind(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    url = f"http://{bound_host if ':' not in bound_host else f'[{bound_host}]'}:{bound_port}"
    state = ServerState(model_id=model_name or Path(package).resolve().name, api_key=api_key, max_body_bytes=max_body_bytes)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if sig == signal.SIGTERM:  # a graceful stop: finish or cancel, then exit 0
                self.should_exit = True
                return
            super().handle_exit(sig, frame)

    def stop() -> None:
        server.should_exit = True

    def startup() -> None:
        start_loading(state, stop, package=package, trust_native_code=trust_native_code, expect_digest=expect_digest,
                      max_cells=max_cells, verify=verify, engine_options=engine_options,
                      state_dir=Path(state_dir) if state_dir is not None else None, speculative=speculative,
                      draft=draft, max_draft=max_draft, weights=weights)
        if on_listening is not None:
            on_listening(url)

    app = create_app(state, on_startup=startup)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=grace_seconds, lifespan="on",
                            access_log=False)
    server = Server(config)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        if state.engine is not None:
            state.engine.shutdown()
    if state.error is not None:
        raise KvexportError(state.error)


def _bind(host: str, port: int) -> socket.socket:
    if not 0 <= port <= 65535:
        raise KvexportError(f"--port must be in 0..65535, got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise KvexportError(f"--host {host}: not an address this machine can bind ({e.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise KvexportError(f"cannot listen on {host}:{port}: {e.strerror}; pick another --port (0 picks a free one)") from None
    sock.set_inheritable(True)
    return sock
