"""metrics.json from records (no model): per-request latency, intervals and n on acceptance, the acceptance
rate, flagged rows with the acceptance without them, the breakdowns; and the table / W&B keys built from it."""

from __future__ import annotations

import numpy as np
import pytest

from eval import aggregate, breakdown, quality, report
from mtp.decode.metrics import SpecMetrics
from mtp.stats import wilson

LOOP = [7, 8, 9] * 10  # 30 tokens, period 3 (`winfo_winfo_...`)


def _record(i: int, hist: list[int], tokens: list[int], category: str = "chat", verify: str = "strict",
            ttft: float = 0.04, steps=None, prompt_tokens: int = 20) -> dict:
    """One prompt in a batch of its own, as eval/run.py writes it."""
    k = len(hist) - 1
    m = SpecMetrics(k=k, verify=verify, accepted_hist=list(hist), row_steps=sum(hist), n_rows=1,
                    new_tokens=len(tokens), time_decode_s=0.5, ttft_s_rows=[ttft], tpot_s_rows=[0.01 * (i + 1)])
    return {"id": f"p{i}", "category": category, "batch": f"b{i:05d}", "thinking": False, "tokens": tokens,
            "output": "", "answer": None, "finish_reason": "length", "prompt_tokens": prompt_tokens,
            "row_accepted_hist": list(hist), "batch_metrics": m.raw(), "batch_wall_s": 1.0,
            "steps": steps if steps is not None else [[j, 0, "answer"] for j in range(sum(hist))]}


def _varied(n: int = 8) -> list[dict]:
    rng = np.random.default_rng(0)
    return [_record(i, [int(x) for x in rng.integers(1, 9, size=3)], list(range(100 + i, 140 + i)),
                    ttft=0.04 + 0.001 * i) for i in range(n)]


def test_latency_is_per_request_with_percentiles():
    """8 requests of ~40 ms each: metrics.json says ~40 ms per request (the old sum said 0.34 s)."""
    recs = _varied()
    m = aggregate.metrics_json({"verify": "strict"}, recs, None, False)
    ttft = [0.04 + 0.001 * i for i in range(8)]
    o = m["overall"]
    assert o["speed/ttft_mean_s"] == pytest.approx(np.mean(ttft)) and o["count/requests"] == 8
    for q in (50, 90, 99):
        assert o[f"speed/ttft_p{q}_s"] == pytest.approx(np.percentile(ttft, q))
        assert o[f"speed/tpot_p{q}_s"] == pytest.approx(np.percentile([0.01 * (i + 1) for i in range(8)], q))
    assert "speed/ttft_s" not in o
    con = report.console()
    with con.capture() as cap:
        con.print(report.latency_table(m))
    text = cap.get()
    ms = [o[f"speed/ttft_{q}_s"] * 1e3 for q in ("mean", "p50", "p90", "p99")]
    assert f"{ms[0]:.1f} {ms[1]:.1f}/{ms[2]:.1f}/{ms[3]:.1f}" in text and "TPOT" in text


def test_acceptance_has_n_intervals_and_the_rate():
    recs = _varied()
    m = aggregate.metrics_json({"verify": "strict"}, recs, None, False)
    o = m["overall"]
    total = np.sum([r["row_accepted_hist"] for r in recs], 0)
    assert o["accept/rate"] == pytest.approx((total[1] + 2 * total[2]) / (2 * total.sum()))
    assert o["count/prompts_with_steps"] == 8 and o["count/row_steps"] == total.sum()
    for key in ("accept/mean_len", "accept/rate", "accept/pos_1", "accept/pos_2", "accept/cond_pos_2"):
        assert o[f"{key}_lo"] < o[key] < o[f"{key}_hi"], key
    p1 = m["per_position"][0]
    assert p1["accept_lo"] == o["accept/pos_1_lo"] and p1["steps"] == total.sum() and p1["prompts"] == 8
    text = _table_text(m)
    assert f"({o['accept/mean_len_lo']:.2f}-{o['accept/mean_len_hi']:.2f})" in text and "rate" in text


def test_loops_are_flagged_and_acceptance_is_given_without_them():
    """The default run's case: 3 of 8 outputs loop. They are flagged (table, metrics.json) and the acceptance
    of the other 5 is reported beside the full one."""
    recs = _varied()
    for i in (1, 4, 6):
        recs[i]["tokens"] = [3, 4] + LOOP
        recs[i]["row_accepted_hist"] = [0, 0, 10]
    m = aggregate.metrics_json({"verify": "strict"}, recs, None, False)
    assert m["flagged"]["ids"] == ["p1", "p4", "p6"] and m["flagged"]["reasons"]["p1"] == ["loop (period 3)"]
    o = m["overall"]
    assert o["quality/flagged_rows"] == 3 and o["count/unflagged_prompts"] == 5
    clean = np.sum([r["row_accepted_hist"] for i, r in enumerate(recs) if i not in (1, 4, 6)], 0)
    assert o["accept_unflagged/mean_len"] == pytest.approx(1 + (clean[1] + 2 * clean[2]) / clean.sum())
    assert m["per_category"]["chat"]["quality/flagged_rows"] == 3
    assert "flagged" in _table_text(m)
    lines = report.flagged_lines(m)
    assert "flagged rows: 3 of 8" in lines[0] and "p1: loop (period 3)" in lines[0]
    assert f"AL {o['accept_unflagged/mean_len']:.2f}" in lines[1]


def test_relaxed_rows_at_the_al_ceiling_are_flagged():
    """`draft.k=3 verify=relaxed`: AL 4.00, every draft accepted. Flagged even without a loop in the tail; the
    same row under strict (lossless) is not."""
    r = _record(0, [0, 0, 0, 9], list(range(200, 236)), verify="relaxed")
    assert quality.flags(r, "relaxed") == ["accepted everything (rate 1.00)"]
    assert quality.flags(r, "strict") == []
    m = aggregate.metrics_json({"verify": "relaxed"}, [r], None, False)
    assert m["flagged"]["count"] == 1 and "count/unflagged_prompts" not in m["overall"]
    assert "every row is flagged" in report.flagged_lines(m)[1]


@pytest.mark.parametrize("tokens, period", [
    (LOOP, 3), ([1, 2] + [5] * 20, 1), ([9] + [1, 2, 3, 4] * 5, 4),
    (list(range(40)), None), ([1, 2, 3] * 3, None),  # three repeats of a short line: not a loop
    ([5] * 10, None),  # too short to say (the degenerate check covers it)
])
def test_loop_period(tokens, period):
    assert quality.loop_period(tokens) == period


# outputs of `mtp-eval draft=vanilla draft.k=3 verify=relaxed thinking=true dataset.per_category=1` (bundled model)
SQLITE = [1697, 1276, 309, 20, 309, 69, 89, 87, 346, 273, 25, 20, 309, 69, 89, 87, 346, 273, 25, 20, 309, 69, 89, 87,
          346, 273, 25, 20, 89, 87, 346, 273]  # 'Module `test.test_sqlite3.test_sqlite3.test_sqlite3.sqlite'
IMPORTLIB = [1697, 1276, 309, 20, 309, 69, 615, 650, 20, 309, 69, 615, 650, 20, 309, 69, 615, 650, 20, 309, 69, 615,
             650, 20, 615, 69, 684, 14, 272, 20, 309, 69]


@pytest.mark.parametrize("tokens, flagged", [(SQLITE, True), (IMPORTLIB, True), (list(range(64)), False),
                                             ([1, 2, 3] * 3 + list(range(10, 40)), False)])
def test_loops_with_variations_are_flagged(tokens, flagged):
    """No exact period in these tails, but they are made of their own repeats."""
    assert quality.loop_period(tokens) is None
    r = _record(0, [5, 2, 1], tokens)
    assert bool(quality.flags(r, "strict")) == flagged
    if flagged:
        assert quality.flags(r, "strict")[0].startswith("repeated 3-grams (")


def test_breakdown_by_phase_position_and_context():
    """Steps grouped by the phase of the text so far, the output position and the context length, each group
    with its prompts, steps, AL and interval; relaxed accepts shown under thinking only."""
    recs = []
    for i in range(6):
        steps = [[0, 2, "thinking"], [3, 2, "thinking"], [6, 0, "answer"], [7, 1, "answer"], [20, 0, "tool_call"]]
        recs.append(_record(i, [2, 1, 2], list(range(30)), steps=steps, prompt_tokens=100 + 10 * i))
    bd = breakdown.breakdown(recs, relaxed_only=5)
    ph = bd["phase"]
    assert list(ph) == ["thinking", "answer", "tool_call"]
    assert ph["thinking"]["accept/mean_len"] == 3.0 and ph["thinking"]["count/row_steps"] == 12
    assert ph["answer"]["accept/mean_len"] == 1.5 and ph["tool_call"]["accept/mean_len"] == 1.0
    assert ph["thinking"]["accept/relaxed_only"] == 5 and ph["answer"]["accept/relaxed_only"] == 0
    assert list(bd["output_pos"]) == ["0-15", "16-63"] and bd["output_pos"]["16-63"]["count/row_steps"] == 6
    # prompts of 100..150 tokens, steps at 0..20: below 128 for the prompts of 100-120, at 128+ (the step at
    # 20, or all) for those of 110-150
    assert bd["context"]["0-127"]["count/prompts"] == 3 and bd["context"]["128-511"]["count/prompts"] == 5
    assert ph["answer"]["accept/mean_len_lo"] == ph["answer"]["accept/mean_len_hi"] == 1.5  # no spread
    flat = breakdown.flat(bd)
    assert flat["breakdown/phase/thinking/accept/mean_len"] == 3.0
    m = aggregate.metrics_json({"verify": "relaxed"}, recs, None, False)
    assert m["breakdown"]["phase"]["thinking"]["accept/relaxed_only"] == m["overall"]["accept/relaxed_only"]


@pytest.fixture(scope="module")
def tok():
    from mtp.checkpoint.tiny import default_checkpoint
    from mtp.text.tokenizer import Tokenizer

    return Tokenizer.from_dir(default_checkpoint())


def test_phase_of_each_step_from_the_tokens(tok):
    """thinking until </think>, answer after it, tool_call from the DSML block on."""
    from mtp.text.dsml import CALLS_OPEN

    think = tok.encode("let me see")
    answer = tok.encode("It is sunny.")
    calls = tok.encode(CALLS_OPEN + ">\n")
    tokens = think + [tok.end_think_id] + answer + calls
    steps = [[0, 1], [len(think), 0], [len(think) + 1, 2], [len(tokens) - 1, 0]]
    got = [s[2] for s in breakdown.phase_steps(tok, True, tokens, steps)]
    assert got == ["thinking", "thinking", "answer", "tool_call"]
    assert [s[2] for s in breakdown.phase_steps(tok, False, answer, [[0, 1]])] == ["answer"]


def test_step_log_from_events():
    from mtp.decode.engine import StepEvent

    log = breakdown.StepLog(2)
    for ev in (StepEvent([[5], [6]], [0, 0]), StepEvent([[1, 2, 3], []], [2, 0]), StepEvent([[4], [7, 8]], [0, 1])):
        log(ev)
    assert log.rows == [[[1, 2], [4, 0]], [[1, 1]]]
    assert log.hists(2) == [[1, 0, 1], [0, 1, 0]]


def _table_text(m: dict) -> str:
    con = report.console()
    with con.capture() as cap:
        con.print(report.acceptance_table(m, "t"))
    return cap.get()


def test_sweep_summary_rows_carry_latency_percentiles_intervals_and_flags(tmp_path, capsys):
    import json

    from eval import summary

    recs = _varied()
    recs[2]["tokens"] = LOOP
    for job, k in (("0", 2), ("1", 2)):
        m = aggregate.metrics_json({"verify": "strict", "k": k, "draft": "eagle"}, recs, None, False)
        (tmp_path / job).mkdir()
        (tmp_path / job / "metrics.json").write_text(json.dumps(m))
    rows = summary.collect(tmp_path)
    o = m["overall"]
    r = rows[0]
    assert r["ttft_p99_s"] == o["speed/ttft_p99_s"] and r["tpot_mean_s"] == o["speed/tpot_mean_s"]
    assert r["accept/mean_len_lo"] == o["accept/mean_len_lo"] and r["accept/rate"] == o["accept/rate"]
    assert r["flagged"] == 1 and r["accept_unflagged/mean_len"] == o["accept_unflagged/mean_len"]
    summary.print_table(rows, "sweep")
    out = capsys.readouterr().out
    assert "TTFT ms" in out and f"{o['speed/ttft_mean_s'] * 1e3:.1f} {o['speed/ttft_p50_s'] * 1e3:.1f}/" in out
    assert f"({o['accept/mean_len_lo']:.2f}-{o['accept/mean_len_hi']:.2f})" in out and "AL unflagged" in out


def test_plots_draw_the_intervals_as_error_bars(tmp_path):
    import matplotlib.pyplot as plt
    from matplotlib.container import ErrorbarContainer

    from eval import plots

    recs = []
    for i in range(6):
        steps = [[0, i % 3, "thinking"], [3, 2, "answer"], [20, 0, "answer"]]
        recs.append(_record(i, [1 + i % 2, 1, 1], list(range(30)), steps=steps))
    m = aggregate.metrics_json({"verify": "strict", "k": 2, "draft": "eagle"}, recs, None, False)
    for draw, arg in ((plots.acceptance_per_position, m["per_position"]), (plots.acceptance_breakdown, m["breakdown"])):
        png = draw(arg, "t", tmp_path / "x.png")
        assert png.read_bytes()[:4] == b"\x89PNG"
    rows = [{"series": "eagle", "k": 2, "accept/mean_len": 2.0, "accept/mean_len_lo": 1.8, "accept/mean_len_hi": 2.3,
             "speed/decode_tok_s": 10.0}]
    fig = plots.sweep_figure(rows)
    bars = [c for c in fig.axes[0].containers if isinstance(c, ErrorbarContainer)]
    (seg,) = bars[0].lines[2][0].get_segments()
    assert seg[0][1] == pytest.approx(1.8) and seg[1][1] == pytest.approx(2.3)
    plt.close(fig)


def test_task_accuracy_has_a_wilson_interval():
    recs = _varied(4)
    for i, r in enumerate(recs):
        r["answer"], r["output"] = "#### 42", "so 42" if i < 3 else "so 7"
    m = aggregate.metrics_json({"verify": "strict"}, recs, None, False)
    o = m["overall"]
    lo, hi = wilson(3, 4)
    assert (o["quality/accuracy"], o["quality/accuracy_lo"], o["quality/accuracy_hi"]) == (0.75, lo, hi)
    assert f"strict 0.75 ({lo:.2f}-{hi:.2f}) (3/4)" in " ".join(report.quality_lines(m))
