"""Each setting is declared once, on its field: the command's options, the config keys, the words of errors and
the resume fingerprint all come from those declarations, and the fingerprint of outputs written before them is
unchanged."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import pytest
import typer.main

from tarsier_batch.cli import app
from tarsier_batch.cli_options import FLAGS, PATH_SETTINGS, SOURCES, caption_declarations, in_flags
from tarsier_batch.config import ConfigError, config_defaults
from tarsier_batch.errors import Worded
from tarsier_batch.inputs.prompt_sets import Question
from tarsier_batch.inputs.segments import Segmenting
from tarsier_batch.inputs.sharding import Shard
from tarsier_batch.outputs.formats import OutputError, OutputTarget
from tarsier_batch.progress import summary_line
from tarsier_batch.settings import (
    CaptionSettings,
    CommandOptions,
    RaySettings,
    Resolved,
    RunSettings,
    SamplingParams,
    SettingsError,
    declared,
    from_values,
    provenance,
    resume_settings,
)

CAPTION = typer.main.get_command(app).commands["caption"]   # type: ignore[attr-defined]


def test_every_option_of_caption_is_a_declared_setting() -> None:
    """An option added to the command by hand (or a declared setting the command forgot) fails here."""
    options = {param.name: param for param in CAPTION.params}
    assert list(options) == [found.key for found in caption_declarations()]
    for found in caption_declarations():
        param = options[found.key]
        assert tuple(name for name in (*param.opts, *param.secondary_opts) if name.startswith("-")) == \
            tuple(flag for names in found.flags for flag in names.split("/"))
        assert param.help == (found.setting.help or None) and param.metavar == found.setting.metavar
        assert param.default == found.flag_default and param.envvar == found.setting.env


def test_every_settings_field_is_declared() -> None:
    """A field without a declaration would have no flag, no config key and no place in the fingerprint."""
    holders = {"caption", "sampling"}   # fields that hold other settings
    for cls in (*SOURCES, CaptionSettings, SamplingParams):
        undeclared = [field.name for field in dataclasses.fields(cls)
                      if "setting" not in field.metadata and field.name not in holders]
        assert not undeclared, (cls.__name__, undeclared)


def test_the_config_keys_are_the_declared_keys(tmp_path: Path) -> None:
    config = tmp_path / "tarsier.toml"
    config.write_text('no-such-setting = 1\n')
    with pytest.raises(ConfigError) as refused:
        config_defaults(config, CAPTION, "caption", PATH_SETTINGS)
    known = str(refused.value).split("known: ")[1].split(", ")
    assert sorted(known) == sorted(found.key.replace("_", "-") for found in caption_declarations()
                                   if found.key != "config")
    config.write_text('decode-timeout = 5\nlog_file = "logs/run.log"\nprompts = "/abs/q.toml"\n')
    assert config_defaults(config, CAPTION, "caption", PATH_SETTINGS) == {
        "decode_timeout": 5, "log_file": str(tmp_path.resolve() / "logs/run.log"), "prompts": "/abs/q.toml"}


def test_errors_name_fields_and_the_command_words_them_as_its_flags() -> None:
    assert FLAGS["decode_timeout_s"] == "--decode-timeout" and FLAGS["preflight"] == "--no-preflight"
    assert FLAGS["actors"] == "--ray-workers" and FLAGS["prompt_set"] == "--ask/--prompts"
    with pytest.raises(SettingsError) as refused:
        from_values(RaySettings, {"ray": "auto", "ray_workers": "3-1"})
    assert str(refused.value).startswith("actors '3-1'")
    assert refused.value.worded(FLAGS).startswith("--ray-workers '3-1'")


def test_the_library_names_fields_in_its_other_errors_and_notes_and_the_command_words_them(tmp_path: Path) -> None:
    folder = tmp_path / "{odd} name"   # braces in a value are the value's, not placeholders
    folder.mkdir()
    with pytest.raises(OutputError) as refused:
        OutputTarget(folder).check()
    assert str(refused.value) == (f"out {folder} is a directory; give a file name such as {folder}/results.parquet, "
                                  f"or use out_dir with shard_rows")
    assert in_flags(refused.value) == (f"--out {folder} is a directory; give a file name such as "
                                       f"{folder}/results.parquet, or use --out-dir with --shard-rows")
    # A parser's error becomes a SettingsError naming the setting alike; both survive a process boundary.
    with pytest.raises(SettingsError) as parsed:
        from_values(RunSettings, {"shard": "4/2"})
    again = pickle.loads(pickle.dumps(parsed.value))
    assert str(again).startswith("shard 4/2: I must be 0 to N-1")
    assert in_flags(again).startswith("--shard 4/2: I must be 0 to N-1")
    # A note built of notes (the summary's line) words the settings inside each part.
    line = summary_line([("files gone", Worded("{count} rows kept ({prune_missing} drops them)", count=2)),
                         ("output", "{x}.parquet")])
    assert str(line) == "done: files gone 2 rows kept (prune_missing drops them); output {x}.parquet"
    assert in_flags(line) == "done: files gone 2 rows kept (--prune-missing drops them); output {x}.parquet"
    assert in_flags("plain text {x}") == "plain text {x}"


def test_flag_values_become_settings_through_their_declarations() -> None:
    settings = from_values(RunSettings, {"shard": "1/4", "segments": "fixed:10s", "decode_timeout": 5.0,
                                         "top_p": 0.5, "key": "sha256", "no_such_key": 1})
    assert settings.shard == Shard(1, 4) and settings.segments == Segmenting.parse("fixed:10s")
    assert settings.caption.decode_timeout_s == 5.0 and settings.caption.sampling.top_p == 0.5
    assert settings.key == "sha256" and settings.caption == CaptionSettings(decode_timeout_s=5.0,
                                                                            sampling=SamplingParams(top_p=0.5))
    with pytest.raises(SettingsError, match="shard"):
        from_values(RunSettings, {"shard": "4/4"})


def test_the_command_checks_its_own_options_as_settings() -> None:
    with pytest.raises(SettingsError) as refused:
        CommandOptions(inputs=["a"], out="a.parquet", shard_rows=5)
    assert refused.value.worded(FLAGS) == "--shard-rows needs --out-dir"
    with pytest.raises(SettingsError) as refused:
        CommandOptions(inputs=["a"], out_dir="d", out_format="webdataset", shard_rows=5)
    assert refused.value.worded(FLAGS).startswith("--shard-rows does not apply to --out-format webdataset")


# What `resume_settings` gave before the settings were declared, for outputs written then: a run continuing
# them must compute the same values, in the same order. A setting declared since is None when off ("fps"), as
# those outputs read without it.
RICH = RunSettings(
    caption=CaptionSettings(model="tiny-random", frames=4, prune_vision=0.5, prune_layer=3,
                            sampling=SamplingParams(temperature=0.7, top_p=0.9, seed=3, repetition_penalty=1.1,
                                                    max_new_tokens=7)),
    with_token_ids=True, key="sha256", shard=Shard(1, 4), segments=Segmenting.parse("fixed:10s,overlap=2s"))
QUESTIONS = RunSettings(caption=CaptionSettings(prompt_set=(Question("a", "What?"), Question("b", "Who?", 5)),
                                                prune_vision=0.25), long=True, limit=3, overwrite=True)
SAMPLED = {"max_new_tokens": 7, "temperature": 0.7, "top_p": 0.9, "seed": 3}
RICH_TAIL = {"prune": {"vision": 0.5, "layer": 3}, "with_token_ids": True, "key": "sha256", "shard": "1/4",
             "segments": "fixed:10s,overlap=2s,min=2s"}
GREEDY = {"max_new_tokens": 512, "temperature": 0.0, "top_p": 1.0, "seed": 0}
PLAIN_TAIL = {"with_token_ids": False, "key": "path", "shard": None, "segments": None}


@pytest.mark.parametrize(("settings", "resolved", "expected"), [
    (RunSettings(), None, {"model": "omni-research/Tarsier2-Recap-7b", "prompt": None, "prompt_set": None,
                           "fps": None, **GREEDY, "prune": None, **PLAIN_TAIL}),
    (RunSettings(), Resolved("abc", 8, 1.05),
     {"model": "omni-research/Tarsier2-Recap-7b", "model_revision": "abc", "prompt": None, "prompt_set": None,
      "frames": 8, "fps": None, **GREEDY, "repetition_penalty": 1.05, "prune": None, **PLAIN_TAIL}),
    (RICH, None, {"model": "tiny-random", "prompt": None, "prompt_set": None, "frames": 4, "fps": None, **SAMPLED,
                  "repetition_penalty": 1.1, **RICH_TAIL}),
    (RICH, Resolved("abc", 8, 1.05), {"model": "tiny-random", "model_revision": "abc", "prompt": None,
                                      "prompt_set": None, "frames": 8, "fps": None, **SAMPLED,
                                      "repetition_penalty": 1.05, **RICH_TAIL}),
    (QUESTIONS, None, {"model": "omni-research/Tarsier2-Recap-7b", "prompt": None, "prompt_set": {"a": None, "b": 5},
                       "fps": None, **GREEDY, "prune": {"vision": 0.25, "method": "temporal"}, **PLAIN_TAIL}),
])
def test_the_fingerprint_of_outputs_written_before_is_unchanged(settings: RunSettings, resolved: Resolved | None,
                                                                 expected: dict) -> None:
    fingerprint = resume_settings(settings, resolved)
    assert fingerprint == expected and list(fingerprint) == list(expected)


def test_the_fingerprint_holds_exactly_the_declared_fields() -> None:
    """A setting that decides a caption is recorded by declaring it so, nowhere else."""
    recorded = {found.setting.recorded_as or found.name for found in declared(RunSettings) if found.setting.fingerprint}
    assert set(resume_settings(RunSettings(), Resolved(None, 8, None))) == recorded | {"model_revision"}


def test_the_provenance_records_the_declared_fields_as_loading_settled_them() -> None:
    settings = CaptionSettings(prune_vision=0.5, compile_step=True, decode_timeout_s=9.0, kv_cache_gb=2.0)
    recorded = provenance(settings, {"frames": 8, "workers": 3, "kv_cache_gb": 4096})
    assert recorded["frames"] == 8 and recorded["decode_workers"] == 3 and recorded["kv_cache_tokens"] == 4096
    assert recorded["prune"] == {"vision": 0.5, "method": "temporal"} and recorded["compile"] is True
    assert recorded["decode_timeout_s"] == 9.0 and recorded["model"] == settings.model
    assert list(recorded) == [found.setting.provenance for found in declared(CaptionSettings)
                              if found.setting.provenance is not None]
