"""Open a page in headless Chromium and collect its console errors over the DevTools protocol.

The browser is one already on the machine: Chromium or Chrome on PATH (`BROWSERS`). Nothing here
or in `make test` installs one; without it the browser tests skip and say why (`MISSING`). CI's
own machine installs Debian's `chromium` package before the tests (`.ci/run`). playwright's PyPI
package is no way round it: it holds no browser, and `playwright install chromium` downloads one
from its own host, not the package index (on a machine that reaches only the registries, refused).
`console_errors(path)` starts it with a fresh profile, opens the page, waits for the load event,
and returns every console error, uncaught exception and failed load (`Log.entryAdded` at level
"error") as text.

`python -m tests.browser` says which browser the tests will use (exit 0) or why they will skip
(exit 1), with the standard library only: `make test` and `.ci/run` ask it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
from pathlib import Path

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--no-first-run",
    "--disable-component-update",
    "--disable-sync",
)


#: The executables tried, in order: Debian's and Ubuntu's Chromium, Google's Chrome.
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
MISSING = (
    f"no headless browser on PATH (tried {', '.join(BROWSERS)}): the browser tests skip; "
    "install Chromium to run them (Debian: the chromium package)"
)


def chromium() -> str | None:
    """The first of `BROWSERS` on PATH, or None."""
    return next((p for name in BROWSERS if (p := shutil.which(name))), None)


async def _collect(ws_url: str, url: str, timeout: float) -> list[str]:
    import aiohttp

    errors: list[str] = []
    ids = iter(range(1, 1 << 30))
    async with aiohttp.ClientSession() as http, http.ws_connect(ws_url, max_msg_size=1 << 26) as ws:
        pending: dict[int, asyncio.Future] = {}
        loaded = asyncio.Event()

        async def send(method: str, params: dict | None = None, session: str | None = None) -> dict:
            n = next(ids)
            fut = asyncio.get_running_loop().create_future()
            pending[n] = fut
            msg = {"id": n, "method": method, "params": params or {}}
            if session:
                msg["sessionId"] = session
            await ws.send_str(json.dumps(msg))
            return await fut

        async def reader() -> None:
            async for raw in ws:
                msg = json.loads(raw.data)
                if "id" in msg and msg["id"] in pending:
                    pending.pop(msg["id"]).set_result(msg.get("result", msg.get("error")))
                    continue
                method, params = msg.get("method"), msg.get("params", {})
                if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                    errors.append(
                        "console: " + " ".join(str(a.get("value", a.get("description"))) for a in params["args"])
                    )
                elif method == "Runtime.exceptionThrown":
                    errors.append("exception: " + params["exceptionDetails"].get("text", ""))
                elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
                    errors.append(f"log: {params['entry'].get('text')} {params['entry'].get('url', '')}".strip())
                elif method == "Page.loadEventFired":
                    loaded.set()

        task = asyncio.create_task(reader())
        try:
            target = await send("Target.createTarget", {"url": "about:blank"})
            attached = await send("Target.attachToTarget", {"targetId": target["targetId"], "flatten": True})
            session = attached["sessionId"]
            for domain in ("Runtime", "Log", "Page"):
                await send(f"{domain}.enable", session=session)
            await send("Page.navigate", {"url": url}, session=session)
            await asyncio.wait_for(loaded.wait(), timeout)
            await asyncio.sleep(0.5)  # late console output and failed loads after the load event
        finally:
            task.cancel()
    return errors


def console_errors(path: Path, *, timeout: float = 60.0) -> list[str]:
    """Console errors, exceptions and failed loads of the page at `path` in headless Chromium."""
    exe = chromium()
    if exe is None:
        raise RuntimeError(MISSING)
    # Chromium's helper processes (renderer, crash handler) outlive the browser process for a moment and
    # still write into the profile: the whole process group is stopped, and a file one of them left
    # behind does not fail the check (the profile is a throwaway).
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        proc = subprocess.Popen(
            [exe, *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0", "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            assert proc.stderr is not None
            ws_url = None
            for line in proc.stderr:  # "DevTools listening on ws://127.0.0.1:PORT/devtools/browser/ID"
                m = re.search(r"DevTools listening on (ws://\S+)", line)
                if m:
                    ws_url = m.group(1)
                    break
            if ws_url is None:
                raise RuntimeError(f"chromium exited ({proc.wait()}) without a DevTools address")
            # keep draining its log, so that a full pipe never blocks the browser
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            return asyncio.run(_collect(ws_url, Path(path).resolve().as_uri(), timeout))
        finally:
            _stop_group(proc)


def _stop_group(proc: subprocess.Popen) -> None:
    """Stop Chromium and every helper it started (its own session's process group)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(10)
            break
        except subprocess.TimeoutExpired:
            continue
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # helpers still alive after the browser itself exited


if __name__ == "__main__":
    import sys

    found = chromium()
    print(f"headless-browser tests: {found}" if found else f"headless-browser tests: {MISSING}")
    sys.exit(0 if found else 1)
