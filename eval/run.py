"""mtp-eval: run a prompt set through speculative decoding and write samples, metrics and plots.

    mtp-eval                                    # = python -m mtp_eval.run ; defaults in conf/eval.yaml
    mtp-eval draft.k=3 verify=relaxed thinking=true
    mtp-eval -m draft.k=1,2,3                   # multirun + sweep summary

Flow: validate the config -> read the prompts -> open the stores (resume) -> load the model once -> per batch:
generate (and the draft=none baseline when baseline=true), append to samples.jsonl / baseline.jsonl ->
metrics.json (atomic), plots, the table on stdout, the logger. Everything lands in the Hydra run dir.
Setup errors (config, data, checkpoint, resume) exit with status 2 and one line on stderr, before any output;
logits that go NaN / inf during generation (mtp.decode.health) exit with status 1 and one line, without metrics.json.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import sys
import time
import zlib
from pathlib import Path
from typing import NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from mtp.draft.modes import NoDraft
from mtp.placement import choose_layout
from mtp.utils import write_atomic
from mtp.verify.registry import verifier

from . import conf_dir, trees
from .common import NotAvailableError, build, check_runtime, generate_kwargs, model_label, model_path
from .data import DataError, Prompt, load_prompts
from .rundir import FAILED_NAME, SETTINGS_NAME, RunDirError, drop_refused, locked
from .schema import EvalConfig, SchemaError, validate, value
from .store import SampleStore, StoreError

log = logging.getLogger("mtp-eval")

# Settings that do not change the generated tokens; a resume may change them.
_NOT_HASHED = ("output_dir", "resume", "logger", "plots", "baseline", "compare_strict", "timing", "task_name",
               "deep_fingerprint")
_RUNTIME_NOT_HASHED = ("warmup", "num_threads")
STRICT_REFERENCE_FILE = "strict_reference.jsonl"  # plain greedy outputs, when no baseline provides them


class SetupError(Exception):
    """A user-facing problem found before generation started."""


class RunExit(SystemExit):
    """The end of a refused or failed run, its one line already on stderr (a sweep's summary lists the line)."""

    def __init__(self, code: int, line: str):
        super().__init__(code)
        self.line = line


def _exit(code: int, error: BaseException) -> NoReturn:
    print(f"mtp-eval: error: {error}", file=sys.stderr)
    raise RunExit(code, str(error))


# The last model built in this process: the jobs of a multirun (basic launcher: one process) share it instead
# of reloading the checkpoint per job; a different model / device / dtype replaces it.
_BUILT: dict = {}


def _build_once(cfg: EvalConfig):
    rt = cfg.runtime
    key = (repr(cfg.model), rt.device, value(rt.dtype), rt.tp, rt.mlp_split, rt.expert_layout, rt.fast_path,
           rt.elementwise, rt.allreduce)
    peers = getattr(_BUILT.get("model"), "peers", None)
    if _BUILT.get("key") != key or (peers is not None and peers.closed):  # a failed job's ranks are gone: start anew
        _BUILT.clear()
        if peers is not None:  # the ranks of the model this one replaces
            peers.close()
        t0 = time.perf_counter()
        model, tok = build(cfg)
        _BUILT.update(key=key, model=model, tok=tok, load_s=time.perf_counter() - t0)
    else:
        _BUILT["load_s"] = 0.0  # an earlier job of the sweep loaded it
        if cfg.runtime.num_threads:
            import torch

            torch.set_num_threads(cfg.runtime.num_threads)
    return _BUILT["model"], _BUILT["tok"]


def output_settings(resolved: dict) -> dict:
    """The settings that shape the outputs: what a resume must keep (recorded in settings.json)."""
    d = {k: v for k, v in resolved.items() if k not in _NOT_HASHED}
    d["runtime"] = {k: v for k, v in d["runtime"].items() if k not in _RUNTIME_NOT_HASHED}
    return d


def config_hash(resolved: dict) -> str:
    return hashlib.sha256(json.dumps(output_settings(resolved), sort_keys=True).encode()).hexdigest()[:16]


def plan_batches(prompts: list[Prompt], batch_size: int) -> list[tuple[str, list[Prompt]]]:
    """Batches of one category each (so per-category metrics are exact merges), named by plan position; turn j+1
    of multi-turn rows in batches after turn j's (it needs their answers). Deterministic in the prompt list: a
    resumed run plans the same batches."""
    by_cat: dict[tuple[str, int], list[Prompt]] = {}
    for p in sorted(prompts, key=lambda p: p.turn):  # stable: turn 1 of every category first
        by_cat.setdefault((p.category, p.turn), []).append(p)
    chunks = [ps[i: i + batch_size] for ps in by_cat.values() for i in range(0, len(ps), batch_size)]
    return [(f"b{n:05d}", c) for n, c in enumerate(chunks)]


def prompt_seed(seed: int, prompt_id: str) -> int:
    """The sampling seed of one prompt: the run's seed and the prompt's id (not its place in a batch)."""
    return seed * 2**32 + zlib.crc32(prompt_id.encode("utf-8"))


def _call(model, batch: list[Prompt], ids: list[list[int]], max_new_tokens: int, kw: dict):
    """One generate call: (result, accepted-count histogram per row -- the engine's own, `row_accepted_hist`, which
    the step events agree with (tests/eval) --, wall seconds, [output position, accepted] per verify step per row).
    A run with draft.tree goes to the tree decoder (eval/trees.py)."""
    import mtp

    from .breakdown import StepLog

    if "seed" in kw:  # verify=sample: each prompt its own seed, so its output does not depend on the batching
        kw = {**kw, "seed": [prompt_seed(kw["seed"], p.id) for p in batch]}
    steps = StepLog(len(ids))
    t0 = time.perf_counter()
    if "tree" in kw:
        res, _ = trees.generate(model, ids, max_new_tokens, kw, on_step=steps)
    else:
        res = mtp.generate(model, ids, max_new_tokens, on_step=steps, **kw)
    wall = time.perf_counter() - t0
    return res, res.row_accepted_hist, wall, steps.rows


def _records(tok, batch: list[Prompt], ids: list[list[int]], name: str, calls: list) -> list[dict]:
    """A record per prompt: the tokens and acceptance of the first call, the timings of every call."""
    from .breakdown import phase_steps

    res, row_hist, wall, steps = calls[0]
    m = res.metrics
    differ = any(c[0].tokens != res.tokens for c in calls[1:])
    if differ:  # greedy and seeded sampling are deterministic: a repeat that differs is a finding in itself
        log.warning("batch %s: a timing repeat produced other tokens than the first run; kept the first", name)
    timings = [[c[0].metrics.raw(), c[2]] for c in calls]
    out = []
    for p, pid, toks, reason, hist, row_steps in zip(batch, ids, res.tokens, res.finish_reasons, row_hist, steps):
        steps_n = sum(hist)
        out.append({
            "id": p.id, "category": p.category, "thinking": p.thinking, "batch": name,
            "prompt_tokens": len(pid), "new_tokens": len(toks), "finish_reason": reason,
            "row_accepted_hist": hist,
            "row_mean_accepted_len": 1 + sum(a * c for a, c in enumerate(hist)) / steps_n if steps_n else 0.0,
            "batch_decode_tok_s": m.decode_tok_s, "batch_wall_s": wall, "batch_metrics": m.raw(),
            "repeats": timings, "repeats_differ": differ, "output": tok.decode(toks), "tokens": toks,
            "answer": p.answer, "tool_calls": _tool_calls(tok.decode(toks), p.thinking),
            "steps": phase_steps(tok, p.thinking, toks, row_steps),
        })
        if res.tree is not None:
            out[-1]["batch_tree_metrics"] = res.tree.raw()
    return out


def _tool_calls(output: str, thinking: bool) -> list | None:
    """The DSML tool calls in an output as OpenAI-style calls ([] when it makes none); None when they are
    malformed (or cut off by max_new_tokens)."""
    from mtp.text.dsml import CompletionFormatError, find_tool_calls

    try:
        found = find_tool_calls(output, thinking)
    except CompletionFormatError:
        return None
    return found[1] if found else []


def run_batch(model, tok, batch: list[Prompt], ids: list[list[int]], max_new_tokens: int, kws: dict[str, dict],
              name: str, repeats: int = 1) -> dict[str, list[dict]]:
    """Every setting of `kws` (name -> generate kwargs) on one batch, `repeats` times, interleaved in the
    order of `kws` (for baseline and speculative: b, s, b, s, ...), so a drifting machine load hits both
    alike and repeat r of the two forms a pair. Records per name."""
    calls: dict[str, list] = {which: [] for which in kws}
    for _ in range(repeats):
        for which, kw in kws.items():
            calls[which].append(_call(model, batch, ids, max_new_tokens, kw))
    return {which: _records(tok, batch, ids, name, c) for which, c in calls.items()}


def _check_lengths(cfg: EvalConfig, model, prompts: list[Prompt], ids: dict[str, list[int]], k: int,
                   tree: str | None = None) -> None:
    from mtp.spec.options import draft_room  # the engine's buffer: prompt + max_new_tokens + draft room
    from mtp.spec.tree_shape import TreeShape

    limit = model.cfg.max_position_embeddings - draft_room(k, None if tree is None else TreeShape.parse(tree).n_nodes)
    what = "the model's max_position_embeddings (minus draft room)"
    if cfg.runtime.max_model_len is not None and cfg.runtime.max_model_len < limit:
        limit, what = cfg.runtime.max_model_len, "runtime.max_model_len"
    long = [f"{p.id} ({len(ids[p.id])})" for p in prompts if len(ids[p.id]) + cfg.max_new_tokens > limit]
    if long:
        raise SetupError(f"prompt tokens + max_new_tokens ({cfg.max_new_tokens}) exceed {what} = {limit} for: "
                         f"{', '.join(long[:10])}; lower max_new_tokens or filter the dataset")


def _identity(cfg: EvalConfig, out: Path) -> tuple[str, str | None]:
    """(run name, group): sweeps are grouped by their multirun folder."""
    hc = HydraConfig.get()
    d = cfg.draft
    shape = f"k{d.k}" if d.tree is None else f"t{d.tree}" + (f"-p{d.min_draft_prob:g}" if d.min_draft_prob else "")
    base = f"{d.name}-{shape}-{cfg.verify.name}"
    if hc.mode == RunMode.MULTIRUN:
        return f"{base}-job{hc.job.num}", Path(hc.sweep.dir).name
    return f"{base}-{out.name}", None


def _setup(cfg: DictConfig):
    typed = validate(cfg)
    check_runtime(typed.runtime)
    out = Path(typed.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    resolved = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    chash = config_hash(resolved)
    prompts = load_prompts(typed.dataset, typed.thinking, typed.system_prompt)
    settings = output_settings(resolved)
    stores = {"spec": SampleStore(out / "samples.jsonl", chash, typed.resume, settings)}
    if typed.baseline:
        stores["base"] = SampleStore(out / "baseline.jsonl", chash, typed.resume, settings)
    if strict_source(typed) == "ref":
        stores["ref"] = SampleStore(out / STRICT_REFERENCE_FILE, chash, typed.resume, settings)
    model, tok = _build_once(typed)
    from mtp.text.prompt import encode_chat

    ids = {p.id: encode_chat(p.messages, tok, p.thinking) for p in prompts}
    kw = generate_kwargs(typed, tok)
    if "draft_vocab" in kw:  # checked here, before the folder is claimed, not first by the proposer
        from mtp.draft.vocab import check_ids

        try:
            check_ids(kw["draft_vocab"], model.cfg.vocab_size)
        except ValueError as e:
            raise SetupError(f"draft.vocab_file={typed.draft.vocab_file}: {e}") from None
    if "tree" in kw:
        trees.check(kw, typed.runtime.batch_size)
    if verifier(kw["verify"]).needs_think_ids and not any(p.thinking for p in prompts):
        log.warning(f"verify={kw['verify']} acts only inside thinking spans and no prompt is in thinking mode, so "
                    "it acts like strict here (thinking=true turns thinking on for every prompt)")
    _check_lengths(typed, model, prompts, ids, kw["k"], kw.get("tree"))
    return typed, out, resolved, prompts, stores, model, tok, ids, kw


def strict_source(typed: EvalConfig) -> str | None:
    """Which store holds plain greedy outputs of the prompts to compare the run with: the baseline when it is
    greedy (a verifier that does not sample: its baseline is strict's, `_baseline_kwargs`), else with
    compare_strict a greedy run of its own ("ref"; a sampling verifier's baseline samples); none when the
    verifier's own output is greedy decoding's."""
    v = verifier(typed.verify.name)
    if typed.baseline and not v.samples:
        return "base"
    return "ref" if typed.compare_strict and not v.greedy_output else None


def _baseline_kwargs(kw: dict) -> dict:
    """draft=none with the run's verifier when it samples (plain sampling), else plain greedy decoding (strict:
    without drafts a verifier that does not sample has nothing to decide)."""
    drop = ("target_hidden", "chain_hidden", "reuse_modules", "draft_vocab", "draft_head_fp8", "top_n", "delta",
            "think_ids", *trees.TREE_KWARGS)
    base = {key: v for key, v in kw.items() if key not in drop}
    base.update(draft=NoDraft.name, k=0)
    if not verifier(base["verify"]).samples:
        base["verify"] = "strict"
    if "draft_sampling" in base:
        base["draft_sampling"] = "greedy"
    return base


def _strict_kwargs(kw: dict) -> dict:
    """Plain greedy decoding (the strict reference), with the run's runtime options."""
    return {"draft": NoDraft.name, "k": 0, "verify": "strict",
            **{key: kw[key] for key in ("mode", "prefill_chunk") if key in kw}}


def _user_errors() -> tuple:
    errors = (SchemaError, DataError, StoreError, NotAvailableError, SetupError, RunDirError)
    if "mtp.checkpoint.files" in sys.modules:  # torch is imported only once the config is valid
        from mtp.checkpoint.files import CheckpointError
        from mtp.model.config import ConfigError
        from mtp.preflight import PreflightError

        errors += (CheckpointError, ConfigError, PreflightError)
    if "mtp.distributed.group" in sys.modules:
        from mtp.distributed.group import RankFailure

        errors += (RankFailure,)  # a rank that could not load (the message names it, the file and the tensor)
    return errors


def evaluate(cfg: DictConfig) -> float:
    """One run, holding its folder's lock throughout. A refused run (bad settings, busy folder, missing
    resume=true) leaves the folder as it was; Ctrl-C ends with exit 130, an unwritable folder or a full disk
    with exit 2, each with one line."""
    try:
        out = Path(cfg.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        with locked(out) as claim:
            try:
                return _evaluate(cfg, claim)
            finally:
                # Every object of the run to the permanent generation: the interpreter's collections at exit then
                # skip the ~0.5 M objects torch / transformers / hydra and the model made (measured: 5-7 s of
                # exit after Ctrl-C on a loaded 2-core machine, all in gc_collect_main; >60 s on CI under load)
                gc.freeze()
    except KeyboardInterrupt:
        print("mtp-eval: interrupted; finished batches are kept (resume=true continues the run)", file=sys.stderr)
        sys.exit(130)
    except RunDirError as e:
        _exit(2, e)
    except OSError as e:  # read-only folder, full disk
        _exit(2, e)


def _evaluate(cfg: DictConfig, claim) -> float:
    try:
        typed, out, resolved, prompts, stores, model, tok, ids, kw = _setup(cfg)
    except Exception as e:
        if not isinstance(e, _user_errors()):
            raise
        _exit(2, e)  # not logged: run.log of a refused run stays untouched
    claim()
    _record(out, cfg, resolved)

    from mtp.provenance import defaulted_line, provenance

    from . import aggregate

    batches = plan_batches(prompts, typed.runtime.batch_size)
    resumed = len(stores["spec"].records)
    prov = provenance(model_path(typed.model), typed.runtime.device, typed.deep_fingerprint)
    if line := defaulted_line(prov["checkpoint"]):  # also in metrics.json's provenance (config_assumed)
        log.warning("%s", line)
    logger = hydra.utils.instantiate(cfg.logger)
    logger.start({**resolved, "provenance": prov}, *_identity(typed, out), out)
    kws = {"spec": kw, "base": _baseline_kwargs(kw), "ref": _strict_kwargs(kw)}
    from mtp.decode.health import NonFiniteError
    from mtp.distributed.group import RankFailure

    try:
        warmup_s = _generate_all(typed, model, tok, batches, ids, stores, kws, logger)
    except (NonFiniteError, RankFailure) as e:  # no metrics.json: there is nothing meaningful to report
        log.error("%s", e)
        _exit(1, e)

    order = {p.id: i for i, p in enumerate(prompts)}
    recs = {w: sorted(s.records, key=lambda r: order.get(r["id"], len(order))) for w, s in stores.items()}
    # Only strict verification promises the baseline's exact tokens; relaxed / sampled outputs differ by design
    # and are measured against plain greedy outputs instead (agreement, accuracy).
    source = strict_source(typed)
    startup = {"load_s": _BUILT["load_s"], "warmup_s": warmup_s}  # warm-up: first calls (compile, graph capture)
    report = getattr(model, "load_report", None)
    if report and _BUILT["load_s"]:  # each rank's load: seconds, checkpoint bytes, bytes read from storage
        startup["ranks"] = report
        slowest = max(report, key=lambda r: r["seconds"])
        log.info("load: %d ranks read %.2f GB of slices; slowest rank %d: %.1f s (%.2f GB/s)", len(report),
                 sum(r["bytes"] for r in report) / 1e9, slowest["rank"], slowest["seconds"],
                 slowest["bytes"] / max(slowest["seconds"], 1e-9) / 1e9)
    log.info("startup: load %.1f s%s, warm-up %s", startup["load_s"], " (reused from the sweep's first job)"
             if not startup["load_s"] else "", "skipped" if warmup_s is None else f"{warmup_s:.1f} s")
    layout = choose_layout(typed.runtime.expert_layout, model.cfg.moe_intermediate_size, typed.runtime.tp)
    metrics = aggregate.metrics_json({**_run_info(typed, len(prompts), len(batches), resumed, layout), "startup": startup},
                                     recs["spec"],
                                     recs.get("base"), compare_tokens=verifier(typed.verify.name).greedy_output,
                                     strict_records=recs.get(source), strict_source=stores[source].path.name
                                     if source else None)
    metrics["provenance"] = prov
    metrics["config"] = resolved
    write_atomic(out / "metrics.json", json.dumps(metrics, indent=2) + "\n")
    pngs = _report(typed, out, metrics)
    logger.finish(metrics, recs["spec"], pngs)
    return metrics["overall"]["accept/mean_len"]


def _record(out: Path, cfg: DictConfig, resolved: dict) -> None:
    """Once the run is accepted: settings.json (first run of the folder only: a resume keeps the original) and
    Hydra's record of the config and overrides in .hydra/ (conf/eval.yaml turns Hydra's own writing off, which
    happens before any check and rewrote the record of a run that was then refused)."""
    if not (out / SETTINGS_NAME).exists():
        write_atomic(out / SETTINGS_NAME, json.dumps(output_settings(resolved), indent=2, sort_keys=True) + "\n")
    rec = out / ".hydra"
    rec.mkdir(exist_ok=True)
    hc = HydraConfig.get()
    write_atomic(rec / "config.yaml", OmegaConf.to_yaml(cfg))
    write_atomic(rec / "overrides.yaml", OmegaConf.to_yaml(list(hc.overrides.task)))


def _generate_all(typed: EvalConfig, model, tok, batches, ids, stores: dict, kws: dict, logger) -> float | None:
    """Every batch not yet in its store, appended as soon as it is done. The timed stores (baseline and
    speculative) run `timing.repeats` times per batch, interleaved; the strict reference once. Returns the
    warm-up's seconds (None without one)."""
    from . import aggregate, report

    todo = [(n, b) for n, b in batches if any(not s.has([p.id for p in b]) for s in stores.values())]
    timed = [w for w in ("base", "spec") if w in stores]
    warmup_s = None
    if todo and typed.runtime.warmup:  # first calls pay one-off allocation / dispatch costs; keep them out
        first = todo[0][1][0]
        t0 = time.perf_counter()
        run_batch(model, tok, [first], [ids[first.id]], min(4, typed.max_new_tokens), {w: kws[w] for w in stores},
                  "warmup")
        warmup_s = time.perf_counter() - t0
    total = sum(len(b) for _, b in batches)
    with report.progress() as bar:
        task = bar.add_task(_describe(typed), total=total, completed=total - sum(len(b) for _, b in todo), status="")
        for step, (name, batch) in enumerate(todo):
            bids = [p.id for p in batch]
            if any(p.follows for p in batch):
                _follow_up_ids(typed, model, tok, batch, {p.id: p for _, b in batches for p in b}, ids,
                               stores["spec"].records)
            bid_tokens = [ids[i] for i in bids]
            for group, repeats in ((timed, typed.timing.repeats), ([w for w in stores if w not in timed], 1)):
                todo_kws = {w: kws[w] for w in group if not stores[w].has(bids)}
                done = run_batch(model, tok, batch, bid_tokens, typed.max_new_tokens, todo_kws, name, repeats)
                for which, recs in done.items():
                    stores[which].append(recs)
                    if which == "spec":
                        logger.log_batch(step, recs)
            al = aggregate.summarize(stores["spec"].records)["overall"]["accept/mean_len"]
            bar.update(task, advance=len(batch), status=f"AL {al:.2f}")
    return warmup_s


def _follow_up_ids(typed: EvalConfig, model, tok, batch: list[Prompt], by_id: dict[str, Prompt], ids: dict,
                   records: list[dict]) -> None:
    """Prompt ids of later turns of multi-turn rows: the conversation so far with the speculative run's answers
    (every setting of the run answers the same prompt, so their speeds compare)."""
    from mtp.text.prompt import encode_chat

    from .data import conversation

    outputs = {r["id"]: r["output"] for r in records}
    for p in batch:
        if p.follows:
            ids[p.id] = encode_chat(conversation(p, by_id, outputs), tok, p.thinking)
    _check_lengths(typed, model, batch, ids, typed.draft.k, typed.draft.tree)


def _describe(typed: EvalConfig) -> str:
    d = typed.draft
    return f"{trees.label(d.name, d.k, d.tree, d.min_draft_prob)} {typed.verify.name}"


def _report(typed: EvalConfig, out: Path, metrics: dict) -> dict[str, Path]:
    """PNG plots (when plots=true) and the acceptance table on stdout; returns the plots by name."""
    from . import plots, report

    pngs = {}
    title = f"{_describe(typed)} ({model_label(typed.model)})"
    if typed.plots:
        if metrics["per_position"]:
            pngs["acceptance_per_position"] = plots.acceptance_per_position(
                metrics["per_position"], title, out / "acceptance_per_position.png")
        pngs["accepted_length_hist"] = plots.accepted_length_hist(metrics["accepted_hist"], title,
                                                                  out / "accepted_length_hist.png")
        if metrics.get("breakdown"):
            pngs["acceptance_breakdown"] = plots.acceptance_breakdown(metrics["breakdown"], title,
                                                                      out / "acceptance_breakdown.png")
        if metrics.get("tree"):
            pngs["tree_acceptance"] = plots.tree_acceptance(metrics["tree"], title, out / "tree_acceptance.png")
    con = report.console()
    n = metrics["run"]["n_prompts"]
    con.print(report.acceptance_table(metrics, f"{_describe(typed)} | model={model_label(typed.model)} | {n} prompts, "
                                               f"max_new_tokens={typed.max_new_tokens}"))
    con.print(report.latency_table(metrics))
    if metrics.get("tree"):
        con.print(report.tree_table(metrics["tree"]))
        con.print(report.tree_line(metrics["tree"]))
    mm = metrics["strict_mismatch"]
    if mm is not None:
        con.print(f"strict outputs differing from the baseline: {mm['count']}"
                  + (f" ({', '.join(mm['ids'][:10])})" if mm["ids"] else ""))
    for line in report.quality_lines(metrics):
        con.print(line)
    for i, line in enumerate(report.flagged_lines(metrics)):
        con.print(f"[bold red]warning:[/] {line}" if i == 0 else line)
        log.warning("%s", line)
    dg = metrics["degenerate"]
    if dg["count"] or dg["all_rows_identical"]:
        what = (f"{dg['count']} of {n} outputs are one token repeated ({', '.join(dg['ids'][:10])})" if dg["count"]
                else "every prompt produced the same output")
        warning = f"degenerate outputs: {what}; their acceptance says nothing about the drafts (broken model?)"
        con.print(f"[bold red]warning:[/] {warning}")
        log.warning("%s", warning)
    con.print(f"outputs: {out}")
    o = metrics["overall"]
    sp = report.spread_text(o, "speed/speedup_decode", 2, "x")
    log.info("%d prompts: AL %.3f, decode %s tok/s%s; metrics in %s", n, o["accept/mean_len"],
             report.spread_text(o, "speed/decode_tok_s", 1), f", speedup {sp}" if sp != "-" else "",
             out / "metrics.json")
    return pngs


def device_note(device: str) -> str | None:
    if device == "cpu":
        return ("CPU timing: the reference path on a shared CPU; tok/s and speedups here are not indicative "
                "of GPU speed")
    return None


def _run_info(typed: EvalConfig, n_prompts: int, n_batches: int, resumed: int, expert_layout: str) -> dict:
    d = typed.draft
    return {
        "model": model_label(typed.model), "draft": d.name, "k": d.k, "verify": typed.verify.name,
        "tree": d.tree, "min_draft_prob": d.min_draft_prob if d.tree is not None else None,
        "target_hidden": value(d.target_hidden), "chain_hidden": value(d.chain_hidden),
        "numerics": value(typed.model.numerics), "runtime_mode": value(typed.runtime.mode),
        "device": typed.runtime.device, "tp": typed.runtime.tp, "device_note": device_note(typed.runtime.device), "dataset": typed.dataset.name, "thinking": typed.thinking,
        "expert_layout": expert_layout,  # the one loaded (runtime.expert_layout 'auto' resolved)
        "max_new_tokens": typed.max_new_tokens, "compare_strict": typed.compare_strict, "n_prompts": n_prompts, "n_batches": n_batches,
        "resumed_samples": resumed,  # finished prompts found in samples.jsonl at start (resume=true)
    }


@hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name="eval")
def main(cfg: DictConfig) -> float:
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        return sweep_job(cfg)  # a refused job keeps its folder: FAILED_NAME in it is the sweep's record
    try:
        return evaluate(cfg)
    except RunExit as e:
        out = Path(HydraConfig.get().runtime.output_dir)
        if e.code == 2 and out.resolve() not in _EXISTING:
            drop_refused(out)
        raise


# hydra.run.dir folders named on the command line that existed before Hydra ran: a refused run never removes one
_EXISTING: set[Path] = set()


def sweep_job(cfg: DictConfig) -> float:
    """One job of a sweep. A refused (exit 2) or failed job must not end the sweep: Hydra's basic launcher lets a
    SystemExit through and stops at the first failed job before its callbacks run, so no summary is written. The
    job's one-line error goes to FAILED_NAME in its folder instead (the sweep summary lists it and the sweep exits
    1), and the next job runs; Ctrl-C (exit 130) still ends the sweep."""
    try:
        return evaluate(cfg)
    except SystemExit as e:
        if e.code in (None, 0, 130):
            raise
        line = e.line if isinstance(e, RunExit) else str(e.code) if isinstance(e.code, str) else f"exit status {e.code}"
        code = e.code if isinstance(e.code, int) else 1
    except Exception as e:  # a bug or a device failure: the traceback to the job's log, one line to the summary
        log.exception("sweep job failed")
        line, code = f"{type(e).__name__}: {e}".splitlines()[0], 1
        print(f"mtp-eval: error: {line}", file=sys.stderr)
    job_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        job_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(job_dir / FAILED_NAME, json.dumps({"error": line, "exit": code}) + "\n")
    except OSError as e:
        print(f"mtp-eval: error: {job_dir / FAILED_NAME}: cannot record the failed job ({e})", file=sys.stderr)
    return float("nan")


def entry() -> None:
    """`mtp-eval`: under torchrun, ranks > 0 serve rank 0 (mtp.distributed.worker) and run no Hydra at all; rank 0 runs
    `main` after the checks Hydra cannot word (a launcher whose extra is missing)."""
    from .common import check_launcher, check_run_dirs, serve_other_ranks

    serve_other_ranks()

    check_launcher(sys.argv[1:])
    check_run_dirs(sys.argv[1:])
    _EXISTING.update(Path(a.partition("=")[2]).resolve() for a in sys.argv[1:]
                     if a.partition("=")[0].strip() == "hydra.run.dir" and Path(a.partition("=")[2]).is_dir())
    main()


if __name__ == "__main__":
    entry()
