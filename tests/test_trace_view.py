"""The trace waterfall page: static checks, then a real headless Chromium (DOM, console, screenshot)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from specrag.agent.trace import SpeculationCycle, Trace, Tracer
from specrag.agent.trace_view import KIND_COLOURS, acceptance_colour, render_waterfall

MS = 1_000_000
REPO = Path(__file__).resolve().parent.parent
SCREENSHOT = REPO / "docs" / "reports" / "trace_view.png"
CHROMIUM_TIMEOUT_S = 20


def realistic_trace(cycles: int = 40, with_decode: bool = True, tool_error: bool = True) -> Trace:
    """One agent run: retrieval, prompt, chat (prefill + decode with cycles), a failing tool, a second chat."""
    trace = Tracer().start_trace(attributes={"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "specrag"})
    t0 = trace.root.start_ns
    retrieval = trace.add_completed_span(
        "retrieval pydoc-topics",
        t0,
        t0 + 18 * MS,
        {"embed_ms": 11.2, "search_ms": 4.1, "top_k": 4, "specrag.passage_ids": ["topics#12", "topics#40"]},
    )
    trace.add_completed_span("embed", t0, t0 + 12 * MS, parent=retrieval)
    trace.add_completed_span("prompt_build", t0 + 18 * MS, t0 + 21 * MS, {"prompt_tokens": 812})
    chat_end = t0 + (21 + 60 + 3 * cycles) * MS
    chat = trace.add_completed_span(
        "chat qwen2.5-coder-0.5b",
        t0 + 21 * MS,
        chat_end,
        {
            "gen_ai.usage.input_tokens": 812,
            "gen_ai.usage.cache_read.input_tokens": 512,
            "gen_ai.usage.output_tokens": 97,
        },
    )
    trace.add_completed_span("prefill", t0 + 21 * MS, t0 + 81 * MS, {"uncached_tokens": 300}, parent=chat)
    if with_decode:
        decode = trace.add_completed_span("decode", t0 + 81 * MS, chat_end, parent=chat)
        for k in range(cycles):
            gamma = 0 if k % 13 == 12 else 4
            accepted = (k * 7) % (gamma + 1) if gamma else 0
            decode.add_cycle(
                SpeculationCycle(
                    t0 + (81 + 3 * k) * MS,
                    gamma=gamma,
                    accepted_len=accepted,
                    committed=accepted + 1,
                    duration_s=0.0028,
                    draft_s=0.0004,
                    verify_s=0.002,
                    accept_s=0.0001,
                    rollback_s=0.0003,
                )
            )
    tool_start = chat_end
    tool = trace.add_completed_span(
        "execute_tool search_documents",
        tool_start,
        tool_start + 9 * MS,
        {"gen_ai.tool.name": "search_documents", "specrag.tool.status": "error" if tool_error else "ok"},
    )
    if tool_error:
        tool.record_exception(TimeoutError("tool timed out after 5 s"))
    trace.add_completed_span("chat qwen2.5-coder-0.5b", tool_start + 9 * MS, tool_start + 30 * MS)
    trace.finish(end_ns=tool_start + 31 * MS)
    return trace


def count_bars(page: str) -> tuple[int, int]:
    return len(re.findall(r"<rect [^>]*data-span-id=", page)), len(re.findall(r"<rect [^>]*data-cycle=", page))


# --- static checks -------------------------------------------------------------------------------------


def test_page_has_a_bar_per_span_and_per_cycle_and_a_summary() -> None:
    data = realistic_trace().to_dict()
    page = render_waterfall(data)
    assert page.startswith("<!DOCTYPE html>")
    assert count_bars(page) == (len(data["spans"]), 40)
    assert page.count('class="bar kind-retrieval"') == 1
    assert page.count("kind-decode") >= 2 and page.count("kind-prefill") >= 2  # a bar and a CSS rule each
    assert "γ = 4 accepted" in page and "0 accepted" in page
    assert '<table class="summary">' in page and "share of the run" in page
    assert page.count('class="bar kind-tool error"') == 1 and "TimeoutError" in page


def test_page_is_self_contained() -> None:
    page = render_waterfall(realistic_trace().to_dict())
    for needle in ("http://", "https://", "src=", "href=", "url(", "@import", "<script", "<link", "<iframe"):
        assert needle not in page, needle


def test_text_from_the_trace_is_escaped() -> None:
    trace = Tracer().start_trace(name='invoke_agent <script>alert("x")</script>')
    with trace.span("execute_tool <img src=x onerror=alert(1)>", {"note": '"><script>alert(2)</script>'}):
        pass
    trace.finish()
    page = render_waterfall(trace.to_dict())
    assert "<script" not in page and "<img" not in page
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in page
    assert "&lt;img src=x onerror=alert(1)&gt;" in page


def test_trace_without_decode_span() -> None:
    data = realistic_trace(with_decode=False, tool_error=False).to_dict()
    page = render_waterfall(data)
    assert count_bars(page) == (len(data["spans"]), 0)
    assert "accepted" not in page and "speculation cycles</text>" not in page
    assert ' error"' not in page and "✖ " not in page  # no error class, no error marker on a label


def test_trace_with_500_cycles() -> None:
    data = realistic_trace(cycles=500).to_dict()
    page = render_waterfall(data)
    assert count_bars(page) == (len(data["spans"]), 500)
    assert "500 speculation cycles" in page


def test_open_and_degenerate_traces_render() -> None:
    open_trace = Tracer().start_trace()
    with open_trace.span("retrieval x"):
        page = render_waterfall(open_trace.to_dict())  # root still open: no end time yet
    assert count_bars(page) == (2, 0)
    empty = Tracer().start_trace()
    empty.finish(end_ns=empty.root.start_ns)  # zero duration
    assert count_bars(render_waterfall(empty.to_dict())) == (1, 0)


def test_acceptance_colour_scale() -> None:
    assert acceptance_colour(0, 4) == "#d73027" and acceptance_colour(4, 4) == "#1a9850"
    assert acceptance_colour(2, 4) == "#fee08b"
    assert acceptance_colour(0, 0) == "#9e9e9e"


# --- a real headless Chromium ----------------------------------------------------------------------------


def chromium_binary() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no chromium on PATH (install the Debian package `chromium`; .ci/run does when apt works)")


def run_chromium(page: Path, profile: Path, *args: str) -> tuple[str, str]:
    """Run headless Chromium on ``page``; return (stdout, stderr). Its console messages go to stderr."""
    cmd = [
        chromium_binary(),
        "--headless",
        "--no-sandbox",  # running as root in CI
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--no-default-browser-check",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        "--enable-logging=stderr",
        "--v=0",
        *args,
        page.as_uri(),
    ]
    # Its own session, so a hung browser and its helper processes die together.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=CHROMIUM_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"chromium did not finish within {CHROMIUM_TIMEOUT_S} s")
    assert proc.returncode == 0, err[-2000:]
    return out, err


def console_problems(stderr: str, page: Path) -> list[str]:
    """Console messages the page produced. The page has no script, so any message at all is a problem."""
    url = page.as_uri()
    return [line for line in stderr.splitlines() if ("CONSOLE" in line and url in line) or "Uncaught" in line]


@pytest.fixture
def page_file(tmp_path: Path) -> Path:
    path = tmp_path / "trace.html"
    path.write_text(render_waterfall(realistic_trace().to_dict()), encoding="utf-8")
    return path


def test_chromium_dom_has_every_bar_and_no_console_errors(page_file: Path, tmp_path: Path) -> None:
    dom, err = run_chromium(page_file, tmp_path / "profile", "--dump-dom")
    spans = len(realistic_trace().to_dict()["spans"])
    assert len(re.findall(r"<rect [^>]*data-span-id=", dom)) == spans
    assert len(re.findall(r"<rect [^>]*data-cycle=", dom)) == 40
    assert "share of the run" in dom
    assert console_problems(err, page_file) == []


def test_console_detector_catches_a_planted_error(page_file: Path, tmp_path: Path) -> None:
    planted = tmp_path / "planted.html"
    html = page_file.read_text(encoding="utf-8")
    planted.write_text(html.replace("</body>", "<script>throw new Error('planted')</script></body>"), encoding="utf-8")
    _, err = run_chromium(planted, tmp_path / "profile", "--dump-dom")
    problems = console_problems(err, planted)
    assert problems and any("Uncaught Error: planted" in p for p in problems), err[-3000:]


def test_chromium_screenshot_shows_the_waterfall(page_file: Path, tmp_path: Path) -> None:
    shot = tmp_path / "shot.png"
    _, err = run_chromium(page_file, tmp_path / "profile", f"--screenshot={shot}", "--window-size=1280,800")
    assert console_problems(err, page_file) == []
    assert shot.stat().st_size > 20_000, "screenshot too small to hold the waterfall"
    if os.environ.get("SPECRAG_UPDATE_SCREENSHOT") == "1":  # the README's copy; a plain run leaves the tree clean
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, SCREENSHOT)

    image_module = pytest.importorskip("PIL.Image", reason="Pillow not installed: colour checks skipped")
    with image_module.open(shot) as image:
        rgb = image.convert("RGB")
        assert rgb.size == (1280, 800)
        colours = {colour for _, colour in rgb.getcolors(maxcolors=1 << 20)}
    assert len(colours) > 50, "a near-blank screenshot"

    def rgb_of(hex_colour: str) -> tuple[int, int, int]:
        return tuple(int(hex_colour[i : i + 2], 16) for i in (1, 3, 5))  # type: ignore[return-value]

    for kind in ("retrieval", "prompt", "prefill", "decode", "tool"):
        assert rgb_of(KIND_COLOURS[kind]) in colours, f"no {kind} bar painted"
    assert rgb_of(acceptance_colour(4, 4)) in colours, "no fully accepted cycle painted"
    assert rgb_of(acceptance_colour(0, 4)) in colours, "no rejected cycle painted"
