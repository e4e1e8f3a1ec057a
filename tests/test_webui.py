"""The chat page that `cmf serve` answers on `/`, end to end in a real headless Chromium.

`cmf serve` runs as a subprocess (with an API key) on a tiny numpy-built model with a skill and
two task masks, on an ephemeral loopback port. Selenium drives the system's Chromium through the
system's chromedriver; the test installs nothing and skips, saying what is missing, when either
is absent (`.ci/run` installs Debian's `chromium` and `chromium-driver`).

What the page shows is checked against the server's own answers: a streamed reply must equal the
greedy answer the API gives for the same conversation, Stop must leave the server idle, the skill
chosen in the panel must be in the request's ``cmf`` object. A second server runs a model with a
48-token context: its first message must be answered (the page caps max_tokens to what the
context leaves), the context line must show the server's own token counts, and a conversation
that no longer fits must not be sent. A screenshot of the page after a reply
goes to ``$CMF_WEBUI_SCREENSHOT`` (default: the test's tmp dir); ``docs/webui.png`` is one.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install 'pycmf[test]')")

from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

import hf_fixtures as H  # noqa: E402
from test_server import _tiny_qwen3  # noqa: E402  (the same numpy-only checkpoint)

from cmf.convert import convert  # noqa: E402
from cmf.format.growth import append  # noqa: E402
from cmf.format.masks import MaskSet, TaskMask  # noqa: E402
from cmf.runtime.routing import fit_selection  # noqa: E402

KEY = "webui-key"
MODEL_ID = "tiny"
CTX = 32768  # long enough that a generation cannot end by itself before Stop is pressed
SMALL_CTX = 48  # far under the page's default max_tokens (512): the page must cap it
BROWSERS = ("chromium", "chromium-browser")
# Without the background-networking flags Chromium opens connections of its own (updates, sync,
# QUIC probes), which a closed network refuses; the page itself only talks to the loopback server.
CHROME_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync")

# ----------------------------------------------------------------------------------- fixtures


def _browser_paths() -> tuple[str | None, str | None]:
    """(browser, chromedriver) found on PATH; None for what is missing."""
    return next((p for p in map(shutil.which, BROWSERS) if p), None), shutil.which("chromedriver")


BROWSER, CHROMEDRIVER = _browser_paths()
_MISSING = " and ".join(n for n, p in (("chromium", BROWSER), ("chromedriver", CHROMEDRIVER)) if p is None)
pytestmark = pytest.mark.skipif(bool(_MISSING), reason=f"no {_MISSING} on PATH: the web UI test needs a system "
                                "Chromium (Debian: apt-get install chromium chromium-driver)")


def _tiny_model(root: Path, ctx: int) -> Path:
    """The tiny qwen3 at q8 with a context of ``ctx`` tokens."""
    hf = _tiny_qwen3(root / "hf")
    cfg = json.loads((hf / "config.json").read_text())
    cfg["max_position_embeddings"] = ctx
    (hf / "config.json").write_text(json.dumps(cfg))
    out = root / "tiny.cmf"
    convert(hf, out, quant="q8")
    return out


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny qwen3 at q8, context 32k, with a skill whose quality was "measured" (fixture
    numbers), a measured task mask and an unmeasured one."""
    out = _tiny_model(tmp_path_factory.mktemp("webui"), CTX)
    rng = np.random.default_rng(7)
    head = (rng.standard_normal((H.VOCAB, 64)) * 0.3).astype("<f4")
    masks = MaskSet(default_task="general", masks=[
        TaskMask(task_id=0, name="general", ffn=np.ones((2, 96), bool), heads=np.ones((2, 4), bool),
                 gates=np.ones(2, bool), priority="Fallback"),
        TaskMask(task_id=1, name="half", ffn=rng.random((2, 96)) < 0.5, heads=np.ones((2, 4), bool),
                 gates=np.ones(2, bool), priority="Normal", quality={"metric": "heldout_ppl_ratio", "value": 1.1})])
    quality = {"metric": "ppl", "backbone": 412.5, "overlaid": 398.25, "file": "fixture.txt", "tokens": 64}
    # A routing subspace makes the skill routable, so that "auto" has a winner to report.
    selection = fit_selection(rng.standard_normal((4, 64)), phi_layer=1, rank=2, skill="terse")
    append(out, [("skill.terse.lm_head.weight", "f32", head.shape, head.tobytes())],
           {"skills": [{"id": "terse", "name": "Terse", "layers": [], "quality": quality,
                        "selection": selection}]}, masks=masks)
    return out


class Served:
    """A `cmf serve` subprocess and a tiny client for its API (with the key)."""

    def __init__(self, url: str, proc: subprocess.Popen) -> None:
        self.url = url
        self.proc = proc

    def call(self, method: str, path: str, body: dict | None = None, key: str | None = KEY) -> tuple[int, Any]:
        """(status, parsed JSON body) of one request."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        if key:
            req.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def health(self) -> dict[str, Any]:
        """The engine block of /health (busy, waiting, cancelled, completion_tokens, ...)."""
        return self.call("GET", "/health", key=None)[1]["engine"]

    def wait_idle(self, timeout: float = 15.0) -> bool:
        """True once the engine runs nothing and nothing waits."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            h = self.health()
            if not h["busy"] and not h["waiting"]:
                return True
            time.sleep(0.05)
        return False

    def greedy(self, messages: list[dict], max_tokens: int, **extra: Any) -> str:
        """The server's greedy answer (temperature 0, not streamed) for a conversation."""
        status, body = self.call("POST", "/v1/chat/completions", dict(
            model=MODEL_ID, messages=messages, max_tokens=max_tokens, temperature=0, **extra))
        assert status == 200, body
        return body["choices"][0]["message"]["content"]

    def count(self, messages: list[dict]) -> int:
        """The prompt tokens of a conversation after the chat template (the server's /v1/tokenize)."""
        status, body = self.call("POST", "/v1/tokenize", dict(model=MODEL_ID, messages=messages))
        assert status == 200, body
        return body["prompt_tokens"]


@contextlib.contextmanager
def _serve(model_path: Path, log_path: Path) -> Iterator[Served]:
    """`cmf serve` on ``model_path``, port 0, with an API key; stopped with Ctrl-C (SIGINT)."""
    cmd = [sys.executable, "-m", "cmf", "serve", str(model_path), "--port", "0", "--alias", MODEL_ID,
           "--api-key", KEY, "--max-queue", "4"]
    with open(log_path, "w") as log:  # a file, not a pipe: access lines must never block the server
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
    try:
        url = None
        deadline = time.monotonic() + 300  # the start's warm-up may compile kernels first
        while url is None and time.monotonic() < deadline and proc.poll() is None:
            for line in log_path.read_text().splitlines():
                if "serving" in line and " on " in line:
                    url = line.split(" on ", 1)[1].split()[0].removesuffix("/v1")
            time.sleep(0.05)
        assert url is not None, f"cmf serve did not start:\n{log_path.read_text()}"
        yield Served(url, proc)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def served(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """`cmf serve` on the 32k-context model."""
    with _serve(model_path, tmp_path_factory.mktemp("serve") / "serve.log") as s:
        yield s


@pytest.fixture(scope="module")
def small_served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """`cmf serve` on a plain tiny model (no skill, no masks) whose context is SMALL_CTX tokens."""
    root = tmp_path_factory.mktemp("webui-small")
    with _serve(_tiny_model(root, SMALL_CTX), root / "serve.log") as s:
        yield s


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Headless Chromium with a fresh profile, driven through the system's chromedriver."""
    options = webdriver.ChromeOptions()
    options.binary_location = BROWSER
    for flag in CHROME_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    options.add_argument("--window-size=1280,800")
    # An explicit driver path: Selenium then never runs Selenium Manager (which would download).
    d = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    d.set_script_timeout(10)
    try:
        yield d
    finally:
        d.quit()


def _open(driver: Any, served: Served) -> Any:
    """The chat page of ``served`` with a fresh conversation and the API key already stored."""
    driver.set_window_size(1280, 800)
    driver.get(served.url + "/")
    driver.execute_script("localStorage.clear(); localStorage.setItem('cmf.webui.apiKey', arguments[0]);", KEY)
    driver.refresh()
    _wait_model(driver)
    return driver


@pytest.fixture
def page(driver: Any, served: Served) -> Any:
    """The chat page of the 32k-context model, fresh."""
    return _open(driver, served)


# ----------------------------------------------------------------------------------- helpers


def _wait(d: Any, what: Callable[[Any], Any], timeout: float = 20.0, message: str = "") -> Any:
    """What ``what(d)`` returns once it is truthy (polled every 50 ms), or a TimeoutException."""
    return WebDriverWait(d, timeout, poll_frequency=0.05).until(what, message)


def _wait_model(d: Any) -> None:
    """Wait until the model panel shows the model card."""
    _wait(d, lambda d: d.find_element(By.ID, "model-facts").text.strip(), message="the model panel stayed empty")


def _replies(d: Any) -> list[dict[str, Any]]:
    """Each message of the log as the page shows it: role, exact text, stats line, error, streaming."""
    return d.execute_script("""
        return [...document.querySelectorAll('#log .message')].map(n => ({
            role: n.classList.contains('user') ? 'user' : 'assistant',
            text: n.querySelector('.content').textContent,
            elements: n.querySelector('.content').children.length,
            stats: n.querySelector('.stats').textContent,
            error: n.querySelector('.error-text').hidden ? '' : n.querySelector('.error-text').textContent,
            streaming: n.classList.contains('streaming')}));""")


def _set(d: Any, element_id: str, value: str) -> None:
    """Type a value into a field and fire its change event, as a user leaving the field would."""
    field = d.find_element(By.ID, element_id)
    if not field.is_displayed():  # a folded "Advanced" section: unfold it first
        field.find_element(By.XPATH, "ancestor::details[1]/summary").click()
    field.clear()
    if value:
        field.send_keys(value)
    d.execute_script("arguments[0].dispatchEvent(new Event('change'))", field)


def _send(d: Any, text: str) -> None:
    """Type a message and press Enter."""
    box = d.find_element(By.ID, "prompt")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)


def _finished_reply(d: Any, n_messages: int, timeout: float = 30.0) -> dict[str, Any]:
    """The last message once the log holds ``n_messages`` and the last reply stopped streaming."""
    def done(d: Any) -> dict[str, Any] | None:
        msgs = _replies(d)
        if len(msgs) == n_messages and not msgs[-1]["streaming"] and msgs[-1]["stats"]:
            return msgs[-1]
        return None

    return _wait(d, done, timeout, "the reply did not finish")


def _spy_requests(d: Any) -> None:
    """Record the body of every request the page makes from now on: chat completions in
    window.__sent, token counts (/v1/tokenize) in window.__counted."""
    d.execute_script("""
        window.__sent = [];
        window.__counted = [];
        const real = window.fetch;
        window.fetch = (url, opts) => {
            if (opts && opts.body) {
                const to = String(url).endsWith('/tokenize') ? window.__counted : window.__sent;
                to.push(JSON.parse(opts.body));
            }
            return real(url, opts);
        };""")


def _context_line(d: Any) -> str:
    return d.find_element(By.ID, "context").text


def _context_text(used: int, ctx: int) -> str:
    """The context line the page shows for a prompt of ``used`` tokens."""
    if used >= ctx:
        return f"context: {used:,} / {ctx:,} tokens used · the conversation no longer fits: start a new chat"
    return f"context: {used:,} / {ctx:,} tokens used · {ctx - used:,} left for the reply"


def _screenshot_path(tmp_path: Path) -> Path:
    """Where the screenshot goes: ``$CMF_WEBUI_SCREENSHOT``, else the test's tmp dir."""
    return Path(os.environ.get("CMF_WEBUI_SCREENSHOT") or tmp_path / "webui.png")


# ----------------------------------------------------------------------------------- tests


def test_api_key_prompt_and_model_panel(driver, served):
    driver.get(served.url + "/")
    driver.execute_script("localStorage.clear()")
    driver.refresh()
    dialog = driver.find_element(By.ID, "key-dialog")
    _wait(driver, lambda d: dialog.is_displayed(), message="no API key prompt on a keyed server")
    field = driver.find_element(By.ID, "api-key")
    field.send_keys("wrong-key", Keys.ENTER)
    _wait(driver, lambda d: "refused" in d.find_element(By.ID, "key-reason").text and dialog.is_displayed(),
          message="a wrong key was not refused")
    assert driver.execute_script("return localStorage.getItem('cmf.webui.apiKey')") is None
    field.send_keys(KEY, Keys.ENTER)
    _wait_model(driver)
    assert not dialog.is_displayed()
    assert driver.execute_script("return localStorage.getItem('cmf.webui.apiKey')") == KEY

    facts = driver.find_element(By.ID, "model-facts").text
    card = served.call("GET", f"/v1/models/{MODEL_ID}")[1]["cmf"]
    assert "qwen3, 2 layers" in facts and "q8_row" in facts and "Q8_ROW" in facts
    assert "KiB" in facts and f"{CTX} tokens" in facts and "in skills" in facts
    assert card["parameters"] > 0 and card["skill_info"][0]["quality"]["metric"] == "ppl"
    tasks = [o.text for o in Select(driver.find_element(By.ID, "task")).options]
    skills = [o.text for o in Select(driver.find_element(By.ID, "skill")).options]
    assert tasks == ["file default (general)", "general — unmeasured", "half — held-out ppl ×1.100"]
    assert skills == ["server default (none)", "none (backbone)", "terse — ppl 412.5 → 398.25 (backbone → skill)",
                      "auto (route each message)", "auto blend (two best skills)"]
    quality = driver.find_element(By.ID, "quality-list").text
    assert "task general (0% of FFN off): unmeasured" in quality and "task half (5" in quality
    assert "skill terse (Terse): ppl 412.5" in quality

    # the key is asked once: a reload goes straight to the model
    driver.refresh()
    _wait_model(driver)
    assert not driver.find_element(By.ID, "key-dialog").is_displayed()
    # every control has a label (a <label for>, or aria-label)
    unlabeled = driver.execute_script("""
        return [...document.querySelectorAll('input, select, textarea, button')]
            .filter(e => !(e.labels && e.labels.length) && !e.getAttribute('aria-label') && !e.textContent.trim()
                         && !e.closest('template'))
            .map(e => e.id || e.outerHTML);""")
    assert unlabeled == []
    assert driver.find_element(By.ID, "log").get_attribute("aria-live") == "polite"


def test_streamed_reply_equals_greedy_answer(page, served, tmp_path):
    _set(page, "temperature", "0")
    _set(page, "max-tokens", "24")
    first = "hello <b>model</b>"
    _send(page, first)
    reply = _finished_reply(page, 2)
    user_msg = _replies(page)[0]
    assert user_msg["text"] == first and user_msg["elements"] == 0  # markup stays text
    expected = served.greedy([{"role": "user", "content": first}], 24)
    assert reply["text"] == expected and reply["error"] == "" and reply["elements"] == 0
    stats = reply["stats"]
    assert "tokens" in stats and "tok/s" in stats and "first token" in stats and "finish: " in stats
    assert "task: general" in stats and "skill: backbone" in stats
    assert page.find_element(By.ID, "prompt").get_attribute("value") == ""

    # a second turn, typed over two lines (Shift+Enter), carries the whole conversation
    page.find_element(By.ID, "prompt").click()
    ActionChains(page).send_keys("and then").key_down(Keys.SHIFT).send_keys(Keys.ENTER).key_up(Keys.SHIFT) \
        .send_keys("what?").perform()
    assert page.find_element(By.ID, "prompt").get_attribute("value") == "and then\nwhat?"
    page.find_element(By.ID, "prompt").send_keys(Keys.ENTER)
    second = _finished_reply(page, 4)
    history = [{"role": "user", "content": first}, {"role": "assistant", "content": expected},
               {"role": "user", "content": "and then\nwhat?"}]
    assert second["text"] == served.greedy(history, 24)
    # the second turn's prompt starts with the first turn's: the server's prefix cache held it
    cached = re.search(r"prompt ([\d,]+) tokens, ([\d,]+) cached", second["stats"])
    assert cached and 0 < int(cached[2].replace(",", "")) < int(cached[1].replace(",", "")), second["stats"]
    shot = _screenshot_path(tmp_path)
    shot.parent.mkdir(parents=True, exist_ok=True)
    page.set_window_size(1280, 960)  # tall enough for the whole model panel
    page.execute_script("document.getElementById('panel').scrollTop = 0; document.activeElement.blur()")
    assert page.save_screenshot(str(shot)) and shot.stat().st_size > 0

    # copy a message: the reply's text lands on the clipboard
    page.execute_cdp_cmd("Browser.grantPermissions", {"origin": served.url,
                                                      "permissions": ["clipboardReadWrite", "clipboardSanitizedWrite"]})
    button = page.find_elements(By.CSS_SELECTOR, "#log .message.assistant .copy")[-1]
    button.click()
    _wait(page, lambda d: button.text == "Copied", 5, "copy did not report success")
    clip = page.execute_async_script("navigator.clipboard.readText().then(arguments[0], e => arguments[0]('!' + e))")
    assert clip == second["text"]


def test_skill_choice_is_sent_and_reported(page, served):
    _set(page, "temperature", "0")
    _set(page, "max-tokens", "12")
    _spy_requests(page)
    Select(page.find_element(By.ID, "skill")).select_by_value("terse")
    _send(page, "use the skill")
    reply = _finished_reply(page, 2)
    sent = page.execute_script("return window.__sent")
    assert sent[-1]["cmf"] == {"skill": "terse"} and sent[-1]["stream"] is True
    assert sent[-1]["stream_options"] == {"include_usage": True} and sent[-1]["max_tokens"] == 12
    assert "skill: terse" in reply["stats"]
    assert reply["text"] == served.greedy([{"role": "user", "content": "use the skill"}], 12, cmf={"skill": "terse"})
    assert reply["text"] != served.greedy([{"role": "user", "content": "use the skill"}], 12)

    # "auto" routes (terse is the only routable skill, so it wins), and the page says what won
    Select(page.find_element(By.ID, "skill")).select_by_value("auto")
    Select(page.find_element(By.ID, "task")).select_by_value("half")
    _send(page, "route me")
    reply = _finished_reply(page, 4)
    assert page.execute_script("return window.__sent")[-1]["cmf"] == {"task": "half", "skill": "auto"}
    assert "skill: auto → terse" in reply["stats"] and "task: half" in reply["stats"]
    # the choice belongs to the conversation: it survives a reload
    page.refresh()
    _wait_model(page)
    assert Select(page.find_element(By.ID, "skill")).first_selected_option.get_attribute("value") == "auto"
    assert Select(page.find_element(By.ID, "task")).first_selected_option.get_attribute("value") == "half"
    # the auto blend goes out as cmf.blend; the page shows the weights the router chose
    _spy_requests(page)
    Select(page.find_element(By.ID, "skill")).select_by_value("blend:auto")
    _send(page, "blend me")
    reply = _finished_reply(page, 6)
    assert page.execute_script("return window.__sent")[-1]["cmf"] == {"task": "half", "blend": "auto"}
    assert "blend (auto): terse 1.00" in reply["stats"] and reply["error"] == ""


def test_stop_cancels_the_generation(page, served):
    _set(page, "max-tokens", str(CTX // 2))  # room for the second turn's history
    _set(page, "extra", '{"ignore_eos": true}')  # a long generation that only Stop can end
    assert served.wait_idle()
    for n, how in ((2, "button"), (4, "escape")):
        before = served.health()
        _send(page, f"go on forever ({how})")
        _wait(page, lambda d: len(_replies(d)) == n and len(_replies(d)[-1]["text"]) > 20,
              message=f"no streamed text: {_replies(page)}")
        assert served.health()["busy"]
        assert not page.find_element(By.ID, "stop").get_attribute("disabled")
        if how == "button":
            page.find_element(By.ID, "stop").click()
        else:
            page.find_element(By.ID, "prompt").send_keys(Keys.ESCAPE)
        reply = _finished_reply(page, n)
        assert "finish: stopped" in reply["stats"] and reply["error"] == ""
        assert served.wait_idle(10), "the server kept generating after Stop"
        after = served.health()
        assert after["cancelled"] == before["cancelled"] + 1
        assert after["completion_tokens"] - before["completion_tokens"] < CTX // 2
        assert page.find_element(By.ID, "stop").get_attribute("disabled")
        assert not page.find_element(By.ID, "send").get_attribute("disabled")


def test_reload_keeps_the_conversation_and_new_chat_clears_it(page, served):
    _set(page, "temperature", "0")
    _set(page, "max-tokens", "8")
    _set(page, "system", "You are terse.")
    _send(page, "remember me")
    reply = _finished_reply(page, 2)
    assert reply["text"] == served.greedy([{"role": "system", "content": "You are terse."},
                                           {"role": "user", "content": "remember me"}], 8)
    before = _replies(page)
    page.refresh()
    _wait_model(page)
    assert _replies(page) == before
    assert page.find_element(By.ID, "system").get_attribute("value") == "You are terse."
    page.find_element(By.ID, "new-chat").click()
    assert _replies(page) == [] and page.find_element(By.ID, "empty").is_displayed()
    page.refresh()
    _wait_model(page)
    assert _replies(page) == []


def test_server_errors_are_shown(page, served):
    # refused by the chat route (the skill is checked there, not by the token count before it)
    _set(page, "max-tokens", "4")
    _set(page, "extra", '{"cmf": {"skill": "nope"}}')
    _send(page, "an unknown skill")
    reply = _finished_reply(page, 2)
    assert "Error 404" in reply["error"] and "skill_not_found" in reply["error"] and "param cmf.skill" in reply["error"]
    assert "no skill 'nope'" in reply["error"] and "finish: error" in reply["stats"]
    # a bad "extra" is refused by the page before anything is sent
    _set(page, "extra", "{not json")
    _send(page, "again")
    _wait(page, lambda d: "not valid JSON" in d.find_element(By.ID, "composer-error").text)
    assert len(_replies(page)) == 2 and page.find_element(By.ID, "prompt").get_attribute("value") == "again"
    page.find_element(By.ID, "prompt").clear()
    # and a request the server refuses for its key
    page.execute_script("localStorage.setItem('cmf.webui.apiKey', 'stale')")
    _set(page, "extra", "")
    _send(page, "who am I")
    reply = _finished_reply(page, 4)
    assert "Error 401" in reply["error"] and "invalid_api_key" in reply["error"]
    assert page.find_element(By.ID, "key-dialog").is_displayed()


def test_narrow_screen(page):
    page.set_window_size(390, 780)  # a phone (headless Chromium may keep a wider minimum)
    _wait(page, lambda d: d.find_element(By.ID, "panel-toggle").is_displayed(), message="no one-column layout")
    width = page.execute_script("return window.innerWidth")
    assert width <= 760
    assert page.execute_script("return document.documentElement.scrollWidth") <= width  # no sideways scroll
    assert not page.find_element(By.ID, "panel").is_displayed()
    for element_id in ("prompt", "send", "stop", "new-chat"):
        box = page.find_element(By.ID, element_id).rect
        assert box["x"] >= 0 and box["x"] + box["width"] <= width, element_id
    toggle = page.find_element(By.ID, "panel-toggle")
    toggle.click()
    assert toggle.get_attribute("aria-expanded") == "true"
    assert page.find_element(By.ID, "skill").is_displayed() and page.find_element(By.ID, "send").is_displayed()
    assert page.execute_script("return document.documentElement.scrollWidth") <= width
    toggle.click()
    assert not page.find_element(By.ID, "panel").is_displayed()


def test_small_context_first_message_is_answered_and_the_context_shown(driver, small_served):
    """A 48-token context: the page's default max_tokens (512) would be a 400; the page sends what
    the context leaves, shows the server's counts, and does not send what no longer fits."""
    page = _open(driver, small_served)
    _wait(page, lambda d: _context_line(d) == _context_text(0, SMALL_CTX), message=_context_line(page))
    assert page.find_element(By.ID, "max-tokens").get_attribute("value") == "512"
    _set(page, "temperature", "0")
    _set(page, "extra", '{"ignore_eos": true}')  # the reply runs up to the cap
    _spy_requests(page)
    first = [{"role": "user", "content": "hello model"}]
    n_first = small_served.count(first)
    page.find_element(By.ID, "prompt").send_keys(first[0]["content"])
    # the draft is counted while it is typed, before anything is sent
    _wait(page, lambda d: _context_line(d) == _context_text(n_first, SMALL_CTX), message=_context_line(page))
    page.find_element(By.ID, "prompt").send_keys(Keys.ENTER)
    reply = _finished_reply(page, 2)
    left = SMALL_CTX - n_first
    assert reply["error"] == "" and "finish: length" in reply["stats"], reply
    assert f"{left} tokens" in reply["stats"] and f"max tokens capped at {left} by the context" in reply["stats"]
    sent = page.execute_script("return window.__sent")
    assert len(sent) == 1 and sent[0]["max_tokens"] == left
    # it was counted first, with the very body it then sent (before the cap)
    counted = page.execute_script("return window.__counted")
    assert dict(sent[0], max_tokens=512) in counted
    assert reply["text"] == small_served.greedy(first, left, ignore_eos=True)

    # the line now counts the conversation with the reply, as the server does
    history = first + [{"role": "assistant", "content": reply["text"]}]
    n_history = small_served.count(history)
    _wait(page, lambda d: _context_line(d) == _context_text(n_history, SMALL_CTX), message=_context_line(page))
    # a message that cannot fit is not sent: the page says why and keeps it in the box
    long = "tensor weight " * 8
    long_turn = [{"role": "user", "content": long}]
    n_long = small_served.count(long_turn)
    assert small_served.count(history + long_turn) > SMALL_CTX > n_long
    _send(page, long)
    _wait(page, lambda d: "no longer fits" in d.find_element(By.ID, "composer-error").text)
    assert "start a new chat" in page.find_element(By.ID, "composer-error").text.lower()
    assert "no longer fits" in _context_line(page)
    assert "full" in page.find_element(By.ID, "context").get_attribute("class")
    assert len(page.execute_script("return window.__sent")) == 1 and len(_replies(page)) == 2
    assert page.find_element(By.ID, "prompt").get_attribute("value") == long
    assert not page.find_element(By.ID, "send").get_attribute("disabled")
    # a new chat has the whole context again, and the kept message is answered in it
    page.find_element(By.ID, "new-chat").click()
    _wait(page, lambda d: _context_line(d) == _context_text(n_long, SMALL_CTX), message=_context_line(page))
    assert not page.find_element(By.ID, "composer-error").is_displayed()
    page.find_element(By.ID, "prompt").send_keys(Keys.ENTER)
    reply = _finished_reply(page, 2)
    assert reply["error"] == "" and page.execute_script("return window.__sent")[-1]["max_tokens"] == SMALL_CTX - n_long
