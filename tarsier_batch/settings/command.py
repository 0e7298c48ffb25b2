"""What `tarsier caption` takes besides the run's settings: where the items come from, where rows go, what it shows.

Declared like the settings (`declaring.setting`), so the command's options, the flags page and the
`--config` keys come from one place; the rules between them are checked here, once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .declaring import SettingsError, setting

OUT_FORMATS = ("parquet", "webdataset")
SHARD_ROWS = 10_000
QUIET_FAILURES_NAMED = 5   # failed items --quiet names with their errors: a cron mail stays short whatever fails


@dataclass(frozen=True)
class CommandOptions:
    """The inputs, the output and the display of one `tarsier caption`."""

    inputs: list[str] | None = setting(None, group="inputs", argument=True, metavar="INPUTS", path=True)
    out: str | None = setting(
        None, group="output", flags=("--out", "-o"), metavar="FILE", path=True, show_default=False,
        help="Results file to write, or to continue if it exists: .parquet, .jsonl or .csv, a path (missing folders "
             "are made) or an s3://, gs://, az:// URL; '-' streams JSON Lines to stdout.")
    out_dir: str | None = setting(
        None, group="output", metavar="DIR", path=True, show_default=False,
        help="Write Parquet shards part-00000.parquet, ... to DIR (a folder or an s3://, gs://, az:// prefix) instead "
             "of one --out file (continued like --out).")
    shard_rows: int | None = setting(
        None, group="output", metavar="N", at_least=1, show_default=False,
        help=f"Rows per shard with --out-dir [default: {SHARD_ROWS}].")
    out_format: str | None = setting(
        None, group="output", choices=OUT_FORMATS, show_default=False,
        help="What --out-dir holds: Parquet shards (parquet), or for inputs in WebDataset shards a tar per input "
             "shard, named like it, with each member's row as KEY.json and caption as KEY.txt (webdataset).")
    manifest: str | None = setting(
        None, group="inputs", metavar="FILE", path=True, show_default=False,
        help="Caption the files listed in a .csv, .tsv, .jsonl or .parquet table, a path or a URL (relative paths: "
             "from its folder); a 'prompt' column gives rows their own prompt, a 'prompts' column (JSON: name -> "
             "question) their own questions.")
    path_column: str | None = setting(
        None, group="inputs", metavar="NAME", show_default=False,
        help="The manifest's column of file paths [default: the first of path, file_name, video, image].")
    keep_columns: str | None = setting(
        None, group="inputs", metavar="A,B|all", show_default=False,
        help="Manifest columns to carry into the output; with WebDataset shards, their members' sibling files by "
             "extension (json,txt). A name taken by an output column gets the prefix input_.")
    null_separated: bool = setting(False, group="inputs", flags=("-0", "--null"),
                                   help="Paths on stdin are separated by NUL bytes (find -print0).")
    recursive: bool = setting(True, group="inputs", flags=("--recursive/--no-recursive",),
                              help="Descend into subdirectories.")
    dry_run: bool = setting(
        False, group="run",
        help="List what would be captioned and what skipped, and why; load no model, write nothing.")
    config: Path | None = setting(
        None, group="run", metavar="FILE", env="TARSIER_CONFIG", show_default=False,
        help="TOML file of flag values (keys are flag names: model, batch-size, ...); flags and environment variables "
             "win over it.")
    ask: list[str] | None = setting(
        None, group="prompt", metavar="NAME=TEXT", multiple=True, show_default=False,
        help="Ask each item this question too, its answer in column NAME (repeat for several: the frames are "
             "prefilled once for all of them).")
    prompts: Path | None = setting(
        None, group="prompt", metavar="FILE", path=True, show_default=False,
        help="Questions to ask each item, from a TOML or JSON file of name = \"text\" (or name = {text = ..., "
             "max_new_tokens = N}); with --ask, these come first.")
    log_file: Path | None = setting(
        None, group="display", metavar="FILE", path=True, show_default=False,
        help="Append timestamped plain lines (start, progress, failures, summary) to this file.")
    quiet: bool = setting(False, group="display", flags=("--quiet", "-q"),
                          help="No progress display: a clean run prints nothing. With failed items, failed "
                               "inputs, rows captioned from damaged files, or failures earlier runs left in the "
                               "output, a few lines on stderr: the summary's counts of them by kind, the first "
                               f"{QUIET_FAILURES_NAMED} failed files with their errors, and where the rest are.")

    def __post_init__(self) -> None:
        inputs = self.inputs or []
        check_output_choice(self.out, self.out_dir, self.out_format)
        if self.shard_rows is not None and self.out_dir is None:
            raise SettingsError("{shard_rows} needs {out_dir}")
        if self.out_format == "webdataset" and self.shard_rows is not None:
            raise SettingsError("{shard_rows} does not apply to {out_format} webdataset: it writes one tar per "
                                "input shard")
        if self.manifest is None:
            if not inputs:
                raise SettingsError("give INPUTS (files, folders, globs, '-' for stdin) or {manifest} FILE")
            if self.path_column is not None:
                raise SettingsError("{path_column} needs {manifest}")
        elif inputs:
            raise SettingsError("give INPUTS or {manifest}, not both")
        if self.null_separated and "-" not in inputs:
            raise SettingsError("{null_separated} reads NUL-separated paths from stdin; add '-' to INPUTS")

    @property
    def streams(self) -> bool:
        """The rows go to stdout as JSON Lines (`-o -`)."""
        return self.out == "-"


def check_output_choice(out: str | None, out_dir: str | None, out_format: str | None, stdout: bool = True) -> None:
    """One output, a file (or stdout, where the command can stream) or a folder; a format only for a folder (a
    file's format is its suffix)."""
    if (out is None) == (out_dir is None):
        files = "(.parquet, .jsonl, .csv; '-' for stdout)" if stdout else "(.parquet, .jsonl, .csv)"
        raise SettingsError(f"give {{out}} FILE {files} or {{out_dir}} DIR, one of them"
                            if out is None else "give {out} or {out_dir}, not both")
    if out_format is not None and out_dir is None:
        raise SettingsError("{out_format} needs {out_dir} (the format of an {out} file is its suffix)")
