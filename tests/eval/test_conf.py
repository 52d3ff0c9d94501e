"""Every config in conf/ composes with Hydra's compose API and validates against eval/schema.py; every sweep
point of every experiment preset validates too; bad values are refused with the key in the message."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from omegaconf import OmegaConf

import eval.schema as schema
from eval.common import NotAvailableError, check_runtime, generate_kwargs
from eval.data import builtin_suites, load_prompts
from eval.loggers import NullLogger, WandbLogger

CONF = Path(__file__).resolve().parents[2] / "conf"
GROUPS = ("model", "draft", "verify", "runtime", "dataset", "logger")
# Options whose required `???` values a real run passes on the command line.
REQUIRED = {"model/dsv32": ["model.path=/ckpt/DeepSeek-V3.2"], "dataset/local": ["dataset.path=prompts.jsonl"],
            "dataset/hub": ["dataset.hub=owner/name"]}
FIXED = ["output_dir=/tmp/mtp-eval-compose"]  # ${hydra:runtime.output_dir} exists only inside a Hydra run


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.fixture(scope="module", autouse=True)
def hydra_conf():
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield


def compose_eval(overrides: list[str], hydra_node: bool = False):
    return compose("eval", overrides=overrides + FIXED, return_hydra_config=hydra_node)


def test_every_group_has_options():
    for g in GROUPS + ("experiment",):
        assert options(g), f"conf/{g}/ is empty"
    assert set(options("draft")) == {"none", "vanilla", "eagle"}
    assert set(options("verify")) == {"strict", "relaxed", "sample", "typical"}
    assert set(options("logger")) == {"wandb", "none"}
    assert {"tiny", "dsv32"} <= set(options("model"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_group_option_composes_and_validates(group, option):
    cfg = compose_eval([f"{group}={option}"] + REQUIRED.get(f"{group}/{option}", []))
    typed = schema.validate(cfg)
    assert isinstance(typed, schema.EvalConfig)
    node = getattr(typed, group)
    assert not isinstance(node, dict), f"{group}={option} is not typed by a schema"
    if group == "logger":
        assert isinstance(instantiate(cfg.logger), (NullLogger, WandbLogger))
    if group == "dataset" and isinstance(node, schema.BuiltinDatasetSchema):
        prompts = load_prompts(node)
        assert prompts and len({p.id for p in prompts}) == len(prompts)
    if group in ("draft", "verify"):
        kw = generate_kwargs(cfg)
        assert kw["draft"] == typed.draft.name and kw["verify"] == typed.verify.name


def test_every_registered_drafter_and_verifier_has_a_conf_file():
    """`draft=<name>` / `verify=<name>` for every built-in registration: the file is there and names it."""
    from mtp.draft.modes import DRAFTERS
    from mtp.verify.registry import VERIFIER_REGISTRY

    for group, registry in (("draft", DRAFTERS), ("verify", VERIFIER_REGISTRY)):
        missing = sorted(set(registry) - set(options(group)))
        assert not missing, f"registered but without conf/{group}/<name>.yaml: {missing}"
        for name in registry:
            typed = schema.validate(compose_eval([f"{group}={name}"]))
            assert getattr(typed, group).name == name, f"conf/{group}/{name}.yaml names another {group}"


def test_typical_options_reach_generate_with_mtps_defaults():
    """verify=typical: its conf file's values are GenerationConfig's own defaults, every key reaches generate, and a
    bad value is refused naming its key."""
    from mtp.decode.config import GenerationConfig

    kw = generate_kwargs(compose_eval(["verify=typical"]))
    assert {key: kw[key] for key in ("verify", "temperature", "posterior_threshold", "posterior_alpha")} == \
        {"verify": "typical", "temperature": 1.0, "posterior_threshold": 0.09, "posterior_alpha": 0.3}
    assert "seed" not in kw  # typical draws nothing
    assert GenerationConfig.from_options(8, **kw) == GenerationConfig.from_options(8, kw["draft"], kw["k"], "typical")
    g = GenerationConfig.from_options(8, **generate_kwargs(compose_eval(
        ["verify=typical", "verify.temperature=0.5", "verify.posterior_threshold=0.2", "verify.posterior_alpha=0.1"])))
    assert (g.sampling.temperature, g.posterior_threshold, g.posterior_alpha) == (0.5, 0.2, 0.1)
    with pytest.raises(schema.SchemaError, match=r"verify\.posterior_threshold = 1\.5 is invalid: expected a "
                                                 r"probability in \(0, 1\]"):
        schema.validate(compose_eval(["verify=typical", "verify.posterior_threshold=1.5"]))
    with pytest.raises(ConfigCompositionException, match="verify.seed"):
        compose_eval(["verify=typical", "verify.seed=1"])


def _sweep_points(params) -> list[list[str]]:
    keys = list(params)
    values = [str(params[k]).split(",") for k in keys]
    return [[f"{k}={v.strip()}" for k, v in zip(keys, combo)] for combo in itertools.product(*values)]


@pytest.mark.parametrize("experiment", options("experiment"))
def test_experiment_composes_and_every_sweep_point_validates(experiment):
    extra = ["model.path=/ckpt/DeepSeek-V3.2"] if "dsv32" in experiment else []
    cfg = compose_eval([f"experiment={experiment}"] + extra, hydra_node=True)
    schema.validate(cfg)
    instantiate(cfg.logger)
    params = OmegaConf.select(cfg, "hydra.sweeper.params") or {}
    for point in _sweep_points(params):
        schema.validate(compose_eval([f"experiment={experiment}"] + extra + point))
    if params:
        assert cfg.hydra.mode.name == "MULTIRUN", f"{experiment} sweeps but does not set hydra.mode: MULTIRUN"


def test_chat_config_composes_with_shared_groups():
    cfg = compose("chat")
    typed = schema.validate(cfg)
    assert isinstance(typed, schema.ChatConfig)
    assert (typed.draft.name, typed.verify.name, typed.runtime.device) == ("eagle", "strict", "cpu")
    assert {"max_new_tokens", "thinking", "show_drafts"} <= set(cfg)
    relaxed = compose("chat", overrides=["verify=relaxed"])
    assert len(generate_kwargs(relaxed)["think_ids"]) == 2


@pytest.mark.parametrize("launcher", ["basic", "joblib"])
def test_launchers_compose(launcher):
    cfg = compose_eval([f"hydra/launcher={launcher}"], hydra_node=True)
    assert launcher in cfg.hydra.launcher._target_.lower()


def test_generate_kwargs_build_a_generation_config():
    from mtp.decode.config import GenerationConfig

    for ov in (["draft=vanilla", "verify=relaxed"], ["verify=sample", "verify.draft_sampling=sample"],
               ["draft=none"], ["draft=eagle", "draft.k=3", "runtime.prefill_chunk=4"]):
        kw = generate_kwargs(compose_eval(ov))
        g = GenerationConfig.from_options(8, **kw)  # an unknown option would raise TypeError
        assert (g.draft.mode, g.draft.k, g.verify) == (kw["draft"], kw["k"], kw["verify"])


@pytest.mark.parametrize("overrides,message", [
    (["draft.k=-1"], "draft.k = -1"),
    (["draft=none", "draft.k=2"], "draft.k = 2"),
    (["draft.k=99"], "draft.k = 99"),
    (["verify=relaxed", "verify.delta=1.5"], "verify.delta"),
    (["verify=sample", "verify.temperature=0"], "verify.temperature"),
    (["verify=sample", "verify.draft_sampling=sample", "draft=none"], "verify.draft_sampling"),
    (["runtime.batch_size=0"], "runtime.batch_size"),
    (["runtime.device=tpu"], "runtime.device"),
    (["max_new_tokens=0"], "max_new_tokens"),
    (["timing.repeats=0"], "timing.repeats"),
    (["model=dsv32"], "model.path is required"),
    (["dataset=local"], "dataset.path is required"),
    (["dataset.per_category=0"], "dataset.per_category"),
    (["dataset.suites=[]"], "dataset.suites"),
    (["draft.vocab_size=100"], "draft.vocab_size"),
    (["draft.vocab_file=v.json", "draft.vocab_size=0"], "draft.vocab_size"),
    (["draft.tree=2x0"], "draft.tree: tree shape '2x0' is invalid"),
    (["draft.tree=0/1.0.0"], "draft.tree: tree shape '0/1.0.0' is invalid"),
    (["draft=none", "draft.tree=2x1"], "draft.tree = '2x1' is invalid: expected null with draft=none"),
    (["draft.min_draft_prob=0.3"], "draft.min_draft_prob = 0.3 is invalid"),
    (["draft.tree=2x1", "draft.min_draft_prob=1.5"], "draft.min_draft_prob = 1.5 is invalid: expected a number in"),
    (["draft.tree=2x1", "verify=relaxed", "verify.span_rule=trtllm"], "verify.span_rule = 'trtllm'"),
    (["draft.tree=2x1", "draft.min_draft_prob=0.2", "verify=sample", "verify.draft_sampling=sample"],
     "draft.min_draft_prob = 0.2 is invalid: expected 0 with draft_sampling='sample'"),
    (["draft.tree=2x1", "verify=sample", "runtime.mode=graph"], "runtime.mode = 'graph' is invalid: expected 'eager'"),
    (["runtime.expert_layout=striped"], "runtime.expert_layout = 'striped' is invalid: expected one of"),
    (["runtime.load_reader=direct"], "runtime.load_reader = 'direct' is invalid: expected one of"),
    (["runtime=cuda", "runtime.fast_path=true", "runtime.elementwise=fused"],
     "runtime.elementwise = 'fused' is invalid: expected one of"),
    (["runtime.elementwise=compile"], "runtime.elementwise = 'compile' is invalid: expected 'triton' unless "
                                      "runtime.fast_path=true"),
])
def test_bad_values_are_refused_by_the_schema(overrides, message):
    with pytest.raises(schema.SchemaError, match=message.replace(".", r"\.")):
        schema.validate(compose_eval(overrides))


@pytest.mark.parametrize("layout", ["contiguous", "interleaved", "permuted", "split"])
def test_every_expert_layout_takes_the_fast_path(layout):
    """The fast path runs every expert layout (`FastMoE`), so the schema takes each one with it at tp > 1."""
    cfg = compose_eval(["runtime=cuda", "runtime.fast_path=true", "runtime.tp=2", f"runtime.expert_layout={layout}"])
    schema.validate(cfg)
    assert cfg.runtime.expert_layout == layout and cfg.runtime.fast_path


@pytest.mark.parametrize("overrides,message", [
    (["verify=nonsense"], "verify/nonsense"),
    (["draft.k=abc"], "draft.k=abc"),
    (["draft.target_hidden=middle"], "draft.target_hidden"),
    (["runtime.mode=turbo"], "runtime.mode"),
    (["verify.temperature=0.5"], "verify.temperature"),  # strict has no temperature
    (["dataset.path=x.jsonl"], "dataset.path"),  # builtin has no path
    (["verify=relaxed", "verify.span_rule=last"], "verify.span_rule"),
])
def test_bad_overrides_fail_at_composition(overrides, message):
    with pytest.raises(ConfigCompositionException, match=message.replace(".", r"\.")):
        compose_eval(overrides)


def test_span_rule_option_reaches_generate():
    from mtp.verify import SPAN_RULES

    assert [r.value for r in schema.SpanRule] == list(SPAN_RULES)  # the schema's choices are mtp's tuple
    assert generate_kwargs(compose_eval(["verify=relaxed"]))["span_rule"] == "tracked"
    assert generate_kwargs(compose_eval(["verify=relaxed", "verify.span_rule=trtllm"]))["span_rule"] == "trtllm"


def test_a_registered_verifier_is_one_override_away(registered):
    """A verifier registered outside eval/ runs as `verify.name=<it>` (its needs read from its registration: think ids
    from the tokenizer, a strict baseline and a strict reference for a lossy rule that does not sample); an unknown
    name is refused with the registered ones listed."""
    from mtp.decode.config import GenerationConfig
    from mtp.verify.registry import Verifier

    from eval.run import _baseline_kwargs, strict_source

    registered(Verifier("spans_only", "mtp.verify.strict:chain", needs_think_ids=True))
    cfg = compose_eval(["verify.name=spans_only", "baseline=true"])
    kw = generate_kwargs(cfg)
    assert kw["verify"] == "spans_only" and len(kw["think_ids"]) == 2
    assert GenerationConfig.from_options(8, **kw).verify == "spans_only"
    assert _baseline_kwargs(kw)["verify"] == "strict" and strict_source(schema.validate(cfg)) == "base"
    assert strict_source(schema.validate(compose_eval(["verify.name=spans_only", "baseline=false"]))) == "ref"
    with pytest.raises(schema.SchemaError, match="verify.name = 'nope' is invalid: expected one of strict, relaxed, "
                                                 "sample, typical, spans_only"):
        schema.validate(compose_eval(["verify.name=nope"]))


def test_a_registered_drafter_is_one_override_away(registered):
    """A drafter registered after eval.schema was imported runs as `draft.name=<it>` (the schema reads the registry
    when it validates, not a list frozen at import); an unknown name is refused with the registered ones listed."""
    from tests.draft.test_modes import FirstModule

    registered(FirstModule())
    cfg = compose_eval(["draft=vanilla", "draft.name=first_module", "draft.k=3"])
    kw = generate_kwargs(cfg)
    assert (kw["draft"], kw["k"], kw["reuse_modules"]) == ("first_module", 3, False)
    assert schema.validate(cfg).draft.name == "first_module"
    for config in ("eval", "chat", "serve"):
        with pytest.raises(schema.SchemaError, match="draft.name = 'medusa' is invalid: expected one of none, "
                                                     "vanilla, eagle, first_module"):
            schema.validate(compose(config, overrides=["draft.name=medusa"] + (FIXED if config == "eval" else [])))
    with pytest.raises(schema.SchemaError, match="draft.tree = '2x1' is invalid: expected null with draft=none"):
        schema.validate(compose_eval(["draft=none", "draft.tree=2x1"]))  # 'none' still drafts nothing
    with pytest.raises(schema.SchemaError, match="expected greedy with draft=none \\(there are no drafts to sample"):
        schema.validate(compose_eval(["draft=none", "verify=sample", "verify.draft_sampling=sample"]))
    assert "target_hidden" not in generate_kwargs(compose_eval(["draft=none"]))


def test_graph_modes_need_cuda():
    rt = schema.validate(compose_eval(["runtime.mode=graph"])).runtime
    with pytest.raises(NotAvailableError, match="cuda"):
        check_runtime(rt)


def test_builtin_suites_are_shipped():
    assert {"chat", "code", "math", "reasoning", "tools"} <= set(builtin_suites())


def test_tools_suite_is_one_override_away():
    """`dataset.suites=[tools]`: a dozen or more tool-use conversations of several turns with tool results, in
    their own category; every one renders in DeepSeek-V3.2's format and ends where the model writes next."""
    from mtp.text.prompt import render_chat

    ds = schema.validate(compose_eval(["dataset.suites=[tools]", "dataset.per_category=null"])).dataset
    prompts = load_prompts(ds)
    assert len(prompts) >= 12 and {p.category for p in prompts} == {"tools"}
    assert any(p.thinking for p in prompts) and not all(p.thinking for p in prompts)
    for p in prompts:
        roles = [m["role"] for m in p.messages]
        assert roles.count("tool") >= 1 and sum(bool(m.get("tool_calls")) for m in p.messages) >= 1, p.id
        assert len(roles) >= 4 and roles[-1] in ("tool", "user"), p.id
        assert render_chat(p.messages, p.thinking).endswith(("<think>", "</think>")), p.id


def test_tree_options_reach_the_tree_decoder():
    """draft.tree replaces k by the tree's depth and adds the tree kwargs; chat refuses trees; the settings
    tree decoding does not serve are refused before anything runs."""
    from eval import trees

    cfg = compose_eval(["draft=vanilla", "draft.tree=3x1x1", "draft.min_draft_prob=0.25"])
    assert schema.validate(cfg).draft.k == 3
    kw = generate_kwargs(cfg)
    assert (kw["tree"], kw["min_draft_prob"], kw["k"], kw["draft"]) == ("3x1x1", 0.25, 3, "vanilla")
    trees.check(kw, batch_size=4)
    with pytest.raises(schema.SchemaError, match="draft.tree = '2x1' is invalid: expected null: mtp-chat"):
        schema.validate(compose("chat", overrides=["draft.tree=2x1"]))
    with pytest.raises(schema.SchemaError, match="runtime.prefill_chunk = 8 is invalid: expected None with tree"):
        generate_kwargs(compose_eval(["draft.tree=2x1", "runtime.prefill_chunk=8"]))
    kw = generate_kwargs(compose_eval(["draft.tree=2x1", "verify=sample"]))
    with pytest.raises(NotAvailableError, match="runtime.batch_size=1, got 2"):
        trees.check(kw, batch_size=2)
    for mode in ("graph", "overlap"):  # the captured tree step (on CUDA; check_runtime refuses CPUs, as for chains)
        kw = schema.generation_options(schema.validate(compose_eval(["draft.tree=2x1", f"runtime.mode={mode}"])))
        assert (kw["mode"], kw["tree"]) == (mode, "2x1")
        trees.check(kw, batch_size=4)
