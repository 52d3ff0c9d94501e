"""Fast tests of the chat logic (`mtp.chat.session`, `mtp.chat.turn`, `mtp.chat.terminal`) with a fake generate:
commands, bad values, streaming/transcript agreement, thinking split, trimming, interrupts, /save, /stats, and
two processes following rank 0's input."""

from __future__ import annotations

import io
import json
import re
from types import SimpleNamespace

import pytest
import torch

from mtp.chat.session import loop
from mtp.chat.terminal import ScriptedInput, StopFlag, TerminalView, printable
from mtp.chat.session import Session, Settings
from mtp.chat.turn import stats_line
from mtp.decode.engine import GenerateResult, StepEvent
from mtp.decode.metrics import SpecMetrics
from mtp.text.tokenizer import Tokenizer, train_bpe_tokenizer

REPLY = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(train_bpe_tokenizer([REPLY * 3, "hello world, thinking about it " * 3], vocab_size=320))


class RecordingView:
    def __init__(self):
        self.chunks, self.stats_lines, self.notices, self.errors, self.ends = [], [], [], [], []

    def stream(self, text, reasoning, drafted):
        self.chunks.append((text, reasoning, drafted))

    def end_reasoning(self):
        self.chunks.append(("|", None, None))

    def end_reply(self, interrupted):
        self.ends.append(interrupted)

    def stats(self, line):
        self.stats_lines.append(line)

    def notice(self, text):
        self.notices.append(text)

    def error(self, text):
        self.errors.append(text)

    def shown(self, reasoning):
        return "".join(t for t, r, _ in self.chunks if r is reasoning)


class FakeGenerate:
    """Streams `reply_ids()` in steps of k+1 (all drafts accepted), as the engine's StepEvents would.
    `raise_after`: raise KeyboardInterrupt after that many steps (a Ctrl-C inside generate)."""

    def __init__(self, tok, reply_ids=None, raise_after=None):
        self.tok, self.calls, self.raise_after = tok, [], raise_after
        self.reply_ids = reply_ids or (lambda: tok.encode(REPLY) + [tok.eos_id])

    def __call__(self, model, prompts, max_new_tokens, draft="none", k=0, verify="strict", *, on_step=None, **kw):
        self.calls.append(dict(prompt=list(prompts[0]), max_new_tokens=max_new_tokens, draft=draft, k=k,
                               verify=verify, **kw))
        ids = self.reply_ids()[:max_new_tokens]
        met = SpecMetrics(k=k, draft=draft, verify=verify, n_rows=1, prompt_tokens=len(prompts[0]))
        steps, i = [ids[:1]], 1
        while i < len(ids):
            steps.append(ids[i:i + k + 1])
            i += k + 1
        for n, step in enumerate(steps):
            if n:
                met.accepted_hist[len(step) - 1] += 1
                met.row_steps += 1
            if self.raise_after is not None and n == self.raise_after:
                raise KeyboardInterrupt
            on_step(StepEvent([step], [max(len(step) - 1, 0)]))
        met.new_tokens, met.time_prefill_s, met.time_decode_s = len(ids), 0.01, 0.02
        met.ttft_s_rows, met.tpot_s_rows = [0.01], [0.02 / max(len(ids) - 1, 1)]
        return GenerateResult([ids], ["stop" if ids[-1] == self.tok.eos_id else "length"], met)


def make(tok, n_mtp=1, max_pos=4096, **settings):
    model = SimpleNamespace(n_mtp=n_mtp, device=torch.device("cpu"),
                            cfg=SimpleNamespace(max_position_embeddings=max_pos, vocab_size=tok.vocab_size))
    view, gen = RecordingView(), FakeGenerate(tok)
    s = Settings(**{"max_new_tokens": 32, "draft": "eagle", "k": 1, **settings})
    return Session(model, tok, s, view, generate=gen), view, gen


def test_settings_from_generate_kwargs():
    s = Settings.from_generate_kwargs({"draft": "none", "k": 0, "verify": "relaxed", "top_n": 5},
                                      max_new_tokens=7, thinking=True)
    assert (s.draft, s.k, s.effective_k, s.verify, s.max_new_tokens, s.thinking) == ("none", 1, 0, "relaxed", 7, True)
    assert s.options == {"top_n": 5}


def test_commands_change_settings(tok):
    sess, view, _ = make(tok)
    for line in ["/think on", "/draft vanilla", "/verify relaxed", "/k 1", "/max 9", "/draft none", "/k 3", "/help"]:
        assert sess.handle(line) is True
    assert view.errors == []
    s = sess.settings
    assert (s.thinking, s.draft, s.k, s.effective_k, s.verify, s.max_new_tokens) == (True, "none", 3, 0, "relaxed", 9)
    assert "applies when drafting is on" in view.notices[-2] and "/save FILE" in view.notices[-1]
    assert sess.handle("/draft eagle") and sess.settings.effective_k == 3
    assert sess.handle("/exit") is False and sess.handle("/quit") is False


@pytest.mark.parametrize("line, expected", [
    ("/k -1", "/k needs an integer in [1, 16], got -1 (draft='none' drafts nothing)"), ("/k 0", "in [1, 16]"),
    ("/k 17", "in [1, 16]"), ("/k two", "/k needs an integer in [1, 16], got 'two'"),
    ("/draft nonsense", "/draft needs one of none, vanilla, eagle, got 'nonsense'"),
    ("/verify greedy", "/verify needs one of strict, relaxed, sample, typical, got 'greedy'"),
    ("/think maybe", "on or off"), ("/max 0", "integer >= 1"), ("/max lots", "got 'lots'"),
    ("/max 5000", "leaves no room for a prompt"), ("/frobnicate", "unknown command /frobnicate"),
    ("/save", "usage: /save FILE"), ("/save /no/such/dir/t.json", "does not exist"),
])
def test_bad_values_give_one_line_and_change_nothing(tok, line, expected):
    sess, view, _ = make(tok)
    before = Settings(**vars(sess.settings))
    assert sess.handle(line) is True
    assert len(view.errors) == 1 and expected in view.errors[0] and "\n" not in view.errors[0]
    assert sess.settings == before


def test_a_registered_verifier_is_one_command_away(tok, registered):
    from mtp.verify.registry import Verifier

    registered(Verifier("accept_none", "tests.verify.test_registry:chain"))
    sess, view, gen = make(tok)
    assert sess.handle("/verify accept_none") and sess.handle("hello")
    assert view.errors == [] and sess.settings.verify == "accept_none" and gen.calls[-1]["verify"] == "accept_none"
    sess.handle("/verify nope")
    assert view.errors == ["/verify needs one of strict, relaxed, sample, typical, accept_none, got 'nope'"]
    assert sess.settings.verify == "accept_none"


def test_a_registered_drafter_is_one_command_away(tok, registered):
    from tests.draft.test_modes import FirstModule

    registered(FirstModule())
    sess, view, gen = make(tok, n_mtp=1)
    assert sess.handle("/draft first_module") and sess.handle("/k 3") and sess.handle("hello")
    assert view.errors == [] and (gen.calls[-1]["draft"], gen.calls[-1]["k"]) == ("first_module", 3)
    assert sess.settings.label() == "first_module k=3 strict"
    sess.handle("/draft nope")
    assert view.errors == ["/draft needs one of none, vanilla, eagle, first_module, got 'nope'"]
    assert sess.settings.draft == "first_module"


def test_a_registered_drafter_that_does_not_draft_runs_with_k_0(tok, registered):
    """Whether a mode drafts is the registry's word (`Drafter.drafts`), not a comparison with the name 'none'."""
    from mtp.draft.modes import NoDraft

    class Off(NoDraft):
        name = "off"

    registered(Off())
    sess, view, gen = make(tok, n_mtp=1)
    assert sess.handle("/k 2") and sess.handle("/draft off") and sess.handle("hello")
    assert view.errors == [] and (gen.calls[-1]["draft"], gen.calls[-1]["k"]) == ("off", 0)
    assert sess.settings.label() == "no draft strict"


def test_vanilla_k_needs_modules_unless_reused(tok):
    sess, view, _ = make(tok, k=1)
    sess.handle("/draft vanilla")
    sess.handle("/k 5")
    assert "vanilla k=5 needs 5 MTP modules" in view.errors[-1] and sess.settings.k == 1
    sess.handle("/draft eagle")
    sess.handle("/k 5")
    sess.handle("/draft vanilla")  # k=5 is fine for eagle, not for vanilla: refused, eagle stays
    assert sess.settings.draft == "eagle" and len(view.errors) == 2
    reuse, view2, _ = make(tok, options={"reuse_modules": True})
    reuse.handle("/draft vanilla")
    reuse.handle("/k 5")
    assert view2.errors == [] and reuse.settings.effective_k == 5


def test_chat_streams_and_records_what_was_shown(tok):
    sess, view, gen = make(tok, k=2)
    sess.handle("hello world")
    [turn] = sess.turns
    assert turn.content == view.shown(False) == REPLY and turn.reasoning == ""
    assert not turn.interrupted and turn.finish_reason == "stop" and view.ends == [False]
    assert any(d for _, _, d in view.chunks) and not all(d for _, _, d in view.chunks)
    call = gen.calls[0]
    assert (call["draft"], call["k"], call["verify"]) == ("eagle", 2, "strict")
    assert call["think_ids"] == (tok.think_id, tok.end_think_id)
    line = view.stats_lines[0]
    assert re.fullmatch(r"in=\d+ out=11 ttft=[\d.]+ms tpot=[\d.]+ms prefill=[\d.]+tok/s decode=[\d.]+tok/s "
                        r"AL=[\d.]+ acc=\[[\d.]+ [\d.]+\] \(eagle k=2 strict\)", line), line


def test_thinking_reply_is_split_and_history_keeps_only_answers(tok):
    sess, view, gen = make(tok, thinking=True)
    gen.reply_ids = lambda: tok.encode("thinking about it") + [tok.end_think_id] + tok.encode("hello") + [tok.eos_id]
    sess.handle("first question")
    turn = sess.turns[0]
    assert (turn.reasoning, turn.content) == ("thinking about it", "hello")
    assert view.shown(True) == "thinking about it" and view.shown(False) == "hello"
    sess.handle("second question")
    second = tok.decode(gen.calls[1]["prompt"])
    assert "first question" in second and "hello" in second and "thinking about it" not in second
    assert second.endswith("second question<｜Assistant｜><think>")
    sess.handle("/think off")
    sess.handle("third")
    assert tok.decode(gen.calls[2]["prompt"]).endswith("third<｜Assistant｜></think>")


def test_history_is_trimmed_to_max_model_len(tok):
    sess, view, gen = make(tok, max_new_tokens=16, max_model_len=120)
    for i in range(6):
        sess.handle(f"question number {i}")
    assert any("history trimmed" in n for n in view.notices)
    assert sess.context_start > 0 and len(sess.turns) == 6
    for call in gen.calls:
        assert len(call["prompt"]) + 16 <= 120
    last = tok.decode(gen.calls[-1]["prompt"])
    assert "question number 5" in last and "question number 0" not in last
    assert last.startswith("<｜begin▁of▁sentence｜>")


def test_overlong_input_is_refused_without_a_turn(tok):
    sess, view, gen = make(tok, max_new_tokens=16, max_model_len=64)
    sess.handle("word " * 100)
    assert "input too long" in view.errors[0] and sess.turns == [] and gen.calls == []
    sess.handle("short")
    assert len(sess.turns) == 1


def test_engine_bound_is_part_of_the_limit(tok):
    sess, _, _ = make(tok, k=3, max_pos=100)
    assert sess.context_limit() == 100 - 3 * 3 - 2
    sess.settings.max_model_len = 50
    assert sess.context_limit() == 50


def test_should_stop_interrupts_and_keeps_the_partial_reply(tok):
    sess, view, gen = make(tok, k=1)
    steps = iter(range(100))
    sess.should_stop = lambda: next(steps) >= 2
    sess.handle("hi")
    turn = sess.turns[0]
    assert turn.interrupted and turn.finish_reason == "interrupted" and view.ends == [True]
    assert turn.content == view.shown(False) and 0 < len(turn.content) < len(REPLY)
    m = turn.metrics
    assert m.new_tokens == 1 + 2 + 2 and m.row_steps == 2 and m.accepted_hist == [0, 2]
    assert view.stats_lines[0].endswith("interrupted")
    sess.should_stop = lambda: False
    sess.handle("again")
    assert not sess.turns[1].interrupted and "hi" in tok.decode(gen.calls[1]["prompt"])


def test_keyboard_interrupt_inside_generate_is_an_interrupt(tok):
    sess, view, gen = make(tok)
    gen.raise_after = 3
    sess.handle("hi")
    assert sess.turns[0].interrupted and view.errors == []


def test_generate_errors_are_one_line(tok):
    sess, view, gen = make(tok)

    def boom(*a, **k):
        raise ValueError("prompt (9) + max_new_tokens exceed max_position_embeddings")

    sess.generate = boom
    assert sess.handle("hi") is True
    assert view.errors == ["ValueError: prompt (9) + max_new_tokens exceed max_position_embeddings"]
    assert sess.turns == []


def test_reset_clears_context_but_keeps_transcript(tok):
    sess, view, gen = make(tok)
    sess.handle("remember apples")
    sess.handle("/reset")
    sess.handle("what fruit")
    assert "apples" not in tok.decode(gen.calls[1]["prompt"])
    assert [t.conversation for t in sess.turns] == [0, 1]


def test_save_writes_transcript_atomically(tok, tmp_path):
    sess, view, _ = make(tok, k=2)
    sess.handle("one")
    sess.handle("/k 1")
    sess.handle("//slash message")
    out = tmp_path / "t.json"
    sess.handle(f"/save {out}")
    assert view.errors == [] and sorted(p.name for p in tmp_path.iterdir()) == ["t.json"]
    data = json.loads(out.read_text())
    assert data["format"] == "mtp-chat-transcript/1"
    assert [t["user"] for t in data["turns"]] == ["one", "/slash message"]
    assert [t["content"] for t in data["turns"]] == [REPLY, REPLY]
    assert data["turns"][0]["settings"]["k"] == 2 and data["turns"][1]["stats"]["accept/pos_1"] == 1.0
    assert data["turns"][0]["stats_line"] == view.stats_lines[0]
    assert len(data["totals"]) == 2 and data["settings"]["k"] == 1
    sess.handle(f"/save {tmp_path}")
    assert "is a folder" in view.errors[-1]


def test_stats_totals_group_by_setting(tok):
    sess, view, _ = make(tok, k=2)
    sess.handle("/stats")
    assert view.notices[-1] == "no turns yet"
    sess.handle("a")
    sess.handle("b")
    sess.handle("/draft none")
    sess.handle("c")
    sess.handle("/stats")
    assert view.notices[-1] == "session: 3 turns (0 interrupted)"
    lines = view.stats_lines[-2:]
    assert "eagle k=2" in lines[0] and " turns=2 speedup=" in lines[0] and "(none strict)" in lines[1]


def test_stats_line_of_plain_decoding():
    m = SpecMetrics(k=0, draft="none", n_rows=1, prompt_tokens=10, new_tokens=5, ttft_s_rows=[0.5],
                    tpot_s_rows=[0.1], time_prefill_s=0.5, time_decode_s=0.4)
    assert stats_line(m) == ("in=10 out=5 ttft=500.0ms tpot=100.0ms prefill=20.0tok/s decode=10.0tok/s "
                             "AL=0.00 acc=[] (none strict)")


def test_loop_runs_until_exit_or_eof(tok):
    sess, view, _ = make(tok)
    loop(sess, ScriptedInput(["hi", "/bogus", "/exit", "never read"]), StopFlag())
    assert len(sess.turns) == 1 and len(view.errors) == 1
    loop(sess, ScriptedInput(["again"]), StopFlag())
    assert len(sess.turns) == 2


def test_terminal_view_makes_control_characters_visible():
    assert printable("a\x1b[2Jb\tc\nd\x7f\x85") == "a\u241b[2Jb\tc\nd\u2421<U+0085>"
    out = io.StringIO()
    view = TerminalView(out, color=True, show_drafts=True)
    view.stream("x\x07", reasoning=False, drafted=True)
    view.stream("y", reasoning=False, drafted=False)
    assert out.getvalue() == "\x1b[32mx\u2407\x1b[0my"


# ---------------------------------------------------------------------------------------------- tools
LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "Find a word",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}}


def _call(name, **args):
    return {"type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def _replies(gen, tok, texts):
    """The fake model answers with these texts in turn (each followed by EOS)."""
    queue = list(texts)
    gen.reply_ids = lambda: tok.encode(queue.pop(0)) + [tok.eos_id]


def test_tool_calls_results_and_continuation(tok, tmp_path):
    from mtp.text.dsml import tool_calls_text
    from mtp.text.prompt import encode_chat

    path = tmp_path / "tools.json"
    path.write_text(json.dumps({"tools": [LOOKUP]}), encoding="utf-8")
    sess, view, gen = make(tok, max_new_tokens=1024)
    sess.handle(f"/tools {path}")
    assert view.notices[-1] == "tools: lookup" and sess.tools == [LOOKUP]
    calls = [_call("lookup", word="cat"), _call("lookup", word="dog")]
    _replies(gen, tok, ["Checking." + tool_calls_text(calls, "test"), "Cats purr, dogs bark."])
    sess.handle("Define cat and dog")
    first = sess.turns[0]
    assert (first.content, first.tool_calls, sess.pending) == ("Checking.", calls, 2)
    assert 'lookup({"word": "cat"})' in view.notices[-1] and "/result" in view.notices[-1]
    sess.handle("something else")  # refused while results are pending
    assert "2 tool call(s) wait for /result" in view.errors[-1] and len(gen.calls) == 1
    sess.handle("/result a small feline")
    assert view.notices[-1] == "1 more result(s) to go" and len(gen.calls) == 1
    sess.handle("/result a canine")  # the last result: the model goes on by itself
    assert len(gen.calls) == 2 and sess.pending == 0
    cont = sess.turns[1]
    assert cont.user is None and cont.content == "Cats purr, dogs bark." and cont.tool_calls == []
    expected = [{"role": "user", "content": "Define cat and dog"},
                {"role": "assistant", "content": "Checking.", "tool_calls": calls},
                {"role": "tool", "content": "a small feline"}, {"role": "tool", "content": "a canine"}]
    assert gen.calls[1]["prompt"] == encode_chat(expected, tok, thinking=False, tools=[LOOKUP])
    assert tok.decode(gen.calls[1]["prompt"]).endswith("<result>a canine</result>\n</function_results>\n\n</think>")
    sess.handle("/result late")
    assert "no tool call is waiting" in view.errors[-1]
    saved = tmp_path / "t.json"
    sess.handle(f"/save {saved}")
    data = json.loads(saved.read_text(encoding="utf-8"))
    assert data["tools"] == [LOOKUP] and data["turns"][0]["tool_results"] == ["a small feline", "a canine"]
    sess.handle("/tools off")
    assert sess.tools is None and view.notices[-1] == "no tools"


def test_tool_calls_in_thinking_mode_and_malformed_ones(tok):
    from mtp.text.dsml import tool_calls_text

    sess, view, gen = make(tok, thinking=True, max_new_tokens=1024)
    sess.tools = [LOOKUP]
    call = _call("lookup", word="owl")
    queue = [tok.encode("I should look it up") + [tok.end_think_id] + tok.encode(tool_calls_text([call], "t")),
             tok.encode("ok") + [tok.end_think_id] + tok.encode("Owls hoot."),
             tok.encode("hm") + [tok.end_think_id] + tok.encode("\n\n<｜DSML｜function_calls>\nbroken")]
    gen.reply_ids = lambda: queue.pop(0) + [tok.eos_id]
    sess.handle("What is an owl?")
    assert sess.turns[0].reasoning == "I should look it up" and sess.turns[0].tool_calls == [call]
    sess.handle("/result a bird")
    # Thinking mode: the tool call turn keeps its reasoning (it is part of the reply being written).
    prompt = tok.decode(gen.calls[1]["prompt"])
    assert "I should look it up</think>" in prompt and prompt.endswith("</function_results>\n\n<think>")
    sess.handle("And a bat?")
    assert sess.pending == 0 and "could not be read, kept as text" in view.notices[-1]
    assert "DSML" in sess.turns[-1].content


def test_bad_tools_file_is_one_line(tok, tmp_path):
    sess, view, _ = make(tok)
    (tmp_path / "bad.json").write_text('[{"name": "f"}]', encoding="utf-8")
    cases = ((tmp_path / "none.json", "cannot read"), (tmp_path / "bad.json", "must be a dict with a 'function'"))
    for arg, match in cases:
        sess.handle(f"/tools {arg}")
        assert match in view.errors[-1] and "\n" not in view.errors[-1] and sess.tools is None


def test_invalid_utf8_input_is_replaced_not_an_error(tok):
    """A terminal in another encoding hands Python lone surrogates (surrogateescape); the tokenizer cannot
    take them. They become U+FFFD, with one notice, and the message is sent."""
    sess, view, gen = make(tok)
    sess.handle("caf\udce9 ok")
    assert view.errors == [] and len(sess.turns) == 1
    assert "invalid UTF-8" in view.notices[0]
    assert tok.decode(gen.calls[0]["prompt"]).count("\ufffd") == 1


def test_a_trailing_backslash_continues_the_message(tok):
    sess, view, gen = make(tok)
    assert sess.handle("first line \\") and sess.handle("  indented second \\") and sess.continuing
    assert gen.calls == []
    sess.handle("third")
    assert not sess.continuing and len(gen.calls) == 1
    assert "first line \n  indented second \nthird" in tok.decode(gen.calls[0]["prompt"])


def test_temperature_command(tok):
    sess, view, gen = make(tok)
    sess.handle("/temperature 0.7")
    assert sess.settings.options["temperature"] == 0.7 and "applies with /verify sample" in view.notices[-1]
    sess.handle("/verify sample")
    sess.handle("hello")
    assert gen.calls[-1]["temperature"] == 0.7
    for bad in ("/temperature 0", "/temperature -1", "/temperature hot", "/temperature nan"):
        sess.handle(bad)
        assert "/temperature needs a number > 0" in view.errors[-1], bad
    assert sess.settings.options["temperature"] == 0.7
    assert "/temperature T" in sess_help(sess, view)


def sess_help(sess, view) -> str:
    sess.handle("/help")
    return view.notices[-1]


def test_help_lists_the_chat_groups_and_the_slash_commands():
    from eval.chat import chat_help
    from mtp.chat.session import help_text

    text = chat_help()
    assert "model: dsv32, tiny" in text and "draft: eagle, none, vanilla" in text and "runtime: cpu, cuda" in text
    groups = text.split("config groups")[1].split("\n\n")[0]  # mtp-eval's own groups are not the chat's
    assert all(f"  {g}:" not in groups for g in ("experiment", "dataset", "logger", "schema", "hydra"))
    assert "  model:" in groups
    assert help_text() in text and "max_new_tokens" in text


def test_help_lists_what_is_registered_after_the_chat_is_imported(tok, registered):
    """A plugin imported after mtp.chat registers its drafter and verifier: /help (and mtp-chat --help) ask the
    registries when they are printed, and the commands take the new names."""
    from eval.chat import chat_help
    from mtp.verify.registry import Verifier
    from tests.draft.test_modes import FirstModule

    sess, view, gen = make(tok, draft="none")
    assert "first_module" not in sess_help(sess, view) and "accept_none" not in sess_help(sess, view)
    registered(FirstModule())
    registered(Verifier("accept_none", "tests.verify.test_registry:chain"))
    text = sess_help(sess, view)
    assert "/draft none|vanilla|eagle|first_module MTP drafting mode" in text
    assert "/verify strict|relaxed|sample|typical|accept_none\n" in text and text in chat_help()
    sess.handle("/k 2")
    assert "applies when drafting is on: /draft vanilla|eagle|first_module)" in view.notices[-1]
    assert sess.handle("/draft first_module") and sess.handle("/verify accept_none") and sess.handle("hello")
    assert view.errors == [] and (gen.calls[-1]["draft"], gen.calls[-1]["k"], gen.calls[-1]["verify"]) == (
        "first_module", 2, "accept_none")


def test_stats_compare_with_the_no_draft_baseline(tok):
    sess, view, _ = make(tok, k=2)
    sess.handle("a")
    sess.handle("/stats")
    assert "no baseline yet" in view.notices[-1] and "/draft none" in view.notices[-1]
    sess.handle("/draft none")
    sess.handle("b")
    sess.handle("/stats")
    spec, base = view.stats_lines[-2:]
    assert re.search(r" speedup=[\d.]+x vs no draft$", spec) and "speedup" not in base
    assert "no baseline yet" not in view.notices[-1]
