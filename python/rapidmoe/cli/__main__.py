"""`python -m rapidmoe.cli` runs rapidmoe-cli."""
from .app import main

main()
