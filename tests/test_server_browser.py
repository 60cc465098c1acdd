"""The web page in a real headless Chromium (Debian's chromium + chromedriver through Selenium):
a generation from the page on the tiny random SD1 checkpoint shows the image, its parameters and
the progress bar at the end, with a picked LoRA applied (Lora hashes in the parameters). Skipped where
chromium, chromedriver or selenium is absent. SDRT_SCREENSHOT=path saves a screenshot."""
import os
import shutil

import numpy as np
import pytest

pytest.importorskip("starlette")
from test_server_tiny import live_server, server_config, tiny_pipe  # noqa: E402,F401

from sdrt.server.app import create_app  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM and DRIVER):
        pytest.skip("chromium / chromedriver not installed (apt-get install -y chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium not installed")
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
              "--disable-background-networking", "--disable-component-update", "--disable-sync",
              "--disable-default-apps", "--no-first-run", "--metrics-recording-only", "--window-size=1100,760"):
        opts.add_argument(a)
    drv = webdriver.Chrome(service=Service(DRIVER), options=opts)
    yield drv
    drv.quit()


def test_generate_from_the_page(browser, tiny_pipe, tmp_path):  # noqa: F811
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import Select, WebDriverWait
    loras = tmp_path / "loras"
    loras.mkdir()
    from test_server_tiny import tiny_sd1_tensors

    from sdrt.io import write_safetensors
    q = tiny_sd1_tensors()["model.diffusion_model.middle_block.1.transformer_blocks.0.attn1.to_q.weight"]
    key = "lora_unet_middle_block_1_transformer_blocks_0_attn1_to_q"
    write_safetensors(str(loras / "style.safetensors"), {
        key + ".lora_down.weight": np.full((4, q.shape[1]), 0.01, np.float16),
        key + ".lora_up.weight": np.full((q.shape[0], 4), 0.01, np.float16)})
    with live_server(create_app(tiny_pipe, server_config(tiny_pipe, lora_dir=str(loras)))) as url:
        browser.get(url + "/")
        wait = WebDriverWait(browser, 90)
        wait.until(lambda d: len(Select(d.find_element(By.ID, "sampler")).options) > 5)   # capabilities loaded
        assert browser.find_element(By.ID, "model").text == "tiny-sd1.safetensors"
        assert browser.find_element(By.ID, "width").get_attribute("value") == "64"
        assert [o.text for o in Select(browser.find_element(By.ID, "lora")).options] == ["style"]
        # a real generation, with the LoRA picked
        Select(browser.find_element(By.ID, "lora")).select_by_index(0)
        prompt = browser.find_element(By.ID, "prompt")
        prompt.clear()
        prompt.send_keys("a lovely cat")
        Select(browser.find_element(By.ID, "sampler")).select_by_value("euler")
        seed = browser.find_element(By.ID, "seed")
        seed.clear()
        seed.send_keys("42")
        browser.find_element(By.ID, "go").click()
        img = wait.until(EC.presence_of_element_located((By.ID, "img0")))
        wait.until(lambda d: d.execute_script("return arguments[0].complete && arguments[0].naturalWidth", img) == 64)
        assert img.get_attribute("src").startswith("data:image/png;base64,")
        params = browser.find_element(By.ID, "params").text
        assert "a lovely cat" in params and "Seed: 42" in params and "Sampler: euler" in params
        assert 'Lora hashes: "style: ' in params
        assert browser.execute_script("return document.getElementById('bar').value") == 2
        assert browser.find_element(By.ID, "status").text.startswith("completed")
        shot = os.environ.get("SDRT_SCREENSHOT")
        if shot:
            browser.save_screenshot(shot)
