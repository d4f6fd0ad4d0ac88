"""Debian's Chromium driven by Selenium through Debian's chromedriver, for the explorer's browser tests
(tests/test_explorer.py, tests/test_workflow.py): no browser download, headless, the network off. Where Chromium is not
installed the tests skip, unless MFPIPE_BROWSER=required (set by .ci/run, which installs it): then they fail."""

import os
import shutil
from pathlib import Path

import pytest

CHROMIUM = os.environ.get("MFPIPE_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("MFPIPE_CHROMEDRIVER", "/usr/bin/chromedriver")
# as the machine's notes start it: without the background-networking flags Chromium tries hosts it cannot reach
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1400,1800")


def browser_or_skip():
    """The paths of chromium and chromedriver, or a skip (a failure where MFPIPE_BROWSER=required)."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not (Path(p).is_file() or shutil.which(p))]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("the selenium package")
    if missing:
        why = f"no browser for the explorer's test: {', '.join(missing)} missing (apt-get install chromium chromium-driver)"
        if os.environ.get("MFPIPE_BROWSER") == "required":
            pytest.fail(why)
        pytest.skip(why)


def open_browser(tmp_path):
    """A headless Chromium with its console log kept, its network cut (offline), its own empty profile."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser_or_skip()
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for f in FLAGS:
        opts.add_argument(f)
    opts.add_argument(f"--user-data-dir={tmp_path / 'chromium-profile'}")
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(60)
    # the page must work with no network at all (everything it needs is shipped beside it)
    driver.execute_cdp_cmd("Network.enable", {})
    driver.execute_cdp_cmd("Network.emulateNetworkConditions", {"offline": True, "latency": 0, "downloadThroughput": 0,
                                                                "uploadThroughput": 0})
    return driver


def console_errors(driver) -> list[str]:
    """The browser console's SEVERE entries since the last call."""
    return [e["message"] for e in driver.get_log("browser") if e.get("level") == "SEVERE"]


def wait_for(driver, script: str, timeout: float = 20.0):
    """Poll a JavaScript expression until it returns something truthy; return it."""
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(lambda d: d.execute_script(f"return {script};"))


def open_model_page(driver, index_html: Path):
    """Open a model's explorer page from disk and wait for its head grid."""
    driver.get(Path(index_html).resolve().as_uri())
    wait_for(driver, "window.MFX && MFX.data && document.querySelector('#grid .heatmaplayer, #grid .hm')")


def grid_z(driver) -> list:
    """The values the head grid draws, [layer][head] (None where NaN)."""
    return driver.execute_script("return document.getElementById('grid').data[0].z;")


def click_head(driver, layer: int, head: int):
    """A real mouse click on the grid's cell of (layer, head), at its centre in the plot's own coordinates, then wait
    for that head's card."""
    from selenium.webdriver.common.action_chains import ActionChains

    grid = driver.find_element("id", "grid")
    x, y, w, h = driver.execute_script(
        "const g=document.getElementById('grid'), f=g._fullLayout, r=g.getBoundingClientRect();"
        f"return [f._size.l + f.xaxis.d2p({head}), f._size.t + f.yaxis.d2p({layer}), r.width, r.height];")
    ActionChains(driver).move_to_element_with_offset(grid, int(x - w / 2), int(y - h / 2)).click().perform()
    wait_for(driver, f"document.getElementById('card').getAttribute('data-head') === 'L{layer}H{head}'"
                     " && document.querySelector('#kernel .heatmaplayer, #kernel .hm, #kernel')")


def set_revision(driver, index: int):
    """Move the revision slider to position ``index`` with the keyboard (the input event a user's drag fires)."""
    from selenium.webdriver.common.keys import Keys

    slider = driver.find_element("id", "revision")
    now = int(slider.get_attribute("value"))
    key = Keys.ARROW_RIGHT if index > now else Keys.ARROW_LEFT
    for _ in range(abs(index - now)):
        slider.send_keys(key)
    wait_for(driver, f"Number(document.getElementById('revision').value) === {index}")


def broken_links(page: Path, hrefs: list[str]) -> list[str]:
    """The links of ``page`` (relative hrefs) whose file is missing or whose #anchor is not an id in it."""
    import re

    bad = []
    for href in hrefs:
        path, _, anchor = href.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.is_file():
            bad.append(f"{href}: no file {target}")
        elif anchor and not re.search(rf'id="{re.escape(anchor)}"', target.read_text(errors="replace")):
            bad.append(f"{href}: no id {anchor!r} in {target.name}")
    return bad
