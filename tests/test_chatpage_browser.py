"""The chat page driven in a real browser: headless Chromium through selenium, the system's
chromium and chromedriver (`apt-get install -y chromium chromium-driver`, `pip install
selenium`). Where neither is installed these tests say so and do not run; the page's HTTP paths
are still tested in tests/test_chatpage.py.

On the tiny model with dense attention and FP32 KV, what the page shows must be the model's exact
answer: `Session.generate` over the ids `ktlong chat -f` would feed for the same turns.
"""
from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from ktlong import server as server_mod  # noqa: E402
from ktlong.conversation import Conversation  # noqa: E402
from ktlong.documents import read_document  # noqa: E402
from ktlong.model import load_model  # noqa: E402
from ktlong.tinymodel import filler_text  # noqa: E402

from .chatpage_driver import Page, browser_missing, open_browser, write_pdf  # noqa: E402
from .models import greedy_text, hf_model, settings  # noqa: E402

MISSING = browser_missing()
pytestmark = pytest.mark.skipif(MISSING is not None,
                                reason=f"the browser test did not run: {MISSING}")
NEW = 10
ST = dict(attention="DENSE", max_new_tokens=NEW, max_seq_len=8192)
TEXT = filler_text(600, seed=21) + "\nThe harbour master keeps the pass key 4417.\n" + \
    filler_text(300, seed=22)


@pytest.fixture(scope="module")
def lm():
    return load_model(hf_model("llama"), device="CPU", dtype="float32")


@pytest.fixture(scope="module")
def browser():
    driver = open_browser()
    yield driver
    driver.quit()


def greedy(lm, ids: list[int], n: int = NEW) -> str:  # type: ignore[no-untyped-def]
    return greedy_text(lm, settings(**ST), ids, n)


def test_the_page_answers_about_an_attached_pdf_turn_after_turn(lm, browser, tmp_path) -> None:
    pdf = write_pdf(TEXT, tmp_path / "harbour.pdf")
    read = read_document(pdf)  # what ktlong reads of it
    doc = read.text
    conv = Conversation(lm.tokenizer, doc)
    srv = server_mod.build(lm, settings(**ST), use_cache=False)
    with server_mod.Running(srv) as r:
        page = Page(browser, r.url + "/", timeout=60)
        assert srv.model_id in page.loaded()
        status = page.attach(pdf)
        n_doc = len(conv.document_ids())
        assert status.startswith(f"read: {n_doc:,} tokens in "), status
        assert page.text("#doc-name") == f"harbour.pdf (pdf, {read.pages} pages, {n_doc:,} tokens)"

        # Shift+Enter is a new line in the question, not a send
        from selenium.webdriver.common.keys import Keys

        box = page.find("textarea")
        box.send_keys("Who keeps", Keys.SHIFT, Keys.ENTER, Keys.SHIFT, "the key?")
        assert box.get_attribute("value") == "Who keeps\nthe key?"
        assert page.all(".turn") == []
        box.send_keys(Keys.ENTER)
        line = page.wait_answered(1)
        q1 = "Who keeps\nthe key?"
        a1 = greedy(lm, conv.prompt_ids(q1))
        answers = page.answers()
        assert [a.get_attribute("textContent") for a in answers] == [a1]
        assert box.get_attribute("value") == ""
        assert f"{NEW} tokens at " in line and " tok/s; prompt " in line, line
        assert page.text("#speed").endswith("tok/s")
        n_ctx = len(conv.prompt_ids(q1)) + NEW - 1
        assert page.text("#context") == f"context {n_ctx:,} / 8,192 tokens"
        # beside the answer: the passages it read, the document's own words
        quotes = page.all("aside.passages blockquote")
        assert quotes and all("% of its attention, tokens" in q.text for q in quotes)
        flat = " ".join(doc.split())
        for q in quotes:
            words = q.text.split("\n", 1)[1]
            assert " ".join(words.split()) in flat

        # a second turn is asked with the first in the conversation
        page.type("And the number?")
        page.wait_answered(2)
        msgs = [{"role": "user", "content": q1}, {"role": "assistant", "content": a1},
                {"role": "user", "content": "And the number?"}]
        ids = srv.documents.get(next(iter(srv.documents._docs))).renderer.chat(msgs).ids
        assert [a.get_attribute("textContent") for a in page.answers()] == [a1, greedy(lm, ids)]

        # a new chat forgets the turns and keeps the document
        page.find("#new-chat").click()
        assert page.all(".turn") == []
        page.type("And the number?")
        page.wait_answered(1)
        assert page.answers()[0].get_attribute("textContent") == \
            greedy(lm, conv.prompt_ids("And the number?"))


def test_stop_ends_a_long_answer_and_the_engine_is_free(lm, browser) -> None:
    long = {**ST, "max_new_tokens": 4000}
    srv = server_mod.build(lm, settings(**long), use_cache=False)
    with server_mod.Running(srv) as r:
        page = Page(browser, r.url + "/", timeout=60)
        page.loaded()
        page.type("Tell me everything.")
        page.wait(lambda: len(page.answers()[0].get_attribute("textContent")) > 20,
                  what="the answer to begin")
        assert not page.find("#stop").get_attribute("hidden")
        page.find("#stop").click()
        line = page.wait_answered(1)
        assert line == "stopped"
        page.wait(lambda: not srv.engine.health()["busy"], timeout=10, what="the engine free")
        assert srv.engine.last["finish_reason"] == "cancelled"
        assert srv.engine.last["completion_tokens"] < 4000
        assert page.find("#stop").get_attribute("hidden") and \
            not page.find("#send").get_attribute("hidden")


def test_the_page_asks_for_the_api_key(lm, browser) -> None:
    srv = server_mod.build(lm, settings(**ST), api_key="s3cret", use_cache=False)
    with server_mod.Running(srv) as r:
        browser.delete_all_cookies()
        page = Page(browser, r.url + "/", timeout=60)
        assert page.all("textarea") == []
        key = page.find('input[type="password"]')
        key.send_keys("wrong\n")
        page.wait(lambda: "not the server" in page.text("form"), what="the refusal")
        page.wait(lambda: page.find('input[type="password"]').send_keys("s3cret\n") or True,
                  what="the form again")
        assert srv.model_id in page.loaded()
        page.type("hello")
        assert "tok/s" in page.wait_answered(1)
        ids = srv.renderer.chat([{"role": "user", "content": "hello"}]).ids
        assert page.answers()[0].get_attribute("textContent") == greedy(lm, ids)
