"""receipt.html as a reviewer sees it: a small receipt of all five notebooks, opened in headless Chromium.

The sections are computed first with the smallest parameters that still exercise every table and plot (one short
prompt, a few generated tokens, one contract class), then rendered by the notebooks through the receipt runner
(``--precomputed``), as a GPU receipt is. The page must show no NaN / <NA> / None / null, no stderr block (the
analyses' progress bars), every image loaded, and nothing wider than the window.

Needs Debian's ``chromium`` and ``chromium-driver`` (``apt-get install -y chromium chromium-driver``); skipped,
saying so, where they are not installed.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from exactness.receipt.cli import main
from exactness.receipt.runner import run_receipts

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
DRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync")
WINDOW = (1280, 1000)
# The smallest section parameters that still give every table and plot rows (receipt run and computation).
PARAMS = ["prompts=[short]", "prompt_max_tokens=40", "gen_tokens=3", "steps=[16]", "deep_threshold=8",
          "contract_classes=[dense]", "contract_dtypes=[bfloat16]", "contract_offload=false", "fp64_rows=4",
          "fp64_cert=2", "stream_counts=[1,2]", "bench_reps=2", "bench_itl_reps=2", "bench_cold_lengths=[32]",
          "bench_step=16"]
COMPUTE_ONLY = ["fp64_synthetic=false"]  # not a notebook parameter: the sections command takes it, a receipt not
BAD_TEXT = re.compile(r"\bNaN\b|<NA>|\bNone\b|\bnull\b")

pytestmark = pytest.mark.skipif(not (Path(CHROMIUM).is_file() and Path(DRIVER).is_file()),
                                reason=f"Chromium or its driver is not installed ({CHROMIUM}, {DRIVER}); on "
                                       "Debian: apt-get install -y chromium chromium-driver")

# Elements whose right edge passes the window's content width (a table or image wider than the page, also when it
# sits in a scrolling output area), and the page's own overflow.
_OVERFLOW_JS = """
const width = document.documentElement.clientWidth;
const wide = [];
for (const el of document.body.querySelectorAll('*')) {
  const r = el.getBoundingClientRect();
  if (r.width > 0 && r.right > width + 1) {
    wide.push(el.tagName + '.' + el.className + ' right=' + Math.round(r.right) + ': '
              + (el.innerText || '').slice(0, 60));
  }
}
for (const t of document.querySelectorAll('table')) {
  if (t.scrollWidth > t.parentElement.clientWidth + 1) {
    wide.push('table wider than its container: ' + (t.innerText || '').slice(0, 60));
  }
}
return {scrollWidth: document.documentElement.scrollWidth, innerWidth: window.innerWidth, wide: wide.slice(0, 20)};
"""


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = CHROMIUM
    for flag in FLAGS + (f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}",
                         f"--window-size={WINDOW[0]},{WINDOW[1]}"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def small_receipt(tmp_path_factory):
    """A receipt of all five notebooks, rendered from sections computed here with PARAMS (about 10 s of compute)."""
    pre = tmp_path_factory.mktemp("sections") / "computed"
    assert main(["sections", "--profile", "ci", "--out", str(pre)]
                + [a for p in PARAMS + COMPUTE_ONLY for a in ("--param", p)]) == 0
    return run_receipts("ci", tmp_path_factory.mktemp("receipt") / "run", PARAMS, precomputed=pre)


def _open(browser, path: Path) -> dict:
    """Load ``path`` and wait until every image has finished loading; returns the page's checks."""
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(path.as_uri())
    WebDriverWait(browser, 30).until(lambda d: d.execute_script(
        "return document.readyState === 'complete' && Array.from(document.images).every(i => i.complete)"))
    return {"text": browser.execute_script("return document.body.innerText"),
            "stderr": browser.execute_script(
                "return document.querySelectorAll('[data-mime-type=\"application/vnd.jupyter.stderr\"]').length"),
            "images": browser.execute_script("return Array.from(document.images).map(i => i.naturalWidth)"),
            **browser.execute_script(_OVERFLOW_JS)}


def test_small_receipt_reads_cleanly_in_a_browser(small_receipt, browser):
    assert small_receipt.status == "ok", small_receipt.receipt["errors"]
    page = _open(browser, small_receipt.folder / "receipt.html")
    bad = sorted({m.group(0) for m in BAD_TEXT.finditer(page["text"])})
    assert bad == [], f"the page shows {bad}"
    assert page["stderr"] == 0
    assert len(page["images"]) >= 5 and all(w > 0 for w in page["images"]), page["images"]
    assert page["scrollWidth"] <= page["innerWidth"] and page["wide"] == [], page["wide"]
    for title in ("Output hashes", "Kernel contract", "FP64 per class", "Drafted decode", "Bench"):
        assert title in page["text"]


def test_small_receipt_markdown_and_json(small_receipt):
    md = (small_receipt.folder / "receipt.md").read_text()
    data = json.loads((small_receipt.folder / "receipt.json").read_text())
    assert data["summary"].startswith("## Summary") and data["summary"] in md
    assert re.search(r"\| git +\| [0-9a-f]{40} \((clean|dirty)", md)
    assert "(in receipt.json)._" not in md and not BAD_TEXT.search(md)
    for symbol in ("η", "γ_K", "κ", "u = 2⁻²⁴"):  # the FP64 section explains its symbols
        assert symbol in md
