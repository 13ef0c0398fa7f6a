"""The chat page of `ktlong serve` driven in headless Chromium (selenium with the system's
chromium and chromedriver: `apt-get install chromium chromium-driver`, `pip install selenium`).

Used by tests/test_chatpage_browser.py, and runnable for what docs/benchmarks.md shows:

    python -m tests.chatpage_driver shot -m smollm2 --pdf FILE -q QUESTION --png docs/chat-page.png
    python -m tests.chatpage_driver first-byte -- -m smollm2

`shot` starts `ktlong serve`, attaches the PDF in the page, asks and saves a screenshot once the
answer is in; `first-byte` starts `ktlong serve ARGS` and times the page's first byte from the
moment the port accepts a connection.
"""
from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from .docfiles import pdf

DRIVER = "chromedriver"
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
INSTALL = "apt-get install -y chromium chromium-driver && pip install selenium"


def browser_missing() -> str | None:
    """Why the page cannot be driven here (None: it can)."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return f"selenium is not installed ({INSTALL})"
    if not any(shutil.which(b) for b in BROWSERS) or not shutil.which(DRIVER):
        return f"no chromium and chromedriver on PATH ({INSTALL})"
    return None


def open_browser(width: int = 1400, height: int = 900) -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = next(shutil.which(b) for b in BROWSERS if shutil.which(b))
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={width},{height}", "--force-device-scale-factor=1"):
        opts.add_argument(arg)
    return webdriver.Chrome(options=opts, service=Service(shutil.which(DRIVER)))


class Page:
    """The chat page in a browser, through its stable hooks: the document's
    `<input type="file">`, the question's `<textarea>`, answers `[data-role=assistant]`."""

    def __init__(self, driver: Any, url: str, timeout: float = 120) -> None:
        self.driver, self.url, self.timeout = driver, url, timeout
        driver.get(url)

    def find(self, css: str) -> Any:
        from selenium.webdriver.common.by import By

        return self.driver.find_element(By.CSS_SELECTOR, css)

    def all(self, css: str) -> list[Any]:
        from selenium.webdriver.common.by import By

        return self.driver.find_elements(By.CSS_SELECTOR, css)

    def wait(self, cond: Any, timeout: float | None = None, what: str = "") -> Any:
        from selenium.common.exceptions import (
            NoSuchElementException,
            StaleElementReferenceException,
        )
        from selenium.webdriver.support.ui import WebDriverWait

        # a page that is loading (a form sent) has no such element yet, or an old one
        return WebDriverWait(self.driver, timeout or self.timeout, poll_frequency=0.05,
                             ignored_exceptions=(NoSuchElementException,
                                                 StaleElementReferenceException)).until(
            lambda d: cond(), message=what)

    def text(self, css: str) -> str:
        return self.find(css).text

    def loaded(self) -> str:
        """Waits for the page to show the model's name; returns it."""
        self.wait(lambda: not self.text("#model").startswith("model"), what="the model's name")
        return self.text("#model")

    def attach(self, path: Path) -> str:
        """Attaches the file and waits until the server has read it; the document's status."""
        self.find('input[type="file"]').send_keys(str(path))
        self.wait(lambda: self.text("#doc-status").startswith(("read:", "error"))
                  or "error" in self.find("#doc-status").get_attribute("class"),
                  what="the document read")
        return self.text("#doc-status")

    def type(self, text: str, send: bool = True) -> None:
        from selenium.webdriver.common.keys import Keys

        box = self.find("textarea")
        box.send_keys(text)
        if send:
            box.send_keys(Keys.ENTER)

    def answers(self) -> list[Any]:
        return self.all('[data-role="assistant"]')

    def metas(self) -> list[str]:
        return [m.text for m in self.all(".turn .meta")]

    def ended(self, n: int) -> str | None:
        """The n-th answer's line (1-based) once it ended: tok/s, stopped, or an error."""
        from selenium.webdriver.common.by import By

        turns = self.all(".turn")
        if len(turns) < n:
            return None
        meta = turns[n - 1].find_element(By.CSS_SELECTOR, ".meta")
        line = meta.text
        if "tok/s" in line or line.startswith("stopped") or "error" in meta.get_attribute("class"):
            return line
        return None

    def wait_answered(self, n: int, timeout: float | None = None) -> str:
        """Waits for the n-th answer (1-based) to end; returns its line."""
        return self.wait(lambda: self.ended(n), timeout, what=f"answer {n} to end")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_serve(args: list[str], port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ktlong", "serve", *args, "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_listening(proc: subprocess.Popen, port: int, timeout: float = 900) -> socket.socket:
    """Polls the port every 2 ms until it accepts; returns the connected socket."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"ktlong serve exited: {proc.stderr.read() if proc.stderr else ''}")
        s = socket.socket()
        try:
            s.connect(("127.0.0.1", port))
            return s
        except OSError:
            s.close()
            time.sleep(0.002)
    raise TimeoutError(f"ktlong serve did not listen on {port} in {timeout:.0f} s")


def first_byte(sock: socket.socket, port: int, path: str = "/") -> tuple[float, float, bytes]:
    """Sends GET `path` on a connected socket: (seconds to the first byte, to the whole
    response, the response)."""
    t0 = time.monotonic()
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n"
                 .encode())
    data = sock.recv(1)
    t1 = time.monotonic()
    while chunk := sock.recv(1 << 16):
        data += chunk
    sock.close()
    return t1 - t0, time.monotonic() - t0, data


def write_pdf(text: str, path: Path, width: int = 90, lines_per_page: int = 54) -> Path:
    """`text` as a real PDF (tests/docfiles.pdf: Helvetica text pages)."""
    lines = [w for para in text.splitlines() for w in (textwrap.wrap(para, width) or [""])]
    pages = [lines[i:i + lines_per_page] for i in range(0, len(lines), lines_per_page)]
    path.write_bytes(pdf(pages))
    return path


def _shot(a: argparse.Namespace) -> None:
    port = free_port()
    serve = ["-m", a.model, *a.serve_args]
    proc = start_serve(serve, port)
    driver = None
    try:
        wait_listening(proc, port).close()
        driver = open_browser(a.width, a.height)
        page = Page(driver, f"http://127.0.0.1:{port}/", timeout=a.timeout)
        print("model:", page.loaded())
        print("document:", page.attach(a.pdf.resolve()))
        page.type(a.question)
        print("answer:", page.wait_answered(1))
        print(page.answers()[0].text)
        time.sleep(0.3)
        a.png.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(a.png))
        print("screenshot:", a.png)
    finally:
        if driver is not None:
            driver.quit()
        proc.terminate()
        proc.wait(60)


def _first_byte(a: argparse.Namespace) -> None:
    port = free_port()
    t0 = time.monotonic()
    proc = start_serve(a.serve_args, port)
    try:
        sock = wait_listening(proc, port)
        listen = time.monotonic() - t0
        fb, whole, data = first_byte(sock, port)
        status = data.split(b" ", 2)[1].decode()
        print(f"ktlong serve {' '.join(a.serve_args)}: listening {listen:.1f} s after start; "
              f"GET / status {status}: first byte {fb * 1000:.1f} ms after listening, the whole "
              f"page ({len(data):,} bytes with headers) {whole * 1000:.1f} ms")
    finally:
        proc.terminate()
        proc.wait(60)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tests.chatpage_driver")
    sub = ap.add_subparsers(dest="cmd", required=True)
    shot = sub.add_parser("shot", help="a screenshot of the page answering about a PDF")
    shot.add_argument("-m", "--model", default="smollm2")
    shot.add_argument("--pdf", type=Path, required=True)
    shot.add_argument("-q", "--question", required=True)
    shot.add_argument("--png", type=Path, required=True)
    shot.add_argument("--width", type=int, default=1400)
    shot.add_argument("--height", type=int, default=900)
    shot.add_argument("--timeout", type=float, default=600)
    shot.add_argument("serve_args", nargs="*", help="more `ktlong serve` arguments (after --)")
    fb = sub.add_parser("first-byte", help="the page's first byte after serve listens")
    fb.add_argument("serve_args", nargs="*", help="`ktlong serve` arguments (after --)")
    pdfp = sub.add_parser("pdf", help="a text file as a PDF")
    pdfp.add_argument("text", type=Path)
    pdfp.add_argument("out", type=Path)
    a = ap.parse_args(argv)
    if a.cmd == "shot":
        _shot(a)
    elif a.cmd == "first-byte":
        _first_byte(a)
    else:
        print(write_pdf(a.text.read_text(encoding="utf-8"), a.out))


if __name__ == "__main__":
    main()
