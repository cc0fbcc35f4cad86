"""Every page in a real headless Chromium, on the store of a real smoke run: what each page must
show is checked in the DOM and in screenshots, and no trace content ever runs as script."""

from __future__ import annotations

import re

from browser import Browser, colors, hex_rgb
from synthetic import EVIL, SmokeRun

from harnessrl.traces import open_store
from harnessrl.view.serve import ViewerHandle

CONTEXT = hex_rgb("#cfd8dc")
HEAT = [hex_rgb(c) for c in ("#1a9850", "#66bd63", "#a6d96a", "#d9ef8b",
                             "#fee08b", "#fdae61", "#f46d43", "#d73027")]  # fmt: skip
BREAK_BORDER, DIFFER = hex_rgb("#ef6c00"), hex_rgb("#ffcc80")


def _base(viewer: ViewerHandle) -> str:
    return viewer.url.rstrip("/")


def _no_script_ran(browser: Browser) -> None:
    assert browser.eval("typeof window.__pwned") == "undefined"
    assert browser.eval("document.scripts.length") == 1  # our own view.js only
    assert browser.eval("document.querySelectorAll('img, iframe, object').length") == 0
    assert browser.eval("document.querySelectorAll('[onerror], [onload]').length") == 0


def test_train_prints_the_viewer_address_and_serves_it_while_it_runs(smoke: SmokeRun) -> None:
    assert re.search(r"^view: http://127\.0\.0\.1:\d+/$", smoke.stdout, re.M), smoke.stdout[-2000:]
    assert 'id="rollouts"' in smoke.live_page


def test_rollout_list_shows_the_runs(
    smoke: SmokeRun, viewer: ViewerHandle, browser: Browser
) -> None:
    with open_store(smoke.store_url, read_only=True) as store:
        ids = [r.rollout_id for r in store.rollouts()]
    assert len(ids) > 10
    browser.open(_base(viewer) + "/")
    shown = browser.eval("[...document.querySelectorAll('#rollouts tbody tr td:first-child a')]"
                         ".map(a => a.textContent)")  # fmt: skip
    assert shown == ids  # creation order, one page
    text = browser.text("#rollouts")
    assert "succeeded" in text and "policy versions" in text
    table = browser.screenshot("#rollouts")
    assert table.height >= 15 * len(ids)  # every row is drawn
    dark = sum(n for c, n in colors(table).items() if sum(c) < 200)
    assert dark > 20 * len(ids)  # and carries text
    # Filtering by step narrows it to that step's runs (train step 1 and the eval after it).
    browser.open(_base(viewer) + "/?step=1&phase=train")
    rows = browser.eval("document.querySelectorAll('#rollouts tbody tr').length")
    assert rows == len([i for i in ids if i.startswith("s0-")])


def test_rollout_page_shows_calls_and_never_runs_trace_script(
    viewer: ViewerHandle, browser: Browser, smoke: SmokeRun
) -> None:
    with open_store(smoke.store_url, read_only=True) as store:
        run = next(r for r in store.rollouts() if r.rollout_id.startswith("s0-"))
        calls = store.calls(run.rollout_id)
    browser.open(f"{_base(viewer)}/rollouts/{run.rollout_id}")
    _no_script_ran(browser)
    heads = browser.eval("[...document.querySelectorAll('section.call h3')].map(h => h.innerText)")
    assert len(heads) == len(calls) and all(
        f"call {c.seq}" in h for c, h in zip(calls, heads, strict=True)
    )
    assert "HTTP 200" in heads[0] and " ms" in heads[0] and "chat" in heads[0]
    text = browser.text("main")
    assert EVIL in text  # the markup is shown as the text it is
    assert calls[0].choices[0].text in text
    # Token ids come on demand: opening the box fetches them.
    browser.eval("document.querySelector('details.lazy').open = true")
    ids = browser.wait_for("document.querySelector('details.lazy #tokens')?.innerText")
    assert " ".join(map(str, calls[0].prompt_token_ids[:5])) in ids
    _no_script_ran(browser)


def test_sequence_view_colours_trained_and_untrained_tokens(
    viewer: ViewerHandle, browser: Browser, smoke: SmokeRun
) -> None:
    with open_store(smoke.store_url, read_only=True) as store:
        run = next(r for r in store.rollouts() if r.rollout_id.startswith("s0-"))
    browser.open(f"{_base(viewer)}/rollouts/{run.rollout_id}/sequences")
    _no_script_ran(browser)
    assert browser.eval("document.querySelectorAll('.seq .s').length") > 0
    assert browser.eval("document.querySelectorAll('.seq .c').length") > 0
    assert "advantage" in browser.text("main") and "weight" in browser.text("main")
    found = colors(browser.screenshot("#seq-0 .seq"))  # the tokens alone, not the legend
    assert found.get(CONTEXT, 0) > 200, "untrained tokens are not drawn in the context colour"
    trained = sum(found.get(c, 0) for c in HEAT)
    assert trained > 200, "trained tokens are not drawn in a heat colour"


def test_a_planted_merge_break_shows_its_cause(viewer: ViewerHandle, browser: Browser) -> None:
    browser.open(f"{_base(viewer)}/rollouts/planted-break/sequences")
    text = browser.text("#break-0")
    assert "call 1" in text and "position 5" in text and "history_rewritten" in text
    differ = browser.eval(
        "[...document.querySelectorAll('#break-0 td.differ')].map(t => t.textContent)"
    )
    assert differ[:2] == ["6", "77"]  # the diverging ids, side by side
    found = colors(browser.screenshot("#break-0"))
    assert found.get(BREAK_BORDER, 0) > 100 and found.get(DIFFER, 0) > 50
    assert browser.eval("document.querySelectorAll('section.sequence').length") == 2


def test_group_view_puts_the_runs_side_by_side(
    viewer: ViewerHandle, browser: Browser, smoke: SmokeRun
) -> None:
    with open_store(smoke.store_url, read_only=True) as store:
        group = next(r for r in store.rollouts() if r.rollout_id.startswith("s0-")).group_id
        runs = store.rollouts(group)
    browser.open(f"{_base(viewer)}/groups/{group}")
    boxes = browser.eval(
        "[...document.querySelectorAll('.run')].map(r => r.getBoundingClientRect())"
        ".map(b => [b.left, b.top])"
    )
    assert len(boxes) == len(runs) >= 2
    assert len({top for _, top in boxes}) == 1 and len({left for left, _ in boxes}) == len(runs)
    rewards = browser.eval("[...document.querySelectorAll('.run .reward')].map(d => d.textContent)")
    assert rewards == [f"{r.reward:.3f}" for r in runs]
    assert len(browser.eval("[...document.querySelectorAll('.run .advantage')]")) == len(runs)


def test_curves_are_drawn_as_svg(viewer: ViewerHandle, browser: Browser) -> None:
    browser.open(_base(viewer) + "/curves")
    titles = browser.eval("[...document.querySelectorAll('figcaption')].map(f => f.textContent)")
    assert titles[:2] == ["reward", "pass rate"] and "compiles" in titles
    assert browser.eval("document.querySelectorAll('svg.chart polyline').length") >= 6
    found = colors(browser.screenshot("figure.chart-panel"))
    assert found.get(hex_rgb("#1f77b4"), 0) > 30 and found.get(hex_rgb("#d62728"), 0) > 30


def test_bad_addresses_get_error_pages_in_the_browser(
    viewer: ViewerHandle, browser: Browser
) -> None:
    for path, status in (("/rollouts/nope", "404"), ("/no/such/page", "404"), ("/?step=x", "400")):
        browser.open(_base(viewer) + path)
        assert browser.text("#error").startswith(status), path
