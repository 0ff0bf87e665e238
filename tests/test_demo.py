"""The Gradio demo: rendering on its own, the app's API through gradio_client, and the page in a real browser.

The browser test drives headless Chromium (Debian's `chromium` package) with Python Playwright
and saves a screenshot. To regenerate the README's picture:

    HF_TREESPARK_DEMO_SCREENSHOT=docs/demo.png .venv/bin/python -m pytest tests/test_demo.py -k browser
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hf_treespark.cli.commands import main as treespark_main
from hf_treespark.decoding.generation_output import RoundRecord
from hf_treespark.demo import run as demo_run
from hf_treespark.demo.page import (
    DATASTORE_COLOUR,
    Band,
    DemoSettings,
    TokenText,
    acceptance_histogram,
    check_request,
    render_answer,
    render_stats,
    render_tree,
)
from hf_treespark.sources.datastore import MAX_NODES
from hf_treespark.sources.lookup import LOOKUP_LONG_TOKENS

REPO = Path(__file__).resolve().parents[1]
PROMPT = "Explain what a binary search does."
# The README's screenshot (HF_TREESPARK_DEMO_SCREENSHOT) shows the shipped drafter at its default settings
# (tree budget "auto") over a longer answer, so that its speed figures mean something.
SCREENSHOT = bool(os.environ.get("HF_TREESPARK_DEMO_SCREENSHOT"))
MAX_NEW_TOKENS = 96 if SCREENSHOT else 24
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


# ----- rendering, without models or gradio ---------------------------------------------------------
def test_answer_bands_escape_token_text_and_mark_the_bonus():
    bands = [Band(["<b>"], None, bonus=False), Band(["a", " & ", "b"], 0), Band(["c"], 1, bonus=False)]
    page = render_answer(bands)
    assert "&lt;b&gt;" in page and "<b>" not in page and " &amp; " in page
    assert page.count('class="ts-band ts-round"') == 2 and page.count('class="ts-band ts-prefill"') == 1
    assert page.count('class="ts-bonus"') == 1  # round 0's last token; round 1 was cut short
    answer = page[page.index('<div class="ts-answer"'):]
    assert "</span><span" in answer  # bands touch: the text content is exactly the answer


def test_token_text_holds_back_a_split_character():
    class ByteTokenizer:  # token id = one UTF-8 byte
        def decode(self, ids, skip_special_tokens=True):
            return bytes(ids).decode("utf-8", errors="replace")

    ids = list("ab é!".encode())
    text = TokenText(ByteTokenizer())
    pieces = text.add(ids[:4]) + text.add(ids[4:])
    assert pieces == ["a", "b", " ", "", "é", "!"]
    assert "".join(pieces) == "ab é!"


def test_check_request_names_each_problem():
    assert check_request("hi", DemoSettings()) is None
    assert "empty" in check_request("   ", DemoSettings())
    assert "tree budget must be between 1 and 128, got 0" in check_request("hi", DemoSettings(tree_budget=0))
    assert "tree budget" in check_request("hi", DemoSettings(tree_budget=10**6))
    assert "max new tokens" in check_request("hi", DemoSettings(max_new_tokens=0))
    assert "whole number" in check_request("hi", DemoSettings(tree_topk=2.5))


@pytest.mark.parametrize(("settings", "message"), [
    (DemoSettings(max_new_tokens="ten"), "max new tokens must be a number between 1 and 1024, got 'ten'."),
    (DemoSettings(max_new_tokens=None), "max new tokens must be a number between 1 and 1024, got None."),
    (DemoSettings(temperature=float("nan")), "temperature must be a number between 0 and 2, got nan."),
    (DemoSettings(tree_budget="8"), "tree budget must be a number between 1 and 128, got '8'."),
    (DemoSettings(chain="no"), "chain must be true or false, got 'no'."),
])
def test_check_request_answers_api_values_of_any_type(settings, message):
    assert check_request("hi", settings) == message


def test_check_request_takes_no_tree_budget_as_the_drafters_own():
    assert check_request("hi", DemoSettings(tree_budget=None, tree_topk=None)) is None
    assert check_request(42, DemoSettings()) == "The prompt must be text, got 42."


def test_tree_drawing_marks_accepted_packed_and_pruned_candidates():
    # Root 10; candidates: 11, 12 (depth 1), 13, 14 under 11 (depth 2). Packed: 11, 12, 13. Accepted: 11.
    # The target's bonus after 11 is 14: drafted, but pruned by packing.
    tree = {
        "tokens": [10, 11, 12, 13], "parents": [-1, 0, 0, 1], "depths": [0, 1, 1, 2],
        "scores": [0.0, -0.1, -0.5, -0.9],
        "candidates": {"tokens": [11, 12, 13, 14], "parents": [-1, -1, 0, 0], "depths": [1, 1, 2, 2],
                       "scores": [-0.1, -0.5, -0.9, -1.2], "packed": [True, True, True, False],
                       "node_index": [1, 2, 3, -1]},
    }
    record = RoundRecord(tree_size=3, num_accepted=1, accepted_path=[1], committed=[11, 14], tree=tree)
    labels = {10: "root", 11: "<a>", 12: "b", 13: "c", 14: "d"}
    page = render_tree(record, labels, 0, 1)
    assert page.count('class="ts-node ts-root"') == 1
    assert page.count('class="ts-node ts-accepted"') == 1 and "&lt;a&gt;" in page
    assert page.count('class="ts-node ts-packed"') == 2 and page.count('class="ts-node ts-pruned"') == 1
    assert "packed 3 of 4 candidates" in page and "drafted, but not packed" in page
    assert "ts-lookup" not in page


def test_tree_drawing_marks_lookup_nodes_and_counts_their_tokens():
    tree = {
        "tokens": [10, 11, 12], "parents": [-1, 0, 1], "depths": [0, 1, 2], "scores": [0.0, -0.1, -0.7],
        "lookup": [False, False, True],
        "candidates": {"tokens": [11, 12], "parents": [-1, 0], "depths": [1, 2], "scores": [-0.1, -0.7],
                       "packed": [True, True], "node_index": [1, 2], "lookup": [False, True]},
    }
    record = RoundRecord(tree_size=2, num_accepted=2, accepted_path=[1, 2], committed=[11, 12, 13], tree=tree,
                         lookup_accepted=1)
    page = render_tree(record, {10: "a", 11: "b", 12: "c", 13: "d"}, 0, 1)
    assert page.count("ts-lookup") == 1 and "from a lookup branch" in page
    assert "accepted 2 (1 from lookup)" in page


def test_tree_drawing_colours_datastore_nodes_and_counts_their_tokens():
    tree = {
        "tokens": [10, 11, 12, 15], "parents": [-1, 0, 1, 0], "depths": [0, 1, 2, 1],
        "scores": [0.0, -0.1, -0.7, -0.9], "lookup": [False, False, True, False], "retrieved": [False] * 3 + [True],
        "candidates": {"tokens": [11, 12, 15], "parents": [-1, 0, -1], "depths": [1, 2, 1],
                       "scores": [-0.1, -0.7, -0.9], "packed": [True, True, True], "node_index": [1, 2, 3],
                       "lookup": [False, True, False], "retrieved": [False, False, True]},
    }
    record = RoundRecord(tree_size=3, num_accepted=1, accepted_path=[3], committed=[15, 13], tree=tree,
                         datastore_accepted=1)
    page = render_tree(record, {10: "a", 11: "b", 12: "c", 13: "d", 15: "e"}, 0, 1)
    assert page.count("ts-datastore") == 1 and page.count("ts-lookup") == 1
    assert "from the datastore" in page and "accepted 1 (1 from the datastore)" in page
    assert DATASTORE_COLOUR in page


def test_histogram_counts_rounds_per_committed_length():
    frame = acceptance_histogram([1, 3, 3, 8], depth=7)
    assert list(frame["tokens per round"]) == [str(k) for k in range(1, 9)]
    assert list(frame["rounds"]) == [1, 0, 2, 0, 0, 0, 0, 1]
    longer = acceptance_histogram([2, 17], depth=7)  # a long lookup-only round commits up to 17 tokens
    assert len(longer) == 17 and list(longer["rounds"])[16] == 1 and sum(longer["rounds"]) == 2


class _FakeClock:
    def __init__(self):
        self.seconds = 0.0

    def __call__(self) -> float:
        return self.seconds


class _FakeTarget:
    """`generate` commits 8 tokens (the prefill's, then rounds of 3 and 4) and advances the clock: the streamed
    TreeSpark run 10 s (the page redrawing), the TreeSpark run without a streamer 1 s, plain decoding 2 s."""

    def __init__(self, clock: _FakeClock):
        self.clock, self.calls = clock, []

    def generate(self, input_ids, attention_mask=None, assistant_model=None, streamer=None,
                 return_dict_in_generate=False, **kwargs):
        self.calls.append({"assistant": assistant_model is not None, "streamer": streamer is not None})
        new = torch.arange(100, 108).reshape(1, -1)
        if streamer is not None:
            streamer.put(input_ids)
            for piece in (new[:, :1], new[:, 1:4], new[:, 4:]):
                streamer.put(piece)
            streamer.end()
        self.clock.seconds += 10.0 if streamer is not None else 1.0 if assistant_model is not None else 2.0
        sequences = torch.cat([input_ids, new], dim=1)
        return SimpleNamespace(sequences=sequences, rounds=[]) if return_dict_in_generate else sequences


class _FakeTokenizer:
    def apply_chat_template(self, messages, **kwargs):
        return {"input_ids": torch.tensor([[1, 2, 3]]), "attention_mask": torch.ones(1, 3, dtype=torch.long)}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


def test_speedup_comes_from_the_unstreamed_runs_not_the_live_one(monkeypatch):
    clock = _FakeClock()
    monkeypatch.setattr(demo_run.time, "perf_counter", clock)
    target = _FakeTarget(clock)
    pair = demo_run.ModelPair(target, _FakeTokenizer(), drafter=object(), description="fake")
    run = demo_run.DemoRun(pair, PROMPT, DemoSettings(max_new_tokens=8, compare=True))
    assert sum(1 for _ in run.stream()) == 3  # the prefill token, then two rounds
    run.compare_plain()
    stats = run.stats()
    assert stats["tokens_per_s"] == pytest.approx(0.8)  # live: 8 tokens in 10 s
    assert stats["plain"]["treespark_tokens_per_s"] == pytest.approx(8.0)  # 8 tokens in 1 s
    assert stats["plain"]["tokens_per_s"] == pytest.approx(4.0)  # 8 tokens in 2 s
    assert stats["plain"]["speedup"] == pytest.approx(2.0)
    assert target.calls == [{"assistant": True, "streamer": True}, {"assistant": True, "streamer": False},
                            {"assistant": False, "streamer": False}]
    assert stats["plain"]["identical"] is True  # plain decoding against the live run's answer
    assert "TreeSpark 8.0 vs plain 4.0 tokens/s" in render_stats(stats)


def test_package_imports_without_gradio():
    code = ("import sys, hf_treespark, hf_treespark.demo.page, hf_treespark.cli.commands; "
            "assert 'gradio' not in sys.modules, 'gradio imported eagerly'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_cli_demo_without_gradio_says_how_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "gradio", None)  # `import gradio` now raises ImportError
    assert treespark_main(["demo"]) == 2
    assert "pip install 'hf_treespark[demo]'" in capsys.readouterr().err


# ----- the running app ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def models():
    """The default pair as `treespark demo` loads it (on a CPU: packed linear layers), in float32."""
    from hf_treespark.hub.loading import load_pair

    return load_pair(dtype=torch.float32)


@pytest.fixture(scope="module")
def plain_greedy(models) -> list[int]:
    """The new token ids of plain greedy decoding for PROMPT."""
    from hf_treespark.hub import assets

    target, tokenizer, _ = models
    inputs = assets.chat_inputs(tokenizer, PROMPT)
    sequences = target.generate(**inputs, do_sample=False, max_new_tokens=MAX_NEW_TOKENS)
    return sequences[0, inputs["input_ids"].shape[1]:].tolist()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def app_url(models):
    pytest.importorskip("gradio", reason="the demo extra is not installed: pip install 'hf_treespark[demo]'")
    from hf_treespark.demo.page import build_app, launch

    target, tokenizer, drafter = models
    app = build_app(target, tokenizer, drafter)
    port = _free_port()
    launch(app, port=port, prevent_thread_lock=True, quiet=True)
    yield f"http://127.0.0.1:{port}/"
    app.close()


@pytest.fixture(scope="module")
def client(app_url):
    gradio_client = pytest.importorskip("gradio_client")
    return gradio_client.Client(app_url, verbose=False)


def _generate(client, prompt, max_new_tokens=MAX_NEW_TOKENS, budget=8, topk=4, chain=False, temperature=0.0,
              compare=True, lookup=None) -> dict:
    """The /generate endpoint's JSON result (its sixth output); `lookup` None: the 7-argument call."""
    args = (prompt, max_new_tokens, budget, topk, chain, temperature, compare)
    outputs = client.predict(*args, *(() if lookup is None else (lookup,)), api_name="/generate")
    return outputs[5]


@pytest.mark.slow
def test_api_with_lookup_branches_equals_plain_greedy_and_counts_lookup_tokens(client, plain_greedy):
    result = _generate(client, PROMPT, lookup=5)
    assert result["error"] is None and result["new_token_ids"] == plain_greedy
    assert result["lookup_tokens"] == sum(r["lookup_accepted"] for r in result["rounds"])


@pytest.mark.slow
def test_api_answer_equals_plain_greedy_with_per_round_data(client, models, plain_greedy):
    tokenizer = models[1]
    result = _generate(client, PROMPT)
    assert result["error"] is None and result["finished"]
    assert result["new_token_ids"] == plain_greedy
    assert result["text"] == tokenizer.decode(plain_greedy, skip_special_tokens=True)
    assert result["check"] == "identical to plain greedy" and result["plain"]["identical"] is True
    rounds = result["rounds"]
    assert len(rounds) == result["num_rounds"] > 0
    # The prefill forward commits the first token, each round the rest.
    assert 1 + sum(len(r["committed"]) for r in rounds) == len(result["new_token_ids"])
    assert [t for r in rounds for t in r["committed_ids"]] == plain_greedy[1:]
    # budget 8 for the drafter's nodes plus at most tree_lookup nodes from lookup branches and MAX_NODES from the
    # datastore, or a long lookup-only round; a round the drafter gate closed may verify the root alone (lookup.py)
    most = max(8 + models[2].config.tree_lookup + MAX_NODES, LOOKUP_LONG_TOKENS)
    assert all(0 <= r["tree_size"] <= most and 0 <= r["num_accepted"] <= r["tree_size"] for r in rounds)
    assert result["acceptance_length"] == pytest.approx(sum(len(r["committed"]) for r in rounds) / len(rounds))


@pytest.mark.slow
def test_api_bad_input_gets_a_readable_message_and_the_app_keeps_running(client):
    empty = client.predict("   ", 8, 8, 4, False, 0.0, False, api_name="/generate")
    assert empty[5] == {"error": "The prompt is empty: type a question or an instruction first."}
    assert "prompt is empty" in empty[6]
    for budget, max_new_tokens, expected in ((0, 8, "tree budget must be between 1 and 128, got 0."),
                                             (10**6, 8, "tree budget must be between 1 and 128, got 1e+06."),
                                             (8, 0, "max new tokens must be between 1 and 1024, got 0."),
                                             (8, "ten", "max new tokens must be a number between 1 and 1024, "
                                                        "got 'ten'.")):
        refused = client.predict("hi", max_new_tokens, budget, 4, False, 0.0, False, api_name="/generate")
        assert refused[5] == {"error": expected} and expected in refused[6]
    default_budget = _generate(client, "Say hi.", max_new_tokens=2, budget=None, compare=False)
    assert default_budget["error"] is None and default_budget["new_tokens"] == 2  # the drafter's own budget
    message = client.predict("", "/no/such/drafter", api_name="/load_models")
    assert "No TreeSpark drafter directory at '/no/such/drafter'" in message and "still using" in message
    message = client.predict("./no/such/target", "", api_name="/load_models")
    assert "No target model directory at './no/such/target'" in message
    short = _generate(client, "Say hi.", max_new_tokens=2, compare=False)  # still serving, same models
    assert short["error"] is None and short["new_tokens"] == 2
    assert [len(r["committed"]) for r in short["rounds"]] == [1]  # one round, cut to one token by the limit


def _screenshot_path(tmp_path: Path) -> Path:
    wanted = os.environ.get("HF_TREESPARK_DEMO_SCREENSHOT")
    if not wanted:
        return tmp_path / "demo.png"
    path = Path(wanted)
    return path if path.is_absolute() else REPO / path


@pytest.mark.slow
def test_browser_shows_round_bands_the_tree_and_the_greedy_check(app_url, models, plain_greedy, tmp_path):
    if os.environ.get("HF_TREESPARK_REQUIRE_BROWSER"):  # CI: a missing browser is a failure, not a skip
        assert shutil.which(CHROMIUM), f"no Chromium at {CHROMIUM}: apt-get install chromium"
    playwright = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the Python package)")
    if not shutil.which(CHROMIUM):
        pytest.skip(f"no Chromium at {CHROMIUM}: apt-get install chromium")
    tokenizer = models[1]
    with playwright.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(app_url)
            page.fill("#ts-prompt textarea", PROMPT)
            max_tokens = page.locator("#ts-max-new-tokens input[type=number]")
            max_tokens.fill(str(MAX_NEW_TOKENS))
            max_tokens.press("Enter")
            budget = page.locator("#ts-budget input[type=number]")  # the shipped default is "auto"
            if not SCREENSHOT:
                budget.fill("8")
                budget.press("Enter")
            page.click("#ts-generate")
            page.wait_for_selector(".ts-round", timeout=300_000)  # bands stream in, round by round
            page.wait_for_selector(".ts-tree-svg", timeout=600_000)  # the run finished: trees drawn
            page.wait_for_selector(".ts-check", timeout=600_000)  # the plain run finished: checked
            page.wait_for_timeout(1000)  # let the histogram settle
            path = _screenshot_path(tmp_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(path), full_page=True)

            answer = page.locator(".ts-answer").text_content()
            assert answer == tokenizer.decode(plain_greedy, skip_special_tokens=True)
            rounds = page.locator(".ts-round").count()
            assert rounds > 0 and page.locator(".ts-prefill").count() == 1
            assert page.locator(".ts-bonus").count() >= rounds - 1  # only the last round may be cut short
            assert "identical to plain greedy" in page.locator(".ts-check").text_content()
            assert page.locator(".ts-node.ts-root").count() == 1
            verified = page.locator(".ts-node.ts-packed, .ts-node.ts-accepted").count()
            # the tree budget, plus at most tree_lookup nodes that lookup branches add (lookup.py); or a lookup-only
            # round after one accepted whole, of up to LOOKUP_LONG_TOKENS nodes and nothing pruned
            long_lookup = verified > 8 + models[2].config.tree_lookup
            if not SCREENSHOT:
                assert 8 <= verified <= (LOOKUP_LONG_TOKENS if long_lookup else 8 + models[2].config.tree_lookup)
            if not SCREENSHOT and not long_lookup:  # the last round of a longer answer can be lookup-only
                assert page.locator(".ts-node.ts-pruned").count() > 0
            assert f"of {rounds}" in page.locator(".ts-tree-caption").text_content()
            assert page.locator("#ts-histogram canvas, #ts-histogram svg").count() > 0
            assert path.stat().st_size > 10_000
        finally:
            browser.close()
