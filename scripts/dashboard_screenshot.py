"""The README's dashboard screenshots: a `kvserve serve` with a host tier, agentic load at concurrency 16
from `kvserve bench`, and the page in headless Chromium (Debian's, through Playwright).

    python scripts/dashboard_screenshot.py [--out-dir docs/images] [--seconds 25]
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from playwright.sync_api import sync_playwright

BROWSER_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise SystemExit("the server did not come up")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=Path("docs/images"))
    parser.add_argument("--seconds", type=float, default=25.0, help="load before the screenshot")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "kvserve", "serve", "--port", str(port), "--kv-host-gb", "0.25",
                               "--num-kv-blocks", "512",
                               "--uvicorn-log-level", "warning"])
    bench = None
    try:
        wait_ready(url, server)
        with tempfile.TemporaryDirectory() as tmp:
            bench = subprocess.Popen([sys.executable, "-m", "kvserve", "bench", "--base-url", url, "--workload",
                                      "agentic", "--concurrency", "16", "--num-requests", "400", "--output-len", "32",
                                      "--no-progress", "--output", f"{tmp}/bench.json"], stdout=subprocess.DEVNULL)
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path="/usr/bin/chromium", args=BROWSER_ARGS)
                page = browser.new_page(viewport={"width": 1280, "height": 1300})
                page.goto(f"{url}/dashboard")
                page.wait_for_selector("#status.live")
                page.wait_for_timeout(args.seconds * 1000)
                page.screenshot(path=str(args.out_dir / "dashboard.png"), full_page=True)
                page.locator("#recent tbody tr").first.click()
                page.wait_for_selector("#timeline g.stage[data-stage=decode]")
                page.locator(".requests").screenshot(path=str(args.out_dir / "dashboard-trip.png"))
                browser.close()
    finally:
        for proc in (bench, server):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)
    print(f"wrote {args.out_dir / 'dashboard.png'} and {args.out_dir / 'dashboard-trip.png'}")


if __name__ == "__main__":
    main()
