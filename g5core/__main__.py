"""``python -m g5core`` is the ``g5`` command (for when the console script is not on PATH)."""
from .present.cli import main

if __name__ == "__main__":  # worker processes that re-import the main module must not run the command
    main(prog_name="g5")
