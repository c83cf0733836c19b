"""``python -m g5core`` is the ``g5`` command (for when the console script is not on PATH)."""
from .cli import main

main(prog_name="g5")
