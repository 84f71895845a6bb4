"""Config layering (defaults < MPITRAIN_* env < flags), parsing and one-line validation errors."""
import dataclasses

import pytest

from mpitrain.train import cli
from mpitrain.train import config as cfg
from mpitrain.train.config import Config, UsageError


def test_defaults_are_the_meaningful_job():
    c = Config().validate()
    assert (c.model, c.dataset, c.epochs, c.device) == ("mlp", "fashion-mnist", 1, "cpu")
    assert c.steps is None and c.scale_lr is False


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().lr = 1.0


def test_env_overrides_defaults_and_flags_override_env():
    env = {"MPITRAIN_BATCH_SIZE": "32", "MPITRAIN_LR": "0.5", "MPITRAIN_SCALE_LR": "yes"}
    c = cli.parse([], environ=env)
    assert (c.batch_size, c.lr, c.scale_lr) == (32, 0.5, True)
    c = cli.parse(["--batch-size", "8"], environ=env)
    assert (c.batch_size, c.lr) == (8, 0.5)


def test_every_field_has_a_flag_and_an_env_var():
    parser = cli.build_parser()
    dests = {a.dest for a in parser._actions}
    for f in cfg.fields():
        assert f.name in dests, f.name
        assert f.metadata["help"]
    # The documented flags, exactly as spelled.
    text = parser.format_help()
    for flag in ("--model", "--dataset", "--data-dir", "--epochs", "--steps", "--batch-size",
                 "--lr", "--scale-lr", "--warmup-epochs", "--optimizer", "--momentum",
                 "--weight-decay", "--average", "--average-every", "--fp16-allreduce",
                 "--fusion-threshold-bytes", "--seed", "--device", "--kernels",
                 "--checkpoint-dir", "--checkpoint-every", "--resume", "--save",
                 "--metrics-json", "--no-progress", "--eval-every", "--threads"):
        assert flag in text, flag


def test_parses_every_kind_of_value():
    c = cli.parse(["--steps", "7", "--warmup-epochs", "0.5", "--fp16-allreduce", "--hidden",
                   "16,8"], environ={})
    assert (c.steps, c.warmup_epochs, c.fp16_allreduce, c.hidden) == (7, 0.5, True, (16, 8))
    c = cli.parse(["--average", "weights", "--average-every", "3"], environ={})
    assert c.average == "weights" and c.average_every == 3
    assert cfg.from_env({"MPITRAIN_HIDDEN": "4"}).hidden == (4,)
    assert cfg.from_env({"MPITRAIN_NO_PROGRESS": "0"}).progress is True


def test_positive_names_keep_their_old_flags_and_variables():
    assert cli.parse([], environ={}).overlap is True
    assert cli.parse(["--no-overlap"], environ={}).overlap is False
    assert cli.parse(["--no-overlap", "--overlap"], environ={}).overlap is True   # last wins
    assert cli.parse(["--no-progress"], environ={}).progress is False
    assert cfg.from_env({"MPITRAIN_NO_OVERLAP": "1"}).overlap is False
    assert cfg.from_env({"MPITRAIN_OVERLAP": "off"}).overlap is False
    # the field's own variable wins over the old name
    assert cfg.from_env({"MPITRAIN_PROGRESS": "1", "MPITRAIN_NO_PROGRESS": "1"}).progress is True
    assert cfg.from_env({"MPITRAIN_NO_DECAY_BN_BIAS": "0"}).decay_bn_bias is True


@pytest.mark.parametrize("argv, needle", [
    (["--model", "resnet"], "--model 'resnet'"),
    (["--batch-size", "0"], "--batch-size 0"),
    (["--lr", "-0.1"], "--lr -0.1"),
    (["--lr", "nan"], "--lr nan"),
    (["--epochs", "0"], "--epochs 0"),
    (["--steps", "0"], "--steps 0"),
    (["--momentum", "1.5"], "--momentum 1.5"),
    (["--dataset", "imagenet"], "--dataset 'imagenet'"),
    (["--average", "both"], "--average 'both'"),
    (["--batch-size", "ten"], "--batch-size='ten'"),
    (["--hidden", "a,b"], "--hidden"),
    (["--hidden", "0"], "--hidden"),
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--checkpoint-every", "5"], "needs --checkpoint-dir"),
    (["--model", "lenet", "--dataset", "cifar10"], "'lenet'"),
    (["--model", "lenet", "--hidden", "8"], "--hidden 8"),
    (["--kernels", "cupy"], "--kernels 'cupy'"),
    (["--average", "weights", "--average-every", "4", "--checkpoint-every", "6",
      "--checkpoint-dir", "x"], "--checkpoint-every 6"),
    (["--no-such-flag"], "--no-such-flag"),
    (["--average", "weights", "--fp16-allreduce"], "--fp16-allreduce"),
])
def test_bad_input_is_one_line_naming_the_value(argv, needle):
    with pytest.raises(UsageError) as info:
        cli.parse(argv, environ={})
    message = str(info.value)
    assert needle in message
    assert "\n" not in message


def test_comm_layer_fusion_variable_is_honoured_unless_ours_is_set():
    assert cfg.from_env({"MPITRAIN_FUSION_THRESHOLD": "1024"}).fusion_threshold_bytes == 1024
    both = {"MPITRAIN_FUSION_THRESHOLD": "1024", "MPITRAIN_FUSION_THRESHOLD_BYTES": "2048"}
    assert cfg.from_env(both).fusion_threshold_bytes == 2048


def test_bad_env_value_names_the_variable():
    with pytest.raises(UsageError, match="MPITRAIN_EPOCHS='x'"):
        cli.parse([], environ={"MPITRAIN_EPOCHS": "x"})
    with pytest.raises(UsageError, match="MPITRAIN_RESUME='maybe'"):
        cli.parse([], environ={"MPITRAIN_RESUME": "maybe"})


def test_run_cli_exits_2_with_one_line_and_writes_nothing(tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    code = cli.run_cli(["--batch-size", "0", "--metrics-json", str(metrics)])
    assert code == cli.EXIT_USAGE == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--batch-size 0" in err
    assert not metrics.exists()


def test_recipe_flags_parse():
    c = cli.parse(["--augment", "flip,crop", "--crop-padding", "3", "--lr-schedule", "step",
                   "--lr-milestones", "2,4", "--lr-gamma", "0.2", "--epochs", "6",
                   "--normalize", "train", "--decay-bn-bias"], environ={})
    assert (c.augment, c.crop_padding, c.lr_schedule, c.lr_milestones, c.lr_gamma) == (
        "crop,flip", 3, "step", (2, 4), 0.2)
    assert c.normalize == "train" and c.decay_bn_bias
    d = cli.parse([], environ={})
    assert (d.augment, d.lr_schedule, d.normalize, d.decay_bn_bias) == (
        "none", "constant", "fixed", False)                    # no decay on ndim <= 1 by default
    assert not cli.parse(["--decay-bn-bias", "--no-decay-bn-bias"], environ={}).decay_bn_bias
    env = cli.parse([], environ={"MPITRAIN_AUGMENT": "flip", "MPITRAIN_LR_SCHEDULE": "cosine",
                                 "MPITRAIN_DECAY_BN_BIAS": "1"})
    assert (env.augment, env.lr_schedule, env.decay_bn_bias) == ("flip", "cosine", True)
    # --steps runs have no epoch count to check milestones against
    assert cli.parse(["--lr-schedule", "step", "--lr-milestones", "9", "--steps", "5"],
                     environ={}).lr_milestones == (9,)


@pytest.mark.parametrize("argv, needle", [
    (["--augment", "rotate"], "unknown augmentation 'rotate'"),
    (["--augment", "crop,crop"], "named twice"),
    (["--augment", "none,flip"], "unknown augmentation 'none'"),
    (["--augment", "crop", "--crop-padding", "-1"], "--crop-padding -1"),
    (["--augment", "crop", "--crop-padding", "28"], "--crop-padding 28: must be in [0, 28)"),
    (["--augment", "crop", "--crop-padding", "32", "--dataset", "cifar10", "--model",
      "cifar_cnn"], "[0, 32) for 32x32"),
    (["--augment", "flip", "--crop-padding", "2"], "only with --augment crop"),
    (["--lr-schedule", "poly"], "--lr-schedule 'poly'"),
    (["--lr-schedule", "step"], "needs --lr-milestones"),
    (["--lr-schedule", "step", "--lr-milestones", "3,2", "--epochs", "5"], "strictly increasing"),
    (["--lr-schedule", "step", "--lr-milestones", "0,2", "--epochs", "5"], "milestone 0"),
    (["--lr-schedule", "step", "--lr-milestones", "x", "--epochs", "5"], "--lr-milestones='x'"),
    (["--lr-schedule", "step", "--lr-milestones", "2,5", "--epochs", "5"], "never reached"),
    (["--lr-milestones", "2", "--epochs", "5"], "only for --lr-schedule step"),
    (["--lr-schedule", "cosine", "--lr-milestones", "2", "--epochs", "5"], "not 'cosine'"),
    (["--lr-gamma", "0"], "--lr-gamma 0.0"),
    (["--normalize", "zscore"], "--normalize 'zscore'"),
])
def test_bad_recipe_input_is_one_line_naming_the_value(argv, needle):
    with pytest.raises(UsageError) as info:
        cli.parse(argv, environ={})
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_config_built_in_code_is_validated_too():
    with pytest.raises(UsageError, match="--lr-milestones 3,1: milestones must be strictly"):
        cfg.Config(lr_schedule="step", lr_milestones=(3, 1), epochs=5).validate()
    with pytest.raises(UsageError, match="unknown augmentation"):
        cfg.Config(augment="blur").validate()


def test_every_field_is_in_one_section_in_the_class_order():
    names = [name for _, _, fields in cfg.SECTIONS for name in fields]
    assert names == [f.name for f in cfg.fields()]
    help_text = cli.build_parser().format_help()
    for section, title, _ in cfg.SECTIONS:
        assert f"{section}: {title}:" in help_text


def test_choices_come_from_their_owners():
    import mpitrain as mt
    choices = {f.name: f.metadata["choices"] for f in cfg.fields() if f.metadata["choices"]}
    assert choices["model"] == mt.models.names
    assert choices["lr_schedule"] == mt.optim.SCHEDULES
    assert choices["normalize"] == mt.data.NORMALIZATIONS
    assert set(choices["dataset"]) == set(mt.data.SPECS) | {"synthetic"}


@pytest.mark.parametrize("flag", ["--lr", "--weight-decay", "--warmup-epochs", "--momentum",
                                  "--dropout", "--lr-gamma", "--min-lr", "--temperature",
                                  "--clip-grad-norm"])
@pytest.mark.parametrize("text", ["inf", "-inf", "nan"])
def test_a_hyper_parameter_that_is_not_finite_is_refused_from_flags_and_env(flag, text):
    """inf passes "> 0" and ">= 0" where nan fails both: every float is checked for it first."""
    line = f"{flag} {float(text)!r}: must be a finite number"
    with pytest.raises(UsageError) as info:
        cli.parse([f"{flag}={text}"])
    assert str(info.value) == line
    variable = cfg.env_name(flag[2:].replace("-", "_"))
    with pytest.raises(UsageError) as info:
        cli.parse([], environ={variable: text})
    assert str(info.value) == line


def test_nonfinite_steps_counts_steps_and_zero_never_stops():
    assert cli.parse([]).nonfinite_steps == 3
    assert cli.parse(["--nonfinite-steps", "0"]).nonfinite_steps == 0
    assert cli.parse([], environ={"MPITRAIN_NONFINITE_STEPS": "7"}).nonfinite_steps == 7
    with pytest.raises(UsageError, match="--nonfinite-steps -1: must be >= 0"):
        cli.parse(["--nonfinite-steps", "-1"])
