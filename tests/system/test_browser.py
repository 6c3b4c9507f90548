"""End to end in a real browser: the quickstart notebook's Explorer UI served by Voila, driven in
headless Debian chromium through Playwright.

The test starts Voila on 127.0.0.1 (a free port, a kernelspec pointing at this interpreter), opens
the page in a fresh chromium profile, changes the objective and checks that the comparison table
in the page gains the re-planned column. Screenshots go to ``test-artifacts/``. A missing
chromium or Playwright is a failure, not a skip: ``scripts/setup.sh`` installs both.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "01_quickstart.ipynb"
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]
# The UI's comparison (a Styler whose id starts with T_snn-compare, unique to its table) inside the
# Compare tab's Output widget; the notebook's own `ex.compare(styled=True)` cell is outside the UI.
TABLE = '.widget-output table[id^="T_snn-compare"]'
START_TIMEOUT_S = 120
RENDER_TIMEOUT_MS = 180_000
CHANGE_TIMEOUT_MS = 60_000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"voila exited with code {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"voila did not answer on {url} within {timeout:g} s:\n{log.read_text()[-4000:]}")


@pytest.fixture
def voila_url(tmp_path):
    """Voila serving the quickstart notebook on 127.0.0.1; stopped (its whole process group) after."""
    with _served(tmp_path, NOTEBOOK) as served:
        yield served


@contextlib.contextmanager
def _served(tmp_path, notebook: Path):
    """Voila serving ``notebook`` on 127.0.0.1: ``(url, log)``; stopped (its whole process group) after."""
    kernels = tmp_path / "kernels"
    subprocess.run([sys.executable, "-m", "ipykernel", "install", "--prefix", str(kernels), "--name", "python3"],
                   check=True, capture_output=True)
    env = dict(os.environ, JUPYTER_PATH=str(kernels / "share" / "jupyter"), PYTHONHASHSEED="0")
    port, log = _free_port(), tmp_path / "voila.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "voila", str(notebook), "--no-browser", f"--port={port}", "--Voila.ip=127.0.0.1",
             "--show_tracebacks=True", f"--Voila.root_dir={notebook.parent}"],
            cwd=notebook.parent, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/"
    try:
        _wait_http(url, proc, log, START_TIMEOUT_S)
        yield url, log
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """End Voila and every process it started: its kernels run in sessions of their own, so they
    are ended by pid, not through Voila's process group."""
    try:
        started = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        started = []
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    alive = [p for p in started if p.is_running()]
    for p in alive:
        p.terminate()
    _, alive = psutil.wait_procs(alive, timeout=10)
    for p in alive:
        p.kill()
    psutil.wait_procs(alive, timeout=10)


def _table(page) -> dict:
    """The comparison table as {row name: {column label: cell text}}."""
    rows = page.locator(TABLE).evaluate(
        "t => Array.from(t.rows).map(r => Array.from(r.cells).map(c => c.innerText.trim()))")
    header = rows[0][1:]
    return {r[0]: dict(zip(header, r[1:])) for r in rows[1:]}


def _screenshot(page, name: str) -> None:
    """The whole Explorer UI (its outermost box) as test-artifacts/<name>.png."""
    ui = page.locator(".widget-vbox", has=page.locator(TABLE)).first
    ui.scroll_into_view_if_needed()
    ui.screenshot(path=str(ARTIFACTS / f"{name}.png"))


@contextlib.contextmanager
def _page(tmp_path, url: str):
    """A page of headless chromium (a fresh profile under ``tmp_path``) opened at ``url``; closed on exit.
    A missing chromium fails the test: scripts/setup.sh installs it."""
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: scripts/setup.sh installs it (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS,
            viewport={"width": 1400, "height": 2400})
        try:
            page = context.pages[0] if context.pages else context.new_page()
            page.goto(url, timeout=RENDER_TIMEOUT_MS)
            yield page
        finally:
            context.close()


def test_objective_change_replans_in_the_browser(voila_url, tmp_path):
    from playwright.sync_api import expect

    url, log = voila_url
    with _page(tmp_path, url) as page:
        table = page.locator(TABLE)
        try:
            table.wait_for(state="visible", timeout=RENDER_TIMEOUT_MS)
        except Exception:
            page.screenshot(path=str(ARTIFACTS / "browser_explorer_failed.png"), full_page=True)
            raise AssertionError(f"the comparison table never appeared; voila log:\n{log.read_text()[-4000:]}")
        before = _table(page)
        # the three pinned plans of the notebook; the controls' plan (speed on dp=4) is #1
        assert list(before["mode"].values()) == ["dp", "fsdp2_tp", "tp"], before["mode"]
        _screenshot(page, "browser_explorer_before")

        objective = page.locator(".widget-dropdown", has_text="objective").locator("select")
        objective.select_option("memory")
        expect(table).to_contain_text("current fsdp2+reshard dp=4", timeout=CHANGE_TIMEOUT_MS)
        after = _table(page)
        _screenshot(page, "browser_explorer_after")
    new = [c for c in after["mode"] if c not in before["mode"]]
    assert new == ["current fsdp2+reshard dp=4"], list(after["mode"])
    column = new[0]
    # memory on 4 data-parallel ranks: FSDP2, which reshards after forward and shards optimizer state
    assert after["mode"][column] == "fsdp2"
    assert after["objective"][column] == "memory"
    assert after["memopt_level"][column] == "1"
    assert after["optimizer_strategy"][column] == "none"
    assert {k: after["mode"][k] for k in before["mode"]} == before["mode"]  # the pinned plans stay


LAUNCH_TIMEOUT_MS = 240_000


def test_launch_tab_launches_saves_loads_and_exports_in_the_browser(voila_url, tmp_path):
    """The Launch tab's buttons in the page: a 4-rank gloo run shows its losses, the plan is saved
    to JSON and loaded back (pinned), and a torchrun / Slurm job is exported."""
    from playwright.sync_api import expect

    url, log = voila_url
    plan_file, job_dir = tmp_path / "plan.json", tmp_path / "job"
    with _page(tmp_path, url) as page:
        page.locator(TABLE).wait_for(state="visible", timeout=RENDER_TIMEOUT_MS)
        try:
            page.get_by_role("tab", name="Launch").click()
            steps = _labelled(page, ".widget-inline-hbox", "steps").locator("input")
            steps.fill("3")
            steps.press("Enter")
            _button(page, "launch").click()
            status = page.locator("pre", has_text="done:")
            status.wait_for(state="visible", timeout=LAUNCH_TIMEOUT_MS)
        except Exception:
            page.screenshot(path=str(ARTIFACTS / "browser_launch_failed.png"), full_page=True)
            raise AssertionError(f"the launch never finished; voila log:\n{log.read_text()[-4000:]}")
        assert "3 steps" in status.inner_text()
        losses = page.locator("table", has_text="rank 3").first
        expect(losses).to_be_visible()
        _launch_screenshot(page, "browser_launch_done")

        plan_input = _labelled(page, ".widget-text", "plan file").locator("input")
        plan_input.fill(str(plan_file))
        plan_input.press("Enter")
        _button(page, "save plan").click()
        expect(page.locator("pre", has_text="saved")).to_be_visible(timeout=CHANGE_TIMEOUT_MS)
        _button(page, "load plan").click()
        expect(page.locator("pre", has_text="pinned as")).to_be_visible(timeout=CHANGE_TIMEOUT_MS)

        job_input = _labelled(page, ".widget-text", "job folder").locator("input")
        job_input.fill(str(job_dir))
        job_input.press("Enter")
        _button(page, "export job").click()
        expect(page.locator("pre", has_text="exported to")).to_be_visible(timeout=CHANGE_TIMEOUT_MS)
        _launch_screenshot(page, "browser_launch_files")
    saved = json.loads(plan_file.read_text())
    assert saved["mode"] == "dp" and saved["topology"]["dims"] == {"dp": 4}  # the controls' plan, launched
    assert sorted(os.listdir(job_dir)) == ["command.sh", "job.sbatch", "payload.pkl", "plan.json", "run.py"]
    assert json.loads((job_dir / "plan.json").read_text()) == saved


def _labelled(page, css: str, label: str):
    """The widget (``css``) whose description label reads exactly ``label``."""
    return page.locator(css).filter(has=page.locator("label", has_text=re.compile(rf"^\s*{re.escape(label)}\s*$")))


def _button(page, text: str):
    return page.locator("button.widget-button", has_text=re.compile(rf"^\s*{re.escape(text)}\s*$"))


def _launch_screenshot(page, name: str) -> None:
    page.locator(".widget-tab").first.screenshot(path=str(ARTIFACTS / f"{name}.png"))


def test_every_strategy_notebook_draws_its_pictures_in_the_browser(tmp_path):
    """Notebook 08 served by Voila (a fresh kernel runs it): as many pictures as its committed outputs hold,
    each screenshotted to test-artifacts/every_strategy_<i>.png."""
    notebook = ROOT / "notebooks" / "08_every_strategy.ipynb"
    cells = json.loads(notebook.read_text())["cells"]
    pictures = sum("image/png" in out.get("data", {}) for cell in cells for out in cell.get("outputs", []))
    assert pictures >= 3
    with _served(tmp_path, notebook) as (url, log), _page(tmp_path, url) as page:
        images = page.locator('img[src^="data:image/png"]')
        try:
            images.nth(pictures - 1).wait_for(state="visible", timeout=RENDER_TIMEOUT_MS)
        except Exception:
            page.screenshot(path=str(ARTIFACTS / "every_strategy_failed.png"), full_page=True)
            raise AssertionError(f"{images.count()} of {pictures} pictures appeared; voila log:\n"
                                 f"{log.read_text()[-4000:]}")
        assert images.count() == pictures
        for i in range(pictures):
            images.nth(i).scroll_into_view_if_needed()
            images.nth(i).screenshot(path=str(ARTIFACTS / f"every_strategy_{i}.png"))
            assert images.nth(i).evaluate("img => img.naturalWidth") > 300
