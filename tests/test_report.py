"""The human reports: report.md content, and report.html rendered in headless Chromium."""

from __future__ import annotations

import copy
import json
import re
import shutil
import struct
import subprocess
import zlib
from html import unescape as unescape_html
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from specaudit.equivalence.reports.summary import summary_table
from specaudit.equivalence.pipeline.runner import exit_status
from specaudit.equivalence.reports.charts import NUMERICAL_COLOR, STRUCTURAL_COLOR, audit_charts, render_svg, series_color
from specaudit.equivalence.reports.markdown import render_markdown, write_reports
from specaudit.equivalence.reports.summary import run_status, verdict

CHROMIUM_INSTALL = "apt-get update && apt-get install -y chromium"
CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "chromium", "chromium-browser")
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-extensions", "--hide-scrollbars", "--mute-audio")
HOSTILE_TEXT = "<script>alert('x')</script> & \"quotes\""


def _structural_divergence() -> dict[str, Any]:
    return {
        "prompt_index": 3, "position": 17, "step": 5, "reference_token": 1203, "engine_token": 98,
        "margin": 2.3125, "kind": "structural", "detected_by": "tokens", "logit_error": 0.61,
        "evidence": {"replay_float64_margin": 2.3125, "replay_float64_top2": [[1203, 12.5], [98, 10.1875]],
                     "dtype_noise": 1e-12, "reason": "margin far above float64 noise"},
        "accepted_history": [3, 4, 0, 2, 1],
        "batch": {"kind": "batch", "rows": [0, 3, 5, 6], "pad_lengths": [0, 2, 7, 1]},
        "context": {"common": [412, 88, 19, 7], "reference": [1203, 55, 61], "engine": [98, 1203, 4]},
        "text": {"common": "the cat sat\non", "reference": " the mat | done\x1b[0m", "engine": HOSTILE_TEXT},
    }


def _numerical_divergence(prompt_index: int, position: int) -> dict[str, Any]:
    return {
        "prompt_index": prompt_index, "position": position, "step": None, "reference_token": 11,
        "engine_token": 12, "margin": 0.0039, "kind": "numerical", "detected_by": "tokens", "logit_error": None,
        "evidence": {"replay_float64_margin": 0.0011, "replay_float64_top2": [[11, 3.25], [12, 3.2489]],
                     "dtype_noise": 0.0156, "reason": "near-tie within bfloat16 noise, confirmed in float64"},
        "accepted_history": None, "batch": None,
        "context": {"common": [5, 6, 7], "reference": [11, 13], "engine": [12, 13]}, "text": None,
    }


def _run(engine: str, batch_size: int, dtype: str, **fields: Any) -> dict[str, Any]:
    run = {"engine": engine, "pair": "tiny-llama", "batch_size": batch_size, "dtype": dtype, "device": "cpu",
           "num_prompts": 8, "exact_matches": 8, "equivalent": True, "max_logit_error": 2e-16,
           "logit_tolerance": 1e-9, "seconds": 1.25, "tokens_generated": 256, "error": None,
           "trace": {"steps": 12, "step_kinds": {"prefill": 2, "batch": 10}, "acceptance_rate": 0.62,
                     "accepted_histogram": [5, 3, 4, 6, 12], "seconds": {"draft": 0.3, "verify": 0.6, "realign": 0.1}},
           "prompts": [], "divergences": []}
    run.update(fields)
    return run


@pytest.fixture
def audit() -> dict[str, Any]:
    return {
        "specaudit_version": "0.1.0", "created": "2025-01-01T12:00:00+00:00",
        "machine": {"python": "3.11.7", "platform": "Linux-6.1-x86_64", "processor": "x86_64", "torch": "2.13.0",
                    "transformers": "5.23.0", "device": "cpu", "device_name": None, "cuda": False},
        "config": {"engines": ["reference", "eqspec", "exspec", "bsp"], "pairs": ["tiny-llama"],
                   "batch_sizes": [1, 4], "dtypes": ["float64", "bfloat16"], "prompts": "builtin",
                   "num_prompts": 8, "max_new_tokens": 32, "draft_tokens": 4},
        "runs": [
            _run("reference", 1, "float64", trace=None),
            _run("eqspec", 1, "float64"),
            _run("eqspec", 4, "float64", exact_matches=7, equivalent=False, max_logit_error=0.61,
                 divergences=[_structural_divergence()]),
            _run("exspec", 4, "bfloat16", exact_matches=6, max_logit_error=None, logit_tolerance=None,
                 trace={"steps": 9, "step_kinds": {"prefill": 1, "group": 6, "fallback": 2}, "acceptance_rate": 0.4,
                        "accepted_histogram": [9, 6, 3, 2, 1], "seconds": {}},
                 divergences=[_numerical_divergence(1, 9), _numerical_divergence(4, 26)]),
            _run("bsp", 4, "float64", exact_matches=0, equivalent=False, trace=None, seconds=0.1,
                 error="Traceback (most recent call last):\n  File \"bsp.py\", line 3\nRuntimeError: shape <4, 7> mismatch"),
        ],
    }


def test_run_status_and_verdict(audit: dict[str, Any]) -> None:
    assert [run_status(run) for run in audit["runs"]] == ["exact", "exact", "structural", "numerical", "crashed"]
    status, sentence = verdict(audit)
    assert status == "fail" and sentence.startswith("NOT EQUIVALENT") and "1 run crashed" in sentence
    numerical_only = copy.deepcopy(audit)
    numerical_only["runs"] = [run for run in audit["runs"] if run_status(run) in ("exact", "numerical")]
    assert verdict(numerical_only)[0] == "numerical"
    assert verdict({"runs": []})[0] == "empty"


def test_markdown_report_content(audit: dict[str, Any]) -> None:
    markdown = render_markdown(audit)
    lines = markdown.splitlines()
    assert lines[0] == "# specaudit report"
    assert lines[2].startswith("**NOT EQUIVALENT")
    assert "torch 2.13.0" in markdown and "transformers 5.23.0" in markdown and "device cpu" in markdown
    table = [line for line in lines if line.startswith("| eqspec ") or line.startswith("| exspec ")
             or line.startswith("| bsp ") or line.startswith("| reference ")]
    assert len(table) == 5
    assert all(line.count("|") == 13 for line in table)
    assert "| eqspec | tiny-llama | 4 | float64 | 7/8 | 0.61 > 1.00e-09 | 62.0% | — | - | 1 | 0 | STRUCTURAL |" in markdown
    assert "| exspec | tiny-llama | 4 | bfloat16 | 6/8 | — | 40.0% | — | - | 0 | 2 | numerical flips only |" in markdown
    assert "| bsp | tiny-llama | 4 | float64 | — |" in markdown and "CRASHED |" in markdown
    assert "## Crashed runs" in markdown and "RuntimeError: shape <4, 7> mismatch" in markdown
    divergences = markdown[markdown.index("## Divergences"):]
    assert divergences.index("STRUCTURAL · eqspec") < divergences.index("NUMERICAL · exspec")
    assert "prompt 3, position 17, step 5" in divergences
    assert "accepted draft tokens per step: 3, 4, 0, 2, 1" in divergences
    assert "batch step, 4 rows: prompt 0 pad 0, prompt 3 pad 2 ◀, prompt 5 pad 7, prompt 6 pad 1" in divergences
    assert "2.312 (above the dtype noise 1.00e-12)" in divergences
    assert "float64 replay of the target: margin 2.312; top-2 1203 (12.5), 98 (10.1875)" in divergences
    assert "top-2 11 (3.25), 12 (3.2489)" in divergences
    assert "0.0039 (within the dtype noise 0.0156)" in divergences
    assert "`…the cat sat⏎on` | ` the mat \\| done\\x1b[0m` |" in divergences
    assert "| ids | `… 412 88 19 7` | `[1203] 55 61` | `[98] 1203 4` |" in divergences
    assert "accepted draft tokens per step: not traced" in divergences


def test_markdown_caps_divergences(audit: dict[str, Any]) -> None:
    many = copy.deepcopy(audit)
    many["runs"][3]["divergences"] = [_numerical_divergence(i % 8, i) for i in range(30)]
    markdown = render_markdown(many, divergence_limit=10)
    assert markdown.count("\n### ") == 10
    assert "21 more divergences left out" in markdown


def test_reports_tolerate_missing_optional_fields(tmp_path: Path) -> None:
    bare = {"runs": [{"engine": "x", "divergences": [{"kind": "structural"}]}, {"engine": "y", "error": "boom"}]}
    paths = write_reports(bare, tmp_path)
    assert paths["markdown"].read_text(encoding="utf-8").startswith("# specaudit report")
    assert "<svg" in paths["html"].read_text(encoding="utf-8")
    assert write_reports({}, tmp_path / "empty")["html"].exists()


def test_charts_show_the_audit(audit: dict[str, Any], tmp_path: Path) -> None:
    charts = audit_charts(audit)
    rate = charts["equivalence-rate"]
    finished = [run for run in audit["runs"] if not run.get("error")]
    engines = tuple(dict.fromkeys(f"{run['engine']} · {run['dtype']}" for run in finished))
    assert len({run["dtype"] for run in finished}) > 1  # so each category names its dtype
    assert rate.categories == engines and rate.percent
    assert [series.label for series in rate.series] == [f"batch {size}" for size in
                                                          sorted({run["batch_size"] for run in audit["runs"]
                                                                  if not run.get("error")})]
    positions = charts["divergence-positions"]
    assert positions.stacked and {series.label for series in positions.series} <= {"structural", "numerical"}
    counted = sum(v for series in positions.series for v in series.values)
    assert counted == sum(len(run.get("divergences") or []) for run in audit["runs"] if not run.get("error"))
    svg = render_svg(rate)
    assert "Equivalence rate by engine and batch size" in svg and all(engine in svg for engine in engines)
    drawn = re.findall(r'<g id="bar-([^"]+)"', svg)
    assert len(drawn) == sum(1 for series in rate.series for v in series.values if v == v and v > 0)
    paths = write_reports(audit, tmp_path)
    markdown = paths["markdown"].read_text(encoding="utf-8")
    for stem in charts:
        assert f"(charts/{stem}.svg)" in markdown and (tmp_path / "charts" / f"{stem}.svg").is_file()


LAYOUT_PROBE = """<script>
(function () {
  const charts = Array.from(document.querySelectorAll("svg.chart")).map(function (svg) {
    const box = svg.getBoundingClientRect();
    const bars = Array.from(svg.querySelectorAll('g[id^="bar-"]')).map(function (bar) {
      const size = bar.getBoundingClientRect();
      return [size.width, size.height];
    });
    return {label: svg.getAttribute("aria-label"), width: box.width, height: box.height, bars: bars};
  });
  const engineText = document.querySelector(".split.text .next.engine");
  const probe = document.createElement("pre");
  probe.id = "layout-probe";
  probe.textContent = JSON.stringify({charts: charts, scripts: document.scripts.length,
                                      engineText: engineText ? engineText.textContent : null});
  document.body.appendChild(probe);
})();
</script>"""


def _chromium() -> str:
    for candidate in CHROMIUM_CANDIDATES:
        found = shutil.which(candidate)
        if found:
            return found
    pytest.fail(f"headless Chromium is needed to check report.html and was not found; install it with: "
                f"{CHROMIUM_INSTALL}", pytrace=False)


def _run_chromium(profile: Path, *arguments: str, window: str = "1280,2600") -> subprocess.CompletedProcess[str]:
    command = [_chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={window}", *arguments]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, f"chromium failed ({result.returncode}): {result.stderr[-2000:]}"
    return result


def _png_pixels(data: bytes) -> np.ndarray:
    """RGB(A) pixels of an 8-bit, non-interlaced PNG: [height, width, channels]."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    offset, compressed, header = 8, [], None
    while offset < len(data):
        (length,) = struct.unpack(">I", data[offset:offset + 4])
        kind, body = data[offset + 4:offset + 8], data[offset + 8:offset + 8 + length]
        offset += 12 + length
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            compressed.append(body)
    assert header is not None, "PNG without IHDR"
    width, height, depth, color_type, _, _, interlace = header
    assert depth == 8 and interlace == 0 and color_type in (2, 6), f"unsupported PNG layout {header}"
    channels = 3 if color_type == 2 else 4
    stride = width * channels
    filtered = np.frombuffer(zlib.decompress(b"".join(compressed)), np.uint8).reshape(height, stride + 1)
    pixels = np.zeros((height, stride), np.uint8)
    above = np.zeros(stride, np.int64)
    for y in range(height):
        kind, line = int(filtered[y, 0]), filtered[y, 1:].astype(np.int64)
        if kind == 0:
            row = line
        elif kind == 1:
            row = line.reshape(width, channels).cumsum(axis=0).reshape(-1) % 256
        elif kind == 2:
            row = (line + above) % 256
        else:
            up, current, out = above.tolist(), line.tolist(), [0] * stride
            for i in range(stride):
                left = out[i - channels] if i >= channels else 0
                if kind == 3:
                    predictor = (left + up[i]) // 2
                else:
                    upper_left = up[i - channels] if i >= channels else 0
                    estimate = left + up[i] - upper_left
                    distances = (abs(estimate - left), abs(estimate - up[i]), abs(estimate - upper_left))
                    predictor = (left if distances[0] <= distances[1] and distances[0] <= distances[2]
                                 else up[i] if distances[1] <= distances[2] else upper_left)
                out[i] = (current[i] + predictor) & 255
            row = np.array(out, np.int64)
        pixels[y] = row
        above = row
    return pixels.reshape(height, width, channels)


def _rgb(color: str) -> tuple[int, int, int]:
    return int(color[1:3], 16), int(color[3:5], 16), int(color[5:7], 16)


@pytest.mark.browser
def test_html_report_renders_in_headless_chromium(audit: dict[str, Any], tmp_path: Path) -> None:
    html_path = write_reports(audit, tmp_path / "report")["html"]
    html = html_path.read_text(encoding="utf-8")
    for external in ("<script", "<link", "src=", "@import"):
        assert external not in html, f"report.html is not self-contained: found {external!r}"
    # the charts' clip paths point inside the page (url(#id)); namespaces name the SVG spec, nothing to fetch
    assert not re.findall(r"url\((?!#)", html), "report.html refers to an outside resource"
    outside = set(re.findall(r"https?://[^\s\"'<>]+", html)) - {"http://www.w3.org/2000/svg", "http://www.w3.org/1999/xlink"}
    assert not outside, f"report.html is not self-contained: {sorted(outside)}"
    assert html.count("<svg") == 4

    probe_path = tmp_path / "report" / "layout-probe.html"
    probe_path.write_text(html.replace("</body>", LAYOUT_PROBE + "</body>"), encoding="utf-8")
    dumped = _run_chromium(tmp_path / "profile", "--dump-dom", probe_path.as_uri()).stdout
    assert dumped.count("<svg") == 4, "the four plots are not in the rendered DOM"
    assert len(re.findall(r'<g id="bar-', dumped)) >= 10
    assert "<script>alert" not in dumped and "&lt;script&gt;alert" in dumped
    assert "RuntimeError: shape &lt;4, 7&gt; mismatch" in dumped
    match = re.search(r'<pre id="layout-probe">(.*?)</pre>', dumped, re.S)
    assert match, "the layout probe did not run"
    layout = json.loads(unescape_html(match.group(1)))
    assert layout["scripts"] == 1, "report.html put a script element into the page"
    assert layout["engineText"] == HOSTILE_TEXT
    charts = {chart["label"]: chart for chart in layout["charts"]}
    assert set(charts) == {"Equivalence rate by engine and batch size", "Where in the output divergences start",
                           "Accepted draft tokens per step and row",
                           "Acceptance per draft position: expected against observed"}
    expected_bars = {"Equivalence rate by engine and batch size": 4, "Where in the output divergences start": 3,
                     "Accepted draft tokens per step and row": 10,
                     # the fixture's runs predate the acceptance record: the chart says so, with no bar
                     "Acceptance per draft position: expected against observed": 0}
    for label, chart in charts.items():
        assert chart["width"] > 300 and chart["height"] > 100, f"{label} laid out at {chart['width']}x{chart['height']}"
        assert len(chart["bars"]) == expected_bars[label], f"{label}: {len(chart['bars'])} bars"
        assert all(width > 0 and height > 0 for width, height in chart["bars"]), f"{label} has an empty bar"

    screenshot = tmp_path / "report.png"
    _run_chromium(tmp_path / "profile", f"--screenshot={screenshot}", html_path.as_uri(), window="1280,1400")
    assert screenshot.exists() and screenshot.stat().st_size > 10_000, "no screenshot"
    pixels = _png_pixels(screenshot.read_bytes())[..., :3].reshape(-1, 3)
    colors, counts = np.unique(pixels, axis=0, return_counts=True)
    assert len(colors) > 100 and counts.max() < 0.95 * len(pixels), "the screenshot is blank"
    for color in (STRUCTURAL_COLOR, NUMERICAL_COLOR, series_color(0), series_color(1)):
        painted = int((pixels == np.array(_rgb(color), np.uint8)).all(axis=1).sum())
        assert painted > 200, f"bars in {color} were not painted ({painted} pixels)"


def test_reports_lead_with_the_diagnosis(audit: dict[str, Any], tmp_path: Path) -> None:
    diagnosed = copy.deepcopy(audit)
    run = diagnosed["runs"][2]
    first = _structural_divergence()
    first["diagnosis"] = {"class": "pad_as_content", "evidence": "re-run with pad id 7, the prompt is exact",
                          "tried": ["re-run alone with pad id 7 instead of 0: exact"]}
    second = {**_structural_divergence(), "prompt_index": 5,
              "diagnosis": {"class": "pad_as_content", "evidence": "second", "tried": []}}
    third = {**_structural_divergence(), "prompt_index": 6,
             "diagnosis": {"class": "stop_eos", "evidence": "tokens after EOS", "tried": []}}
    run["divergences"] = [first, second, third]
    run["adversarial"] = {"first_index": 3, "skipped": [],
                          "cases": [{"prompt_index": 3, "case": "pad-inside", "length": 10, "why": "pad id inside"}]}
    markdown = render_markdown(diagnosed)
    lines = markdown.splitlines()
    # right after the verdict: one line per class, most frequent first, with count, share of the structural
    # divergences, what decided them, example and fix
    assert lines[4] == "## Diagnosis"
    rows = [line for line in lines if line.startswith("| **")]
    assert rows[0].startswith("| **pad_as_content** | 2 | 67% | not recorded (2) | eqspec · tiny-llama · batch 4 · "
                              "float64: prompt 3, new token 17")
    assert "adversarial prompt `pad-inside`: pad id inside" in rows[0] and "never by token value" in rows[0]
    assert rows[1].startswith("| **stop_eos** | 1 | 33% |")
    assert "**diagnosis: pad_as_content**: re-run with pad id 7" in markdown
    html = write_reports(diagnosed, tmp_path)["html"].read_text()
    assert html.index('<table class="diagnosis">') < html.index('<table class="runs">')
    assert "<strong>pad_as_content</strong>" in html and "tokens after EOS" in html


def test_summary_table_keeps_columns_apart_for_long_names() -> None:
    long_engine = "a_rather_long_module_name_for_the_summary_table_check:factory"
    runs = [{"engine": engine, "pair": pair, "batch_size": size, "dtype": "float64", "exact_matches": 4,
             "num_prompts": 4, "max_logit_error": 0.0, "equivalent": True}
            for engine, pair, size in ((long_engine, "tiny-llama", 4), ("eqspec", "tiny-gpt2", 16),
                                       ("vllm:http://127.0.0.1:18500", "a-pair-named-at-length-by-a-user/target", 1))]
    lines = summary_table({"runs": runs}).splitlines()
    starts = {line.index(pair) for line, pair in zip(lines[1:], ("tiny-llama", "tiny-gpt2", "a-pair-named"))}
    assert len(starts) == 1 and lines[0].index("pair") == starts.pop()  # one column, under its heading
    for line in lines[1:]:
        engine_cell, _, rest = line.partition("  ")
        assert rest.startswith(" ") or rest[:1].isalnum(), line  # two spaces at least between engine and pair
        assert len(engine_cell) <= 40
    assert lines[1].startswith("a_rather_long_module") and "…" in lines[1] and ":factory" in lines[1]


def _sampled_audit() -> dict[str, Any]:
    """A sampled audit's `audit.json` as equivalence/sampling/cli.py writes it: one engine judged, one failed."""
    histogram = [9, 7, 6, 5, 5, 4, 4, 3, 3, 3, 2, 2, 2, 1, 1, 1, 1, 1, 0, 0]  # piled left: too sharp
    # the per-position tests: the departure grows with the position (a fault of later tokens of a step)
    positions = [{"test": "chi_square_pit", "scope": f"output position {j}", "p_value": 0.5 / (j + 1), "n": 20,
                  "bins": 4, "tv_observed": 0.1 + 0.1 * j, "tv_null": 0.1, "tv_excess": 0.1 * j} for j in range(3)]
    judged = {"verdict": "departure", "p_value": 3.2e-7, "worst_test": "all tokens (chi_square_pit)",
              "finding": "all tokens: sharper than the target (too much mass on its likely tokens)",
              "detectable_tv_pooled": 0.125, "detectable_tv_first_token": 0.186, "power": 0.8, "samples": 20,
              "tokens": sum(histogram), "pit_histogram": histogram, "tests": positions, "effect_tv": 0.2,
              "rounding": {"dtype": "bfloat16", "device": "cuda:0", "factor": 2.0, "allowance_tv_mean": 0.037,
                           "allowance_tv_max": 0.15, "cut_tokens": 2},
              "seeds": {"checked": True, "same_seed_same_output": True, "alone_equals_batch": True}}
    base = {"mode": "sampled", "pair": "tiny-llama", "batch_size": 8, "dtype": "bfloat16", "device": "cuda:0",
            "num_prompts": 4}
    runs = [{"engine": "sampled-spec", **base, "verdict": "departure", "equivalent": False, "seconds": 3.0,
             "sampled": judged},
            {"engine": "mine:hangs", **base, "verdict": "run failed", "equivalent": False, "failed": True,
             "seconds": 2.0, "traceback": "...",
             "error": f"engine mine:hangs failed: generate() did not return within 2 s (--timeout) {HOSTILE_TEXT}"}]
    return {"specaudit_version": "0.3.0", "created": "2026-01-01T00:00:00+00:00",
            "machine": {"python": "3.11", "torch": "2.13.0", "transformers": "5.24.0", "device": "cuda:0",
                        "device_name": "NVIDIA H200", "cuda": True},
            "config": {"mode": "sampled", "engines": ["sampled-spec", "mine:hangs"], "pairs": ["tiny-llama"],
                       "batch_sizes": [8], "dtypes": ["bfloat16"], "device": "cuda:0", "max_new_tokens": 3,
                       "timeout": 2.0, "sampling": {"temperature": 0.7, "top_k": 8, "top_p": 1.0}, "seed": 1,
                       "samples": 20, "alpha": 0.01, "teacher_forcing": {"device": "cpu", "dtype": "float64"}},
            "complete": True, "runs": runs}


@pytest.mark.browser
def test_sampled_report_renders_in_headless_chromium(tmp_path: Path) -> None:
    sampled = _sampled_audit()
    paths = write_reports(sampled, tmp_path / "report")
    markdown = paths["markdown"].read_text(encoding="utf-8")
    assert "NOT shown to sample the target's distribution: sampled-spec, mine:hangs" in markdown
    assert "sampled-spec departs from the target's distribution in 20 samples (60 tokens): p = 3.2e-07" in markdown
    assert "mine:hangs: the run failed: engine mine:hangs failed: generate() did not return within 2 s" in markdown
    assert "dtypes: bfloat16" in markdown and "teacher forcing: cpu float64" in markdown
    assert "NVIDIA H200" in markdown and "(charts/sampled-pit.svg)" in markdown
    assert "(charts/sampled-positions.svg)" in markdown and "## Runs" not in markdown  # no greedy section
    html = paths["html"].read_text(encoding="utf-8")
    for external in ("<script", "<link", "src=", "@import"):
        assert external not in html, f"report.html is not self-contained: found {external!r}"
    assert html.count("<svg") == 2

    probe_path = tmp_path / "report" / "layout-probe.html"
    probe_path.write_text(html.replace("</body>", LAYOUT_PROBE + "</body>"), encoding="utf-8")
    dumped = _run_chromium(tmp_path / "profile", "--dump-dom", probe_path.as_uri()).stdout
    assert "<script>alert" not in dumped and "&lt;script&gt;alert" in dumped
    match = re.search(r'<pre id="layout-probe">(.*?)</pre>', dumped, re.S)
    assert match, "the layout probe did not run"
    pit, by_position = json.loads(unescape_html(match.group(1)))["charts"]
    assert pit["label"].startswith("PIT histogram of the sampled tokens")
    assert by_position["label"].startswith("Departure per output position")
    for chart in (pit, by_position):
        assert chart["width"] > 300 and chart["height"] > 100, f"laid out at {chart['width']}x{chart['height']}"
    assert len(pit["bars"]) == 18 and all(width > 0 and height > 0 for width, height in pit["bars"])
    assert len(by_position["bars"]) == 2  # positions 1 and 2 depart; position 0 has no excess, no bar
    screenshot = tmp_path / "report.png"
    _run_chromium(tmp_path / "profile", f"--screenshot={screenshot}", paths["html"].as_uri(), window="1280,2200")
    pixels = _png_pixels(screenshot.read_bytes())[..., :3].reshape(-1, 3)
    painted = int((pixels == np.array(_rgb(series_color(0)), np.uint8)).all(axis=1).sum())
    assert painted > 200, f"the histogram's bars were not painted ({painted} pixels)"


def test_greedy_and_sampled_runs_in_one_audit_share_the_report(audit: dict[str, Any], tmp_path: Path) -> None:
    """One audit.json with greedy and sampled runs: each section reads its own runs, the verdict both, the
    exit status every run, and the terminal table the greedy runs with a line per sampled one."""
    sampled = _sampled_audit()
    mixed = {**audit, "runs": [*audit["runs"], *sampled["runs"]], "config": {**audit["config"], **{
        k: v for k, v in sampled["config"].items() if k in ("sampling", "samples", "seed", "alpha", "teacher_forcing")}}}
    paths = write_reports(mixed, tmp_path)
    markdown = paths["markdown"].read_text(encoding="utf-8")
    greedy_only = render_markdown(audit)
    assert "## Runs" in markdown and "## Sampled runs" in markdown
    assert markdown.count("sampled-spec") >= 2 and "Sampled runs: NOT shown to sample" in markdown
    assert markdown.split("\n")[2].startswith(greedy_only.split("\n")[2].rstrip("*"))  # greedy verdict, then sampled
    assert exit_status(mixed) == 1 and exit_status({**mixed, "runs": audit["runs"]}) == exit_status(audit)
    table = summary_table(mixed)
    assert table.startswith(summary_table(audit)) and "mine:hangs: run failed" in table.splitlines()[-1]
    html = paths["html"].read_text(encoding="utf-8")
    assert html.count("<svg") == len(audit_charts(audit)) + 2


def test_a_chart_whose_labels_outgrow_the_figure_is_drawn_whole_without_a_warning() -> None:
    """Many long engine and pair names: matplotlib's tight layout gives up (with a warning a user would see on
    every audit); the saved figure grows to its labels instead."""
    import warnings

    from specaudit.equivalence.reports.charts import BarChart, Series

    names = tuple(f"package.module_{i}:engine_factory_with_a_long_name tiny-pair-{i} B=16 bfloat16" for i in range(24))
    chart = BarChart("exact prompts", "run", "share", names, (
        Series("structural", tuple(0.5 for _ in names), STRUCTURAL_COLOR),
        Series("numerical", tuple(0.25 for _ in names), NUMERICAL_COLOR)), stacked=True, percent=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        svg = render_svg(chart)
    assert svg.startswith("<svg") and names[0].split()[0] in svg and names[-1].split()[0] in svg
