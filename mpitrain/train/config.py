"""One source of configuration truth for ``python -m mpitrain``.

A frozen dataclass holds every knob of a training job. Values come from three layers, later ones
winning: the defaults written below < ``MPITRAIN_<FIELD>`` environment variables < command-line
flags (cli.py builds one flag per field from the metadata here, so the layers cannot drift
apart).
Units live in the names or the help text (``fusion_threshold_bytes``, ``checkpoint_every`` in
steps), never in a second place with a second unit -- Horovod sets its fusion threshold in three
places in two units, which is what this file exists to avoid.

``validate()`` checks everything that can be checked from the config alone, so every rank reaches
the same verdict without talking to the others; the one-line error names the offending value.
"""
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

from mpitrain import comm
from mpitrain.data import NORMALIZATIONS
from mpitrain.data.catalog import SPECS
from mpitrain.data.locate import env_data_dir
from mpitrain.nn import models
from mpitrain.optim import SCHEDULES
from mpitrain.parallel.optimizer import AVERAGE_MODES
from mpitrain.parallel.sharded import SHARDINGS, check_mode as check_sharding
from mpitrain.runtime import env
from mpitrain.runtime import threads as thread_budget
from mpitrain.runtime.errors import UsageError
from mpitrain.train.flag_types import (field_type, parse_augment, parse_betas, parse_hidden,
                                       parse_milestones, parse_signals, parse_value)

# Choices come from the modules that own them; the ones only the CLI offers are set here.
MODELS = models.names
DATASETS = tuple(SPECS) + ("synthetic",)
# Datasets named by a path: a text file (--model gpt) or the user's own arrays.
DATASET_PREFIXES = ("text:", "npz:")
TOKENS = ("chars", "bytes")
# Per-sample shape of each real dataset, so model/dataset mismatches fail before any data is read.
DATASET_SHAPES = {name: spec.sample_shape for name, spec in SPECS.items()}
OPTIMIZERS = ("sgd", "adam", "adamw")
ENV_PREFIX = "MPITRAIN_"


def _opt(default, help, choices=None, flag_type=None, off_flag=None, path_prefixes=()):
    """A field; ``off_flag`` names a second bool flag that sets it to False (its variable
    MPITRAIN_<OFF_FLAG> is read too, inverted, when MPITRAIN_<FIELD> is unset);
    ``path_prefixes``: besides its ``choices``, the field takes PREFIX + a path."""
    return field(default=default, metadata={"help": help, "choices": choices, "type": flag_type,
                                            "off_flag": off_flag, "path_prefixes": path_prefixes})


def path_choice(f, value):
    """Whether ``value`` of field ``f`` is one of its prefixes and a path (not a choice)."""
    return bool(f.metadata.get("path_prefixes")) and str(value).startswith(
        f.metadata["path_prefixes"])


@dataclass(frozen=True)
class Config:
    """Every knob of a training job, in the sections of SECTIONS; a field name is its flag
    (--batch-size) and its variable's suffix (MPITRAIN_BATCH_SIZE)."""

    # -- model (see SECTIONS)
    model: str = _opt("mlp", "model from the zoo", choices=MODELS)
    hidden: Optional[tuple] = _opt(None, "MLP hidden widths, e.g. 256,128 (default: the zoo's)",
                                   flag_type=parse_hidden)
    dropout: float = _opt(0.0, "dropout probability before the output layer of the zoo model; "
                               "--model gpt: on the embeddings, attention and residuals "
                               "(0 = none)")
    sync_bn: bool = _opt(False, "SyncBatchNorm: BatchNorm statistics of the global batch "
                                "(two small allreduces per BatchNorm layer and step) instead of "
                                "each rank's own")
    n_layer: int = _opt(4, "--model gpt: transformer blocks")
    n_head: int = _opt(4, "--model gpt: attention heads (must divide --n-embd)")
    n_embd: int = _opt(128, "--model gpt: embedding width")
    block_size: int = _opt(64, "--model gpt: context length in tokens (a training sample is a "
                               "window of block_size + 1 tokens)")
    dataset: str = _opt("fashion-mnist", "training/test data: " + ", ".join(DATASETS)
                        + ", text:PATH (a UTF-8 file, for --model gpt; 90/10 train/val split) "
                          "or npz:PATH (your arrays x, y in an .npz or x.npy/y.npy)",
                        choices=DATASETS, path_prefixes=DATASET_PREFIXES)
    tokens: str = _opt("chars", "--dataset text: chars (the file's characters are the "
                                "vocabulary) or bytes (256 byte values)", choices=TOKENS)
    data_dir: Optional[str] = _opt(None, "dataset folder, the only place looked in: missing or "
                                         "lacking the files is an error (default: mpitrain.data's "
                                         "search path)")
    synthetic_samples: int = _opt(4096, "training samples of --dataset synthetic (test: 1/4)")
    normalize: str = _opt("fixed", "per-channel input standardisation: fixed (the training "
                                   "split's published mean/std), train (recomputed from the "
                                   "loaded training set) or none (pixels in [0, 1])",
                          choices=NORMALIZATIONS)
    augment: str = _opt("none", "training augmentation: none, or any of crop,flip (random crop "
                                "with zero padding, horizontal flip; per sample, keyed by seed, "
                                "epoch and sample index)", flag_type=parse_augment)
    crop_padding: Optional[int] = _opt(None, "pixels of zero padding for --augment crop "
                                             "(default: 2 on 28x28 images, 4 on 32x32)")

    # -- schedule (see SECTIONS)
    epochs: int = _opt(1, "passes over the training set (ignored when --steps is given)")
    steps: Optional[int] = _opt(None, "total optimizer steps; overrides --epochs; a resumed run "
                                      "continues up to it")
    batch_size: int = _opt(64, "samples per rank per backward pass (global batch = ranks x this "
                               "x --accumulate)")
    global_batch_size: Optional[int] = _opt(None, "samples per optimizer step over all ranks; "
                                                  "sets --batch-size to it / (ranks x "
                                                  "--accumulate), refused if that does not "
                                                  "divide: the same global batch at any N "
                                                  "(a restart on fewer ranks)")
    accumulate: int = _opt(1, "backward passes per optimizer step: gradients of K consecutive "
                              "micro-batches of --batch-size are summed, then averaged across "
                              "ranks once (the update of one rank with the whole global batch)")
    uneven: bool = _opt(False, "train each epoch's last, partial global batch too (default: "
                               "dropped): one smaller step, every sample used once; ranks with "
                               "no share of it wait in mt.join")
    eval_every: int = _opt(0, "steps between test evaluations (0 = at the end of every epoch)")
    eval_batches: int = _opt(50, "--dataset text: the validation set is this many global "
                                 "batches of windows, drawn from --seed alone (val_loss)")
    seed: int = _opt(0, "seed for the model init and the data order (same on every rank)")

    # -- optimizer (see SECTIONS)
    optimizer: str = _opt("sgd", "optimizer", choices=OPTIMIZERS)
    lr: float = _opt(0.05, "learning rate, used as given (see --scale-lr)")
    scale_lr: bool = _opt(False, "multiply --lr by the number of ranks")
    warmup_epochs: float = _opt(0.0, "linear lr warm-up from lr/steps to lr over this many epochs")
    warmup_steps: int = _opt(0, "linear lr warm-up over this many steps (lr/W, 2lr/W, ..., lr)")
    lr_schedule: str = _opt("constant", "lr decay, times the warm-up: constant, step (x gamma "
                                        "after each --lr-milestones epoch) or cosine (per step, "
                                        "to 0 at the end of the run)", choices=SCHEDULES)
    lr_milestones: Optional[tuple] = _opt(None, "epochs after which --lr-schedule step "
                                                "multiplies the lr by --lr-gamma, e.g. 30,60",
                                          flag_type=parse_milestones)
    lr_gamma: float = _opt(0.1, "lr factor at each --lr-milestones epoch")
    min_lr: float = _opt(0.0, "--lr-schedule cosine: the lr it anneals to")
    momentum: float = _opt(0.9, "SGD momentum (0 = plain SGD)")
    betas: tuple = _opt((0.9, 0.999), "adam, adamw: decay rates of the moment averages, "
                                      "e.g. 0.9,0.99", flag_type=parse_betas)
    weight_decay: float = _opt(0.0, "weight decay: L2 (sgd, adam) or decoupled (adamw)")
    decay_bn_bias: bool = _opt(False, "decay every parameter; by default parameters with ndim <= 1 "
                                      "(biases, BatchNorm weight and bias) get no weight decay "
                                      "(--no-decay-bn-bias)", off_flag="no_decay_bn_bias")
    clip_grad_norm: Optional[float] = _opt(None, "clip the global 2-norm of the averaged "
                                                 "gradients to this before each update")
    nonfinite_steps: int = _opt(3, "stop the job (one line, exit 2) when the training loss is "
                                   "NaN or infinite on some rank for this many consecutive "
                                   "steps (0 = never: train on)")

    # -- parallel (see SECTIONS)
    average: str = _opt("gradients", "average gradients before every update (Horovod) or "
                                     "weights every --average-every steps (PNNL)",
                        choices=AVERAGE_MODES)
    average_every: int = _opt(1, "steps between weight averages (--average weights)")
    sharding: str = _opt("none", "split across ranks: optimizer = each rank keeps and steps "
                                 "the optimizer state of 1/N of the parameters; gradients = "
                                 "and of the gradients, reduce-scattered; parameters = and "
                                 "the parameters, gathered layer by layer (same bits)",
                         choices=SHARDINGS)
    fp16_allreduce: bool = _opt(False, "send float32 gradients as float16")
    fusion_threshold_bytes: Optional[int] = _opt(None, "gradient bucket size in bytes (0 = one "
                                                       "allreduce per tensor; default 4 MiB "
                                                       "with overlap, 64 MiB without)")
    overlap: bool = _opt(True, "overlap each gradient bucket's allreduce with the rest of "
                               "backward (--no-overlap: average after backward)",
                         off_flag="no_overlap")
    deterministic: bool = _opt(False, "bitwise-identical parameters for every power-of-two "
                                      "number of ranks dividing --micro-shards: one pass per "
                                      "micro-shard, gradients summed in one fixed tree")
    micro_shards: int = _opt(8, "--deterministic: micro-shards per global batch (a power of two; "
                                "the global batch must divide by it)")

    # -- runtime (see SECTIONS)
    device: str = _opt("cpu", "where the model runs", choices=("cpu", "cuda"))
    kernels: Optional[str] = _opt(None, "kernel flavour (default: numba on cpu, cupy on cuda)",
                                  choices=("numba", "cupy"))
    threads: int = _opt(0, "BLAS + Numba threads per rank (0 = cores / ranks on this node, >= 1)")

    # -- outputs (see SECTIONS)
    checkpoint_dir: Optional[str] = _opt(None, "folder for checkpoints (rank 0 writes)")
    checkpoint_every: int = _opt(0, "steps between checkpoints (0 = only at the end); "
                                    "needs --checkpoint-dir")
    resume: bool = _opt(False, "continue from the newest valid checkpoint in --checkpoint-dir "
                               "(a folder that does not exist is an error)")
    resume_if_exists: bool = _opt(False, "--resume when --checkpoint-dir holds checkpoints, else "
                                         "start at step 0 (the first launch and every restart "
                                         "can run the same command)")
    keep_checkpoints: int = _opt(3, "checkpoints kept in --checkpoint-dir: the newest K (0 = all)")
    checkpoint_async: bool = _opt(False, "write checkpoints on a background thread: the state is "
                                         "copied at the step, the file written while training "
                                         "goes on (the next checkpoint waits for it; a failed "
                                         "write stops every rank at the next step)")
    preempt_signals: str = _opt("TERM,USR1", "signals that stop the job at the next step with a "
                                             "checkpoint and exit code 32 (preempted), any of "
                                             "TERM,USR1,USR2,INT,HUP or none",
                                flag_type=parse_signals)
    save: Optional[str] = _opt(None, "write the final parameters to this .npz (keys: names)")
    metrics_json: Optional[str] = _opt(None, "append JSON-lines metrics to this file (rank 0)")
    progress: bool = _opt(True, "a progress bar on rank 0 when stderr is a terminal (a log "
                                "gets the evaluation lines only; --no-progress: none)",
                          off_flag="no_progress")
    timeline: Optional[str] = _opt(None, "write a Chrome-trace JSON of every rank's spans to this "
                                         "file (rank 0 merges; opens in Perfetto)")
    tensorboard: Optional[str] = _opt(None, "write TensorBoard event files of the step and eval "
                                            "records into this folder (rank 0; needs the "
                                            "tensorboard extra)")
    sample: int = _opt(0, "--model gpt: print this many generated characters at the end")
    temperature: float = _opt(0.8, "--sample: softmax temperature (0 = greedy)")

    def validate(self):
        """Raise UsageError naming the first offending value; return self when all is well."""
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if path_choice(f, value):
                if not value.split(":", 1)[1]:
                    raise UsageError(f"{_flag(f.name)} {value!r}: give a path after the colon")
                continue
            if choices and value is not None and value not in choices:
                paths = ", ".join(f"{p}PATH" for p in f.metadata["path_prefixes"])
                raise UsageError(f"{_flag(f.name)} {value!r}: expected one of "
                                 f"{', '.join(choices)}{', or ' + paths if paths else ''}")
        for f in dataclasses.fields(self):      # inf passes "> 0", nan fails every test
            value = getattr(self, f.name)
            if field_type(f) is float and value is not None and not math.isfinite(value):
                raise UsageError(f"{_flag(f.name)} {value!r}: must be a finite number")
        at_least = {"epochs": 1, "batch_size": 1, "accumulate": 1, "average_every": 1,
                    "synthetic_samples": 1, "fusion_threshold_bytes": 0, "checkpoint_every": 0,
                    "eval_every": 0, "threads": 0, "seed": 0, "steps": 1, "keep_checkpoints": 0,
                    "global_batch_size": 1, "n_layer": 1, "n_head": 1, "n_embd": 1,
                    "block_size": 1, "eval_batches": 1, "warmup_steps": 0, "sample": 0,
                    "nonfinite_steps": 0}
        for name, low in at_least.items():
            if getattr(self, name) is not None and getattr(self, name) < low:
                raise UsageError(f"{_flag(name)} {getattr(self, name)!r}: must be >= {low}")
        for name, ok, rule in (("lr", self.lr > 0, "> 0"),
                               ("momentum", 0 <= self.momentum < 1, "in [0, 1)"),
                               ("weight_decay", self.weight_decay >= 0, ">= 0"),
                               ("dropout", 0 <= self.dropout < 1, "in [0, 1)"),
                               ("warmup_epochs", self.warmup_epochs >= 0, ">= 0"),
                               ("min_lr", 0 <= self.min_lr <= self.lr, "in [0, --lr]"),
                               ("temperature", self.temperature >= 0, ">= 0"),
                               ("clip_grad_norm", self.clip_grad_norm is None
                                or self.clip_grad_norm > 0, "> 0")):
            if not ok:
                raise UsageError(f"{_flag(name)} {getattr(self, name)!r}: must be {rule}")
        self._validate_recipe()
        self._validate_gpt()
        if (self.checkpoint_every or self.resuming) and not self.checkpoint_dir:
            what = ("--resume" if self.resume else "--resume-if-exists" if self.resume_if_exists
                    else f"--checkpoint-every {self.checkpoint_every}")
            raise UsageError(f"{what} needs --checkpoint-dir")
        if self.average == "weights" and self.checkpoint_every % self.average_every:
            # Between averages the replicas differ; a checkpoint must hold one model, not N.
            raise UsageError(f"--checkpoint-every {self.checkpoint_every} must be a multiple of "
                             f"--average-every {self.average_every} with --average weights")
        if self.fp16_allreduce and self.average == "weights":
            raise UsageError("--fp16-allreduce compresses gradients; it does not apply to "
                             "--average weights")
        if self.uneven and self.average == "weights":
            # a joined rank gives zeros, which only an average of gradients can weigh
            raise UsageError("--uneven needs --average gradients (a rank without samples in "
                             "the last step has no weights of its own to average)")
        if self.uneven and self.accumulate > 1:
            raise UsageError(f"--uneven with --accumulate {self.accumulate}: the last, partial "
                             f"step cannot be cut into {self.accumulate} micro-batches; use one")
        self._validate_deterministic()
        try:                # flags and env were parsed by it already; a Config built in code not
            parse_signals(self.preempt_signals)
        except UsageError as exc:
            raise UsageError(f"--preempt-signals {self.preempt_signals!r}: {exc}") from None
        if self.hidden is not None and self.model != "mlp":
            raise UsageError(f"--hidden {','.join(map(str, self.hidden))}: only for --model mlp, "
                             f"not {self.model!r}")
        if self.kernels == "cupy" and self.device == "cpu":
            raise UsageError("--kernels 'cupy' needs --device cuda")
        want = models.FIXED_INPUT_SHAPES.get(self.model)
        have = DATASET_SHAPES.get(self.dataset)
        if want and have and want != have:
            raise UsageError(f"--model {self.model!r} takes {want} samples but --dataset "
                             f"{self.dataset!r} has {have}")
        return self

    def _validate_gpt(self):
        """--model gpt, --dataset text: and the flags that belong to them."""
        try:  # flags and env were parsed already; a Config built in code was not
            parse_betas(_csv(self.betas))
        except UsageError as exc:
            raise UsageError(f"--betas {_csv(self.betas)!r}: {exc}") from None
        text = self.dataset.startswith("text:")
        if (self.model == "gpt") != text:
            raise UsageError(f"--model gpt trains on --dataset text:PATH, got --model "
                             f"{self.model!r} with --dataset {self.dataset!r}")
        if self.n_embd % self.n_head:
            raise UsageError(f"--n-embd {self.n_embd} is not divisible by --n-head {self.n_head}")
        if text and self.augment != "none":
            raise UsageError(f"--augment {self.augment}: only for image data, not text")
        if self.sample and self.model != "gpt":
            raise UsageError(f"--sample {self.sample}: only for --model gpt")
        if self.min_lr and self.lr_schedule != "cosine":
            raise UsageError(f"--min-lr {self.min_lr!r}: only for --lr-schedule cosine, not "
                             f"{self.lr_schedule!r}")
        if self.clip_grad_norm is not None and self.average == "weights":
            raise UsageError("--clip-grad-norm clips averaged gradients; it does not apply to "
                             "--average weights")
        try:
            check_sharding(self.sharding, self.average, self.deterministic,
                           self.clip_grad_norm)
        except ValueError as exc:
            raise UsageError(f"--sharding {self.sharding}: {exc}") from None
        if self.sharding != "none" and self.device != "cpu":
            raise UsageError(f"--sharding {self.sharding}: device parameters are not sharded "
                             f"yet (--device cpu)")

    def _validate_deterministic(self):
        """--deterministic against the flags it cannot keep its promise with (the checks that
        need the number of ranks are setup.py's)."""
        m = self.micro_shards
        if m < 1 or m & (m - 1):
            raise UsageError(f"--micro-shards {m!r}: must be a power of two (1, 2, 4, 8, ...)")
        if not self.deterministic:
            return
        refused = [("--average weights", self.average == "weights"),
                   ("--fp16-allreduce", self.fp16_allreduce),
                   ("--uneven", self.uneven),
                   ("--sync-bn", self.sync_bn),
                   ("--device cuda", self.device == "cuda")]
        for flag, given in refused:
            if given:
                raise UsageError(f"--deterministic does not support {flag} (see README, "
                                 f"\"Bitwise-identical training\")")

    def _validate_recipe(self):
        """Augmentation and lr schedule flags that contradict each other or the data."""
        if self.lr_milestones is not None:
            try:  # flags and env were parsed by it already; a Config built in code was not
                parse_milestones(_csv(self.lr_milestones))
            except UsageError as exc:
                raise UsageError(f"--lr-milestones {_csv(self.lr_milestones)}: {exc}") from None
            if self.lr_schedule != "step":
                raise UsageError(f"--lr-milestones {_csv(self.lr_milestones)}: only for "
                                 f"--lr-schedule step, not {self.lr_schedule!r}")
            if self.steps is None and self.lr_milestones[-1] >= self.epochs:
                raise UsageError(f"--lr-milestones {_csv(self.lr_milestones)}: milestone "
                                 f"{self.lr_milestones[-1]} is never reached in --epochs "
                                 f"{self.epochs} (the lr changes after epoch m, m < epochs)")
        elif self.lr_schedule == "step":
            raise UsageError("--lr-schedule step needs --lr-milestones (epochs, e.g. 30,60)")
        if not self.lr_gamma > 0:
            raise UsageError(f"--lr-gamma {self.lr_gamma!r}: must be > 0")
        augment = parse_augment(self.augment).split(",")
        if self.crop_padding is not None:
            if "crop" not in augment:
                raise UsageError(f"--crop-padding {self.crop_padding}: only with --augment crop")
            shape = self.sample_shape()
            if not 0 <= self.crop_padding < min(shape[-2:]):
                raise UsageError(f"--crop-padding {self.crop_padding}: must be in [0, "
                                 f"{min(shape[-2:])}) for {shape[-2]}x{shape[-1]} images")

    @property
    def resuming(self):
        """--resume or --resume-if-exists: continue from a checkpoint when there is one."""
        return self.resume or self.resume_if_exists

    def sample_shape(self):
        """The per-sample shape the job's data will have (synthetic: the model's input)."""
        if self.dataset.startswith("text:"):
            return (self.block_size,)
        return (DATASET_SHAPES.get(self.dataset)
                or models.FIXED_INPUT_SHAPES.get(self.model, (1, 28, 28)))

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)

    def as_dict(self):
        return dataclasses.asdict(self)


def _sections(starts):
    """((section, title, field names), ...) from ((section, title, its first field), ...) in
    Config's order: a section runs up to the next one's first field."""
    names = [f.name for f in dataclasses.fields(Config)]
    cuts = [names.index(first) for _, _, first in starts] + [len(names)]
    return tuple((section, title, tuple(names[cuts[i]:cuts[i + 1]]))
                 for i, (section, title, _) in enumerate(starts))


# The sections of Config, in its order: ``--help`` groups the flags by them.
SECTIONS = _sections((("model", "what is trained, on what", "model"),
                      ("schedule", "how long, in what batches", "epochs"),
                      ("optimizer", "the update", "optimizer"),
                      ("parallel", "how the ranks stay one model", "average"),
                      ("runtime", "where it runs", "device"),
                      ("outputs", "what the job writes", "checkpoint_dir")))


def _flag(name):
    return "--" + name.replace("_", "-")


def _csv(values):
    return ",".join(map(str, values))


def env_name(name):
    return ENV_PREFIX + name.upper()


def from_env(environ=None, base=None):
    """Config with every ``MPITRAIN_<FIELD>`` variable of ``environ`` applied over ``base``
    (unset or empty: ``base``'s value); a bad value is a UsageError naming the variable."""
    base = base or Config()
    try:
        return base.replace(**{f.name: _from_env(f, getattr(base, f.name), environ)
                               for f in fields()})
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _from_env(f, default, environ):
    """Field ``f`` from its variable with runtime/env.py's grammar. A variable that a lower
    layer reads too (mt.init, mpitrain.data) is read by that layer's reader."""
    if f.name == "threads":
        return thread_budget.from_env(environ, default)
    if f.name == "data_dir":
        return env_data_dir(environ)[1] or default
    if f.name == "fusion_threshold_bytes":      # the comm layer's variable, unless ours is set
        default = comm.fusion_threshold_from_env(environ, default)
    name, kind = env_name(f.name), field_type(f)
    text = env.text(name, None, environ)
    if text is not None and path_choice(f, text):       # e.g. text:PATH, not a choice
        return text
    if f.metadata.get("choices"):
        return env.choice(name, default, f.metadata["choices"], environ)
    if kind is bool:
        off = f.metadata.get("off_flag")
        if off and text is None:        # e.g. MPITRAIN_NO_PROGRESS=1
            return not env.flag(env_name(off), not default, environ)
        return env.flag(name, default, environ)
    if kind is int:
        return env.integer(name, default, environ=environ)
    if kind is float:
        return env.number(name, default, environ=environ)
    return default if text is None else parse_value(f, text, name)


def fields():
    return dataclasses.fields(Config)


env.declare(*(env_name(f.name) for f in fields()),
            *(env_name(f.metadata["off_flag"]) for f in fields() if f.metadata.get("off_flag")))
