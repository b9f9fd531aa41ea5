"""The chat page in a real browser: headless Chromium (OS packages, scripts/install_browser.sh)
loads `/`, sends a prompt side by side to vanilla and eagle2, and both streamed answers appear with
coloured tokens; greedy answers are identical, accepted drafts are marked. The screenshot is kept
in runs/test-artifacts/serve_page.png."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from serve_helpers import load_spec, oracle_engine, running_server

ARTIFACTS = Path(__file__).resolve().parents[1] / "runs" / "test-artifacts"


def chrome(monkeypatch):
    """A headless Chromium driven through the system chromedriver (no download: offline)."""
    webdriver = pytest.importorskip("selenium.webdriver")
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not (browser and driver):
        pytest.skip("no chromium/chromedriver on PATH: run scripts/install_browser.sh (make test does)")
    from selenium.webdriver.chrome.service import Service

    monkeypatch.setenv("SE_OFFLINE", "true")  # Selenium Manager must not try to fetch anything
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,900", "--disable-extensions", "--no-first-run"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(executable_path=driver), options=options)


def test_page_streams_coloured_tokens(tiny_chat_checkpoint_256, monkeypatch):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.select import Select
    from selenium.webdriver.support.ui import WebDriverWait

    spec = oracle_engine(load_spec(tiny_chat_checkpoint_256), 1.0, 0.0, memo=True)
    reference = spec.generate("why is the sun big", max_new_tokens=40).text
    with running_server(spec) as srv:
        driver = chrome(monkeypatch)
        try:
            driver.set_page_load_timeout(20)
            driver.get(srv.url + "/")
            WebDriverWait(driver, 10).until(lambda d: srv.model in d.find_element(By.ID, "model").text)
            Select(driver.find_element(By.ID, "mode")).select_by_value("both")
            box = driver.find_element(By.ID, "max-tokens")
            box.clear()
            box.send_keys("40")
            driver.find_element(By.ID, "prompt").send_keys("why is the sun big")
            driver.find_element(By.ID, "send").click()
            done = ".msg.assistant[data-done='1']"
            WebDriverWait(driver, 30).until(lambda d: len(d.find_elements(By.CSS_SELECTOR, done)) == 2)
            answers = {}
            for column in driver.find_elements(By.CSS_SELECTOR, ".column"):
                method = column.get_attribute("data-method")
                msg = column.find_element(By.CSS_SELECTOR, ".msg.assistant")
                assert "error" not in msg.get_attribute("class")
                tokens = msg.find_elements(By.CSS_SELECTOR, ".tok")
                kinds = [t.get_attribute("class").split()[1] for t in tokens]
                answers[method] = ("".join(t.get_attribute("textContent") for t in tokens), kinds)
                assert "tau" in column.find_element(By.CSS_SELECTOR, ".stats").text
                assert method in msg.find_element(By.CSS_SELECTOR, ".final").text
            (vanilla, v_kinds), (eagle2, e_kinds) = answers["vanilla"], answers["eagle2"]
            assert vanilla == eagle2 == reference  # lossless, on the page too
            assert set(v_kinds) == {"target"}  # vanilla never drafts
            assert "draft" in e_kinds and "target" in e_kinds and e_kinds[0] == "target"
            # The colours are really different on screen.
            colour = driver.execute_script(
                "return [...document.querySelectorAll('.column[data-method=eagle2] .tok')]"
                ".map(e => getComputedStyle(e).backgroundColor)")
            assert len(set(colour)) == 2
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            assert driver.save_screenshot(str(ARTIFACTS / "serve_page.png"))
            assert os.path.getsize(ARTIFACTS / "serve_page.png") > 1000
        finally:
            driver.quit()
