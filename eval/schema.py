"""Structured-config schemas of every `conf/` group, registered in Hydra's ConfigStore on import.

How the YAML files use them: each group option starts with `defaults: [/schema/<group>/<kind>@_here_, _self_]`,
so its keys are typed by the dataclass below. Types and choices (enums) are checked by OmegaConf while Hydra
composes (a bad override fails before anything runs); ranges and cross-field rules live in `__post_init__`,
which runs in `validate(cfg)` (OmegaConf.to_object builds the dataclasses). The generation options (draft,
verify, runtime.mode / prefill_chunk, max_new_tokens) are not checked here: the primary configs build a
`GenerationConfig` from them (`generation_options`), whose rules are mtp's one validation, and name the config
key of the option it refuses. Primary configs: `eval_schema` (conf/eval.yaml) and `chat_schema`
(conf/chat.yaml). A new key in a YAML file needs a field here.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf, open_dict
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from mtp.decode.config import GenerationConfig
from mtp.draft.modes import drafts
from mtp.spec.options import DEFAULT_LOAD_READER, LOAD_READERS, MLP_SPLITS, MODES, OptionError, SamplingParams
from mtp.draft.config import DRAFT_SAMPLING, HIDDEN
from mtp.placement import LAYOUT_CHOICES
from mtp.spec.options import SPAN_RULES
from mtp.verify.registry import VERIFIER_REGISTRY


class SchemaError(ValueError):
    """A composed config is outside the schema (range, cross-field rule or a required `???` value)."""


def _fail(key: str, value: Any, expected: str) -> None:
    raise SchemaError(f"{key} = {value!r} is invalid: expected {expected}")


# ---------------------------------------------------------------------------------------------- choices
# Member names are the YAML spellings; OmegaConf lists them when a value is not one of them. The generation
# options' choices are mtp's own tuples. draft.name and verify.name are plain strings: their choices are the
# registries', read when a config is validated (a drafter or verifier registered after this import is taken).
Hidden = Enum("Hidden", {n: n for n in HIDDEN})
DraftSampling = Enum("DraftSampling", {n: n for n in DRAFT_SAMPLING})
SpanRule = Enum("SpanRule", {n: n for n in SPAN_RULES})
RunMode = Enum("RunMode", {n: n for n in MODES})


class Numerics(Enum):
    fp8 = "fp8"
    dequant = "dequant"


class DType(Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"
    float64 = "float64"  # exactness checks (TP=N against TP=1), the reference path only


class WandbMode(Enum):
    auto = "auto"  # online when WANDB_API_KEY is set and the server answers, else offline
    online = "online"
    offline = "offline"
    disabled = "disabled"


def value(x: Any) -> Any:
    """The plain value of a config entry (enum member -> its YAML spelling)."""
    return x.value if isinstance(x, Enum) else x


# ---------------------------------------------------------------------------------------------- groups
@dataclass
class ModelSchema:
    name: str = MISSING
    path: Optional[str] = MISSING  # null: the bundled tiny checkpoint (mtp.checkpoint.tiny.default_checkpoint())
    tokenizer: Optional[str] = None  # folder with tokenizer.json; None: the checkpoint folder
    numerics: Numerics = Numerics.fp8
    n_mtp: Optional[int] = None  # MTP layers to load; None: all the checkpoint has

    def __post_init__(self):
        if self.n_mtp is not None and self.n_mtp < 0:
            _fail("model.n_mtp", self.n_mtp, "null or an integer >= 0")


@dataclass
class DraftSchema:
    name: str = MISSING  # a registered drafter (mtp.draft.modes): checked with the generation options
    k: int = 0
    target_hidden: Hidden = Hidden.normed  # target hidden that feeds MTP module 1
    chain_hidden: Hidden = Hidden.normed  # module output chained to the next draft
    reuse_modules: bool = False  # vanilla only: repeat the last module when k > MTP modules
    vocab_file: Optional[str] = None  # draft vocabulary (python -m mtp.draft.vocab): the head scores only its
    # ids (ignored with draft=none)
    vocab_size: Optional[int] = None  # ... only its first vocab_size ids (null: all of them)
    head_fp8: bool = False  # the drafts' logits from an FP8 copy of the head (mtp.draft.head_fp8; ignored with
    # draft=none); the verify keeps the model's head
    tree: Optional[str] = None  # draft tree (mtp.spec.tree_shape.TreeShape.parse: '2x1x1', '0/1/0.0'): the run decodes
    # with mtp.decode.tree (any runtime.mode), and the tree's depth replaces k
    min_draft_prob: float = 0.0  # adaptive draft length (with a tree): nodes drafted below this probability die

    def __post_init__(self):
        if self.tree is not None:
            self.k = _tree_depth(self)
        elif self.min_draft_prob != 0.0:
            _fail("draft.min_draft_prob", self.min_draft_prob, "0.0 without draft.tree (adaptive length runs "
                  "through tree decoding; a chain of K drafts is the tree 1x1x..., K times)")
        if self.vocab_size is not None and self.vocab_file is None:
            _fail("draft.vocab_size", self.vocab_size, "null unless draft.vocab_file is set")
        if self.vocab_size is not None and self.vocab_size < 1:
            _fail("draft.vocab_size", self.vocab_size, "null or an integer >= 1")


def _tree_depth(d: DraftSchema) -> int:
    """The depth of draft.tree (the shape is parsed where it is defined, with its own error naming the value)."""
    if not drafts(d.name):
        _fail("draft.tree", d.tree, f"null with draft={d.name} (plain decoding drafts nothing)")
    from mtp.spec.tree_shape import TreeShape  # imports torch: only for tree runs

    try:
        return TreeShape.parse(d.tree).max_depth
    except ValueError as e:
        raise SchemaError(f"draft.tree: {e}") from None


@dataclass
class VerifySchema:
    """A verifier's group: `name` (a registered verifier, mtp.verify.registry) and its options, each key a
    `mtp.generate` option of the same name (`generation_options` passes them on as they are)."""

    name: str = MISSING


@dataclass
class StrictVerifySchema(VerifySchema):
    name: str = "strict"


@dataclass
class RelaxedVerifySchema(VerifySchema):
    name: str = "relaxed"
    top_n: int = 10  # a draft must be among the target's top-n ...
    delta: float = 0.6  # ... with probability >= p_top1 - delta (probability space), inside thinking spans
    span_rule: SpanRule = SpanRule.tracked  # where spans are: tracked (ours) | trtllm (TensorRT-LLM's rule)


@dataclass
class SampleVerifySchema(VerifySchema):
    name: str = "sample"
    temperature: float = 1.0
    top_p: float = 1.0  # 1.0 = off
    top_k: int = 0  # 0 = off
    draft_sampling: DraftSampling = DraftSampling.greedy
    seed: int = 0


@dataclass
class TypicalVerifySchema(VerifySchema):
    """Typical acceptance (mtp/verify/typical.py): draws nothing, so it has no seed; its defaults are mtp's."""

    name: str = "typical"
    temperature: float = SamplingParams.temperature  # of the target distribution p whose entropy sets the bar
    posterior_threshold: float = GenerationConfig.posterior_threshold  # x passes if p(x) > min(this, ...
    posterior_alpha: float = GenerationConfig.posterior_alpha  # ... posterior_alpha * exp(-entropy of p))


_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


@dataclass
class RuntimeSchema:
    device: str = "cpu"
    dtype: DType = DType.float32
    batch_size: int = 1  # prompts per generate call (mtp-eval); batches never mix categories
    max_model_len: Optional[int] = None  # prompt + max_new_tokens cap; None: the model's context length
    mode: RunMode = RunMode.eager  # graph / overlap: CUDA-graph runner (mtp/decode/graphs.py), CUDA only
    num_threads: Optional[int] = None  # torch CPU threads; None: torch's default
    warmup: bool = True  # one short untimed generate before measuring
    fast_path: bool = False  # Triton kernels + fused glue (mtp.backends.fast_path), CUDA + fp8 numerics only
    elementwise: str = "triton"  # the fast path's glue ops: triton | compile (torch.compile) | eager
    prefill_chunk: Optional[int] = None  # prefill in chunks of this many tokens (long prompts); None: one pass
    tp: int = 1  # ranks the model is split over (tensor + expert parallel): spawned here, or torchrun's
    mlp_split: str = "blocks"  # how dense / shared-expert MLPs split over ranks (mtp.parallel.layout)
    allreduce: str = "nccl"  # the ranks' all-reduce: nccl | oneshot (NVLink peer memory, mtp.parallel.oneshot; CUDA)
    expert_layout: str = "auto"  # which routed experts each rank holds (mtp.placement; auto: split where the blocks divide)
    load_reader: str = DEFAULT_LOAD_READER  # how the shards are read: pread (mtp.checkpoint.reader) | mmap (safetensors); same bytes

    def __post_init__(self):
        if self.tp < 1:
            _fail("runtime.tp", self.tp, "an integer >= 1")
        if self.tp > 1 and self.device not in ("cpu", "cuda"):
            _fail("runtime.device", self.device, "'cpu' or 'cuda' with runtime.tp > 1 (rank r uses GPU r)")
        if self.mlp_split not in MLP_SPLITS:
            _fail("runtime.mlp_split", self.mlp_split, f"one of {list(MLP_SPLITS)}")
        from mtp.parallel.comm import ALLREDUCE_IMPLS  # here: the schema module itself stays torch-free

        if self.allreduce not in ALLREDUCE_IMPLS:
            _fail("runtime.allreduce", self.allreduce, f"one of {list(ALLREDUCE_IMPLS)}")
        if self.allreduce != "nccl" and not (self.tp > 1 and self.device.startswith("cuda")):
            _fail("runtime.allreduce", self.allreduce, "'nccl' unless runtime.tp > 1 on cuda (peer memory of GPUs)")
        from mtp.kernels.dispatch import ELEMENTWISE_IMPLS

        if self.elementwise not in ELEMENTWISE_IMPLS:
            _fail("runtime.elementwise", self.elementwise, f"one of {list(ELEMENTWISE_IMPLS)}")
        if self.elementwise != "triton" and not self.fast_path:
            _fail("runtime.elementwise", self.elementwise, "'triton' unless runtime.fast_path=true (it picks the "
                  "fast path's ops)")
        if self.expert_layout not in LAYOUT_CHOICES:
            _fail("runtime.expert_layout", self.expert_layout, f"one of {list(LAYOUT_CHOICES)}")
        if self.load_reader not in LOAD_READERS:
            _fail("runtime.load_reader", self.load_reader, f"one of {list(LOAD_READERS)}")
        if self.fast_path and not self.device.startswith("cuda"):
            _fail("runtime.fast_path", True, "false unless runtime.device is cuda (the Triton kernels need a GPU)")
        if not _DEVICE.match(self.device):
            _fail("runtime.device", self.device, "'cpu', 'cuda' or 'cuda:N'")
        if self.batch_size < 1:
            _fail("runtime.batch_size", self.batch_size, "an integer >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            _fail("runtime.max_model_len", self.max_model_len, "null or an integer >= 2")
        if self.num_threads is not None and self.num_threads < 1:
            _fail("runtime.num_threads", self.num_threads, "null or an integer >= 1")


@dataclass
class FieldMap:
    """Dataset column names for each prompt field (null: the dataset has no such column)."""

    id: Optional[str] = "id"
    prompt: Optional[str] = "prompt"  # a single user message
    messages: Optional[str] = "messages"  # a chat: [{role, content}, ...]; wins over `prompt`
    turns: Optional[str] = "turns"  # MT-Bench / SpecBench: user turns, each answered by the model before the next
    category: Optional[str] = "category"
    thinking: Optional[str] = "thinking"
    answer: Optional[str] = "answer"  # reference answer: task accuracy (last number of the output vs of this)


@dataclass
class DatasetSchema:
    """Common to every prompt source; the subclass (the schema of the chosen option) says where rows come from."""

    name: str = MISSING
    fields: FieldMap = field(default_factory=FieldMap)
    category: Optional[str] = None  # category of rows without one; None: the dataset name
    thinking: bool = False  # thinking mode of rows without a `thinking` field
    categories: list[str] = field(default_factory=list)  # keep only these categories ([] = all)
    per_category: Optional[int] = None  # first N prompts of each category
    limit: Optional[int] = None  # first N prompts overall

    def __post_init__(self):
        for key in ("per_category", "limit"):
            n = getattr(self, key)
            if n is not None and n < 1:
                _fail(f"dataset.{key}", n, "null or an integer >= 1")


@dataclass
class BuiltinDatasetSchema(DatasetSchema):
    suites: list[str] = field(default_factory=list)  # mtp/data/prompts/<suite>.jsonl

    def __post_init__(self):
        super().__post_init__()
        if not self.suites:
            _fail("dataset.suites", list(self.suites), "at least one built-in suite")


@dataclass
class LocalDatasetSchema(DatasetSchema):
    path: str = MISSING  # a .jsonl / .json / .parquet file

    def __post_init__(self):
        super().__post_init__()
        if not self.path.endswith((".jsonl", ".json", ".parquet")):
            _fail("dataset.path", self.path, "a file ending in .jsonl, .json or .parquet")


@dataclass
class BundledDatasetSchema(DatasetSchema):
    file: str = MISSING  # a .jsonl file under mtp/data/benchmarks/ (subsets of public benchmarks, offline)


@dataclass
class HubDatasetSchema(DatasetSchema):
    hub: str = MISSING  # dataset name on the Hugging Face hub
    subset: Optional[str] = None  # configuration name
    split: str = "test"


@dataclass
class LoggerSchema:
    _target_: str = MISSING


@dataclass
class NullLoggerSchema(LoggerSchema):
    _target_: str = f"{__package__}.loggers.NullLogger"


@dataclass
class WandbLoggerSchema(LoggerSchema):
    _target_: str = f"{__package__}.loggers.WandbLogger"
    project: str = "mtp-spec"
    entity: Optional[str] = None
    mode: WandbMode = WandbMode.auto
    group: Optional[str] = None  # None: the multirun folder name in sweeps, no group otherwise
    tags: list[str] = field(default_factory=list)
    job_type: str = "eval"
    init_timeout_s: float = 30.0
    log_samples: bool = True
    save_dir: Optional[str] = None  # where the local wandb/ folder goes; None: wandb's default

    def __post_init__(self):
        if not self.init_timeout_s > 0:
            _fail("logger.init_timeout_s", self.init_timeout_s, "> 0 seconds")


@dataclass
class TimingSchema:
    """How speed is measured: every batch runs `repeats` times, baseline and speculative interleaved
    (b, s, b, s, ...), and tok/s and speedup are reported as the median with the min-max over repeats."""

    repeats: int = 3

    def __post_init__(self):
        if self.repeats < 1:
            _fail("timing.repeats", self.repeats, "an integer >= 1")


# ---------------------------------------------------------------------------------------------- primary
@dataclass
class EvalConfig:
    model: Any = MISSING
    draft: Any = MISSING
    verify: Any = MISSING
    runtime: Any = MISSING
    dataset: Any = MISSING
    logger: Any = MISSING
    task_name: str = "eval"
    max_new_tokens: int = 32
    thinking: Optional[bool] = None  # None: each prompt's own `thinking`; true/false forces it
    system_prompt: Optional[str] = None
    baseline: bool = False  # also run draft=none on the same prompts: speedup + strict-output check
    compare_strict: bool = True  # relaxed / sample: compare the outputs with strict greedy decoding's
    timing: TimingSchema = field(default_factory=TimingSchema)
    resume: bool = False  # continue samples.jsonl in the run dir, skipping finished prompts
    plots: bool = True
    deep_fingerprint: bool = False  # provenance: hash the shards' contents too, not only names and sizes
    output_dir: str = MISSING

    def __post_init__(self):
        _check_generation(self)


@dataclass
class ChatConfig:
    model: Any = MISSING
    draft: Any = MISSING
    verify: Any = MISSING
    runtime: Any = MISSING
    max_new_tokens: int = 512
    thinking: bool = True  # the bundled model's training format (MODEL_CARD.md); off answers it with noise
    show_drafts: bool = False  # mark which tokens came from accepted drafts

    def __post_init__(self):
        _chains_only(self, "mtp-chat")
        _check_generation(self)


@dataclass
class ServeConfig:
    """`mtp-serve`: the model and the default generation settings of requests that do not set their own."""

    model: Any = MISSING
    draft: Any = MISSING
    verify: Any = MISSING
    runtime: Any = MISSING
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: Optional[str] = None  # None: the model's label (the bundled model's folder name)
    max_new_tokens: int = 512  # a request's max_tokens when it gives none
    thinking: bool = True  # a chat request's thinking mode when it does not say

    def __post_init__(self):
        _chains_only(self, "mtp-serve")
        if not 0 <= self.port <= 65535:
            _fail("port", self.port, "a TCP port in [0, 65535] (0: any free port)")
        _check_generation(self)


def _chains_only(cfg: ChatConfig | ServeConfig, tool: str) -> None:
    if cfg.draft.tree is not None:
        _fail("draft.tree", cfg.draft.tree, f"null: {tool} decodes chains (tree decoding runs in mtp-eval)")


# generate()'s option -> its key in conf/: how an OptionError from mtp's validation is reported
CONFIG_KEYS = {"max_new_tokens": "max_new_tokens", "draft": "draft.name", "k": "draft.k",
               "target_hidden": "draft.target_hidden", "chain_hidden": "draft.chain_hidden",
               "reuse_modules": "draft.reuse_modules", "verify": "verify.name", "top_n": "verify.top_n",
               "delta": "verify.delta", "span_rule": "verify.span_rule", "temperature": "verify.temperature",
               "top_p": "verify.top_p", "top_k": "verify.top_k", "draft_sampling": "verify.draft_sampling",
               "seed": "verify.seed", "mode": "runtime.mode", "prefill_chunk": "runtime.prefill_chunk",
               "tree": "draft.tree", "min_draft_prob": "draft.min_draft_prob", "draft_head_fp8": "draft.head_fp8",
               "posterior_threshold": "verify.posterior_threshold", "posterior_alpha": "verify.posterior_alpha"}


def generation_options(cfg: EvalConfig | ChatConfig | ServeConfig) -> dict:
    """`mtp.generate` keyword options of a typed config's draft, verify and runtime groups (all but
    max_new_tokens; runtime.mode only when it is not eager). What needs files is left to
    `eval.common.generate_kwargs`: think_ids (the tokenizer's) and draft_vocab (draft.vocab_file)."""
    d, v, rt = cfg.draft, cfg.verify, cfg.runtime
    kw: dict = {"draft": d.name, "k": d.k, "verify": v.name}
    if drafts(d.name):
        kw.update(target_hidden=value(d.target_hidden), chain_hidden=value(d.chain_hidden),
                  reuse_modules=d.reuse_modules)
        if d.head_fp8:
            kw["draft_head_fp8"] = True
        if d.tree is not None:
            kw.update(tree=d.tree, min_draft_prob=d.min_draft_prob)
    kw.update({f.name: value(getattr(v, f.name)) for f in fields(v) if f.name != "name"})  # the verifier's options
    if value(rt.mode) != RunMode.eager.value:
        kw["mode"] = value(rt.mode)
    if rt.prefill_chunk is not None:
        kw["prefill_chunk"] = rt.prefill_chunk
    return kw


def _check_generation(cfg: EvalConfig | ChatConfig | ServeConfig) -> None:
    """The generation options through mtp's own rules (a GenerationConfig built from them), reported by key."""
    kw = generation_options(cfg)
    needs = VERIFIER_REGISTRY.get(kw["verify"])  # an unregistered name is GenerationConfig's to refuse
    if needs is not None and needs.needs_think_ids:
        kw["think_ids"] = (0, 1)  # a stand-in: the tokenizer's ids come with generate_kwargs
    try:
        GenerationConfig.from_options(cfg.max_new_tokens, **kw)
    except OptionError as e:
        _fail(CONFIG_KEYS.get(e.name, e.name), e.value, e.expected + (f" ({e.note})" if e.note else ""))
    # not a rule of mtp's (draft=none with sampled drafts simply draws nothing), but a config asking for it
    # is a mistake
    if kw.get("draft_sampling") == "sample" and not drafts(kw["draft"]):
        _fail("verify.draft_sampling", "sample", f"greedy with draft={kw['draft']} (there are no drafts to sample)")


def register() -> None:
    # `_target_`s name this package as it is imported: `eval` in the repository, `mtp_eval` once installed
    if not OmegaConf.has_resolver("eval_pkg"):
        OmegaConf.register_new_resolver("eval_pkg", lambda: __package__)
    cs = ConfigStore.instance()
    cs.store(name="eval_schema", node=EvalConfig)
    cs.store(name="chat_schema", node=ChatConfig)
    cs.store(name="serve_schema", node=ServeConfig)
    for group, name, node in (
        ("model", "base", ModelSchema), ("draft", "base", DraftSchema), ("runtime", "base", RuntimeSchema),
        ("dataset", "builtin", BuiltinDatasetSchema), ("dataset", "local", LocalDatasetSchema),
        ("dataset", "bundled", BundledDatasetSchema),
        ("dataset", "hub", HubDatasetSchema), ("verify", "strict", StrictVerifySchema),
        ("verify", "relaxed", RelaxedVerifySchema), ("verify", "sample", SampleVerifySchema),
        ("verify", "typical", TypicalVerifySchema),
        ("logger", "none", NullLoggerSchema), ("logger", "wandb", WandbLoggerSchema),
    ):
        cs.store(group=f"schema/{group}", name=name, node=node)


register()


def validate(cfg: DictConfig | EvalConfig | ChatConfig) -> EvalConfig | ChatConfig:
    """Typed, range-checked copy of a composed config (its `hydra` node, if any, is left out).

    Raises SchemaError naming the key, the value and what was expected."""
    if not isinstance(cfg, DictConfig):
        return cfg
    cfg = copy.deepcopy(cfg)
    with open_dict(cfg):
        cfg.pop("hydra", None)
    try:
        return OmegaConf.to_object(cfg)
    except MissingMandatoryValue as e:
        key = e.full_key or "?"
        hint = {"model.path": " (the folder of the DeepSeek-V3.2 checkpoint)", "dataset.path": " (a .jsonl, .json "
                "or .parquet file)", "dataset.hub": " (a Hugging Face hub dataset name)"}.get(key, "")
        raise SchemaError(f"{key} is required{hint}: it is '???' in the config; pass {key}=...") from None
    except OmegaConfBaseException as e:
        raise SchemaError(str(e).splitlines()[0]) from None

