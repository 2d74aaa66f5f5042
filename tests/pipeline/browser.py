"""A headless Chromium driven over the Chrome DevTools protocol (websocket-client, which the
kubernetes client already needs): open a page, run JavaScript in it, wait for what it renders,
and see the requests it sends, as a person's browser would send them."""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Any

import websocket


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


class Browser:
    """One headless Chromium with one page: ``with Browser() as b: b.open(url)``."""

    def __init__(self, width: int = 1440, height: int = 1400, timeout: float = 30.0):
        self.size, self.timeout = (width, height), timeout
        self._ids = itertools.count(1)
        self.events: list[dict] = []

    def __enter__(self) -> Browser:
        self._profile = tempfile.TemporaryDirectory(prefix="posttrain-chromium-")
        binary = chromium_path()
        if binary is None:
            raise FileNotFoundError("chromium")
        self.proc = subprocess.Popen(
            [binary, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
             "--force-device-scale-factor=1", f"--window-size={self.size[0]},{self.size[1]}",
             f"--user-data-dir={self._profile.name}", "--remote-debugging-port=0", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            self.ws = websocket.create_connection(self._page_ws_url(), timeout=self.timeout, suppress_origin=True)
            self.call("Page.enable")
            self.call("Runtime.enable")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if getattr(self, "ws", None) is not None:
            self.ws.close()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)
        self._profile.cleanup()

    def _page_ws_url(self) -> str:
        """The page's DevTools socket: Chromium writes its port to DevToolsActivePort in the profile."""
        import urllib.request

        active = os.path.join(self._profile.name, "DevToolsActivePort")
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited ({self.proc.returncode})")
            if os.path.exists(active) and open(active).read().count("\n") >= 1:
                port = open(active).read().split("\n")[0]
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=5) as r:
                    pages = [t for t in json.loads(r.read()) if t["type"] == "page"]
                if pages:
                    return pages[0]["webSocketDebuggerUrl"]
            time.sleep(0.1)
        raise TimeoutError("chromium did not open its DevTools port")

    def call(self, method: str, **params) -> dict:
        """Send one DevTools command and return its result; events that arrive meanwhile are kept."""
        msg_id = next(self._ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self.events.append(msg)

    def pump(self, seconds: float) -> None:
        """Read the events that arrive within ``seconds``."""
        self.ws.settimeout(seconds)
        try:
            while True:
                self.events.append(json.loads(self.ws.recv()))
        except websocket.WebSocketTimeoutException:
            pass
        finally:
            self.ws.settimeout(self.timeout)

    def open(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def js(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (promises awaited)."""
        out = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in out:
            raise RuntimeError(f"JavaScript failed: {out['exceptionDetails']}")
        return out["result"].get("value")

    def wait_for(self, expression: str, timeout: float | None = None) -> Any:
        """Poll a JavaScript expression until it is truthy; its value. An expression that throws (the
        page is still loading: no body yet, or the navigation replaced the context) counts as false."""
        deadline = time.monotonic() + (timeout or self.timeout)
        error = None
        while True:
            try:
                value = self.js(expression)
            except RuntimeError as e:
                value, error = None, e
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"the page never satisfied: {expression} (last error: {error})")
            time.sleep(0.2)

    def screenshot(self, path: str, *, full_page: bool = True) -> None:
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            width, height = self.js("[document.documentElement.scrollWidth, document.documentElement.scrollHeight]")
            params["clip"] = {"x": 0, "y": 0, "width": width, "height": height, "scale": 1}
            params["captureBeyondViewport"] = True
        with open(path, "wb") as f:
            f.write(base64.b64decode(self.call("Page.captureScreenshot", **params)["data"]))

    def intercept(self, url_pattern: str) -> None:
        """Hold every request whose URL matches ``url_pattern`` (a glob) until ``held_request`` lets it on."""
        self.call("Fetch.enable", patterns=[{"urlPattern": url_pattern, "requestStage": "Request"}])

    def held_request(self, timeout: float | None = None) -> dict:
        """The next held request (``Fetch.requestPaused``'s params: requestId, request{url, method, postData})."""
        deadline = time.monotonic() + (timeout or self.timeout)
        while time.monotonic() < deadline:
            for i, event in enumerate(self.events):
                if event.get("method") == "Fetch.requestPaused":
                    return self.events.pop(i)["params"]
            self.pump(0.2)
        raise TimeoutError("the page sent no request matching the interception pattern")

    def resume(self, request_id: str, post_data: str | None = None) -> None:
        """Let a held request go on, with ``post_data`` instead of its own body when given."""
        extra = {} if post_data is None else {"postData": base64.b64encode(post_data.encode()).decode()}
        self.call("Fetch.continueRequest", requestId=request_id, **extra)

