"""The process-wide fork server that decoding workers (and `tarsier inspect`'s children) start from, and what a
worker process does first.

Children are forked from this small server, never from the caller: forking a caller that holds
a model (gigabytes of private memory, torch's threads) can fail with ENOMEM where memory is not
overcommitted, and forking a threaded process is unsafe. The server is started once, quiet. The workers that
read videos' lengths for `--segments` are fresh interpreters instead (`probe`): they need none of its preload.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import re
import signal
import sys
from contextlib import suppress
from multiprocessing.context import BaseContext
from pathlib import Path

_quiet_server_pid: int | None = None
_MAIN_GUARD = re.compile(r"""__name__\s*==\s*['"]__main__['"]|['"]__main__['"]\s*==\s*__name__""")


class UnguardedScriptError(RuntimeError):
    """The script running this process does its work when imported, which every child process does again."""


def quiet_fork_server(preload: list[str]) -> BaseContext:
    """The forkserver context, its server running with stdout and stderr on /dev/null.

    `preload` is what the server imports once, so that a child only has to fork; it counts only
    when the server starts (it lives as long as this process), so the first caller's list wins.
    Children inherit the server's descriptors, so nothing a child prints reaches the terminal,
    even before its own set-up runs (a worker forked while its pool stops can fail to unpickle
    its start-up state and print a traceback). Our descriptors 1 and 2 point to /dev/null only
    while the server is launched (a few milliseconds; launching does not wait for its imports):
    a line another thread prints meanwhile is lost. If the server dies, multiprocessing restarts
    it on its own, without this; children still silence themselves first thing.
    """
    global _quiet_server_pid
    from multiprocessing import forkserver

    check_main_is_guarded()
    context = multiprocessing.get_context("forkserver")
    server = forkserver._forkserver  # private, but stable: the process-wide server
    if _quiet_server_pid is not None and getattr(server, "_forkserver_pid", None) == _quiet_server_pid:
        return context
    context.set_forkserver_preload(preload)
    saved = [os.dup(1), os.dup(2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None and not stream.closed:
                stream.flush()
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        forkserver.ensure_running()
    finally:
        for descriptor, original in zip((1, 2), saved):
            os.dup2(original, descriptor)
            os.close(original)
        os.close(devnull)
    if _quiet_server_pid is None:   # the first start: a restarted server is stopped the same way
        atexit.register(_stop_server)
    _quiet_server_pid = getattr(server, "_forkserver_pid", None)
    return context


def _stop_server() -> None:
    """At this process's exit, stop the server at once. Left to notice the exit on its own, it would tear down
    its own interpreter (the decoders and torch it preloaded: seconds), outliving the command that started it;
    its decoding workers have stopped by then (or notice the exit themselves)."""
    if _quiet_server_pid is None:
        return
    with suppress(OSError):   # gone already, or reaped by multiprocessing
        os.kill(_quiet_server_pid, signal.SIGTERM)   # its Python has no handler for it: it ends where it stands
        os.waitpid(_quiet_server_pid, 0)


def check_main_is_guarded() -> None:
    """Refuse to start children for a script without an `if __name__ == "__main__":` guard.

    A child imports the parent's main script again (multiprocessing's rule for a fork server or
    spawn); unguarded, the script's work starts again in the child, which dies while starting, and
    every item would fail with "the workers failed" and nothing to say why.
    """
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)   # none: python -c, a notebook, an interactive session
    if path is None:
        return
    try:
        with open(path, encoding="utf-8", errors="replace") as script:
            source = script.read()
    except OSError:
        return
    if not _MAIN_GUARD.search(source):
        raise UnguardedScriptError(
            f"{path} runs its work when imported, and the processes that decode media import it again: put "
            f"that work under 'if __name__ == \"__main__\":' (or decode in threads: "
            f"CaptionSettings(isolate_decoding=False))")


def start_decoding_server(checkpoint: Path | None = None) -> None:
    """Start the fork server that decoding workers come from, if it is not running yet.

    A run calls this before it imports torch and loads the model: the server's own imports (the
    decoders, torch, the processor of `checkpoint`'s family, or of every built-in family where it is not given
    or not readable: 2-5 s) then overlap the parent's instead of following them, and the first items decode
    that much sooner (on a short or resumed run, most of what a restart pays).
    """
    quiet_fork_server(decoding_preload(checkpoint))


def decoding_preload(checkpoint: Path | None = None) -> list[str]:
    """What the decoding fork server imports once, so that a new worker only has to fork.

    The decoders (imported lazily by the media package: about 70 ms per worker otherwise), the decoding
    workers' module, the processor of `checkpoint`'s family (of every built-in family without it: the Qwen-VL
    ones import transformers' image processors, and with them its modeling utilities, seconds that a Tarsier v1
    run's workers never need), the storage backends (the fsspec
    modules this process has loaded), and every module of this package the parent has
    imported: a worker also imports the parent's main script again (the `tarsier` console script
    imports the CLI, about 0.25 s) and finds them loaded. Only the first list counts (the server
    lives as long as this process). A processor from elsewhere is imported by each worker; it is
    not preloaded, because a module that fails in the server stops every worker.
    """
    from ..families import catalog
    from ..families.loading import family_of_checkpoint

    package = __name__.split(".")[0]
    ours = sorted(name for name in sys.modules if name == package or name.startswith(package + "."))
    families = catalog.model_families()
    if checkpoint is not None:
        with suppress(OSError, ValueError):   # not a checkpoint: loading it says so
            families = (family_of_checkpoint(checkpoint),)
    processors = [family.processor_loader.partition(":")[0] for family in families
                  if family.processor_loader.startswith(package + ".")]
    # Importing a backend starts no thread or event loop (checked for s3fs), so the server stays safe to fork.
    storage = sorted(name for name in ("fsspec", "s3fs", "gcsfs", "adlfs") if name in sys.modules)
    return ["decord", "av", f"{package}.workers.pool", *processors, *storage, *ours]


def quiet_worker(environment: dict[str, str] | None = None) -> None:
    """What a worker process does first: native log lines off the terminal, Ctrl-C left to the parent, SIGTERM
    final; `environment` (object-store settings) set, as a fork server keeps the one it started with."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # decord and FFmpeg log from native code: keep it off the terminal
    os.dup2(devnull, 2)
    os.close(devnull)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent decides
    # pebble's SIGTERM handler is Python code, which never runs while a decoder hangs in native
    # code: pebble would wait 3 s before SIGKILL on each timeout and each worker at shutdown.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ.update(environment or {})
