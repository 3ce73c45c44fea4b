"""``python -m mlxq.server``."""

from . import main

main()
