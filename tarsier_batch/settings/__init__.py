"""Every setting of a captioning run, each declared once and each rule checked once.

`CaptionSettings` decides what a loaded model produces and how it runs; `RunSettings` adds what a
run does with its output; `RaySettings` where it runs; `CommandOptions` what the command line
takes besides them (inputs, output, display). Each field declares its flag, help, config key and
whether it decides a caption (`declaring.setting`); the command line, the flags page, the config
keys, the words of errors and the resume fingerprint are generated from those declarations.
"""

from .caption import DEVICE_NAMES, DTYPES, PRUNE_METHODS, CaptionSettings, SamplingParams
from .command import OUT_FORMATS, SHARD_ROWS, CommandOptions, check_output_choice
from .declaring import (
    GROUPS,
    Declared,
    Setting,
    SettingsError,
    declared,
    from_values,
    provenance,
    setting,
    shown,
    words,
)
from .run import FLUSH_ROWS, FLUSH_SECONDS, KEY_MODES, RaySettings, Resolved, RunSettings, resume_settings

__all__ = [
    "DEVICE_NAMES", "DTYPES", "FLUSH_ROWS", "FLUSH_SECONDS", "GROUPS", "KEY_MODES", "OUT_FORMATS", "PRUNE_METHODS",
    "SHARD_ROWS", "CaptionSettings", "CommandOptions", "Declared", "RaySettings", "Resolved", "RunSettings",
    "SamplingParams", "Setting", "SettingsError", "check_output_choice", "declared", "from_values", "provenance",
    "resume_settings", "setting", "shown", "words",
]
