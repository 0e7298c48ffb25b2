"""One captioning run over an output: what `tarsier caption` does, as a library object.

    from tarsier_batch import CaptionRun, CaptionSettings, RunSettings
    outcome = CaptionRun(["./videos"], "results.parquet", RunSettings(CaptionSettings(model="demo"))).execute()

`plan` makes what a run will do out of what was gathered (pure, no I/O); `caption_run` gathers
those facts and carries the plan out; `loop` feeds the items to the `Backend` (`backend`) and
saves each row; `outcome` says how the run ended.
"""

from .backend import Backend, LoggingReporter, RunReporter, run_provenance
from .caption_run import CaptionRun, load_captioner
from .outcome import LoadingCrashed, RunOutcome, Status, Terminated

__all__ = ["CaptionRun", "LoadingCrashed", "LoggingReporter", "RunOutcome", "RunReporter", "Status", "Terminated",
           "Backend", "load_captioner", "run_provenance"]
