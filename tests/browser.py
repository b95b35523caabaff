"""Headless Chromium driven over the DevTools protocol (aiohttp's WebSocket client, no other
dependency), for tests of the dashboard page as a browser runs it."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import os
import shutil
import signal
import tempfile
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp

CHROMIUM = next((path for name in ("chromium", "chromium-browser", "google-chrome")
                 if (path := shutil.which(name))), None)
# Without the background-networking flags Chromium keeps dialling out of a closed network.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-extensions", "--remote-debugging-port=0", "--window-size=1400,1500"]


class Browser:
    """One page of a fresh headless Chromium: ``evaluate`` JavaScript in it, ``screenshot``."""

    def __init__(self) -> None:
        # Chromium's helper processes may still be writing to the profile as it goes.
        self._profile = tempfile.TemporaryDirectory(ignore_cleanup_errors=True)
        self._process: asyncio.subprocess.Process | None = None
        self._session: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._ids = itertools.count(1)

    async def __aenter__(self) -> Browser:
        assert CHROMIUM is not None
        self._process = await asyncio.create_subprocess_exec(
            CHROMIUM, *FLAGS, f"--user-data-dir={self._profile.name}", "about:blank",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
            start_new_session=True)  # its own process group, ended whole
        self._session = aiohttp.ClientSession()
        page = await self._page(Path(self._profile.name) / "DevToolsActivePort")
        self._ws = await self._session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)
        return self

    async def _page(self, active: Path) -> dict[str, Any]:
        """The page target, once Chromium has written its port and answers on it (it may
        write the file a moment before it listens, on a loaded machine)."""
        assert self._session is not None
        deadline = asyncio.get_running_loop().time() + 30
        while True:
            try:
                lines = active.read_text().splitlines()
                if len(lines) == 2:
                    url = f"http://127.0.0.1:{lines[0]}/json/list"
                    async with self._session.get(url) as resp:
                        targets = await resp.json()
                    page = next((t for t in targets if t["type"] == "page"), None)
                    if page is not None:
                        return dict(page)
            except (OSError, aiohttp.ClientError, ValueError):
                if asyncio.get_running_loop().time() > deadline:
                    raise
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError("Chromium did not open its DevTools port")
            await asyncio.sleep(0.05)

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        trace: TracebackType | None) -> None:
        if self._ws is not None:
            await self._ws.close()
        if self._session is not None:
            await self._session.close()
        if self._process is not None and self._process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._process.pid, signal.SIGKILL)
            await self._process.wait()
        self._profile.cleanup()

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        assert self._ws is not None
        ident = next(self._ids)
        await self._ws.send_json({"id": ident, "method": method, "params": params})
        while True:
            message = await self._ws.receive_json(timeout=30)
            if message.get("id") == ident:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                result: dict[str, Any] = message["result"]
                return result

    async def goto(self, url: str) -> None:
        await self.send("Page.navigate", url=url)

    async def evaluate(self, expression: str) -> Any:
        result = await self.send("Runtime.evaluate", expression=expression,
                                 returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout_s: float = 15.0) -> Any:
        """The value of ``expression`` once it is truthy."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            try:
                value = await self.evaluate(expression)
            except RuntimeError:
                value = None
            if value:
                return value
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"never true: {expression}")
            await asyncio.sleep(0.1)

    async def screenshot(self, path: Path) -> None:
        shot = await self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(shot["data"]))
