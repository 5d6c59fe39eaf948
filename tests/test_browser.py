"""The notebooks in a real JupyterLab, in headless Chromium: what a learner sees, not only what nbmake executes.

Notebook 01 runs top to bottom through JupyterLab's own "Run All Cells", and the rendered page is checked:
the token strips hold coloured accepted / rejected tokens, the acceptance explorer's sliders redraw its figure,
the figures are images, no cell shows an error, nothing of torchao's start-up reaches a cell, every control's
text is whole, the notebook opens unmodified. The screenshot goes to docs/images/ (the README shows it).
Notebooks 02-04 get their widget or live-plot cell each; 05 has none (the reason is in its test).

Chromium comes from the distribution (`apt-get install chromium`): Playwright drives it by its path, nothing is
downloaded. Without it, or without Playwright, the tests skip and say so. JupyterLab runs on a free localhost
port with a token, in a temporary folder with its own settings (copies of the notebooks: a run through the UI
never writes into the repository), and is shut down whatever happens.
"""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"
SCREENSHOT = REPO / "docs" / "images" / "notebook01_jupyterlab.png"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# A closed network refuses Chromium's background connections (updates, sync, safe browsing): ask for none.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
WIDTH, HEIGHT = 1400, 1000

# JupyterLab renders only the cells in view by default ("windowing"); the checks read every cell.
LAB_SETTINGS = {"@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
                "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                                    "checkForUpdates": False}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def playwright_api():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("the browser tests need Playwright's Python package: pip install playwright (its own browser "
                    "download is not used)")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"the browser tests need Chromium at {CHROMIUM}: apt-get install chromium")
    return sync_playwright


@pytest.fixture(scope="module")
def lab(playwright_api, tmp_path_factory):
    """(url, token, root) of a JupyterLab serving `root`, a temporary copy of notebooks/, stopped at the end
    whatever happens."""
    root = tmp_path_factory.mktemp("lab")
    for notebook in NOTEBOOKS.glob("*.ipynb"):
        shutil.copy(notebook, root)
    settings = root / ".lab-settings"
    for name, values in LAB_SETTINGS.items():
        path = settings / name.replace("/", os.sep, 1).replace("/", os.sep)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    env = os.environ | {"JUPYTER_CONFIG_DIR": str(root / ".config"), "JUPYTER_RUNTIME_DIR": str(root / ".runtime"),
                        "JUPYTERLAB_SETTINGS_DIR": str(settings), "JUPYTERLAB_WORKSPACES_DIR": str(root / ".ws"),
                        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    port, token = free_port(), uuid.uuid4().hex
    command = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
               f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        command.append("--allow-root")  # CI runs as root, where jupyter refuses to start without it
    log_path = tmp_path_factory.mktemp("lab-log") / "lab.log"
    log = open(log_path, "w")
    server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
                break
            except OSError as e:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"JupyterLab did not start:\n{log_path.read_text()[-3000:]}") from e
                time.sleep(1)
        yield url, token, root
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


@pytest.fixture(scope="module")
def browser(playwright_api, tmp_path_factory):
    with playwright_api() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=CHROMIUM, headless=True,
            args=CHROMIUM_FLAGS, viewport={"width": WIDTH, "height": HEIGHT})
        try:
            yield context
        finally:
            context.close()


def open_notebook(browser, lab, name: str):
    url, token, _ = lab
    page = browser.new_page()
    # reset: a fresh workspace, or JupyterLab would reopen (and start kernels for) an earlier test's notebooks.
    page.goto(f"{url}/lab/tree/{name}?reset&token={token}")
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=120_000)
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=120_000)
    return page


def notebook_tab_dirty(page) -> bool:
    return page.locator(".lm-TabBar-tab.jp-mod-current.jp-mod-dirty").count() > 0


def start_all(page) -> None:
    """Run > Run All Cells. Clicked before the kernel has connected, it queues nothing (no cell shows [*]):
    then it is clicked again, a few seconds later. A notebook written while JupyterLab runs may open with
    the "Select Kernel" dialog: its default, the notebook's own kernel, is accepted."""
    for _ in range(10):
        dialog = page.locator(".jp-Dialog")
        if dialog.count():
            dialog.locator(".jp-Dialog-button.jp-mod-accept").click()
        page.get_by_role("menuitem", name="Run", exact=True).click()
        page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
        for _ in range(10):
            page.wait_for_timeout(1_000)
            if any(p.strip() != "[ ]:" for p in page.locator(".jp-CodeCell .jp-InputArea-prompt").all_inner_texts()):
                return
    raise AssertionError("Run All Cells started no cell: the kernel never connected")


def run_all(page, timeout: float, start: bool = True) -> None:
    """Run > Run All Cells (unless already started), then wait until every code cell has its execution count."""
    if start:
        start_all(page)
    deadline = time.monotonic() + timeout
    prompts = []
    while time.monotonic() < deadline:
        prompts = page.locator(".jp-CodeCell .jp-InputArea-prompt").all_inner_texts()
        if prompts and all(p.strip()[1:-2].isdigit() for p in prompts):
            return
        time.sleep(2)
    shot = Path(tempfile.mkdtemp()) / "unfinished.png"
    page.screenshot(path=str(shot))
    raise AssertionError(f"the cells did not finish within {timeout:.0f} s: prompts {prompts}; the page: {shot}")


# A text progress bar (tqdm outside a widget), the one stderr a training cell shows on purpose: "desc: 40%|███ ..."
PROGRESS_BAR = re.compile(r"^[^\n]*\d+%\|[^\n]*$")


def cell_errors(page) -> list[str]:
    """The text of every error and stderr output (a traceback, a warning, a library's start-up messages), less the
    lines of text progress bars."""
    outputs = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']").all_inner_texts()
    lines = (line for text in outputs for line in text.splitlines())
    return [line for line in lines if line.strip() and not PROGRESS_BAR.match(line)]


def clipped(page, selector: str) -> list[str]:
    """The texts of `selector`'s elements that do not fit their own box (the browser cuts or ellipsizes them)."""
    return page.eval_on_selector_all(selector, "els => els.filter(e => e.scrollWidth > e.clientWidth + 1)"
                                               ".map(e => e.textContent.trim())")


def overlapping(page, selector: str) -> list[str]:
    """`selector`'s elements that reach into the next box of their row (a readout under the next column)."""
    return page.eval_on_selector_all(selector, """els => els.filter(e => {
        const r = e.getBoundingClientRect();
        return Array.from(document.querySelectorAll('.widget-slider, .widget-toggle-buttons, .widget-button'))
            .some(o => !o.contains(e) && (() => { const s = o.getBoundingClientRect();
                return s.left > r.left && s.left < r.right - 1 && s.top < r.bottom && s.bottom > r.top; })());
    }).map(e => e.textContent.trim())""")


def test_notebook_01_in_jupyterlab(browser, lab):
    page = open_notebook(browser, lab, "01_speculative_sampling.ipynb")
    # The tab shows "modified" for a moment while the document loads; then the kernel's info reply, a few seconds
    # later, rewrites the notebook's metadata, which marks it modified for good unless they already agree.
    page.wait_for_function("() => !document.querySelector('.lm-TabBar-tab.jp-mod-current.jp-mod-dirty')",
                           timeout=30_000)
    for _ in range(10):
        page.wait_for_timeout(1_500)
        assert not notebook_tab_dirty(page), "opening the notebook marked it modified: its metadata differ " \
                                             "from what JupyterLab writes (kernelspec, language_info)"
    run_all(page, timeout=600)
    page.wait_for_timeout(1_000)

    assert cell_errors(page) == [], "a cell printed to stderr (an error, or a library's start-up noise)"
    # Figures are images.
    assert page.locator(".jp-OutputArea-output[data-mime-type='image/png'] img").count() >= 8
    # Both token strips hold accepted and rejected drafts, coloured, and say which τ they show.
    strips = page.locator(".ms-strip")
    assert strips.count() == 2
    for i in range(2):
        for status in ("accepted", "rejected"):
            token = strips.nth(i).locator(f".ms-tok.ms-{status}").first
            assert token.count() == 1, f"strip {i} has no {status} token"
            assert token.evaluate("e => getComputedStyle(e).backgroundColor") not in ("rgba(0, 0, 0, 0)", "")
    summaries = page.locator(".ms-summary").all_inner_texts()
    assert all(s.startswith("this strip (sequence 0 of the batch): cycles") for s in summaries), summaries
    assert page.get_by_text("n-gram, all 16 prompts: τ =").count() == 1

    # The explorer: every readout and button label whole, none under its neighbour, and a slider move redraws.
    explorer = page.locator(".widget-vbox:has(.widget-toggle-buttons)").first
    explorer.scroll_into_view_if_needed()
    assert clipped(page, ".widget-readout") == []
    assert clipped(page, ".widget-toggle-button") == []
    assert overlapping(page, ".widget-readout") == []
    image = explorer.locator(".widget-image")
    readout = explorer.locator(".widget-html-content").last
    before_image, before_text = image.get_attribute("src"), readout.inner_text()
    handle = explorer.locator(".widget-slider .noUi-handle").nth(2)  # q's peak
    handle.click()
    handle.press("ArrowLeft")
    # The kernel sends the image and the readout as two updates: on a busy machine the text can come later.
    page.wait_for_function("([img, src, out, text]) => img.getAttribute('src') !== src && out.innerText !== text",
                           arg=[image.element_handle(), before_image, readout.element_handle(), before_text],
                           timeout=60_000)
    assert readout.inner_text() != before_text, "the acceptance readout did not follow the slider"

    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    page.locator(".ms-strip").first.scroll_into_view_if_needed()
    page.screenshot(path=str(SCREENSHOT))
    page.close()


class Glue(str):
    """Code of a cell of its own, among `cells_of`'s picks: what joins two cells of a notebook."""


def cells_of(notebook: str, *cells: str) -> dict:
    """A notebook of some cells of `notebook`: each of `cells` names the first code cell that holds that text
    (it must exist), or is a `Glue` cell."""
    source = json.loads((NOTEBOOKS / notebook).read_text())
    code = [c for c in source["cells"] if c["cell_type"] == "code"]
    picked = []
    for text in cells:
        if isinstance(text, Glue):
            picked.append({"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [],
                           "source": str(text)})
            continue
        found = [c for c in code if text in "".join(c["source"])]
        assert found, f"{notebook} has no code cell that holds {text!r}: update this test with the notebook"
        picked.append(found[0])
    return source | {"cells": picked}


def run_cells(browser, lab, notebook: str, *cells: str, timeout: float = 300):
    """Open a notebook of `cells` of `notebook` (`cells_of`) and run it; the page, with the run under way."""
    name = notebook.replace(".ipynb", "_cells.ipynb")
    (lab[2] / name).write_text(json.dumps(cells_of(notebook, *cells)))
    page = open_notebook(browser, lab, name)
    start_all(page)
    return page


def last_image(page):
    return page.locator(".jp-CodeCell").last.locator(".jp-OutputArea-output img")


def assert_live_plot(page, timeout: float):
    """The last cell's live plot appears while its loop runs and is redrawn in place: one picture, updated."""
    page.wait_for_function("() => { const c = document.querySelectorAll('.jp-CodeCell');"
                           " return c[c.length - 1].querySelector('.jp-OutputArea-output img') !== null; }",
                           timeout=timeout * 1000)
    first = last_image(page).first.get_attribute("src")
    run_all(page, timeout, start=False)
    assert cell_errors(page) == []
    assert last_image(page).first.get_attribute("src") != first, "the live plot was not redrawn"
    assert last_image(page).count() == 1, "the live plot added pictures instead of redrawing its one"


def test_notebook_02_token_strip(browser, lab):
    page = run_cells(browser, lab, "02_dflash.ipynb", "ms.load_drafter(\"bolt-mini-dflash\"", "strip = TokenStrip(tok)")
    run_all(page, 300, start=False)
    assert cell_errors(page) == []
    strip = page.locator(".ms-strip")
    assert strip.count() == 1
    assert strip.locator(".ms-tok.ms-accepted").count() > 0
    page.close()


def test_notebook_03_live_boosting_plot(browser, lab):
    page = run_cells(browser, lab, "03_mtp_boosting.ipynb", "post_backbone = stages.load_backbone",
                     "live = LivePlot(\"boosting the stale head")
    assert_live_plot(page, 300)
    page.close()


def test_notebook_04_live_qad_plot(browser, lab):
    page = run_cells(browser, lab, "04_nvfp4_qad.ipynb", "teacher, tok = ms.load_target",
                     Glue("val = data.token_stream(\"val\", tok)"), "live = LivePlot(\"QAD")
    assert_live_plot(page, 300)
    page.close()


def test_notebook_05_has_no_widget():
    """Notebook 05 (Mamba replay) shows static figures and tables only, which nbmake's run covers: no widget
    and no live plot to render. This keeps that true: a widget added there must get a browser test here."""
    cells = json.loads((NOTEBOOKS / "05_mamba_replay.ipynb").read_text())["cells"]
    source = "".join("".join(c["source"]) for c in cells)
    assert not any(name in source for name in ("LivePlot", "TokenStrip", "ipywidgets", "explorer", ".display()"))
