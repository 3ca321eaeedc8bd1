"""The report where users look: a real Prefect server with its UI, the report artifact of a
finished run published by the flow's own report task, opened in headless Chromium (Debian's
``chromium``) through the DevTools protocol: every image on the page loads, the headline table is
there, and the screenshot is kept (``report-artifact.png`` in the test's folder). Runs when
Chromium is installed; ``.ci/run`` installs it."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import stop_process_group
from test_report import full_run  # noqa: F401  (a finished run's directory, written without training)
from websockets.sync.client import connect

from pipeline.train.launch import free_port

ROOT = Path(__file__).parent.parent
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.release,  # the UI in a browser: make test-release
    pytest.mark.skipif(CHROMIUM is None, reason="no Chromium: .ci/run installs Debian's chromium"),
]
PUBLISH = """
import sys
from prefect import flow
from flows.report import report

@flow(name="ui-check")
def publish(run_dir: str) -> None:
    report(run_dir, "uicheck")

publish(sys.argv[1])
"""
# What the page shows once the artifact rendered: its images (loaded or not) and its tables' text.
PAGE = """JSON.stringify({
  images: Array.from(document.querySelectorAll('img')).filter(i => i.src.startsWith('data:image/png'))
    .map(i => [i.complete, i.naturalWidth]),
  tables: Array.from(document.querySelectorAll('table')).map(t => t.innerText),
})"""


def wait_for(url: str, what: str, proc: subprocess.Popen, seconds: float = 180) -> httpx.Response:
    deadline = time.monotonic() + seconds
    while True:
        assert proc.poll() is None, f"{what} exited"
        try:
            response = httpx.get(url, timeout=2)
            if response.status_code == 200:
                return response
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{what} did not answer in {seconds} s"
        time.sleep(0.5)


def started(argv: list[str], env: dict | None = None, log: Path | None = None) -> subprocess.Popen:
    with open(log or os.devnull, "w") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


class DevTools:
    """The few DevTools protocol calls the check needs, over one page's websocket."""

    def __init__(self, websocket_url: str):
        self.socket, self.next_id = connect(websocket_url, max_size=None), 0

    def call(self, method: str, **params) -> dict:
        self.next_id += 1
        self.socket.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:  # events arrive in between; the answer carries our id
            message = json.loads(self.socket.recv())
            if message.get("id") == self.next_id:
                assert "error" not in message, message
                return message["result"]

    def close(self) -> None:
        self.socket.close()

    def evaluate(self, expression: str) -> dict:
        return json.loads(self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"]["value"])


def test_the_report_artifact_shows_its_plots_and_headline_in_the_prefect_ui(full_run, tmp_path):  # noqa: F811
    port, home = free_port(), tmp_path / "prefect-home"
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_UI_ENABLED": "true",
    }
    prefect = str(Path(sys.executable).parent / "prefect")
    server = started([prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env, tmp_path / "s.log")
    try:
        wait_for(f"{env['PREFECT_API_URL']}/health", "the Prefect server", server)
        subprocess.run([sys.executable, "-c", PUBLISH, str(full_run)], env=env, cwd=ROOT, check=True)
        found = httpx.post(
            f"{env['PREFECT_API_URL']}/artifacts/filter", json={"artifacts": {"key": {"any_": ["uicheck-report"]}}}
        ).json()
        artifact = found[0]
        expected_images = artifact["data"].count("](data:image/png;base64,")
        headline = json.loads((full_run / "report" / "report.json").read_text())["headline"]["model"]
        assert expected_images >= 3 and "file://" not in artifact["data"]

        debug_port = free_port()
        flags = ["--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,2400"]
        profile = f"--user-data-dir={tmp_path / 'chromium'}"
        browser = started([CHROMIUM, *flags, f"--remote-debugging-port={debug_port}", profile, "about:blank"])
        try:
            wait_for(f"http://127.0.0.1:{debug_port}/json/version", "Chromium", browser, seconds=60)
            page = httpx.put(f"http://127.0.0.1:{debug_port}/json/new?about:blank").json()
            tools = DevTools(page["webSocketDebuggerUrl"])
            tools.call("Page.navigate", url=f"http://127.0.0.1:{port}/artifacts/artifact/{artifact['id']}")
            deadline = time.monotonic() + 120
            while True:  # the UI is a single-page app: it fetches and renders the artifact after load
                shown = tools.evaluate(PAGE)
                if len(shown["images"]) >= expected_images and all(done for done, _ in shown["images"]):
                    break
                assert time.monotonic() < deadline, f"the artifact did not render: {shown}"
                time.sleep(1)
            screenshot = tools.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
            (tmp_path / "report-artifact.png").write_bytes(base64.b64decode(screenshot["data"]))
            tools.close()
        finally:
            stop_process_group(browser)
    finally:
        stop_process_group(server)
    assert len(shown["images"]) == expected_images and all(width > 0 for _, width in shown["images"])
    assert any(headline in table for table in shown["tables"])  # the headline table, rendered as a table
    assert (tmp_path / "report-artifact.png").stat().st_size > 20_000
