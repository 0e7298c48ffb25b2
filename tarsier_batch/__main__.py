"""`python -m tarsier_batch ...`: the `tarsier` command where its script is not on the PATH."""

from .cli import run_command

# Guarded: the processes that decode media import the main module again.
if __name__ == "__main__":
    run_command()
